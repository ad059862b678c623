"""The order in which CI's two pytest workers (`-n 2 --dist loadfile`) are handed the test files.

xdist hands out whole files, by default those with the most tests first: the long files of few tests (the
benchmark suite's smoke run, the README's snippets, the elastic scenarios) came last, and one worker could
still be in one of them a minute after the other had finished. Here the files go out longest first, by
their seconds on 2 CPU cores in `durations.json` (a file not listed there goes first: it may be long), so
that the last ones are short and the workers end together. The order only decides who runs what when;
every test runs as before, and a run without workers keeps pytest's own order.

After tests were added or changed a lot, rewrite `durations.json` from a run as CI's:
``DT_WRITE_DURATIONS=1 python -m pytest -q -n 2 --dist loadfile``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


_seconds: dict[str, float] = defaultdict(float)  # per file, as this run measures them


def _durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def pytest_configure(config):
    # On the controller: take the files in collection order (the order below), not by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        _compile_sources()


def _compile_sources() -> None:
    """Write the package's and the tests' bytecode once, before any test starts a process.

    The suite starts hundreds of fresh interpreters (torchrun's workers, dtrain, the jobs in tests/jobs),
    each importing the package from this checkout. Where ``PYTHONDONTWRITEBYTECODE`` is set (as on CI's
    machines) none of them writes its bytecode, so each compiled all ~13,000 lines again: about a second of
    CPU per process on 2 cores. Reading bytecode is not affected by that setting."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in ("distributed_training", "tests"):
        compileall.compile_dir(str(root / folder), quiet=1, workers=1)


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: pytest's order
    seconds = _durations()
    # A stable sort: each file's tests stay together and in order, files of equal seconds in pytest's order.
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], float("inf")))


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::", 1)[0]] += report.duration  # setup, call and teardown


def pytest_sessionfinish(session):
    # On the controller (it sees every worker's reports), when asked to.
    if os.environ.get("DT_WRITE_DURATIONS") and not hasattr(session.config, "workerinput") and _seconds:
        ordered = sorted(((f, round(s)) for f, s in _seconds.items()), key=lambda kv: (-kv[1], kv[0]))
        DURATIONS.write_text(json.dumps(dict(ordered), indent=1) + "\n")


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory):
    """``warm_python(argv, cwd=, env=, timeout=)``: ``python *argv`` as `subprocess.run` with
    ``capture_output=True, text=True`` would run it, in a process forked from a server that imported torch
    and the package once (`_warm_runner.py`), not a fresh interpreter (~3 s of imports, far more on loaded
    cores). One server per pytest process, started on first use, killed with its jobs at the end."""
    from _warm_runner import WarmPython

    warm = WarmPython(tmp_path_factory.mktemp("warm_python"))
    yield warm
    warm.close()


@pytest.fixture
def warm_torchrun(warm_python):
    """`distributed_training.testing.run_torchrun`'s command and environment (``torchrun --standalone
    --nproc-per-node=N ...``, launcher variables removed, OMP_NUM_THREADS=1, PYTHONUNBUFFERED), with the
    launcher forked from the warm_python fixture's server rather than a fresh interpreter; its workers are
    torchrun's own fresh processes, as a user's. Returns a `subprocess.CompletedProcess`; a job past its
    timeout is killed with its workers and `subprocess.TimeoutExpired` raised. The tests of run_torchrun
    itself (test_testing.py) use run_torchrun."""
    from distributed_training.testing import _torchrun_env

    def run(target, args=(), *, nproc=2, module=False, launcher_args=(), env=None, cwd=None, timeout=300.0):
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *map(str, launcher_args),
               *(["-m"] if module else []), os.fspath(target), *map(str, args)]
        return warm_python(cmd, cwd=cwd, env=_torchrun_env(env), timeout=timeout)

    return run
