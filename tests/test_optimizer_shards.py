"""A sharded strategy's optimizer must hold the shards it was handed: anything else is an error at
construction, never a silent no-op (ZeRO-3) or silently unsharded training (ZeRO-1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 10), nn.Tanh(), nn.Linear(10, 3))


def ignoring_factory_worker(rank, world, strategy, captured):
    model = _model()
    params = list(model.parameters())
    # The factory ignores its argument: over a list captured before wrapping, or model.parameters().
    if captured == "groups":  # Hugging Face's no-decay recipe, over model.named_parameters()
        def factory(ps):
            named = list(model.named_parameters())
            return torch.optim.SGD([{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.01},
                                    {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}], lr=0.1)
    elif captured:
        factory = lambda ps: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    else:
        factory = lambda ps: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    try:
        trainer = DistributedTrainer(model, factory, strategy=strategy)
    except ValueError as err:
        return str(err)
    # Show what the old code did: one step, then whether any weight moved.
    before = {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.model).items()}
    trainer.train_step((torch.randn(8, 20), torch.randn(8, 3)), nn.functional.mse_loss)
    after = trainer.strategy.model_state_dict(trainer.model)
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    trainer.close()
    return f"no error (weights moved: {moved})"


@pytest.mark.parametrize("strategy, captured", [("zero3", True), ("zero2", True), ("zero1", False), ("zero1", True)])
def test_optimizer_that_ignores_the_shards_is_an_error(strategy, captured):
    messages = run_distributed(ignoring_factory_worker, 2, args=(strategy, captured), timeout=120)
    for msg in messages:
        assert f"strategy '{strategy}'" in msg, msg  # the name the user chose
        assert "holds 4 tensor(s) that are not this rank's shards" in msg, msg
        assert "first: '0.weight' of shape (10, 20)" in msg, msg


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_parameter_groups_over_the_emptied_model_are_an_error(strategy):
    """Groups built over model.named_parameters() after the strategy emptied it: torch accepts empty groups, and
    training silently did nothing."""
    msg = run_distributed(ignoring_factory_worker, 1, args=(strategy, "groups"), timeout=120)[0]
    assert f"strategy '{strategy}': the optimizer holds none of this rank's shards" in msg, msg


def test_zero3_factory_over_emptied_model_parameters_says_why():
    msg = run_distributed(ignoring_factory_worker, 1, args=("zero3", False), timeout=120)[0]
    assert "FSDP moves the model's parameters into this rank's shards" in msg, msg


def foreign_tensor_worker(rank, world):
    model = _model()
    stray = nn.Parameter(torch.zeros(5))
    try:
        DistributedTrainer(model, lambda ps: torch.optim.SGD(list(ps) + [stray], lr=0.1), strategy="ddp")
    except ValueError as err:
        return str(err)
    return "no error"


def test_ddp_optimizer_with_a_tensor_outside_the_model_is_an_error():
    msg = run_distributed(foreign_tensor_worker, 2, timeout=120)[0]
    assert "holds 1 tensor(s) that are not parameters of the wrapped model (first: a tensor of shape (5,))" in msg, msg
