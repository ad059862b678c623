"""The collectives a tensor-parallel layer needs, each an autograd function whose backward is the
conjugate collective.

| function | forward | backward |
|---|---|---|
| `copy_to` | identity | all-reduce |
| `reduce_from` | all-reduce | identity |
| `gather_last` | all-gather along the last dim | this rank's slice |
| `split_last` | this rank's slice of the last dim | all-gather |
| `split_sequence` | this rank's slice along `dim` | all-gather |
| `gather_sequence` | all-gather along `dim` | reduce-scatter |
| `reduce_scatter_sequence` | reduce-scatter along `dim` | all-gather |

Column-parallel layers start with `copy_to` (each rank uses the whole input; the input's gradient is
the sum of every rank's part), row-parallel layers end with `reduce_from` (each rank holds a partial
product). Under sequence parallelism the activations between those regions are split along the
sequence: `gather_sequence` replaces `copy_to` and `reduce_scatter_sequence` replaces `reduce_from`,
same traffic as the all-reduce they replace, and the activations in between take 1/T of the memory.

`group` is the tensor group (``None``: the default group). With a group of one rank every function
is the identity and runs no collective. Rank r's slice of a dimension of size T * n is
[r * n, (r + 1) * n); a size not divisible by T is a `ValueError` naming it. The collectives run on
contiguous flat buffers (`all_gather_into_tensor` / `reduce_scatter_tensor`, one call each) where the
backend has them (NCCL, recent gloo), and on per-rank lists / all-reduce otherwise. They run in the
tensor's own dtype: under autocast a bf16 activation is communicated in bf16, an fp32 one in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_single, reduce_scatter_single
from ..comm.wait_meter import WaitMeter

__all__ = ["copy_to", "reduce_from", "gather_last", "split_last", "split_sequence", "gather_sequence",
           "reduce_scatter_sequence", "group_size", "group_rank"]

# Backends on which a flat collective raised: the list / all-reduce fallback is used from then on.
_NO_FLAT: set[str] = set()
#: The time this process's tensor-parallel collectives take, on the steps the trainer logs (they are not
#: overlapped with compute: all of it is exposed, waiting for the slowest rank of the group included).
WAITS = WaitMeter()


def group_size(group) -> int:
    """The number of ranks of the tensor `group` (``None``: the default group); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank in the tensor `group` (``None``: the default group); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _check_divisible(x: torch.Tensor, dim: int, parts: int, what: str) -> int:
    """The length of each of the `parts` slices of `x` along `dim`; a ValueError naming `what` when
    it does not split."""
    length = x.shape[dim]
    if length % parts:
        hint = (": sequence_parallel=True splits each sequence between the tensor-parallel ranks; give it "
                "sequences whose length T divides (or sequence_parallel=False)") if what == "sequence length" else ""
        raise ValueError(f"{what} {length} (dim {dim % x.dim()} of shape {list(x.shape)}) is not divisible by "
                         f"the tensor-parallel size T={parts}{hint}")
    return length // parts


def _flat(op, fallback, group, *args) -> None:
    """Run the flat collective `op(*args, group=group)`, or `fallback` where the backend lacks it."""
    backend = dist.get_backend(group)
    with WAITS.waiting(args[0].device):
        if backend not in _NO_FLAT:
            try:
                op(*args, group=group)
                return
            except (RuntimeError, NotImplementedError, ValueError):
                if backend == "nccl":
                    raise
                _NO_FLAT.add(backend)  # this backend lacks the flat collective: fall back, now and later
        fallback(*args, group=group)


def _gather_list(out: torch.Tensor, flat: torch.Tensor, group) -> None:
    dist.all_gather(list(out.chunk(group_size(group))), flat, group=group)


def _reduce_scatter_via_all_reduce(out: torch.Tensor, flat: torch.Tensor, group) -> None:
    total = flat.clone()
    dist.all_reduce(total, group=group)
    out.copy_(total.chunk(group_size(group))[group_rank(group)])


def _all_reduce(x: torch.Tensor, group, inplace: bool = False) -> torch.Tensor:
    """The sum of `x` over the group: `x` itself reduced where `inplace` (and contiguous), else a copy."""
    out = x if inplace and x.is_contiguous() else x.contiguous().clone()
    with WAITS.waiting(out.device):
        dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    parts = group_size(group)
    x = x.contiguous()
    buf = torch.empty((parts,) + tuple(x.shape), dtype=x.dtype, device=x.device)  # (T, *x.shape)
    _flat(all_gather_single, _gather_list, group, buf.view(-1), x.view(-1))
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] *= parts
    # (T, ..., n, ...) -> (..., T, n, ...) -> (..., T * n, ...): one copy.
    return buf.movedim(0, dim).reshape(shape)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along `dim` of the sum over ranks of `x`."""
    parts = group_size(group)
    dim = dim % x.dim()
    n = _check_divisible(x, dim, parts, "length")
    shape = list(x.shape)
    blocks = x.reshape(shape[:dim] + [parts, n] + shape[dim + 1:]).movedim(dim, 0).contiguous()  # (T, ..., n, ...)
    shape[dim] = n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _flat(reduce_scatter_single, _reduce_scatter_via_all_reduce, group, out.view(-1), blocks.view(-1))
    return out


def _slice(x: torch.Tensor, dim: int, group, what: str) -> torch.Tensor:
    """This rank's slice of `x` along `dim` (a contiguous copy)."""
    n = _check_divisible(x, dim, group_size(group), what)
    return x.narrow(dim, group_rank(group) * n, n).contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        inplace = inplace and x.is_contiguous()
        if inplace:
            ctx.mark_dirty(x)
        return _all_reduce(x, group, inplace)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherAlong(torch.autograd.Function):
    """fwd all-gather along `dim`; bwd this rank's slice (`reduce=False`) or reduce-scatter (True)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce):
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _slice(grad, ctx.dim, ctx.group, "length"), None, None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, what):
        ctx.group, ctx.dim = group, dim
        return _slice(x, dim, group, what)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: forward the identity, backward the all-reduce of the gradient."""
    return x if group_size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group=None, *, inplace: bool = False) -> torch.Tensor:
    """Leave a tensor-parallel region: forward the all-reduce (sum) of the partial results, backward the
    identity. ``inplace=True`` reduces `x` itself (a fresh partial product that nothing else keeps)."""
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group, inplace)


def gather_last(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: every rank's `x` concatenated along the last dim; backward: this rank's slice."""
    return x if group_size(group) == 1 else _GatherAlong.apply(x, group, -1, False)


def split_last(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: this rank's slice of the last dim; backward: the all-gather of the gradient."""
    return x if group_size(group) == 1 else _SplitAlong.apply(x, group, -1, "last dimension")


def split_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Enter the sequence-parallel region: forward this rank's slice along `dim` (the sequence),
    backward the all-gather of the gradient."""
    return x if group_size(group) == 1 else _SplitAlong.apply(x, group, dim, "sequence length")


def gather_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel -> tensor-parallel: forward the all-gather along `dim`, backward the
    reduce-scatter (each rank's use of the whole sequence contributes to every slice's gradient)."""
    return x if group_size(group) == 1 else _GatherAlong.apply(x, group, dim, True)


def reduce_scatter_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Tensor-parallel -> sequence-parallel: forward the sum of the partial results, of which this rank
    keeps its slice along `dim` (reduce-scatter); backward the all-gather of the gradient."""
    if group_size(group) == 1:
        return x
    _check_divisible(x, dim, group_size(group), "sequence length")
    return _ReduceScatter.apply(x, group, dim)
