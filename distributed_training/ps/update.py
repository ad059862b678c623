"""A server's update rule, apart from its message loop (`server.Server`): how a request's payload splits
into the pieces' rows and gradients, and how several workers' pushes combine into one update.

A push is a flat fp32 tensor: each piece's gradient in plan order (for a sparse piece only the rows the
request names), then one flag per piece, 1 where the worker's parameter had a gradient at all. Its
indices start with one row count per sparse piece (-1: every row), then those rows.
"""

from __future__ import annotations

import torch

from .sharding import Piece

__all__ = ["combine", "split_push", "split_rows", "sum_rows"]


def split_rows(sparse_pieces: list[Piece], indices: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The rows of each sparse piece that a request names (None: all of them)."""
    k = len(sparse_pieces)
    if k == 0:
        return {}
    if indices is None or indices.numel() < k:
        raise RuntimeError(f"parameter server: a request lacks the row counts of {k} sparse piece(s)")
    counts, rows, at = indices[:k].tolist(), {}, k
    for piece, count in zip(sparse_pieces, counts):
        if count < 0:
            rows[piece.name] = None
        else:
            rows[piece.name] = indices[at : at + count]
            at += count
    return rows


def split_push(pieces: list[Piece], rows: dict[str, torch.Tensor | None], values: torch.Tensor | None) -> dict:
    """A push's values as ``{"rows": rows, "grads": piece -> gradient (its rows for a sparse piece),
    "has": piece -> whether the worker's parameter had a gradient}``."""
    grads, at = {}, 0
    for piece in pieces:
        picked = rows.get(piece.name)
        n = piece.numel if picked is None else picked.numel() * piece.row_numel
        shape = piece.local_shape if picked is None else (picked.numel(), *piece.local_shape[1:])
        grads[piece.name] = values[at : at + n].view(shape) if n else torch.zeros(shape)
        at += n
    carried = 0 if values is None else values.numel()
    if at + len(pieces) != carried:
        raise RuntimeError(f"parameter server: a push carried {carried} values, expected {at + len(pieces)}")
    has = {piece.name: bool(values[at + i]) for i, piece in enumerate(pieces)}
    return {"rows": rows, "grads": grads, "has": has}


def combine(pieces: list[Piece], pushes: dict[int, dict], scale: float | dict[int, float]
            ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """One update's gradients from several workers' pushes (worker -> `split_push`'s result), summed in
    worker order (arrival order never changes a bit) and multiplied by `scale`, or each by its worker's (a
    dict). Returns (dense piece -> gradient, sparse piece -> (rows, their gradient)); a dense piece that no
    worker's parameter had a gradient for is left out (the optimizer leaves it alone: no momentum or Adam
    step on a gradient nobody computed)."""
    order = sorted(pushes)
    dense, sparse = {}, {}
    for piece in pieces:
        if piece.sparse:
            sparse[piece.name] = sum_rows(piece, [pushes[w] for w in order],
                                          scale if isinstance(scale, float) else [scale[w] for w in order])
            continue
        givers = [w for w in order if pushes[w]["has"][piece.name]]
        if not givers:
            continue
        if isinstance(scale, dict):
            total = pushes[givers[0]]["grads"][piece.name] * scale[givers[0]]
            for w in givers[1:]:
                total.add_(pushes[w]["grads"][piece.name], alpha=scale[w])
            dense[piece.name] = total
        else:
            total = pushes[givers[0]]["grads"][piece.name].clone()
            for w in givers[1:]:
                total.add_(pushes[w]["grads"][piece.name])
            dense[piece.name] = total.mul_(scale)
    return dense, sparse


def sum_rows(piece: Piece, pushes: list[dict], scale: float | list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, their summed gradient x scale) of a sparse piece over several pushes (`scale` a list:
    each push's own)."""
    rows = torch.cat([torch.arange(piece.rows) if p["rows"].get(piece.name) is None else p["rows"][piece.name]
                      for p in pushes])
    if isinstance(scale, list):
        grads = torch.cat([p["grads"][piece.name] * s for p, s in zip(pushes, scale)])
    else:
        grads = torch.cat([p["grads"][piece.name] for p in pushes])
    unique, inverse = torch.unique(rows, return_inverse=True)
    total = torch.zeros((unique.numel(), *piece.local_shape[1:]))
    total.index_add_(0, inverse, grads)
    return unique, total if isinstance(scale, list) else total.mul_(scale)
