"""Process groups over the nodes of a job: shard inside a node, replicate across nodes."""

from __future__ import annotations

import torch.distributed as dist

from ..mesh import Mesh

__all__ = ["make_hybrid_groups"]


def make_hybrid_groups(ranks_per_node: int, group: dist.ProcessGroup | None = None):
    """(shard group, replicate group) for this rank: shard inside a node, replicate across nodes.

    Every rank must call this (group creation is collective). Nodes are consecutive blocks of
    `ranks_per_node` ranks, as torchrun numbers them. The mesh's node groups of a data-parallel mesh
    over `group` (`Mesh.node_groups`); kept for callers that want the two groups alone.
    """
    return Mesh(group=group, ranks_per_node=ranks_per_node).node_groups()
