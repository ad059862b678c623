"""Process groups over the nodes of a job: shard inside a node, replicate across nodes."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["make_hybrid_groups"]


def make_hybrid_groups(ranks_per_node: int, group: dist.ProcessGroup | None = None):
    """(shard group, replicate group) for this rank: shard inside a node, replicate across nodes.

    Every rank must call this (group creation is collective). Nodes are consecutive blocks of
    `ranks_per_node` ranks, as torchrun numbers them.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world size {world}")
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    nodes = world // ranks_per_node
    shard_group = replicate_group = None
    for n in range(nodes):
        g = dist.new_group(ranks[n * ranks_per_node : (n + 1) * ranks_per_node])
        if rank // ranks_per_node == n:
            shard_group = g
    for local in range(ranks_per_node):
        g = dist.new_group(ranks[local::ranks_per_node])
        if rank % ranks_per_node == local:
            replicate_group = g
    return shard_group, replicate_group
