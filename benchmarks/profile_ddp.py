"""Where a DDP step's time goes: GPU kernel time by category, per implementation, under torch.profiler.

    torchrun --nproc_per_node=2 benchmarks/profile_ddp.py --model gpt-1.3b --micro-batch 8 --out prof.json

For `plain` (no wrapper, no communication), `ours_nosync` (our hooks, no communication), `ours` and
`torch`, profiles a few steps after warm-up and sums CUDA kernel time into: matmul, attention,
nccl, copy (gradient copies into buckets and other copies), optimizer, other elementwise. Rank 0
writes the JSON and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training import DDP, init_distributed  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS  # noqa: E402

CATEGORIES = (
    ("nccl", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")),
    ("copy", ("copy", "memcpy", "cat", "fill")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def step(wrapped, opt, x, y, no_sync):
    with wrapped.no_sync() if no_sync else contextlib.nullcontext():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = wrapped(x, y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-1.3b", choices=sorted(GPT_PRESETS))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = init_distributed()
    dev = ctx.device
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(GPT_PRESETS[args.model])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, model.cfg.vocab_size, (args.micro_batch, 1025), device=dev)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    report = {}
    for impl in ("plain", "ours_nosync", "ours", "torch"):
        if impl == "plain":
            wrapped = model
        elif impl.startswith("ours"):
            wrapped = DDP(model)
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
        no_sync = impl.endswith("nosync")
        for _ in range(3):
            step(wrapped, opt, x, y, no_sync)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(wrapped, opt, x, y, no_sync)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.steps
        by_cat: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                us = evt.device_time_total
                by_cat[category(evt.name)] += us / 1e3 / args.steps
                top[evt.name[:90]] += us / 1e3 / args.steps
        hook_cpu = sum(e.cpu_time_total for e in prof.key_averages() if "hook" in e.key.lower()) / 1e3 / args.steps
        report[impl] = {
            "wall_ms_profiled": wall * 1e3,
            "kernel_ms_by_category": dict(by_cat),
            "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]),
            "python_hook_cpu_ms": hook_cpu,
        }
        if isinstance(wrapped, DDP):
            wrapped.remove_hooks()
        del wrapped
        gc.collect()
        torch.cuda.empty_cache()
    if ctx.is_main:
        cats = ["matmul", "attention", "nccl", "copy", "optimizer", "other"]
        print(f"{'impl':12s} {'wall':>7s} " + " ".join(f"{c:>9s}" for c in cats) + "   (ms per step; kernel time)")
        for impl, r in report.items():
            k = r["kernel_ms_by_category"]
            print(f"{impl:12s} {r['wall_ms_profiled']:7.1f} " + " ".join(f"{k.get(c, 0.0):9.1f}" for c in cats))
        for impl, r in report.items():
            print(impl, "top:", json.dumps({n: round(v, 2) for n, v in list(r["top_kernels_ms"].items())[:6]}))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "micro_batch": args.micro_batch, "card": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                           "report": report}, f, indent=1)
    ctx.shutdown()


if __name__ == "__main__":
    main()
