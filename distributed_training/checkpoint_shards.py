"""One checkpoint format for every strategy: each rank writes the pieces of full tensors it holds.

Every strategy keeps a model's parameters (and the optimizer's state of them) in one of a few
shapes: whole tensors (DDP; ZeRO-1's parameters), or slices of flat vectors that concatenate several
parameters (FSDP's unit shards; ZeRO-1's optimizer shards). Whatever the shape, what a rank holds is
a set of *pieces*: elements ``[start, start + length)`` of a parameter's flattened full tensor, named
by its key in the plain module's ``state_dict()``, found at offset ``local`` of a local tensor. A
strategy describes its pieces (`Strategy.state_layout` -> `StateLayout`); this module does the rest,
the same way for all of them:

* **save**: each rank puts the pieces it is asked to write into its ``rank<r>.pt`` (parameters under
  ``params``, optimizer state under ``optim``; a state tensor of the local tensor's size is cut into
  the same pieces, a scalar such as Adam's ``step`` is kept whole), and the ranks agree on an *index*
  (key -> which rank holds which elements) that rank 0 puts in ``meta.pt`` with every full shape;
* **load**: each rank asks its own strategy which pieces it needs now, looks them up in the index and
  reads only the files that hold them (its own first), whatever strategy and world size wrote them.

So a checkpoint written by DDP at world 2 loads under ZeRO-3 at world 3, and back. The files keep the
crash-proof properties of `distributed_training.checkpoint` (atomic, checksummed); this module only
decides what goes in them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["FORMAT", "Piece", "Holding", "StateLayout", "whole_tensors", "flat_pieces", "pack", "summary",
           "build_index", "check_shapes", "Sources", "unpack_params", "unpack_optimizer"]

#: The value of ``checkpoint_format`` in ``meta.pt``.
FORMAT = "pieces/1"


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of the flattened full tensor `key`, held at elements
    ``[local, local + length)`` of a local tensor."""

    key: str
    start: int
    length: int
    local: int


@dataclass
class Holding:
    """A local tensor and the pieces of full tensors it holds; `save` says whether this rank writes
    them (one replica writes what several hold); pieces of the keys in `not_saved` are loaded but
    written by another rank (a pipeline's copy of a tied weight, inside a shard of several)."""

    tensor: torch.Tensor
    pieces: list[Piece]
    save: bool = True
    not_saved: frozenset[str] = frozenset()


@dataclass
class StateLayout:
    """What a rank holds: `shapes` of every parameter key, `params` (the parameters' storage) and
    `optimizer` (one holding per parameter of the optimizer, in its order)."""

    shapes: dict[str, tuple[int, ...]]
    params: list[Holding]
    optimizer: list[Holding] = field(default_factory=list)


def whole_tensors(named: list[tuple[str, torch.Tensor]], save: bool) -> list[Holding]:
    """Holdings of replicated parameters: each one a single piece, the whole tensor."""
    return [Holding(t, [Piece(key, 0, t.numel(), 0)], save) for key, t in named]


def flat_pieces(members: list[tuple[str, int, int]], lo: int, hi: int) -> list[Piece]:
    """The pieces of a slice ``[lo, hi)`` of a flat vector that concatenates parameters, given as
    ``(key, offset in the vector, numel)``; the slice's own element 0 is ``local`` 0."""
    pieces = []
    for key, offset, numel in members:
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            pieces.append(Piece(key, a - offset, b - a, a - lo))
    return pieces


def _cut(value: torch.Tensor, piece: Piece) -> torch.Tensor:
    return value.detach().reshape(-1)[piece.local : piece.local + piece.length].cpu().clone()


def pack(layout: StateLayout, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's part of a checkpoint: the pieces it writes (``params``, ``optim``: key -> list of
    ``(start, data)``; ``optim_scalars``: key -> {name: value}) and the optimizer's hyperparameters."""
    params: dict[str, list] = {}
    for holding in layout.params:
        if holding.save:
            for piece in holding.pieces:
                if piece.key in holding.not_saved:
                    continue
                params.setdefault(piece.key, []).append((piece.start, _cut(holding.tensor, piece)))
    optim: dict[str, dict[str, list]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        for holding in layout.optimizer:
            if not holding.save:
                continue
            state = optimizer.state.get(holding.tensor, {})
            for piece in holding.pieces:
                if piece.key in holding.not_saved:
                    continue
                for name, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == holding.tensor.numel():
                        optim.setdefault(piece.key, {}).setdefault(name, []).append((piece.start, _cut(value, piece)))
                    else:
                        scalars.setdefault(piece.key, {})[name] = (value.detach().cpu().clone() if torch.is_tensor(value)
                                                                   else value)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"params": params, "optim": optim, "optim_scalars": scalars, "param_groups": groups}


def summary(packed: dict[str, Any]) -> dict[str, Any]:
    """What one rank's `pack` holds, without the data: small enough to gather from every rank."""
    def spans(pieces):
        return [(start, data.numel()) for start, data in pieces]
    return {"params": {key: spans(pieces) for key, pieces in packed["params"].items()},
            "optim": {key: (sorted(names), spans(next(iter(names.values())))) for key, names in packed["optim"].items()},
            "optim_scalars": list(packed["optim_scalars"])}


