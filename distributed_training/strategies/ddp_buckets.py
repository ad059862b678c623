"""DDP's gradient buckets: their size, their lookup tables, re-bucketing, and the gather before a launch.

`comm.bucket` decides which parameters share a bucket (`assign_buckets`) and allocates the flat
buffers (`allocate_buckets`). What `DDP` (and `Zero1DDP`, which pads every buffer) does with them
lives here, as plain functions over its parameter list:

* `resolve_bucket_cap_mb`: the bucket cap, from DDP's argument or the communication optimizer's.
* `index_buckets`: for each parameter, its bucket and its view into that bucket's buffer (the
  tables the gradient hooks read).
* `agreed_bucket_order`: the order to re-bucket in after the first step: the order gradients
  arrived on the group's first rank, broadcast so that every rank buckets identically.
* `move_grads_to_views`: when the layout changes, carry the gradients that live in the old buffers
  over to the new ones.
* `gather_bucket`: before a bucket is reduced, bring its gradients into its buffer with one
  multi-tensor copy, and make each `.grad` the view.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..comm.bucket import Bucket
from ..comm.collectives import labelled
from ..runtime import collective_device

__all__ = ["agreed_bucket_order", "gather_bucket", "index_buckets", "move_grads_to_views", "resolve_bucket_cap_mb"]


def resolve_bucket_cap_mb(given: float | None, reducer) -> float:
    """The bucket cap: `bucket_cap_mb` if given, else the reducer's ``bucket_size_mb`` if it has one,
    else the size it prefers (``preferred_bucket_size_mb``: Top-K's 100), else 25."""
    wanted = getattr(reducer, "bucket_size_mb", None)
    if given is None:
        if wanted is not None:
            return wanted
        preferred = getattr(reducer, "preferred_bucket_size_mb", None)
        return preferred if preferred is not None else 25.0
    if wanted is not None and wanted != given:
        raise ValueError(
            f"DDP(bucket_cap_mb={given!r}) and the communication optimizer's bucket_size_mb={wanted!r} disagree: "
            "give the bucket size in one place"
        )
    return given


def index_buckets(buckets: Sequence[Bucket], n_params: int) -> tuple[list[int], list[torch.Tensor]]:
    """For each of the `n_params` parameters: the index of its bucket, and its view into that bucket."""
    bucket_of = [0] * n_params
    view_of: list[torch.Tensor] = [None] * n_params  # type: ignore[list-item]
    for bucket in buckets:
        for i, view in zip(bucket.param_indices, bucket.views):
            bucket_of[i] = bucket.index
            view_of[i] = view
    return bucket_of, view_of


def agreed_bucket_order(arrived: list[int], n_params: int, buckets: Sequence[Bucket], *, world_size: int,
                        group: dist.ProcessGroup | None, src: int) -> list[int]:
    """The parameter order to re-bucket in: those that `arrived` (in arrival order), then the others in
    reverse registration order; with several ranks, global rank `src`'s order, broadcast over `group`
    (collective: every rank of the group must call it)."""
    # A parameter arrives once per backward pass: two passes before the rebuild (two losses backpropagated
    # with retain_graph=True in the first step) record it twice. Keep its first arrival only: a duplicate
    # would put it in two buckets, whose pending counts then never reach zero (never reduced).
    arrived = list(dict.fromkeys(arrived))
    seen = set(arrived)
    order = arrived + [i for i in reversed(range(n_params)) if i not in seen]
    if world_size > 1:
        # Every rank must bucket identically: take the first rank's observed order.
        device = collective_device(group, buckets[0].buffer.device if buckets else None)
        order_t = torch.tensor(order, dtype=torch.int64, device=device)
        with labelled("DDP broadcast of the bucket order"):
            dist.broadcast(order_t, src=src, group=group)
        order = order_t.tolist()
    return order


def move_grads_to_views(params: Sequence[torch.Tensor], old_views: Sequence[torch.Tensor],
                        new_views: Sequence[torch.Tensor]) -> None:
    """After a change of layout: copy each gradient that lives in its old bucket view into its new view,
    and make `.grad` the new view (gradients held elsewhere are left where they are)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            grad = p.grad
            if grad is not None and grad.data_ptr() == old_views[i].data_ptr():
                new_views[i].copy_(grad)
                p.grad = new_views[i]


def gather_bucket(bucket: Bucket, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor],
                  names: Sequence[str]) -> None:
    """Bring the bucket's gradients into its buffer before it is reduced.

    A gradient that autograd accumulated into `.grad` in place is already there (`.grad` is the
    bucket view: ``zero_grad(set_to_none=False)``, ``no_sync`` leftovers, ZeRO-1). One that autograd
    allocated (after ``zero_grad(set_to_none=True)``, the usual case) is copied in with one
    multi-tensor copy for the whole bucket, and `.grad` becomes the view. Doing this per bucket
    rather than in every parameter's hook keeps the hooks to bookkeeping: a copy launched from
    Python per parameter cost about as much host time as the rest of the hook (BERT, ResNet-50).
    A parameter without a gradient contributes zeros. `names` name the parameters in errors."""
    targets, sources, moved, empty = [], [], [], []
    for i in bucket.param_indices:
        grad = params[i].grad
        view = views[i]
        if grad is view:
            continue
        if grad is None:  # unused in this backward (or a hook cleared it): contributes zeros
            empty.append(view)
        else:
            if grad.is_sparse:
                raise RuntimeError(
                    f"parameter '{names[i]}' produced a sparse gradient; DDP supports dense "
                    "gradients only (use nn.Embedding(sparse=False))"
                )
            targets.append(view)
            sources.append(grad)
        moved.append(i)
    with torch.no_grad():
        if len(empty) == len(bucket.param_indices):
            bucket.buffer.zero_()  # nothing in this bucket got a gradient (join's shadow step, frozen parts)
        elif empty:
            torch._foreach_zero_(empty)
        if sources:
            torch._foreach_copy_(targets, sources)
    for i in moved:
        params[i].grad = views[i]
