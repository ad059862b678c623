"""Top-K's block-max selection as one fused Triton kernel (CUDA), with the eager twin beside it.

Block-max views the accumulated gradient (gradient + error-feedback residual) as rows of L values and
sends each row's largest-magnitude entry: ceil(n / L) (index, value) pairs, a count fixed by the length.
In eager PyTorch that is an add, two row reductions (max and min: the larger magnitude of the two is
the row's largest |x|, and no |x| pass is written), a few small element-wise ops over the n / L
winners and a scatter that zeroes them in the residual: about ten launches per bucket, which at 25 MiB
buckets costs more host time than the GPU needs for the bytes. The kernel does it in one launch and in
the fewest passes over memory: it reads the gradient and the residual once, writes the residual once
(the sent entry zeroed) and writes the pairs.

`blockmax_eager` is the reference (and the path on CPU, or without Triton); `blockmax_fused` must
match it bit for bit wherever a row has a single largest magnitude (ties may pick another entry of
the same magnitude: both are correct).
"""

from __future__ import annotations

import functools

import torch

# The fused kernel holds BLOCK_R x BLOCK_L values per program: rows longer than this (densities below
# about 1 / 8192) take the eager path.
MAX_FUSED_ROW = 8192
# False sends every call down the eager path (to time one against the other, or to rule the kernel out).
ENABLED = True


def blockmax_eager(acc: torch.Tensor, n: int, row: int, base: torch.Tensor,
                   zero_sent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 indices, values) of each `row`-long row's largest-magnitude entry of ``acc[:n]``.

    `acc` holds at least ceil(n / row) * row values, those past n zero (the last row's padding);
    `base` is ``arange(0, rows * row, row)`` in int32. With `zero_sent` the sent entries are set to 0
    in `acc` (what error feedback keeps is the rest). A padding entry is picked only when its row's
    real entries are all 0; its index is clamped to n - 1 and it carries 0, so it adds nothing."""
    rows = -(-n // row)
    view = acc[: rows * row].view(rows, row)                       # (rows, row)
    high, i_high = view.max(dim=1)
    low, i_low = view.min(dim=1)
    take_high = (high + low) >= 0                                  # |high| >= |low|; exact in floats
    values = torch.where(take_high, high, low)
    local = torch.where(take_high, i_high, i_low)                  # (rows,) int64, position in the row
    if zero_sent:
        view.scatter_(1, local.unsqueeze(1), 0.0)
    indices = torch.add(local, base, out=torch.empty(rows, dtype=torch.int32, device=acc.device))
    if rows * row > n:
        indices.clamp_(max=n - 1)
    return indices, values


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use; None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def blockmax(flat_ptr, res_ptr, idx_ptr, val_ptr, n, rows, row_len,
                 ACCUMULATE: tl.constexpr, KEEP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)     # (BLOCK_R,) rows of this program
        c = tl.arange(0, BLOCK_L)                                   # (BLOCK_L,) position in a row
        offs = r.to(tl.int64)[:, None] * row_len + c[None, :]       # (BLOCK_R, BLOCK_L)
        mask = (r[:, None] < rows) & (c[None, :] < row_len) & (offs < n)
        acc = tl.load(flat_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ACCUMULATE:
            acc = tl.load(res_ptr + offs, mask=mask, other=0.0) + acc  # residual + gradient, as eager
        magnitude = tl.where(mask, tl.abs(acc), -1.0)               # masked lanes never win
        # The row's largest magnitude, then the first position holding it: two plain reductions,
        # several times faster than tl.argmax here (measured on H200), and the same first-of-equals.
        best = tl.max(magnitude, axis=1)
        pick = tl.min(tl.where(magnitude == best[:, None], c[None, :], BLOCK_L), axis=1)
        hit = c[None, :] == pick[:, None]
        value = tl.sum(tl.where(hit, acc, 0.0), axis=1)             # one term is nonzero: exact
        if KEEP:
            tl.store(res_ptr + offs, tl.where(hit, 0.0, acc), mask=mask)
        live = r < rows
        tl.store(idx_ptr + r, (r.to(tl.int64) * row_len + pick).to(tl.int32), mask=live)
        tl.store(val_ptr + r, value, mask=live)

    return triton, blockmax


def fused_available(flat: torch.Tensor, row: int) -> bool:
    """Whether `blockmax_fused` can take `flat` (CUDA, a float dtype, rows short enough, Triton)."""
    return (ENABLED and flat.is_cuda and flat.dtype in (torch.float32, torch.bfloat16, torch.float16) and flat.is_contiguous()
            and row <= MAX_FUSED_ROW and _kernel() is not None)


def blockmax_fused(flat: torch.Tensor, residual: torch.Tensor | None, row: int,
                   keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`blockmax_eager` of (`residual` + `flat`) in one launch, `residual` updated in place.

    `residual` (float32, n values, or None: the input is `flat` alone) is read and, with `keep`,
    overwritten with the accumulated values less the sent ones (`keep` needs a `residual`)."""
    triton, kernel = _kernel()
    n = flat.numel()
    rows = -(-n // row)
    block_l = triton.next_power_of_2(row)
    # Few rows a program, two warps: at 1% (rows of 100) 4 rows a program ran a 26 M-value bucket in
    # 0.089 ms on an H200 (2 reads and a write at ~3.5 TB/s), against 0.61 ms with 32 rows and 4 warps
    # (benchmarks/results/topk_kernels_2026-11-26_h200.json).
    block_r = max(1, 512 // block_l)
    indices = torch.empty(rows, dtype=torch.int32, device=flat.device)
    values = torch.empty(rows, dtype=torch.float32, device=flat.device)
    kernel[(triton.cdiv(rows, block_r),)](
        flat, flat if residual is None else residual, indices, values, n, rows, row,
        ACCUMULATE=residual is not None, KEEP=keep, BLOCK_R=block_r, BLOCK_L=block_l,
        num_warps=2 if block_r * block_l <= 512 else 4)
    return indices, values
