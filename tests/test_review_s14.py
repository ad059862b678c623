"""Review of session 14's DDP gradient path and pipeline engine, on situations no other test names.

* DDP: a gradient hook registered after wrapping runs after DDP's. For the parameter whose own hook
  launched its bucket, that hook acts on a gradient already being averaged: a replaced `.grad` used
  to stay this rank's own (unaveraged) gradient and an in-place change raced with the all-reduce,
  silently. Now it raises, naming the parameter; hooks registered before wrapping work as in torch.
* Pipeline engine: a first stage whose parameters are all frozen (its output needs no backward), a
  stage whose output is a tuple, a stage whose first layer modifies its received input in place, a
  step under ``torch.no_grad()`` or on a batch with fewer rows than microbatches (refused before any
  message, the pipeline still usable), and a rank whose receiver went away while it waited for its sends.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from distributed_training import DDP
from distributed_training.pipeline.engine import PipelineEngine
from distributed_training.testing import run_distributed

from _models import reference_step

# ------------------------------------------------------------------ DDP and the user's gradient hooks


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _replace(p):
    p.grad = p.grad * 2


def _in_place(p):
    p.grad.mul_(2)


def _hooks(model: nn.Module, hook) -> None:
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def hook_worker(rank, world):
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    out = {}
    for name, hook in (("replace", _replace), ("in_place", _in_place)):
        # Registered before wrapping: they run before DDP's hook, so the doubled gradients are averaged.
        ours_model, torch_model = _mlp(), _mlp()
        _hooks(ours_model, hook)
        _hooks(torch_model, hook)
        ours = DDP(ours_model, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
        ref = TorchDDP(torch_model, bucket_cap_mb=1e-4)
        for model in (ours, ref):
            F.mse_loss(model(x), y).backward()
        out[name + "_before"] = max((a.grad - b.grad).abs().max().item()
                                    for a, b in zip(ours.parameters(), ref.parameters()))
        # Registered after wrapping: refused, not silently unaveraged or torn.
        late = DDP(_mlp(), bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
        _hooks(late.module, hook)
        try:
            F.mse_loss(late(x), y).backward()
            out[name + "_after"] = None
        except RuntimeError as err:
            out[name + "_after"] = str(err)
        late.remove_hooks()
    return out


def test_ddp_gradient_hooks_before_wrapping_work_and_after_wrapping_raise():
    for rank, out in enumerate(run_distributed(hook_worker, 2, timeout=60)):
        for name in ("replace", "in_place"):
            assert out[name + "_before"] <= 1e-6, (rank, name, out)
            message = out[name + "_after"]
            assert message is not None, f"rank {rank}: a {name} hook after wrapping went unnoticed"
            assert "4.weight" in message and "before wrapping" in message, message


# ------------------------------------------------------------------ pipeline engine

WIDTH = 8


def _stages(frozen_first: bool = False, first_of_second=None):
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    if frozen_first:
        first.requires_grad_(False)
    second = nn.Sequential(*([first_of_second] if first_of_second is not None else []),
                           nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    return [first, second]


def _batch(step: int, rows: int = 6):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _engine(stages, rank, schedule="1f1b", microbatches=3):
    return PipelineEngine([stages[rank]], ranks=[0, 1], rank=rank, schedule=schedule, microbatches=microbatches,
                          loss_fn=F.mse_loss)


def frozen_worker(rank, world, schedule):
    stages = _stages(frozen_first=True)
    reference = nn.Sequential(*copy.deepcopy(stages))
    mine = stages[rank]
    params = [p for p in mine.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    engine = _engine(stages, rank, schedule)
    worst = 0.0
    for step in range(3):
        x, y = _batch(step)
        loss = engine.step(x, y)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        ref_loss = reference_step(reference, ref_opt, x, y, loss_fn=F.mse_loss)
        worst = max(worst, abs(loss.item() - ref_loss.item()))
        for p, q in zip(mine.parameters(), reference[rank].parameters()):
            worst = max(worst, (p - q).abs().max().item())
    return worst


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_pipeline_first_stage_with_every_parameter_frozen_trains_like_one_process(schedule):
    # Its output needs no backward; the engine used to call backward on it and fail.
    assert max(run_distributed(frozen_worker, 2, args=(schedule,), timeout=60)) <= 1e-6


class _AddsInPlace(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


def relu_inplace_worker(rank, world):
    """A stage starting with nn.ReLU(inplace=True) gets a copy of its received input: it trains as
    one process does."""
    stages = _stages(first_of_second=nn.ReLU(inplace=True))
    reference = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(stages[rank].parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    engine = _engine(stages, rank)
    worst = 0.0
    for step in range(3):
        x, y = _batch(step)
        engine.step(x, y)
        opt.step()
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(stages[rank].parameters(), reference[rank].parameters()):
            worst = max(worst, (p - q).abs().max().item())
    return worst


def test_a_stage_starting_with_an_in_place_activation_trains():
    assert max(run_distributed(relu_inplace_worker, 2, timeout=60)) <= 1e-6


class _Pair(nn.Module):
    def forward(self, x):
        return x, x


def failing_stage_worker(rank, world, case):
    if case == "tuple":
        stages = _stages()
        stages[0] = nn.Sequential(*stages[0], _Pair())
    else:  # the second stage starts by modifying its input in place, where no flag says so
        stages = _stages(first_of_second=_AddsInPlace())
    engine = _engine(stages, rank)
    try:
        engine.step(*_batch(0))
    except RuntimeError as err:
        cause = err.__cause__
        return type(err).__name__, str(err), type(cause).__name__ if cause is not None else None
    return None


def test_pipeline_stage_returning_a_tuple_is_named():
    (kind, message, cause), (other, _, _) = run_distributed(failing_stage_worker, 2, args=("tuple",), timeout=60)
    assert cause == "TypeError" and "pipeline stage 0 returned a tuple" in message, message
    assert other == "PipelineAborted"


def test_pipeline_stage_modifying_its_received_input_in_place_is_named():
    (other, _, _), (kind, message, _) = run_distributed(failing_stage_worker, 2, args=("in_place",), timeout=60)
    assert "pipeline stage 1 modifies its input in place" in message, message
    assert other == "PipelineAborted"


def refused_worker(rank, world):
    stages = _stages()
    engine = _engine(stages, rank)
    x, y = _batch(0)
    refused = []
    try:
        with torch.no_grad():
            engine.step(x, y)
    except RuntimeError as err:
        refused.append(str(err))
    # The tail of an epoch, fewer rows than microbatches: one microbatch a sample, the schedule rebuilt.
    short = engine.step(x[:2], y[:2]).item()
    interleaved = PipelineEngine([stages[rank], stages[rank]], ranks=[0, 1], rank=rank, schedule="interleaved_1f1b",
                                 microbatches=4, loss_fn=F.mse_loss)
    try:  # interleaved needs a multiple of the ranks: fewer samples than ranks refused, before any message
        interleaved.step(x[:1], y[:1])
    except ValueError as err:
        refused.append(str(err))
    # 3 samples: interleaved runs 2 microbatches (the largest multiple of the ranks), the loss the batch's
    short_interleaved = interleaved.step(x[:3], y[:3]).item()
    with torch.no_grad():
        s = _stages()
        want_interleaved = F.mse_loss(nn.Sequential(s[0], s[1], s[0], s[1])(x[:3]), y[:3]).item()
    # Refused before any message: the pipeline still runs a step afterwards (a refusal inside the
    # step used to leave abort messages behind, which failed every later step).
    with torch.no_grad():
        want_short = F.mse_loss(nn.Sequential(*_stages())(x[:2]), y[:2]).item()
    loss = engine.step(x, y)
    return (refused, short, want_short, loss.item(), F.mse_loss(nn.Sequential(*_stages())(x), y).item(),
            short_interleaved, want_interleaved)


def test_pipeline_step_under_no_grad_is_refused_a_short_batch_runs_and_the_pipeline_goes_on():
    for refused, short, want_short, loss, want, short_il, want_il in run_distributed(refused_worker, 2, timeout=60):
        assert len(refused) == 2, refused
        assert "torch.no_grad()" in refused[0], refused
        assert "a batch of 1 samples is smaller than microbatches=4" in refused[1], refused
        assert abs(short_il - want_il) <= 1e-6, (short_il, want_il)
        assert abs(short - want_short) <= 1e-6, (short, want_short)
        assert abs(loss - want) <= 1e-6


class _FailsInBackward(nn.Module):
    def forward(self, x):
        out = x * 1
        out.register_hook(self._boom)
        return out

    @staticmethod
    def _boom(grad):
        raise ValueError("boom in the first stage's backward")


def gone_receiver_worker(rank, world):
    stages = _stages()
    stages[0] = nn.Sequential(*stages[0], _FailsInBackward())
    engine = _engine(stages, rank, microbatches=2)
    try:
        engine.step(*_batch(0, rows=4))
    except RuntimeError as err:
        return type(err).__name__, str(err)
    return None


def test_pipeline_rank_whose_receiver_went_away_says_so():
    # 1F1B, P=2, 2 microbatches: rank 0 fails in its first backward, rank 1 ends the step waiting for
    # its last gradient to leave; rank 0's process then ends. Rank 1 used to report its *own* stage as
    # failed ("Connection closed by peer").
    (kind0, message0), (kind1, message1) = run_distributed(gone_receiver_worker, 2, timeout=60)
    assert "boom in the first stage's backward" in message0, message0
    assert kind1 == "PipelineAborted" and "global rank 0" in message1, message1
