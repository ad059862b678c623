"""batch_size="auto": the out-of-memory search (with a simulated OOM, so it runs on CPU), the memory-budget
estimate, agreement across ranks, training after the search, resume, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.planner import activation_bytes_per_sample, state_bytes
from distributed_training.runtime import init_distributed
from distributed_training.testing import run_distributed

from _models import MLP


class _OOMInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cap):
        ctx.cap = cap
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.cap:
            raise torch.cuda.OutOfMemoryError(f"simulated: {grad.shape[0]} > {ctx.cap}")
        return grad, None


class Capped(nn.Module):
    """An MLP that "runs out of memory" above `cap` samples, in forward or in backward."""

    def __init__(self, cap: int, where: str) -> None:
        super().__init__()
        self.net, self.cap, self.where = MLP(), cap, where

    def forward(self, x):
        if self.where == "forward" and x.shape[0] > self.cap:
            raise torch.cuda.OutOfMemoryError(f"simulated: {x.shape[0]} > {self.cap}")
        h = torch.relu(self.net.fc1(x))
        if self.where == "backward":
            h = _OOMInBackward.apply(h, self.cap)
        return self.net.fc3(torch.relu(self.net.fc2(h)))


def _data(n: int = 240) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


def probe_worker(rank, world):
    ctx = init_distributed()
    try:
        data = _data()
        # Rank 0 fails in forward above 12 samples, rank 1 in backward above 9: they must agree on 9.
        torch.manual_seed(0)
        model = Capped(12 if rank == 0 else 9, "forward" if rank == 0 else "backward")
        reference = copy.deepcopy(model)
        opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
        auto = DistributedTrainer(model, opt, gradient_accumulation_steps=2, context=ctx)
        before = [p.detach().clone() for p in auto.model.parameters()]
        chosen = auto.auto_batch_size(data, F.mse_loss, method="probe")
        untouched = all(torch.equal(a, b) for a, b in zip(before, auto.model.parameters()))
        no_grads = all(p.grad is None or not p.grad.any() for p in auto.model.parameters())
        # Training after the search must be exactly training with that batch size given by hand.
        fixed = DistributedTrainer(reference, opt, gradient_accumulation_steps=2, context=ctx)
        steps_a, steps_b = [], []
        auto.fit(data, batch_size="auto", criterion=F.mse_loss, max_steps=5, log_every=1,
                 on_step=lambda s, m: steps_a.append([p.detach().clone() for p in auto.model.parameters()]))
        fixed.fit(data, batch_size=chosen, criterion=F.mse_loss, max_steps=5, log_every=1,
                  on_step=lambda s, m: steps_b.append([p.detach().clone() for p in fixed.model.parameters()]))
        worst = max(float((a - b).abs().max()) for sa, sb in zip(steps_a, steps_b) for a, b in zip(sa, sb))
        result = (chosen, auto.batch_size_reason, untouched, no_grads, len(steps_a), len(steps_b), worst)
        auto.close()
        fixed.close()
        return result
    finally:
        ctx.shutdown()


@pytest.mark.slow
def test_probe_agrees_on_the_smallest_fit_and_training_matches():
    for chosen, reason, untouched, no_grads, na, nb, worst in run_distributed(probe_worker, 2, timeout=120):
        assert chosen == 18, reason  # micro-batch 9, times 2 accumulation steps
        assert "another rank fits only 9" in reason or "up to 9" in reason
        assert untouched and no_grads, "the search must not change parameters or leave gradients behind"
        assert na == nb == 5 and worst == 0.0


def _mlp_and_its_activations():
    """(data, model, parameter count, activation bytes per sample measured on a plain copy)."""
    torch.manual_seed(0)
    data = _data()
    model = MLP(16, 256, 4)
    per_sample = activation_bytes_per_sample(
        copy.deepcopy(model), lambda b: (data.tensors[0][:b], data.tensors[1][:b]),
        lambda m, batch: F.mse_loss(m(batch[0]), batch[1]))
    return data, model, sum(p.numel() for p in model.parameters()), per_sample


def estimate_worker(rank, world, strategy, slack):
    data, model, params, per_sample = _mlp_and_its_activations()
    fixed = state_bytes(strategy, params, world, largest_unit_params=params, param_dtype_bytes=4)
    fits = 7 if rank == 0 else 5
    budget = (fixed + (fits + slack) * per_sample) / 0.9
    trainer = DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy=strategy,
                                 memory_budget_bytes=budget)
    try:
        chosen = trainer.auto_batch_size(data, F.mse_loss)
        history = trainer.fit(data, batch_size="auto", criterion=F.mse_loss, max_steps=2)
        return chosen, trainer.batch_size_reason, trainer.step, len(history)
    finally:
        trainer.close()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_estimate_within_budget_agrees_across_ranks(strategy):
    for chosen, reason, step, _ in run_distributed(estimate_worker, 2, args=(strategy, 0.5), timeout=120):
        assert chosen == 5, reason
        assert "estimated" in reason and step == 2


def error_worker(rank, world):
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3",
                                 memory_budget_bytes=1000.0)
    errors = []
    try:
        for call in (lambda: trainer.auto_batch_size(DataLoader(_data(), batch_size=4)),
                     lambda: trainer.auto_batch_size(_data(), F.mse_loss, method="probe"),
                     lambda: trainer.auto_batch_size(_data(), F.mse_loss),
                     lambda: trainer.fit(_data(), batch_size="largest", criterion=F.mse_loss)):
            try:
                call()
                errors.append(None)
            except (TypeError, ValueError) as err:
                errors.append(str(err))
        return errors
    finally:
        trainer.close()


def test_errors_name_what_is_wrong():
    loader, probe, budget, word = run_distributed(error_worker, 2, timeout=90)[1]
    assert loader and "map-style Dataset" in loader
    assert probe and "collectives" in probe and "'zero3'" in probe  # the name the user chose
    assert budget and "rank 1" in budget and "memory_budget_bytes" in budget
    assert word and "'auto'" in word


def resume_worker(rank, world, ckpt, budget_scale):
    data, model, params, per_sample = _mlp_and_its_activations()
    budget = (state_bytes("ddp", params, world) + budget_scale * per_sample) / 0.9
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.05), memory_budget_bytes=budget,
                                 checkpoint_dir=ckpt, checkpoint_every=2)
    try:
        trainer.fit(data, batch_size="auto", criterion=F.mse_loss, max_steps=4 if budget_scale < 10 else 6)
        return trainer.batch_size, trainer.step
    finally:
        trainer.close()


def test_resumed_run_keeps_its_batch_size(tmp_path):
    first = run_distributed(resume_worker, 2, args=(str(tmp_path), 6.5), timeout=120)
    assert first[0] == (6, 4)
    # A bigger budget after the restart must not change the batch size (the data position depends on it).
    second = run_distributed(resume_worker, 2, args=(str(tmp_path), 20.5), timeout=120)
    assert second[0] == (6, 6)


def one_rank_fails_worker(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.BatchNorm1d(64), nn.Linear(64, 4))
    params = sum(p.numel() for p in model.parameters())
    # Rank 1's budget cannot hold even the model state: it fails, and rank 0 must not wait for it.
    budget = 10 * state_bytes("ddp", params, world) if rank == 0 else 1000.0
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), memory_budget_bytes=budget)
    rng = torch.get_rng_state()
    stats = trainer.module[2].running_mean.clone()
    try:
        trainer.auto_batch_size(_data(), F.mse_loss)
        error = None
    except (ValueError, RuntimeError) as err:
        error = f"{type(err).__name__}: {err}"
    untouched = torch.equal(rng, torch.get_rng_state()) and torch.equal(stats, trainer.module[2].running_mean)
    trainer.close()
    return error, untouched


def test_a_failure_on_one_rank_raises_everywhere_and_leaves_no_trace():
    (err0, untouched0), (err1, untouched1) = run_distributed(one_rank_fails_worker, 2, timeout=60)
    assert err1 and err1.startswith("ValueError") and "rank 1" in err1 and "memory_budget_bytes" in err1
    assert err0 and err0.startswith("RuntimeError") and "another rank" in err0
    assert untouched0 and untouched1, "dropout's RNG and BatchNorm statistics must be restored"
