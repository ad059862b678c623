"""Defects found in session 34 (the first GPU tests on 2 GPUs since session 28, and trials), each tested
where it can fail on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed


def dead_peer_after_training_worker(rank, world, directory):
    """Rank 1 ends without a word after two steps; rank 0 then calls the trainer's collectives outside a
    step, as a script does after its loop: each must name rank 1."""
    import json
    import os

    from distributed_training.peer_watch import PeerFailureError

    torch.manual_seed(0)
    trainer = DistributedTrainer(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                                 lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3", progress=False,
                                 heartbeat_timeout=1.0)
    trainer._peer_exit_after = 60.0  # (not the watcher's exit: the calls must raise)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 2))
    for _ in range(2):
        trainer.train_step((torch.randn(4, 8), torch.randn(4, 2)), torch.nn.functional.mse_loss)
    if rank == 1:
        os._exit(1)  # no goodbye: a crashed process
    said = {}
    for name, call in [("save_checkpoint", lambda: trainer.save_checkpoint(os.path.join(directory, "last"))),
                       ("evaluate", lambda: trainer.evaluate(data, torch.nn.functional.mse_loss, batch_size=4)),
                       ("full_state_dict", trainer.full_state_dict)]:
        try:
            call()
            said[name] = "returned"
        except PeerFailureError as err:
            said[name] = f"peer {err.rank}: {err}"
        except Exception as err:
            said[name] = f"{type(err).__name__}: {err}"
    trainer.close()
    with open(os.path.join(directory, "said.json"), "w") as f:
        json.dump(said, f)


def test_a_peer_dead_after_the_loop_is_named_by_save_evaluate_and_full_state_dict(tmp_path):
    """Only fit's saves and evaluations ran under the peer watch: a script's own save after its loop got
    gloo's nameless "Connection closed by peer" (on NCCL it would wait for the collective timeout)."""
    from distributed_training.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as caught:  # rank 1's os._exit: no result of its own
        run_distributed(dead_peer_after_training_worker, 2, args=(str(tmp_path),), timeout=120, grace=60)
    assert "rank 1 failed" in str(caught.value) and "rank 0" not in str(caught.value), caught.value
    said = json.loads((tmp_path / "said.json").read_text())
    for name, text in said.items():
        assert text.startswith("peer 1: "), (name, text)
