"""ZeRO stage 1's wrapper, `Zero1DDP`: every rank holds the whole model, the optimizer state is sharded
1/W, and gradients are reduce-scattered into the shard each rank owns. The trainer strategy that uses
it, `Zero1Strategy` (``"zero1"``), is in `zero1.py`.

Layout. `Zero1DDP` is our bucketed `DDP` with one change of layout: every gradient bucket (one
(device, dtype), ``bucket_cap_mb``, parameters in reverse registration order) is padded to a multiple
of the world size W and cut into W equal slices, and rank r owns slice r of *every* bucket. The
parameters are re-homed into one flat buffer per bucket laid out like it (``p.data`` is a view), just as
each ``p.grad`` is a view into the bucket. The optimizer is built over one tensor per bucket: slice r of
its parameter buffer (a view, so the step updates the model in place), whose ``.grad`` is slice r of
the gradient bucket (a view too). Optimizer state is therefore 1/W per rank, and there is no copy
between the model's gradients and the optimizer's.

One step:

1. Backward. When a bucket's last gradient has been accumulated, one asynchronous reduce-scatter
   (`comm.reduce.ReduceScatterMean`) leaves the mean over ranks in slice r of the bucket. Buckets launch
   in index order from DDP's hooks, overlapped with the rest of backward; on CUDA the collective is
   queued after the stream that produced the gradients and the wait at the end of backward is
   stream-ordered, exactly as DDP's all-reduce. Only slice r is a mean afterwards: the rest of the
   bucket keeps this rank's own contribution.
2. Clipping (optional, `Zero1DDP.clip_grad_norm_`): the global norm is the root of the all-reduced sum
   of squares of every rank's slices; each rank scales its own slices.
3. ``optimizer.step()`` updates slice r of every parameter buffer; a post-step hook launches one
   asynchronous all-gather per buffer (in place on NCCL), so that every rank's parameters become whole
   again, and returns without waiting (see "Overlap" below).
4. ``optimizer.zero_grad()`` also zeroes the gradient buckets (the model's ``.grad`` views stay, so the
   next backward accumulates into them with no allocation or copy). A reduce-scatter consumes the
   gradients it reduces, so gradients cannot accumulate across *synchronised* backwards: accumulate
   under ``no_sync()``, as the trainer does.

Overlap of the all-gather with the next forward (``overlap_param_gather=True``, the default). The
post-step hook launches the buffers' all-gathers from the last bucket to the first: buckets are built
in reverse registration order, so the last one holds the first layers, which the next forward needs
first. Each module that owns parameters (``module.parameters(recurse=False)``; a tied weight has two
owners) gets a forward pre-hook that, the first time it runs after a step, waits for the all-gathers of
the buckets holding its parameters. On NCCL that wait is stream-ordered (the compute stream waits for
the collective; the host does not block), so the first layers compute while later buckets are still
on the wire; on gloo it blocks the host until that bucket has arrived. A safety net waits for
whatever is still in flight before anything else reads or writes the parameters: the next backward
(`Zero1Strategy.backward`, else the first gradient hook), the next ``optimizer.step()``,
``state_dict()``/``load_state_dict()``/``parameters()`` of the wrapper, the strategy's checkpoint and
state-dict methods and ``unwrap`` (so ``DistributedTrainer.module`` is always whole), ``remove_hooks``
and ``teardown``. What no hook can see: reading ``wrapper.module``'s parameters directly (call
``wrapper.wait_for_parameters()`` first), and a forward that reads a parameter outside the forward of a
module that owns it (``F.linear(x, self.head.weight)`` in a parent). The latter raises an error naming
the parameter when its gradient arrives, if its owner never ran in that forward; if its owner runs
later in the same forward it goes undetected, so call ``wait_for_parameters()`` before such a forward
or pass ``overlap_param_gather=False``, which waits for every all-gather inside the step, as before.
Under ``torch.compile`` (of the wrapper, of the module or of its blocks) the pre-hooks stay out of
compiled graphs, which would otherwise guard on how many all-gathers are in flight (recompiling) and
break at each wait; instead, when compiled code is about to run the module, the wrapper's forward
waits for every all-gather first (on NCCL still stream-ordered): compiled, the forward does not
overlap the all-gathers.
Buffers broadcast at the start of a forward (``broadcast_buffers``, BatchNorm) queue behind the
all-gathers on NCCL, so a model with buffers gets less of this overlap.

On the wire per step: a reduce-scatter of the gradients and an all-gather of the parameters, each
(W - 1) / W of the model, which together are the volume of one all-reduce, as under DDP.

Other reducers. A bucket reducer that all-reduces (leaves the mean in the whole bucket) satisfies the
same layout, at the price of an all-reduce instead of a reduce-scatter: that is what ``communication=``
(a `CommunicationOptimizer`) and ``bucket_reducer=`` do here. Top-K (all-gathered index/value pairs that
differ by rank) and PowerSGD (low-rank factors of the whole bucket) have no reduce-scatter form, and the
bf16/fp16 casts, hierarchical and ring/tree patterns are written as all-reduces, so ZeRO-1 with any
`CommunicationOptimizer` falls back to that (compressed) all-reduce followed by the all-gather; uncompressed,
that is 1.5x the bytes of the default reduce-scatter.

Differences from DDP + a full optimizer:

* The bucket layout is fixed when the model is wrapped (reverse registration order, not re-ordered
  after the first iteration): the optimizer's shards are slices of it. ``rebuild_buckets=True`` is an
  error, and a checkpoint resumes only under the same bucket caps.
* A parameter that gets no gradient on any rank (``find_unused_parameters=True``) has a zero gradient
  inside its shard rather than none, so momentum and weight decay still move it, as in every flat-shard
  ZeRO. One that is unused on some ranks only is averaged like any other.
* After backward the model's ``.grad`` is the mean only in this rank's slices (see 1).
* ``join()`` is not supported: the optimizer step runs a collective that a rank out of data would issue
  out of order.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.bucket import Bucket
from ..comm.reduce import ReduceScatterMean
from ..comm.sharded import all_gather_flat
from ..runtime import collective_device
from .base import norm_dtype
from .ddp import DDP
from .eager import eager_only

__all__ = ["Zero1DDP"]


class _BucketShard:
    """One gradient bucket's parameter buffer, and this rank's slices of it and of the bucket.

    Attributes:
        numel: elements of the bucket's parameters (the buffers hold `size * world` >= numel).
        size: elements of one rank's slice.
        flat: the parameter buffer; the bucket's parameters are views into it.
        param: slice r of `flat`, what the optimizer holds.
        grad: slice r of the gradient bucket, `param`'s gradient.
    """

    def __init__(self, bucket: Bucket, params: list[nn.Parameter], world: int, rank: int) -> None:
        buffer = bucket.buffer
        self.numel = sum(v.numel() for v in bucket.views)
        self.size = buffer.numel() // world
        self.flat = torch.zeros_like(buffer)
        self.members: list[tuple[nn.Parameter, int]] = []  # each parameter and where it starts in `flat`
        with torch.no_grad():
            for index, view in zip(bucket.param_indices, bucket.views):
                p = params[index]
                start = view.storage_offset() - buffer.storage_offset()
                piece = self.flat[start : start + view.numel()]
                piece.copy_(p.detach().reshape(-1))
                p.data = piece.view_as(p)  # the parameter now lives in the buffer, laid out like its gradient
                self.members.append((p, start))
        lo, hi = rank * self.size, (rank + 1) * self.size
        self.lo, self.hi = lo, hi
        self.param = nn.Parameter(self.flat[lo:hi])
        self.grad = buffer[lo:hi]


class _Gathers:
    """The parameter all-gathers launched by the last step and not yet waited for. A plain object,
    not module attributes: the gradient hook reads and updates it on autograd's thread, where an
    ``nn.Module`` attribute assignment is slow (see `DDP`)."""

    __slots__ = ("works", "in_flight", "unwaited")

    def __init__(self, buckets: int) -> None:
        self.works: list = [None] * buckets  # per bucket: its all-gather's handle while in flight
        self.in_flight = 0                   # how many of `works` are not None
        self.unwaited: frozenset[int] = frozenset()  # buckets still in flight when the backward began


class Zero1DDP(DDP):
    """`DDP` whose buckets are reduce-scattered into the slice each rank owns (see the module docstring).

    Takes `DDP`'s arguments; the default bucket reducer is `ReduceScatterMean`, and buckets are never
    rebuilt. `shards` holds one `_BucketShard` per bucket, in bucket order.

    Args:
        overlap_param_gather: after a step, leave the parameters' all-gathers in flight and let each
            module's forward pre-hook wait for its own buckets (default); False waits for all of them
            inside the step. With it on, read ``self.module``'s parameters only after
            `wait_for_parameters()` (the wrapper's own ``parameters()`` and ``state_dict()`` wait).
    """

    def __init__(self, module: nn.Module, *, overlap_param_gather: bool = True, **ddp_kwargs: Any) -> None:
        if ddp_kwargs.get("rebuild_buckets", False):
            raise ValueError("ZeRO-1 cannot rebuild_buckets: each rank's optimizer shard is a slice of every bucket, "
                             "so the bucket layout is fixed when the model is wrapped (pass rebuild_buckets=False "
                             "or leave it out)")
        ddp_kwargs["rebuild_buckets"] = False
        if ddp_kwargs.get("communication") is None and ddp_kwargs.get("bucket_reducer") is None:
            ddp_kwargs["bucket_reducer"] = ReduceScatterMean()
        super().__init__(module, **ddp_kwargs)
        self.shards = [_BucketShard(b, self._params, self.world_size, self.rank) for b in self._buckets]
        self._gathers = _Gathers(len(self.shards))
        self._overlap_param_gather = bool(overlap_param_gather) and self.world_size > 1
        self._gather_hooks: list = []
        # Set once a synchronised backward has reduce-scattered the buckets, cleared when they are zeroed
        # (optimizer.zero_grad()): a gradient accumulated onto them in between would be reduced twice.
        self._reduced = False
        if self._overlap_param_gather:
            self._register_gather_hooks()

    # Contiguous views: the shards hold the parameters themselves (made contiguous below) in the logical
    # order the checkpoint pieces use, and each gradient must lie where its parameter does.
    _bucket_keep_layout = False

    @property
    def _bucket_pad_to(self) -> int:  # read by DDP when it allocates the buckets
        return self.world_size

    @property
    def overlap_param_gather(self) -> bool:
        """Whether a step leaves the parameters' all-gathers in flight for the next forward to wait for."""
        return self._overlap_param_gather

    def join(self, optimizer=None, *, lr_scheduler=None):
        raise RuntimeError("join() is not supported with ZeRO-1: its optimizer step all-gathers the parameters, a "
                           "collective that a rank out of data would issue out of order; use strategy 'ddp' or "
                           "'zero3', or give every rank the same number of batches")

    def _finish_backward(self, outside_backward: bool = False) -> None:
        sync = self._backward.sync_enabled or outside_backward
        super()._finish_backward(outside_backward)
        if sync and not self._shadowing:
            self._reduced = True

    def _read_held(self, held: list[int]) -> torch.Tensor:
        # Gradients live in the buckets: a `.grad` held is a bucket view, zeroed after each step, so what
        # counts is whether it holds anything (what no_sync micro-batches fed it). One multi-tensor norm
        # on the device, before the reduce-scatter overwrites this rank's shard of it.
        return torch.stack(torch._foreach_norm([self._params[i].grad for i in held])).ne(0)

    def _used_flags(self, ready: list[bool], held: list[int], read: torch.Tensor | None) -> torch.Tensor:
        used = super()._used_flags(ready, [], None)
        if held:
            used.index_copy_(0, torch.tensor(held, device=used.device), read.to(used.device, used.dtype))
        return used

    def _unready_everywhere(self, indices: list[int]) -> None:
        # No rank reached them in this backward and none holds a gradient for them (`_used_flags`): the
        # flat shards give them zeros, which momentum or weight decay still act on. Named once.
        self._report_unused(indices)

    def _report_unused(self, indices: list[int]) -> None:
        if not indices or getattr(self, "_unused_reported", False) or self.rank != 0:
            return
        self._unused_reported = True
        names = [self._param_names[i] for i in indices]
        shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        warnings.warn(
            f"ZeRO-1: {len(names)} parameter(s) got no gradient on any rank in this backward pass: {shown}. The "
            "optimizer's shards are slices of the gradient buckets, so they get a zero gradient there instead of "
            "none (as in every flat-shard ZeRO), and an optimizer with momentum or weight decay still moves them, "
            "where one process or DDP would leave them alone. Freeze them (requires_grad=False) if they never "
            "train, or use DDP for exact skipping.", stacklevel=2)

    # ------------------------------------------------------------- parameter all-gathers
    def forward(self, *args, **kwargs):
        self._settle_for_compile(torch.compiler.is_compiling())
        return super().forward(*args, **kwargs)

    @eager_only
    def _settle_for_compile(self, compiling: bool) -> None:
        """Wait for every all-gather still in flight when compiled code is about to run the module:
        the forward is being compiled (`compiling`, true only while dynamo traces the wrapper), or
        the module holds compiled parts (``torch.compile(model)``, ``block.compile()``). Compiled code
        skips the per-module pre-hooks (see `_make_gather_hook`), so it must start from whole
        parameters; eager forwards keep the overlap."""
        if self._gathers.in_flight and (compiling or _holds_compiled(self.module)):
            self.wait_for_parameters()

    def _register_gather_hooks(self) -> None:
        """A forward pre-hook on every module that owns a bucketed parameter, waiting for its buckets."""
        bucket_of = {id(p): i for i, s in enumerate(self.shards) for p, _ in s.members}
        self_ref = weakref.ref(self)
        for m in self.module.modules():
            owned = sorted({bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of})
            if owned:
                self._gather_hooks.append(m.register_forward_pre_hook(_make_gather_hook(self_ref, tuple(owned))))

    def _wait_for_buckets(self, indices) -> None:
        gathers = self._gathers
        for i in indices:
            work = gathers.works[i]
            if work is None:
                continue
            gathers.works[i] = None
            gathers.in_flight -= 1
            try:
                work.wait()
            except RuntimeError as err:
                raise RuntimeError(f"rank {self.rank}: ZeRO-1 all-gather of parameter bucket {i + 1}/"
                                   f"{len(self.shards)} failed: {err}") from err

    def wait_for_parameters(self) -> None:
        """Wait for the parameter all-gathers the last step left in flight: afterwards every parameter
        of ``self.module`` is whole and up to date (on NCCL: for work queued on the current stream).

        Needed before reading or writing ``self.module``'s parameters other than through its forward:
        the wrapper's ``parameters()``, ``state_dict()`` and the strategy's methods call it already."""
        gathers = getattr(self, "_gathers", None)  # absent while DDP.__init__ runs
        if gathers is not None and gathers.in_flight:
            self._wait_for_buckets(range(len(self.shards) - 1, -1, -1))  # in launch order

    def _settle_before_backward(self) -> None:
        """Wait for every all-gather still in flight when a backward begins, remembering which: a
        gradient for a parameter of one of them means the forward read it before it was gathered."""
        gathers = self._gathers
        if gathers.in_flight:
            gathers.unwaited = frozenset(i for i, w in enumerate(gathers.works) if w is not None)
            self.wait_for_parameters()

    def _on_grad_ready(self, index: int) -> None:
        gathers = self._gathers
        if gathers.in_flight:  # a backward the strategy did not start (the user's loss.backward())
            self._settle_before_backward()
        if gathers.unwaited and self._bucket_of[index] in gathers.unwaited:
            raise RuntimeError(
                f"rank {self.rank}: parameter '{self._param_names[index]}' was used in the forward before its "
                "ZeRO-1 all-gather was waited for, so it may have held its value from before the last step: the "
                "forward read it outside the forward of every module that owns it (e.g. a parent module using "
                "`self.head.weight` while `head` never runs), or compiled code ran the module without going through "
                "the wrapper (compiled code skips the per-module waits). Call model.wait_for_parameters() before "
                "such a forward, or use Zero1Strategy(overlap_param_gather=False)")
        if self._reduced and self._params[index].grad is self._view_of[index]:
            raise RuntimeError(
                f"rank {self.rank}: a backward pass accumulated into parameter '{self._param_names[index]}' after a "
                "synchronised backward had already reduce-scattered its gradient, before optimizer.zero_grad(). "
                "ZeRO-1's reduce-scatter leaves only this rank's slice of each bucket averaged, so a second "
                "synchronised backward before the step (two losses backpropagated separately, retain_graph=True, "
                "manual accumulation without no_sync) would average wrongly. Sum the losses into one backward, "
                "run the earlier backward passes under model.no_sync(), or use strategy 'ddp' / 'zero2' / 'zero3'")
        super()._on_grad_ready(index)

    def named_parameters(self, *args, **kwargs):
        self.wait_for_parameters()
        return super().named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        self.wait_for_parameters()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.wait_for_parameters()
        return super().load_state_dict(*args, **kwargs)

    def remove_hooks(self) -> None:
        """Wait for the parameters, then remove DDP's gradient hooks and the all-gather pre-hooks (later
        steps, if any, then wait for their all-gathers inside the step)."""
        try:
            self.wait_for_parameters()
        finally:  # a failed all-gather (a peer gone) still leaves no hook behind
            self._remove_gather_hooks()
            super().remove_hooks()

    def _remove_gather_hooks(self) -> None:
        for h in self._gather_hooks:
            h.remove()
        self._gather_hooks = []
        self._overlap_param_gather = False

    def __del__(self):  # no collective wait while being collected: only drop the hooks
        try:
            self._remove_gather_hooks()
            DDP.remove_hooks(self)
        except Exception:
            pass

    # ------------------------------------------------------------- step
    def attach_shard_grads(self) -> None:
        """Point each optimizer shard's `.grad` at its slice of the gradient bucket (before a step)."""
        for s in self.shards:
            if s.param.grad is None or s.param.grad.data_ptr() != s.grad.data_ptr():
                s.param.grad = s.grad

    def prepare_step(self) -> None:
        """Before ``optimizer.step()``: the parameters whole (the step writes the slices that a pending
        all-gather reads), and each shard's `.grad` attached."""
        self.wait_for_parameters()
        self.attach_shard_grads()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every parameter buffer from the ranks' updated slices (after a step).

        With `overlap_param_gather` the all-gathers are left in flight, launched from the last bucket
        to the first (the order the next forward needs them), and each is waited for by the forward
        pre-hook of a module that owns its parameters or by the safety net (`wait_for_parameters`);
        otherwise this waits for all of them."""
        if self.world_size == 1:
            return
        self.wait_for_parameters()  # a previous step's, if nothing has waited for them yet
        in_place = dist.get_backend(self.process_group) == "nccl"  # NCCL's documented in-place all-gather
        gathers = self._gathers
        gathers.unwaited = frozenset()
        for i in range(len(self.shards) - 1, -1, -1):
            s = self.shards[i]
            # Off NCCL, gather from a copy: in-place aliasing is not part of those backends' contract.
            gathers.works[i] = all_gather_flat(s.flat, s.param.detach() if in_place else s.param.detach().clone(),
                                               self.process_group, async_op=True)
            gathers.in_flight += 1
        if not self._overlap_param_gather:
            self.wait_for_parameters()

    @torch.no_grad()
    def zero_grad_buckets(self) -> None:
        """Zero every gradient bucket in place, and drop a parameter's gradient that is not (yet) a view
        into one (a first step's passes under `no_sync`, or a backward that raised, before any reduction
        made it a view; the optimizer, which steps the buckets' slices, never sees these): the next
        backward starts from zero."""
        for b in self._buckets:
            b.buffer.zero_()
        for p, view in zip(self._params, self._view_of):
            if p.grad is not None and p.grad is not view:
                p.grad = None
        self._reduced = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm over all ranks' slices; return the norm.

        Every rank computes the norm of its own slices, the p-th powers are summed by one all-reduce
        (the maximum for the inf-norm), and each rank scales its slices: the result equals
        `torch.nn.utils.clip_grad_norm_` over the averaged full gradients. Collective: every rank calls it."""
        if self._join_state is not None:
            self._join_state.announce_clip(max_norm)
        norm_type = float(norm_type)
        grads = [s.grad for s in self.shards]
        device = collective_device(self.process_group, grads[0].device if grads else None)
        dtype = norm_dtype([s.flat for s in self.shards])
        if grads:
            norms = torch.stack([n.to(dtype) for n in torch._foreach_norm(grads, norm_type)]).to(device)
            local = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
        else:
            local = torch.zeros((), dtype=dtype, device=device)
        if self.world_size > 1:
            op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=self.process_group)
        total = local if norm_type == float("inf") else local.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for g in grads:
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return total


def _make_gather_hook(self_ref: "weakref.ReferenceType[Zero1DDP]", owned: tuple[int, ...]):
    """A forward pre-hook for a module whose parameters live in buckets `owned`: the first time it runs
    after a step, it waits for those buckets' all-gathers; afterwards it only reads one counter."""

    def hook(_module: nn.Module, _args) -> None:
        # Traced by torch.compile, the hook would guard on the count of gathers in flight (a recompile
        # per count) and graph-break at each wait; compiled code starts from whole parameters instead
        # (`Zero1DDP._settle_for_compile`), so it is left out of graphs.
        if torch.compiler.is_compiling():
            return
        zero1 = self_ref()
        if zero1 is not None and zero1._gathers.in_flight:
            zero1._wait_for_buckets(owned)

    return hook


def _holds_compiled(module: nn.Module) -> bool:
    """Whether `module` or a submodule runs compiled code: ``torch.compile(m)`` (an `OptimizedModule`)
    or ``m.compile()``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())
