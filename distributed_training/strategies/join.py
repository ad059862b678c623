"""Uneven inputs in a user's own loop: ranks that run out of data keep answering the others' collectives.

    with distributed_training.join(model, optimizer=opt):      # or: with model.join(optimizer=opt):
        for x, y in my_loader:                                 # any number of batches per rank
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

Without it, a rank with fewer batches leaves its loop while the others wait forever in their next
gradient all-reduce (or FSDP all-gather). The protocol:

* While a rank trains, a forward pre-hook (registered on the wrapper only inside the context, so
  training outside it pays nothing) all-reduces a few numbers before every forward: "I am training,
  this forward is (or is not) under `no_sync()` and grad mode". `clip_grad_norm_` announces itself the
  same way, with its `max_norm`.
* A rank whose loop ended enters `__exit__` and loops: it all-reduces "I am done". If nobody is still
  training, every rank has finished and all leave together. Otherwise it *shadows* what the others
  announced, issuing exactly the collectives they issue while contributing nothing:

  - `DDP`: the collectives before a synchronised forward (bucket rebuild, buffer broadcast from the
    lowest rank still training), then every gradient bucket with zeros (and the unused-parameter
    bitmap, all zero). No input and no compute are needed.
  - `FSDP`: its all-gathers and reduce-scatters follow the model's own control flow, so the rank
    replays the last input its model saw inside the context with a loss of zero weight (under
    `no_sync()` / `no_grad()` as announced), restoring its buffers afterwards so that BatchNorm
    statistics are not polluted. A rank that ran no forward at all inside the context has nothing to
    replay: every rank then raises the same error naming it, instead of hanging.

  After the others' synchronised backward the rank steps `optimizer` (and `lr_scheduler`) with the
  averaged gradients, before it shadows their next forward and after their `clip_grad_norm_`, as they do,
  so replicas and optimizer states stay identical and FSDP shards keep training.

Gradients are averaged over the *initial* world size: a rank that has left contributes zeros, so
the gradient at a step is the sum over the ranks still training divided by W (what torch's `Join`
does by default). At exit, `DDP` broadcasts parameters and buffers from the last rank to finish, so
every replica leaves identical even without `optimizer` (its optimizer state, though, then missed the
last steps: pass `optimizer` to keep training afterwards). `FSDP` requires `optimizer`: without it the
shard of a rank that left would silently stop training.

Assumptions, as for any collective program: every rank runs the same sequence of forwards, each
forward in grad mode with sync is followed by one backward, and the loop makes no other collective
calls than these (your own all-reduces, or a loss scaler's overflow check, are not shadowed). Each
forward inside the context costs one tiny all-reduce and a host synchronisation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ..comm.collectives import labelled
from ..runtime import collective_device
from .ddp import DDP
from .fsdp import FSDP

__all__ = ["Join", "join"]


def join(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, lr_scheduler: Any = None) -> "Join":
    """The context manager `Join(model, optimizer, lr_scheduler=...)`; see the module docstring."""
    return Join(model, optimizer, lr_scheduler=lr_scheduler)


@dataclass
class _Message:
    active: list[int]  # ranks still training
    sync: int  # how many of them announced a forward outside no_sync()
    grad: int  # ... in grad mode
    clip: int  # how many announced clip_grad_norm_ instead of a forward
    max_norm: float
    empty: list[int]  # ranks out of data with nothing to replay


class Join:
    """Let ranks with fewer batches finish early without hanging the others (`DDP` or `FSDP`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 lr_scheduler: Any = None) -> None:
        if isinstance(model, FSDP):
            if optimizer is None:
                raise ValueError(
                    "join(FSDP model) needs optimizer=: a rank that runs out of data still owns its shards, which "
                    "only its own optimizer can step; without it they would silently stop training"
                )
            self.group = model.process_group
        elif isinstance(model, DDP):
            self.group = model.process_group
        else:
            raise TypeError(f"join() takes a DDP or FSDP model, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.replays = isinstance(model, FSDP)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._device = collective_device(self.group)
        self._handle = None
        self._inputs: tuple[tuple, dict] | None = None
        self._replaying = False
        self._last_active = list(range(self.world))
        self._step_pending = False

    # ------------------------------------------------------------ while training
    def __enter__(self) -> "Join":
        if self.model._join_state is not None:
            raise RuntimeError("this model is already inside a join() context")
        self.model._join_state = self
        self._handle = self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        return self

    def _before_forward(self, module, args, kwargs):
        if self._replaying:
            return None
        if self.replays:
            self._inputs = (args, kwargs)  # a reference, not a copy: the replay input if this rank runs out
        self._exchange(active=True, sync=self.model._sync_enabled, grad=torch.is_grad_enabled())
        return None

    def announce_clip(self, max_norm: float) -> None:
        """Called by the model's `clip_grad_norm_`: ranks out of data clip with the same threshold."""
        if not self._replaying:
            self._exchange(active=True, clip=float(max_norm))

    # ------------------------------------------------------------ after this rank's loop
    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self._shadow_until_every_rank_is_done()
        finally:
            self._handle.remove()
            self.model._join_state = None
            self._inputs = None
            if isinstance(self.model, DDP):
                self.model._buffer_src = 0
        return False  # an exception propagates (peers then fail on their collective timeout)

    def _shadow_until_every_rank_is_done(self) -> None:
        self._drop_gradients()  # from here on this rank contributes zeros
        while True:
            msg = self._exchange(active=False)
            if msg.clip:
                with self._as_shadow():
                    self.model.clip_grad_norm_(msg.max_norm)
                continue
            # The others stepped after their synchronised backward and before this forward (or leaving).
            if self._step_pending:
                self._step()
            if not msg.active:
                break
            if msg.grad and msg.sync:
                self._shadow_forward_backward(sync=True)
                self._step_pending = self.optimizer is not None
            elif msg.grad:
                self._shadow_forward_backward(sync=False)
            elif self.replays:
                self._shadow_forward_backward(sync=bool(msg.sync), grad=False)
            # DDP in no_grad or no_sync issues no collective: nothing to shadow.
        if isinstance(self.model, DDP):
            self._sync_replicas_from(min(self._last_active))

    def _shadow_forward_backward(self, sync: bool, grad: bool = True) -> None:
        if isinstance(self.model, DDP):
            if sync:
                self.model._shadow_iteration()
            return
        args, kwargs = self._inputs  # present: _exchange raised otherwise
        buffers = [b for b in self.model.module.buffers()]
        saved = [b.detach().clone() for b in buffers]
        with self._as_shadow(), torch.set_grad_enabled(grad), \
                (contextlib.nullcontext() if sync else self.model.no_sync()):
            out = self.model(*args, **kwargs)
            if grad:
                tensors = [t for t in tree_flatten(out)[0]
                           if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
                if tensors:
                    # Zero weight: the model's collectives run as in a real backward, the gradient is 0.
                    (sum(t.sum() for t in tensors) * 0.0).backward()
            del out
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)

    def _step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._step_pending = False

    def _drop_gradients(self) -> None:
        for p in self.model.parameters():
            p.grad = None
        if isinstance(self.model, FSDP):
            self.model.drop_accumulated_gradients()  # what no_sync() accumulated

    @torch.no_grad()
    def _sync_replicas_from(self, src: int) -> None:
        if self.world == 1:
            return
        from ..comm.collectives import broadcast_coalesced

        module = self.model.module
        tensors = [p.data for p in module.parameters()] + list(module.buffers())
        with labelled("join() broadcast of the final model"):
            broadcast_coalesced(tensors, self.model._global_rank(src), self.group)

    @contextlib.contextmanager
    def _as_shadow(self):
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    # ------------------------------------------------------------ the announcement
    def _exchange(self, *, active: bool, sync: bool = False, grad: bool = False, clip: float | None = None) -> _Message:
        w = self.world
        t = torch.zeros(5 + 2 * w, dtype=torch.float64)
        if active:
            t[0], t[5 + self.rank] = 1, 1
            if clip is not None:
                t[3], t[4] = 1, clip
            else:
                t[1], t[2] = float(sync), float(grad)
        elif self.replays and self._inputs is None:
            t[5 + w + self.rank] = 1
        if w > 1:
            t = t.to(self._device)
            with labelled("join() all-reduce of who is still training"):
                dist.all_reduce(t, group=self.group)
        v = [round(x) for x in t.tolist()]
        msg = _Message(active=[r for r in range(w) if v[5 + r]], sync=v[1], grad=v[2], clip=v[3],
                       max_norm=float(t[4].item()) / max(1, v[3]), empty=[r for r in range(w) if v[5 + w + r]])
        n = len(msg.active)
        if msg.empty and n:
            raise RuntimeError(
                f"join(): rank(s) {msg.empty} ran out of data before running a single forward inside join(), so they "
                f"have no input to replay for FSDP's collectives while rank(s) {msg.active} still train; give every "
                "rank at least one batch"
            )
        if n and (msg.sync not in (0, n) or msg.grad not in (0, n) or msg.clip not in (0, n)
                  or (msg.clip and (msg.sync or msg.grad))):
            raise RuntimeError(
                f"join(): the ranks still training ({msg.active}) disagree on what comes next: {msg.clip} announced "
                f"clip_grad_norm_, {n - msg.clip} a forward ({msg.grad} in grad mode, {msg.sync} outside no_sync()); "
                "every rank must run the same sequence of forwards and clip_grad_norm_ calls"
            )
        if n:
            self._last_active = msg.active
            if isinstance(self.model, DDP):
                self.model._buffer_src = min(msg.active)  # a rank that left has stale buffers
        return msg
