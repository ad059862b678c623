"""Gradient buckets: flat per-dtype buffers whose slices are the parameters' `.grad` tensors.

A bucket is the unit of communication. Reducing one 25 MiB buffer costs about as much as reducing one
tiny tensor plus the bytes, so gradients are packed into few large flat buffers; but a bucket can only
be sent once its last gradient is ready, so buckets must not be so large that communication starts
late. PyTorch's choice, which we keep: 25 MiB buckets, and a small (1 MiB) first bucket so that the
first all-reduce starts almost as soon as backward does.

Each parameter's `.grad` is a view into its bucket (`gradient_as_bucket_view`): autograd accumulates
straight into the buffer that is sent, so there is no copy into the bucket and none back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["Bucket", "assign_buckets", "allocate_buckets", "bucket_layout"]

MIB = 1024 * 1024  # bucket caps are given in MiB (the `_mb` arguments, as torch DDP's bucket_cap_mb)


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    Attributes:
        index: position in launch order (every rank launches bucket i before bucket i + 1).
        param_indices: indices (into the strategy's parameter list) of the parameters in this bucket.
        buffer: the flat 1-D gradient buffer (one dtype, one device).
        views: for each parameter, the slice of `buffer` shaped like that parameter.
    """

    index: int
    param_indices: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def assign_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, walking `order` (the expected gradient-ready order).

    Each bucket holds one (device, dtype). A bucket is closed once it reaches its cap; the first
    bucket closed uses `first_cap_bytes`. A parameter larger than the cap gets a bucket of its own.
    Buckets are returned in the order they were closed, which is the order they become ready when
    gradients arrive in `order`.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    first_cap = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for i in order:
        p = params[i]
        key = (p.device, p.dtype)
        members, size = open_buckets.get(key, ([], 0))
        members.append(i)
        size += p.numel() * p.element_size()
        cap = first_cap if not closed else cap_bytes
        if size >= cap:
            closed.append(members)
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, size)
    # Whatever is still open closes in the order its last parameter arrived.
    position = {i: k for k, i in enumerate(order)}
    rest = sorted(open_buckets.values(), key=lambda entry: position[entry[0][-1]])
    closed.extend(members for members, _ in rest)
    return closed


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether `t`'s strides lay its elements out densely, without overlap (contiguous, channels_last, a
    permutation of a contiguous tensor): then `numel` consecutive elements can hold it in that layout."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def view_like(segment: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`segment` (``like.numel()`` consecutive elements of a flat buffer) viewed with `like`'s shape and,
    where `like` is laid out densely but not contiguously (a ``channels_last`` convolution weight),
    with its strides too: a gradient in a bucket then has its parameter's layout, as optimizers (the
    fused ones require it) and the parameter's own gradient would."""
    if like.is_contiguous() or not _dense_layout(like):
        return segment.view(like.shape)
    return segment.as_strided(like.shape, like.stride(), segment.storage_offset())


def allocate_buckets(params: Sequence[torch.Tensor], groups: list[list[int]], pad_to: int = 1,
                     keep_layout: bool = True) -> list[Bucket]:
    """Allocate one zeroed flat buffer per group and carve it into per-parameter views.

    With `pad_to` > 1 each buffer is padded with zeros (after the last view) to a multiple of it, so
    that it cuts into `pad_to` equal slices: ZeRO-1 reduce-scatters every bucket over the world size.
    Each view has its parameter's layout (`view_like`), or with `keep_layout=False` the contiguous one
    (ZeRO-1, whose flat shards hold the parameters themselves in the logical order its checkpoints use).
    """
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ValueError(f"pad_to must be a positive integer, got {pad_to!r}")
    buckets = []
    for b, members in enumerate(groups):
        first = params[members[0]]
        total = sum(params[i].numel() for i in members)
        buffer = torch.zeros(-(-total // pad_to) * pad_to, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for i in members:
            n = params[i].numel()
            segment = buffer[offset : offset + n]
            views.append(view_like(segment, params[i]) if keep_layout else segment.view(params[i].shape))
            offset += n
        buckets.append(Bucket(index=b, param_indices=list(members), buffer=buffer, views=views))
    return buckets


def bucket_layout(bucket: Bucket) -> list[tuple[int, tuple[int, ...]]]:
    """(offset in the buffer, shape in memory order) of each view: what a reducer that treats tensors
    differently (PowerSGD's matrices) needs. Memory order puts the outermost dimension first, so a
    ``channels_last`` convolution's (out, in, kh, kw) is (out, kh, kw, in): still one row per output."""
    start = bucket.buffer.storage_offset()
    layout = []
    for view in bucket.views:
        dims = sorted(range(view.dim()), key=lambda d: -view.stride(d)) if view.dim() else []
        layout.append((view.storage_offset() - start, tuple(view.shape[d] for d in dims)))
    return layout
