"""A model given to the trainer as an adapter's list of (name, module) pairs, names with dots as the
documented GPT-2 adapter writes them ("block.0"): it trains at pipeline size 2 as the same chain does in
one process, with a weight tied between the first and the last layer (a trial found the list refused,
and `nn.Sequential` refusing the dotted names)."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.pipeline import Chain, chain
from distributed_training.testing import run_distributed


class Embed(nn.Module):
    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, idx):
        return self.table(idx)


class Head(nn.Module):
    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, x):
        return (x @ self.table.weight.t()).flatten(0, 1)  # tied with the embedding


def _pairs():
    torch.manual_seed(0)
    table = nn.Embedding(16, 8)
    return [("embed", Embed(table)), ("block.0", nn.Linear(8, 8)), ("block.1", nn.Tanh()),
            ("block.2", nn.Linear(8, 8)), ("head", Head(table))]


def _train(rank, world):
    reference = Chain(_pairs())
    trainer = DistributedTrainer(_pairs(), lambda ps: torch.optim.SGD(ps, lr=0.1), pipeline_parallel_size=2,
                                 microbatches=2, progress=False)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(3):
        idx = torch.randint(0, 16, (4, 5), generator=g)
        y = torch.randint(0, 16, (20,), generator=g)
        trainer.train_step((idx, y), F.cross_entropy)
        F.cross_entropy(reference(idx), y).backward()
        opt.step()
        opt.zero_grad()
        full = trainer.full_state_dict()
        if full:
            want = reference.state_dict()
            assert set(full) == set(want), (sorted(full), sorted(want))
            worst = max(worst, max((full[k] - want[k]).abs().max().item() for k in want))
    trainer.close()
    return worst


def test_an_adapters_list_trains_through_the_trainer_at_pipeline_size_two():
    assert [n for n, _ in chain(Chain(_pairs()))] == ["embed", "block.0", "block.1", "block.2", "head"]
    for worst in run_distributed(_train, 2, timeout=120):
        assert worst <= 1e-6, worst
