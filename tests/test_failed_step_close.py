"""A rank whose step raises, under the usual ``try: trainer.fit(...) finally: trainer.close()`` (or one
that catches the error and then closes), exits at once, so that torchrun ends the job with its error.

A trial (Hugging Face GPT-2, world 3, one rank raising in its forward) hung until the collective timeout
(10 minutes by default): the failing rank's `close()` waited in the shutdown barrier while its peers
waited in the failed step's gradient all-reduce (DDP) or parameter all-gather (ZeRO-3). `with trainer:`
did not hang (its exit skips the barrier on an error); `close()` now does the same when called while an
exception propagates or after a `train_step` that raised."""

from __future__ import annotations

import pytest


SCRIPT = '''
import os, sys
import torch, torch.nn.functional as F
from torch import nn
from distributed_training import DistributedTrainer

strategy, how = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
calls = [0]

def boom(module, inputs):
    calls[0] += 1
    if rank == 1 and calls[0] == 3:
        raise RuntimeError("boom in rank 1's forward")

model.register_forward_pre_hook(boom)
trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, progress=False)
batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
if how == "finally":
    try:
        for _ in range(5):
            trainer.train_step(batch, F.cross_entropy)
    finally:
        trainer.close()
else:  # the error is caught (logged, say), and the trainer closed afterwards
    failed = None
    try:
        for _ in range(5):
            trainer.train_step(batch, F.cross_entropy)
    except RuntimeError as err:
        failed = err
    trainer.close()
    print(f"rank {rank} closed after: {failed}", flush=True)
    if failed is not None:
        sys.exit(1)
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,how", [("ddp", "finally"), ("zero3", "caught")])
def test_a_rank_whose_step_raises_closes_without_waiting_for_its_peers(tmp_path, strategy, how, warm_torchrun):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # The old code hung here until run_torchrun's timeout (the collective timeout being 10 minutes).
    result = warm_torchrun(script, [strategy, how], nproc=2, timeout=90, env={"CUDA_VISIBLE_DEVICES": ""})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "boom in rank 1's forward" in out, out[-3000:]
