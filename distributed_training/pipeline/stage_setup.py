"""Setting up a rank's stages from the user's model (`PipelineStrategy.setup_module`'s helpers): the
checks and adjustments of half blocks, freeing the layers of other ranks' stages, the autocast a measured
cut times its layers under, the log line describing the cut, and a mesh rank's global rank."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..mesh import global_rank
from ..models.gpt import GPT
from ..runtime import DistributedContext

__all__ = ["autocast_for", "checkpoint_halves", "describe_cut", "free_other_layers", "global_of",
           "refuse_block_hooks"]


def global_of(context: DistributedContext, mesh_rank: int) -> int:
    return global_rank(context.group, mesh_rank)


def refuse_block_hooks(model: GPT) -> None:
    """The chain of halves calls a block's attention and MLP halves, never the block itself: a hook on a
    block (an adapter's, a steering hook) would not run. Refused, naming it (the halves' own hooks run)."""
    for i, block in enumerate(model.blocks):
        if (block._forward_hooks or block._forward_pre_hooks or block._backward_hooks
                or block._backward_pre_hooks):
            raise ValueError(f"pipeline_half_blocks=True runs each GPT block as two halves (attention, MLP) and never "
                             f"calls the block itself, so the hook registered on blocks.{i} would not run: register "
                             f"it on the block's parts (blocks.{i}.attn, blocks.{i}.mlp), or leave "
                             "pipeline_half_blocks off")


def checkpoint_halves(model: GPT, layers) -> None:
    """A block chosen for activation checkpointing (its forward replaced, `activation`) is not called
    when the chain runs its halves: each half of such a block is checkpointed instead."""
    from ..activation import checkpoint_module

    for name, layer in layers:
        parts = name.split(".")
        if len(parts) == 3 and getattr(model.blocks[int(parts[1])], "_dt_checkpointed", False):
            checkpoint_module(layer)


def free_other_layers(model: nn.Module, keep: Sequence[nn.Module]) -> None:
    """Replace the parameters and buffers of `model` that none of `keep` holds by meta tensors (shape
    and dtype kept, storage freed), slot by slot: a tied parameter a kept stage holds stays whole."""
    kept = {id(t) for m in keep for t in (*m.parameters(), *m.buffers())}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in kept and not p.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) not in kept and not b.is_meta:
                module._buffers[name] = torch.empty_like(b, device="meta")


def autocast_for(mixed_precision: str | None, device: torch.device) -> Callable[[], Any] | None:
    """The trainer's autocast (its ``mixed_precision``), for timing the layers as they will run."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "fp32")
    if dtype is None:
        return None
    return lambda: torch.autocast(device.type, dtype=dtype)


def describe_cut(names: Sequence[str], bounds: Sequence[int], costs: Sequence[float] | None, balance: str) -> str:
    """``"embed..block.4 (12.1 ms) | block.5..head (11.8 ms)"``: each stage's first and last layers
    and, when the cut balanced costs, their sum (ms for measured times)."""
    parts = []
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        span = names[a] if b - a == 1 else f"{names[a]}..{names[b - 1]}"
        if costs is not None:
            total = sum(costs[a:b])
            span += f" ({total * 1e3:.2f} ms)" if balance == "time" else f" ({total:.3g})"
        parts.append(span)
    return " | ".join(parts)
