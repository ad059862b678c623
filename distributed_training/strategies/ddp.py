"""Data-parallel training with bucketed gradient all-reduce overlapped with backward.

The algorithm, for one iteration:

1. `forward` first broadcasts rank 0's buffers (BatchNorm statistics) when `broadcast_buffers`,
   then runs the wrapped module unchanged.
2. During `loss.backward()`, autograd accumulates each parameter's gradient into `.grad`, and a
   post-accumulate-grad hook marks the parameter ready (bookkeeping only: no tensor work there).
3. When a bucket's last parameter is ready, its gradients are copied into the bucket's flat buffer
   with one multi-tensor copy (skipped for a `.grad` that already is its view into the buffer, where
   autograd accumulated in place), each `.grad` becomes that view, and the bucket is handed to the
   *bucket reducer* (by default one asynchronous all-reduce). Buckets launch strictly in index order
   on every rank, as NCCL requires the same collective order everywhere; a bucket that is ready early
   waits for its predecessors, which is why buckets are ordered by expected gradient arrival.
4. A callback queued on the autograd engine runs when backward finishes: it deals with parameters
   that got no gradient, launches what is left, and waits once for all buckets. On CUDA that wait is
   stream-ordered, so the host never blocks.

After the first synchronised iteration the buckets are rebuilt in the order gradients actually
arrived on rank 0 (broadcast so that every rank agrees), which is what lets communication start early.

Under `no_sync()` the hooks do nothing: gradients accumulate locally in `.grad`, and the first
backward outside `no_sync()` gathers and reduces the accumulated sum.

`NaiveDDP` in `naive.py` is the same contract done the obvious way: the test oracle for this file.
The bucket machinery (sizes, lookup tables, re-bucketing order, the gather before a launch) is in
`ddp_buckets.py`, the wrapper's layout of its buckets (saved, adopted, rebuilt in arrival order) in
`ddp_layout.py`; this file holds the `DDP` module and its hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..comm.bucket import MIB, Bucket
from ..comm.collectives import broadcast_coalesced, check_same_across_ranks, describe_module, labelled
from ..comm.optimizer import CommunicationOptimizer
from ..comm.reduce import AllReduceMean, BucketReducer, ReduceScatterMean
from ..comm.work import CompletedWork
from ..mesh import Mesh, global_rank
from .backward_start import inside_backward, on_backward_start
from .ddp_buckets import gather_bucket, resolve_bucket_cap_mb
from .ddp_layout import BucketLayout
from .ddp_unused import UnusedParameters
from .eager import eager_only
from .overlap import CommTiming, OverlapTimeline
from .trainable import TrainableSet

__all__ = ["DDP"]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


_wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a wrapped module -> its DDP (weakly)


def _take_over(module: nn.Module) -> None:
    """A module that a live `DDP` still holds with its gradient hooks, wrapped again (``ddp = DDP(ddp.module)``
    to rebuild it, another reducer): the new wrapper takes the module over. The old one's hooks go (both
    would average each gradient, the second after the first had started: its error blamed a hook of the
    user's), and its forward then raises rather than train without averaging."""
    ref = _wrappers.get(module)
    old = ref() if ref is not None else None
    if old is not None and old._hook_handles:
        old.remove_hooks()
        old._superseded = True


