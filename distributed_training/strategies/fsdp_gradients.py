"""FSDP's gradients (`FSDP`'s part for them): each unit's full gradient reduce-scattered into this
rank's shard as soon as autograd has accumulated it (`_on_unit_grad`), the end of the backward
(`_finish_backward`: the reductions waited for, averaged over the replicas under hybrid sharding, added
to the shards' ``.grad``), `no_sync` accumulation and `sync_gradients` after it (a pipeline stage), the
cleanup after a backward that raised (`_drop_backward`), and clipping by the global norm."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..comm.sharded import reduce_scatter_flat
from .base import norm_dtype
from .fsdp_units import Unit

__all__ = ["FSDPGradients"]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class FSDPGradients:
    """The gradient half of `FSDP` (a mixin: the units, groups and flags are `FSDP`'s)."""

    def _queue_finish(self, recomputing: bool = False) -> None:
        # Inside backward grad mode is on only with create_graph=True, or in a checkpoint's recomputation.
        if torch.is_grad_enabled() and not recomputing:
            raise RuntimeError(
                "FSDP / ZeRO-2/3 does not support double backward (torch.autograd.grad(..., create_graph=True) or "
                "backward(create_graph=True) through the wrapped model, e.g. a gradient penalty): the end of that "
                "backward frees the units' gathered weights, which the second backward still needs. Use strategy "
                "'ddp' or 'zero1' for gradient penalties")
        if not self._backward_state.callback_queued:
            self._backward_state.callback_queued = True
            _queue_callback(self._finish_backward)

    def _on_unit_grad(self, unit: Unit) -> None:
        self._queue_finish()
        if not self._sync_enabled:
            # no_sync: keep the full gradient; autograd accumulates into it next time (or, with a wider
            # reduce dtype, we add it to the unit's sum in that dtype).
            self._hold_in_reduce_dtype(unit)
            if not unit.is_root and not self._hold_until_sync:
                self._reshard(unit)
            return
        self._reduce_unit(unit)
        if not unit.is_root:
            self._reshard(unit)

    def _hold_in_reduce_dtype(self, unit: Unit) -> None:
        """Under `no_sync`, where gradients are reduced in a wider dtype than the gathered parameters':
        add the unit's full gradient to its sum in the reduce dtype (`Unit.held_grad`), as the reduction
        would sum replicas, so that accumulating many micro-batches rounds once, not at each add."""
        grad = unit.full.grad
        if grad is None or self._reduce_dtype is None or grad.dtype == self._reduce_dtype:
            return
        if unit.held_grad is None:
            unit.held_grad = grad.to(self._reduce_dtype)
        else:
            unit.held_grad.add_(grad)
        unit.full.grad = None

    def _accumulated(self, unit: Unit) -> torch.Tensor | None:
        """The unit's whole accumulated full gradient as one tensor (its `held_grad` with the latest
        pass's added), or None without one; the unit's `held_grad` is let go."""
        self._hold_in_reduce_dtype(unit)
        held, unit.held_grad = unit.held_grad, None
        if held is not None:
            return held
        return unit.full.grad

    def _reduce_unit(self, unit: Unit) -> None:
        """Start the reduce-scatter of the unit's full gradient into this rank's piece (pending until
        `_finish_backward`), and drop the full gradient."""
        grad = self._accumulated(unit)
        if self._reduce_dtype is not None and grad.dtype != self._reduce_dtype:
            grad = grad.to(self._reduce_dtype)
        out = torch.empty(unit.padded // self.shard_world, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter_flat(out, grad, self.shard_group, async_op=True)
        # The collective keeps its input alive until it completes (NCCL stashes it, gloo's work owns
        # it): dropping our reference here frees each unit's full gradient as soon as it is reduced.
        self._backward_state.pending.append((unit, out, work))
        unit.full.grad = None
        del grad

    def _drop_backward(self) -> None:
        """What a backward that raised left behind, dropped (as one process's ``zero_grad`` after it
        would): its reduce-scatters waited for (every rank issued them) but not added to the shards'
        gradients, its queued end forgotten, the units freed."""
        state = self._backward_state
        try:
            for _, _, work in state.pending:
                with self.waits.waiting(self.device):
                    work.wait()
        finally:
            state.pending = []
            state.callback_queued = False
            for unit in self._units:
                self._reshard(unit)

    def _finish_backward(self, reshard: bool | None = None) -> None:
        if reshard is None:
            reshard = self._sync_enabled or not self._hold_until_sync
        try:
            for unit, out, work in self._backward_state.pending:
                try:
                    with self.waits.waiting(self.device):
                        work.wait()
                except RuntimeError as err:
                    raise RuntimeError(
                        f"FSDP reduce-scatter of unit '{unit.name or '<root>'}' failed: {err}"
                    ) from err
            if self.replicate_world > 1:
                works = []
                for _, out, _ in self._backward_state.pending:
                    if dist.get_backend(self.replicate_group) == "nccl":
                        works.append(dist.all_reduce(out, op=dist.ReduceOp.AVG, group=self.replicate_group, async_op=True))
                    else:
                        out.div_(self.replicate_world)
                        works.append(dist.all_reduce(out, group=self.replicate_group, async_op=True))
                with self.waits.waiting(self.device):
                    for w in works:
                        w.wait()
            for unit, out, _ in self._backward_state.pending:
                if not unit.shard.requires_grad:
                    # A shard the user froze after wrapping (``for p in fsdp.parameters(): p.requires_grad_(False)``,
                    # a GAN's discriminator during the generator's step): reduced like the others (every rank ran
                    # this backward), then left without a gradient, as torch leaves a frozen parameter; it
                    # trained on before, silently.
                    continue
                grad = out.to(unit.shard.device, unit.shard.dtype, non_blocking=True)
                if unit.shard.grad is None:
                    unit.shard.grad = grad
                else:
                    unit.shard.grad += grad
            if self._backward_state.pending and self._join_state is None:  # (a synchronised pass, every rank)
                self._unused_watch.after_backward(self._units, self.process_group, self.device)
            if self._sync_enabled:
                self.waits.count_pass()
        finally:
            self._backward_state.pending = []
            self._backward_state.callback_queued = False
            if reshard:
                for unit in self._units:
                    self._reshard(unit)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shards' gradients (`nn.Module.zero_grad`) and the units' full gradients accumulated under
        `no_sync`, which an optimizer over the shards never sees: a loop that drops a half-accumulated
        batch (a micro-batch that raised) calls this, as the trainer does (its optimizer's ``zero_grad``
        does both, `FSDPStrategy.setup_optimizer`)."""
        super().zero_grad(set_to_none)
        self.drop_accumulated_gradients()

    def drop_accumulated_gradients(self) -> None:
        """Forget the units' full gradients that backward passes under `no_sync` accumulated."""
        for unit in self._units:
            unit.full.grad = None
            unit.held_grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full (unsharded) gradients locally; the next backward outside reduces once."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def sync_gradients(self) -> None:
        """Reduce, now, the full gradients that backward passes accumulated under `no_sync`: each unit's
        is reduce-scattered into this rank's shard (then averaged over the replicas under hybrid
        sharding) and added to the shard's ``.grad``, as the first synchronised backward after the
        block would do; the full gradients are freed. Units without an accumulated gradient are left
        alone (every rank of the group must hold the same ones, as for a backward).

        For schedules whose last backward cannot be the synchronised one: a pipeline stage runs all
        of a step's backward passes under `no_sync` and calls this once after them (see
        `DDP.sync_gradients`). Every rank of the group must call it at the same point."""
        if self._backward_state.callback_queued:
            raise RuntimeError("sync_gradients() called during a synchronised backward pass; call it after backward, "
                               "with the backward passes run under no_sync()")
        for unit in self._units:
            if unit.full.requires_grad and (unit.full.grad is not None or unit.held_grad is not None):
                self._reduce_unit(unit)
        self._finish_backward(reshard=True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the global 2-norm over all shards; return the norm."""
        if norm_type != 2.0:
            raise ValueError("FSDP.clip_grad_norm_ supports the 2-norm only")
        if self._join_state is not None:
            self._join_state.announce_clip(max_norm)  # ranks out of data join this all-reduce
        grads = [u.shard.grad for u in self._units if u.shard.grad is not None]
        comm_device = self.device if dist.get_backend(self.shard_group) == "nccl" else torch.device("cpu")
        dtype = norm_dtype([u.shard for u in self._units])
        total = torch.zeros((), dtype=dtype, device=comm_device)
        for g in grads:
            total += g.detach().to(dtype).pow(2).sum().to(comm_device)
        if self.shard_world > 1:
            dist.all_reduce(total, group=self.shard_group)
        norm = total.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
        return norm


class _BackwardState:
    """Per-backward bookkeeping: the queued finishing callback and the reductions in flight."""

    __slots__ = ("callback_queued", "pending")

    def __init__(self) -> None:
        self.callback_queued = False
        self.pending: list[tuple[Unit, torch.Tensor, Any]] = []
