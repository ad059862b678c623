"""Tensor-parallel layers, each built from the user's full module by slicing its weights.

`X.from_module(module, group, ...)` takes this rank's part of `module`'s parameters (rank and size from
the tensor `group`, ``None``: the default group) and marks each split parameter with its `ShardSpec`,
so that checkpoints and `unshard` see the full tensor. Every tensor rank must start from the same full
module (same seed), so TP = 1 and TP = N start identical. Parameters keep their names (`weight`,
`bias`): a model's state-dict keys do not change.

* `ColumnParallelLinear`: weight split by output features; input copied in (or gathered along the
  sequence under sequence parallelism); output split along its last dim (unless `gather_output`).
* `RowParallelLinear`: weight split by input features; input split along its last dim; the partial
  products all-reduced (each with 1/T of the bias added inside its matmul), or reduce-scattered along
  the sequence (the whole bias added once, after).
* `VocabParallelEmbedding`: vocabulary rows split; ids of other ranks look up zeros; all-reduce.
* `vocab_parallel_cross_entropy`: the loss on vocabulary-split logits, never gathering them.
* `SequenceParallelDropout`: dropout on this rank's part of the sequence, with TP = 1's mask.

Both linear layers take `nn.Linear` and Hugging Face's `Conv1D` (weight stored [in, out], recognised
by its class name and `nf` attribute): the Conv1D layout is kept (`transposed=True`, the split is on
the other dimension of the weight) and computed as Conv1D does, ``addmm(bias, x, weight)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .functional import (copy_to, gather_last, gather_sequence, group_rank, group_size, reduce_from,
                         reduce_scatter_sequence)
from .spec import ShardSpec, mark_sequence_parallel, set_spec, shard

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "SequenceParallelDropout"]


class _Group:
    """Holds the process group; a deep copy of a layer (pipeline balancing copies layers) shares it,
    as process groups cannot be copied."""

    def __init__(self, group) -> None:
        self.group = group

    def __deepcopy__(self, memo) -> "_Group":
        return self


class _OnTensorGroup(nn.Module):
    """A layer computing over the tensor group: `group`, and this process's `rank` in it of `size`."""

    def _join(self, group) -> None:
        self._group = _Group(group)
        self.rank, self.size = _rank_size(group)

    @property
    def group(self):
        return self._group.group


def _rank_size(group) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); (0, 1) without a process group."""
    return group_rank(group), group_size(group)


def _split_param(full: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    p = nn.Parameter(shard(full.detach(), spec), requires_grad=full.requires_grad)
    set_spec(p, spec)
    return p


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is Hugging Face's Conv1D (weight stored [in, out]), recognised by its class name
    and `nf` attribute without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def linear_shape(module: nn.Module, caller: str) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of an `nn.Linear` (transposed False) or an HF `Conv1D`
    (True); a TypeError naming `caller` for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1], True
    raise TypeError(f"{caller}: expected an nn.Linear or a Hugging Face Conv1D, got {type(module).__name__}")


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if not transposed:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.matmul(x, weight)
    # Conv1D's own forward, so that TP = 1 gives its numbers exactly.
    out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)
    return out.view(x.shape[:-1] + (weight.shape[1],))


class _ParallelLinear(_OnTensorGroup):
    def __init__(self, weight, bias, group, *, in_features, out_features, transposed, sequence_parallel,
                 sequence_dim) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self._join(group)
        self.in_features, self.out_features = in_features, out_features
        self.transposed = transposed
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim

    def _repr_tail(self) -> str:
        tail = ", conv1d layout [in, out]" if self.transposed else ""
        if self.sequence_parallel:
            tail += f", sequence_parallel (dim {self.sequence_dim})"
        return tail


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T + b with A's rows (output features) split between the T ranks of the tensor group:
    this rank computes its slice of y's last dim. The input arrives whole (`copy_to`: its gradient is the
    sum of every rank's contribution) or, under sequence parallelism, split along `sequence_dim`
    (`gather_sequence`: all-gather forward, reduce-scatter backward). A fused projection of `chunks`
    equal blocks (q/k/v: ``chunks=3``) splits each block, so that the local output is [q_r; k_r; v_r]."""

    chunks: int = 1
    gather_output: bool = False

    @classmethod
    def from_module(cls, linear: nn.Module, group=None, *, chunks: int = 1, sequence_parallel: bool = False,
                    sequence_dim: int = 1, gather_output: bool = False) -> "ColumnParallelLinear":
        in_f, out_f, transposed = linear_shape(linear, f"{cls.__name__}.from_module")
        rank, size = _rank_size(group)
        if not isinstance(chunks, int) or chunks < 1 or out_f % chunks:
            raise ValueError(f"{cls.__name__}: chunks={chunks!r} does not split out features {out_f} into equal blocks")
        if out_f % (chunks * size):
            blocks = f" ({chunks} blocks of {out_f // chunks})" if chunks > 1 else ""
            raise ValueError(f"{cls.__name__}: out features {out_f}{blocks} of {type(linear).__name__}"
                             f"(in={in_f}, out={out_f}) not divisible by T={size}")
        wspec = ShardSpec(tuple(linear.weight.shape), 1 if transposed else 0, rank, size, chunks)
        bias = linear.bias
        if bias is not None:
            bias = _split_param(bias, ShardSpec(tuple(bias.shape), 0, rank, size, chunks))
        layer = cls(_split_param(linear.weight, wspec), bias, group, in_features=in_f, out_features=out_f,
                    transposed=transposed, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
        layer.chunks, layer.gather_output = chunks, gather_output
        return layer

    sequence_entry = None  # (`plan.SequenceEntry`: where the sequence-parallel region began, set by `apply_plan`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            if self.sequence_entry is not None:
                self.sequence_entry.check(x, self)
            x = gather_sequence(x, self.group, self.sequence_dim)
        else:
            x = copy_to(x, self.group)
        out = _matmul(x, self.weight, self.bias, self.transposed)  # (..., out / T)
        if not self.gather_output or self.size == 1:
            return out
        out = gather_last(out, self.group)  # (..., T * chunks * part): rank-major
        if self.chunks > 1:  # -> block-major, the full layer's order
            out = out.unflatten(-1, (self.size, self.chunks, -1)).transpose(-3, -2).flatten(-3)
        return out

    def extra_repr(self) -> str:
        chunks = f" in {self.chunks} blocks" if self.chunks > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}/{self.size}, split=output features{chunks} "
                f"(local {self.out_features // self.size}){', gather_output' if self.gather_output else ''}"
                + self._repr_tail())


