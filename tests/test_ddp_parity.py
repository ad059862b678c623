"""Our DDP against torch's DistributedDataParallel, our naive twin, and one process on the whole batch.

Every case trains four replicas of one model side by side in each rank for several steps with SGD
and momentum (Adam's scale invariance hides gradient-scaling bugs), and compares every parameter and
buffer after every step:

* ours      distributed_training.DDP on this rank's slice of the global batch
* torch     torch.nn.parallel.DistributedDataParallel on the same slice
* naive     distributed_training.NaiveDDP (one all-reduce per parameter) on the same slice
* single    one plain module on the whole global batch (mean loss), no communication at all

The cases are run at world sizes 1 to 4 (3 is odd: no power-of-two shortcut hides there).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from distributed_training import DDP, NaiveDDP
from distributed_training.testing import run_distributed

from _models import MLP, Branchy, ConvBN, MixedDtypeFrozen, Reordered, tiny_gpt

TOL = 1e-5
STEPS = 5
PER_RANK = 4  # samples per rank per step


def _batch(case: str, step: int, world: int):
    """The global batch of a step: identical on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * world
    if case == "cnn_bn":
        return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)
    if case == "gpt_tied":
        idx = torch.randint(0, 64, (n, 16), generator=g)
        return idx, torch.roll(idx, -1, dims=1)
    if case == "unused":
        return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    if case == "reordered":
        return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def _model(case: str):
    torch.manual_seed(0)
    return {"cnn_bn": ConvBN, "gpt_tied": tiny_gpt, "unused": Branchy, "reordered": Reordered}.get(case, MLP)()


def _loss(case: str, model, x, y, use_b: bool = False):
    if case == "cnn_bn":
        return F.cross_entropy(model(x), y)
    if case == "gpt_tied":
        return model(x, y)
    if case == "unused":
        return F.mse_loss(model(x, use_b), y)
    return F.mse_loss(model(x), y)


