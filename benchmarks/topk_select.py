"""Time of Top-K compression's selection on one GPU: exact top-k against per-chunk top-k.

    python benchmarks/topk_select.py --out topk.json

For buckets of 1, 6.5 and 26 M fp32 values (DDP's first bucket, a 25 MiB bucket, a 100 MiB one) at
1% density: milliseconds of `CommunicationOptimizer.compress_topk` (selection, gather of values,
error-feedback residual) for each `topk_select` method (exact, chunked, sampled), and the same for
GPT-2 124M's and a 1.3B model's whole gradients split into 25 MiB buckets: the cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training import CommunicationOptimizer  # noqa: E402


def time_ms(fn, repeat: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "ratio": args.ratio, "buckets": {}}
    methods = ("exact", "chunked", "sampled")
    for n in (1 << 20, 25 * (1 << 20) // 4, 100 * (1 << 20) // 4):
        grad = torch.randn(n, device=dev)
        row = {}
        for method in methods:
            comm = CommunicationOptimizer("topk", compression_ratio=args.ratio, topk_select=method)
            row[method] = time_ms(lambda: comm.compress_topk(grad, key=0))
        result["buckets"][n] = row
        print(f"{n:>10d} values: " + "  ".join(f"{k} {v:7.2f} ms" for k, v in row.items()), flush=True)
    # Whole gradients in 25 MiB buckets: the selection cost of one step.
    for name, total in (("gpt2_124m", 124_439_808), ("gpt_1.3b", 1_315_575_808)):
        bucket = 25 * (1 << 20) // 4
        sizes = [bucket] * (total // bucket) + ([total % bucket] if total % bucket else [])
        grads = [torch.randn(s, device=dev) for s in sizes]
        step = {}
        for method in methods:
            comm = CommunicationOptimizer("topk", compression_ratio=args.ratio, topk_select=method)
            step[method] = time_ms(lambda: [comm.compress_topk(g, key=i) for i, g in enumerate(grads)], repeat=3)
        result[f"{name}_step_ms"] = step
        print(f"{name} gradient, per step: " + "  ".join(f"{k} {v:7.2f} ms" for k, v in step.items()), flush=True)
        grads.clear()  # free this model's gradients before the next
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
