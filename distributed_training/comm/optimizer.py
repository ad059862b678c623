"""`CommunicationOptimizer`: how DDP's buckets travel — compressed, by hand-built patterns, or hierarchically.

It is a bucket reducer (see `comm/reduce.py`): pass it as `DDP(module, communication=...)`, or call
`all_reduce_compressed(tensor)` / `hierarchical_all_reduce(tensor, ...)` directly. Compression:

* ``"topk"``: each rank sends only about k = ratio x n largest-magnitude entries of (gradient +
  residual) as (index, value) pairs. Supports differ between ranks, so the pairs are all-gathered and
  scatter-added, not all-reduced. With error feedback what was not sent stays in a per-bucket residual
  and is added to the next step's gradient (sent + residual = accumulated input, exactly). An optional
  warm-up starts dense and decays the density to `compression_ratio`. How the entries are chosen is
  `topk_select`: ``"blockmax"`` (the default: the bucket seen as rows of L = round(1 / density)
  values, each row's largest-magnitude entry; on CUDA with Triton one fused kernel reads gradient and
  residual once and writes the residual once, elsewhere a few eager ops, see `comm/_topk_kernels.py`),
  ``"exact"`` (one top-k over the bucket), ``"chunked"`` (the ratio x `topk_chunk`
  largest of every `topk_chunk` consecutive entries, plus the tail's share) or ``"sampled"`` (a
  threshold from the top-k of a strided sample, then the first k entries at or above it, padded).
  Every method sends a number of pairs fixed by the length and the density, never by the values, so
  every rank all-gathers the same sizes without a host sync; what a method leaves out stays in the
  residual. Each bucket's residual lives in a buffer kept from step to step (no allocation of the
  bucket's size per call).
* ``"bf16"`` / ``"fp16"``: cast, all-reduce, cast back (fp16 divides by the world size first).
* ``"powersgd"``: each gradient matrix (a layer's weight) as a rank-r product P Q^T, two small
  all-reduces a bucket, warm-started Q, error feedback; vectors and small matrices go exactly (see
  `comm/powersgd.py`).

Residuals and PowerSGD's Q are state: `state_dict()` / `load_state_dict()` put them in checkpoints.
`bytes_sent` counts what this rank put on the wire.
"""

from __future__ import annotations

import math
import numbers
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import Mesh
from ..runtime import launcher_ranks_per_node
from .collectives import all_gather_single
from .powersgd import BucketLayout, PowerSGDPlan, initial_q, plan_bucket, powersgd_finish, powersgd_start
from .patterns import hierarchical_all_reduce, ring_all_reduce, tree_all_reduce
from ._topk_kernels import blockmax_eager, blockmax_fused, fused_available
from .reduce import CompletedWork

__all__ = ["CommunicationOptimizer"]


class _Finish:
    """A reduction in flight: `wait()` waits for its collectives, then runs `finish` (decode, copy
    back) once. What DDP's single wait at the end of backward calls."""

    def __init__(self, works: list, finish, keep: tuple = ()) -> None:
        self.works = [w for w in works if w is not None]
        self._finish = finish
        self._keep = keep  # every tensor the collectives read or write lives until wait()

    def wait(self) -> bool:
        if self._finish is not None:
            for work in self.works:
                work.wait()
            finish, self._finish = self._finish, None
            finish()
            self._keep = ()
        return True

_COMPRESSIONS = (None, "topk", "bf16", "fp16", "powersgd")
_PATTERNS = ("nccl", "ring", "tree")
_TOPK_SELECTIONS = ("blockmax", "exact", "chunked", "sampled")


