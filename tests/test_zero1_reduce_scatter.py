"""ZeRO-1 reduce-scatters gradients into each rank's shard: parameters equal torch DDP + the full
optimizer after every step, and no all-reduce of the gradient happens."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from distributed_training import DistributedTrainer, Zero1Strategy
from distributed_training.amp import DynamicLossScaler
from distributed_training.testing import run_distributed

TOL = 1e-5
# Small buckets: the model spreads over several, so that every rank owns a slice of each, padded at W = 3.
SMALL_BUCKETS = {"bucket_cap_mb": 1200 / 2**20, "first_bucket_cap_mb": 300 / 2**20}


class Mixed(nn.Module):
    """A frozen first layer, odd sizes (padding at W = 3), a float64 parameter (a bucket of its own
    dtype), and a branch that only some ranks use in a step when `branch` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(7, 33)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(33, 17)
        self.side = nn.Linear(17, 17)
        self.head = nn.Linear(17, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

    def forward(self, x, use_side):
        h = torch.tanh(self.mid(torch.tanh(self.frozen(x))))
        if bool(use_side[0]):
            h = h + torch.tanh(self.side(h))
        return (self.head(h) * self.scale).float()


def _optimizer(kind):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.Adam(ps, lr=0.01)


def _batch(rank, world, step, per_rank, side_on):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(per_rank * world, 7, generator=g), torch.randn(per_rank * world, 5, generator=g)
    sl = slice(per_rank * rank, per_rank * (rank + 1))
    flag = torch.full((per_rank,), side_on)
    return (x[sl], flag), y[sl]


def parity_worker(rank, world, kind, accumulation, clip, unused):
    torch.manual_seed(0)
    base = Mixed()
    ref = TorchDDP(copy.deepcopy(base), find_unused_parameters=unused)
    ref_opt = _optimizer(kind)([p for p in ref.parameters() if p.requires_grad])
    strategy = Zero1Strategy(find_unused_parameters=unused, **SMALL_BUCKETS)
    trainer = DistributedTrainer(copy.deepcopy(base), _optimizer(kind), strategy=strategy,
                                 gradient_accumulation_steps=accumulation, gradient_clip_val=clip)
    assert len(trainer.model.shards) >= 3, trainer.model.bucket_layout()  # several buckets, two dtypes
    worst, norms = 0.0, []
    for step in range(5):
        # With `unused`, the side branch runs on one rank per step (a different one each step).
        side_on = (not unused) or step % world == rank
        (inputs, flag), target = _batch(rank, world, step, 4 * accumulation, side_on)
        metrics = trainer.train_step(((inputs, flag), target), F.mse_loss)
        # The reference: torch DDP, the same micro-batches, the first under no_sync, the full optimizer.
        for k, (xs, ys) in enumerate(zip(inputs.chunk(accumulation), target.chunk(accumulation))):
            sync = k == accumulation - 1
            with contextlib.nullcontext() if sync else ref.no_sync():
                (F.mse_loss(ref(xs, flag), ys) / accumulation).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
            norms.append((float(metrics["grad_norm"]), float(norm)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        mine = dict(trainer.module.named_parameters())
        for name, p in ref.module.named_parameters():
            worst = max(worst, (mine[name].detach() - p.detach()).abs().max().item())
    frozen_kept = torch.equal(trainer.module.frozen.weight, base.frozen.weight)
    trainer.close()
    return worst, norms, frozen_kept


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_zero1_equals_torch_ddp_after_every_step(world, kind):
    # Gradient accumulation over 2 micro-batches and clipping by the global norm (small enough to bite).
    for worst, norms, frozen_kept in run_distributed(parity_worker, world, args=(kind, 2, 0.05, False), timeout=180):
        assert worst <= TOL, worst
        assert frozen_kept
        assert any(ref > 0.05 for _, ref in norms), norms  # clipping did happen
        for ours, ref in norms:
            assert abs(ours - ref) <= 1e-5 * max(1.0, ref), norms


def test_zero1_with_parameters_unused_on_some_ranks_equals_torch_ddp():
    for worst, _, _ in run_distributed(parity_worker, 3, args=("sgd", 1, None, True), timeout=180):
        assert worst <= TOL, worst


def communication_worker(rank, world):
    from distributed_training import CommunicationOptimizer

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))
    trainers = {name: DistributedTrainer(copy.deepcopy(base), _optimizer("adam"), strategy=name,
                                         communication=CommunicationOptimizer(compression="bf16"))
                for name in ("ddp", "zero1")}
    worst = 0.0
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 12, generator=g), torch.randn(4 * world, 3, generator=g)
        for t in trainers.values():
            t.train_step((x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]), F.mse_loss)
        ref = dict(trainers["ddp"].module.named_parameters())
        for name, p in trainers["zero1"].module.named_parameters():
            worst = max(worst, (p.detach() - ref[name].detach()).abs().max().item())
    for t in trainers.values():
        t.close()
    return worst


