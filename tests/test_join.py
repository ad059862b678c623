"""Uneven inputs in a user's own loop: with `join()`, rank r runs 3 + 2r batches and nobody hangs.

Reference: one process that, at step i, takes the gradient summed over the ranks still training at
step i divided by the world size (ranks that left contribute zeros), and steps the same optimizer.
Every parameter is compared after every step of the longest rank.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training import DDP, FSDP, join
from distributed_training.testing import run_distributed

TOL = 1e-10
CLIP_TOL = 1e-8  # FSDP computes the global gradient norm in float32
LR, MOMENTUM, CLIP = 0.1, 0.9, 0.05
BATCH = 4


def _steps(rank: int) -> int:
    return 3 + 2 * rank


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "ddp":  # BatchNorm: buffers broadcast from a rank still training
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    else:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return model.double()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=g, dtype=torch.float64))


def _micro(x, y, accumulate):
    if not accumulate:
        return [(x, y)]
    return [(x[:BATCH // 2], y[:BATCH // 2]), (x[BATCH // 2:], y[BATCH // 2:])]


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        return DDP(model, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)  # several buckets
    return FSDP(model, auto_wrap_policy={nn.Linear}, reshard_after_forward=kind == "zero3")


def join_worker(rank, world, kind, with_optimizer, accumulate, clip, steps=None):
    steps = steps or [_steps(r) for r in range(world)]
    model = _wrap(kind, _model(kind))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    records = []
    if kind == "ddp":
        record = lambda: records.append([p.detach().clone() for p in model.module.parameters()])  # noqa: E731
    else:
        record = lambda: records.append([s.detach().clone() for s in model.parameters()])  # noqa: E731
    opt.register_step_post_hook(lambda *_: record())  # joined ranks' steps are recorded too
    with join(model, optimizer=opt if with_optimizer else None):
        for i in range(steps[rank]):
            x, y = _batch(rank, i)
            micro = _micro(x, y, accumulate)
            for k, (xs, ys) in enumerate(micro):
                last = k == len(micro) - 1
                with model.no_sync() if not last else torch.enable_grad():
                    (F.mse_loss(model(xs), ys) / len(micro)).backward()
            if clip:
                model.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
    # After the context every rank is back in step: a collective outside it must work.
    if kind == "ddp":
        final = [t.detach().clone() for t in list(model.module.parameters()) + list(model.module.buffers())]
        layout = None
    else:
        final = None
        layout = [[(i.fqns[0], tuple(i.shape), i.offset) for i in u.infos] for u in model._units if u.padded]
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return records, final, layout


def _reference(kind, world, accumulate, clip, steps):
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    # Buffers (BatchNorm statistics) are per rank: a synchronised forward first takes those of the
    # lowest rank still training (broadcast), a no_sync() forward keeps the rank's own.
    buffers = {r: [b.clone() for b in model.buffers()] for r in range(world)}

    def load(values):
        with torch.no_grad():
            for b, v in zip(model.buffers(), values):
                b.copy_(v)

    trajectory, active = [], list(range(world))
    for i in range(max(steps)):
        active = [r for r in range(world) if i < steps[r]]
        opt.zero_grad()
        micro = {r: _micro(*_batch(r, i), accumulate) for r in active}
        parts = len(micro[active[0]])
        for k in range(parts):
            if k == parts - 1:
                for r in active:
                    buffers[r] = [v.clone() for v in buffers[min(active)]]
            for r in active:
                load(buffers[r])
                xs, ys = micro[r][k]
                (F.mse_loss(model(xs), ys) / parts / world).backward()
                buffers[r] = [b.clone() for b in model.buffers()]
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    load(buffers[min(active)])  # join() syncs every replica from the last rank to finish
    return model, trajectory


def _unshard(layout, per_rank_shards, names):
    """Full parameters (in `names` order) from every rank's shards of one step."""
    values = {}
    for unit_index, infos in enumerate(layout):
        flat = torch.cat([shards[unit_index] for shards in per_rank_shards])
        for fqn, shape, offset in infos:
            n = torch.Size(shape).numel()
            values[fqn] = flat[offset:offset + n].view(shape)
    return [values[n] for n in names]


CASES = [
    ("ddp", True, False, False),
    ("ddp", False, False, False),
    ("ddp", True, True, True),
    ("zero3", True, False, False),
    ("zero3", True, True, True),
    ("zero2", True, False, False),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind, with_optimizer, accumulate, clip", CASES,
                         ids=[f"{c[0]}{'' if c[1] else '-no-optimizer'}{'-acc-clip' if c[2] else ''}" for c in CASES])
