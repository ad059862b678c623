"""GPU benchmark: our ZeRO-1/2/3 against torch FSDP2 (`fully_shard` per block) and torch DDP.

Every implementation trains a freshly built copy of the same GPT (seeded) in the same processes,
phase after phase, interleaved over rounds; bf16 compute, fp32 master weights, fused AdamW:

    torch_ddp   torch.nn.parallel.DistributedDataParallel, bf16 autocast
    ours_ddp    distributed_training.DDP, bf16 autocast
    torch_fsdp2 fully_shard per block and root, MixedPrecisionPolicy(bf16 params, fp32 reduce)
    zero3       our FSDP, MixedPrecision(bf16, fp32), reshard_after_forward=True
    zero2       the same with reshard_after_forward=False
    zero1       our DDP + optimizer state sharded (Zero1Strategy)

    torchrun --nproc_per_node=2 benchmarks/fsdp_gpu.py --model gpt-1.3b --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import GIB, environment, run_phase, synchronize  # noqa: E402

from distributed_training import init_distributed  # noqa: E402
from distributed_training.planner import state_bytes  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS  # noqa: E402


def model_state_gib(impl: str, params: int, world: int, largest_unit: int) -> float:
    """Per-rank GiB of fp32 weights, gradients and Adam's two moments as each scheme divides them, plus
    what it keeps unsharded in bf16 (the planner's formulas)."""
    kind = "ddp" if impl in ("torch_ddp", "ours_ddp") else "zero3" if impl == "torch_fsdp2" else impl
    return state_bytes(kind, params, world, largest_unit_params=largest_unit) / GIB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-1.3b", choices=sorted(GPT_PRESETS))
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--impls", default="torch_ddp,ours_ddp,torch_fsdp2,zero3,zero2,zero1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    ctx = init_distributed()
    device = ctx.device
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPT_PRESETS[args.model]
    g = torch.Generator(device=device).manual_seed(1234 + ctx.rank)
    batches = []
    for _ in range(4):
        idx = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), device=device, generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    with torch.device("meta"):
        meta = GPT(cfg)
    params = meta.num_parameters()
    largest_unit = max(sum(p.numel() for p in b.parameters()) for b in meta.blocks)
    largest_unit = max(largest_unit, params - sum(sum(p.numel() for p in b.parameters()) for b in meta.blocks))

    impls = [i for i in args.impls.split(",") if i]
    synchronize(device)
    base_bytes = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    results: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for impl in (impls if rnd % 2 == 0 else impls[::-1]):
            ph = run_phase(impl, cfg, batches, args.warmup, args.steps, device, ctx, base_bytes)
            step_s, peak, leftover, loss = ph["step_s"], ph["peak_bytes"], ph["leftover_bytes"], ph["loss"]
            r = results.setdefault(impl, {"step_s": [], "peaks": [], "leftover": [], "loss": loss})
            r["step_s"].append(step_s)
            r["peaks"].append(peak)
            r["leftover"].append(leftover)
            if ctx.is_main:
                print(f"round {rnd} {impl:12s} {step_s * 1e3:8.1f} ms  peak {peak / GIB:6.1f} GiB  "
                      f"left {leftover / GIB:5.2f} GiB  loss {loss:.4f}", flush=True)
    tokens = args.micro_batch * args.seq
    summary = {}
    for impl, r in results.items():
        t = torch.tensor([statistics.median(r["step_s"]), float(max(r["peaks"]))], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        summary[impl] = {
            "median_step_s": t[0].item(),
            "tokens_per_s_per_gpu": tokens / t[0].item(),
            "peak_mem_gib": t[1].item() / GIB,
            "model_state_formula_gib": model_state_gib(impl, params, ctx.world_size, largest_unit),
            "rank0_round_step_s": r["step_s"],
            "rank0_round_peak_gib": [p / GIB for p in r["peaks"]],
            "rank0_leftover_gib": [b / GIB for b in r["leftover"]],
            "last_loss": r["loss"],
        }
    base = summary.get("torch_ddp", {}).get("tokens_per_s_per_gpu")
    fsdp2 = summary.get("torch_fsdp2", {})
    lines = ["| impl | step ms | tokens/s/GPU | vs torch DDP | peak GiB | model-state formula GiB |", "|---|---|---|---|---|---|"]
    for impl, s in summary.items():
        vs = f"{s['tokens_per_s_per_gpu'] / base:.3f}x" if base else ""
        lines.append(f"| {impl} | {s['median_step_s'] * 1e3:.1f} | {s['tokens_per_s_per_gpu']:,.0f} | {vs} | "
                     f"{s['peak_mem_gib']:.1f} | {s['model_state_formula_gib']:.1f} |")
    table = "\n".join(lines)
    result = {"model": args.model, "params": params, "world_size": ctx.world_size, "micro_batch": args.micro_batch,
              "seq": args.seq, "steps": args.steps, "rounds": args.rounds,
              "precision": "bf16 compute (autocast for DDP; bf16 params, fp32 reduce for FSDP/ZeRO-2/3), fp32 master, fused AdamW",
              "phases": summary, "table_markdown": table, **environment()}
    if ctx.is_main:
        print(table)
        if fsdp2:
            z3 = summary.get("zero3", {})
            print(f"zero3 peak {z3.get('peak_mem_gib', 0):.1f} GiB vs torch FSDP2 {fsdp2['peak_mem_gib']:.1f} GiB")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    ctx.shutdown()


if __name__ == "__main__":
    main()
