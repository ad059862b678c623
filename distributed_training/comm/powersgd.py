"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): each gradient matrix sent as a rank-r product.

A layer's gradient M (its weight's gradient seen as rows x the rest: a linear layer's out x in, a
convolution's out x in*kh*kw) is approximated by P Q^T, with P = M Q (rows x r) and Q = M^T P (cols x r):

1. P_i = M_i Q on every rank, with the same Q everywhere (last step's mean Q: the warm start that
   makes one power iteration a step enough); all-reduce the P_i: P = sum P_i.
2. Orthonormalise P (QR); Q_i = M_i^T P; all-reduce: Q = mean Q_i.
3. Every rank takes P Q^T = mean over ranks of P P^T M_i: the mean gradient projected on span(P).

Two small all-reduces of r (rows + cols) values instead of rows x cols. With error feedback, what
the projection misses of a rank's own M_i (M_i - P P^T M_i, which is M_i - P Q_i^T) is added to its
next step's gradient, so nothing is lost, only delayed (except across a step the fp16 loss scaler
skips: see `CommunicationOptimizer.loss_scale_changed`).

What is a matrix is decided per tensor, from a bucket's layout (`BucketLayout`, which DDP hands to its
reducer): a tensor of two or more dimensions whose rank-r factors are smaller than it. Everything else
(biases, norms' weights, small matrices) is all-reduced exactly, in the same collective as the P's. A
flat tensor with no layout is seen as one near-square matrix plus an exact tail.

P's of one shape are orthonormalised together (one batched QR): a transformer's layers share a few
shapes, so a bucket costs a few QR calls, not one per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["BucketLayout", "PowerSGDPlan", "plan_bucket", "powersgd_start", "powersgd_finish"]

#: (offset in the flat bucket, shape in memory order: outermost dimension first) per tensor.
BucketLayout = list[tuple[int, tuple[int, ...]]]


@dataclass(frozen=True)
class PowerSGDPlan:
    """How one flat bucket of `numel` values is sent.

    Attributes:
        numel: the bucket's length.
        matrices: (offset, rows, cols, r) per compressed matrix, ordered by (rows, r): the P's that
            one batched QR orthonormalises are contiguous in the P buffer.
        groups: (offset in the P buffer, count, rows, r) per run of equal (rows, r): orthonormalised
            together.
        exact: (offset, numel) spans all-reduced exactly (adjacent spans merged).
        p_numel, q_numel, exact_numel: sizes of the P, Q and exact buffers.
    """

    numel: int
    matrices: tuple[tuple[int, int, int, int], ...]
    groups: tuple[tuple[int, int, int, int], ...]
    exact: tuple[tuple[int, int], ...]
    p_numel: int
    q_numel: int
    exact_numel: int


def plan_bucket(numel: int, layout: BucketLayout | None, rank: int) -> PowerSGDPlan:
    """The plan for a bucket of `numel` values laid out as `layout` (None or empty: one near-square
    matrix and an exact tail)."""
    if not layout:
        cols = max(1, math.isqrt(numel))
        rows = numel // cols
        layout = [(0, (rows, cols))] + ([(rows * cols, (numel - rows * cols,))] if numel > rows * cols else [])
    matrices, exact = [], []
    for offset, shape in layout:
        size = math.prod(shape)
        if len(shape) >= 2 and size:
            rows, cols = shape[0], size // shape[0]
            r = min(rank, rows, cols)
            if r * (rows + cols) < rows * cols:  # the factors are smaller than the matrix
                matrices.append((offset, rows, cols, r))
                continue
        if size:
            exact.append((offset, size))
    matrices.sort(key=lambda m: (m[1], m[3], m[2]))  # stable: bucket order within a shape
    groups: list[list[int]] = []  # [offset in P, count, rows, r]
    p_at = 0
    for _, rows, _, r in matrices:
        if groups and groups[-1][2:] == [rows, r]:
            groups[-1][1] += 1
        else:
            groups.append([p_at, 1, rows, r])
        p_at += rows * r
    merged: list[tuple[int, int]] = []
    for offset, size in sorted(exact):
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((offset, size))
    return PowerSGDPlan(numel, tuple(matrices), tuple(tuple(g) for g in groups), tuple(merged), p_at, sum(cols * r for _, _, cols, r in matrices),
                        sum(size for _, size in merged))


def initial_q(plan: PowerSGDPlan, key: int, device: torch.device) -> torch.Tensor:
    """Every matrix's first Q, flat: standard normal, the same on every rank. The matrix at `offset`
    of bucket `key` draws its (cols x r) values from a generator seeded ``(1234 + ((key + 1) << 40) +
    offset) mod 2^63``: a rule that does not depend on how the plan orders the matrices."""
    q = torch.empty(plan.q_numel, dtype=torch.float32)
    for (offset, _, cols, r), qi in zip(plan.matrices, _views(q, plan, "q")):
        g = torch.Generator(device="cpu").manual_seed((1234 + ((key + 1) << 40) + offset) % (1 << 63))
        qi.copy_(torch.randn(cols, r, generator=g))
    return q.to(device)


def _views(buf: torch.Tensor, plan: PowerSGDPlan, which: str) -> list[torch.Tensor]:
    """Per matrix, its (rows x r) P or (cols x r) Q inside the flat `buf`."""
    views, offset = [], 0
    for _, rows, cols, r in plan.matrices:
        n = (rows if which == "p" else cols) * r
        views.append(buf[offset:offset + n].view(-1, r))
        offset += n
    return views


def powersgd_start(m: torch.Tensor, plan: PowerSGDPlan, q: torch.Tensor, group, world: int):
    """Step 1 on `m` (this rank's fp32 bucket, gradient + residual): P_i = M_i Q and the exact spans, in
    one buffer whose all-reduce (a sum) is launched. Returns (buffer, work or None)."""
    sent = torch.empty(plan.p_numel + plan.exact_numel, dtype=torch.float32, device=m.device)
    for (offset, rows, cols, _), p, qi in zip(plan.matrices, _views(sent, plan, "p"), _views(q, plan, "q")):
        torch.matmul(m[offset:offset + rows * cols].view(rows, cols), qi, out=p)
    at = plan.p_numel
    for offset, size in plan.exact:
        sent[at:at + size].copy_(m[offset:offset + size])
        at += size
    work = dist.all_reduce(sent, group=group, async_op=True) if world > 1 else None
    return sent, work


def powersgd_finish(flat: torch.Tensor, m: torch.Tensor, sent: torch.Tensor, plan: PowerSGDPlan, group,
                    world: int, feedback: bool) -> torch.Tensor:
    """Steps 2-3 once `sent` is summed: writes the mean approximation into `flat`, and with `feedback`
    turns `m` into this rank's residual in place (zero where the bucket went exactly). Returns the new
    mean Q (flat), the next step's warm start."""
    p_all = sent[:plan.p_numel]
    for start, count, rows, r in plan.groups:  # orthonormalise each shape's P's in one batched QR
        block = p_all[start:start + count * rows * r].view(count, rows, r)
        block.copy_(torch.linalg.qr(block).Q)
    ps = _views(p_all, plan, "p")
    q = torch.empty(plan.q_numel, dtype=torch.float32, device=m.device)
    for (offset, rows, cols, _), p, qi in zip(plan.matrices, ps, _views(q, plan, "q")):
        torch.matmul(m[offset:offset + rows * cols].view(rows, cols).t(), p, out=qi)
    own = q.clone() if feedback else None
    if world > 1:
        dist.all_reduce(q, group=group)
        q.div_(world)
    for (offset, rows, cols, _), p, qi in zip(plan.matrices, ps, _views(q, plan, "q")):
        flat[offset:offset + rows * cols].view(rows, cols).copy_(p @ qi.t())
    at = plan.p_numel
    for offset, size in plan.exact:
        flat[offset:offset + size].copy_(sent[at:at + size] / world)
        at += size
    if feedback:
        for (offset, rows, cols, _), p, qi in zip(plan.matrices, ps, _views(own, plan, "q")):
            m[offset:offset + rows * cols].view(rows, cols).sub_(p @ qi.t())  # M_i - P P^T M_i
        for offset, size in plan.exact:
            m[offset:offset + size].zero_()
    return q
