"""Top-K compression's selection on one device: milliseconds of `CommunicationOptimizer.compress_topk`
(selection, gather of the values, error-feedback residual) for each `topk_select` method (exact,
chunked, sampled) at 1% density, for buckets of 1, 6.5 and 26 M fp32 values (DDP's first bucket, a
25 MiB bucket, a 100 MiB one), and for GPT-2 124M's and a 1.3B model's whole gradients split into
25 MiB buckets: the selection cost of one step. The smoke run uses small buckets and a small model."""

from __future__ import annotations

import torch

from common import MB, free_memory, time_median_ms

METHODS = ("exact", "chunked", "sampled")
GPU_BUCKETS = (1 << 20, 25 * MB // 4, 100 * MB // 4)
GPU_GRADIENTS = (("gpt2_124m", 124_439_808), ("gpt_1.3b", 1_315_575_808))
SMOKE_BUCKETS = (1 << 12, 1 << 15)
SMOKE_GRADIENTS = (("tiny", 3 * (1 << 15) + 123),)


def run(ctx, opts) -> dict:
    from distributed_training import CommunicationOptimizer

    device = ctx.device
    ratio = opts.topk_ratio
    buckets = SMOKE_BUCKETS if opts.smoke else GPU_BUCKETS
    bucket = (1 << 15) if opts.smoke else 25 * MB // 4
    result = {"status": "ok", "ratio": ratio, "bucket_values": bucket, "buckets": {}, "step_ms": {}}
    for n in buckets:
        grad = torch.randn(n, device=device)
        row = {}
        for method in METHODS:
            comm = CommunicationOptimizer("topk", compression_ratio=ratio, topk_select=method)
            row[method] = time_median_ms(lambda: comm.compress_topk(grad, key=0), device)
        result["buckets"][str(n)] = row
        print(f"[topk] {n:>10d} values: " + "  ".join(f"{k} {v:7.2f} ms" for k, v in row.items()), flush=True)
    for name, total in (SMOKE_GRADIENTS if opts.smoke else GPU_GRADIENTS):
        sizes = [bucket] * (total // bucket) + ([total % bucket] if total % bucket else [])
        grads = [torch.randn(s, device=device) for s in sizes]
        step = {}
        for method in METHODS:
            comm = CommunicationOptimizer("topk", compression_ratio=ratio, topk_select=method)
            step[method] = time_median_ms(lambda: [comm.compress_topk(g, key=i) for i, g in enumerate(grads)], device,
                                          repeat=3)
        result["step_ms"][name] = {"params": total, **step}
        print(f"[topk] {name} gradient, per step: " + "  ".join(f"{k} {v:7.2f} ms" for k, v in step.items()),
              flush=True)
        grads.clear()  # free this model's gradients before the next
        free_memory(device)
    return result