def test_zero1_with_a_communication_optimizer_all_reduces_and_equals_ddp():
    # bf16 compression has no reduce-scatter form here: ZeRO-1 falls back to its all-reduce, whose mean
    # lands in this rank's slice as well.
    for worst in run_distributed(communication_worker, 2, timeout=120):
        assert worst <= 1e-6, worst


# ------------------------------------------------------------------ what goes on the wire
_COUNTED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
            "broadcast", "all_to_all_single")


def wire_worker(rank, world, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 9))
    trainable = sum(p.numel() for p in model.parameters())
    chosen = Zero1Strategy(**SMALL_BUCKETS) if strategy == "zero1" else strategy
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=chosen,
                                 gradient_clip_val=1.0)
    calls: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counting(name):
        def call(*args, **kwargs):
            # The larger tensor: a reduce-scatter's input, an all-gather's output (the whole flat buffer).
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            calls.append((name, max(sizes, default=-1)))
            return originals[name](*args, **kwargs)
        return call

    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(6, 40, generator=g), torch.randn(6, 9, generator=g)) for _ in range(3)]
    trainer.train_step(batches[0], F.mse_loss)  # the first step may do one-off work (DDP rebuilds its buckets)
    for name in _COUNTED:
        setattr(dist, name, counting(name))
    try:
        for batch in batches[1:]:
            trainer.train_step(batch, F.mse_loss)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    layout = None
    if strategy == "zero1":
        shards, buckets = trainer.model.shards, trainer.model._buckets
        params = dict(trainer.module.named_parameters())

        def storage(t):
            return t.untyped_storage().data_ptr()

        # The optimizer's tensors are slices of the buckets and of the parameter buffers, not copies.
        views = all(storage(s.grad) == storage(b.buffer) and storage(s.param) == storage(s.flat)
                    for s, b in zip(shards, buckets))
        views = views and all(any(storage(p) == storage(s.flat) for s in shards) for p in params.values())
        layout = (sum(s.flat.numel() for s in shards), len(shards), views)
    trainer.close()
    return trainable, calls, layout


def test_zero1_puts_a_reduce_scatter_and_an_all_gather_on_the_wire_never_an_all_reduce_of_the_gradient():
    world, steps = 3, 2
    trainable, calls, _ = run_distributed(wire_worker, world, args=("ddp",))[0]
    # The counter sees DDP's gradient all-reduce: it would see ZeRO-1's if there were one.
    assert sum(n for op, n in calls if op == "all_reduce") >= steps * trainable, calls

    for trainable, calls, (padded, buckets, views) in run_distributed(wire_worker, world, args=("zero1",)):
        assert views
        assert buckets >= 2 and trainable <= padded < trainable + buckets * world  # padding only
        reduced = [n for op, n in calls if op == "all_reduce"]
        # What is all-reduced: the clip norm (one element) per step, nothing of the gradient's size.
        assert len(reduced) == steps and max(reduced) == 1, calls
        # One reduce-scatter of every (padded) bucket and one all-gather of every parameter buffer per step:
        # (W - 1) / W of the model each, together the bytes of one all-reduce.
        assert sum(n for op, n in calls if op == "reduce_scatter_tensor") == steps * padded, calls
        assert sum(n for op, n in calls if op == "all_gather_into_tensor") == steps * padded, calls
        assert not [op for op, _ in calls if op in ("all_gather", "reduce_scatter", "all_to_all_single")], calls


