"""The pipeline engine against one process on the whole batch: parameters equal after every step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training.pipeline.engine import PipelineEngine
from distributed_training.testing import run_distributed

STEPS = 3
WIDTH = 8


def _model(layers: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods)


def _batch(step: int, rows: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    length = 3 + step  # the sequence length changes every step: shapes are not fixed
    x = torch.randn(rows, length, WIDTH, generator=g)
    y = torch.randn(rows, length, WIDTH, generator=g)
    return x, y


def _cut(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    layers = list(model)
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(stages)]


def engine_worker(rank, world, schedule, chunks, microbatches, optimizer):
    base = _model(layers=2 * world * chunks)
    reference = copy.deepcopy(base)
    stages = _cut(base, world * chunks)
    mine = [stages[c * world + rank] for c in range(chunks)]
    params = [p for m in mine for p in m.parameters()]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}[optimizer]
    opt, ref_opt = make(params), make(reference.parameters())
    engine = PipelineEngine(mine, ranks=list(range(world)), rank=rank, group=None, schedule=schedule,
                            microbatches=microbatches, loss_fn=F.mse_loss)
    worst, losses = 0.0, []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = engine.step(x, y)
        opt.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
        ref_stages = _cut(reference, world * chunks)
        for c in range(chunks):
            for p, q in zip(mine[c].parameters(), ref_stages[c * world + rank].parameters()):
                worst = max(worst, (p - q).abs().max().item())
    return worst, losses


@pytest.mark.parametrize("schedule,world,chunks,microbatches", [
    ("gpipe", 2, 1, 4), ("1f1b", 2, 1, 4), ("1f1b", 2, 1, 3), ("gpipe", 3, 1, 5),
    pytest.param("1f1b", 4, 1, 8, marks=pytest.mark.slow),
    ("interleaved_1f1b", 2, 2, 4),
])
def test_engine_matches_one_process(schedule, world, chunks, microbatches):
    for rank, (worst, losses) in enumerate(run_distributed(engine_worker, world, args=(schedule, chunks, microbatches,
                                                                                          "sgd"), timeout=120)):
        assert worst <= 1e-5, f"rank {rank}: parameters differ from one process by {worst:.3g}"
        for got, want in losses:  # every rank reports the whole batch's loss
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, got, want)


def test_engine_with_adamw():
    for worst, _ in run_distributed(engine_worker, 2, args=("1f1b", 1, 4, "adamw"), timeout=120):
        assert worst <= 1e-5