def test_uneven_batches_match_a_single_process(world, kind, with_optimizer, accumulate, clip):
    steps = [_steps(r) for r in range(world)]
    results = run_distributed(join_worker, world, args=(kind, with_optimizer, accumulate, clip),
                              timeout=120, collective_timeout=60)
    ref_model, trajectory = _reference(kind, world, accumulate, clip, steps)
    names = [n for n, _ in ref_model.named_parameters()]
    tol = CLIP_TOL if clip and kind != "ddp" else TOL
    longest = max(range(world), key=lambda r: steps[r])
    if kind == "ddp":
        records = results[longest][0]
        assert len(records) == steps[longest]
        for i, (mine, expected) in enumerate(zip(records, trajectory)):
            for name, a, b in zip(names, mine, expected):
                assert (a - b).abs().max().item() <= tol, f"step {i + 1}, {name}"
        for r in range(world):  # every replica leaves identical, buffers included
            if with_optimizer:
                assert len(results[r][0]) == steps[longest], f"rank {r} did not step with the others"
            expected = list(ref_model.parameters()) + list(ref_model.buffers())
            for a, b in zip(results[r][1], expected):
                assert (a - b.detach()).abs().max().item() <= TOL, f"rank {r} leaves with other weights or buffers"
    else:
        layout = results[0][2]
        for r in range(world):
            assert len(results[r][0]) == steps[longest], f"rank {r} stepped {len(results[r][0])} times"
        for i, expected in enumerate(trajectory):
            mine = _unshard(layout, [results[r][0][i] for r in range(world)], names)
            for name, a, b in zip(names, mine, expected):
                assert (a - b).abs().max().item() <= tol, f"step {i + 1}, {name}"


def test_ddp_rank_without_any_batch_shadows_from_the_start():
    steps = [0, 3]
    results = run_distributed(join_worker, 2, args=("ddp", True, False, False, steps), timeout=120, collective_timeout=60)
    ref_model, trajectory = _reference("ddp", 2, False, False, steps)
    for i, (mine, expected) in enumerate(zip(results[1][0], trajectory)):
        assert all((a - b).abs().max().item() <= TOL for a, b in zip(mine, expected)), f"step {i + 1}"
    assert len(results[0][0]) == 3


def fsdp_empty_worker(rank, world):
    model = _wrap("zero3", _model("zero3"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        with model.join(optimizer=opt):
            for i in range(0 if rank == 1 else 2):
                F.mse_loss(model(_batch(rank, i)[0]), _batch(rank, i)[1]).backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_fsdp_rank_without_any_batch_is_named_on_every_rank():
    messages = run_distributed(fsdp_empty_worker, 2, timeout=120, collective_timeout=60)
    for msg in messages:
        assert "rank(s) [1] ran out of data before running a single forward" in msg, msg


def fsdp_without_optimizer_worker(rank, world):
    model = _wrap("zero3", _model("zero3"))
    try:
        model.join()
    except ValueError as err:
        return str(err)
    return "no error"


def test_fsdp_join_requires_the_optimizer():
    msg = run_distributed(fsdp_without_optimizer_worker, 1, timeout=60)[0]
    assert "needs optimizer=" in msg, msg


def unused_worker(rank, world):
    """find_unused_parameters: branch_b runs on even steps only, `never` never. A rank that is done must
    report its parameters unused, or the others' optimizer would see zero gradients (and momentum would
    move branch_b) where one process sees none."""
    from _models import Branchy

    torch.manual_seed(0)
    model = DDP(Branchy().double(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    records = []
    opt.register_step_post_hook(lambda *_: records.append([p.detach().clone() for p in model.module.parameters()]))
    with model.join(optimizer=opt):
        for i in range(_steps(rank)):
            x, _ = _batch(rank, i)
            y = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(rank * 7 + i), dtype=torch.float64)
            F.mse_loss(model(x, i % 2 == 0), y).backward()
            opt.step()
            opt.zero_grad()
    return records


def test_ddp_find_unused_parameters_with_ranks_done():
    from _models import Branchy

    world = 2
    results = run_distributed(unused_worker, world, timeout=120, collective_timeout=60)
    torch.manual_seed(0)
    reference = Branchy().double()
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    steps = [_steps(r) for r in range(world)]
    for i in range(max(steps)):
        for r in [r for r in range(world) if i < steps[r]]:
            x, _ = _batch(r, i)
            y = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(r * 7 + i), dtype=torch.float64)
            (F.mse_loss(reference(x, i % 2 == 0), y) / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            for (name, p), mine in zip(reference.named_parameters(), results[r][i]):
                assert (mine - p.detach()).abs().max().item() <= TOL, f"rank {r}, step {i + 1}, {name}"
