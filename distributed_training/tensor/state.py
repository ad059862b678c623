"""A tensor-parallel model's state in full-tensor terms: checkpoint pieces and the full state dict.

A data-parallel strategy wrapping a tensor-parallel model sees only the *local* parameters (this
tensor rank's part of each split one) and describes what it holds of them as usual
(`Strategy.state_layout`): whole local tensors (DDP), or element ranges of them inside flat shards
(FSDP / ZeRO-3 units, ZeRO-1's optimizer shards). `tensor_state_layout` rewrites that description in
the coordinates of the full tensors, which is what the checkpoint format indexes, so that a
checkpoint saved at one tensor-parallel size loads at any other (and without tensor parallelism):

* an element range ``[a, b)`` of a split parameter's local tensor (flattened) meets each of its
  spec's runs (`ShardSpec` -> `runs`: one per fused block, repeated over the dimensions before the
  split one) in a partial first run, a regular middle and a partial last run: at most three pieces
  a block, the middle one *strided* (`Piece.count` runs, `Piece.stride` apart in the full tensor);
  a range that cuts no run, e.g. a column-parallel weight's (split along dim 0), stays one plain
  piece;
* the full shape replaces the local one in ``shapes``;
* a replicated parameter (no spec) is held alike by every tensor rank: tensor rank 0 writes it, the
  others only load it (``not_saved``).

`full_tensors` is the other direction for ``full_state_dict()``: each split tensor all-gathered over
the tensor group and put together with `unshard`.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint_shards import Holding, Piece, StateLayout
from .functional import group_size
from .spec import Run, ShardSpec, runs, spec_of, unshard

__all__ = ["tensor_state_layout", "full_tensors", "parameter_specs"]


def parameter_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """Name -> `ShardSpec` of each split parameter of `module` (names as `named_parameters` gives
    them: a tied parameter under its first name)."""
    return {name: spec for name, p in module.named_parameters() if (spec := spec_of(p)) is not None}


def _covered(run: Run, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """The parts of `run`'s runs inside local elements ``[lo, hi)``, as ``(first run, runs, offset in
    the run, length)``: a partial first run, the whole runs between, a partial last run."""
    step = run.local_stride if run.count > 1 else run.length
    first = max(0, (lo - run.local - run.length) // step + 1)  # the first run ending after lo
    last = min(run.count - 1, -(-(hi - run.local) // step) - 1)  # the last run starting before hi
    if first > last:
        return []

    def part(i: int) -> tuple[int, int]:
        start = run.local + i * step
        a, b = max(lo, start), min(hi, start + run.length)
        return a - start, b - a

    out = []
    whole_from, whole_to = first, last + 1
    offset, length = part(first)
    if length < run.length:
        out.append((first, 1, offset, length))
        whole_from += 1
    if last >= whole_from:
        offset, length = part(last)
        if length < run.length:
            out.append((last, 1, offset, length))
            whole_to -= 1
    if whole_from < whole_to:
        out.append((whole_from, whole_to - whole_from, 0, run.length))
    return sorted(out)


def _full_pieces(piece: Piece, spec: ShardSpec) -> list[Piece]:
    """The pieces of the full tensor that `piece` (elements of the local tensor) holds."""
    if piece.count != 1:
        raise ValueError(f"piece of '{piece.key}' is strided already: a data-parallel strategy's pieces of a "
                         "tensor-parallel parameter must be element ranges of its local tensor")
    if spec.parts == 1:  # the local tensor is the full one
        return [piece]
    shift = piece.local - piece.start  # local tensor element e sits at holding element e + shift
    out = []
    for run in runs(spec):
        step = run.local_stride if run.count > 1 else run.length
        for i, count, offset, length in _covered(run, piece.start, piece.start + piece.length):
            local = run.local + i * step + offset + shift
            start = run.full + i * run.full_stride + offset
            if count == 1 or (length == run.full_stride and length == step):  # one run (e.g. at TP = 1)
                out.append(Piece(piece.key, start, count * length, local))
            else:
                out.append(Piece(piece.key, start, length, local, count, run.full_stride,
                                 None if step == length else step))
    return out


def tensor_state_layout(layout: StateLayout, specs: Mapping[str, ShardSpec], tensor_rank: int) -> StateLayout:
    """`layout` (built by a data-parallel strategy over this tensor rank's local parameters) in the
    coordinates of the full tensors: the pieces of each split key (named in `specs`, key -> its
    `ShardSpec`) become the pieces of the full tensor they hold, its shape the full shape; replicated
    keys are written by tensor rank 0 only (`not_saved` elsewhere) and loaded by every rank. Holdings
    shared by ``params`` and ``optimizer`` (FSDP's shards) stay shared. Specs of keys the layout does
    not have (the second name of a tied parameter) are ignored."""
    for key, spec in specs.items():
        if key not in layout.shapes:  # another name of a tied parameter, or one this rank does not hold
            continue
        if tuple(layout.shapes[key]) != spec.local_shape:
            raise ValueError(f"'{key}': the layout's tensor has shape {list(layout.shapes[key])}, its ShardSpec "
                             f"{spec} expects the local shape {list(spec.local_shape)}")
        if spec.rank != tensor_rank:
            raise ValueError(f"'{key}': its ShardSpec is tensor rank {spec.rank}'s part, this is tensor rank "
                             f"{tensor_rank}")
    replicated = frozenset(key for key in layout.shapes if key not in specs) if tensor_rank else frozenset()
    done: dict[int, Holding] = {}

    def full(holding: Holding) -> Holding:
        if id(holding) not in done:
            pieces = [q for p in holding.pieces for q in (_full_pieces(p, specs[p.key]) if p.key in specs else [p])]
            skip = holding.not_saved | {p.key for p in holding.pieces if p.key in replicated}
            done[id(holding)] = Holding(holding.tensor, pieces, holding.save, frozenset(skip))
        return done[id(holding)]

    shapes = {key: tuple(specs[key].full_shape) if key in specs else tuple(shape)
              for key, shape in layout.shapes.items()}
    return StateLayout(shapes=shapes, params=[full(h) for h in layout.params],
                       optimizer=[full(h) for h in layout.optimizer])


def full_tensors(local: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec],
                 group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The full tensors of a tensor-parallel model's state: each key in `specs` all-gathered over the
    tensor `group` (one all-gather a tensor, every rank of the group calls this alike) and put together
    with `unshard`; the other keys pass through. Every rank gets the full tensors, on the local ones'
    device. A tensor under several keys (a tied weight: GPT's ``wte.weight`` and ``lm_head.weight``)
    is gathered once, and its full tensor is one tensor under each key, as in a plain state dict."""
    parts = group_size(group)
    out: dict[str, torch.Tensor] = {}
    # A state dict holds a tied weight as two detached views of one tensor: known by what they view.
    gathered_from: dict[tuple, torch.Tensor] = {}
    for key, value in local.items():
        spec = specs.get(key)
        if spec is None:
            out[key] = value
            continue
        seen = (value.device, value.dtype, value.data_ptr(), tuple(value.shape), value.stride(), spec)
        if seen in gathered_from:
            out[key] = gathered_from[seen]
            continue
        if spec.parts != parts:
            raise ValueError(f"'{key}' is split into {spec.parts} parts, and the tensor group has {parts} ranks")
        if tuple(value.shape) != spec.local_shape:
            raise ValueError(f"'{key}': a local tensor of shape {list(value.shape)}, its ShardSpec expects "
                             f"{list(spec.local_shape)}")
        if parts == 1:
            out[key] = value.detach().clone()
        else:
            mine = value.detach().contiguous()
            gathered = [torch.empty_like(mine) for _ in range(parts)]
            dist.all_gather(gathered, mine, group=group)
            out[key] = unshard(gathered, spec)
        gathered_from[seen] = out[key]
    return out
