"""Parameters that get no gradient on any rank: DDP leaves their `.grad` None (exact); the flat-shard
strategies (ZeRO-1's bucket slices, ZeRO-2/3's unit vectors) cannot, and say so once, naming them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DDP, FSDP
from distributed_training.strategies.zero1_ddp import Zero1DDP
from distributed_training.testing import run_distributed


class TwoHeads(nn.Module):
    """Blocks (FSDP units) and two heads; `use_b` picks the head, the same on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x, use_b=False):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.b(x) if use_b else self.a(x)


def _spend(wrapped) -> None:
    """What the optimizer's zero_grad does after its step: ZeRO-1 refuses a second synchronised backward
    onto gradients already reduce-scattered (only this rank's slice of them is the average)."""
    if isinstance(wrapped, Zero1DDP):
        wrapped.zero_grad_buckets()


def _warnings_over_steps(rank, world, wrapper, pattern):
    torch.manual_seed(0)
    model = TwoHeads()
    wrapped = {"ddp": lambda: DDP(model, find_unused_parameters=True),
               "zero1": lambda: Zero1DDP(model, find_unused_parameters=True),
               "fsdp": lambda: FSDP(model)}[wrapper]()
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for use_b in pattern:
            F.mse_loss(wrapped(torch.randn(3, 4, generator=g), use_b=use_b), torch.randn(3, 2, generator=g)).backward()
            _spend(wrapped)
    return [str(w.message) for w in caught if "got no gradient" in str(w.message)]


@pytest.mark.parametrize("wrapper", ["zero1", "fsdp"])
def test_flat_shards_name_parameters_unused_on_every_rank_once(wrapper):
    rank0, rank1 = run_distributed(_warnings_over_steps, 2, args=(wrapper, [False, True, False]), timeout=120)
    assert len(rank0) == 1 and "'b.weight'" in rank0[0] and "'b.bias'" in rank0[0], rank0
    assert "'a." not in rank0[0] and "requires_grad=False" in rank0[0], rank0
    assert rank1 == []  # said once, by the group's first rank


def test_ddp_leaves_unused_gradients_none_without_a_warning():
    assert run_distributed(_warnings_over_steps, 2, args=("ddp", [False, True, False]), timeout=120) == [[], []]


@pytest.mark.parametrize("wrapper", ["zero1", "fsdp"])
def test_no_warning_when_every_parameter_trains(wrapper):
    assert run_distributed(_used_everywhere, 2, args=(wrapper,), timeout=120) == [[], []]


class BothHeads(TwoHeads):
    def forward(self, x, use_b=False):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.a(x) + self.b(x)


def _used_everywhere(rank, world, wrapper):
    torch.manual_seed(0)
    model = BothHeads()
    wrapped = Zero1DDP(model, find_unused_parameters=True) if wrapper == "zero1" else FSDP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            F.mse_loss(wrapped(torch.randn(3, 4)), torch.randn(3, 2)).backward()
            _spend(wrapped)
    return [str(w.message) for w in caught if "got no gradient" in str(w.message)]
