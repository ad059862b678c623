"""A torchrun launcher started in the background without a fresh interpreter: `ForkedTorchrunJob`.

`distributed_training.testing.start_torchrun` runs ``python -m torch.distributed.run ...`` as a fresh
interpreter, which first spends seconds importing torch (~2 s on an idle core, 5-10 s on CI's two loaded
ones) before it starts its workers. Here the launcher is forked from `run_distributed`'s fork server
(torch and the package already imported) and runs ``torch.distributed.run`` as ``__main__`` with the
job's argv, working directory and environment, stdout and stderr to files, in a session of its own (as
``start_torchrun``'s ``start_new_session=True``). It is torchrun all the same: its agent, its rendezvous,
its signal handling and forwarding, its restarts; and its workers are torchrun's own fresh interpreters,
as a user's. Only the launcher's imports are skipped: use `start_torchrun` where the launcher's own
start is what a test is about (the tests of `run_torchrun` itself).

`ForkedTorchrunJob` is a `TorchrunJob` (``signal``, ``kill`` with its workers, ``wait`` with a timeout,
``output``, ``close``); `start(target, args, nproc=...)` is `start_torchrun`'s equivalent, and `agent(args)`
starts a launcher from a full torchrun command line (``[python, "-m", "torch.distributed.run", ...]``).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

from distributed_training.testing import TorchrunJob, _PRELOAD, _torchrun_env

# The launcher's own imports on top of the fork server's: loaded once there, not in every launcher.
_LAUNCHER_PRELOAD = [*_PRELOAD, "torch.distributed.run"]


def _launch(argv: list[str], cwd: str | None, env: dict[str, str], out: str, err: str, started) -> None:
    """(In the forked child) become torchrun: a session of its own, the job's streams, directory and
    environment, then ``torch.distributed.run`` as ``__main__``; its exit status is the process's."""
    import runpy

    os.setsid()  # before anyone can signal or kill it: its group is the session's (see ForkedTorchrunJob)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    for name, fd in (("stdout", 1), ("stderr", 2)):  # unbuffered, as PYTHONUNBUFFERED makes a fresh one's
        stream = io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    started.set()
    sys.argv = ["torch.distributed.run", *argv]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


class _Process:
    """The part of `subprocess.Popen` that `TorchrunJob` uses, over a `multiprocessing.Process`."""

    def __init__(self, process: mp.Process, args: list[str]) -> None:
        self._process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)


class ForkedTorchrunJob(TorchrunJob):
    """A `TorchrunJob` whose launcher is forked from the warm fork server (see the module's doc)."""

    def __init__(self, args: list[str], *, env: Mapping[str, str], cwd: str | os.PathLike | None) -> None:
        if args[:3] != [sys.executable, "-m", "torch.distributed.run"]:
            raise ValueError(f"not a torchrun command line: {args[:3]}")
        self.args = args
        self._dir = tempfile.mkdtemp(prefix="dt-torchrun-")
        self._out_path = os.path.join(self._dir, "stdout")
        self._err_path = os.path.join(self._dir, "stderr")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_LAUNCHER_PRELOAD)  # a no-op once run_distributed has started the server
        started = ctx.Event()
        process = ctx.Process(target=_launch, args=(list(map(str, args[3:])), None if cwd is None else os.fspath(cwd),
                                                    dict(env), self._out_path, self._err_path, started),
                              daemon=False, name="torchrun")
        process.start()
        self.proc = _Process(process, args)
        # In its own session before it is handed out: `kill` (a process group) must find it there.
        deadline = time.monotonic() + 60
        while not started.wait(0.05):
            if process.exitcode is not None or time.monotonic() > deadline:
                process.kill()
                process.join(5)
                shutil.rmtree(self._dir, ignore_errors=True)
                raise RuntimeError(f"the forked torchrun launcher did not start (exit code {process.exitcode})")


def start(target: str | os.PathLike, args: Sequence[str] = (), *, nproc: int = 2,
          launcher_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike | None = None) -> ForkedTorchrunJob:
    """`start_torchrun`'s ``torchrun --standalone --nproc-per-node=NPROC [launcher_args] TARGET [args]``,
    with the launcher forked (its environment: `start_torchrun`'s)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *map(str, launcher_args), os.fspath(target), *map(str, args)]
    return ForkedTorchrunJob(cmd, env=_torchrun_env(env), cwd=cwd)

