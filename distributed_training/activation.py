"""Activation checkpointing: keep only a module's inputs in forward and recompute it in backward.

`apply_activation_checkpointing(model, policy)` makes every module the policy selects run through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. Non-reentrant checkpointing recomputes
inside the same backward pass, so each parameter's gradient is accumulated once: DDP marks it ready
once, and FSDP's recompute reads weights gathered for that unit's backward. The recompute is the
forward run again: running statistics it updates (BatchNorm's) get back the values the forward left,
so that they are updated once a step, as without checkpointing.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "checkpoint_module", "restore_key_value_cache"]


def _selector(policy: Any) -> Callable[[nn.Module, str], bool]:
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = (policy,)
    if isinstance(policy, (tuple, list, set, frozenset)):
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError("activation_checkpointing as a collection must hold nn.Module classes")
        return lambda module, name: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(f"activation_checkpointing must be module classes or a callable (module, name) -> bool, got {policy!r}")


def apply_activation_checkpointing(model: nn.Module, policy: Any) -> list[str]:
    """Checkpoint the forward of every selected submodule; return their names."""
    select = _selector(policy)
    chosen = []
    for name, module in model.named_modules():
        if name and select(module, name) and not getattr(module, "_dt_checkpointed", False):
            checkpoint_module(module)
            chosen.append(name)
    if not chosen:
        raise ValueError(f"activation_checkpointing policy {policy!r} selected no module of {type(model).__name__}")
    _turn_off_key_value_cache(model)
    return chosen


def _turn_off_key_value_cache(model: nn.Module) -> None:
    """A Hugging Face model's attention layers append each forward's keys and values to a cache while
    ``config.use_cache`` is on (its default): a checkpointed layer's recompute appends them a second
    time, and its backward then fails on a cache twice the sequence long (Hugging Face's own
    checkpointing hands its layers no cache while training). The config's ``use_cache`` is turned off,
    with a warning, until `restore_key_value_cache` (the trainer's ``close()``) turns it on again."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    if configs:
        model._dt_cache_configs = list(configs.values())
        warnings.warn(f"activation_checkpointing: {type(model).__name__}'s config.use_cache is False until the "
                      "trainer's close() (a checkpointed layer's recompute would write its keys and values into the "
                      "cache a second time)", UserWarning, stacklevel=3)


def restore_key_value_cache(model: nn.Module) -> None:
    """Turn ``config.use_cache`` on again where `apply_activation_checkpointing` turned it off."""
    for config in model.__dict__.pop("_dt_cache_configs", ()):
        config.use_cache = True


def checkpoint_module(module: nn.Module) -> None:
    """Checkpoint `module`'s forward (an instance attribute; marked so it is never wrapped twice)."""
    keeping = None
    if any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in module.modules()):
        # (disabled for torch.compile here, not where it is defined: that imports dynamo, whose sympy adds
        # warning filters, with the package)
        keeping = torch.compiler.disable(functools.partial(_keeping_running_statistics, module, module.forward))
    module.forward = functools.partial(_run_checkpointed, module.forward, keeping)
    module._dt_checkpointed = True


class _KeepRunningStatistics:
    """The recompute's context: the running statistics of `module`'s normalisation layers are put back
    to what they were before the recompute updated them a second time."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        # Read now, not when wrapped: `.to()` replaces buffers.
        self.saved = [(b, b.clone()) for m in self.module.modules()
                      if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
                      for b in m.buffers(recurse=False)]

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)


def _run_checkpointed(forward: Callable, keeping: Callable | None, *args, **kwargs):
    """`keeping`: where the module holds normalisation layers whose running statistics a recompute would
    update a second time, `_keeping_running_statistics` over it (else None)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if keeping is None:
        # (no context: torch.compile traces a checkpoint, but not one with a context_fn of one's own, and
        # `compile=` with activation checkpointing failed at the first step under every strategy)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return keeping(*args, **kwargs)


def _keeping_running_statistics(module: nn.Module, forward: Callable, *args, **kwargs):
    """A checkpoint whose recompute puts `module`'s running statistics back. Inside a compiled model it runs
    eagerly, between the compiled graphs: dynamo cannot trace a checkpoint with a context of one's own."""
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), _KeepRunningStatistics(module)), **kwargs)

