"""Which server holds which parameter: whole parameters greedily by bytes, large embedding tables by rows.

A `Piece` is what one server holds of one parameter: the whole tensor, or the rows ``start, start +
stride, start + 2 * stride, ...`` of an embedding table split cyclically over ``stride`` servers. Cyclic
rows rather than contiguous blocks because a power-law table's hot rows are usually its low ids: blocks
would put them all on the first server.

`plan_shards` is a pure function of the parameters' names, shapes and dtypes, so every rank computes the
same plan without talking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["Piece", "ShardPlan", "plan_shards"]


@dataclass(frozen=True)
class Piece:
    """One server's part of one parameter.

    Attributes:
        name: the parameter's name in the model.
        server: the server index (``0 .. num_servers - 1``, which is also its rank).
        shape: the full parameter's shape.
        start: first row held (0 for a whole parameter).
        stride: the piece holds rows ``start::stride`` (1 for a whole parameter).
        sparse: a sparse table: pushes and pulls carry only the rows asked for.
    """

    name: str
    server: int
    shape: tuple[int, ...]
    start: int = 0
    stride: int = 1
    sparse: bool = False

    @property
    def rows(self) -> int:
        """Rows held (the first dimension of `local_shape`)."""
        return len(range(self.start, self.shape[0], self.stride)) if self.shape else 1

    @property
    def row_numel(self) -> int:
        """Elements in one row."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the tensor the server holds."""
        return (self.rows, *self.shape[1:]) if self.shape else ()

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel if self.shape else 1

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece's part of the full `tensor` (a view: rows ``start::stride``)."""
        return tensor if self.stride == 1 and self.start == 0 else tensor[self.start :: self.stride]


@dataclass
class ShardPlan:
    """Every parameter's pieces, and the load they put on each server.

    Attributes:
        num_servers: servers in the plan.
        pieces: each server's pieces, in the order they travel in a message.
        tables: for each row-addressable table (sparse or split), its pieces indexed by ``row % stride``.
        bytes_per_server: fp32 bytes each server holds.
    """

    num_servers: int
    pieces: list[list[Piece]]
    tables: dict[str, list[Piece]] = field(default_factory=dict)
    bytes_per_server: list[int] = field(default_factory=list)

    @property
    def max_over_mean(self) -> float:
        """Load imbalance: the most loaded server's bytes over the mean (1.0 is perfect)."""
        mean = sum(self.bytes_per_server) / max(1, self.num_servers)
        return max(self.bytes_per_server) / mean if mean else 1.0

    def report(self) -> str:
        """One line: bytes per server and max / mean."""
        per = ", ".join(f"{b / 2**20:.3f}" for b in self.bytes_per_server)
        return f"bytes per server (MiB): [{per}]; max/mean {self.max_over_mean:.3f}"


def plan_shards(
    params: Sequence[tuple[str, torch.Size | Sequence[int]]],
    num_servers: int,
    *,
    tables: Sequence[str] = (),
    sparse: Sequence[str] = (),
) -> ShardPlan:
    """Assign parameters to servers by bytes (fp32 on the servers).

    Args:
        params: ``(name, shape)`` of every parameter the servers hold.
        num_servers: how many servers.
        tables: names of embedding tables: one larger than ``total / num_servers`` is split by rows,
            cyclically, over all servers.
        sparse: names of sparse tables (a subset of `tables`, split or not).

    The rest go largest first onto the least-loaded server (a greedy that is within 4/3 of the best).
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    shapes = {name: tuple(int(d) for d in shape) for name, shape in params}
    if len(shapes) != len(params):
        raise ValueError("plan_shards: parameter names must be unique")
    for name in sparse:
        if name not in tables:
            raise ValueError(f"sparse: {name!r} is not an embedding table ({sorted(tables)})")
    numel = {n: _numel(s) for n, s in shapes.items()}
    total = 4 * sum(numel.values())
    load = [0] * num_servers
    by_server: list[list[Piece]] = [[] for _ in range(num_servers)]
    table_pieces: dict[str, list[Piece]] = {}
    for name in sorted(shapes, key=lambda n: (-numel[n], n)):
        shape, nbytes = shapes[name], 4 * numel[name]
        is_sparse = name in sparse
        if name in tables and num_servers > 1 and nbytes > total / num_servers and shape[0] >= num_servers:
            pieces = [Piece(name, s, shape, s, num_servers, is_sparse) for s in range(num_servers)]
        else:
            server = min(range(num_servers), key=lambda s: (load[s], s))
            pieces = [Piece(name, server, shape, 0, 1, is_sparse)]
        for piece in pieces:
            by_server[piece.server].append(piece)
            load[piece.server] += 4 * piece.numel
        if name in tables:
            table_pieces[name] = pieces
    for server_pieces in by_server:
        server_pieces.sort(key=lambda p: p.name)
    return ShardPlan(num_servers, by_server, table_pieces, load)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
