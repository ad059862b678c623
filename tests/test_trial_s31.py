"""Defects found in session 31 (new users' trials and the notes left by session 30), each tested where it
was fixed."""

from __future__ import annotations

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
