"""All-reduce built by hand from point-to-point messages: ring, tree, and hierarchical.

Each works for any world size and any tensor length and returns the sum in place (callers divide for
the mean). Messages are cut into segments of at most `segment_bytes`; all segments of one ring step
travel in one `batch_isend_irecv`, so large tensors keep several transfers in flight.

* **ring**: reduce-scatter then all-gather around the ring r -> r+1. With W ranks each sends
  2 (W - 1) / W of the tensor: bandwidth-optimal, latency 2 (W - 1) steps.
* **tree**: reduce up a binary tree to rank 0, then broadcast down; latency 2 log2 W steps, each
  rank sends up to 2x the tensor: better for small messages.
* **hierarchical**: reduce-scatter inside a node, all-reduce across nodes among ranks with the same
  local rank, all-gather inside the node; slow inter-node links carry 1/(ranks per node) of the tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_single, reduce_scatter_single

__all__ = ["ring_all_reduce", "tree_all_reduce", "hierarchical_all_reduce"]

DEFAULT_SEGMENT_BYTES = 4 * 1024 * 1024


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def _segments(t: torch.Tensor, segment_bytes: int) -> list[torch.Tensor]:
    per = max(1, segment_bytes // max(t.element_size(), 1))
    return [t[i : i + per] for i in range(0, t.numel(), per)] if t.numel() else []


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def _write_back(flat: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if flat.data_ptr() != tensor.data_ptr():  # a non-contiguous input was reduced in a copy
        tensor.copy_(flat.view_as(tensor))
    return tensor


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> torch.Tensor:
    """Sum `tensor` over `group` in place with a ring of point-to-point messages."""
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    flat = _flat(tensor)
    chunks = list(torch.tensor_split(flat, world))  # uneven lengths are fine: sizes differ by at most one
    nxt, prv = _global(group, (rank + 1) % world), _global(group, (rank - 1) % world)
    # Reduce-scatter: after W-1 steps rank r holds the full sum of chunk (r + 1) % W.
    for step in range(world - 1):
        send_c = chunks[(rank - step) % world]
        recv_c = chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv_c)
        _exchange(send_c, nxt, incoming, prv, group, segment_bytes)
        recv_c.add_(incoming)
    # All-gather: pass the finished chunks around the ring.
    for step in range(world - 1):
        send_c = chunks[(rank + 1 - step) % world]
        recv_c = chunks[(rank - step) % world]
        _exchange(send_c, nxt, recv_c, prv, group, segment_bytes)
    return _write_back(flat, tensor)


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, segment_bytes: int) -> None:
    ops = []
    for s, r in zip(_segments(send, segment_bytes), _segments(recv, segment_bytes)):
        ops.append(dist.P2POp(dist.isend, s.contiguous(), dst, group))
        ops.append(dist.P2POp(dist.irecv, r, src, group))
    # Chunk sizes of neighbours differ by at most one element; send any leftover segment alone.
    send_segs, recv_segs = _segments(send, segment_bytes), _segments(recv, segment_bytes)
    for s in send_segs[len(recv_segs):]:
        ops.append(dist.P2POp(dist.isend, s.contiguous(), dst, group))
    for r in recv_segs[len(send_segs):]:
        ops.append(dist.P2POp(dist.irecv, r, src, group))
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def tree_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> torch.Tensor:
    """Sum `tensor` over `group` in place: reduce up a binary tree rooted at rank 0, broadcast down."""
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    flat = _flat(tensor)
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < world]
    parent = (rank - 1) // 2 if rank else None
    for seg in _segments(flat, segment_bytes):
        buffers = [torch.empty_like(seg) for _ in children]
        works = [dist.irecv(b, _global(group, c), group) for b, c in zip(buffers, children)]
        for w, b in zip(works, buffers):
            w.wait()
            seg.add_(b)
        if parent is not None:
            dist.isend(seg.contiguous(), _global(group, parent), group).wait()
            dist.irecv(seg, _global(group, parent), group).wait()
        sends = [dist.isend(seg, _global(group, c), group) for c in children]
        for w in sends:
            w.wait()
    return _write_back(flat, tensor)


def hierarchical_all_reduce(tensor: torch.Tensor, intra_node_group: dist.ProcessGroup | None,
                            inter_node_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `tensor` over every rank of both groups in place (see the module docstring). As everywhere
    in torch.distributed, a group of ``None`` is the default group (a mesh whose nodes are single ranks
    gives ``None`` as the inter-node group of a job-wide mesh)."""
    local = dist.get_world_size(intra_node_group)
    flat = tensor.reshape(-1)
    n = flat.numel()
    size = -(-n // local) if n else 0
    padded = torch.zeros(size * local, dtype=tensor.dtype, device=tensor.device)
    padded[:n].copy_(flat)
    part = torch.empty(size, dtype=tensor.dtype, device=tensor.device)
    if local > 1:
        reduce_scatter_single(part, padded, op=dist.ReduceOp.SUM, group=intra_node_group)
    else:
        part.copy_(padded)
    if dist.get_world_size(inter_node_group) > 1:
        dist.all_reduce(part, group=inter_node_group)
    if local > 1:
        all_gather_single(padded, part, group=intra_node_group)
    else:
        padded.copy_(part)
    tensor.copy_(padded[:n].view_as(tensor))
    return tensor
