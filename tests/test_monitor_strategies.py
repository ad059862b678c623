"""The trainer's monitor on gloo under every data-parallel strategy: training runs and the per-rank
files get written (ZeRO-1's reduce-scatter on gloo is a work without a future, which the overlap
timing once called `get_future` on and crashed)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed


def _fit_with_monitor(rank, world, strategy, log_dir):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    trainer = DistributedTrainer(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
                                 lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, log_dir=log_dir,
                                 log_every=1, progress=False)
    history = trainer.fit(data, epochs=1, criterion=F.cross_entropy, batch_size=4)
    trainer.close()
    return len(history)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_monitor_under_every_strategy_on_gloo(tmp_path, strategy):
    log_dir = str(tmp_path / "runs")
    assert run_distributed(_fit_with_monitor, 2, args=(strategy, log_dir), timeout=120) == [1, 1]
    for rank in range(2):
        with open(os.path.join(log_dir, f"rank_{rank}", "metrics.jsonl"), encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        assert len(lines) == 4 and all("train/loss" in line for line in lines), lines[:2]
