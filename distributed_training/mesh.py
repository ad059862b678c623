"""The mesh: how a job's ranks are laid out over the parallel dimensions, and this rank's process
group along each of them.

Dimensions, outermost first:

    pipeline        stages of the model, each holding some of its layers
    data_replicate  replicas of the sharded state (hybrid sharding: one per node)
    data_shard      ranks that split parameters, gradients and optimizer state (FSDP, ZeRO)
    tensor          ranks that split each layer's matrices between them

A rank with coordinates (p, r, s, t) in a mesh of sizes (P, R, S, T) has mesh rank

    rank = ((p * R + r) * S + s) * T + t

so tensor-parallel peers are consecutive ranks, which torchrun places on one node: the collectives
with the most traffic (one or two per layer, on the critical path) stay on the fastest links. Data
sharding comes next, data replication after it, and pipeline stages are outermost: a stage boundary
carries one activation per micro-batch, the least traffic, and may cross nodes.

``"data"`` names the flattened data-parallel dimension, data_replicate x data_shard: the ranks that
see different batches. This rank feeds data-parallel replica `dp_rank` = r * S + s of `dp_size` = R * S;
DDP averages gradients over the ``"data"`` group, FSDP shards over ``"data_shard"`` and averages
shards over ``"data_replicate"``.

Nodes are consecutive blocks of `ranks_per_node` ranks, as torchrun numbers them: the runtime takes
the block size from ``LOCAL_WORLD_SIZE``; `with_ranks_per_node` emulates other node sizes (tests on one
machine, FSDP's ``ranks_per_node=``). `node_groups()` splits this rank's data-parallel group into the
ranks of its node and the ranks at the same place on the other nodes (hierarchical all-reduce), and
`hybrid()` re-splits the data dimensions at node boundaries (FSDP's hybrid sharding).

Groups. Creating a process group is collective: every rank of the parent group must create every
group, in the same order. A `Mesh` creates the groups of its dimensions when it is built (so every
rank must build the same meshes in the same order), and `node_groups()`, `hybrid()`,
`with_data_shard()` create what they need the first time (so every rank must call them together, as
the wrappers' constructors do). A dimension spanning the whole mesh reuses the parent group (``None``
for the default group: no new communicator); a dimension of size 1 gets a group of one rank, made
locally when first asked for, so that `group(dim)` never answers ``None`` (the whole world) for it.
Groups are remembered by their ranks in a table that derived meshes share, so a group is created at
most once however many meshes ask for it. Nothing is module-level state: the mesh owns its table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

__all__ = ["Mesh", "MeshLayout", "DIMS"]

#: The parallel dimensions, outermost first (the order of the rank arithmetic).
DIMS = ("pipeline", "data_replicate", "data_shard", "tensor")
_ALL_DIMS = DIMS + ("data",)


def _check_dim(dim: str) -> None:
    if dim not in _ALL_DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}: expected one of {list(_ALL_DIMS)}")


def global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (`group` None: the default group, where they are equal)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the dimensions, and the rank arithmetic over them (no process groups).

    Attributes:
        pipeline: number of pipeline stages.
        data_replicate: number of replicas of the data-parallel shards.
        data_shard: number of ranks the data-parallel state is sharded over.
        tensor: number of tensor-parallel ranks.
    """

    pipeline: int = 1
    data_replicate: int = 1
    data_shard: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for dim in DIMS:
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh dimension {dim} must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, world_size: int, *, pipeline: int = 1, data_replicate: int | None = None,
           data_shard: int | None = None, tensor: int = 1) -> "MeshLayout":
        """The layout of `world_size` ranks; the data dimensions left out take what remains
        (all of it to `data_shard` when both are left out). Raises if the sizes do not multiply to
        `world_size`, naming them."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        for dim, value in (("pipeline", pipeline), ("tensor", tensor), ("data_replicate", data_replicate),
                           ("data_shard", data_shard)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"mesh dimension {dim} must be a positive integer, got {value!r}")
        sizes = f"pipeline={pipeline}, data_replicate={data_replicate}, data_shard={data_shard}, tensor={tensor}"
        model = pipeline * tensor
        if world_size % model:
            raise ValueError(f"pipeline x tensor = {model} does not divide the world size {world_size} ({sizes})")
        data = world_size // model
        if data_replicate is None and data_shard is None:
            data_replicate, data_shard = 1, data
        elif data_replicate is None:
            if data % data_shard:
                raise ValueError(f"data_shard={data_shard} does not divide the {data} data-parallel ranks "
                                 f"(world {world_size}; {sizes})")
            data_replicate = data // data_shard
        elif data_shard is None:
            if data % data_replicate:
                raise ValueError(f"data_replicate={data_replicate} does not divide the {data} data-parallel ranks "
                                 f"(world {world_size}; {sizes})")
            data_shard = data // data_replicate
        if data_replicate * data_shard != data:
            raise ValueError(f"pipeline x data_replicate x data_shard x tensor = "
                             f"{model * data_replicate * data_shard} is not the world size {world_size} ({sizes})")
        return cls(pipeline, data_replicate, data_shard, tensor)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_replicate * self.data_shard * self.tensor

    def size(self, dim: str) -> int:
        _check_dim(dim)
        return self.data_replicate * self.data_shard if dim == "data" else getattr(self, dim)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each dimension (``"data"`` included: its data-parallel index)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        rest, t = divmod(rank, self.tensor)
        rest, s = divmod(rest, self.data_shard)
        p, r = divmod(rest, self.data_replicate)
        return {"pipeline": p, "data_replicate": r, "data_shard": s, "tensor": t, "data": r * self.data_shard + s}

    def rank_of(self, pipeline: int = 0, data_replicate: int = 0, data_shard: int = 0, tensor: int = 0) -> int:
        """The mesh rank at these coordinates."""
        coords = (pipeline, data_replicate, data_shard, tensor)
        for dim, c in zip(DIMS, coords):
            if not 0 <= c < getattr(self, dim):
                raise ValueError(f"coordinate {dim}={c} is outside [0, {getattr(self, dim)})")
        return ((pipeline * self.data_replicate + data_replicate) * self.data_shard + data_shard) * self.tensor + tensor

    def ranks_along(self, dim: str, rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `dim`, in order of their coordinate on it:
        the members of `rank`'s group for `dim`, in group-rank order."""
        c = self.coords(rank)
        if dim == "data":
            return [self.rank_of(c["pipeline"], d // self.data_shard, d % self.data_shard, c["tensor"])
                    for d in range(self.size("data"))]
        _check_dim(dim)
        out = []
        for i in range(getattr(self, dim)):
            c2 = dict(c, **{dim: i})
            out.append(self.rank_of(c2["pipeline"], c2["data_replicate"], c2["data_shard"], c2["tensor"]))
        return out

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of `dim`: a partition of the ranks, in a fixed order (by lowest member)."""
        seen: set[int] = set()
        out = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.ranks_along(dim, rank)
                seen.update(members)
                out.append(members)
        return out

    def node_split(self, ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
        """(intra-node groups, inter-node groups) of every data-parallel group, for nodes of
        `ranks_per_node` consecutive ranks: each data-parallel group is cut into the members on each
        node, and the i-th members of those pieces form an inter-node group. Raises unless every node
        holds the same number of each data-parallel group's members."""
        world = self.world_size
        if world % ranks_per_node:
            sizes = ", ".join(str(ranks_per_node * k) for k in range(1, 5))
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world size {world} "
                             f"(nodes of equal size): the world sizes that keep nodes of {ranks_per_node} ranks "
                             f"are multiples of {ranks_per_node} ({sizes}, ...)")
        intra: list[list[int]] = []
        inter: list[list[int]] = []
        for members in self.groups("data"):
            pieces: dict[int, list[int]] = {}
            for r in members:
                pieces.setdefault(r // ranks_per_node, []).append(r)
            parts = list(pieces.values())
            if {len(p) for p in parts} != {len(intra[0]) if intra else len(parts[0])}:
                raise ValueError(
                    f"nodes of {ranks_per_node} ranks hold unequal parts of the data-parallel groups of {self} "
                    f"(group {members}: {[len(p) for p in parts]} rank(s) on its nodes"
                    + (f"; group {self.groups('data')[0]}: {len(intra[0])} per node" if intra else "")
                    + "): make the node size a multiple of tensor, and a divisor or a multiple of "
                    "data_replicate x data_shard x tensor"
                )
            intra.extend(parts)
            inter.extend([p[i] for p in parts] for i in range(len(parts[0])))
        return intra, inter


class _GroupTable:
    """Process groups by their member ranks (mesh ranks), shared by a mesh and the meshes derived
    from it, so that each set of ranks gets one group."""

    def __init__(self, parent: dist.ProcessGroup | None, world_size: int) -> None:
        self.parent = parent
        self.world_size = world_size
        self.groups: dict[tuple[int, ...], object] = {}
        self.node_sizes_agreed: set[int] = set()  # (`Mesh._node_split`)

    def _global(self, rank: int) -> int:
        return global_rank(self.parent, rank)

    def create(self, rank_lists: Sequence[Sequence[int]]) -> None:
        """Create the groups not made yet, in order. Collective over the parent group: every rank must
        call this with the same lists (non-members receive a placeholder and keep it, so that a later
        call skips the same groups on every rank)."""
        for ranks in rank_lists:
            key = tuple(ranks)
            if len(key) in (1, self.world_size) or key in self.groups:
                continue
            self.groups[key] = dist.new_group([self._global(r) for r in key])

    def get(self, ranks: Sequence[int], mesh_rank: int, dim: str):
        key = tuple(ranks)
        if len(key) == self.world_size:
            return self.parent
        if len(key) == 1:
            if key not in self.groups:
                # A group of one needs no peer: made by this rank alone, whenever first asked for.
                self.groups[key] = dist.new_group([self._global(mesh_rank)], use_local_synchronization=True)
            return self.groups[key]
        if key not in self.groups:
            raise RuntimeError(f"mesh group {dim} {list(key)} was never created (a bug: groups are created "
                               "when the mesh is built)")
        return self.groups[key]


class Mesh:
    """This rank's place in the layout of the job, and its process group along every dimension.

    Args:
        world_size: number of ranks in the mesh (default: the size of `group`).
        pipeline, data_replicate, data_shard, tensor: the dimensions' sizes (see `MeshLayout.of`:
            the data dimensions left out take the rest, ``data_shard`` first).
        ranks_per_node: ranks on one node (consecutive ranks; default: all of them on one).
        group: the process group the mesh lays out (default: the default group, the whole job);
            mesh rank i is that group's rank i.
        rank: this process's rank in `group` (default: asked of `torch.distributed`).

    Building a mesh creates the groups of its dimensions: every rank of `group` must build it.
    """

    def __init__(self, world_size: int | None = None, *, pipeline: int = 1, data_replicate: int | None = None,
                 data_shard: int | None = None, tensor: int = 1, ranks_per_node: int | None = None,
                 group: dist.ProcessGroup | None = None, rank: int | None = None,
                 _table: _GroupTable | None = None) -> None:
        if world_size is None:
            world_size = dist.get_world_size(group)
        elif dist.is_initialized() and world_size != dist.get_world_size(group):
            raise ValueError(f"Mesh(world_size={world_size}) but the process group holds "
                             f"{dist.get_world_size(group)} ranks")
        self.layout = MeshLayout.of(world_size, pipeline=pipeline, data_replicate=data_replicate,
                                    data_shard=data_shard, tensor=tensor)
        if ranks_per_node is None:
            ranks_per_node = world_size
        if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        self.ranks_per_node = ranks_per_node
        self.group_of_mesh = group
        self._rank = rank if rank is not None else dist.get_rank(group)
        self._coords = self.layout.coords(self._rank)
        self._table = _table if _table is not None else _GroupTable(group, world_size)
        self._table.create([members for dim in _ALL_DIMS for members in self.layout.groups(dim)])
        self._host_groups: dict[str, dist.ProcessGroup | None] = {}

    # ------------------------------------------------------------ sizes, ranks, groups
    def size(self, dim: str | None = None) -> int:
        """Size of `dim` (one of `DIMS` or ``"data"``); with no argument, of the whole mesh."""
        return self.layout.world_size if dim is None else self.layout.size(dim)

    def rank(self, dim: str | None = None) -> int:
        """This rank's coordinate along `dim`, which is its rank in `group(dim)`; with no argument,
        its rank in the mesh."""
        if dim is None:
            return self._rank
        _check_dim(dim)
        return self._coords[dim]

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """This rank's process group along `dim` (``None``: the default group, when `dim` spans a mesh
        over the whole job)."""
        _check_dim(dim)
        return self._table.get(self.layout.ranks_along(dim, self._rank), self._rank, dim)

    def host_group(self, dim: str) -> dist.ProcessGroup | None:
        """A CPU (gloo) group along `dim`, for agreeing on values the host holds (a batch's rows) without
        waiting for the GPU's queue: `group(dim)` itself on a gloo job. On another backend the first call
        creates the gloo groups of every group along `dim`, so every rank must make it at the same point."""
        _check_dim(dim)
        if dist.get_backend(self.group_of_mesh) == "gloo":
            return self.group(dim)
        if dim not in self._host_groups:
            self._host_groups[dim] = self._new_host_groups(dim)
        return self._host_groups[dim]

    def _new_host_groups(self, dim: str) -> dist.ProcessGroup:
        """New gloo groups over every group along `dim` (each rank creates all, in one order); this rank's."""
        mine = None
        for members in self.layout.groups(dim):
            made = dist.new_group([global_rank(self.group_of_mesh, m) for m in members], backend="gloo")
            if self._rank in members:
                mine = made
        return mine

    def ranks(self, dim: str) -> list[int]:
        """Mesh ranks of `group(dim)`'s members, in group-rank order."""
        _check_dim(dim)
        return self.layout.ranks_along(dim, self._rank)

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank feeds (``rank("data")``)."""
        return self._coords["data"]

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (``size("data")`` = data_replicate x data_shard)."""
        return self.layout.size("data")

    @property
    def node(self) -> int:
        """Index of this rank's node."""
        return self._rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return -(-self.layout.world_size // self.ranks_per_node)

    # ------------------------------------------------------------ derived meshes
    def _derive(self, *, data_shard: int | None = None, ranks_per_node: int | None = None) -> "Mesh":
        lay = self.layout
        shard = lay.data_shard if data_shard is None else data_shard
        return Mesh(lay.world_size, pipeline=lay.pipeline, data_shard=shard, tensor=lay.tensor,
                    ranks_per_node=ranks_per_node or self.ranks_per_node, group=self.group_of_mesh,
                    rank=self._rank, _table=self._table)

    def with_ranks_per_node(self, ranks_per_node: int) -> "Mesh":
        """The same mesh over nodes of `ranks_per_node` ranks (emulated nodes; creates no group)."""
        if ranks_per_node == self.ranks_per_node:
            return self
        return self._derive(ranks_per_node=ranks_per_node)

    def with_data_shard(self, data_shard: int) -> "Mesh":
        """The same mesh with the data-parallel ranks re-split into `data_shard` x the rest
        (collective the first time: every rank must call it)."""
        if data_shard == self.layout.data_shard:
            return self
        return self._derive(data_shard=data_shard)

    def hybrid(self) -> "Mesh":
        """The mesh whose data dimensions split at node boundaries: shard over the data-parallel ranks
        of a node, replicate across nodes (collective the first time)."""
        intra, _ = self._node_split()
        return self.with_data_shard(len(intra[0]))

    def node_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(intra-node, inter-node) groups of this rank's data-parallel group: the members on this
        rank's node, and the members at the same place on every node (collective the first time)."""
        intra, inter = self._node_split()
        self._table.create(intra + inter)
        mine_intra = next(g for g in intra if self._rank in g)
        mine_inter = next(g for g in inter if self._rank in g)
        return (self._table.get(mine_intra, self._rank, "node"), self._table.get(mine_inter, self._rank, "node"))

    def _node_split(self) -> tuple[list[list[int]], list[list[int]]]:
        """`MeshLayout.node_split` at this mesh's node size, once every rank is known to have the same:
        under torchrun each rank takes it from its own node (LOCAL_WORLD_SIZE), and nodes that run
        different numbers of processes would cut the job into different nodes and make other groups on
        each (a hang). One all-gather the first time, over the mesh's group."""
        size = self.ranks_per_node
        if size not in self._table.node_sizes_agreed and dist.is_initialized() and self._table.world_size > 1:
            every: list = [None] * self._table.world_size
            dist.all_gather_object(every, size, group=self.group_of_mesh)
            if len(set(every)) > 1:
                other = next(r for r, n in enumerate(every) if n != every[0])
                raise ValueError(
                    f"the ranks count different node sizes (rank 0: {every[0]} ranks a node, rank {other}: "
                    f"{every[other]}): hybrid sharding and the hierarchical all-reduce need nodes of equal size. "
                    "Under torchrun it is each node's --nproc-per-node (LOCAL_WORLD_SIZE): start as many "
                    "processes on every node, or give every rank the same ranks_per_node")
            self._table.node_sizes_agreed.add(size)
        return self.layout.node_split(size)

    def __repr__(self) -> str:
        lay = self.layout
        return (f"Mesh(pipeline={lay.pipeline}, data_replicate={lay.data_replicate}, data_shard={lay.data_shard}, "
                f"tensor={lay.tensor}; rank {self._rank}, ranks_per_node={self.ranks_per_node})")
