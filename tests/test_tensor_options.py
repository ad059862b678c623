"""A tensor-parallel plan at tensor_parallel_size 1: checked, not applied, so that one config (or one
script) runs the model whole and split by changing the size alone; the training equals the plain model's
after every step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.config import ConfigError, load_config
from distributed_training.tensor.options import TensorOptions

PLAN = {"0": "colwise", "2": "rowwise"}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_plan_at_size_one_is_checked_and_not_applied():
    assert not TensorOptions(1, PLAN).enabled
    with pytest.raises(ValueError, match="sideways"):
        TensorOptions(1, {"0": "sideways"})  # still checked
    cfg = load_config({"training": {"tensor_parallel_size": 1, "tensor_parallel_plan": PLAN}})
    assert cfg.training.tensor_parallel_plan == PLAN
    with pytest.raises(ConfigError, match="training.tensor_parallel_plan"):
        load_config({"training": {"tensor_parallel_size": 1, "tensor_parallel_plan": {"0": "sideways"}}})


def test_a_plan_at_size_one_trains_as_the_plain_model():
    trainer = DistributedTrainer(_mlp(), lambda ps: torch.optim.SGD(ps, lr=0.1), tensor_parallel_size=1,
                                 tensor_parallel_plan=PLAN, progress=False)
    reference = _mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        trainer.train_step((x, y), F.mse_loss)
        F.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
        mine = trainer.full_state_dict()
        assert all(torch.equal(mine[k], v) for k, v in reference.state_dict().items())
    assert isinstance(trainer.module[0], nn.Linear) and trainer.module[0].weight.shape == (16, 8)  # not split
    trainer.close()