CASES = {
    # name: (our DDP kwargs, torch DDP kwargs)
    "mlp": ({}, {}),
    "cnn_bn": ({}, {}),
    "gpt_tied": ({}, {}),
    "unused": ({"find_unused_parameters": True}, {"find_unused_parameters": True}),
    "accumulate_no_sync": ({}, {}),
    # zero_grad(set_to_none=False): `.grad` stays the bucket view and autograd accumulates into it.
    "keep_grads": ({}, {}),
    "tiny_buckets": ({"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}, {"bucket_cap_mb": 1e-4}),
    "huge_bucket": ({"bucket_cap_mb": 1000.0, "first_bucket_cap_mb": 1000.0}, {"bucket_cap_mb": 1000.0}),
    "reordered": ({"bucket_cap_mb": 1e-3, "first_bucket_cap_mb": 1e-3}, {}),
}


def _uses_b(rank: int) -> bool:
    return rank % 2 == 1


def _single_process_step(case, model, x, y, world):
    """The gradient the data-parallel replicas must reproduce, computed in one process.

    For most cases that is the mean loss over the whole batch. BatchNorm normalises each rank's
    slice with that slice's statistics, and `unused` runs a different branch per rank, so for those
    the per-rank losses are averaged, slice by slice, with running statistics following rank 0
    (which DDP broadcasts before each forward).
    """
    if case in ("cnn_bn", "unused"):
        start = {k: v.clone() for k, v in model.named_buffers()}
        after_rank0 = None
        for r in range(world):
            for k, v in model.named_buffers():
                v.copy_(start[k])
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            (_loss(case, model, x[sl], y[sl], use_b=_uses_b(r)) / world).backward()
            if r == 0:
                after_rank0 = {k: v.clone() for k, v in model.named_buffers()}
        for k, v in model.named_buffers():
            v.copy_(after_rank0[k])
    else:
        _loss(case, model, x, y).backward()


def _max_diff(a: torch.nn.Module, b: torch.nn.Module, buffers: bool = True) -> float:
    worst = 0.0
    pairs = zip(a.state_dict().items(), b.state_dict().items()) if buffers else zip(
        a.named_parameters(), b.named_parameters()
    )
    for (name, ta), (_, tb) in pairs:
        if ta.is_floating_point():
            worst = max(worst, (ta - tb).abs().max().item())
        elif not torch.equal(ta, tb):
            return float("inf")
    return worst


def parity_worker(rank: int, world: int) -> dict:
    report = {}
    for case, (ours_kw, torch_kw) in CASES.items():
        base = _model(case)
        replicas = {
            "ours": DDP(copy.deepcopy(base), **ours_kw),
            "torch": TorchDDP(copy.deepcopy(base), **torch_kw),
            "naive": NaiveDDP(copy.deepcopy(base)),
        }
        single = copy.deepcopy(base)
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in replicas.items()}
        opt_single = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
        worst = {k: 0.0 for k in replicas}
        for step in range(STEPS):
            x, y = _batch(case, step, world)
            sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            xs, ys = x[sl], y[sl]
            for name, model in replicas.items():
                if case == "accumulate_no_sync":
                    half = PER_RANK // 2
                    with model.no_sync():
                        (_loss(case, model, xs[:half], ys[:half]) / 2).backward()
                    (_loss(case, model, xs[half:], ys[half:]) / 2).backward()
                else:
                    _loss(case, model, xs, ys, use_b=_uses_b(rank)).backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=case != "keep_grads")
            if case == "accumulate_no_sync":
                # The same total: each rank's two halves weighted 1/2 = the mean over the whole batch.
                _loss(case, single, x, y).backward()
            else:
                _single_process_step(case, single, x, y, world)
            opt_single.step()
            opt_single.zero_grad()
            # A rank's running statistics come from rank 0's (broadcast before forward) updated by its own
            # slice; the single-process emulation follows rank 0, so other ranks compare parameters only.
            buffers = rank == 0 or case != "cnn_bn"
            for name, model in replicas.items():
                worst[name] = max(worst[name], _max_diff(model.module, single, buffers))
            worst["ours_vs_torch"] = max(worst.get("ours_vs_torch", 0.0),
                                         _max_diff(replicas["ours"].module, replicas["torch"].module))
        if case == "unused":
            never = replicas["ours"].module.never.weight
            worst["never_grad_is_none"] = float(never.grad is None)
        if case == "keep_grads":
            ours = replicas["ours"]
            worst["grads_are_views"] = float(bool(ours._view_of) and
                                             all(p.grad is v for p, v in zip(ours._params, ours._view_of)))
            worst["buckets"] = len(ours.bucket_layout())
        if case == "reordered":
            worst["layout"] = replicas["ours"].bucket_layout()
        report[case] = worst
    return report


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_parity_every_step(world):
    reports = run_distributed(parity_worker, world, timeout=240)
    for rank, report in enumerate(reports):
        for case, worst in report.items():
            for name in ("ours", "torch", "naive", "ours_vs_torch"):
                assert worst[name] <= TOL, f"rank {rank} case {case}: {name} differs from the reference by {worst[name]:.3g}"
    unused = reports[0]["unused"]
    assert unused["never_grad_is_none"] == 1.0, "a globally unused parameter must keep grad=None"
    if world == 1:  # one rank: nothing to reduce, no buckets; the gradients are autograd's own
        assert reports[0]["keep_grads"]["buckets"] == 0 and reports[0]["keep_grads"]["grads_are_views"] == 0.0
        return
    # With set_to_none=False every `.grad` stays its bucket view (autograd accumulates into the bucket).
    assert reports[0]["keep_grads"]["grads_are_views"] == 1.0
    # After the first iteration, buckets follow arrival order: first.* arrives last, so it is in the last bucket.
    layout = reports[0]["reordered"]["layout"]
    assert layout[-1][-1].startswith("first."), layout
    assert layout[0][0].startswith("last."), layout


def mixed_worker(rank: int, world: int) -> float:
    torch.manual_seed(0)
    base = MixedDtypeFrozen().to(memory_format=torch.channels_last)
    ours, ref = DDP(copy.deepcopy(base), bucket_cap_mb=1e-4), TorchDDP(copy.deepcopy(base), bucket_cap_mb=1e-4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref)]
    worst = 0.0
    for step in range(4):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        for model, opt in zip((ours, ref), opts):
            model(x).square().mean().backward()
            if model is ours:  # each gradient has its parameter's layout (channels_last), as torch's DDP gives
                wrong = [n for n, q in ours.module.named_parameters() if q.grad is not None and q.grad.stride() != q.stride()]
                assert not wrong, wrong
            opt.step()
            opt.zero_grad()
        worst = max(worst, _max_diff(ours.module, ref.module))
    assert ours.module.conv.weight.stride() != ours.module.conv.weight.contiguous().stride()  # still channels_last
    assert ours.module.frozen.weight.grad is None
    return worst


@pytest.mark.slow
def test_mixed_dtypes_frozen_layers_channels_last():
    assert max(run_distributed(mixed_worker, 3, timeout=120)) <= TOL
