"""How a tensor-parallel rank's parameter relates to the full one: `ShardSpec`.

A parameter split between the T ranks of the tensor group holds, along one dimension `dim`, its
rank's part of each of `chunks` equal blocks (``chunks=1`` for a plain column- or row-parallel
weight; ``chunks=3`` for a fused q/k/v projection, whose rows are [q; k; v] and each of q, k and v is
split by heads). Everything that must see the full tensor -- the checkpoint format, `full_state_dict()`,
slicing the user's weights when a plan is applied -- goes through this one description:

* `shard(full, spec)` -> this rank's local tensor (a copy);
* `unshard(parts, spec)` -> the full tensor from every rank's local tensor, in tensor-rank order;
* `runs(spec)` -> where the local tensor's elements lie in the full tensor, as regular runs (for the
  checkpoint's pieces).

The spec rides on the parameter (`set_spec` / `spec_of`), so it survives the data-parallel wrappers
that keep the parameter objects (DDP, ZeRO-1/2) and is read before sharding by those that do not.
Parameters that every tensor rank holds whole have no spec; those that see only a part of the
sequence (sequence parallelism) are marked with `mark_sequence_parallel`: their gradients are partial
sums, added over the tensor group before the data-parallel reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ShardSpec", "Run", "set_spec", "spec_of", "shard", "unshard", "runs", "mark_sequence_parallel",
           "is_sequence_parallel"]

_SPEC = "_dt_tensor_spec"
_SEQUENCE = "_dt_sequence_parallel"


@dataclass(frozen=True)
class ShardSpec:
    """This rank's part (`rank` of `parts`) of a tensor of `full_shape`, split along `dim` in each of
    `chunks` equal blocks."""

    full_shape: tuple[int, ...]
    dim: int
    rank: int
    parts: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.full_shape):
            raise ValueError(f"dim {self.dim} is not a dimension of a tensor of shape {list(self.full_shape)}")
        if not 0 <= self.rank < self.parts:
            raise ValueError(f"rank {self.rank} is not one of {self.parts} parts")
        size = self.full_shape[self.dim]
        if size % (self.chunks * self.parts):
            what = f"{self.chunks} blocks of {size // self.chunks}" if self.chunks > 1 else f"{size}"
            raise ValueError(f"dimension {self.dim} of shape {list(self.full_shape)} ({what}) does not split into "
                             f"{self.parts} equal parts")

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's local tensor: `full_shape` with `dim` divided by `parts`."""
        shape = list(self.full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    @property
    def part(self) -> int:
        """Elements of `dim` this rank holds of each block."""
        return self.full_shape[self.dim] // (self.chunks * self.parts)


@dataclass(frozen=True)
class Run:
    """`count` runs of `length` elements: run i starts at ``full + i * full_stride`` of the full
    tensor flattened and at ``local + i * local_stride`` of the local one."""

    full: int
    local: int
    length: int
    count: int = 1
    full_stride: int = 0
    local_stride: int = 0


def set_spec(param: torch.Tensor, spec: ShardSpec) -> None:
    """Mark `param` (this rank's local tensor) as `spec`'s part; a ValueError when its shape is not
    the spec's local shape."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(f"a local tensor of shape {list(param.shape)} does not match {spec} "
                         f"(expected {list(spec.local_shape)})")
    setattr(param, _SPEC, spec)


def spec_of(param: torch.Tensor) -> ShardSpec | None:
    """The `ShardSpec` that `set_spec` put on `param`, or None for a parameter held whole."""
    return getattr(param, _SPEC, None)


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """Mark a replicated `param` whose gradient is a partial sum over this rank's part of the sequence."""
    setattr(param, _SEQUENCE, True)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether `mark_sequence_parallel` marked `param`."""
    return getattr(param, _SEQUENCE, False)


def _blocks(spec: ShardSpec) -> list[tuple[int, int]]:
    """(start in the full dimension, start in the local one) of each block's part."""
    block = spec.full_shape[spec.dim] // spec.chunks
    return [(j * block + spec.rank * spec.part, j * spec.part) for j in range(spec.chunks)]


def shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's part of `full` (a new contiguous tensor)."""
    if tuple(full.shape) != tuple(spec.full_shape):
        raise ValueError(f"a tensor of shape {list(full.shape)} is not the full tensor of {spec}")
    parts = [full.narrow(spec.dim, start, spec.part) for start, _ in _blocks(spec)]
    return torch.cat(parts, dim=spec.dim).contiguous()


def unshard(locals_: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every tensor rank's local tensor (in rank order)."""
    if len(locals_) != spec.parts:
        raise ValueError(f"{len(locals_)} local tensors for {spec.parts} parts")
    pieces = []
    for j in range(spec.chunks):
        pieces += [t.narrow(spec.dim, j * spec.part, spec.part) for t in locals_]
    return torch.cat(pieces, dim=spec.dim)


def runs(spec: ShardSpec) -> list[Run]:
    """The local tensor's elements in the full one, one `Run` per block (each repeated over the
    dimensions before `dim`)."""
    inner = math.prod(spec.full_shape[spec.dim + 1:])
    outer = math.prod(spec.full_shape[:spec.dim])
    full_row, local_row = spec.full_shape[spec.dim] * inner, spec.local_shape[spec.dim] * inner
    out = []
    for full_start, local_start in _blocks(spec):
        out.append(Run(full_start * inner, local_start * inner, spec.part * inner, outer, full_row, local_row))
    return out