def build_index(summaries: list[dict[str, Any]], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Key -> which ranks hold which elements, from every rank's `summary` in rank order."""
    index: dict[str, Any] = {"params": {}, "optim": {}, "optim_names": {}, "optim_scalars": {},
                             "param_groups": param_groups}
    for rank, part in enumerate(summaries):
        for key, spans in part["params"].items():
            index["params"].setdefault(key, []).extend((rank, start, length) for start, length in spans)
        for key, (names, spans) in part["optim"].items():
            index["optim_names"].setdefault(key, names)
            index["optim"].setdefault(key, []).extend((rank, start, length) for start, length in spans)
        for key in part["optim_scalars"]:
            index["optim_scalars"].setdefault(key, []).append(rank)
    return index


class Sources:
    """Finds the saved pieces that cover an element range, reading as few rank files as it can."""

    def __init__(self, read: Callable[[int], dict], own_rank: int) -> None:
        self.read = read
        self.own = own_rank
        self.opened: set[int] = set()

    def _order(self, ranks):
        return sorted(ranks, key=lambda r: (r != self.own, r not in self.opened, r))

    def pick(self, ranks: list[int]) -> dict:
        """The file of one of `ranks` (this rank's own, or one already read, if among them)."""
        rank = self._order(ranks)[0]
        self.opened.add(rank)
        return self.read(rank)

    def fill(self, out: torch.Tensor, spans: list[tuple[int, int, int]], start: int, length: int,
             fetch: Callable[[dict, int], torch.Tensor], what: str) -> None:
        """Copy elements ``[start, start + length)`` into `out` (flat, `length` long) from the saved
        `spans` ``(rank, start, length)``; `fetch(file, saved_start)` returns a saved piece's data."""
        missing = [(start, start + length)]
        order = {r: i for i, r in enumerate(self._order({s[0] for s in spans}))}
        ranked = sorted(spans, key=lambda s: order[s[0]])
        for rank, s_start, s_len in ranked:
            s_end = s_start + s_len
            if not any(a < s_end and s_start < b for a, b in missing):
                continue
            data = fetch(self.read(rank), s_start).reshape(-1)
            self.opened.add(rank)
            still = []
            for a, b in missing:
                lo, hi = max(a, s_start), min(b, s_end)
                if lo < hi:
                    out[lo - start : hi - start].copy_(data[lo - s_start : hi - s_start])
                    still += [(a, lo)] if a < lo else []
                    still += [(hi, b)] if hi < b else []
                else:
                    still.append((a, b))
            missing = still
            if not missing:
                return
        raise ValueError(f"{what}: elements {missing[0][0]}..{missing[0][1]} are in no rank's file of the checkpoint")


def _piece_of(pieces: list, start: int) -> torch.Tensor:
    for s, data in pieces:
        if s == start:
            return data
    raise KeyError(start)


def check_shapes(saved: dict[str, tuple], mine: dict[str, tuple]) -> None:
    """Raise `ValueError` naming the first parameter missing, unexpected or of another shape."""
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise ValueError(f"parameters missing from the checkpoint {missing[:5]}, in it but not in this model "
                         f"{unexpected[:5]}")
    for key, shape in mine.items():
        if tuple(saved[key]) != tuple(shape):
            raise ValueError(f"'{key}': the checkpoint has shape {list(saved[key])}, this model {list(shape)}")


@torch.no_grad()
def unpack_params(layout: StateLayout, index: dict[str, Any], sources: Sources) -> None:
    """Fill this rank's parameter storage from the checkpoint."""
    for holding in layout.params:
        flat = holding.tensor.detach().view(-1)
        for piece in holding.pieces:
            buffer = torch.empty(piece.length, dtype=flat.dtype)
            sources.fill(buffer, index["params"].get(piece.key, []), piece.start, piece.length,
                         lambda f, s, k=piece.key: _piece_of(f["params"][k], s), f"parameter '{piece.key}'")
            flat[piece.local : piece.local + piece.length].copy_(buffer)


def unpack_optimizer(layout: StateLayout, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                     sources: Sources) -> None:
    """Rebuild this rank's optimizer state from the checkpoint and load it (torch casts each state
    tensor to its parameter's dtype and device). The saved hyperparameters of each param group come
    back when the optimizer has as many groups as the saved one."""
    position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for holding in layout.optimizer:
        entry: dict[str, Any] = {}
        for piece in holding.pieces:  # scalars (Adam's step) are alike for all pieces of one parameter
            ranks = index["optim_scalars"].get(piece.key)
            if ranks:
                entry = {**sources.pick(ranks)["optim_scalars"][piece.key], **entry}
        names = sorted({name for piece in holding.pieces for name in index["optim_names"].get(piece.key, [])})
        for name in names:
            flat = torch.zeros(holding.tensor.numel(), dtype=holding.tensor.dtype)
            for piece in holding.pieces:
                sources.fill(flat[piece.local : piece.local + piece.length], index["optim"].get(piece.key, []),
                             piece.start, piece.length,
                             lambda f, s, k=piece.key, n=name: _piece_of(f["optim"][k][n], s),
                             f"optimizer state '{name}' of '{piece.key}'")
            entry[name] = flat.view(holding.tensor.shape)
        if entry:
            state[position[id(holding.tensor)]] = entry
    current = optimizer.state_dict()["param_groups"]
    saved = index.get("param_groups") or []
    groups = ([dict(old, params=mine["params"]) for old, mine in zip(saved, current)]
              if len(saved) == len(current) else current)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