class _BiasShare(torch.autograd.Function):
    """Forward: ``bias / T``, the share of it that each of the T ranks adds inside its matmul (the
    all-reduce of the partial products then sums the shares to the bias). Backward: the gradient whole,
    not divided: the output's gradient, and so each rank's gradient of its share, is the same on every
    rank, and the bias's gradient is the sum of the T shares' gradients times 1/T = any one of them."""

    @staticmethod
    def forward(ctx, bias, size):
        return bias / size

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RowParallelLinear(_ParallelLinear):
    """y = x A^T + b with A's columns (input features) split between the T ranks: the input arrives split
    along its last dim (a column-parallel layer's output), each rank computes a partial product, and
    the partial products are summed (`reduce_from`; under sequence parallelism `reduce_scatter_sequence`,
    which leaves each rank its part of the sequence). The bias is whole on every rank. Without sequence
    parallelism each rank adds ``bias / T`` inside its matmul (the GEMM's epilogue: no pass of its own
    over the output; `_BiasShare`), and the sum adds up the shares; ``bias_in_matmul = False`` adds the
    bias once after the sum instead. Under sequence parallelism it is added after the reduce-scatter;
    its gradient is then a partial sum (this rank's part of the sequence), so it is marked with
    `mark_sequence_parallel`."""

    bias_in_matmul = True  # class-wide; the benchmark's `bias_after` variant measures the other way

    @classmethod
    def from_module(cls, linear: nn.Module, group=None, *, sequence_parallel: bool = False,
                    sequence_dim: int = 1) -> "RowParallelLinear":
        in_f, out_f, transposed = linear_shape(linear, f"{cls.__name__}.from_module")
        rank, size = _rank_size(group)
        if in_f % size:
            raise ValueError(f"{cls.__name__}: in features {in_f} of {type(linear).__name__}(in={in_f}, out={out_f}) "
                             f"not divisible by T={size}")
        wspec = ShardSpec(tuple(linear.weight.shape), 0 if transposed else 1, rank, size)
        bias = linear.bias
        if bias is not None:
            bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
            if sequence_parallel and size > 1:
                mark_sequence_parallel(bias)
        return cls(_split_param(linear.weight, wspec), bias, group, in_features=in_f, out_features=out_f,
                   transposed=transposed, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:  # the plain layer, bias fused as it is there
            return _matmul(x, self.weight, self.bias, self.transposed)
        if x.shape[-1] != self.in_features // self.size:  # (torch's words: "mat1 and mat2 shapes cannot be ...")
            raise ValueError(
                f"tensor_parallel_plan: {getattr(self, 'plan_name', None) or 'a row-parallel layer'} ('rowwise') got an "
                f"input of {x.shape[-1]} features, where it takes this rank's part of its {self.in_features}: "
                f"{self.in_features // self.size}. A 'rowwise' layer takes what a 'colwise' one before it split (an "
                "MLP's second linear after its first); style the layer before it 'colwise', or this one 'colwise' "
                "or 'replicate'")
        if self.bias_in_matmul and not self.sequence_parallel:
            share = None if self.bias is None else _BiasShare.apply(self.bias, self.size)
            # One 2-D product that is no view of anything: reduced in place, a view (F.linear's 3-D
            # output is one) would make autograd copy the whole gradient in backward (measured on the
            # 7B: 256 activation-sized copies a step).
            rows = x.reshape(-1, x.shape[-1])
            weight = self.weight if self.transposed else self.weight.t()
            flat = torch.mm(rows, weight) if share is None else torch.addmm(share, rows, weight)
            out = reduce_from(flat, self.group, inplace=True)
            return out.view(*x.shape[:-1], out.shape[-1])
        partial = _matmul(x, self.weight, None, self.transposed)  # (..., out): this rank's share of the sum
        if self.sequence_parallel:
            out = reduce_scatter_sequence(partial, self.group, self.sequence_dim)
        else:
            out = reduce_from(partial, self.group, inplace=True)
        bias = self.bias
        if bias is None:
            return out
        if bias.dtype != out.dtype:
            # Only under autocast (an fp32 bias, a bf16 / fp16 activation): the bias in the activation's
            # dtype, as autocast gives it to F.linear. Otherwise no cast, not even a no-op `.to`.
            bias = bias.to(out.dtype)
        return out + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}/{self.size}, split=input features (local {self.in_features // self.size})"
                + self._repr_tail())


class VocabParallelEmbedding(_OnTensorGroup):
    """An embedding whose vocabulary rows are split: this rank holds ids [start, start + V / T). Ids of
    other ranks look up row 0 and are masked to zero; the all-reduce (`reduce_from`) then gives every
    rank the full lookup. `padding_idx` keeps nn.Embedding's meaning (its row gets no gradient)."""

    @classmethod
    def from_module(cls, embedding: nn.Embedding, group=None) -> "VocabParallelEmbedding":
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_module: expected an nn.Embedding, got {type(embedding).__name__}")
        for option, off in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(embedding, option) != off:
                raise ValueError(f"{cls.__name__}: nn.Embedding option {option}={getattr(embedding, option)!r} is "
                                 f"not supported under tensor parallelism (it needs the whole vocabulary)")
        vocab, dim = embedding.weight.shape
        rank, size = _rank_size(group)
        if vocab % size:
            raise ValueError(f"{cls.__name__}: vocabulary size {vocab} of nn.Embedding({vocab}, {dim}) not divisible "
                             f"by T={size}")
        weight = _split_param(embedding.weight, ShardSpec((vocab, dim), 0, rank, size))
        return cls(weight, group, num_embeddings=vocab, padding_idx=embedding.padding_idx)

    def __init__(self, weight: nn.Parameter, group, *, num_embeddings: int, padding_idx: int | None) -> None:
        super().__init__()
        self.weight = weight
        self._join(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, weight.shape[1]
        self.padding_idx = padding_idx
        self.vocab_start = self.rank * weight.shape[0]
        self.vocab_end = self.vocab_start + weight.shape[0]
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self._local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < weight.shape[0] else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        other = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(other, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        out = out.masked_fill(other.unsqueeze(-1), 0)  # (..., D): this rank's rows, zeros elsewhere
        return reduce_from(out, self.group, inplace=True)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, rank={self.rank}/{self.size}, "
                f"split=vocabulary rows [{self.vocab_start}, {self.vocab_end})")


class SequenceParallelDropout(_OnTensorGroup):
    """Dropout on this rank's part of the sequence, bit-equal to TP = 1.

    In training with p > 0 it draws the whole mask exactly as TP = 1's `F.dropout` draws it on the
    full-size input (``F.dropout(torch.ones(full_shape), p)``, same device and dtype: the same random
    numbers consumed in the same order) and multiplies its slice along `sequence_dim` into the input.
    So every tensor rank must hold the same random state (the trainer seeds them alike), and then the
    output equals TP = 1's slice bit for bit under a fixed seed. The draw takes the same kernel as the
    module's: `inplace` is kept (in-place dropout draws differently on CUDA), and on CUDA TP = 1's input
    is assumed contiguous, as activations are (a strided input may take another kernel path). The
    full mask lives only during the draw; autograd keeps this rank's slice."""

    @classmethod
    def from_module(cls, dropout: nn.Dropout, group=None, sequence_dim: int = 1) -> "SequenceParallelDropout":
        if type(dropout) is not nn.Dropout:
            raise TypeError(f"{cls.__name__}.from_module: expected an nn.Dropout, got {type(dropout).__name__}")
        return cls(dropout.p, group, sequence_dim, inplace=dropout.inplace, training=dropout.training)

    def __init__(self, p: float, group=None, sequence_dim: int = 1, *, inplace: bool = False,
                 training: bool = True) -> None:
        super().__init__()
        self.p, self.inplace = p, inplace
        self._join(group)
        self.sequence_dim = sequence_dim
        self.train(training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.size == 1:
            return F.dropout(x, self.p, True, self.inplace)
        dim = self.sequence_dim % x.dim()
        n = x.shape[dim]
        full = list(x.shape)
        full[dim] = n * self.size
        with torch.no_grad():
            mask = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), self.p, True, self.inplace)
            mask = mask.narrow(dim, self.rank * n, n).contiguous()  # 0 or 1 / (1 - p)
        return x * mask

    def extra_repr(self) -> str:
        return (f"p={self.p}, rank={self.rank}/{self.size}, split=sequence (dim {self.sequence_dim}), "
                f"mask drawn whole as at TP=1")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on logits split by vocabulary; rows (N, V / T) in a dtype of at least fp32."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index, smoothing, vocab):
        size = group_size(group)
        # A shift by the row's global max keeps exp() in range; any common shift gives the same loss.
        peak = logits.max(dim=-1).values
        if size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)  # (N, V / T), <= 0
        local = logits.shape[-1]
        valid = target != ignore_index
        index = target - vocab_start
        here = valid & (index >= 0) & (index < local)  # the target's logit is on this rank
        index = index.clamp(0, local - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0)
        exp = shifted.exp()
        stats = [exp.sum(-1), picked] + ([shifted.sum(-1)] if smoothing else [])
        stats = torch.stack(stats)  # one all-reduce for the sum of exp, the target logit (and the row sum)
        if size > 1:
            dist.all_reduce(stats, group=group)
        # loss = log sum exp - (1 - eps) x_target - eps mean_j x_j  (eps = label smoothing)
        loss = stats[0].log() - (1 - smoothing) * stats[1]
        if smoothing:
            loss = loss - smoothing / vocab * stats[2]
        loss = loss.masked_fill(~valid, 0)
        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, here, valid)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, here, valid = ctx.saved_tensors
        row = grad_loss.masked_fill(~valid, 0)  # (N,)
        grad = softmax * row.unsqueeze(-1)
        if ctx.smoothing:
            grad -= (ctx.smoothing / ctx.vocab * row).unsqueeze(-1)
        hit = (-(1 - ctx.smoothing) * row).masked_fill(~here, 0)
        grad.scatter_add_(-1, index.unsqueeze(-1), hit.unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, group=None, *,
                                 vocab_start: int | None = None, ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ...)`` from this rank's slice of the
    logits' last dim, without gathering the full logits.

    Three numbers per row cross the tensor group, in two all-reduces: the max logit (for a stable
    exp), then the sum of exp together with the target's logit (held by one rank, zero elsewhere) and,
    with label smoothing, the sum of the logits. The backward is computed here, on the local slice:
    softmax minus (1 - eps) one-hot minus eps / V, times the incoming gradient.

    Args:
        local_logits: (..., V / T), this rank's vocabulary columns (a vocab-parallel head's output).
        target: (...) class ids in [0, V), or `ignore_index`.
        group: the tensor group (``None``: the default group).
        vocab_start: the first vocabulary id of this rank's slice (default: rank * V / T).
        ignore_index, reduction ("mean" over the targets not ignored, "sum", "none"), label_smoothing:
            as in `F.cross_entropy`.

    Returns:
        The loss in fp32 (fp64 for fp64 logits): computed in at least fp32 whatever the logits' dtype.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if tuple(target.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(f"target of shape {list(target.shape)} does not match logits of shape "
                         f"{list(local_logits.shape)} (expected {list(local_logits.shape[:-1])})")
    rank, size = _rank_size(group)
    local = local_logits.shape[-1]
    if vocab_start is None:
        vocab_start = rank * local
    dtype = torch.promote_types(local_logits.dtype, torch.float32)
    rows = local_logits.reshape(-1, local).to(dtype)
    loss = _VocabParallelCrossEntropy.apply(rows, target.reshape(-1), group, vocab_start, ignore_index,
                                           float(label_smoothing), local * size)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()  # no target left: nan, as F.cross_entropy
