"""Run ``python SCRIPT`` / ``python -m MODULE`` / ``python -c CODE`` without a fresh interpreter each time.

A fresh interpreter spends ~3 s importing torch and the package (10-20 s on CI's two loaded cores). This
server imports them once; then for each job it is sent it forks a child that runs the job as the
interpreter would (``runpy`` / ``exec`` as ``__main__``, ``sys.argv`` and ``sys.path`` as the interpreter
sets them, the job's working directory and environment, PYTHONPATH's entries on the path, stdout and
stderr to files), and exits as the interpreter does (non-daemon threads joined, atexit handlers run,
streams flushed) without tearing torch's modules down. One job at a time; a job still running after its
timeout is killed with everything it started (its own process group, and every descendant).

The tests use it through `conftest.py`'s ``warm_python`` fixture (`WarmPython` below: one server per
pytest process, started on first use). What it cannot stand in for is left to fresh interpreters: jobs
that need a ``sitecustomize`` on PYTHONPATH, or that configure something before their first import of
torch or the package (here both are imported already).

Protocol: one JSON line per job on stdin ``{"argv", "cwd", "env", "timeout", "out", "err"}``, one JSON line
per job on stdout ``{"returncode"}`` (null: killed after its timeout).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

# What a fresh interpreter's job imports first (the fork server's list and then some), loaded once here.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.functional", "torch.utils.data",
           "distributed_training", "distributed_training.testing"]


def _run_child(job: dict) -> None:
    """In the forked child: run the job as the interpreter would, then exit as it does."""
    import atexit
    import runpy
    import threading
    import traceback
    import types

    os.setpgid(0, 0)  # a group of its own: a timeout kills it and what it started, never the server
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags, 0o644)  # stdin: not the server's job pipe
        os.dup2(f, fd)
        os.close(f)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    # The streams as a fresh interpreter makes them over these files: stdout block-buffered, stderr line-
    # buffered, both unbuffered under PYTHONUNBUFFERED (torchrun's jobs: output in order, none lost).
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd, errors, lines in (("stdout", 1, "strict", False), ("stderr", 2, "backslashreplace", True)):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(raw, encoding=getattr(sys, name).encoding, errors=errors, line_buffering=lines,
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    argv = job["argv"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
            sys.path[:1] = [os.getcwd(), *extra]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:1] = ["", *extra]
            main = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    # The interpreter's exit, less tearing down torch's modules (~1.5 s): non-daemon threads joined,
    # atexit handlers (multiprocessing's among them) run, the streams flushed.
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from distributed_training.testing import _kill_tree

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(job)
        deadline = time.monotonic() + job["timeout"]
        returncode = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                returncode = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.02)
        if returncode is None:
            _kill_tree(pid)
            os.waitpid(pid, 0)
        print(json.dumps({"returncode": returncode}), flush=True)


class WarmPython:
    """The client: ``warm(argv, cwd=..., env=..., timeout=...)`` runs ``python *argv`` in a fresh child of
    the server and returns a `subprocess.CompletedProcess` (stdout and stderr as text); after `timeout`
    seconds the job is killed and `subprocess.TimeoutExpired` raised, as `subprocess.run` does."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.proc: subprocess.Popen | None = None
        self.count = 0

    def _start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self._answer(300)

    def _answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"the warm Python server gave no answer within {timeout:.0f} s")
        return json.loads(line)

    def __call__(self, argv, *, cwd=None, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.count += 1
        out, err = self.work_dir / f"{self.count}.out", self.work_dir / f"{self.count}.err"
        argv = [str(a) for a in argv]
        job = {"argv": argv, "cwd": str(cwd or os.getcwd()), "env": dict(os.environ if env is None else env),
               "timeout": timeout, "out": str(out), "err": str(err)}
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            answer = self._answer(timeout + 30)  # the server kills the job at `timeout`
        except BaseException:  # pytest's own timeout, or a broken server: nothing left running
            self.close()
            raise
        stdout, stderr = out.read_text(), err.read_text()
        if answer["returncode"] is None:
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *argv], answer["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.proc is not None:
            from distributed_training.testing import _kill_tree

            if self.proc.poll() is None:
                _kill_tree(self.proc.pid)
            self.proc.wait(timeout=30)
            self.proc = None


if __name__ == "__main__":
    serve()
