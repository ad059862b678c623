"""Frozen parameters mixed with trainable ones inside one FSDP unit (ZeRO-2, ZeRO-3, hybrid): every
parameter after every step equals one process on the whole batch, frozen ones never move by a bit,
and the full state dict and the sharded checkpoint round-trip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import FSDP, DistributedTrainer, FSDPStrategy
from distributed_training.testing import run_distributed

TOL = 1e-10
STEPS = 4
PER_RANK = 3
VOCAB, DIM, SEQ = 32, 16, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.attn(self.norm(x))))


class FrozenMix(nn.Module):
    """A frozen embedding beside a trainable head (the root unit), a frozen half-block (block 0's
    `attn`), and a module frozen by halves (block 1's norm weight, not its bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.embed.weight.requires_grad_(False)
        self.blocks[0].attn.requires_grad_(False)
        self.blocks[1].norm.weight.requires_grad_(False)

    def forward(self, idx, targets):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


FROZEN = {"embed.weight", "blocks.0.attn.weight", "blocks.0.attn.bias", "blocks.1.norm.weight"}


def _model():
    torch.manual_seed(0)
    return FrozenMix().double()


def _batch(step, world):
    g = torch.Generator().manual_seed(50 + step)
    idx = torch.randint(0, VOCAB, (PER_RANK * world, SEQ), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _optim(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def frozen_parity_worker(rank, world, kwargs, optim):
    base = _model()
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    reference = copy.deepcopy(base)
    fsdp = FSDP(copy.deepcopy(base), **kwargs)
    opt, ref_opt = _optim(optim, fsdp.parameters()), _optim(optim, reference.parameters())
    worst, moved = 0.0, []
    for step in range(STEPS):
        x, y = _batch(step, world)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        fsdp(x[sl], y[sl]).backward()
        opt.step()
        opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        full = fsdp.full_state_dict()
        if rank == 0:
            expected = reference.state_dict()
            assert list(full) == list(expected)
            worst = max(worst, max((full[k] - expected[k]).abs().max().item() for k in expected))
            moved += [f"{k} at step {step + 1}" for k in FROZEN if not torch.equal(full[k], initial[k])]
    # The frozen parameters have shards of their own, which the optimizer never gives a state.
    frozen_shards = [u.shard for u in fsdp._units if not u.shard.requires_grad and u.padded]
    stateful = [s for s in frozen_shards if opt.state.get(s)]
    # A full state dict loads back into a fresh wrapper and gives the same model.
    full = fsdp.full_state_dict(rank0_only=False)
    other = FSDP(FrozenMix().double(), **kwargs)
    other.load_full_state_dict(full)
    again = other.full_state_dict(rank0_only=False)
    round_trip = all(torch.equal(full[k], again[k]) for k in full)
    return worst, moved, len(frozen_shards), len(stateful), round_trip, fsdp.unit_names()


CASES = {
    "zero3": {},
    "zero2": {"reshard_after_forward": False},
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("stage", list(CASES))
def test_frozen_and_trainable_in_one_unit_match_one_process(stage, optim, world):
    worst, moved, frozen_shards, stateful, round_trip, units = run_distributed(
        frozen_parity_worker, world, args=(CASES[stage], optim), timeout=180)[0]
    assert worst <= TOL, f"differs from one process by {worst:.3g}"
    assert not moved, f"frozen parameters moved: {moved}"
    assert "#frozen" in units and "blocks.0#frozen" in units and "blocks.1#frozen" in units, units
    assert frozen_shards == 3 and stateful == 0, (frozen_shards, stateful)
    assert round_trip


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("world, ranks_per_node", [(2, 1), (4, 2)])
def test_frozen_in_one_unit_with_hybrid_sharding(optim, world, ranks_per_node):
    kwargs = {"sharding_strategy": "hybrid", "ranks_per_node": ranks_per_node}
    worst, moved, _, stateful, round_trip, _ = run_distributed(
        frozen_parity_worker, world, args=(kwargs, optim), timeout=180)[0]
    assert worst <= TOL and not moved and stateful == 0 and round_trip, (worst, moved, stateful)


def checkpoint_worker(rank, world, directory, phase):
    """Train 2 steps and save (phase 'save'); or load and train 2 more (phase 'load'), at any world."""
    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=0.01,
                                                                     weight_decay=0.1), strategy=FSDPStrategy())
    steps = range(2) if phase == "save" else range(2, 4)
    if phase == "load":
        trainer.load_checkpoint(directory)
    for step in steps:
        x, y = _batch(step, world)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        trainer.train_step((x[sl], y[sl]))
    if phase == "save":
        trainer.save_checkpoint(directory)
    state = trainer.strategy.model_state_dict(trainer.model)
    trainer.close()
    return state


@pytest.mark.slow
def test_frozen_checkpoint_round_trip_and_reshard(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(checkpoint_worker, 2, args=(directory, "save"), timeout=180)
    resumed = run_distributed(checkpoint_worker, 3, args=(directory, "load"), timeout=180)[0]
    # One process, same four steps (the batch of step s is split over 2 ranks, then over 3: the
    # whole batch is what one process sees at 2 ranks; at 3 ranks, the 3-rank whole batch).
    reference = _model()
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
    for step in range(4):
        x, y = _batch(step, 2 if step < 2 else 3)
        reference(x, y).backward()
        opt.step()
        opt.zero_grad()
    expected = reference.state_dict()
    initial = _model().state_dict()
    for k in expected:
        assert (resumed[k] - expected[k]).abs().max().item() <= TOL, k
    for k in FROZEN:
        assert torch.equal(resumed[k], initial[k]), k
