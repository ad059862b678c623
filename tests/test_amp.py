"""Precision: the dynamic loss scaler's state machine, the precision objects against torch's own autocast
and `torch.amp.GradScaler`, the fp16 trainer under DDP against one process, and every rank skipping
together on one rank's overflow."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DDPStrategy, DistributedTrainer
from distributed_training.amp import BF16Precision, DynamicLossScaler, FP16Precision, Precision, make_precision
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
    restored = DynamicLossScaler(growth_interval=3, hysteresis=2, min_scale=2.0**14)
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale and restored.state_dict() == s.state_dict()
    assert restored.changed_settings(s.state_dict()) == []
    other = DynamicLossScaler(growth_interval=2000, hysteresis=3)
    assert other.changed_settings(s.state_dict()) == ["loss_scaler.growth_interval: 3 -> 2000",
                                                      "loss_scaler.min_scale: 16384.0 -> 1.0",
                                                      "loss_scaler.hysteresis: 2 -> 3"]


def test_hysteresis_counts_overflows_between_clean_steps():
    # Overflow, clean, overflow, ...: each clean step gave the tolerance back, so with hysteresis 2 the scale
    # never backed off while half the steps were skipped (trial E). As Megatron-LM's and DeepSpeed's default:
    # the count starts again when the scale changes.
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scales = []
    for k in range(10):
        p.grad = torch.full((3,), float("inf") if k % 2 == 0 else 1.0)
        s.step(opt, [p.grad])
        scales.append(s.scale)
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0, 256.0, 256.0, 256.0, 256.0]
    assert s.skipped_steps == 5
    grown = DynamicLossScaler(init_scale=8.0, growth_interval=1, hysteresis=2)
    for grad in (float("inf"), 1.0):  # one overflow tolerated, then a growth: the count starts again
        p.grad = torch.full((3,), grad)
        grown.step(opt, [p.grad])
    p.grad = torch.full((3,), float("inf"))
    grown.step(opt, [p.grad])
    assert grown.scale == 16.0


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


class NormBlock(nn.Module):
    """A block with BatchNorm: its recompute must not update the running statistics a second time."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.relu(self.norm(self.linear(x)))


def checkpointing_worker(rank, world, strategy, kind="gpt"):
    from distributed_training.models.gpt import Block

    from _models import tiny_gpt

    torch.manual_seed(0)
    base = tiny_gpt() if kind == "gpt" else nn.Sequential(NormBlock(), NormBlock(), nn.Linear(8, 3))
    plain = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy)
    recompute = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                   strategy=strategy, activation_checkpointing={Block, NormBlock})
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        if kind == "gpt":
            idx = torch.randint(0, 64, (4, 16), generator=g)
            batch, criterion = (idx, torch.roll(idx, -1, 1)), None
        else:
            batch, criterion = (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)), F.cross_entropy
        for t in (plain, recompute):
            t.train_step(batch, criterion)
        a = plain.strategy.model_state_dict(plain.model)
        b = recompute.strategy.model_state_dict(recompute.model)
        if a:
            worst = max(worst, max((a[k] - b[k]).abs().max().item() for k in a))
    for t in (plain, recompute):
        t.close()
    return worst


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("kind", ["gpt", "batchnorm"])
def test_activation_checkpointing_gives_the_same_training(strategy, kind):
    """Parameters and buffers: with BatchNorm the recompute updated the running statistics a second time
    (num_batches_tracked 4 against 2 after two steps, in a trial on timm's resnet18)."""
    assert max(run_distributed(checkpointing_worker, 2, args=(strategy, kind), timeout=120)) <= 1e-6


# ------------------------------------------------ precision objects against torch's autocast and GradScaler
def _batches(steps, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)) for _ in range(steps)]


def _poison(model):
    """An inf in one (scaled) gradient element, as an fp16 overflow in backward would leave."""
    model.fc2.weight.grad.view(-1)[3] = float("inf")