class DDP(UnusedParameters, BucketLayout, CommTiming, nn.Module):
    """Wrap `module` so that after `loss.backward()` every rank's `.grad` is the mean over ranks.

    Post-accumulate-grad hooks of your own that change `.grad` must be registered before wrapping, so
    that they run before DDP's; one registered after it that changes a gradient DDP is already
    averaging makes backward raise, naming the parameter.

    Args:
        module: the model, already on this rank's device.
        process_group: the group to average over (default: the whole job).
        mesh: a `Mesh` instead of `process_group`: average over its data-parallel group
            (``mesh.group("data")``); its node boundaries serve a hierarchical `communication`.
        bucket_cap_mb: cap of a gradient bucket in MiB (default: the `communication` optimizer's
            ``bucket_size_mb`` when it has one, else 100 for Top-K compression, else 25).
        first_bucket_cap_mb: cap of the first bucket, kept small so communication starts early
            (default 1).
        find_unused_parameters: allow parameters that get no gradient in some iterations, on some or
            all ranks. Costs one tiny extra all-reduce per iteration. With it off, such a parameter
            raises an error naming it.
        broadcast_buffers: broadcast rank 0's buffers before each forward that will be followed by a
            synchronised backward.
        bucket_reducer: how one bucket is averaged (see `comm.reduce`); default `AllReduceMean()`.
        communication: a `CommunicationOptimizer` (compression, ring/tree, hierarchical); it is the
            bucket reducer then. Its ``bucket_size_mb`` sizes the buckets (when `bucket_cap_mb` is not
            given), and with ``enable_overlap=False`` buckets are reduced after backward instead of
            while it runs.
        rebuild_buckets: re-bucket after the first iteration in the observed gradient order.
        measure_overlap: time every bucket's communication (CUDA events on a side stream, or
            completion callbacks on CPU) and the wait after backward, so that `pop_overlap_stats()`
            and `pop_exposed_comm_seconds()` can say how much was hidden and how much exposed. Off by
            default (no timing on the hot path); the trainer turns it on when it logs metrics.
    """

    #: Every bucket buffer is padded to a multiple of this (ZeRO-1 cuts buckets into world-size slices).
    _bucket_pad_to = 1
    #: Gradient views with their parameters' layouts (channels_last weights get channels_last gradients).
    _bucket_keep_layout = True

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        mesh: Mesh | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        first_bucket_cap_mb: float = 1.0,
        bucket_reducer: BucketReducer | None = None,
        rebuild_buckets: bool = True,
        communication: BucketReducer | None = None,
        measure_overlap: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DDP wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, DDP):
            raise TypeError("module is already wrapped in DDP")
        _take_over(module)
        if communication is not None and bucket_reducer is not None:
            raise ValueError("pass either communication= (a CommunicationOptimizer) or bucket_reducer=, not both")
        if communication is not None and not callable(communication):
            raise TypeError(f"communication must be a CommunicationOptimizer (or another bucket reducer), got "
                            f"{communication!r}" + (f": CommunicationOptimizer({communication!r})?"
                                                   if isinstance(communication, str) else ""))
        bucket_reducer = communication if communication is not None else bucket_reducer
        if bucket_reducer is not None and not callable(bucket_reducer):
            raise TypeError(f"bucket_reducer must be callable, got {type(bucket_reducer).__name__}")
        bucket_cap_mb = resolve_bucket_cap_mb(bucket_cap_mb, bucket_reducer)
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
        if not dist.is_initialized():
            raise RuntimeError(
                "DDP needs an initialised process group: call distributed_training.init_distributed() first"
            )

        if mesh is not None and process_group is not None:
            raise ValueError("pass either mesh= or process_group=, not both (the mesh's data group is the one used)")

        self.module = module
        self.mesh = mesh if mesh is not None else Mesh(group=process_group)
        process_group = self.process_group = self.mesh.group("data")
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.bucket_reducer: BucketReducer = bucket_reducer or AllReduceMean()
        if hasattr(self.bucket_reducer, "serve"):
            self.bucket_reducer.serve(module)  # one model per reducer: its state is per bucket
        if hasattr(self.bucket_reducer, "setup"):
            self.bucket_reducer.setup(process_group, mesh=self.mesh)  # e.g. node groups for hierarchical all-reduce
        self._pass_index = getattr(self.bucket_reducer, "wants_bucket_index", False)
        # Launch each bucket as soon as its last gradient arrives (overlapped with the rest of backward),
        # or all of them once backward is over (`CommunicationOptimizer(enable_overlap=False)`).
        self._launch_during_backward = bool(getattr(self.bucket_reducer, "enable_overlap", True))
        self._cap_bytes = int(bucket_cap_mb * MIB)
        self._first_cap_bytes = int(first_bucket_cap_mb * MIB)

        check_same_across_ranks(describe_module(module), "model", process_group)

        # named_parameters() yields a shared (tied) parameter once: it is bucketed and reduced once.
        self._trainable = TrainableSet(module.named_parameters(), "DDP", module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        for name, p in named:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"DDP supports dense parameters only; '{name}' has layout {p.layout}")

        self._synced_buffers = list(module.buffers())
        with torch.no_grad():
            broadcast_coalesced(
                [p.data for p in module.parameters()] + self._synced_buffers, self._global_rank(0), process_group
            )

        # One data-parallel rank and a plain mean (tensor parallelism over a whole node, or one GPU):
        # nothing to reduce, so no buckets and no hooks; the gradients stay autograd's own, as without
        # DDP (no copy into a bucket, no second gradient-sized buffer).
        self._sync_checks_left = self.SYNC_CHECKS
        self._solo = (self.world_size == 1 and type(self) is DDP and type(self.bucket_reducer) is AllReduceMean
                      and not self.find_unused_parameters)
        # Reverse registration order approximates the order gradients become ready in backward.
        self._build_buckets(list(reversed(range(len(self._params)))) if not self._solo else [])
        self._rebuild_buckets = bool(rebuild_buckets) and not self._solo
        self._rebuild_pending = self._rebuild_buckets
        self._arrival_order: list[int] | None = [] if rebuild_buckets else None
        # Set by the first synchronised backward on every rank alike (a rank whose parameters all went
        # unused has an empty arrival order, yet must take part in the rebuild broadcast).
        self._rebuild_ready = False

        # Everything the hooks change during backward lives in `_backward`, a plain object: assigning an
        # attribute of an nn.Module runs Module.__setattr__'s Python body, and on autograd's device
        # thread that measured about 3 ms per assignment (ResNet-50, 2x H200): 30 ms a step.
        self._backward = _BackwardPass()
        # Inside `join()`: the rank whose buffers are broadcast (the lowest one still training) and the
        # context itself; outside it, rank 0 and None.
        self._buffer_src = 0
        self._join_state = None
        self._shadowing = False
        self._comm_host_seconds, self._comm_count, self._comm_events = 0.0, 0, []
        self._comm_blocking_events: list = []  # (`CommTiming._add_blocking_comm`)
        self._superseded = False  # another DDP took its module over (`_take_over`)
        self.measure_overlap = bool(measure_overlap)
        self._overlap = OverlapTimeline()
        # Reducers whose collectives read only tensors that outlive the handle (the bucket itself, or
        # what a CommunicationOptimizer handle keeps): their transfers may be timed on a side stream.
        self._reducer_owns_tensors = isinstance(self.bucket_reducer,
                                                (AllReduceMean, ReduceScatterMean, CommunicationOptimizer))
        self._reset_iteration()
        self._hook_handles = []
        self_ref = weakref.ref(self)
        for index, p in enumerate(self._params if not self._solo else []):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(self_ref, index)))
        _wrappers[module] = self_ref

    # ----------------------------------------------------------------- public
    def forward(self, *args, **kwargs):
        if self._superseded:
            raise RuntimeError("this DDP's module was wrapped by another DDP since, which took over its gradient "
                               "averaging: use the new wrapper (this one would no longer average)")
        self._before_forward()
        out = self.module(*args, **kwargs)
        self._hook_outputs(out)
        return out

    def before_forward(self) -> None:
        """What `forward` does before running the module when a synchronised backward will follow: the
        bucket rebuild after the first step and the broadcast of rank 0's buffers. For callers that run
        the wrapped module's parts themselves, as a pipeline stage does (collective over the data group)."""
        self._before_forward()

    @eager_only
    def _before_forward(self) -> None:
        """What runs before the wrapped module. Never traced by torch.compile: under
        ``torch.compile(DDP(model))`` dynamo graph-breaks here, runs this eagerly (collectives, bucket
        rebuild, Python state), and compiles the module's forward after it."""
        if self._all_frozen():
            return  # (nothing to average after this pass: no bucket waits for a gradient)
        self._trainable.check()
        if torch.is_grad_enabled() and self._backward.sync_enabled:
            if self._backward.callback_queued and not inside_backward():
                self._drop_backward()  # a backward that raised half-way: its queued end never ran
            self._collectives_before_forward()

    @eager_only
    def _hook_outputs(self, out) -> None:
        """At the start of a synchronised backward through `out`, queue its end there, on the outermost
        pass (`backward_start`): reentrant activation checkpointing's nested backward, where a parameter's
        hook would queue it, ends before the rest of the model's gradients arrive."""
        if self._hook_handles and self._backward.sync_enabled and torch.is_grad_enabled() and not self._all_frozen():
            me = weakref.ref(self)
            on_backward_start(out, lambda: me() is not None and me()._queue_finish())

    def _all_frozen(self) -> bool:
        """Every parameter this wrapper averages frozen for now (``requires_grad_(False)`` on all of them: a
        GAN's discriminator during the generator's step, its gradient flowing through it to the generator's
        parameters): a pass that trains none of them, as under ``no_grad``. Freezing some of them is still
        refused (`TrainableSet`): the buckets are built over those that train."""
        return bool(self._params) and not any(p.requires_grad for p in self._params)

    def join(self, optimizer: torch.optim.Optimizer | None = None, *, lr_scheduler=None):
        """A context in which ranks that run out of data keep answering the others' collectives:
        ``with model.join(optimizer=opt): for batch in my_loader: ...``. See `distributed_training.join`."""
        from .join import Join

        return Join(self, optimizer, lr_scheduler=lr_scheduler)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (already averaged, so identical) gradients by their 2-norm; return the norm.

        Equal to `torch.nn.utils.clip_grad_norm_` over the parameters; inside `join()` it also tells
        ranks that ran out of data to clip, so that their optimizer steps stay identical."""
        if self._join_state is not None:
            self._join_state.announce_clip(max_norm)
        return torch.nn.utils.clip_grad_norm_([p for p in self._params if p.grad is not None], max_norm, norm_type)

    @property
    def _sync_enabled(self) -> bool:
        """Whether the next backward synchronises (False inside `no_sync`); what `join` announces."""
        return self._backward.sync_enabled

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages the sum."""
        state = self._backward
        previous = state.sync_enabled
        state.sync_enabled = False
        try:
            yield
        finally:
            state.sync_enabled = previous

    def sync_gradients(self) -> None:
        """Average, now, the gradients that backward passes accumulated under `no_sync`, bucket by
        bucket, as the first synchronised backward after the block would; a parameter without a
        gradient contributes zeros (with `find_unused_parameters`, one unused on every rank keeps
        ``.grad = None``).

        For schedules whose last backward cannot be the synchronised one. A pipeline stage runs all of
        a step's backward passes under `no_sync` and calls this once after them: synchronising inside
        its last backward would make the input gradient it sends to the previous stage wait for the
        reduction (on CUDA the send is stream-ordered after it), which delays every earlier stage, one
        after the other. Every rank of the group must call it at the same point."""
        if self._backward.callback_queued:
            raise RuntimeError("sync_gradients() called during a synchronised backward pass; call it after backward, "
                               "with the backward passes run under no_sync()")
        if self._solo:
            return  # one rank: the accumulated gradients are the mean already
        if not self.find_unused_parameters and self._sync_checks_left > 0:
            self._sync_checks_left -= 1
            self._refuse_unused_everywhere()
        self._reset_iteration()
        self._finish_backward(outside_backward=True)

    def bucket_layout(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order (for inspection and tests)."""
        return [[self._param_names[i] for i in b.param_indices] for b in self._buckets]

    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    def __del__(self):  # hooks hold only a weak reference, but do not leave them behind
        try:
            self.remove_hooks()
        except Exception:
            pass

    def _collectives_before_forward(self) -> None:
        """What a forward followed by a synchronised backward communicates before the module runs."""
        if self._rebuild_pending and self._rebuild_ready:
            self._rebuild_buckets_in_arrival_order()
        if self.broadcast_buffers and self.world_size > 1 and self._synced_buffers:
            with labelled("DDP broadcast of buffers"):
                broadcast_coalesced(self._synced_buffers, self._global_rank(self._buffer_src), self.process_group)

    def _shadow_iteration(self) -> None:
        """Issue exactly the collectives of one synchronised forward and backward, contributing zero
        gradients and using no parameter: what a rank out of data does inside `join()`. It needs no
        input and runs no compute; afterwards `.grad` holds the other ranks' average, as theirs does."""
        self._collectives_before_forward()
        for p in self._params:
            p.grad = None  # every bucket slot of this rank is zero
        self._reset_iteration()
        self._shadowing = True
        try:
            self._finish_backward()
        finally:
            self._shadowing = False

    def _global_rank(self, group_rank: int) -> int:
        return global_rank(self.process_group, group_rank)

    # ------------------------------------------------------------- iteration
    def _reset_iteration(self) -> None:
        self._backward.reset(len(self._params), [len(b.param_indices) for b in self._buckets])

    def _drop_backward(self) -> None:
        """What a backward that raised half-way left: the all-reduces of the buckets it launched (every rank
        did) are waited for, else one still in flight would write into its bucket after the next backward
        copied its gradients there; their results are dropped with the iteration (the trainer, or the
        user's ``zero_grad``, drops the gradients)."""
        try:
            for handle in self._backward.handles:
                handle.wait()
        finally:
            self._reset_iteration()

    def _gather_bucket(self, bucket: Bucket) -> None:
        """Bring the bucket's gradients into its buffer before it is reduced (see `ddp_buckets.gather_bucket`)."""
        gather_bucket(bucket, self._params, self._view_of, self._param_names)

    def _on_grad_ready(self, index: int) -> None:
        state = self._backward
        if not state.sync_enabled:
            return  # `.grad` accumulates where autograd keeps it; the synchronised backward gathers it
        self._queue_finish()
        ready = state.ready
        if ready[index]:
            raise RuntimeError(
                f"parameter '{self._param_names[index]}' got its gradient twice in one backward pass, after its "
                "bucket may have been reduced: a reentrant activation checkpoint's recomputation (which runs a "
                "backward of its own) met another use of it, outside the checkpoint or in another forward of the "
                "model before this backward. Use use_reentrant=False for that checkpoint."
            )
        ready[index] = True
        if self._arrival_order is not None:
            self._arrival_order.append(index)
        bucket = self._bucket_of[index]
        pending = state.pending
        pending[bucket] -= 1
        if pending[bucket] == 0 and self._launch_during_backward:
            self._launch_ready_buckets()
            if state.next_to_launch > bucket:
                # Launched from this parameter's own hook: gradient hooks registered after DDP's run next, on a
                # gradient already being averaged. `_finish_backward` checks that they left it alone.
                state.launched_by.append((index, self._view_of[index]._version))

    def _queue_finish(self) -> None:
        state = self._backward
        if not state.callback_queued and state.sync_enabled:
            state.callback_queued = True
            if self.measure_overlap:
                self._overlap.begin()  # drop what a backward that raised half-way left behind
            _queue_callback(self._finish_if_reached)

    def _finish_if_reached(self) -> None:
        """The end of a synchronised backward: `_finish_backward`, unless it reached no parameter (a
        ``torch.autograd.grad`` for the inputs only), which reduces nothing, as before it began."""
        if any(self._backward.ready):
            self._finish_backward()
        else:
            self._backward.callback_queued = False

    def _launch_ready_buckets(self) -> None:
        state = self._backward
        while state.next_to_launch < len(self._buckets) and state.pending[state.next_to_launch] == 0:
            bucket = self._buckets[state.next_to_launch]
            self._gather_bucket(bucket)
            launched = self._overlap.launch(bucket.buffer) if self.measure_overlap else None
            timing = self._start_comm_timer()  # (None unless measuring)
            if self._pass_index:
                handle = self.bucket_reducer(bucket.buffer, self.process_group, index=bucket.index)
            else:
                handle = self.bucket_reducer(bucket.buffer, self.process_group)
            if timing is not None and isinstance(handle, CompletedWork):  # it communicated inside the call
                self._add_blocking_comm(timing)
            if launched is not None:
                self._overlap.track(launched, handle, owned=self._reducer_owns_tensors)
            state.handles.append(handle)
            state.next_to_launch += 1

    def _finish_backward(self, outside_backward: bool = False) -> None:
        if not self._rebuild_ready:  # assign once: module attributes are slow to set on this thread
            self._rebuild_ready = True
        try:
            state = self._backward
            changed = [i for i, version in state.launched_by
                       if self._params[i].grad is not self._view_of[i] or self._view_of[i]._version != version]
            unready = [i for i, ready in enumerate(state.ready) if not ready]
            had_no_grad = {i for i in unready if self._params[i].grad is None}
            used_work = used = None
            # Which parameters got a gradient on *some* rank, in this backward or in the no_sync micro-batches
            # before it (what a rank holds is read before its bucket is reduced): those with none anywhere
            # keep `.grad = None`, as if DDP were not there; the others are averaged on every rank.
            flag_used = self.find_unused_parameters and (self.world_size > 1 or bool(unready))
            held = [i for i in unready if i not in had_no_grad] if flag_used else []
            read = self._read_held(held) if held else None
            for i in unready:
                # Its bucket gathers it at launch: an absent gradient contributes zeros, an accumulated one
                # (from no_sync steps, or all of them for `sync_gradients`) counts, one foreach copy a bucket.
                state.pending[self._bucket_of[i]] -= 1
            self._launch_ready_buckets()
            if flag_used:
                # (After the launches: the flags' copy to a GPU waits for the device, and their all-reduce
                # follows the buckets' on every rank, some of which a rank launched during backward.)
                used = self._used_flags(state.ready, held, read)
                if self.world_size > 1:
                    used_work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
            timing = self._start_comm_timer()
            if self.measure_overlap:
                self._overlap.backward_done(timing)
            for index, handle in enumerate(state.handles):
                try:
                    handle.wait()
                except RuntimeError as err:
                    raise RuntimeError(
                        f"DDP gradient all-reduce of bucket {index + 1}/{len(self._buckets)} failed: {err}"
                    ) from err
            if used_work is not None:
                used_work.wait()
            self._stop_comm_timer(timing)
            if changed:
                names = ", ".join(f"'{self._param_names[i]}'" for i in changed)
                raise RuntimeError(
                    f"rank {self.rank}: a gradient hook replaced or modified the gradient of parameter(s) {names} "
                    "after DDP had started averaging it (the hook was registered after the model was wrapped, so it "
                    "runs after DDP's): the change would be lost or torn. Register such hooks on the parameters "
                    "before wrapping the model in DDP; they then run before DDP's."
                )
            if unready and not self.find_unused_parameters and not self._shadowing and not outside_backward:
                names = [self._param_names[i] for i in unready]
                shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                raise RuntimeError(
                    f"rank {self.rank}: {len(names)} parameter(s) received no gradient in this backward pass: "
                    f"{shown}. If they are unused in some iterations or on some ranks, pass "
                    "find_unused_parameters=True; if they are never used, set requires_grad=False or remove them. "
                    "If they are used, and a reentrant activation checkpoint holds the model's last layers while "
                    "the loss comes from a tensor the model does not return, the pass ended with the checkpoint's "
                    "own backward: return that tensor, or use use_reentrant=False."
                )
            if self.find_unused_parameters and unready:
                globally_used = used.tolist()
                unused = [i for i in had_no_grad if not globally_used[i]]
                if unused and getattr(self.bucket_reducer, "residuals", None):
                    # Error feedback may have sent some of their residuals (compression picked them): that
                    # delayed gradient is applied, the same on every rank, not dropped (it left the residuals).
                    sent = torch.stack(torch._foreach_norm([self._view_of[i] for i in unused])).ne(0).tolist()
                    unused = [i for i, s in zip(unused, sent) if not s]
                for i in unused:
                    self._params[i].grad = None
                if unused:
                    self._unused_everywhere(unused)
                self._unready_everywhere([i for i in unready if not globally_used[i]])
        finally:
            self._reset_iteration()

class _BackwardPass:
    """What the hooks track during one backward pass (and whether it synchronises at all)."""

    __slots__ = ("sync_enabled", "ready", "pending", "next_to_launch", "handles", "callback_queued", "launched_by")

    def __init__(self) -> None:
        self.sync_enabled = True
        self.reset(0, [])

    def reset(self, n_params: int, pending: list[int]) -> None:
        self.ready = [False] * n_params       # which parameters' gradients arrived
        self.pending = pending                # per bucket: gradients still to arrive
        self.next_to_launch = 0               # buckets launch strictly in index order
        self.handles: list = []               # one per launched bucket, waited for at the end
        self.callback_queued = False
        self.launched_by: list = []           # (parameter, its view's version) whose own hook launched its bucket


def _make_hook(self_ref: "weakref.ReferenceType[DDP]", index: int):
    def hook(_param: torch.Tensor) -> None:
        ddp = self_ref()
        if ddp is not None:
            ddp._on_grad_ready(index)

    return hook
