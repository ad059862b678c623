"""Where a backward begins, for the wrappers that queue work at its end (`DDP`, `FSDP`).

A hook on a forward's outputs is the first thing a backward through them reaches, on the outermost pass:
reentrant activation checkpointing runs a backward inside the outer one, and work queued from inside it
(a parameter's hook) would run at the nested pass's end, before the rest of the model's gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["on_backward_start", "inside_backward", "output_tensors"]


def on_backward_start(outputs: Any, fn: Callable[[], Any]) -> None:
    """Call `fn()` when a backward first reaches any tensor of `outputs` that autograd computed. Not the
    leaves among them: a parameter returned as an output (a learned loss weight) would keep one hook per
    forward for good, and its backward is the parameter's own."""
    tensors = [t for t in output_tensors(outputs) if t.grad_fn is not None]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: fn(), mode="any")


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """The tensors in `outputs`: torch's pytree containers (tuples, lists, dicts, Hugging Face outputs),
    and a dataclass's fields, which pytree leaves closed."""
    found = []
    for leaf in tree_flatten(outputs)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


def inside_backward() -> bool:
    """Whether autograd is running a backward on this thread (a reentrant checkpoint's recomputed forward)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
