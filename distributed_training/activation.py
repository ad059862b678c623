"""Activation checkpointing: keep only a module's inputs in forward and recompute it in backward.

`apply_activation_checkpointing(model, policy)` makes every module the policy selects run through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. Non-reentrant checkpointing recomputes
inside the same backward pass, so each parameter's gradient is accumulated once: DDP marks it ready
once, and FSDP's recompute reads weights gathered for that unit's backward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "checkpoint_module"]


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
    return chosen


def checkpoint_module(module: nn.Module) -> None:
    """Checkpoint `module`'s forward (an instance attribute; marked so it is never wrapped twice)."""
    module.forward = functools.partial(_run_checkpointed, module.forward)
    module._dt_checkpointed = True


def _run_checkpointed(forward: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
