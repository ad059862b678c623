"""FSDP against one process on the whole batch, every parameter after every step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import FSDP, MixedPrecision
from distributed_training.testing import run_distributed

from _models import MLP, tiny_gpt
from _once import once_per_key

TOL = 1e-5
STEPS = 4
PER_RANK = 4


class DeepOdd(nn.Module):
    """Layer sizes chosen so that no unit's flat size divides by 2, 3 or 4: every shard is padded."""

    def __init__(self) -> None:
        super().__init__()
        dims = [7, 13, 11, 5, 3]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.inner(x)) + x


class Nested(nn.Module):
    """Units inside units: `blocks.i` are units and so are their `inner` parts."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Outer() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _case(case: str):
    torch.manual_seed(0)
    if case == "gpt_tied":
        return tiny_gpt(), {}
    if case == "gpt_zero2":
        return tiny_gpt(), {"reshard_after_forward": False}
    if case == "deep_odd":
        return DeepOdd(), {"auto_wrap_policy": 1}
    if case == "nested":
        return Nested(), {"auto_wrap_policy": {Outer, nn.Sequential}}
    if case == "mlp_per_layer":
        return MLP(), {"auto_wrap_policy": {nn.Linear}}
    if case == "float64_gather":
        return MLP(), {"auto_wrap_policy": {nn.Linear}, "mixed_precision": MixedPrecision(torch.float64, torch.float64)}
    if case == "hybrid":
        return tiny_gpt(), {"sharding_strategy": "hybrid", "ranks_per_node": 2}
    if case == "cpu_offload":
        return MLP(), {"cpu_offload": True}
    raise KeyError(case)


def _batch(case: str, step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    n = PER_RANK * world
    if case.startswith("gpt") or case == "hybrid":
        idx = torch.randint(0, 64, (n, 16), generator=g)
        return idx, torch.roll(idx, -1, 1)
    d_in, d_out = {"deep_odd": (7, 3), "nested": (16, 4)}.get(case, (16, 4))
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def _loss(model, case, x, y):
    if case.startswith("gpt") or case == "hybrid":
        return model(x, y)
    out = model(x)
    return F.mse_loss(out, y.to(out.dtype))


def _optim(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def fsdp_parity_worker(rank, world, case, optim, accumulate, clip):
    base, kwargs = _case(case)
    if optim == "adamw":
        # Adam divides by the root of the second moment: float32 rounding in near-zero gradients
        # (different but equally valid summation orders) grows to ~1e-5 within steps. In float64
        # the comparison measures the algorithm, not the rounding.
        base = base.double()
    reference = copy.deepcopy(base)
    fsdp = FSDP(copy.deepcopy(base), **kwargs)
    opt, ref_opt = _optim(optim, fsdp.parameters()), _optim(optim, reference.parameters())
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(case, step, world)
        if optim == "adamw" and x.is_floating_point():
            x = x.double()
        xs, ys = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        if accumulate:
            h = PER_RANK // 2
            with fsdp.no_sync():
                (_loss(fsdp, case, xs[:h], ys[:h]) / 2).backward()
            (_loss(fsdp, case, xs[h:], ys[h:]) / 2).backward()
        else:
            _loss(fsdp, case, xs, ys).backward()
        if clip:
            norm = fsdp.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()

        _loss(reference, case, x, y).backward()
        if clip:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            assert abs(norm.item() - ref_norm.item()) <= 1e-5 * max(1, ref_norm.item()), (norm, ref_norm)
        ref_opt.step()
        ref_opt.zero_grad()

        full = fsdp.full_state_dict()
        if rank == 0:
            expected = reference.state_dict()
            assert list(full) == list(expected), (list(full), list(expected))
            worst = max(worst, max((full[k].float() - expected[k].float()).abs().max().item() for k in expected))
    return worst, fsdp.unit_names()


CASES = [
    ("gpt_tied", "sgd", False, None),
    ("gpt_tied", "adamw", False, None),
    ("gpt_zero2", "sgd", False, None),
    ("deep_odd", "sgd", False, None),
    ("nested", "adamw", False, None),
    ("mlp_per_layer", "sgd", True, None),
    ("mlp_per_layer", "sgd", False, 0.05),
    ("float64_gather", "sgd", False, None),
    ("cpu_offload", "adamw", False, None),
]


def fsdp_cases_worker(rank, world, cases):
    """`fsdp_parity_worker` for each case in turn, in one launch (each case seeds itself and builds its own
    model, reference and optimizers, as in a launch of its own); any failure fails the launch."""
    return [fsdp_parity_worker(rank, world, *case) for case in cases]


@pytest.fixture(scope="module")
def parity_results():
    """``parity_results(world)``: rank 0's (worst difference, unit names) per case of CASES at that world
    size, from one launch of all the cases (made on first use; a failed launch fails each of its tests)."""
    return once_per_key(lambda world: run_distributed(fsdp_cases_worker, world, args=(CASES,), timeout=240)[0])


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case, optim, accumulate, clip", CASES, ids=[f"{c[0]}-{c[1]}{'-acc' if c[2] else ''}{'-clip' if c[3] else ''}" for c in CASES])
def test_fsdp_matches_single_process(world, case, optim, accumulate, clip, parity_results):
    worst, units = parity_results(world)[CASES.index((case, optim, accumulate, clip))]
    assert worst <= TOL, f"{case}: differs from one process by {worst:.3g}"
    if case == "nested":
        assert "blocks.0" in units and "blocks.0.inner" in units, units


def test_hybrid_sharding_world4_two_per_node():
    worst, _ = run_distributed(fsdp_parity_worker, 4, args=("hybrid", "sgd", False, None), timeout=120)[0]
    assert worst <= TOL, worst
