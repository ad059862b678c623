"""FSDP's public helpers besides the wrapper itself: `summon_full_params()` (every module's full weights
inside it, sharded again after) and `sharded_state_dict` / `load_sharded_state_dict` across world sizes."""

from __future__ import annotations

import copy

import torch
from torch import nn

from distributed_training import FSDP
from distributed_training.testing import run_distributed


def _summon(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    plain = copy.deepcopy(model)
    wrapped = FSDP(model, auto_wrap_policy={nn.Linear})
    with wrapped.summon_full_params():
        inside = all(torch.equal(model[i].weight, plain[i].weight) and torch.equal(model[i].bias, plain[i].bias)
                     for i in (0, 2))
    sharded = all(not u.gathered for u in wrapped._units)
    return inside, sharded


def test_summon_full_params_shows_every_weight_then_reshards():
    assert run_distributed(_summon, 2, timeout=60) == [(True, True), (True, True)]


def _save_sharded(rank, world, directory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    wrapped = FSDP(model, auto_wrap_policy={nn.Linear})
    for p in wrapped.parameters():  # weights that are not the seed's
        with torch.no_grad():
            p.add_(0.1 * (rank + 1))
    torch.save(wrapped.sharded_state_dict(), f"{directory}/rank{rank}.pt")
    return wrapped.full_state_dict(rank0_only=False)


def _load_sharded(rank, world, directory, saved_world):
    torch.manual_seed(1)
    wrapped = FSDP(nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3)), auto_wrap_policy={nn.Linear})
    wrapped.load_sharded_state_dict(lambda r: torch.load(f"{directory}/rank{r}.pt", weights_only=False))
    return wrapped.full_state_dict(rank0_only=False)


def test_sharded_state_dict_saved_at_two_loads_at_three(tmp_path):
    """`sharded_state_dict` per rank at world 2, `load_sharded_state_dict` of every rank's at world 3: the
    full parameters equal the saved ones on every rank."""
    saved = run_distributed(_save_sharded, 2, args=(str(tmp_path),), timeout=60)[0]
    for loaded in run_distributed(_load_sharded, 3, args=(str(tmp_path), 2), timeout=60):
        assert set(loaded) == set(saved)
        for key in saved:
            if "running" not in key and "num_batches" not in key:  # buffers are per-rank state
                assert torch.equal(loaded[key], saved[key]), key
