"""The servers' state in the one checkpoint format (`distributed_training.checkpoint_shards`).

A server's pieces are pieces of full tensors as every other strategy's are: a whole parameter is one
piece (elements ``[0, numel)``); rows ``start::stride`` of a table split over the servers are a
*strided* piece (``rows`` runs of one row's elements, ``stride`` rows apart). Their optimizer state
(SGD's momentum, Adam's moments and step) is cut into the same pieces, so a checkpoint the servers
write reads like one of DDP or ZeRO: `unpack_params` / `unpack_optimizer` under a one-process layout
give the full parameters and torch's optimizer state, and the servers of another plan (another number
of servers) read back exactly the elements they hold.

Files: server ``i`` (job rank ``i``) writes ``rank<i>.pt``; workers hold no trained state (they pull)
and write none; rank 0 writes ``meta.pt`` with the index, the full shapes and ``ps``: the servers'
version (updates applied) and each worker's step, which a restarted parameter server starts from.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..checkpoint_shards import FORMAT, Holding, Piece as StatePiece, Sources, StateLayout, pack, summary, \
    unpack_params
from .server import Server
from .sharding import Piece, ShardPlan

__all__ = ["ServerState", "state_piece"]


def state_piece(piece: Piece) -> StatePiece:
    """The checkpoint piece of a server's piece: the whole parameter, or its rows ``start::stride``
    as a strided piece (one run per row) held contiguously."""
    if piece.stride == 1 and piece.start == 0:
        return StatePiece(piece.name, 0, piece.numel, 0)
    row = piece.row_numel
    if piece.rows == 1:
        return StatePiece(piece.name, piece.start * row, row, 0)
    return StatePiece(piece.name, piece.start * row, row, 0, count=piece.rows, stride=piece.stride * row)


class _Optimizer:
    """What `pack` reads of an optimizer (``state`` by tensor, ``param_groups``), from a server's."""

    def __init__(self, server: Server) -> None:
        by_name = server.optim.piece_state()
        self.state = {server.values[name]: held for name, held in by_name.items()}
        self.param_groups = [{"params": list(server.values.values()), **server.optim.hyperparameters()}]


class ServerState:
    """One server's checkpointable state: its pieces of the parameters and of their optimizer state,
    keyed by parameter name and offsets in the full tensors.

    Args:
        plan: the job's shard plan (for every parameter's full shape).
        server: this rank's `Server`.
    """

    def __init__(self, plan: ShardPlan, server: Server) -> None:
        self.server = server
        shapes = {p.name: tuple(p.shape) for pieces in plan.pieces for p in pieces}
        holdings = [Holding(server.values[p.name], [state_piece(p)]) for p in server.pieces]
        self.layout = StateLayout(shapes, holdings, holdings)

    def pack(self) -> dict[str, Any]:
        """This server's part of a checkpoint (`checkpoint_shards.pack`), with its version under ``ps``."""
        packed = pack(self.layout, _Optimizer(self.server))
        packed["ps"] = {"version": self.server.version}
        return packed

    def summary(self, packed: dict[str, Any]) -> dict[str, Any]:
        return summary(packed)

    def load(self, meta: dict[str, Any], sources: Sources) -> None:
        """Fill the server's pieces and their optimizer state from a checkpoint (any writer: other
        servers, DDP, ZeRO, ...) and take its version (``meta["ps"]``; 0 without one)."""
        index = meta["index"]
        check_shapes_held(meta.get("shapes", {}), self.layout.shapes)
        unpack_params(self.layout, index, sources)
        state: dict[str, dict[str, Any]] = {}
        for holding in self.layout.optimizer:
            (piece,) = holding.pieces
            entry: dict[str, Any] = {}
            ranks = index["optim_scalars"].get(piece.key)
            if ranks:
                entry.update({k: v for k, v in sources.pick(ranks)["optim_scalars"][piece.key].items()
                              if v is not None})
            for name in index["optim_names"].get(piece.key, []):
                buffer = torch.empty(piece.numel, dtype=holding.tensor.dtype)
                sources.fill(buffer, index["optim"].get(piece.key, []), piece.start, piece.length,
                             lambda f, s, k=piece.key, n=name: _saved(f["optim"][k][n], s),
                             f"optimizer state '{name}' of '{piece.key}'", piece.count, piece.stride)
                entry[name] = buffer
            if entry:
                state[piece.key] = entry
        self.server.optim.load_piece_state(state)
        version = int((meta.get("ps") or {}).get("version", meta.get("step", 0)))
        # where each worker stands, as the workers take it (ssp's gate counts their steps)
        self.server.pushed = [worker_step(meta, w) for w in range(self.server.num_workers)]
        self.server.pulled_clock = [min(self.server.pushed)] * self.server.num_workers
        if not self.server.eager:
            # step-aggregated (sync): the version is the next step to apply. A checkpoint of async or ssp
            # (s >= 1), one update a gradient, has more updates than steps: no step past the workers'
            version = min(version, max(self.server.pushed))
        self.server.version = version
        self.server.pulled_version = [version] * self.server.num_workers


def worker_step(meta: dict[str, Any], index: int) -> int:
    """The step worker `index` continues from after loading the checkpoint of `meta`: its saved step,
    else (a checkpoint of fewer workers, or of another strategy) the checkpoint's step, the workers'
    least (the servers' version counts updates: one a gradient under ssp / async, not steps)."""
    steps = (meta.get("ps") or {}).get("worker_steps") or []
    return int(steps[index]) if index < len(steps) else int(meta.get("step", 0))


def _saved(pieces: list, start: int) -> torch.Tensor:
    for entry in pieces:
        if entry[0] == start:
            return entry[1]
    raise KeyError(start)


def check_shapes_held(saved: dict[str, tuple], mine: dict[str, tuple]) -> None:
    """Raise `ValueError` naming the first parameter the servers hold that the checkpoint lacks or has
    in another shape (a checkpoint of another strategy may hold more: untrained parameters)."""
    missing = sorted(set(mine) - set(saved))
    if missing:
        raise ValueError(f"parameters missing from the checkpoint {missing[:5]}")
    for key, shape in mine.items():
        if tuple(saved[key]) != tuple(shape):
            raise ValueError(f"'{key}': the checkpoint has shape {list(saved[key])}, this model {list(shape)}")


def meta_of(summaries: list[dict[str, Any]], shapes: dict[str, tuple], param_groups, *, version: int,
            worker_steps: list[int], num_servers: int, consistency: str) -> dict[str, Any]:
    """``meta.pt`` (but its checksums) of a checkpoint of the servers: `summaries` of every rank in
    rank order (the workers' empty)."""
    from ..checkpoint_shards import build_index

    return {
        "step": min(worker_steps) if worker_steps else version,
        "world_size": len(summaries),
        "strategy": "parameter_server",
        "checkpoint_format": FORMAT,
        "shapes": shapes,
        "index": build_index(summaries, param_groups),
        "buffer_index": {},
        "ps": {"version": version, "worker_steps": list(worker_steps), "num_servers": num_servers,
               "consistency": consistency},
    }


def rank_path(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank}.pt")