# ------------------------------------------------------------------ fp16 loss scaling, skipped steps
def fp16_worker(rank, world):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))
    trainers = {}
    for name in ("ddp", "zero1"):
        # A scale large enough to overflow fp16 at first: the first steps are skipped, and what they
        # accumulated must not leak into the next ones.
        trainers[name] = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                            strategy=name, mixed_precision="fp16", gradient_clip_val=0.5,
                                            loss_scaler=DynamicLossScaler(init_scale=2.0**20))
    worst = 0.0
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 12, generator=g), torch.randn(4 * world, 3, generator=g)
        batch = (x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])
        for t in trainers.values():
            t.train_step(batch, F.mse_loss)
        ref = dict(trainers["ddp"].module.named_parameters())
        for name, p in trainers["zero1"].module.named_parameters():
            worst = max(worst, (p.detach() - ref[name].detach()).abs().max().item())
    skipped = [t.loss_scaler.skipped_steps for t in trainers.values()]
    for t in trainers.values():
        t.close()
    return worst, skipped


def test_zero1_fp16_with_skipped_steps_equals_ddp():
    for worst, skipped in run_distributed(fp16_worker, 2, timeout=180):
        assert skipped[0] == skipped[1] and 0 < skipped[0] < 5, skipped
        assert worst <= 1e-3, worst


# ------------------------------------------------------------------ checkpoints do not depend on the buckets
def layout_worker(rank, world, directory, save):
    torch.manual_seed(0 if save else 1)
    caps = SMALL_BUCKETS if save else {"bucket_cap_mb": 1.0}  # other caps: other buckets, other shards
    trainer = DistributedTrainer(Mixed(), _optimizer("sgd"), strategy=Zero1Strategy(**caps))
    if save:
        trainer.train_step(_batch(rank, world, 0, 4, True), F.mse_loss)
        trainer.save_checkpoint(directory)
    else:
        trainer.load_checkpoint(directory)
    loaded = trainer.full_state_dict()
    trainer.train_step(_batch(rank, world, 1, 4, True), F.mse_loss)  # momentum from the checkpoint
    after = trainer.full_state_dict()
    trainer.close()
    return loaded, after


def test_zero1_checkpoint_loads_under_other_bucket_caps(tmp_path):
    saved = run_distributed(layout_worker, 2, args=(str(tmp_path / "ck"), True))[0]
    loaded = run_distributed(layout_worker, 2, args=(str(tmp_path / "ck"), False))[0]
    assert len(SMALL_BUCKETS) and set(saved[0]) == set(loaded[0])
    for before, after in zip(saved, loaded):
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, rtol=1e-6, atol=1e-7, msg=key)


# ------------------------------------------------------------------ NCCL: in-place reduce-scatter and all-gather
def nccl_worker(rank, world):
    from distributed_training.models import GPT, GPTConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    base = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)).to(device)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[rank], bucket_cap_mb=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                 strategy=Zero1Strategy(bucket_cap_mb=0.5), gradient_clip_val=1.0)
    worst = 0.0
    g = torch.Generator(device=device).manual_seed(rank)
    for _ in range(6):
        idx = torch.randint(0, 512, (4, 64), device=device, generator=g)
        target = torch.roll(idx, -1, 1)
        trainer.train_step((idx, target))
        ref(idx, target).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        mine = dict(trainer.module.named_parameters())
        for name, p in ref.module.named_parameters():
            worst = max(worst, (mine[name].detach() - p.detach()).abs().max().item())
    trainer.close()
    return worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_zero1_on_nccl_equals_torch_ddp():
    assert max(run_distributed(nccl_worker, 2, backend="nccl", timeout=300)) <= 1e-5
