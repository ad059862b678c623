"""Test your own distributed code on several real processes, from pytest or any script.

Two tools, both public:

* `run_distributed(fn, world_size, args=...)` runs ``fn(rank, world_size, *args)`` on `world_size`
  processes that already share a gloo process group, and returns every rank's return value (or
  raises `DistributedTestError` with each failing rank's traceback). Fast: the processes are forked
  from a server that has imported torch and this package once (about 0.07 s for two ranks, where
  fresh interpreters take about 2 s), so a test can afford many small worlds.
* `run_torchrun(script, args, nproc=...)` runs a script (or ``module=True``: a module) under
  ``torchrun --standalone`` exactly as a user would start it, and returns its exit status and
  output; `start_torchrun` does the same in the background, for a test that signals the job while
  it runs. Slower (fresh interpreters), but it covers what `run_distributed` cannot: torchrun's
  rendezvous, the ``env://`` process group, ``--max-restarts``, signal forwarding.

Both are race-free and cannot hang a test suite: `run_distributed` rendezvouses through a
``file://`` store in a fresh temporary directory and torchrun ``--standalone`` binds its store to
port 0 (the OS picks a free port and hands it to the workers), so no port is ever chosen first and
bound later, where a parallel test could take it in between; both kill what they started (for
torchrun: torchrun, its workers and theirs) when `timeout` seconds pass, and fail.

How `run_distributed` runs a rank: the child

* sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and the caller's
  current environment (plus `env`, and OMP_NUM_THREADS=1: several ranks share the CPU),
* joins a process group (gloo by default) through the ``file://`` store,
* runs ``fn(rank, world_size, *args)`` and sends back its return value (pickled) or its traceback,
* destroys its process group in ``finally``.

The parent waits until every rank has answered or `timeout` seconds have passed. A hang is a
failure: stragglers are killed and the error names them. `fn`, its arguments and its return value
travel by pickle, so `fn` must be a module-level function of an importable module; in a script,
put the call under ``if __name__ == "__main__":`` (each rank imports the script as a module).
"""

from __future__ import annotations

import multiprocessing as mp
import json
import os
import pickle
import queue as queue_module
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["run_distributed", "run_torchrun", "start_torchrun", "TorchrunJob", "DistributedTestError", "write_record",
           "read_records"]

# What a launcher sets in its workers: never inherited by a job started from inside one.
# What the fork server imports once, so that each rank forked from it starts with it loaded: torch,
# this package, and torch._dynamo, which the first optimizer a rank builds imports lazily (about 1.5 s
# of every multi-process test otherwise).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distributed_training"]

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


class DistributedTestError(AssertionError):
    """One or more ranks failed, hung, or died; or a torchrun job did not end in time.

    An `AssertionError`, so that pytest reports it as a test failure; its message holds every
    failing rank's traceback (or the job's output)."""


def _child(fn, rank, world_size, args, store_path, backend, collective_timeout, result_queue, env):
    # The fork server's environment is the parent's at the time the server started: take the caller's
    # current one instead, as a freshly spawned process would have.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        if backend == "gloo" and world_size > 1:
            # gloo's full mesh can be complete on some ranks before others: a rank that went on and exited
            # (a test whose ranks all raise at once) would break a slower rank's connecting with "Connection
            # closed by peer". Everyone connected first.
            dist.barrier()
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # not after an abort (a dead peer on NCCL: `peer_watch`)
                dist.destroy_process_group()
        result_queue.put((rank, True, pickle.dumps(value)))
    except BaseException:
        result_queue.put((rank, False, traceback.format_exc()))


