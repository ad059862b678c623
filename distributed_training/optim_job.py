"""The `optimizer:` and `schedule:` sections of a `dtrain` config: their rules between fields, and the
optimizer factory and LR scheduler they build for the trainer (see `optim.py` for the algorithms).

Without those sections a job trains as before: torch's AdamW over every parameter at ``training.lr``
and ``training.weight_decay``, no scheduler.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from .logs import get_logger
from .optim import (EXCLUSION_RULES, LAMB, LARS, WarmupSchedule, decay_by_segments, excluded_names, linear_scaling,
                    param_groups)

if TYPE_CHECKING:
    from .config import JobConfig

__all__ = ["check_optimizer_fields", "job_optimizer", "learning_rate"]

log = get_logger("cli")

_EPS = {"adamw": 1e-8, "lamb": 1e-6, "lars": 0.0, "sgd": 0.0}


def _given(section, name: str) -> bool:
    """Set in the config to another value than its default: a config that `dtrain --print-config`
    wrote spells out every default, which must not count as a choice."""
    from .config import given

    return given(section, name)


def check_optimizer_fields(cfg: "JobConfig") -> None:
    """Raise `ConfigError` naming the field(s) for settings that disagree (called by the config's validator)."""
    from .config import ConfigError

    o, s, t = cfg.optimizer, cfg.schedule, cfg.training
    for name in ("lr", "weight_decay"):
        mine = getattr(o, name)
        if mine is not None and _given(t, name) and getattr(t, name) != mine:
            raise ConfigError(f"training.{name} ({getattr(t, name)}) and optimizer.{name} ({mine}) disagree: give "
                              f"one of them (training.{name} is the older spelling of optimizer.{name})")
    if o.nesterov and (o.name not in ("sgd", "lars") or o.momentum == 0):
        raise ConfigError(f"optimizer.nesterov needs optimizer.name sgd or lars with optimizer.momentum > 0, got "
                          f"{o.name!r} with momentum {o.momentum}")
    if o.name in ("lars", "lamb"):
        if t.strategy == "zero1":
            raise ConfigError(f"optimizer.name {o.name!r} needs each layer's whole norm: training.strategy 'zero1' "
                              "hands the optimizer flat shards without layer boundaries; use ddp, zero2 or zero3")
        if t.tensor_parallel_size > 1:
            raise ConfigError(f"optimizer.name {o.name!r} with training.tensor_parallel_size > 1 is not supported "
                              "yet: each rank holds a slice of a layer, whose norm needs the other slices")
    lr = o.lr if o.lr is not None else t.lr
    total = s.total_steps or t.max_steps
    if s.kind in ("cosine", "linear"):
        # Neither given: dtrain counts training.epochs' steps once the data is known (`schedule_steps`).
        if total is not None and total <= s.warmup_steps:
            raise ConfigError(f"schedule.warmup_steps ({s.warmup_steps}) must be less than schedule.total_steps "
                              f"(or training.max_steps): {total}")
    if s.min_lr > lr and s.kind in ("cosine", "linear"):
        raise ConfigError(f"schedule.min_lr ({s.min_lr}) is above the learning rate (optimizer.lr / training.lr: {lr})")
    if s.kind == "step" and not s.milestones:
        raise ConfigError("schedule.kind 'step' needs schedule.milestones, the steps where the learning rate is "
                          "multiplied by schedule.gamma (e.g. [30, 60]); without them it stays constant")
    if s.milestones and s.kind != "step":
        raise ConfigError(f"schedule.milestones are for schedule.kind 'step', not {s.kind!r}")
    if s.milestones != sorted(set(s.milestones)):
        raise ConfigError(f"schedule.milestones must be increasing, got {s.milestones}")
    if s.scale_lr_with_batch and t.global_batch_size is None and t.batch_size == "auto":
        raise ConfigError("schedule.scale_lr_with_batch needs a known batch: training.batch_size 'auto' is chosen "
                          "at start; give a number or training.global_batch_size")


def _global_batch(cfg: "JobConfig") -> int:
    """Samples per optimizer step over the data-parallel replicas (the world from torchrun's WORLD_SIZE)."""
    t = cfg.training
    if t.global_batch_size is not None:
        return t.global_batch_size
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    dp = max(1, world // (t.pipeline_parallel_size * t.tensor_parallel_size))
    return t.batch_size * t.gradient_accumulation_steps * dp


def learning_rate(cfg: "JobConfig") -> float:
    """The job's peak learning rate: optimizer.lr (else training.lr), scaled by the linear scaling
    rule when schedule.scale_lr_with_batch says so."""
    lr = cfg.optimizer.lr if cfg.optimizer.lr is not None else cfg.training.lr
    if cfg.schedule.scale_lr_with_batch:
        return linear_scaling(lr, _global_batch(cfg), cfg.schedule.base_batch_size)
    return lr


def schedule_steps(cfg: "JobConfig", train: Any, data_parallel_size: int, iterable: bool,
                   resumed: dict | None = None) -> int | None:
    """The steps a decaying schedule runs over when neither ``schedule.total_steps`` nor
    ``training.max_steps`` says: ``training.epochs`` passes over `train` at `data_parallel_size`
    replicas (None: no decaying schedule, or a length given). `resumed`: the metadata of the checkpoint
    the job resumes from; its step plus the steps left at this size, where those differ (a job resumed
    at another size, whose per-rank batch makes another global batch), so that the schedule ends where
    training does instead of leaving the last steps at its final rate."""
    from .config import ConfigError
    from .data import ShardedSampler

    s, t = cfg.schedule, cfg.training
    if s.kind not in ("cosine", "linear") or s.total_steps or t.max_steps:
        return None
    why = ("an iterable dataset has no length" if iterable else
           "training.batch_size 'auto' is chosen later" if t.global_batch_size is None and t.batch_size == "auto"
           else "training.epochs is 0" if t.epochs == 0 else None)
    if why is not None:
        raise ConfigError(f"schedule.kind {s.kind!r} decays until schedule.total_steps: give it, or training.max_steps "
                          f"(dtrain cannot count training.epochs' steps: {why})")
    if t.global_batch_size is not None:
        per_epoch = math.ceil(len(train) / t.global_batch_size)
    else:
        per_epoch = math.ceil(len(ShardedSampler(train, data_parallel_size, 0)) / t.batch_size)
    total = max(1, per_epoch) * t.epochs
    step, position = int((resumed or {}).get("step", 0)), (resumed or {}).get("samples_in_epoch")
    if step and position is not None and int(resumed.get("epoch", 0)) < t.epochs:
        # As `fit` counts them: what is left of the current epoch from its sample position, then whole epochs.
        if t.global_batch_size is not None:
            current = math.ceil(max(0, len(train) - int(position)) / t.global_batch_size)
        else:
            sampler = ShardedSampler(train, data_parallel_size, 0)
            sampler.set_epoch(int(resumed.get("epoch", 0)), offset=int(position))
            current = math.ceil(sampler.shard_length() / t.batch_size)
        left = current + (t.epochs - int(resumed.get("epoch", 0)) - 1) * max(1, per_epoch)
        if step + left != total:
            log.info("dtrain: schedule %s over %d steps: the checkpoint's %d and the %d left at %d replica(s) (at this "
                     "size, training.epochs=%d would be %d steps)", s.kind, step + left, step, left, data_parallel_size,
                     t.epochs, total)
            return max(step + left, s.warmup_steps + 1)
    if total <= s.warmup_steps:
        raise ConfigError(f"schedule.warmup_steps ({s.warmup_steps}) must be less than the {total} steps of "
                          f"training.epochs={t.epochs} (or give schedule.total_steps / training.max_steps)")
    log.info("dtrain: schedule %s over %d steps (training.epochs=%d of %d steps)", s.kind, total, t.epochs, per_epoch)
    return total


def _check_exclusions(rules: list[str], model: nn.Module) -> None:
    """A glob of ``optimizer.exclude_from_weight_decay`` that matches none of the model's parameter names
    is a mistake (a typo, or another model's names): `ConfigError` naming it and a few of the names."""
    import fnmatch

    from .config import ConfigError

    names = [name for name, _ in model.named_parameters()]
    for rule in rules:
        if rule not in EXCLUSION_RULES and not any(fnmatch.fnmatchcase(name, rule) for name in names):
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            raise ConfigError(f"optimizer.exclude_from_weight_decay: {rule!r} matches no parameter of "
                              f"{type(model).__name__} (its parameters: {shown}); a glob is matched against "
                              "these names, as in 'head.*', besides the rules bias, norm and embedding")


def job_optimizer(cfg: "JobConfig", model: nn.Module, total_steps: int | None = None
                  ) -> tuple[Callable[[Any], torch.optim.Optimizer], Callable[[torch.optim.Optimizer], Any] | None]:
    """(optimizer factory, LR scheduler factory or None) for the trainer, from `cfg`'s sections;
    `total_steps`: a decaying schedule's length when the config gives none (`schedule_steps`).

    The factory is called by the strategy with what it trains: the model's own parameters (DDP), or
    flat shards (ZeRO / FSDP: each carries its layers' segments, for exclusions and layer-wise norms)."""
    o, s, t = cfg.optimizer, cfg.schedule, cfg.training
    lr = learning_rate(cfg)
    if s.scale_lr_with_batch:
        log.info("dtrain: linear scaling rule: learning rate %g x global batch %d / schedule.base_batch_size %d = %g",
                 o.lr if o.lr is not None else t.lr, _global_batch(cfg), s.base_batch_size, lr)
    wd = o.weight_decay if o.weight_decay is not None else t.weight_decay
    eps = o.eps if o.eps is not None else _EPS[o.name]
    _check_exclusions(o.exclude_from_weight_decay, model)
    exclude = excluded_names(model, o.exclude_from_weight_decay)
    if o.exclude_from_weight_decay and not exclude:
        log.warning("dtrain: optimizer.exclude_from_weight_decay %s matches no parameter of %s",
                    o.exclude_from_weight_decay, type(model).__name__)

    def factory(params):
        params = list(params)
        if exclude:
            names = {id(p): n for n, p in model.named_parameters()}
            # (an empty tensor holds no weight to exclude: a pipeline rank without parameters gets one)
            unknown = [p for p in params if id(p) not in names and getattr(p, "segments", None) is None and p.numel()]
            if unknown:
                raise ValueError("optimizer.exclude_from_weight_decay: the strategy hands the optimizer tensors that "
                                 "are not the model's parameters (flat shards without layer names, e.g. zero1)")
            groups = param_groups(params, names, exclude, wd)
        else:
            groups = [{"params": params, "weight_decay": wd}]
        if o.name in ("adamw", "sgd"):
            optimizer = (torch.optim.AdamW(groups, lr=lr, betas=tuple(o.betas), eps=eps, weight_decay=wd)
                         if o.name == "adamw" else
                         torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=wd))
            decay_by_segments(optimizer)  # flat shards of several layers (ZeRO-2/3): exclusions per element
            return optimizer
        if o.name == "lars":
            return LARS(groups, lr=lr, momentum=o.momentum, weight_decay=wd, trust_coefficient=o.trust_coefficient,
                        eps=eps, nesterov=o.nesterov)
        return LAMB(groups, lr=lr, betas=tuple(o.betas), eps=eps, weight_decay=wd)

    if s.kind == "constant" and not s.warmup_steps:
        return factory, None
    schedule = WarmupSchedule(s.kind, warmup_steps=s.warmup_steps, total_steps=s.total_steps or t.max_steps or total_steps,
                              min_ratio=min(1.0, s.min_lr / lr), milestones=s.milestones, gamma=s.gamma)

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    return factory, scheduler