class CommunicationOptimizer:
    """Compression, all-reduce pattern and hierarchy for gradient buckets (see the module docstring).

    Args:
        compression: ``None``, ``"topk"``, ``"bf16"``, ``"fp16"`` or ``"powersgd"``.
        compression_ratio: the fraction of entries Top-K sends.
        error_feedback: keep what compression left out and add it to the next step's gradient.
        hierarchical: reduce-scatter in a node, all-reduce across nodes, all-gather in a node.
        ranks_per_node: the node size for `hierarchical` (default: LOCAL_WORLD_SIZE).
        pattern: ``"nccl"`` (the backend's all-reduce), ``"ring"`` or ``"tree"`` (ours, from
            point-to-point messages).
        bucket_size_mb: the bucket cap of the `DDP` it is given to, when that DDP is not given
            ``bucket_cap_mb`` itself (default: 100 MiB for Top-K, whose cost is mostly per bucket; DDP's
            25 MiB otherwise). Larger buckets mean fewer, larger messages: fewer Top-K selections and
            PowerSGD factorisations, each over more entries.
        enable_overlap: reduce each bucket as soon as its gradients are ready, overlapped with the
            rest of backward (default), or with ``False`` all buckets after backward, which is
            slower but keeps communication off backward's critical path (for measuring one against
            the other, or for reducers that compete with backward for the GPU).
        powersgd_rank: the rank r of PowerSGD's approximation.
        warmup_steps: steps over which Top-K's density decays from 1 to `compression_ratio`.
        topk_select, topk_chunk: how Top-K chooses its entries: ``"blockmax"`` (default), ``"exact"``,
            ``"chunked"`` (rows of `topk_chunk`) or ``"sampled"`` (see the module docstring).
    """

    wants_bucket_index = True

    def __init__(self, compression: str | None = None, compression_ratio: float = 0.01, error_feedback: bool = True,
                 hierarchical: bool = False, ranks_per_node: int | None = None, pattern: str = "nccl",
                 bucket_size_mb: float | None = None, enable_overlap: bool = True, powersgd_rank: int = 4,
                 warmup_steps: int = 0, topk_select: str = "blockmax", topk_chunk: int = 4096) -> None:
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(_COMPRESSIONS)}, got {compression!r}")
        if pattern not in _PATTERNS:
            raise ValueError(f"pattern must be one of {list(_PATTERNS)}, got {pattern!r}")
        if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, numbers.Real) \
                or not 0 < compression_ratio <= 1:
            raise ValueError(f"compression_ratio must be a number in (0, 1], got {compression_ratio!r}")
        for name, value in (("error_feedback", error_feedback), ("hierarchical", hierarchical)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive integer or None, got {ranks_per_node!r}")
        if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be an integer >= 1, got {powersgd_rank!r}")
        if bucket_size_mb is not None and (isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float))
                                           or not bucket_size_mb > 0):
            raise ValueError(f"bucket_size_mb must be a positive number of MiB or None, got {bucket_size_mb!r}")
        if not isinstance(enable_overlap, bool):
            raise TypeError(f"enable_overlap must be True or False, got {enable_overlap!r}")
        if ranks_per_node is not None and not hierarchical:
            raise ValueError(f"ranks_per_node={ranks_per_node!r} is the node size of hierarchical all-reduce: "
                             "pass hierarchical=True with it, or leave it out")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
        if topk_select not in _TOPK_SELECTIONS:
            raise ValueError(f"topk_select must be one of {list(_TOPK_SELECTIONS)}, got {topk_select!r}")
        if isinstance(topk_chunk, bool) or not isinstance(topk_chunk, int) or topk_chunk < 1:
            raise ValueError(f"topk_chunk must be a positive integer, got {topk_chunk!r}")
        # A setting of one compression given with another is a mistake the user would not see: refuse it
        # (only a changed value can be told from the default; the config refuses any given one).
        for name, value, default, applies in (
                ("compression_ratio", compression_ratio, 0.01, "topk"), ("warmup_steps", warmup_steps, 0, "topk"),
                ("topk_select", topk_select, "blockmax", "topk"), ("topk_chunk", topk_chunk, 4096, "topk"),
                ("powersgd_rank", powersgd_rank, 4, "powersgd")):
            if value != default and compression != applies:
                raise ValueError(f"{name}={value!r} applies to compression={applies!r}, not {compression!r}: "
                                 f"set the compression, or leave {name} out")
        if not error_feedback and compression not in ("topk", "powersgd"):
            raise ValueError(f"error_feedback=False applies to compression 'topk' or 'powersgd', not {compression!r} "
                             "(which leaves nothing out to feed back): set the compression, or leave error_feedback out")
        if hierarchical and compression is not None:
            raise ValueError("hierarchical all-reduce and compression cannot be combined yet: choose one")
        if hierarchical and pattern != "nccl":
            raise ValueError(f"hierarchical all-reduce runs the backend's collectives in and across nodes; pattern="
                             f"{pattern!r} is another way to all-reduce a whole bucket: choose one")
        if pattern != "nccl" and compression is not None:
            raise ValueError(f"pattern={pattern!r} is how an uncompressed bucket is all-reduced; compression "
                             f"{compression!r} sends its own messages (all-gather / all-reduce): choose one")
        self.compression = compression
        self.compression_ratio = compression_ratio
        self.error_feedback = error_feedback
        self.hierarchical = hierarchical
        self.ranks_per_node = ranks_per_node
        self.pattern = pattern
        self.bucket_size_mb = bucket_size_mb
        # Top-K's cost is mostly per call (launches, the all-gathers' latency), so it prefers fewer,
        # larger buckets: at 1.3B on an H200, 4.9 ms a step in 100 MiB buckets against 13.0 in 25 MiB.
        self.preferred_bucket_size_mb = 100.0 if compression == "topk" else None
        self.enable_overlap = enable_overlap
        self.powersgd_rank = powersgd_rank
        self.warmup_steps = warmup_steps
        self.topk_select = topk_select
        self.topk_chunk = topk_chunk
        self.residuals: dict[int, torch.Tensor] = {}
        self._topk_buffers: dict[int, torch.Tensor] = {}
        self._bases: dict[tuple, torch.Tensor] = {}
        self.powersgd_q: dict[int, torch.Tensor] = {}  # per bucket: every matrix's Q, flat
        self._layouts: dict[int, BucketLayout] = {}
        self._plans: dict[int, tuple[BucketLayout | None, PowerSGDPlan]] = {}
        self.bytes_sent = 0
        self.steps = 0
        self._groups: tuple | None = None
        self._served: weakref.ref | None = None  # the model whose buckets these are (`serve`)

    # ------------------------------------------------------------------ setup
    def setup(self, group: dist.ProcessGroup | None, mesh: Mesh | None = None) -> None:
        """Take the node groups for hierarchical all-reduce from `mesh` (DDP passes its own), over
        nodes of `ranks_per_node` ranks when that was given (emulated nodes); without a mesh, lay out
        `group` over the launcher's nodes. Collective: every rank calls it."""
        if self.compression is not None and dist.get_world_size(group) == 1 and dist.get_rank() == 0:
            warnings.warn(f"compression {self.compression!r} over a data-parallel group of one rank: nothing is "
                          "sent, and the gradients are still compressed (changed); leave compression off here "
                          "(e.g. a pipeline or tensor-parallel layout with one replica)", stacklevel=3)
        if self.hierarchical and self._groups is None:
            if mesh is None:
                mesh = Mesh(group=group, ranks_per_node=self.ranks_per_node or launcher_ranks_per_node(group))
            elif self.ranks_per_node:
                mesh = mesh.with_ranks_per_node(self.ranks_per_node)
            self._groups = mesh.node_groups()

    def serve(self, module: torch.nn.Module) -> None:
        """Bind to the model whose buckets this reduces (DDP calls it). Residuals, Q's and the step count
        are keyed by bucket: a second model's buckets would mix with the first's, so another model is
        refused while the first lives, and once it is gone the state starts afresh (it belonged to the
        first). The same module wrapped again (a rebuilt DDP) keeps the state."""
        if self._served is not None:
            served = self._served()
            if served is module:
                return
            if served is not None:
                raise ValueError(f"this CommunicationOptimizer already reduces the gradients of another model (a "
                                 f"{type(served).__name__}): its error-feedback state is per bucket, so create one "
                                 f"CommunicationOptimizer per model")
            self.load_state_dict({})  # the first model's state, which nothing can use now
            self._topk_buffers.clear()
            self._layouts.clear()
            self._plans.clear()
        self._served = weakref.ref(module)

    # ------------------------------------------------------------------ DDP's reducer
    def __call__(self, bucket: torch.Tensor, group: dist.ProcessGroup | None, index: int = 0):
        world = dist.get_world_size(group)
        if index == 0:
            self.steps += 1
        if world == 1 and self.compression is None:
            return CompletedWork()
        if self.compression is None:
            if self.hierarchical:
                if self._groups is None:
                    raise RuntimeError("hierarchical all-reduce needs setup(group) first (DDP calls it)")
                self.bytes_sent += bucket.numel() * bucket.element_size()
                hierarchical_all_reduce(bucket, *self._groups)
                bucket.div_(world)
                return CompletedWork()
            if self.pattern == "nccl":
                from .reduce import AllReduceMean

                self.bytes_sent += bucket.numel() * bucket.element_size()
                return AllReduceMean()(bucket, group)
            self.bytes_sent += bucket.numel() * bucket.element_size()
            (ring_all_reduce if self.pattern == "ring" else tree_all_reduce)(bucket, group)
            bucket.div_(world)
            return CompletedWork()
        return self._compressed_mean(bucket, group, index)

    def all_reduce_compressed(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                              key: int = -1) -> torch.Tensor:
        """The mean of `tensor` over `group`, in place, through this optimizer's compression (PowerSGD
        takes a tensor of two or more dimensions as one matrix of its shape)."""
        flat = tensor.reshape(-1)  # a copy when `tensor` is not contiguous (channels_last, transposed)
        if self.compression is None:
            self(flat, group, max(key, 0)).wait()
        else:
            if key <= 0:  # a step: each call with the default key, or the first of keyed tensors (as bucket 0)
                self.steps += 1
            # Its own shape, never a DDP bucket's layout of the same key (); 1-D: one near-square matrix.
            layout = [(0, tuple(tensor.shape))] if tensor.dim() >= 2 else ()
            self._compressed_mean(flat, group, key, layout).wait()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def hierarchical_all_reduce(self, tensor: torch.Tensor, intra_node_group=None, inter_node_group=None) -> torch.Tensor:
        """The sum over every rank, through intra-node reduce-scatter, inter-node all-reduce, all-gather."""
        if intra_node_group is None and inter_node_group is None:
            if self._groups is None:
                self.setup(None)
            intra_node_group, inter_node_group = self._groups
        return hierarchical_all_reduce(tensor, intra_node_group, inter_node_group)

    # ------------------------------------------------------------------ compression
    def density(self) -> float:
        """Fraction of entries Top-K sends now: 1 at the first step, decaying geometrically to the target
        ratio, which step ``warmup_steps + 1`` reaches (`steps` counts from 1 at the first bucket)."""
        if self.warmup_steps and self.steps <= self.warmup_steps:
            progress = max(0, self.steps - 1) / self.warmup_steps
            return math.exp(math.log(self.compression_ratio) * progress)
        return self.compression_ratio

    def _compressed_mean(self, flat: torch.Tensor, group, key: int,
                         layout: BucketLayout | None = None) -> "_Finish":
        """Start the compressed mean of `flat`; the returned handle's `wait()` finishes it in place.

        Compression runs now, the collectives are launched asynchronously, and decoding waits for
        `wait()`: under DDP the transfer overlaps the rest of backward like a dense bucket's.
        PowerSGD's second all-reduce depends on the first (through a QR), so it completes in `wait()`.
        """
        world = dist.get_world_size(group)
        if self.compression in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.compression == "bf16" else torch.float16
            op = dist.ReduceOp.SUM
            if dtype == torch.bfloat16 and world > 1 and dist.get_backend(group) == "nccl":
                low, op = flat.to(dtype), dist.ReduceOp.AVG  # bf16 has fp32's range: NCCL averages in one pass
            else:
                low = (flat / world).to(dtype)  # divide first: fp16 sums of many ranks overflow otherwise
            self.bytes_sent += low.numel() * low.element_size()
            work = dist.all_reduce(low, op=op, group=group, async_op=True) if world > 1 else None
            return _Finish([work], lambda: flat.copy_(low), keep=(low,))
        if self.compression == "topk":
            return self._topk_mean(flat, group, key, world)
        return self._powersgd_mean(flat, group, key, world, layout)

    def compress_topk(self, flat: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) this rank sends for `flat`, updating the error-feedback residual.

        Index ``n`` (one past the end) is padding: it carries the value 0 (see ``"sampled"``).
        Indices are int64, or int32 for ``"blockmax"`` (what goes on the wire). Nothing here waits
        for the device: the counts depend on the length and the density only."""
        n = flat.numel()
        density = self.density()
        keep = self.error_feedback
        if self.topk_select == "blockmax":
            row = self._row(density, n)
            if fused_available(flat, row):
                return blockmax_fused(flat, self._topk_buffer(flat, key)[:n] if keep else None, row, keep)
            if keep:
                acc = self._topk_buffer(flat, key)
                acc[:n].add_(flat)  # residual + gradient, in the residual's own buffer
            else:
                acc = torch.zeros(n + row, dtype=torch.float32, device=flat.device)
                acc[:n].copy_(flat)
            return blockmax_eager(acc, n, row, self._base(-(-n // row), row, torch.int32, flat.device), keep)
        if keep:
            acc = self._topk_buffer(flat, key)
            acc[:n].add_(flat)
        else:
            acc = torch.zeros(n + 1, dtype=torch.float32, device=flat.device)  # + the padding slot, 0
            acc[:n].copy_(flat)
        indices = self._select(acc[:n].abs(), density)
        values = acc[indices]
        if keep:
            acc.index_fill_(0, indices, 0)  # what was sent leaves the residual; the rest waits for the next step
        return indices, values

    def _row(self, density: float, n: int) -> int:
        """Block-max's row length for a bucket of `n` values: one entry sent per `row` values (at most the
        bucket: a tiny density sends one entry of it, and pads no further)."""
        return max(1, min(n, round(1 / density)))

    def _topk_buffer(self, flat: torch.Tensor, key: int) -> torch.Tensor:
        """This key's float32 buffer: its first n values hold the residual (zeros at first), the
        rest, always 0, are the padding slot of ``"sampled"`` and block-max's last-row padding.

        Kept from call to call (no allocation of n values per call): `residuals[key]` is a view of
        it. A residual that is not (loaded from a checkpoint) is copied in; one of another length
        (the buckets changed) is dropped, as before."""
        n = flat.numel()
        size = n + self._row(self.compression_ratio, n)  # the longest row any density of the warm-up uses
        buf = self._topk_buffers.get(key)
        residual = self.residuals.get(key)
        if (buf is not None and buf.numel() == size and buf.device == flat.device and residual is not None
                and residual.numel() == n and residual.data_ptr() == buf.data_ptr()):
            return buf
        buf = torch.zeros(size, dtype=torch.float32, device=flat.device)
        if residual is not None and residual.numel() == n:
            buf[:n].copy_(residual.reshape(-1))
        self._topk_buffers[key] = buf
        self.residuals[key] = buf[:n]
        return buf

    def _base(self, rows: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``arange(0, rows * step, step)``, cached: where each row of a bucket starts."""
        cache_key = (rows, step, dtype, device)
        base = self._bases.get(cache_key)
        if base is None:
            base = self._bases[cache_key] = torch.arange(0, rows * step, step, dtype=dtype, device=device)
        return base

    def _select(self, magnitude: torch.Tensor, density: float) -> torch.Tensor:
        """Indices of the entries to send (see `topk_select`), as many as the length and density say."""
        n = magnitude.numel()
        k = max(1, min(n, math.ceil(density * n)))
        chunk = self.topk_chunk
        if self.topk_select == "exact" or n <= chunk:
            return magnitude.topk(k, sorted=False).indices
        if self.topk_select == "sampled":
            # The (1 - density) quantile of a strided sample of >= 100 / density values estimates the
            # k-th largest magnitude; nonzero_static takes the first k entries at or above it (padding
            # with index n when fewer qualify), with no host sync for the data-dependent count.
            stride = max(1, n // max(1 << 16, math.ceil(100 / density)))
            sample = magnitude[::stride]
            threshold = sample.topk(max(1, math.ceil(density * sample.numel())), sorted=False).values.min()
            return torch.nonzero_static(magnitude >= threshold, size=k, fill_value=n).view(-1)
        rows, tail = divmod(n, chunk)
        per_row = max(1, min(chunk, math.ceil(density * chunk)))
        picked = magnitude[: rows * chunk].view(rows, chunk).topk(per_row, dim=1, sorted=False).indices
        picked += self._base(rows, chunk, torch.int64, magnitude.device).unsqueeze(1)
        parts = [picked.reshape(-1)]
        if tail:
            last = magnitude[rows * chunk:]
            parts.append(last.topk(max(1, min(tail, math.ceil(density * tail))), sorted=False).indices + rows * chunk)
        return torch.cat(parts)

    def _topk_mean(self, flat: torch.Tensor, group, key: int, world: int) -> "_Finish":
        indices, values = self.compress_topk(flat, key)
        self.bytes_sent += indices.numel() * 4 + values.numel() * values.element_size()  # int32 indices on the wire
        idx32 = indices.to(torch.int32)
        works = []
        if world > 1:
            all_idx = torch.empty(world * idx32.numel(), dtype=torch.int32, device=flat.device)
            all_val = torch.empty(world * values.numel(), dtype=values.dtype, device=flat.device)
            works.append(all_gather_single(all_idx, idx32, group=group, async_op=True))
            works.append(all_gather_single(all_val, values, group=group, async_op=True))
        else:
            all_idx, all_val = idx32, values

        def decode() -> None:
            # One scatter-add per sending rank, in rank order: a rank's own indices are distinct (bar
            # padding, whose value is 0), so no two atomic adds meet in one call, and every replica
            # sums the same values in the same order. One call over all ranks' pairs would let CUDA's
            # atomics add colliding indices in any order, and replicas would drift apart by rounding.
            k = idx32.numel()
            if self.topk_select == "sampled" or flat.dtype != values.dtype:
                total = torch.zeros(flat.numel() + 1, dtype=values.dtype, device=flat.device)  # + the padding slot
                for r in range(world):
                    total.index_add_(0, all_idx[r * k:(r + 1) * k], all_val[r * k:(r + 1) * k])
                flat.copy_(total[:-1] / world)
                return
            # No padding index: decode in place, the same sums and division as above.
            flat.zero_()
            for r in range(world):
                flat.index_add_(0, all_idx[r * k:(r + 1) * k], all_val[r * k:(r + 1) * k])
            if world > 1:
                flat.div_(world)

        return _Finish(works, decode, keep=(idx32, values, all_idx, all_val))

    def set_bucket_layout(self, layouts: dict[int, BucketLayout]) -> None:
        """Where each tensor sits in each bucket (DDP calls it whenever it lays out its buckets):
        PowerSGD compresses each matrix on its own and sends the rest exactly."""
        self._layouts = dict(layouts)
        self._plans.clear()

    def _powersgd_plan(self, n: int, key: int, layout: BucketLayout | None) -> PowerSGDPlan:
        layout = layout if layout is not None else self._layouts.get(key)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is layout and cached[1].numel == n:
            return cached[1]
        if layout and max((o + math.prod(s) for o, s in layout), default=0) > n:
            layout = ()  # not this bucket's: one matrix
        plan = plan_bucket(n, layout, self.powersgd_rank)
        self._plans[key] = (layout, plan)
        return plan

    def _powersgd_mean(self, flat: torch.Tensor, group, key: int, world: int,
                       layout: BucketLayout | None = None) -> "_Finish":
        n = flat.numel()
        plan = self._powersgd_plan(n, key, layout)
        residual = self.residuals.get(key) if self.error_feedback else None
        if residual is not None and residual.numel() == n:
            if residual.device != flat.device:  # loaded from a checkpoint (on the CPU)
                residual = residual.to(flat.device, torch.float32)
            m = residual.add_(flat)  # this rank's gradient plus what earlier steps left out, in place
        elif self.error_feedback:
            m = flat.to(torch.float32, copy=True)
        else:
            m = flat.float()  # `flat` itself when fp32: read (steps 1-2) before it is overwritten
        q = self.powersgd_q.get(key)
        if q is None or q.numel() != plan.q_numel:
            q = initial_q(plan, key, flat.device)  # the same start on every rank
        elif q.device != flat.device:  # loaded from a checkpoint (on the CPU)
            q = q.to(flat.device)
        sent, work = powersgd_start(m, plan, q, group, world)
        self.bytes_sent += (plan.p_numel + plan.exact_numel + plan.q_numel) * 4

        def finish() -> None:
            self.powersgd_q[key] = powersgd_finish(flat, m, sent, plan, group, world, self.error_feedback)
            if self.error_feedback:
                self.residuals[key] = m

        return _Finish([work], finish, keep=(sent, m))

    def rebucket(self, moves: list[tuple[int, int, int, int, int]], sizes: dict[int, int]) -> None:
        """The buckets were laid out anew (DDP's rebuild in arrival order, after the first step): carry
        each parameter's error-feedback residual to its new place. `moves` holds (old bucket, old
        offset, new bucket, new offset, numel) per parameter, `sizes` each new bucket's numel. PowerSGD's
        factors belong to the old buckets' matrices and start again."""
        self.powersgd_q.clear()
        self._topk_buffers.clear()
        if not self.residuals:
            return
        old = {k: v.reshape(-1) for k, v in self.residuals.items()}
        new: dict[int, torch.Tensor] = {}
        for old_key, old_offset, new_key, new_offset, n in moves:
            src = old.get(old_key)
            if src is None or old_offset + n > src.numel():
                continue
            if new_key not in new:
                size = sizes[new_key]
                new[new_key] = torch.zeros(size, dtype=src.dtype, device=src.device)
            new[new_key][new_offset:new_offset + n] = src[old_offset:old_offset + n]
        self.residuals = new

    def loss_scale_changed(self, ratio: float, skipped: bool) -> None:
        """The loss scaler (fp16) multiplied its scale by `ratio` after a step it took or, `skipped`, skipped
        for an overflow. Residuals hold gradients as reduced, loss-scaled: they are rescaled with it, or the
        next step would add them at the old scale. After an overflow, their inf / NaN entries are dropped
        (zeroed) and a PowerSGD Q that is not finite starts again; without that, one bad step poisons
        every later one. So a skipped step is not free for error feedback: what it sent of the residuals is
        gone, its finite gradient stays in them, and a PowerSGD matrix that overflowed on any rank loses its
        residual on every rank (its P was shared). Overflows are rare after the scaler's first steps."""
        if skipped:
            for residual in self.residuals.values():
                residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            for key in [k for k, q in self.powersgd_q.items() if not bool(torch.isfinite(q).all())]:
                del self.powersgd_q[key]  # a host sync, on skipped steps only
        if ratio != 1.0:
            for residual in self.residuals.values():
                residual.mul_(ratio)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        # A copy: a residual is a view of a buffer that the next step overwrites.
        return {"residuals": {k: v.to("cpu", copy=True) for k, v in self.residuals.items()},
                "powersgd_q": {k: v.cpu() for k, v in self.powersgd_q.items()},
                "steps": self.steps, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(k): v for k, v in state.get("residuals", {}).items()}
        self.powersgd_q = {int(k): v for k, v in state.get("powersgd_q", {}).items()}
        self.steps = int(state.get("steps", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))