def _check_picklable(fn: Callable[..., Any]) -> None:
    """`fn` travels to the ranks by pickle: one that cannot is a TypeError naming it and the rule (pickle's own
    error names a ``<locals>`` path or a failed attribute lookup)."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(fn)
    except RuntimeError:  # e.g. a partial holding a Queue, which pickles only while a process starts: leave it to that
        return
    except (pickle.PicklingError, AttributeError, TypeError) as err:  # lambdas, nested functions, local classes
        raise TypeError(f"run_distributed: fn {getattr(fn, '__qualname__', fn)!r} cannot be pickled to the ranks "
                        f"({type(err).__name__}: {err}): it must be a module-level function of an importable "
                        "module (not a lambda, a nested function or a local class's method)") from None


def _silent_exit(code: int) -> str:
    """What a rank that ended with exit status `code` without reporting a result or an error says."""
    from .peer_watch import EXIT_CODE

    if code == EXIT_CODE:
        return (f"process exited with code {code} (the peer watch's: a peer had failed, and this rank, stuck "
                "waiting for it, was ended, or the peers' collectives timed out waiting for this rank, stuck in its "
                "own code: its log says where)")
    return (f"process exited with code {code} without reporting (a script that calls run_distributed at module "
            "level must do it under `if __name__ == '__main__':`: each rank imports the main module)")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    collective_timeout: float | None = None,
    env: dict[str, str] | None = None,
    grace: float = 10.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `world_size` processes; return each rank's result.

    Args:
        fn: a module-level function (it travels by pickle); it runs with the process group already
            initialised, and its return value (picklable) comes back in the list.
        world_size: how many processes (ranks), each with RANK / WORLD_SIZE / LOCAL_RANK set.
        args: more positional arguments for `fn` (picklable), the same on every rank.
        timeout: seconds for the whole job before it counts as hung: then every rank still running
            is killed and `DistributedTestError` names them.
        backend: the process group's backend (``"gloo"``, CPU; ``"nccl"`` needs one GPU a rank).
        collective_timeout: the process group's own timeout, after which a collective that waits
            for a rank raises in `fn` (default: `timeout`).
        env: extra environment variables for the ranks.
        grace: seconds the other ranks still get once one has failed (see Raises).

    The ranks are daemonic processes (they end with the caller), which Python forbids to have children
    of their own: a DataLoader with ``num_workers > 0`` cannot start its workers there. Run such code
    as a script under `run_torchrun`.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died, or did not
            finish within `timeout`. When one rank fails, the others get 10 more seconds to fail
            too (a peer waiting in a collective), so that every traceback is reported.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_picklable(fn)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no-op once started
    result_queue = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="dt-test-")
    store_path = os.path.join(tmpdir, "store")
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, tuple(args), store_path, backend,
                  collective_timeout or timeout, result_queue, child_env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        grace_deadline = None
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            try:
                rank, ok, payload = result_queue.get(timeout=min(0.5, limit - now))
            except queue_module.Empty:
                for rank, p in enumerate(procs):
                    if rank not in results and rank not in failures and not p.is_alive() and p.exitcode not in (0, None):
                        failures[rank] = _silent_exit(p.exitcode)
                if failures and grace_deadline is None:
                    grace_deadline = time.monotonic() + grace
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                if grace_deadline is None:
                    # Peers of a failed rank may be stuck in a collective: give them a moment to fail too.
                    grace_deadline = time.monotonic() + grace
    finally:
        started = [p for p in procs if p.pid is not None]  # start() may have failed part-way
        for rank, p in enumerate(procs):
            # A rank that answered gets 5 s to exit by itself; one that never did (hung: the timeout or the
            # grace ran out, or an error here) is killed now, without waiting for it.
            if p.pid is not None and (rank in results or rank in failures):
                p.join(timeout=5)
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        result_queue.close()
        shutil.rmtree(tmpdir, ignore_errors=True)

    missing = [r for r in range(world_size) if r not in results and r not in failures]
    if failures or missing:
        parts = [f"--- rank {r} failed ---\n{failures[r]}" for r in sorted(failures)]
        if missing:
            parts.append(f"--- rank(s) {missing} did not finish within {timeout:.0f}s (killed) ---")
        raise DistributedTestError("\n".join(parts))
    return [results[r] for r in range(world_size)]


# ------------------------------------------------------------------ torchrun
class TorchrunJob:
    """A ``torchrun --standalone`` job running in the background; made by `start_torchrun`.

    torchrun runs in a session (process group) of its own; `kill` and a timeout in `wait` end it,
    its workers (each in a session of its own) and their children, and `signal` reaches torchrun alone (it forwards SIGTERM, SIGINT and
    SIGHUP to its workers, as it does when a scheduler stops a job). stdout and stderr go to files,
    so a chatty job never blocks on a full pipe and `output()` can be read while it runs.

    Use it as a context manager: leaving the block kills a job still running and removes its
    output files.

    Attributes:
        args: the command line.
        proc: the `subprocess.Popen` of torchrun itself.
    """

    def __init__(self, args: list[str], *, env: Mapping[str, str], cwd: str | os.PathLike | None) -> None:
        self.args = args
        self._dir = tempfile.mkdtemp(prefix="dt-torchrun-")
        self._out_path = os.path.join(self._dir, "stdout")
        self._err_path = os.path.join(self._dir, "stderr")
        with open(self._out_path, "wb") as out, open(self._err_path, "wb") as err:
            self.proc = subprocess.Popen(args, cwd=cwd, env=dict(env), stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        """torchrun's process id, which is also its process group's id."""
        return self.proc.pid

    def poll(self) -> int | None:
        """torchrun's exit status, or None while it runs."""
        return self.proc.poll()

    def stdout(self) -> str:
        """What the job has written to stdout so far."""
        return Path(self._out_path).read_text(errors="replace") if os.path.exists(self._out_path) else ""

    def stderr(self) -> str:
        """What the job has written to stderr so far (torchrun's own messages are there)."""
        return Path(self._err_path).read_text(errors="replace") if os.path.exists(self._err_path) else ""

    def output(self) -> str:
        """stdout, then stderr, so far."""
        return self.stdout() + self.stderr()

    def signal(self, sig: int, *, group: bool = False) -> None:
        """Send `sig` to torchrun, which forwards SIGTERM / SIGINT / SIGHUP to its workers; with
        ``group=True`` to torchrun's process group, as Ctrl-C in a terminal does."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL torchrun, its workers and theirs (data loader workers, ...), and reap torchrun."""
        if self.proc.poll() is None:
            _kill_tree(self.proc.pid)
        self.proc.wait()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the job to end; return its ``returncode``, ``stdout`` and ``stderr``.

        Raises:
            DistributedTestError: it did not end within `timeout` seconds; it has been killed, with
                its workers, and the message holds the end of its output.
        """
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DistributedTestError(
                f"{' '.join(self.args)} did not finish within {timeout:g}s (killed, workers included)\n"
                f"--- stdout ---\n{self.stdout()[-4000:]}\n--- stderr ---\n{self.stderr()[-4000:]}"
            ) from None
        return subprocess.CompletedProcess(self.args, self.proc.returncode, self.stdout(), self.stderr())

    def close(self) -> None:
        """Kill the job if it still runs; remove its output files."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "TorchrunJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kill_tree(pid: int) -> None:
    """SIGKILL process `pid`'s process group and every process descended from it.

    torchrun starts each worker in a session of its own (so that it can kill a worker's group), so
    killing torchrun's group alone would leave the workers running, orphaned. torchrun is stopped
    first, so that it starts no worker while its tree is walked; then every group found is killed.
    """
    import psutil

    try:
        os.killpg(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    groups = {pid}
    for child in descendants:
        try:
            groups.add(os.getpgid(child.pid))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())  # never our own
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _torchrun_env(env: Mapping[str, str] | None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    base.setdefault("OMP_NUM_THREADS", "1")
    # Output in the order it was printed, and none lost when a rank is killed. The ranks share one
    # output stream and torchrun's workers write through (a print() is two writes: the text, then the
    # newline), so lines of two ranks printing at once can interleave: look for what a rank printed, do
    # not expect whole lines in order.
    base["PYTHONUNBUFFERED"] = "1"
    base.update(env or {})
    return base


def start_torchrun(
    target: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    module: bool = False,
    launcher_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> TorchrunJob:
    """Start ``torchrun --standalone --nproc-per-node=NPROC [launcher_args] TARGET [args]`` in the
    background and return its `TorchrunJob`; see `run_torchrun` for the arguments."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    for flag in launcher_args:
        if str(flag).split("=")[0].replace("_", "-") in ("--rdzv-endpoint", "--master-port", "--nproc-per-node"):
            raise ValueError(f"launcher_args: {flag!r} is the harness's to choose (the rendezvous is --standalone, "
                             "on a free port; the number of processes is nproc=)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *map(str, launcher_args), *(["-m"] if module else []), os.fspath(target), *map(str, args)]
    return TorchrunJob(cmd, env=_torchrun_env(env), cwd=cwd)


def run_torchrun(
    target: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    module: bool = False,
    launcher_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess:
    """Run a script (or a module) under ``torchrun --standalone`` on `nproc` processes and wait.

    The rendezvous is torchrun's ``--standalone``: its store binds port 0 and the workers are told
    the port the OS gave it, so parallel jobs never race for a port.

    Args:
        target: the script's path, or with ``module=True`` a module name (``python -m`` style).
        args: the script's own arguments.
        nproc: processes (ranks) on this machine.
        launcher_args: more torchrun options, before the script (``["--max-restarts=2"]``).
        env: environment variables on top of this process's environment, from which any launcher's
            variables (RANK, MASTER_PORT, ...) are removed; OMP_NUM_THREADS defaults to 1 and
            PYTHONUNBUFFERED is set. On a GPU machine, ``{"CUDA_VISIBLE_DEVICES": ""}`` keeps a CPU
            test on the CPU.
        cwd: the working directory (default: this process's).
        timeout: seconds before the job counts as hung: then torchrun and all its workers are
            killed and `DistributedTestError` is raised with the end of their output.

    Returns:
        A `subprocess.CompletedProcess` with ``returncode`` (torchrun's: 0 when every worker
        succeeded), ``stdout`` and ``stderr`` (text). A failed job is returned, not raised: check
        ``returncode`` (torchrun's summary of the failure is at the end of ``stderr``).
    """
    with start_torchrun(target, args, nproc=nproc, module=module, launcher_args=launcher_args, env=env,
                        cwd=cwd) as job:
        return job.wait(timeout)


def write_record(directory: str, rank: int, **fields: Any) -> None:
    """Write this rank's `fields` as ``rank<rank>.json`` in `directory` (what a rank reports when it may
    not live to return a value: a test that kills a peer reads them with `read_records`)."""
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(fields, f)


def read_records(directory: str) -> dict[int, dict[str, Any]]:
    """The records `write_record` left in `directory`, by rank."""
    out = {}
    for name in os.listdir(directory):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out[int(name[4:-5])] = json.load(f)
    return out
