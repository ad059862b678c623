"""The checks of an optimizer that a user's own loop builds over `FSDP`, made at its first step.

The trainer builds the optimizer itself (`FSDPStrategy.setup_optimizer`) and checks it there. In a loop of
one's own the wrapper never sees the optimizer, and three mistakes trained silently wrong (a trial):
an optimizer built before wrapping holds the model's old parameters, which no longer receive gradients
(nothing trained); param groups split by ``p.dim()`` or by name over the wrapper's flat 1-D shards put every
shard in one group (weight decay applied to nothing); an optimizer that reads a tensor's shape or whole
norm (Adafactor, LBFGS) ran another algorithm over slices. A global optimizer step pre-hook, registered
with the first wrapper, checks each optimizer once, at its first step, on this rank alone (no collective:
a rank without a step under `join` must not leave the others waiting). So only what every rank finds
alike raises (an optimizer built before wrapping, its class); an empty param group is warned of, since a
shard-aware split may leave a group empty on some ranks only, and a raise there would leave the others
waiting in the next collective.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .base import _lost_group_settings, lost_group_error

__all__ = ["watch_optimizers", "mark_checked"]

_shards: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a wrapper's shard -> the wrapper (weakly)
_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a wrapped model's own parameter -> its name
_checked: weakref.WeakSet = weakref.WeakSet()  # optimizers checked (or built by a strategy, which checks)
_hook: list = []


def watch_optimizers(fsdp, originals: dict[str, torch.Tensor]) -> None:
    """Have the optimizers over `fsdp`'s shards checked at their first step; `originals`: the wrapped
    module's parameters by name, as they were before the wrapper moved them into its shards."""
    for name, param in originals.items():
        _replaced[param] = name
    for shard in fsdp.shards:
        _shards[shard] = weakref.ref(fsdp)
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_first_step))


def mark_checked(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer a strategy built and checked itself (collectively): not checked again."""
    _checked.add(optimizer)


def _first_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _checked:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    taken = [_replaced[p] for p in params if p in _replaced]
    if taken:
        raise ValueError(
            f"the optimizer holds {len(taken)} parameter(s) of a model that FSDP has wrapped since (first: "
            f"'{taken[0]}'): the wrapper moved them into its shards, so they receive no gradient and this step "
            "would train nothing. Build the optimizer after wrapping, over the wrapper's parameters: "
            "torch.optim.AdamW(fsdp_model.parameters(), ...)")
    wrapper = next((w for w in (_shards[p]() for p in params if p in _shards) if w is not None), None)
    if wrapper is not None:
        for said in _lost_group_settings(optimizer).values():
            error = lost_group_error("FSDP's parameters() are", said, "use DDP, whose parameters are the layers' own")
            warnings.warn(f"(this rank's group; if it is empty on every rank) {error}", stacklevel=3)
        from ..trainer_arguments import check_optimizer_layout
        check_optimizer_layout(optimizer, wrapper, tensor_parallel=False)
    _checked.add(optimizer)
