"""ZeRO-1 reduce-scatters gradients into each rank's shard: parameters equal torch DDP + the full
optimizer after every step, and no all-reduce of the gradient happens."""

from __future__ import annotations

import contextlib
import copy
import sys

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


class Twice(nn.Module):
    """One module called twice per forward, and a weight shared by two modules whose other parameters
    sit in other buckets (`echo.weight` is `inner.weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 17)
        self.inner = nn.Linear(17, 17)
        self.mid = nn.Linear(17, 17)
        self.out = nn.Linear(17, 5)
        self.echo = nn.Linear(17, 17)
        self.echo.weight = self.inner.weight

    def forward(self, x, use_side):
        h = torch.tanh(self.inner(torch.tanh(self.inp(x))))
        h = torch.tanh(self.inner(h))  # the same module again
        return self.out(torch.tanh(self.echo(torch.tanh(self.mid(h)))))


def _model(name):
    from _models import tiny_gpt

    return {"mixed": Mixed, "twice": Twice, "gpt": tiny_gpt}[name]()


def _model_batch(name, rank, world, step, per_rank, side_on):
    """((inputs...), target) for `name`; the GPT computes its loss from (idx, targets) itself."""
    if name != "gpt":
        return _batch(rank, world, step, per_rank, side_on)
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 64, (per_rank * world, 16), generator=g)
    sl = slice(per_rank * rank, per_rank * (rank + 1))
    return (idx[sl],), torch.roll(idx, -1, 1)[sl]


class _DelayedGather:
    """An all-gather whose result reaches the parameters only when it is waited for: whatever reads
    them before the wait sees the values from before the step, on any backend and at any speed."""

    def __init__(self, out, shard, group, async_op=True):
        self.out, self.staging = out, torch.empty_like(out)
        self.work = _real_all_gather_flat(self.staging, shard, group, async_op=async_op)
        self.waited = False

    def wait(self):
        self.work.wait()
        if not self.waited:
            self.waited = True
            self.out.copy_(self.staging)
        return True


def _real_all_gather_flat(*args, **kwargs):
    from distributed_training.comm.sharded import all_gather_flat

    return all_gather_flat(*args, **kwargs)


def _delay_gathers(factory=_DelayedGather):
    from distributed_training.strategies import zero1_ddp

    assert hasattr(zero1_ddp, "all_gather_flat")  # patched where Zero1DDP looks it up
    zero1_ddp.all_gather_flat = factory


def parity_worker(rank, world, kind, accumulation, clip, unused, model="mixed", overlap=True, read_between=True,
                  delay=False):
    """Our ZeRO-1 against torch DDP + the full optimizer, step by step. Each forward records the
    parameters each module saw (after its wait for the all-gather), compared with the reference's
    after the previous step; with `read_between`, the parameters are also read through
    `trainer.module` after every step (which waits for them: the next forward then has nothing in
    flight). `delay` holds every all-gather's result back until it is waited for."""
    if delay:
        _delay_gathers()
    torch.manual_seed(0)
    base = _model(model)
    ref = TorchDDP(copy.deepcopy(base), find_unused_parameters=unused)
    ref_opt = _optimizer(kind)([p for p in ref.parameters() if p.requires_grad])
    strategy = Zero1Strategy(find_unused_parameters=unused, overlap_param_gather=overlap, **SMALL_BUCKETS)
    trainer = DistributedTrainer(copy.deepcopy(base), _optimizer(kind), strategy=strategy,
                                 gradient_accumulation_steps=accumulation, gradient_clip_val=clip)
    assert len(trainer.model.shards) >= 3, trainer.model.bucket_layout()  # several buckets
    name_of = {id(p): name for name, p in trainer.module.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def record(module, args, output):
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                seen.setdefault(name_of[id(p)], p.detach().clone())

    for m in trainer.module.modules():
        m.register_forward_hook(record)
    worst, worst_seen, norms, in_flight, checked = 0.0, 0.0, [], [], 0
    for step in range(5):
        # With `unused`, the side branch runs on one rank per step (a different one each step).
        side_on = (not unused) or step % world == rank
        inputs, target = _model_batch(model, rank, world, step, 4 * accumulation, side_on)
        expected = {name: p.detach().clone() for name, p in ref.module.named_parameters()}
        seen.clear()
        metrics = trainer.train_step((inputs, target) if model != "gpt" else (*inputs, target),
                                     None if model == "gpt" else F.mse_loss)
        for name, value in seen.items():
            worst_seen = max(worst_seen, (value - expected[name]).abs().max().item())
            checked += 1
        in_flight.append(trainer.model._gathers.in_flight)  # read without waiting
        # The reference: torch DDP, the same micro-batches, the first under no_sync, the full optimizer.
        chunks = [x.chunk(accumulation) for x in (*inputs, target)]
        for k, pieces in enumerate(zip(*chunks)):
            sync = k == accumulation - 1
            with contextlib.nullcontext() if sync else ref.no_sync():
                if model == "gpt":
                    loss = ref(*pieces)
                else:
                    loss = F.mse_loss(ref(*pieces[:-1]), pieces[-1])
                (loss / accumulation).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
            norms.append((float(metrics["grad_norm"]), float(norm)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if read_between or step == 4:
            mine = dict(trainer.module.named_parameters())  # waits for the all-gathers
            for name, p in ref.module.named_parameters():
                worst = max(worst, (mine[name].detach() - p.detach()).abs().max().item())
    frozen_kept = model != "mixed" or torch.equal(trainer.module.frozen.weight, base.frozen.weight)
    buckets = len(trainer.model.shards)
    trainer.close()
    return {"worst": worst, "worst_seen": worst_seen, "checked": checked, "norms": norms,
            "frozen_kept": frozen_kept, "in_flight": in_flight, "buckets": buckets,
            "trainable": sum(1 for p in base.parameters() if p.requires_grad)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_zero1_equals_torch_ddp_after_every_step(world, kind):
    # Gradient accumulation over 2 micro-batches and clipping by the global norm (small enough to bite).
    for r in run_distributed(parity_worker, world, args=(kind, 2, 0.05, False), timeout=180):
        assert r["worst"] <= TOL and r["worst_seen"] <= TOL, r
        assert r["frozen_kept"]
        assert any(ref > 0.05 for _, ref in r["norms"]), r["norms"]  # clipping did happen
        for ours, ref in r["norms"]:
            assert abs(ours - ref) <= 1e-5 * max(1.0, ref), r["norms"]


def test_zero1_with_parameters_unused_on_some_ranks_equals_torch_ddp():
    for r in run_distributed(parity_worker, 3, args=("sgd", 1, None, True), timeout=180):
        assert r["worst"] <= TOL and r["worst_seen"] <= TOL, r


# ------------------------------------------------------------------ the all-gather overlapped with the next forward
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", ["mixed", "twice", "gpt"])
def test_zero1_overlapped_gather_each_forward_sees_the_stepped_parameters(world, model):
    # Nothing reads the parameters between steps, and every all-gather's result is held back until it is
    # waited for: each forward starts with all of them in flight, and each module must wait for its own
    # buckets (the tied GPT embedding and `Twice.echo` for two, `Twice.inner` once though called twice).
    for r in run_distributed(parity_worker, world, args=("sgd", 2, 0.05, False, model, True, False, True),
                             timeout=240):
        assert r["in_flight"] == [r["buckets"]] * 5, r["in_flight"]
        assert r["checked"] == 5 * r["trainable"], r  # every parameter, as its module's forward saw it
        assert r["worst_seen"] <= TOL and r["worst"] <= TOL, r
        assert any(ref > 0.05 for _, ref in r["norms"]), r["norms"]


def test_zero1_without_overlap_gathers_inside_the_step():
    for r in run_distributed(parity_worker, 2, args=("adam", 1, None, False, "twice", False, False, True)):
        assert r["in_flight"] == [0] * 5, r["in_flight"]
        assert r["worst_seen"] <= TOL and r["worst"] <= TOL, r


def waits_worker(rank, world, overlap):
    """Which code waits for each bucket's all-gather, relative to the step that launched it."""
    events: list[tuple] = []
    bucket_at: dict[int, int] = {}

    class Recording(_DelayedGather):
        def __init__(self, out, shard, group, async_op=True):
            super().__init__(out, shard, group, async_op)
            self.bucket = bucket_at[out.data_ptr()]
            self.step = sum(1 for e in events if e[0] == "launch") // len(bucket_at)  # which step launched it
            events.append(("launch", self.step, self.bucket))

        def wait(self):
            if not self.waited:
                frames, f = [], sys._getframe(1)
                while f is not None and len(frames) < 8:
                    frames.append(f.f_code.co_name)
                    f = f.f_back
                where = ("forward" if "hook" in frames else "step" if "gather_parameters" in frames
                         else "backward" if "_settle_before_backward" in frames else "other")
                events.append(("wait", self.step, self.bucket, where))
            return super().wait()

    _delay_gathers(Recording)
    torch.manual_seed(0)
    trainer = DistributedTrainer(Twice(), _optimizer("sgd"),
                                 strategy=Zero1Strategy(overlap_param_gather=overlap, **SMALL_BUCKETS))
    bucket_at.update({s.flat.data_ptr(): i for i, s in enumerate(trainer.model.shards)})
    for step in range(3):
        trainer.train_step(_batch(rank, world, step, 4, True), F.mse_loss)
        events.append(("returned", step))
    buckets = len(trainer.model.shards)
    trainer.close()
    return events, buckets


@pytest.mark.parametrize("overlap", [True, False])
def test_zero1_gathers_are_in_flight_when_the_step_returns_and_the_forward_waits(overlap):
    for events, buckets in run_distributed(waits_worker, 2, args=(overlap,)):
        assert buckets >= 3
        for step in range(2):  # each step's all-gathers (the last step's are waited for by close())
            launches = [i for i, e in enumerate(events) if e[0] == "launch" and e[1] == step]
            waits = [(i, e[2], e[3]) for i, e in enumerate(events) if e[0] == "wait" and e[1] == step]
            returned = events.index(("returned", step))
            # Launched inside the step, from the last bucket (the first layers) to the first.
            assert [events[i][2] for i in launches] == list(range(buckets - 1, -1, -1)), events
            assert max(launches) < returned and (step == 0 or min(launches) > events.index(("returned", step - 1)))
            assert sorted(b for _, b, _ in waits) == list(range(buckets)), events  # each bucket once
            if overlap:
                # Nothing waited inside the step: the all-gathers are in flight when it returns, and the
                # next forward's pre-hooks wait for them, the first layers' bucket first.
                assert min(i for i, _, _ in waits) > returned, events
                assert {where for _, _, where in waits} == {"forward"}, events
                assert waits[0][1] == buckets - 1, events
            else:
                assert {where for _, _, where in waits} == {"step"}, events
                assert max(i for i, _, _ in waits) < returned, events


def save_after_step_worker(rank, world, directory, overlap):
    _delay_gathers()
    torch.manual_seed(0)
    trainer = DistributedTrainer(Mixed(), _optimizer("sgd"),
                                 strategy=Zero1Strategy(overlap_param_gather=overlap, **SMALL_BUCKETS))
    for step in range(2):
        trainer.train_step(_batch(rank, world, step, 4, True), F.mse_loss)
    in_flight = trainer.model._gathers.in_flight
    trainer.save_checkpoint(directory)  # right after the step: no forward has waited for anything
    trainer.close()
    return in_flight


def load_full_worker(rank, world, directory):
    trainer = DistributedTrainer(Mixed(), _optimizer("sgd"), strategy="ddp")
    trainer.load_checkpoint(directory)
    full = trainer.full_state_dict()
    trainer.close()
    return full


def test_zero1_checkpoint_right_after_a_step_saves_the_gathered_parameters(tmp_path):
    saved = {}
    for overlap in (True, False):
        in_flight = run_distributed(save_after_step_worker, 2, args=(str(tmp_path / str(overlap)), overlap))
        assert (min(in_flight) > 0) if overlap else (max(in_flight) == 0), in_flight
        saved[overlap] = run_distributed(load_full_worker, 2, args=(str(tmp_path / str(overlap)),))[0]
    torch.manual_seed(0)
    initial = Mixed().state_dict()
    assert set(saved[True]) == set(saved[False]) == set(initial)
    for key, value in saved[False].items():
        assert torch.equal(saved[True][key], value), key
    assert not torch.equal(saved[True]["head.weight"], initial["head.weight"])  # the steps did move it


class Borrower(nn.Module):
    """A parent that reads its child's parameters without running the child (`head` never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(7, 33)
        self.head = nn.Linear(33, 5)

    def forward(self, x, use_side):
        return F.linear(torch.tanh(self.body(x)), self.head.weight, self.head.bias)


def borrower_worker(rank, world):
    _delay_gathers()
    torch.manual_seed(0)
    trainer = DistributedTrainer(Borrower(), _optimizer("sgd"), strategy=Zero1Strategy(**SMALL_BUCKETS))
    separate = len({i for name in ("head.weight", "body.weight") for i, names in
                    enumerate(trainer.model.bucket_layout()) if name in names}) == 2
    trainer.train_step(_batch(rank, world, 0, 4, True), F.mse_loss)
    try:
        trainer.train_step(_batch(rank, world, 1, 4, True), F.mse_loss)
        message = None
    except RuntimeError as err:
        message = str(err)
    trainer.close(barrier=False)
    return separate, message


def test_zero1_parameter_read_outside_its_owners_forward_is_an_error_naming_it():
    for separate, message in run_distributed(borrower_worker, 2):
        assert separate
        assert message is not None and "'head." in message and "wait_for_parameters" in message, message


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
# torch 2.12 renamed the flat collectives; both names are counted, under the old one.
_RENAMED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _count_collectives(calls: list[tuple[str, int]]):
    """Patch torch's collectives, and the package's module-level aliases of them (bound at import, e.g.
    `comm.collectives.all_gather_single`), to record (name, larger tensor's numel); returns an undo."""
    import sys

    originals = {name: getattr(dist, name) for name in (*_COUNTED, *_RENAMED) if hasattr(dist, name)}
    by_function = {fn: _RENAMED.get(name, name) for name, fn in originals.items()}

    def counting(label, fn):
        def call(*args, **kwargs):
            # The larger tensor: a reduce-scatter's input, an all-gather's output (the whole flat buffer).
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            calls.append((label, max(sizes, default=-1)))
            return fn(*args, **kwargs)
        return call

    patched = [(dist, name, fn) for name, fn in originals.items()]
    for module in [m for name, m in sys.modules.items() if name.startswith("distributed_training") and m]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in by_function:
                patched.append((module, attr, value))
    for owner, attr, fn in patched:
        setattr(owner, attr, counting(by_function[fn], fn))

    def undo():
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)
    return undo


def wire_worker(rank, world, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 9))
    trainable = sum(p.numel() for p in model.parameters())
    chosen = Zero1Strategy(**SMALL_BUCKETS) if strategy == "zero1" else strategy
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=chosen,
                                 gradient_clip_val=1.0)
    calls: list[tuple[str, int]] = []
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(6, 40, generator=g), torch.randn(6, 9, generator=g)) for _ in range(3)]
    trainer.train_step(batches[0], F.mse_loss)  # the first step may do one-off work (DDP rebuilds its buckets)
    undo = _count_collectives(calls)
    try:
        for batch in batches[1:]:
            trainer.train_step(batch, F.mse_loss)
    finally:
        undo()
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
        # What is all-reduced: the replicas' row counts (`loss_weights.replica_scale`) and the clip norm,
        # one element each per step, nothing of the gradient's size.
        assert len(reduced) == 2 * steps and max(reduced) == 1, calls
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
def nccl_worker(rank, world, read_between=True):
    """With `read_between`, the parameters are compared after every step (reading them waits for the
    all-gathers); without, nothing reads them between steps, so each forward starts with every
    all-gather in flight on the NCCL stream: what each module's forward saw is compared instead (with
    the reference's parameters after the previous step), and everything after the last step."""
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
    name_of = {id(p): name for name, p in trainer.module.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def record(module, args, output):
        for p in module.parameters(recurse=False):
            seen.setdefault(name_of[id(p)], p.detach().clone())

    for m in trainer.module.modules():
        m.register_forward_hook(record)
    worst = worst_seen = 0.0
    checked = 0
    g = torch.Generator(device=device).manual_seed(rank)
    for step in range(6):
        idx = torch.randint(0, 512, (4, 64), device=device, generator=g)
        target = torch.roll(idx, -1, 1)
        expected = {name: p.detach().clone() for name, p in ref.module.named_parameters()}
        seen.clear()
        trainer.train_step((idx, target))
        for name, value in seen.items():
            worst_seen = max(worst_seen, (value - expected[name]).abs().max().item())
            checked += 1
        ref(idx, target).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        if read_between or step == 5:
            mine = dict(trainer.module.named_parameters())
            for name, p in ref.module.named_parameters():
                worst = max(worst, (mine[name].detach() - p.detach()).abs().max().item())
    trainer.close()
    return worst, worst_seen, checked == 6 * len(name_of)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("read_between", [True, False])
def test_zero1_on_nccl_equals_torch_ddp(read_between):
    for worst, worst_seen, every_parameter_seen in run_distributed(nccl_worker, 2, args=(read_between,),
                                                                   backend="nccl", timeout=300):
        assert every_parameter_seen
        assert worst <= 1e-5 and worst_seen <= 1e-5, (worst, worst_seen)
