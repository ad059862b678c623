"""All-reduce built by hand from point-to-point messages: ring, tree, and hierarchical.

Each works for any world size and any tensor length and returns the sum in place (callers divide for
the mean); every rank ends with the same bits, because each element is summed on one rank and copied
to the others.

* **ring**: reduce-scatter then all-gather around the ring r -> r+1, W - 1 steps each. With W ranks
  each sends 2 (W - 1) / W of the tensor: bandwidth-optimal, latency 2 (W - 1) steps.
* **tree**: two binary trees over the ranks, the second the mirror image of the first, each carrying
  half of the tensor (as NCCL's double binary tree): a rank that is an inner node of one tree is
  mostly a leaf of the other, so the load is spread and, at 4 ranks, every rank moves as many bytes as
  in the ring. Latency about 3 log2 W steps: better for small messages at large W.
* **hierarchical**: reduce-scatter inside a node, all-reduce across nodes among ranks with the same
  local rank, all-gather inside the node; slow inter-node links carry 1/(ranks per node) of the tensor.
  With one node (or nodes of one rank) there is nothing to split: one flat all-reduce.

How the ring and the tree stay near the links' bandwidth
-------------------------------------------------------
The tensor is cut into segments and the segments are pipelined: while segment i is on the wire,
segment i - 1, which has just arrived, is added into the local sum, and is sent on as soon as the add
is done. Each message (the send to one neighbour and the receive from the other) is one
`batch_isend_irecv`, so both directions of a link work at once. Receive buffers are allocated once per
call and reused round-robin (`in_flight` of them in the ring, two per child in the tree).

No host synchronisation anywhere on NCCL: `work.wait()` only makes the current stream wait for the
message, and NCCL starts a message only after the work queued on the current stream before it. So the
order in which we *queue* things is the whole schedule: an add is queued right after the wait for the
message it reads, and the next message that sends its result is queued after that add, so the GPU
runs add i beside message i + 1. On gloo the same code is correct because `wait()` blocks until the
message is done (`_sendrecv` is the only place that posts messages).

On NCCL a message's speed depends on its size (NCCL gives a send/recv under 256 MiB about half of the
link's channels), so the segments that let adds overlap the wire would each be slow. The ring spreads
them over lanes instead: communicators of their own over the same ranks (`ring_lanes`), one segment per
lane, so several messages are on the wire at once, each with its own channels and stream.

Segments are cut with `torch.tensor_split` into the same number of pieces on every rank, so a segment
has the same length on the sender and the receiver even when lengths are not multiples of anything;
empty pieces send nothing.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from ..mesh import global_rank
from .bucket import MIB
from .collectives import all_gather_single, reduce_scatter_single

__all__ = ["ring_all_reduce", "ring_lanes", "tree_all_reduce", "hierarchical_all_reduce"]

DEFAULT_IN_FLIGHT = 3
# Automatic segment sizes: a ring's chunk whole up to 256 MiB (in as few segments of at most that as it
# takes), a tree's half in 4, within [min, max]. Measured at 1 GB on 2x H200 (suite, session 14): the
# ring at 0.74x of NCCL's bus bandwidth with 64 MiB segments, 0.82x with 256 MiB (16 MiB: 0.45x); on 4x
# H200 (session 16) 0.42x with 64 MiB, 0.43x with 128 (a 256 MiB chunk in 2), 0.76x with the whole
# chunk; the tree 0.59x with 16 MiB, 0.76x with 64, 0.82x with 256.
_RING_SEGMENTS, _RING_MIN, _RING_MAX = 1, 8 * MIB, 256 * MIB
# Lanes (NCCL only). One NCCL send/recv gives a message only some of the link's channels, and how many
# depends on its size: on 4x H200 (NCCL 2.28, `benchmarks/ring_probe.py`, session 20) an exchange with
# both ring neighbours moved 155 GB/s at 64 MiB and 161 at 128 MiB, but 294 at 256 MiB; two 128 MiB
# messages in one batch still 161. So smaller segments, which would let the adds overlap the wire, ran
# at half speed (the 0.42x above). Messages on separate communicators run at once, each with its own
# channels: four 64 MiB messages on four communicators moved 315 GB/s. The ring therefore spreads its
# segments over RING_LANES communicators (`ring_lanes`), one segment per lane of at least _LANE_MIN, for
# chunks of at least RING_LANES such segments. At 1 GB: on 4 GPUs 4 lanes x 64 MiB 0.82-0.86x of NCCL's
# all-reduce (probe and suite; one lane 0.77x; 4 lanes x 2 segments of 32 MiB 0.87x in the probe but
# 0.57-0.70x in the suite), on 2 GPUs 4 lanes x 128 MiB 0.96x (one lane 0.82x). Smaller segments on lanes
# lost to one lane (session 20's suite: 64 MB on 4 GPUs 26 GB/s against 108, 256 MB on 2 GPUs 190 against
# 242), so smaller tensors keep one lane and whole-chunk messages.
RING_LANES, _LANE_MIN = 4, 64 * MIB
_lanes_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TREE_SEGMENTS, _TREE_MIN, _TREE_MAX = 4, 4 * MIB, 256 * MIB


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def _write_back(flat: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if flat.data_ptr() != tensor.data_ptr():  # a non-contiguous input was reduced in a copy
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _check(segment_bytes, in_flight=None) -> None:
    if segment_bytes is not None and (isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int)
                                      or segment_bytes < 1):
        raise ValueError(f"segment_bytes must be a positive integer number of bytes or None (automatic), "
                         f"got {segment_bytes!r}")
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1):
        raise ValueError(f"in_flight must be a positive integer or None (automatic), got {in_flight!r}")


def ring_lanes(group: dist.ProcessGroup | None = None, count: int = RING_LANES) -> list[dist.ProcessGroup]:
    """``count - 1`` more NCCL communicators over the world's ranks: the ring's extra lanes
    (`ring_all_reduce`). Made once (`new_group`, by every rank together: the ring's first call on a
    CUDA tensor over the world) and kept while the world's group lives. ``[]`` for a group that is not
    NCCL or not the whole world: a subgroup's lanes would need every rank of the world to make them
    (`new_group`), and `split_group`, which needs only the members, failed on torch 2.11 + NCCL 2.28
    here; such a ring runs on one communicator, as before (pass `lanes` to `ring_all_reduce` to give
    it some)."""
    if (dist.get_backend(group) != "nccl" or count < 2 or dist.get_world_size(group) < 2
            or dist.get_world_size(group) != dist.get_world_size()):
        return []
    key = group if group is not None else dist.group.WORLD
    lanes = _lanes_of.get(key)
    if lanes is None:
        ranks = dist.get_process_group_ranks(key)  # every rank of the world (new_group orders by rank)
        _lanes_of[key] = lanes = [dist.new_group(ranks) for _ in range(count - 1)]
    return lanes[: count - 1]


def _segment_count(piece: int, element_size: int, segment_bytes, auto: tuple[int, int, int]) -> int:
    """How many segments a piece of `piece` elements is cut into (the same on every rank)."""
    nbytes = piece * element_size
    if segment_bytes is None:
        count, low, high = auto
        segment_bytes = min(high, max(low, nbytes // count))
    return max(1, -(-nbytes // max(segment_bytes, element_size)))


def _sendrecv(ops: list[tuple[str, torch.Tensor, int]], group) -> list:
    """Post one message: ("send" | "recv", tensor, group rank) operations in one batch; empty tensors
    are skipped (the peer skips the matching one: both cut the same pieces)."""
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, global_rank(group, peer), group)
           for kind, t, peer in ops if t.numel()]
    return dist.batch_isend_irecv(p2p) if p2p else []


class _Messages:
    """Posted messages by index; `wait(i)` waits for message i once (stream-ordered on NCCL)."""

    def __init__(self) -> None:
        self.works: dict[int, list] = {}

    def post(self, i: int, ops, group) -> None:
        self.works[i] = _sendrecv(ops, group)

    def wait(self, i: int) -> None:
        for work in self.works.pop(i, ()):
            work.wait()

    def wait_all(self) -> None:
        for i in sorted(self.works):
            self.wait(i)


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    segment_bytes: int | None = None, in_flight: int | None = None,
                    lanes: Sequence[dist.ProcessGroup] | None = None) -> torch.Tensor:
    """Sum `tensor` over `group` in place with a pipelined ring of point-to-point messages.

    The tensor is split into W chunks (lengths differ by at most one) and each chunk into K segments
    of at most `segment_bytes` (default: on NCCL, for chunks of 256 MiB or more, one per lane, see
    `lanes`; else the whole chunk, in pieces of at most 256 MiB). Message
    (step s, segment k) of the reduce-scatter sends segment k of chunk r - s to rank r + 1 and receives
    segment k of chunk r - s - 1 from rank r - 1 into a buffer, which is then added into the local
    chunk; after W - 1 steps rank r holds the full sum of chunk r + 1. The all-gather passes the
    finished chunks on for W - 1 more steps, received straight into place.

    Messages run in the order (step, segment). Message n sends what the add of message n - K produced,
    and receives into buffer n mod D, which the add of message n - D read; so it is queued right after
    the add of message n - min(K, D), and D = min(`in_flight`, K) messages are queued ahead of the
    adds: the add of one segment runs while the next ones are on the wire. Segment j's messages go
    through lane j mod L, so L of them are on the wire at once.

    Args:
        tensor: any shape and dtype; summed in place (a non-contiguous tensor through a copy).
        group: the process group (default: the world).
        segment_bytes: the largest message, in bytes; ``None`` chooses by size.
        in_flight: receive buffers, i.e. messages queued ahead of the adds (at most K are useful);
            ``None``: 3, or one per lane.
        lanes: more groups over the same ranks in the same order: segment j's messages go through
            lane j mod L (`group` is lane 0); on NCCL, where each communicator has its own stream and
            channels, L segments are on the wire at once while the adds of others run. ``None``
            (default): `ring_lanes` on NCCL tensors whose chunks are 256 MiB or more, none elsewhere;
            ``()``: none.
    """
    _check(segment_bytes, in_flight)
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    flat = _flat(tensor)
    chunks = torch.tensor_split(flat, world)  # the first chunks are the longest
    chunk_bytes = chunks[0].numel() * flat.element_size()
    if lanes is None:  # made on the first call that would use them (not for DDP's usual 25 MiB buckets)
        lanes = ring_lanes(group) if flat.is_cuda and chunk_bytes >= RING_LANES * _LANE_MIN else []
    if segment_bytes is None and lanes:
        k = max(1, min(len(lanes) + 1, chunk_bytes // _LANE_MIN))
    else:
        k = _segment_count(chunks[0].numel(), flat.element_size(), segment_bytes,
                           (_RING_SEGMENTS, _RING_MIN, _RING_MAX))
    lanes = list(lanes)[: k - 1]
    segs = [torch.tensor_split(c, k) for c in chunks]  # segs[chunk][segment], K pieces on every rank
    if in_flight is None:
        in_flight = len(lanes) + 1 if lanes else DEFAULT_IN_FLIGHT
    depth = min(in_flight, k)
    buffers = flat.new_empty((depth, segs[0][0].numel()))  # segs[0][0] is the longest segment
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    steps = (world - 1) * k  # messages per phase
    total = 2 * steps

    def ops(n: int):
        """(send, receive, add-into or None) of message n."""
        phase, rest = divmod(n, steps)
        s, j = divmod(rest, k)
        if phase == 0:  # reduce-scatter: receive into a buffer, then add it into chunk r - s - 1
            into = segs[(rank - s - 1) % world][j]
            return segs[(rank - s) % world][j], buffers[n % depth, : into.numel()], into
        return segs[(rank + 1 - s) % world][j], segs[(rank - s) % world][j], None  # all-gather: in place

    messages = _Messages()
    posted = 0
    groups = [group, *lanes]

    def post_until(end: int) -> None:
        nonlocal posted
        while posted < min(end, total):
            # The all-gather forwards what message posted - k received: on gloo, wait for it (on NCCL
            # the wait only orders the streams, which the NCCL stream already is).
            messages.wait(posted - k)
            send, recv, _ = ops(posted)
            lane = groups[(posted % k) % len(groups)]
            messages.post(posted, [("send", send, nxt), ("recv", recv, prv)], lane)
            posted += 1

    for n in range(steps):  # the adds of the reduce-scatter, each followed by the message it frees
        post_until(n + depth)
        messages.wait(n)
        _, recv, into = ops(n)
        into.add_(recv)
    post_until(total)
    messages.wait_all()
    return _write_back(flat, tensor)


def _tree(world: int, mirror: bool):
    """A binary tree over positions 0..W-1 (children of p: 2p+1, 2p+2), rank = position or, for the
    mirrored tree, W - 1 - position. Returns (rank of position, position of rank, height, depth)."""
    rank_of = [world - 1 - p if mirror else p for p in range(world)]
    height = [0] * world
    for p in reversed(range(world)):
        kids = [c for c in (2 * p + 1, 2 * p + 2) if c < world]
        height[p] = 1 + max(height[c] for c in kids) if kids else 0
    depth = [(p + 1).bit_length() - 1 for p in range(world)]
    return rank_of, {r: p for p, r in enumerate(rank_of)}, height, depth


def tree_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    segment_bytes: int | None = None) -> torch.Tensor:
    """Sum `tensor` over `group` in place: a pipelined double binary tree (see the module docstring).

    Each half of the tensor goes through its own tree, cut into K segments of at most `segment_bytes`
    (default: about 1/32 of a half, between 4 and 16 MiB). Segments go up the tree, summed at each
    inner node, and back down from the root; all ranks run in lock-step ticks, every tick one batched
    message per rank holding all its sends and receives of that tick (of both trees). With h the
    height of a node (leaves 0), d its depth and H the root's height, segment j

    * goes from a node to its parent at tick j + 2h: the parent received its children's copies by tick
      j + 2h - 2 and queued their adds after posting tick j + 2h - 1, so the add of one tick runs
      beside the next tick's transfers (two ticks per level);
    * goes from the root down at tick j + 2H, and from a node at depth d to its children at tick
      j + 2H + d, one tick after it arrived (no add on the way down: it is received in place).

    So K segments take K + 2H + max depth ticks; bandwidth stays flat as the tensor grows.

    Args:
        tensor: any shape and dtype; summed in place (a non-contiguous tensor through a copy).
        group: the process group (default: the world).
        segment_bytes: the largest message per tree and link, in bytes; ``None`` chooses by size.
    """
    _check(segment_bytes)
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    flat = _flat(tensor)
    halves = torch.tensor_split(flat, 2)
    k = _segment_count(halves[0].numel(), flat.element_size(), segment_bytes,
                       (_TREE_SEGMENTS, _TREE_MIN, _TREE_MAX))
    longest = torch.tensor_split(halves[0], k)[0].numel()
    sends: dict[int, list] = {}  # tick -> [(kind, tensor, group rank)] in a fixed order (see below)
    adds: dict[int, list] = {}  # tick -> [(into, buffer)] for what arrives at that tick
    plans = []
    for mirror, half in zip((False, True), halves):
        rank_of, pos_of, height, depth = _tree(world, mirror)
        p = pos_of[rank]
        kids = [c for c in (2 * p + 1, 2 * p + 2) if c < world]
        plans.append((half, rank_of, p, kids, height, depth))
    n_kids = sum(len(plan[3]) for plan in plans)
    buffers = flat.new_empty((max(1, 2 * n_kids), longest))  # two per child: a tick's add frees one
    slot = 0
    # Both ranks of a pair list their operations in the same order (tree by tree, segment by segment),
    # so two messages between the same pair in one tick (one per tree) are matched correctly.
    for half, rank_of, p, kids, height, depth in plans:
        top = height[0]
        segs = torch.tensor_split(half, k)
        for j, seg in enumerate(segs):
            for i, c in enumerate(kids):  # up: children's partial sums into buffers, added after a tick
                buf = buffers[slot + 2 * i + j % 2, : seg.numel()]
                sends.setdefault(j + 2 * height[c], []).append(("recv", buf, rank_of[c]))
                adds.setdefault(j + 2 * height[c], []).append((seg, buf))
            if p:
                parent = rank_of[(p - 1) // 2]
                sends.setdefault(j + 2 * height[p], []).append(("send", seg, parent))
                sends.setdefault(j + 2 * top + depth[p] - 1, []).append(("recv", seg, parent))  # down, in place
            for c in kids:
                sends.setdefault(j + 2 * top + depth[p], []).append(("send", seg, rank_of[c]))
        slot += 2 * len(kids)
    messages = _Messages()
    for tick in range(max(sends) + 1):
        # Sends of this tick may forward what arrived last tick: on gloo wait for it; on NCCL this only
        # orders the current stream after it (the NCCL stream runs ticks in order anyway).
        messages.wait(tick - 1)
        if tick in sends:
            messages.post(tick, sends[tick], group)
        for into, buf in adds.pop(tick - 1, ()):  # queued after the next tick: runs beside its transfers
            into.add_(buf)
    messages.wait_all()
    for tick in sorted(adds):  # what arrived at the last tick (none in this schedule, kept for safety)
        for into, buf in adds[tick]:
            into.add_(buf)
    return _write_back(flat, tensor)


def hierarchical_all_reduce(tensor: torch.Tensor, intra_node_group: dist.ProcessGroup | None,
                            inter_node_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `tensor` over every rank of both groups in place (see the module docstring). As everywhere
    in torch.distributed, a group of ``None`` is the default group (a mesh whose nodes are single ranks
    gives ``None`` as the inter-node group of a job-wide mesh).

    With a single node (inter-node group of one) or nodes of one rank (intra-node group of one) it is
    one all-reduce over the other group: exactly what a flat all-reduce costs. Otherwise the length
    is padded to a multiple of the node size only when it is not one already (no copy otherwise)."""
    local = dist.get_world_size(intra_node_group)
    across = dist.get_world_size(inter_node_group)
    if local * across == 1 or tensor.numel() == 0:
        return tensor
    flat = _flat(tensor)
    if across == 1 or local == 1:
        dist.all_reduce(flat, group=intra_node_group if across == 1 else inter_node_group)
        return _write_back(flat, tensor)
    n = flat.numel()
    size = -(-n // local)
    if size * local == n:
        padded = flat
    else:
        padded = flat.new_zeros(size * local)
        padded[:n].copy_(flat)
    part = flat.new_empty(size)
    reduce_scatter_single(part, padded, op=dist.ReduceOp.SUM, group=intra_node_group)
    dist.all_reduce(part, group=inter_node_group)
    all_gather_single(padded, part, group=intra_node_group)
    if padded is not flat:
        flat.copy_(padded[:n])
    return _write_back(flat, tensor)
