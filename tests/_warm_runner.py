"""Run Python scripts one after the other, each as ``python SCRIPT`` would, in a process forked from this
one after it has imported torch and the package once (a fresh interpreter spends ~3 s importing them).

    python tests/_warm_runner.py TIMEOUT OUT_DIR SCRIPT [SCRIPT ...]

Each script runs in a child forked from here, in this process's working directory and environment, as
``__main__`` (``runpy.run_path``: ``if __name__ == "__main__":`` blocks run, and `multiprocessing` /
`run_distributed` find the script as a fresh interpreter's would), with ``sys.argv == [SCRIPT]`` and the
script's directory first on ``sys.path``. Its stdout and stderr go to ``OUT_DIR/<i>.out``; a child still
running after TIMEOUT seconds is killed with everything it started. One JSON line per script on stdout:
``{"script", "returncode", "seconds"}`` (a killed one: returncode null).

Nothing runs here but the imports: no torch op, thread or process group exists when a child is forked.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys
import time
import traceback

from distributed_training.testing import _PRELOAD, _kill_tree

# What every script imports first, loaded once here (the fork server's list: torch, torch.distributed,
# torch._dynamo, which the first optimizer imports lazily, and the package), and what the README's use.
for _name in [*_PRELOAD, "torch.nn.functional", "torch.utils.data", "distributed_training.testing"]:
    importlib.import_module(_name)


def _child(script: str, out_path: str) -> None:
    os.setpgid(0, 0)  # a group of its own: a timeout kills it and what it started, never the runner
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would
        traceback.print_exc()
        code = 1
    # As the interpreter's exit, less tearing down torch's modules (~1.5 s): atexit handlers (multiprocessing's
    # among them), then the streams flushed.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    timeout, out_dir, scripts = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for i, script in enumerate(scripts):
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(script, os.path.join(out_dir, f"{i}.out"))
        returncode = None
        while time.monotonic() - started < timeout:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                returncode = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.05)
        if returncode is None:
            _kill_tree(pid)
            os.waitpid(pid, 0)
        print(json.dumps({"script": script, "returncode": returncode,
                          "seconds": round(time.monotonic() - started, 2)}), flush=True)


if __name__ == "__main__":
    main()
