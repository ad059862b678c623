"""Small collective helpers shared by the strategies: coalesced broadcast, cross-rank checks, error labels."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["all_gather_single", "reduce_scatter_single", "broadcast_coalesced", "check_same_across_ranks",
           "describe_module", "labelled"]

# torch 2.12 renamed the flat collectives (`all_gather_into_tensor` -> `all_gather_single`,
# `reduce_scatter_tensor` -> `reduce_scatter_single`, same arguments) and the old names now warn on
# every call; older versions have only the old names. Call these, never the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_BROADCAST_CHUNK_BYTES = 256 * 1024 * 1024


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = _BROADCAST_CHUNK_BYTES,
    via: torch.device | None = None,
) -> None:
    """Broadcast `tensors` in place from global rank `src`, packed into few flat messages.

    Tensors are grouped by (device, dtype) and packed into chunks of at most `chunk_bytes`, so a
    model with hundreds of small buffers costs a handful of collectives, and a huge model never
    needs a second full copy of itself.

    `via`: the device the group's collectives take their tensors on (NCCL: the GPU), for tensors that
    live elsewhere (a model still on the CPU): each chunk is packed where its tensors are, moved to
    `via` for the broadcast and back, one chunk at a time. None: every tensor is already there.
    """
    if dist.get_world_size(group) == 1 or not tensors:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for members in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in members:
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= chunk_bytes:
                _broadcast_chunk(chunk, src, group, via)
                chunk, size = [], 0
        if chunk:
            _broadcast_chunk(chunk, src, group, via)


def _broadcast_chunk(chunk: list[torch.Tensor], src: int, group, via: torch.device | None = None) -> None:
    staged = via is not None and chunk[0].device != torch.device(via)
    if len(chunk) == 1 and chunk[0].is_contiguous() and not staged:
        dist.broadcast(chunk[0].data, src=src, group=group)
        return
    # Packing and unpacking run in C++ and the copy back is one multi-tensor copy: a ResNet's hundred
    # and fifty BatchNorm buffers are broadcast before every forward, so per-tensor Python adds up.
    with torch.no_grad():
        flat = _flatten_dense_tensors(chunk)
        sent = flat.to(via) if staged else flat
        dist.broadcast(sent, src=src, group=group)
        if dist.get_rank() != src:  # the source's tensors already hold what it sent
            torch._foreach_copy_(chunk, _unflatten_dense_tensors(sent.to(flat.device) if staged else flat, chunk))


def describe_module(module: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    """(kind, name, shape, dtype, trains) for every parameter and buffer, in registration order. Whether
    a parameter trains counts too: ranks that froze different parameters of the same size would average
    the gradients of different parameters together, every collective lining up."""
    entries = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    entries += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return entries


def check_same_across_ranks(
    entries: Iterable[tuple], what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Raise the same ValueError on every rank if `entries` differ between ranks.

    One all-gather of the (small) descriptions; every rank then finds the same first difference, so
    every rank raises together and nobody is left waiting in a later collective.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    mine = list(entries)
    gathered: list[list[tuple] | None] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    reference = gathered[0]
    for rank in range(1, world_size):
        other = gathered[rank]
        if other == reference:
            continue
        for k in range(max(len(reference), len(other))):
            a = reference[k] if k < len(reference) else None
            b = other[k] if k < len(other) else None
            if a != b:
                raise ValueError(
                    f"{what} differs across ranks at entry {k}: rank 0 has {_fmt(a)}, rank {rank} has {_fmt(b)}. "
                    "Every rank must build the same model (same parameter names, shapes and dtypes) and freeze the "
                    "same parameters."
                )
    return


def _fmt(entry) -> str:
    if entry is None:
        return "nothing (fewer entries)"
    kind, name, shape, dtype, *trains = entry
    frozen = " frozen (requires_grad=False)" if kind == "parameter" and trains and not trains[0] else ""
    return f"{kind} '{name}' shape {list(shape)} dtype {dtype}{frozen}"


@contextlib.contextmanager
def labelled(operation: str) -> Iterator[None]:
    """Name the collective in any error it raises (a timeout then says what was waited for)."""
    try:
        yield
    except RuntimeError as err:
        raise RuntimeError(f"{operation} failed: {err}") from err
