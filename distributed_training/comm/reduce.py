"""How one gradient bucket is reduced: the single pluggable point of the DDP strategy.

A *bucket reducer* is any callable

    reducer(bucket: Tensor, group: ProcessGroup | None) -> handle

that starts reducing the flat 1-D `bucket` across `group` and returns a handle with a `wait()`
method. After `wait()` returns, `bucket` must hold the **mean** over ranks, in place. On CUDA,
`wait()` may be stream-ordered (make the current stream wait) rather than block the host.

The default is `AllReduceMean` (one asynchronous all-reduce). Compression, hierarchical all-reduce
and hand-written ring/tree patterns plug in here by providing another callable.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["BucketReducer", "Waitable", "AllReduceMean", "CompletedWork"]


class Waitable(Protocol):
    def wait(self) -> object: ...


class BucketReducer(Protocol):
    def __call__(self, bucket: torch.Tensor, group: dist.ProcessGroup | None) -> Waitable: ...


class CompletedWork:
    """The handle of work that finished when it was started (a world of one, a synchronous
    collective): `wait()` returns at once. The one such type in the package: reducers, the sharded
    collectives (`comm.sharded`) and the strategies all return it where nothing is left in flight."""

    def wait(self) -> bool:
        return True


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
