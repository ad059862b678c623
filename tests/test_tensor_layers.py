"""Tensor-parallel collectives and layers on real gloo processes: each layer, built from a plain module,
gives the plain module's output, input gradient and (reassembled) weight gradient on the same full input;
the vocabulary-parallel loss equals F.cross_entropy; sequence-parallel dropout draws TP = 1's mask.

Worlds of 2 (T = 2) and 4 (T = 4 over the default group, and T = 2 over the subgroups {0, 1}, {2, 3},
so that a group's rank differs from the global one). References in fp64 unless the dtype is the point.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training.tensor import functional
from distributed_training.tensor.functional import (copy_to, gather_last, gather_sequence, reduce_from,
                                                    reduce_scatter_sequence, split_last, split_sequence)
from distributed_training.tensor.layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallelDropout,
                                                VocabParallelEmbedding, vocab_parallel_cross_entropy)
from distributed_training.tensor.spec import ShardSpec, is_sequence_parallel, shard, spec_of, unshard
from distributed_training.testing import run_distributed

TOL = dict(atol=1e-5, rtol=1e-5)
F64 = torch.float64


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D (transformers is not installed here): weight [in, out], `nf` = out."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def tensor_groups(world: int) -> list[tuple[object, int]]:
    """(group, T) configurations for this rank; every rank creates every subgroup, in the same order."""
    if world == 2:
        return [(None, 2)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    # gloo connects a new group's pairs one side at a time: a rank that never talks on its pair (the dropout
    # test) could exit while its partner is still connecting ("Connection closed by peer", seen in CI).
    dist.barrier()
    return [(None, 4), (pairs[dist.get_rank() // 2], 2)]


def gather_all(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def seeded(seed: int, *shape, dtype=F64) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def check_grad(layer_param, full_param, group, what):
    spec = spec_of(layer_param)
    got = unshard(gather_all(layer_param.grad, group), spec) if spec is not None else layer_param.grad
    torch.testing.assert_close(got, full_param.grad, **TOL, msg=lambda m: f"{what}: {m}")


def sliced(t: torch.Tensor, dim: int, rank: int, parts: int, chunks: int = 1) -> torch.Tensor:
    return shard(t, ShardSpec(tuple(t.shape), dim % t.dim(), rank, parts, chunks))


# ----------------------------------------------------------------------------------- collectives
def collectives_worker(rank, world, fallback):
    if fallback:  # the per-rank-list / all-reduce path, for backends without the flat collectives
        functional._NO_FLAT.add("gloo")
    for group, T in tensor_groups(world):
        r = dist.get_rank(group)
        xs = [seeded(10 + s, 2, 4 * T, 3 * T) for s in range(T)]  # every group rank's input, known to all
        gs = [seeded(20 + s, 2, 4 * T, 3 * T) for s in range(T)]
        small = [x.narrow(1, 0, 4) for x in xs]  # (2, 4, 3T): a sequence slice
        small_g = [g.narrow(1, 0, 4) for g in gs]

        def run(fn, x, g):
            x = x.clone().requires_grad_(True)
            y = fn(x)
            y.backward(g)
            return y.detach(), x.grad

        def check(name, got, expected):
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=0, msg=lambda m: f"T={T} {name}: {m}")

        y, gx = run(lambda x: copy_to(x, group), xs[r], gs[r])
        check("copy_to fwd", y, xs[r]); check("copy_to bwd", gx, sum(gs))
        y, gx = run(lambda x: reduce_from(x, group), xs[r], gs[r])
        check("reduce_from fwd", y, sum(xs)); check("reduce_from bwd", gx, gs[r])
        big_g = [seeded(30 + s, 2, 4, 3 * T * T) for s in range(T)]
        y, gx = run(lambda x: gather_last(x, group), small[r], big_g[r])
        check("gather_last fwd", y, torch.cat(small, -1)); check("gather_last bwd", gx, sliced(big_g[r], -1, r, T))
        part_g = [sliced(g, -1, s, T) for s, g in enumerate(gs)]
        y, gx = run(lambda x: split_last(x, group), xs[r], part_g[r])
        check("split_last fwd", y, sliced(xs[r], -1, r, T)); check("split_last bwd", gx, torch.cat(part_g, -1))
        seq_g = [sliced(g, 1, s, T) for s, g in enumerate(gs)]
        y, gx = run(lambda x: split_sequence(x, group), xs[r], seq_g[r])
        check("split_sequence fwd", y, sliced(xs[r], 1, r, T)); check("split_sequence bwd", gx, torch.cat(seq_g, 1))
        y, gx = run(lambda x: gather_sequence(x, group), small[r], gs[r])
        check("gather_sequence fwd", y, torch.cat(small, 1)); check("gather_sequence bwd", gx, sliced(sum(gs), 1, r, T))
        y, gx = run(lambda x: reduce_scatter_sequence(x, group), xs[r], small_g[r])
        check("reduce_scatter fwd", y, sliced(sum(xs), 1, r, T)); check("reduce_scatter bwd", gx, torch.cat(small_g, 1))
        # Along another dim (0), and a non-contiguous input.
        dim0_g = [seeded(40 + s, 2 * T, 3 * T, 4) for s in range(T)]
        y, gx = run(lambda x: gather_sequence(x.transpose(1, 2), group, dim=0), small[r], dim0_g[r])
        check("gather dim 0 fwd", y, torch.cat([s.transpose(1, 2) for s in small], 0))
        check("gather dim 0 bwd", gx, sliced(sum(dim0_g), 0, r, T).transpose(1, 2))
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, fallback", [(2, False), (4, False), (4, True)])
def test_collectives_forward_and_conjugate_backward(world, fallback):
    assert all(run_distributed(collectives_worker, world, args=(fallback,), timeout=50))


# ----------------------------------------------------------------------------------- linear layers
def linear_case(group, T, make, style, *, chunks=1, sp=False, gather_output=False):
    """Build the full module and its parallel twin, run both on the same full input; compare."""
    r = dist.get_rank(group)
    torch.manual_seed(0)
    full = make().to(F64)
    if style == "colwise":
        layer = ColumnParallelLinear.from_module(full, group, chunks=chunks, sequence_parallel=sp,
                                                 gather_output=gather_output)
    else:
        layer = RowParallelLinear.from_module(full, group, sequence_parallel=sp)
    in_f = full.weight.shape[0] if isinstance(full, Conv1D) else full.in_features
    x = seeded(1, 2, 4 * T, in_f)
    x.requires_grad_(True)
    y = full(x)
    g = seeded(2, *y.shape)
    y.backward(g)
    # What this rank sees: colwise takes x whole (or its sequence slice), rowwise its feature slice.
    if style == "colwise":
        x_local = sliced(x.detach(), 1, r, T) if sp else x.detach().clone()
        out_of = (lambda t: t) if gather_output else (lambda t: sliced(t, -1, r, T, chunks))
        expect_x_grad = sliced(x.grad, 1, r, T) if sp else x.grad
    else:
        x_local = sliced(x.detach(), -1, r, T)
        out_of = (lambda t: sliced(t, 1, r, T)) if sp else (lambda t: t)
        expect_x_grad = sliced(x.grad, -1, r, T)
    x_local.requires_grad_(True)
    y_local = layer(x_local)
    what = f"T={T} {style} {type(full).__name__} chunks={chunks} sp={sp} gather_output={gather_output}"
    torch.testing.assert_close(y_local, out_of(y.detach()), **TOL, msg=lambda m: f"{what} output: {m}")
    y_local.backward(out_of(g))
    torch.testing.assert_close(x_local.grad, expect_x_grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
    check_grad(layer.weight, full.weight, group, f"{what} weight grad")
    if style == "rowwise" and sp:
        assert is_sequence_parallel(layer.bias), what
        dist.all_reduce(layer.bias.grad, group=group)  # partial sums over the sequence
    check_grad(layer.bias, full.bias, group, f"{what} bias grad")
    return layer


def linear_worker(rank, world):
    for group, T in tensor_groups(world):
        for sp in (False, True):
            for make in (lambda: nn.Linear(6, 12), lambda: Conv1D(12, 6)):
                for chunks in (1, 3):
                    layer = linear_case(group, T, make, "colwise", chunks=chunks, sp=sp)
                    want = ShardSpec((12, 6), 0, dist.get_rank(group), T, chunks)
                    if isinstance(make(), Conv1D):
                        want = ShardSpec((6, 12), 1, dist.get_rank(group), T, chunks)
                    assert spec_of(layer.weight) == want, (spec_of(layer.weight), want)
                    assert f"rank={dist.get_rank(group)}/{T}" in repr(layer) and "output features" in repr(layer)
                linear_case(group, T, make, "colwise", chunks=3, sp=sp, gather_output=True)
            for make in (lambda: nn.Linear(8, 5), lambda: Conv1D(5, 8)):
                layer = linear_case(group, T, make, "rowwise", sp=sp)
                assert spec_of(layer.bias) is None and "input features" in repr(layer)
            mlp_case(group, T, sp)
            autocast_case(group, T, sp)
        copy.deepcopy(layer)  # the group is shared, not copied
    return True


def mlp_case(group, T, sp):
    """colwise -> gelu -> rowwise, the Megatron MLP: equal to the plain MLP."""
    r = dist.get_rank(group)
    torch.manual_seed(3)
    up, down = nn.Linear(4, 8 * T).to(F64), nn.Linear(8 * T, 4).to(F64)
    tp_up = ColumnParallelLinear.from_module(up, group, sequence_parallel=sp)
    tp_down = RowParallelLinear.from_module(down, group, sequence_parallel=sp)
    x = seeded(4, 2, 2 * T, 4).requires_grad_(True)
    y = down(F.gelu(up(x)))
    y.square().sum().backward()
    x_local = (sliced(x.detach(), 1, r, T) if sp else x.detach().clone()).requires_grad_(True)
    y_local = tp_down(F.gelu(tp_up(x_local)))
    y_local.square().sum().backward()
    torch.testing.assert_close(y_local, sliced(y.detach(), 1, r, T) if sp else y.detach(), **TOL)
    torch.testing.assert_close(x_local.grad, sliced(x.grad, 1, r, T) if sp else x.grad, **TOL)
    if sp:
        dist.all_reduce(tp_down.bias.grad, group=group)
    for a, b in ((tp_up.weight, up.weight), (tp_up.bias, up.bias), (tp_down.weight, down.weight),
                 (tp_down.bias, down.bias)):
        check_grad(a, b, group, f"mlp T={T} sp={sp}")


def autocast_case(group, T, sp):
    """Under autocast the layers give the plain layers' dtypes (bf16 activations, communicated in bf16)."""
    r = dist.get_rank(group)
    torch.manual_seed(3)
    up, down = nn.Linear(4, 4 * T), nn.Linear(4 * T, 4)
    tp_up = ColumnParallelLinear.from_module(up, group, sequence_parallel=sp)
    tp_down = RowParallelLinear.from_module(down, group, sequence_parallel=sp)
    x = seeded(4, 2, 2 * T, 4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = down(up(x))
        got = tp_down(tp_up(sliced(x, 1, r, T) if sp else x))
    assert got.dtype == want.dtype == torch.bfloat16, (got.dtype, want.dtype)
    torch.testing.assert_close(got, sliced(want, 1, r, T) if sp else want, atol=3e-2, rtol=3e-2)
    # The row-parallel bias, bit for bit as the naive formula: without sequence parallelism 1/T of it added
    # inside each rank's matmul (cast to bf16 by autocast, as F.linear casts it), with sequence parallelism
    # cast to bf16 and added after the reduce-scatter; in fp32 no cast anywhere in the graph.
    h = seeded(5, 2, 2 * T, 4, dtype=torch.float32)
    naive = copy.deepcopy(tp_down)
    if sp:
        def formula(weight, bias):
            return reduce_scatter_sequence(F.linear(h, weight), group, 1) + bias.to(torch.get_autocast_dtype("cpu")
                                                                                    if torch.is_autocast_enabled("cpu")
                                                                                    else bias.dtype)
    else:
        def formula(weight, bias):
            return reduce_from(F.linear(h, weight, bias / T), group)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tp_down(h)
        want = formula(naive.weight, naive.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"T={T} sp={sp}: autocast bias"
    got.float().square().sum().backward()
    want.float().square().sum().backward()
    # the naive share's gradient is 1/T of the bias's (every rank sees the whole output's gradient)
    expected = naive.bias.grad if sp else naive.bias.grad * T
    assert tp_down.bias.grad.dtype == torch.float32 and torch.equal(tp_down.bias.grad, expected)
    out = tp_down(h)
    assert out.dtype == torch.float32 and "ToCopy" not in _graph(out.grad_fn)
    assert torch.equal(out, formula(tp_down.weight, tp_down.bias))


def _graph(fn) -> str:
    """The names of every node of an autograd graph, joined."""
    names, todo, seen = [], [fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return " ".join(names)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_linear_layers_equal_the_plain_module(world):
    assert all(run_distributed(linear_worker, world, timeout=80))


# ----------------------------------------------------------------------------------- vocabulary
def vocab_worker(rank, world):
    for group, T in tensor_groups(world):
        r = dist.get_rank(group)
        # Embedding: ids from every rank's range, the padding id among them.
        for padding_idx in (None, 5):
            torch.manual_seed(5)
            full = nn.Embedding(16, 3, padding_idx=padding_idx).to(F64)
            layer = VocabParallelEmbedding.from_module(full, group)
            ids = torch.tensor([[0, 5, 15, 7], [8, 5, 3, 12]])
            g = seeded(6, 2, 4, 3)
            y = full(ids)
            y.backward(g)
            y_local = layer(ids)
            torch.testing.assert_close(y_local, y.detach(), **TOL)
            y_local.backward(g)
            check_grad(layer.weight, full.weight, group, f"T={T} embedding padding_idx={padding_idx}")
            assert spec_of(layer.weight) == ShardSpec((16, 3), 0, r, T) and "vocabulary rows" in repr(layer)
            if padding_idx is not None:
                assert not full.weight.grad[padding_idx].any()
        # Cross-entropy: logits of any leading shape, ignored targets, every reduction, label smoothing.
        target = torch.tensor([[1, 15, -100, 8, 4], [0, 7, 11, -100, 3]])
        for dtype in (F64, torch.float32, torch.bfloat16):
            logits = (seeded(7, 2, 5, 16) * 4).to(dtype)
            for reduction in ("mean", "sum", "none"):
                for smoothing in (0.0, 0.1):
                    full = logits.detach().to(torch.promote_types(dtype, torch.float32)).requires_grad_(True)
                    want = F.cross_entropy(full.view(-1, 16), target.view(-1), reduction=reduction,
                                           label_smoothing=smoothing)
                    want = want.view(target.shape) if reduction == "none" else want
                    g = seeded(8, *want.shape, dtype=want.dtype)
                    want.backward(g)
                    local = sliced(logits, -1, r, T).requires_grad_(True)
                    got = vocab_parallel_cross_entropy(local, target, group, reduction=reduction,
                                                       label_smoothing=smoothing)
                    got.backward(g)
                    what = f"T={T} {dtype} {reduction} smoothing={smoothing}"
                    assert got.dtype == want.dtype, what
                    torch.testing.assert_close(got, want.detach(), **TOL, msg=lambda m: f"{what} loss: {m}")
                    torch.testing.assert_close(local.grad.to(full.dtype), sliced(full.grad, -1, r, T),
                                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2,
                                               msg=lambda m: f"{what} grad: {m}")
        # (N, V / T) logits and an explicit vocab_start; every target ignored gives nan, as torch.
        flat = seeded(9, 6, 16)
        got = vocab_parallel_cross_entropy(sliced(flat, -1, r, T), target.view(-1)[:6], group,
                                           vocab_start=r * 16 // T)
        torch.testing.assert_close(got, F.cross_entropy(flat, target.view(-1)[:6]), **TOL)
        assert vocab_parallel_cross_entropy(sliced(flat, -1, r, T)[:1], torch.tensor([-100]), group).isnan()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_embedding_and_cross_entropy_equal_the_plain_ones(world):
    assert all(run_distributed(vocab_worker, world, timeout=50))


# ----------------------------------------------------------------------------------- dropout
def dropout_worker(rank, world):
    for group, T in tensor_groups(world):
        r = dist.get_rank(group)
        for dtype, inplace in ((torch.float32, False), (F64, False), (torch.float32, True)):
            layer = SequenceParallelDropout.from_module(nn.Dropout(0.3, inplace=inplace), group)
            assert "mask drawn whole" in repr(layer) and layer.inplace == inplace
            x = seeded(11, 2, 4 * T, 5, dtype=dtype).requires_grad_(True)
            g = seeded(12, 2, 4 * T, 5, dtype=dtype)
            torch.manual_seed(1234)
            want = F.dropout(x * 1, 0.3, training=True, inplace=inplace)  # TP = 1
            want.backward(g)
            torch.manual_seed(1234)
            x_local = sliced(x.detach(), 1, r, T).requires_grad_(True)
            got = layer(x_local)
            got.backward(sliced(g, 1, r, T))
            assert torch.equal(got, sliced(want.detach(), 1, r, T)), f"T={T} {dtype}: mask differs from TP=1"
            assert torch.equal(x_local.grad, sliced(x.grad, 1, r, T)), f"T={T} {dtype}: grad differs from TP=1"
            assert (got == 0).any() and (got != 0).any()
        layer.eval()
        assert layer(x_local) is x_local
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_dropout_draws_the_tp1_mask(world):
    assert all(run_distributed(dropout_worker, world, timeout=50))


# ----------------------------------------------------------------------------------- T = 1
def tp1_worker(rank, world):
    alone = [dist.new_group([r]) for r in range(world)][rank]
    x = seeded(13, 2, 3, 6, dtype=torch.float32)
    torch.manual_seed(0)
    for full in (Conv1D(6, 6), nn.Linear(6, 6)):
        for layer in (ColumnParallelLinear.from_module(full, alone, chunks=3, sequence_parallel=True),
                      RowParallelLinear.from_module(full, alone, sequence_parallel=True)):
            assert torch.equal(layer(x), full(x)), layer  # bit-equal: the same kernel as the plain module
            assert spec_of(layer.weight).parts == 1 and not is_sequence_parallel(layer.bias)
    emb = nn.Embedding(10, 4, padding_idx=2)
    ids = torch.tensor([[2, 9, 0]])
    assert torch.equal(VocabParallelEmbedding.from_module(emb, alone)(ids), emb(ids))
    torch.testing.assert_close(vocab_parallel_cross_entropy(x, torch.tensor([[0, 5, -100]] * 2), alone),
                               F.cross_entropy(x.view(-1, 6), torch.tensor([0, 5, -100] * 2)), **TOL)
    for fn in (copy_to, reduce_from, gather_last, split_last, split_sequence, gather_sequence, reduce_scatter_sequence):
        assert fn(x, alone) is x
    torch.manual_seed(5)
    want = F.dropout(x, 0.5)
    torch.manual_seed(5)
    assert torch.equal(SequenceParallelDropout.from_module(nn.Dropout(0.5), alone)(x), want)
    return True


@pytest.mark.timeout(60)
def test_tensor_size_one_is_the_plain_module():
    assert all(run_distributed(tp1_worker, 2, timeout=50))


# ----------------------------------------------------------------------------------- errors
ERRORS = [
    (lambda g: ColumnParallelLinear.from_module(nn.Linear(3, 10), g), ValueError,
     r"out features 10 of Linear\(in=3, out=10\) not divisible by T=4"),
    (lambda g: ColumnParallelLinear.from_module(nn.Linear(3, 6), g, chunks=3), ValueError,
     r"out features 6 \(3 blocks of 2\) .* not divisible by T=4"),
    (lambda g: ColumnParallelLinear.from_module(nn.Linear(3, 8), g, chunks=3), ValueError,
     r"chunks=3 does not split out features 8"),
    (lambda g: ColumnParallelLinear.from_module(Conv1D(6, 3), g), ValueError,
     r"out features 6 of Conv1D\(in=3, out=6\) not divisible by T=4"),
    (lambda g: RowParallelLinear.from_module(nn.Linear(6, 4), g), ValueError,
     r"in features 6 of Linear\(in=6, out=4\) not divisible by T=4"),
    (lambda g: RowParallelLinear.from_module(nn.Conv1d(4, 4, 1), g), TypeError, r"nn.Linear or a Hugging Face Conv1D"),
    (lambda g: VocabParallelEmbedding.from_module(nn.Embedding(10, 4), g), ValueError,
     r"vocabulary size 10 of nn.Embedding\(10, 4\) not divisible by T=4"),
    (lambda g: VocabParallelEmbedding.from_module(nn.Embedding(8, 4, max_norm=1.0), g), ValueError, r"max_norm=1.0"),
    (lambda g: VocabParallelEmbedding.from_module(nn.Embedding(8, 4, scale_grad_by_freq=True), g), ValueError,
     r"scale_grad_by_freq=True"),
    (lambda g: VocabParallelEmbedding.from_module(nn.Embedding(8, 4, sparse=True), g), ValueError, r"sparse=True"),
    (lambda g: SequenceParallelDropout.from_module(nn.Dropout2d(), g), TypeError, r"expected an nn.Dropout"),
    (lambda g: split_sequence(torch.zeros(2, 5, 4), g), ValueError, r"sequence length 5 .* not divisible .* T=4"),
    (lambda g: reduce_scatter_sequence(torch.zeros(2, 6, 4), g), ValueError, r"sequence length 6 .* T=4"),
    (lambda g: split_last(torch.zeros(2, 6), g), ValueError, r"last dimension 6 .* T=4"),
    (lambda g: vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), g),
     ValueError, r"target of shape \[2, 4\] does not match logits of shape \[2, 3, 4\]"),
    (lambda g: vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), g, reduction="avg"),
     ValueError, r"reduction must be"),
]


def errors_worker(rank, world):
    failures = []
    for i, (make, kind, pattern) in enumerate(ERRORS):
        try:
            with pytest.raises(kind, match=pattern):
                make(None)
        except BaseException as e:  # pytest's Failed is a BaseException
            failures.append(f"case {i}: {e}")
    return failures


@pytest.mark.timeout(60)
def test_validation_errors_name_the_shapes_and_T():
    for failures in run_distributed(errors_worker, 4, timeout=50):
        assert not failures, "\n".join(failures)
