"""Collectives on flat shards, and re-sharding a flat tensor saved at one world size for another.

A flat tensor of `numel` elements is padded to a multiple of the world size W and cut into W equal
shards; rank r holds elements [r * S, (r + 1) * S) with S = ceil(numel / W). Knowing only (numel, W),
anyone can say which saved shards overlap a new shard: that is all re-sharding needs.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from .collectives import all_gather_single, reduce_scatter_single
from .work import CompletedWork, Waitable

__all__ = ["shard_size", "all_gather_flat", "reduce_scatter_flat", "reshard_flat"]


def shard_size(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) if numel else 0


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True) -> Waitable:
    """`out` (W * S elements) <- every rank's `shard` (S elements), in rank order.

    Returns a handle to `wait()` on: the collective's, or a `CompletedWork` when nothing is left in
    flight (a world of one, or ``async_op=False``)."""
    if dist.get_world_size(group) == 1:
        out.copy_(shard)
        return CompletedWork()
    work = all_gather_single(out, shard, group=group, async_op=async_op)
    return work if work is not None else CompletedWork()


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group, async_op: bool = True) -> Waitable:
    """`out` (S elements) <- the mean over ranks of this rank's slice of `full` (W * S elements).

    Returns a handle to `wait()` on, as `all_gather_flat` does."""
    world = dist.get_world_size(group)
    if world == 1:
        out.copy_(full)
        return CompletedWork()
    if dist.get_backend(group) == "nccl":
        work = reduce_scatter_single(out, full, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    else:
        full.div_(world)
        work = reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work if work is not None else CompletedWork()


def reshard_flat(
    numel: int,
    old_world: int,
    read_old_shard: Callable[[int], torch.Tensor],
    new_world: int,
    new_rank: int,
) -> torch.Tensor:
    """This rank's shard at `new_world`, assembled from the shards saved at `old_world`.

    `read_old_shard(k)` returns old rank k's shard; only the old shards that overlap the new one are
    read. The result is padded with zeros past `numel`.
    """
    new_size = shard_size(numel, new_world)
    old_size = shard_size(numel, old_world)
    start, stop = new_rank * new_size, min((new_rank + 1) * new_size, numel)
    pieces = []
    if stop > start:
        for k in range(start // old_size, (stop - 1) // old_size + 1):
            old = read_old_shard(k)
            lo, hi = max(start, k * old_size), min(stop, (k + 1) * old_size)
            pieces.append(old[lo - k * old_size : hi - k * old_size])
    out = torch.cat(pieces) if pieces else torch.empty(0)
    if out.numel() < new_size:
        pad_like = read_old_shard(0) if not pieces else pieces[0]
        out = torch.cat([out.to(pad_like.dtype), torch.zeros(new_size - out.numel(), dtype=pad_like.dtype)])
    return out
