"""Defects found in session 31 (new users' trials and the notes left by session 30), each tested where it
was fixed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed


def parameterless_zero1_worker(rank, world):
    """ZeRO-1 over a model with no parameters at all, with an lr schedule: the optimizer is the
    factory's (over an empty placeholder), so the schedule finds its lr."""
    trainer = DistributedTrainer(
        nn.Sequential(nn.Flatten(), nn.ReLU()), lambda params: torch.optim.SGD(params, lr=0.1), strategy="zero1",
        progress=False, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    kind = type(trainer.optimizer).__name__
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    rate = trainer.optimizer.param_groups[0]["lr"]
    trainer.close()
    return kind, rate


def test_zero1_over_a_model_without_parameters_builds_the_factorys_optimizer():
    """It built a stand-in optimizer without hyperparameters: an lr schedule failed on its missing lr."""
    assert run_distributed(parameterless_zero1_worker, 2, timeout=60) == [("SGD", 0.05)] * 2


def raising_rank_worker(rank, world, strategy, stages, everyone=False):
    """The last rank's criterion raises in the second step; the others' steps wait for it in a collective.
    `everyone`: every rank raises the same RuntimeError there, rank 0 first and the others a watcher's
    period later (after adopting rank 0's record)."""
    import time

    from distributed_training.trainer import PeerFailureError

    trainer = DistributedTrainer(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), lambda params: torch.optim.SGD(params, lr=0.1),
        strategy=strategy, progress=False, pipeline_parallel_size=stages, microbatches=2 if stages > 1 else 1)

    def criterion(out, y):
        if everyone and trainer.step == 1:
            time.sleep(2.5 if rank else 0)
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied on rank {rank}")
        if rank == world - 1 and trainer.step == 1:
            raise ValueError("a label out of range on this rank")
        return torch.nn.functional.mse_loss(out, y)

    try:
        for _ in range(3):
            trainer.train_step((torch.randn(4, 8), torch.randn(4, 2)), criterion)
    except PeerFailureError as err:
        return "peer", err.rank, err.error, str(err)
    except Exception as err:
        return type(err).__name__, None, None, str(err)
    finally:
        trainer.close()
    return "trained", None, None, ""


@pytest.mark.parametrize("strategy, world, stages", [("zero3", 3, 1), ("ddp", 4, 2)])
def test_a_rank_whose_step_raises_is_named_with_its_error_by_the_peers_waiting_for_it(strategy, world, stages):
    """The peers of a rank whose own step raised failed with gloo's "Connection closed by peer" (no rank
    named) once its process ended, after waiting for the heartbeat verdict. Now the raising rank
    publishes its error and every peer inside a collective with it raises PeerFailureError naming it and
    its error (at P = 2 x DP = 2 the other pipeline's ranks too; the raising rank's own pipeline stops
    with PipelineAborted)."""
    results = run_distributed(raising_rank_worker, world, args=(strategy, stages), timeout=90)
    kind, _, _, said = results[-1]
    assert "a label out of range" in said and kind in ("ValueError", "RuntimeError"), results[-1]
    for rank, (kind, peer, error, said) in enumerate(results[:-1]):
        if kind == "PipelineAborted":  # the raising rank's pipeline partner: the pipeline's own abort
            continue
        assert kind == "peer" and peer == world - 1, (rank, kind, said)
        assert "a label out of range on this rank" in error and f"peer rank {world - 1}" in said, said
    assert sum(kind == "peer" for kind, *_ in results) >= world - 2


def test_ranks_that_raise_the_same_error_each_raise_their_own():
    """A rank that adopted a peer's published error and then raised one of its own (every rank's batch was
    bad alike) raises its own error, not the peer's."""
    results = run_distributed(raising_rank_worker, 2, args=("ddp", 1, True), timeout=90)
    assert [(kind, said) for kind, _, _, said in results] == [
        ("RuntimeError", f"mat1 and mat2 shapes cannot be multiplied on rank {rank}") for rank in range(2)], results
