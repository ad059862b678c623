"""The ``optimizer:`` and ``schedule:`` sections of the `dtrain` config (`distributed_training.config`).

    optimizer: {name: lamb, lr: 4e-3, weight_decay: 0.01, exclude_from_weight_decay: [bias, norm]}
    schedule:  {kind: cosine, warmup_steps: 500, min_lr: 1e-5, scale_lr_with_batch: true}

Their fields only: the rules between them and the optimizer and LR scheduler they build are in
`optim_job` (which `JobConfig`'s validator calls), the algorithms in `optim`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from .config_fields import Float, Int, PositiveFloat, PositiveInt, Section

__all__ = ["OptimizerConfig", "ScheduleConfig"]


class OptimizerConfig(Section):
    name: Literal["adamw", "sgd", "lars", "lamb"] = "adamw"
    """adamw / sgd: torch's; lars / lamb: ours (layer-wise trust ratios for large batches, see optim.py)."""
    lr: Optional[PositiveFloat] = None
    """Peak learning rate (null: training.lr), times schedule.scale_lr_with_batch's factor; the schedule's
    warm-up climbs to it."""
    weight_decay: Optional[Annotated[Float, Field(ge=0)]] = None
    """Weight decay (null: training.weight_decay): decoupled for adamw / lamb, L2 for sgd / lars."""
    momentum: Annotated[Float, Field(ge=0, lt=1)] = 0.9
    """sgd / lars: momentum, in [0, 1)."""
    nesterov: bool = False
    """sgd / lars: Nesterov momentum (needs momentum > 0)."""
    betas: Annotated[list[Annotated[Float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.9, 0.999]
    """adamw / lamb: the moments' decay rates [beta1, beta2]."""
    eps: Optional[Annotated[Float, Field(ge=0)]] = None
    """adamw / lamb: added to the second moment's root; lars: to the trust ratio's denominator (null: 1e-8
    adamw, 1e-6 lamb, 0 lars)."""
    trust_coefficient: PositiveFloat = 0.001
    """lars: eta, the largest relative change of a layer in one step."""
    exclude_from_weight_decay: list[Annotated[str, Field(min_length=1)]] = []
    """Parameters without weight decay (nor, for lars / lamb, trust ratio): bias, norm (normalisation
    layers), embedding, or a glob on parameter names ("head.*": one that matches no parameter is an
    error). Not with strategy zero1 (its flat shards say no layers; zero2 / zero3 shards do)."""


class ScheduleConfig(Section):
    kind: Literal["constant", "cosine", "linear", "step"] = "constant"
    """After the warm-up: constant, cosine or linear decay to min_lr at total_steps, or step (x gamma
    at each of ``milestones``, which it needs)."""
    warmup_steps: Annotated[Int, Field(ge=0)] = 0
    """Optimizer steps of linear warm-up: step s (from 0) trains at lr * (s + 1) / warmup_steps."""
    total_steps: Optional[PositiveInt] = None
    """The optimizer step where cosine / linear reach min_lr (null: training.max_steps, else the steps of
    training.epochs, which dtrain counts from the data at start). Steps after it stay at min_lr."""
    min_lr: Annotated[Float, Field(ge=0)] = 0.0
    """cosine / linear: the learning rate at total_steps."""
    milestones: list[Annotated[Int, Field(ge=1)]] = []
    """step: the steps where the learning rate is multiplied by gamma (increasing)."""
    gamma: Annotated[Float, Field(gt=0, le=1)] = 0.1
    """step: the factor at each milestone."""
    scale_lr_with_batch: bool = False
    """Linear scaling rule (Goyal et al. 2017): lr x global batch / base_batch_size, the global batch
    being training.global_batch_size, else batch_size x gradient_accumulation_steps x data-parallel
    size (the run says so)."""
    base_batch_size: PositiveInt = 256
    """scale_lr_with_batch: the global batch the learning rate was tuned for."""