def test_fp16_precision_matches_torch_grad_scaler():
    """Our fp16 object (through the strategy's default step: unscale, clip, step) against torch's own
    recipe, parameters bit for bit after every step; step 3 has an inf both must skip, and the scale
    must back off and grow at the same steps."""
    torch.manual_seed(0)
    ours, ref = MLP(), MLP()
    ref.load_state_dict(ours.state_dict())
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    precision = FP16Precision("cpu", DynamicLossScaler(init_scale=2.0**10, growth_interval=2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    strategy, clip = DDPStrategy(), 0.5  # only the base class's backward / optimizer_step run: no wrapper
    scales, clipped = [], False
    for step, (x, y) in enumerate(_batches(8)):
        with precision.autocast():
            loss = F.mse_loss(ours(x), y)
        assert ours(x).dtype == torch.float32 and loss.dtype == torch.float32
        strategy.backward(ours, loss, precision)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = F.mse_loss(ref(x), y)
        scaler.scale(ref_loss).backward()
        if step == 3:
            _poison(ours)
            _poison(ref)
        before = [p.detach().clone() for p in ours.parameters()]
        stepped, norm = strategy.optimizer_step(ours, opt, precision, clip)
        scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        scaler.step(ref_opt)
        scaler.update()
        assert stepped == (step != 3)
        if step == 3:
            assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters())), "an overflow must skip"
        else:
            assert torch.equal(norm, ref_norm)
            clipped |= float(ref_norm) > clip
        for name, a in ours.state_dict().items():
            assert torch.equal(a, ref.state_dict()[name]), f"step {step}: {name} differs from GradScaler's"
        assert precision.scaler.scale == scaler.get_scale(), step
        scales.append(precision.scaler.scale)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert clipped, "the threshold must actually clip"
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**12], scales
    assert precision.scaler.skipped_steps == 1


@pytest.mark.parametrize("precision, dtype", [(BF16Precision("cpu"), torch.bfloat16), (Precision("cpu"), None)])
def test_precision_without_scaler_matches_plain_autocast(precision, dtype):
    torch.manual_seed(0)
    ours, ref = MLP(), MLP()
    ref.load_state_dict(ours.state_dict())
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    strategy = DDPStrategy()
    for step, (x, y) in enumerate(_batches(5)):
        with precision.autocast():
            out = ours(x)
            loss = F.mse_loss(out, y)
        assert out.dtype == (dtype or torch.float32)
        strategy.backward(ours, loss, precision)
        assert strategy.optimizer_step(ours, opt, precision, 1.0)[0]
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        for a, b in zip(ours.parameters(), ref.parameters()):
            assert torch.equal(a, b), step
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert precision.state_dict() == {} and precision.scaler is None and precision.metrics() == {}


def test_make_precision_and_scaler_state():
    assert type(make_precision(None, "cpu")) is Precision and make_precision("fp32", "cpu").name == "fp32"
    assert isinstance(make_precision("bf16", "cpu"), BF16Precision)
    scaler = DynamicLossScaler(init_scale=64.0)
    fp16 = make_precision("fp16", "cpu", loss_scaler=scaler)
    assert fp16.scaler is scaler and float(fp16.metrics()["loss_scale"]) == 64.0
    # The checkpoint's "loss_scaler" entry is the scaler's own state dict, as before the precision
    # objects: an old checkpoint loads, and one without a scaler (None) leaves the scaler as it is.
    old = DynamicLossScaler(init_scale=8.0).state_dict()
    fp16.load_state_dict(old)
    assert fp16.state_dict() == old and scaler.scale == 8.0
    fp16.load_state_dict(None)
    assert scaler.scale == 8.0
    with pytest.raises(ValueError, match="fp16 only"):
        make_precision("bf16", "cpu", loss_scaler=DynamicLossScaler())
    with pytest.raises(TypeError, match="DynamicLossScaler"):
        make_precision("fp16", "cpu", loss_scaler=torch.amp.GradScaler("cpu"))


