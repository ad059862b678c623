"""Defects found in session 45's trials and review, each test failing on the code before its fix."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed


def late_rank_worker(rank, world):
    from distributed_training.hangs import CollectiveTimeoutError

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    trainer.train_step(batch, F.cross_entropy)
    if rank == 1:
        time.sleep(9)  # past the collective timeout (5 s): rank 0 gives up on it, and closes the connection
    try:
        trainer.train_step(batch, F.cross_entropy)
        said = "returned"
    except CollectiveTimeoutError as err:
        said = str(err)
    if rank == 0:
        time.sleep(6)  # (alive while rank 1 finds the connection closed)
    trainer.close(barrier=False)
    return said


def test_the_rank_its_peers_gave_up_on_is_told_it_was_late():
    """A rank that spent longer than the collective timeout between two steps found its peers gone
    (they raised a timeout naming it) and got gloo's bare "Connection closed by peer"."""
    said0, said1 = run_distributed(late_rank_worker, 2, timeout=90, collective_timeout=5)
    assert "rank 1 (last seen at step 2) never reached step 2" in said0 or "missing: rank 1" in said0, said0
    assert said1.startswith("rank 1: training step 2"), said1
    assert "after this rank's previous step returned: longer than the job's collective timeout (5 s)" in said1, said1
