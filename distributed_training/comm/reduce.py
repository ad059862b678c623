"""How one gradient bucket is reduced: the single pluggable point of the DDP strategy.

A *bucket reducer* is any callable

    reducer(bucket: Tensor, group: ProcessGroup | None) -> handle

that starts reducing the flat 1-D `bucket` across `group` and returns a handle with a `wait()`
method. After `wait()` returns, `bucket` must hold the **mean** over ranks, in place. On CUDA,
`wait()` may be stream-ordered (make the current stream wait) rather than block the host.

The default is `AllReduceMean` (one asynchronous all-reduce). Compression, hierarchical all-reduce
and hand-written ring/tree patterns plug in here by providing another callable.

`ReduceScatterMean` is the one reducer with a weaker contract, for ZeRO-1 (`strategies/zero1.py`):
the bucket is padded to a multiple of the world size W, and after `wait()` only this rank's slice of
it, elements [r * S, (r + 1) * S) with S = numel / W, holds the mean; the rest is left undefined. Any
all-reducing reducer satisfies that contract too (at twice the bytes).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from .sharded import reduce_scatter_flat
from .work import CompletedWork, Waitable

__all__ = ["BucketReducer", "Waitable", "AllReduceMean", "ReduceScatterMean", "CompletedWork"]


class BucketReducer(Protocol):
    def __call__(self, bucket: torch.Tensor, group: dist.ProcessGroup | None) -> Waitable: ...


class AllReduceMean:
    """Average a bucket with one asynchronous all-reduce.

    NCCL averages inside the collective (`ReduceOp.AVG`); gloo has no AVG, so the bucket is divided
    by the world size first and summed, which is also what PyTorch's DDP does (dividing first keeps
    fp16 sums from overflowing).
    """

    def __call__(self, bucket: torch.Tensor, group: dist.ProcessGroup | None) -> Waitable:
        world_size = dist.get_world_size(group)
        if world_size == 1:
            return CompletedWork()
        if dist.get_backend(group) == "nccl":
            return dist.all_reduce(bucket, op=dist.ReduceOp.AVG, group=group, async_op=True)
        bucket.div_(world_size)
        return dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=group, async_op=True)


class ReduceScatterMean:
    """Leave in this rank's slice of a bucket the mean over ranks of that slice, with one asynchronous
    reduce-scatter: (W - 1) / W of the bucket on the wire, half of an all-reduce.

    The bucket must be padded to a multiple of the world size. On NCCL the reduce-scatter runs in
    place, its output being the rank's own slice of its input (NCCL's documented in-place form: receive
    buffer = send buffer + rank * count) and the mean taken inside the collective. Other backends divide
    by the world size first, reduce-scatter into a separate slice and copy it in on `wait()`: in-place
    aliasing is not part of their contract. Either way the other slices keep this rank's own
    contribution (divided by W off NCCL) and must not be read as a mean.
    """

    def __call__(self, bucket: torch.Tensor, group: dist.ProcessGroup | None) -> Waitable:
        world = dist.get_world_size(group)
        if world == 1:
            return CompletedWork()
        if bucket.numel() % world:
            raise ValueError(f"a reduce-scattered bucket must be padded to a multiple of the world size {world}, "
                             f"got {bucket.numel()} elements")
        size = bucket.numel() // world
        rank = dist.get_rank(group)
        own = bucket[rank * size : (rank + 1) * size]
        if dist.get_backend(group) == "nccl":
            return reduce_scatter_flat(own, bucket, group, async_op=True)
        out = torch.empty_like(own)
        return _CopyWhenDone(reduce_scatter_flat(out, bucket, group, async_op=True), out, own)


class _CopyWhenDone:
    """A collective writing into `source`: `wait()` waits for it, then copies `source` into `target`.
    `works` is what DDP's overlap timeline looks for in a handle."""

    def __init__(self, work, source: torch.Tensor, target: torch.Tensor) -> None:
        self.works = [work]
        self._copy: tuple | None = (source, target)

    def wait(self) -> bool:
        if self._copy is not None:
            for work in self.works:
                work.wait()
            source, target = self._copy
            target.copy_(source)
            self._copy = None
        return True
