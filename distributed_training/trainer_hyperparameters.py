"""A resumed run's hyperparameters: what changed since its checkpoint, applied and said.

A mixin of `DistributedTrainer` (under `trainer_checkpoint_loading.CheckpointLoading`). Loading an
optimizer's state brings back the saved param groups' settings and a scheduler's state its old
schedule; a run resumed with another configuration (a new lr, warm-up or weight decay) gets the new
values back, and each change is described in words for the resume message.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

__all__ = ["HyperparameterRestore", "hyperparameters"]


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A copy of each param group's settings (lr, betas, weight decay, ...), without the parameters."""
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return repr(value)


def _steps_of(state: dict[str, Any]) -> int | None:
    """How many times a scheduler whose state this is was stepped (counting its construction's step): its
    ``last_epoch``, or a `ChainedScheduler`'s first scheduler's (it keeps none of its own: its resumes
    restarted the schedule); None for a state that says neither."""
    if "last_epoch" in state:
        return int(state["last_epoch"])
    inner = state.get("_schedulers")
    return _steps_of(inner[0]) if isinstance(inner, list) and inner and isinstance(inner[0], dict) else None


def _lambda_changes(saved: Any, now: Any) -> list[str]:
    """What differs between two `LambdaLR` states' ``lr_lambdas``, field by field, in words
    (``lr schedule warmup_steps: 4 -> 6``). Each entry is a schedule object's fields (a plain function's
    is None, and a field holding a function cannot be compared: both are left out; the learning rate
    they give is compared anyway). Changes the same for every param group are said once."""
    saved, now = list(saved or []), list(now or [])
    if len(saved) != len(now):
        return [f"lr schedule: {len(saved)} -> {len(now)} param group schedules"]
    per_group = []
    for old, new in zip(saved, now):
        if not isinstance(old, dict) or not isinstance(new, dict):
            per_group.append([])
            continue
        per_group.append([f"{key}: {_show(old.get(key))} -> {_show(new.get(key))}"
                          for key in sorted(set(old) | set(new), key=str)
                          if not callable(old.get(key)) and not callable(new.get(key))
                          and not _same(old.get(key), new.get(key))])
    if not per_group:
        return []
    if all(group == per_group[0] for group in per_group):
        return [f"lr schedule {change}" for change in per_group[0]]
    return [f"lr schedule param_groups[{i}].{change}" for i, group in enumerate(per_group) for change in group]


class HyperparameterRestore:
    """`_apply_changed_hyperparameters` and `_restore_schedule`, on the trainer's `optimizer`,
    `lr_scheduler`, `_configured_hparams` (`hyperparameters` at construction) and `_configured_schedule`."""

    def _apply_changed_hyperparameters(self, meta: dict[str, Any]) -> list[str]:
        """Loading the optimizer's state brings back the saved param groups' hyperparameters: where this
        trainer was configured differently from the run that wrote the checkpoint, put the new value
        back, and describe the change. Values the run itself changed (a schedule's lr) are left alone."""
        saved = meta.get("optimizer_hparams")
        groups = self.optimizer.param_groups
        if saved is None or len(saved) != len(groups):
            return []  # a checkpoint from before hyperparameters were recorded
        changes = []
        for i, (old, new, group) in enumerate(zip(saved, self._configured_hparams, groups)):
            for key, value in new.items():
                if self.lr_scheduler is not None and key in ("lr", "initial_lr"):
                    continue  # the schedule is rebuilt from its new configuration (see _restore_schedule)
                if key in old and not _same(old[key], value):
                    group[key] = copy.deepcopy(value)
                    where = f"param_groups[{i}]." if len(groups) > 1 else ""
                    changes.append(f"optimizer {where}{key}: {_show(old[key])} -> {_show(value)}")
        return changes

    def _configured_rates(self, schedule: bool) -> list[Any]:
        """Put the configured learning rates back into the param groups (the loaded ones are the saved run's,
        a schedule's last), with a `schedule`'s ``initial_lr`` as configured, or without one (none now: a
        schedule built later by hand sets it again); return each group's rate."""
        for group, configured in zip(self.optimizer.param_groups, self._configured_hparams):
            if "lr" in configured:
                group["lr"] = copy.deepcopy(configured["lr"])
            if schedule and "initial_lr" in configured:
                group["initial_lr"] = copy.deepcopy(configured["initial_lr"])
            elif not schedule:
                group.pop("initial_lr", None)
        return [group["lr"] for group in self.optimizer.param_groups]

    def _drop_schedule(self, saved: dict[str, Any]) -> list[str]:
        """The checkpoint had an LR schedule and this run has none: the configured learning rates apply
        from here on, as if there had never been one (the loaded param groups hold the schedule's last)."""
        lrs = self._configured_rates(schedule=False)
        was = f" (its learning rate {_show(saved['_last_lr'])})" if "_last_lr" in saved else ""
        return [f"lr_scheduler: the checkpoint's schedule{was} -> none: the configured learning rate {_show(lrs)} "
                "applies"]

    def _restore_schedule(self, saved: dict[str, Any], step: int) -> list[str]:
        """Bring the LR scheduler to the checkpoint's step *as it is configured now*.

        Loading the saved scheduler state would bring back the old run's base learning rates and
        schedule parameters. Instead the scheduler is reset to its state at construction and stepped
        as many times as the saved one was (microseconds per step); with an unchanged configuration that
        reproduces the saved state exactly, and with a changed one (lr, warmup, decay, a schedule given
        as a function) the new schedule applies from here on. Returns what differs from the saved state.
        `step`: the checkpoint's, the count where a state keeps none of its own (`_steps_of`).
        """
        sched, fresh = self.lr_scheduler, self._configured_schedule
        self._configured_rates(schedule=True)
        sched.load_state_dict(copy.deepcopy(fresh))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": we only replay
            taken, at_start = _steps_of(saved), _steps_of(fresh)
            for _ in range((step if taken is None else taken) - (at_start or 0)):
                sched.step()
        now = sched.state_dict()
        counters = {"last_epoch", "_step_count", "_last_lr", "_is_initial", "_get_lr_called_within_step"}
        changes = [f"lr_scheduler {key}: {_show(saved.get(key))} -> {_show(now.get(key))}"
                   for key in sorted(set(saved) | set(now), key=str)
                   if key not in counters | {"lr_lambdas"} and not _same(saved.get(key), now.get(key))]
        changes += _lambda_changes(saved.get("lr_lambdas"), now.get("lr_lambdas"))
        if "_last_lr" in saved and not _same(saved["_last_lr"], now.get("_last_lr")):
            changes.append(f"learning rate at step {step}: "
                           f"{_show(saved['_last_lr'])} -> {_show(now.get('_last_lr'))}")
        return changes
