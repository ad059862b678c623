"""The dynamic loss scaler: its state machine, and every rank skipping together on one rank's overflow."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from distributed_training import DistributedTrainer
from distributed_training.amp import DynamicLossScaler
from distributed_training.testing import run_distributed

from _models import MLP


def test_scaler_state_machine():
    s = DynamicLossScaler(init_scale=2.0**16, growth_interval=3, hysteresis=2, min_scale=2.0**14)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)

    def step(grad):
        p.grad = grad.clone() * s.scale
        return s.step(opt, [p.grad])

    assert step(torch.ones(3)) and s.scale == 2.0**16
    assert not step(torch.tensor([1.0, float("inf"), 1.0]))  # first overflow: skipped, hysteresis holds
    assert s.scale == 2.0**16
    assert not step(torch.tensor([float("nan"), 1.0, 1.0]))  # second in a row: back off
    assert s.scale == 2.0**15
    for _ in range(3):
        assert step(torch.ones(3))
    assert s.scale == 2.0**16  # grew after 3 clean steps
    for _ in range(6):
        step(torch.full((3,), float("inf")))
    assert s.scale == 2.0**14  # never below min_scale
    assert s.skipped_steps == 8
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale and restored.state_dict() == s.state_dict()


def test_unscale_divides_and_detects():
    s = DynamicLossScaler(init_scale=8.0)
    g = torch.tensor([8.0, 16.0])
    assert not s.unscale_([g]) and torch.equal(g, torch.tensor([1.0, 2.0]))
    assert not s.unscale_([g]) and torch.equal(g, torch.tensor([1.0, 2.0]))  # once per step only


def inf_worker(rank, world, strategy):
    torch.manual_seed(0)
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 mixed_precision="fp16", loss_scaler=DynamicLossScaler(init_scale=1024.0))
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    trainer.train_step((x, y), F.mse_loss)  # a clean step first
    before = [p.detach().clone() for p in trainer.model.parameters()]
    scale_before = trainer.loss_scaler.scale
    if rank == 1:
        # Poison one element of this rank's gradient, after synchronisation, on this rank only.
        original = trainer.loss_scaler.unscale_

        def poisoned(grads):
            grads = list(grads)
            next(g for g in grads if g is not None).view(-1)[0] = float("inf")
            return original(grads)

        trainer.loss_scaler.unscale_ = poisoned
    metrics = trainer.train_step((x, y), F.mse_loss)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    result = (unchanged, scale_before, trainer.loss_scaler.scale, trainer.loss_scaler.skipped_steps,
              float(metrics["loss_scale"]))
    trainer.close()
    return result


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_one_rank_overflow_skips_everywhere(strategy):
    for unchanged, before, after, skipped, _ in run_distributed(inf_worker, 2, args=(strategy,), timeout=90):
        assert unchanged, "parameters must not move on a skipped step, on any rank"
        assert after == before / 2 and skipped == 1


def bf16_worker(rank, world):
    torch.manual_seed(0)
    base = MLP()
    trainer = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.05), mixed_precision="bf16")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    losses = [float(trainer.train_step((x, y), F.mse_loss)["loss"]) for _ in range(20)]
    trainer.close()
    return losses


def test_bf16_autocast_trains_on_cpu():
    losses = run_distributed(bf16_worker, 2, timeout=90)[0]
    assert losses[-1] < losses[0] * 0.8, losses


def test_scaler_with_bf16_is_refused():
    with pytest.raises(ValueError, match="fp16 only"):
        DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), mixed_precision="bf16",
                           loss_scaler=DynamicLossScaler())
    with pytest.raises(ValueError, match="mixed_precision"):
        DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), mixed_precision="fp8")


def checkpointing_worker(rank, world, strategy):
    from distributed_training.models.gpt import Block

    from _models import tiny_gpt

    torch.manual_seed(0)
    base = tiny_gpt()
    plain = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy)
    recompute = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                   strategy=strategy, activation_checkpointing={Block})
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        idx = torch.randint(0, 64, (4, 16), generator=g)
        for t in (plain, recompute):
            t.train_step((idx, torch.roll(idx, -1, 1)))
        a = plain.strategy.model_state_dict(plain.model)
        b = recompute.strategy.model_state_dict(recompute.model)
        if a:
            worst = max(worst, max((a[k] - b[k]).abs().max().item() for k in a))
    for t in (plain, recompute):
        t.close()
    return worst


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_activation_checkpointing_gives_the_same_training(strategy):
    assert max(run_distributed(checkpointing_worker, 2, args=(strategy,), timeout=120)) <= 1e-6
