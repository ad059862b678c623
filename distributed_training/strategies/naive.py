"""The obvious data parallelism: one all-reduce per parameter after backward.

Not for production: it sends hundreds of small messages and none of them overlaps backward. It is the
teaching twin of `DDP` and the oracle its tests compare against, so it is kept as short and as
plainly correct as possible.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import broadcast_coalesced

__all__ = ["NaiveDDP"]


class NaiveDDP(nn.Module):
    """`DDP`'s contract without buckets or overlap.

    After backward (outside `no_sync()`), each parameter's gradient is summed over ranks and divided
    by the world size. A parameter without a gradient contributes zeros, and ends with a zero
    gradient rather than `None`.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self._sync_enabled = True
        self._callback_queued = False
        with torch.no_grad():
            broadcast_coalesced(list(module.parameters()) + list(module.buffers()), 0, process_group)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self._sync_enabled and self.broadcast_buffers:
            for b in self.module.buffers():
                dist.broadcast(b, src=0, group=self.process_group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        if self._sync_enabled and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._all_reduce_gradients)

    def _all_reduce_gradients(self) -> None:
        self._callback_queued = False
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.process_group)
            p.grad.div_(self.world_size)
