"""The public test harness (`distributed_training.testing`) and what importing the package does.

`run_distributed` is exercised by nearly every other test file; here are its failure paths and
`run_torchrun`'s: exit status and output, a failing worker, and a hang that must end with torchrun
*and* its workers killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from distributed_training.comm.patterns import hierarchical_all_reduce
from distributed_training.comm.sharded import all_gather_flat, reduce_scatter_flat
from distributed_training.testing import DistributedTestError, run_distributed, run_torchrun, start_torchrun

CPU = {"CUDA_VISIBLE_DEVICES": ""}


# ------------------------------------------------------------------ run_distributed
def ranks_worker(rank, world, offset):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank + offset, world, os.environ["RANK"], total.item()


def test_run_distributed_returns_every_ranks_result_in_rank_order():
    assert run_distributed(ranks_worker, 3, args=(10,), timeout=60) == [(10 + r, 3, str(r), 3.0) for r in range(3)]


def failing_worker(rank, world):
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that is gone: it must be reported too, not hang


def test_run_distributed_reports_the_failing_ranks_traceback():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 failed.*KeyError: 'rank one is broken'"):
        run_distributed(failing_worker, 2, timeout=60, collective_timeout=5)


def hanging_worker(rank, world):
    if rank == 0:
        time.sleep(600)


def test_run_distributed_kills_a_hung_rank_and_names_it():
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0\] did not finish within 3s"):
        run_distributed(hanging_worker, 2, timeout=3)
    assert time.monotonic() - started < 30


def test_a_function_that_cannot_travel_by_pickle_is_named_with_the_rule():
    """A nested function gave pickle's own "AttributeError: Can't pickle local object 'main.<locals>.inner'",
    which says nothing of the module-level function run_distributed needs."""
    def inner(rank, world):
        return rank

    with pytest.raises(TypeError, match=r"run_distributed: fn .*inner.* module-level function"):
        run_distributed(inner, 2, timeout=60)
    with pytest.raises(TypeError, match=r"run_distributed: fn .*lambda.* module-level function"):
        run_distributed(lambda rank, world: rank, 1, timeout=60)


# ------------------------------------------------------------------ run_torchrun
HELLO = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g}, args {sys.argv[1:]}", flush=True)
if "--fail" in sys.argv and dist.get_rank() == 1:
    sys.exit(3)
if "--hang" in sys.argv:
    with open(os.path.join(sys.argv[-1], f"pid_{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_run_torchrun_runs_a_script_on_n_processes(tmp_path, monkeypatch):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    monkeypatch.setenv("MASTER_PORT", "1")  # a launcher's variable in our environment is not inherited
    out = run_torchrun(script, ["a", "b"], nproc=3, env=CPU, timeout=120)
    assert out.returncode == 0, out.stderr
    for r in range(3):  # the ranks print at once to one stream: lines may interleave, so look for each
        assert out.stdout.count(f"rank {r} of 3: sum 6, args ['a', 'b']") == 1, out.stdout


@pytest.mark.slow
def test_run_torchrun_returns_a_failed_jobs_status_and_output(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    out = run_torchrun(script, ["--fail"], nproc=2, env=CPU, timeout=120)
    assert out.returncode != 0
    assert "rank 1 of 2" in out.stdout and "exitcode" in out.stderr, out.stderr[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by its parent) is not running either.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_hung_torchrun_job_is_killed_with_its_workers(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    with start_torchrun(script, ["--hang", str(tmp_path)], nproc=2, env=CPU) as job:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid_*"))) < 2:
            assert job.poll() is None and time.monotonic() < deadline, job.output()
            time.sleep(0.1)
        workers = [int(p.read_text()) for p in tmp_path.glob("pid_*")]
        with pytest.raises(DistributedTestError, match="did not finish within 1s"):
            job.wait(1)
        assert job.poll() is not None
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a worker outlived its torchrun"


def test_run_torchrun_refuses_to_be_given_a_rendezvous_port():
    with pytest.raises(ValueError, match="rdzv"):
        run_torchrun("x.py", launcher_args=["--rdzv-endpoint=localhost:29500"])


# ------------------------------------------------------------------ importing the package
@pytest.mark.slow
def test_importing_the_package_leaves_warning_filters_alone():
    code = textwrap.dedent("""
        import pkgutil, importlib, warnings
        # What the package imports adds filters of its own (torch's, numpy's): import them first.
        import numpy, psutil, pydantic, tqdm, yaml, torch, torch.distributed, torch.utils.tensorboard
        before = list(warnings.filters)
        import distributed_training
        for m in pkgutil.walk_packages(distributed_training.__path__, "distributed_training."):
            if m.name.endswith(("__main__", ".plot")):
                continue  # a command, and an optional matplotlib front end
            importlib.import_module(m.name)
        changed = [f for f in warnings.filters if f not in before]
        assert warnings.filters == before, changed
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def flat_collectives_worker(rank, world):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.empty(2 * world)
        all_gather_flat(out, torch.tensor([rank, rank + 0.5]), None).wait()
        shard = torch.empty(2)
        reduce_scatter_flat(shard, torch.arange(2.0 * world), None).wait()
        singles = [torch.distributed.new_group([r]) for r in range(world)]  # one node: no inter-node peer
        summed = hierarchical_all_reduce(torch.full((5,), rank + 1.0), None, singles[rank])
    return out.tolist(), shard.tolist(), summed.tolist(), [str(w.message) for w in caught]


def test_the_flat_collectives_are_right_and_warn_nothing():
    for rank, (gathered, shard, summed, warned) in enumerate(run_distributed(flat_collectives_worker, 2, timeout=60)):
        assert gathered == [0.0, 0.5, 1.0, 1.5]
        assert shard == [2.0 * rank, 2.0 * rank + 1]  # the mean of equal slices is the slice
        assert summed == [3.0] * 5
        assert warned == [], warned


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_is_told_what_to_do(tmp_path, warm_python):
    script = tmp_path / "unguarded.py"
    script.write_text("from distributed_training.testing import run_distributed\n"
                      "def f(rank, world):\n    return rank\n"
                      "print(run_distributed(f, 2, timeout=60))\n")
    out = warm_python([script], timeout=100, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode != 0
    assert "__name__ == '__main__'" in out.stderr, out.stderr[-3000:]
    assert "can only join a started process" not in out.stderr, out.stderr[-3000:]
