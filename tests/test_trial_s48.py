"""Session 48's trial findings, each test failing on the code before its fix."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

import _forked_torchrun

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ torchrun's agent killed (session 47's Left)
_LONG_JOB = """
import os, sys, time
import torch, torch.nn.functional as F
from distributed_training import DistributedTrainer

out = sys.argv[1]
torch.manual_seed(0)
trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
with open(os.path.join(out, f"pid_{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
for step in range(600):
    trainer.train_step((torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss)
    time.sleep(0.1)
print("trained to the end", flush=True)
trainer.close()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_workers_whose_torchrun_agent_was_killed_end_rather_than_train_on_as_orphans(tmp_path):
    # SIGKILL to torchrun's agent (the OOM killer, a scheduler's hard kill of that one process) left its
    # workers training to the end: the store they beat into died with the agent, and the watch stopped
    # quietly, as at a normal teardown.
    script = tmp_path / "job.py"
    script.write_text(_LONG_JOB)
    job = _forked_torchrun.start(script, [str(tmp_path)], nproc=2, cwd=REPO,
                                 env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2:
            assert job.poll() is None and time.monotonic() < deadline, job.output()[-3000:]
            try:
                pids = [int((tmp_path / f"pid_{r}").read_text()) for r in range(2)]
            except (OSError, ValueError):
                time.sleep(0.1)
        time.sleep(1.0)  # a few steps in
        os.kill(job.pid, signal.SIGKILL)  # the agent alone, not its workers
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - killed < 20:
            time.sleep(0.1)
        ended = time.monotonic() - killed
        out = job.output()
        assert not any(_alive(pid) for pid in pids), f"the orphans still train after {ended:.0f} s:\n{out[-3000:]}"
        assert ended < 10, ended
        assert "the torchrun agent that started this worker" in out and "orphaned worker" in out, out[-3000:]
        assert "trained to the end" not in out, out[-3000:]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        job.close()
