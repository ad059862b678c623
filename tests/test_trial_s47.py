"""Session 47's defects, each test failing on the code before its fix."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from distributed_training import DistributedTrainer
from distributed_training.peer_watch import PeerFailureError
from distributed_training.testing import run_distributed


def _error_seen_across_restart_counts(rank, world):
    # Two torchrun agents after one node's worker failed: its agent counts a restart (1), the other a
    # membership change (0). The peer watch keyed its error records by that count, so rank 0 never saw
    # rank 1's own error and ended in gloo's "Connection closed by peer".
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), heartbeat_timeout=30)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)  # (read by the watch, started at the first step)

    def criterion(out, y):
        if rank == 1 and trainer.step == 1:
            raise ValueError("a label out of range on rank 1")
        return F.mse_loss(out, y)

    for _ in range(3):
        try:
            trainer.train_step((torch.randn(8, 4), torch.randn(8, 2)), criterion)
        except PeerFailureError as err:
            return f"peer {err.rank}: {err}"
        except ValueError as err:
            return f"own: {err}"
    return "no error"


@pytest.mark.timeout(60)
def test_a_peers_own_error_is_named_whatever_each_agents_restart_count():
    said = run_distributed(_error_seen_across_restart_counts, 2, timeout=50)
    assert said[1] == "own: a label out of range on rank 1", said
    assert said[0].startswith("peer 1:") and "a label out of range on rank 1" in said[0], said