def _grad_scaler_step(scaler, loss, model, optimizer, clip):
    """torch's reference recipe: scale, backward, unscale, clip, step (or skip), update, zero."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def trainer_vs_autocast_worker(rank, world, mode):
    """World 1: the trainer's step against torch's autocast (and GradScaler for fp16) by hand."""
    torch.manual_seed(0)
    base = MLP()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    scaler_kw = {"loss_scaler": DynamicLossScaler(init_scale=2.0**10, growth_interval=2)} if mode == "fp16" else {}
    trainer = DistributedTrainer(copy.deepcopy(base), sgd, mixed_precision=mode, gradient_clip_val=0.5, **scaler_kw)
    ref = copy.deepcopy(base)
    ref_opt = sgd(ref.parameters())
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, enabled=mode == "fp16")
    exact = []
    for x, y in _batches(5):
        metrics = trainer.train_step((x, y), F.mse_loss)
        with torch.autocast("cpu", dtype=dtype):
            ref_loss = F.mse_loss(ref(x), y)
        _grad_scaler_step(scaler, ref_loss, ref, ref_opt, clip=0.5)
        exact.append(torch.equal(metrics["loss"], ref_loss.detach().float())
                     and all(torch.equal(a, b) for a, b in zip(trainer.module.parameters(), ref.parameters())))
    trainer.close()
    return exact


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_trainer_step_equals_torch_autocast(mode):
    exact = run_distributed(trainer_vs_autocast_worker, 1, args=(mode,), timeout=90)[0]
    assert all(exact), exact


def fp16_parity_worker(rank, world, strategy, accumulation):
    """Each rank trains on its half of a batch; a reference trains on the whole batch in one process
    with torch's autocast and GradScaler. At step 2 one sample of rank 1's half is beyond fp16's range,
    so its forward overflows on rank 1 only (and in the reference): every rank must skip that step."""
    torch.manual_seed(0)
    base = MLP()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    trainer = DistributedTrainer(copy.deepcopy(base), sgd, strategy=strategy, mixed_precision="fp16",
                                 gradient_accumulation_steps=accumulation, gradient_clip_val=0.5,
                                 loss_scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=2))
    ref = copy.deepcopy(base)
    ref_opt = sgd(ref.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    per_rank = 4
    worst, scales, skipped = 0.0, [], []
    for step, (x, y) in enumerate(_batches(6, n=per_rank * world, seed=1)):
        if step == 2:
            x[per_rank + 1, 0] = 1e6  # rank 1's second sample: inf once cast to fp16
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        metrics = trainer.train_step((x[sl], y[sl]), F.mse_loss)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = F.mse_loss(ref(x), y)
        _grad_scaler_step(scaler, ref_loss, ref, ref_opt, clip=0.5)
        full = trainer.strategy.model_state_dict(trainer.model)  # every rank calls it: FSDP gathers to rank 0
        if full or rank == 0:
            worst = max(worst, max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()))
        scales.append((float(metrics["loss_scale"]), trainer.loss_scaler.scale, scaler.get_scale()))
        skipped.append(trainer.loss_scaler.skipped_steps)
    trainer.close()
    return worst, scales, skipped


@pytest.mark.parametrize("strategy, accumulation", [("ddp", 1), ("ddp", 2), ("zero3", 1)])
def test_fp16_trainer_at_world_2_equals_one_process(strategy, accumulation):
    for worst, scales, skipped in run_distributed(fp16_parity_worker, 2, args=(strategy, accumulation), timeout=120):
        # fp16 rounds half-batch products differently from whole-batch ones; with the scale forgotten
        # before clipping (or the skip not taken) the parameters differ by whole units instead.
        assert worst <= 2e-4, worst
        assert [ours for _, ours, _ in scales] == [ref for _, _, ref in scales], scales
        assert skipped == [0, 0, 1, 1, 1, 1], skipped
        assert [used for used, _, _ in scales] == [2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11], scales


def scaler_checkpoint_worker(rank, world, path):
    """The fp16 scaler's state goes through a checkpoint (meta's "loss_scaler" entry) and training goes
    on as if unbroken; a bf16 trainer reads the same checkpoint and ignores the entry."""
    torch.manual_seed(0)
    base = MLP()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731

    def fp16_trainer():
        return DistributedTrainer(copy.deepcopy(base), sgd, mixed_precision="fp16",
                                  loss_scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=3))

    batches = _batches(6, n=4, seed=rank)
    unbroken, first = fp16_trainer(), fp16_trainer()
    for x, y in batches[:4]:
        unbroken.train_step((x, y), F.mse_loss)
        first.train_step((x, y), F.mse_loss)
    first.save_checkpoint(path)
    saved = first.loss_scaler.state_dict()
    resumed = fp16_trainer()
    resumed.load_checkpoint(path)
    restored = resumed.loss_scaler.state_dict() == saved and saved["scale"] == 2.0**11 and saved["clean_steps"] == 1
    for x, y in batches[4:]:
        unbroken.train_step((x, y), F.mse_loss)
        resumed.train_step((x, y), F.mse_loss)
    same = (resumed.loss_scaler.state_dict() == unbroken.loss_scaler.state_dict()
            and all(torch.equal(a, b) for a, b in zip(resumed.module.parameters(), unbroken.module.parameters())))
    bf16 = DistributedTrainer(copy.deepcopy(base), sgd, mixed_precision="bf16")
    bf16.load_checkpoint(path)
    for t in (unbroken, first, resumed, bf16):
        t.close()
    return restored, same, bf16.loss_scaler is None


def test_scaler_state_survives_a_checkpoint(tmp_path):
    for restored, same, bf16_ignores in run_distributed(scaler_checkpoint_worker, 2, args=(str(tmp_path / "ck"),),
                                                        timeout=120):
        assert restored and same and bf16_ignores
