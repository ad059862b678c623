"""GPU benchmark: our DDP against torch's DistributedDataParallel on a GPT-style model.

One process per GPU (start it with torchrun). In one process the same model and the same fused
AdamW are wrapped in turn by each implementation, phase after phase, interleaved over several rounds,
so that both see the same GPU, clocks and neighbours:

    torch      torch.nn.parallel.DistributedDataParallel, default options
    torch_gav  the same with gradient_as_bucket_view=True (what ours always does)
    ours       distributed_training.DDP
    plain      the bare model, no wrapper (the 1-GPU baseline)

For each, a `*_nosync` phase runs the same steps under `no_sync()`: its step time is the compute-only
time, so `step_time - nosync_step_time` is the communication left exposed after overlap.

Writes one JSON object per world size to --out. `--summarize` merges such files into the results
file and a markdown table.

    torchrun --nproc_per_node=2 benchmarks/ddp_gpu.py --model gpt2-124m --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, synchronize, train_steps  # noqa: E402

from distributed_training import DDP, init_distributed  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m", choices=sorted(GPT_PRESETS))
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (no_sync on all but the last)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per phase (timed as one block)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--impls", default="torch,torch_gav,ours",
                   help="comma-separated: torch, torch_gav (gradient_as_bucket_view), ours; suffix _hp for a "
                        "high-priority NCCL stream (torch_hp, ours_hp); one GPU always runs plain")
    p.add_argument("--nosync", action="store_true", help="also time compute-only (no_sync) phases")
    p.add_argument("--out", default=None)
    p.add_argument("--summarize", nargs="*", default=None, help="merge result JSON files and print a table")
    p.add_argument("--results", default=None, help="with --summarize: where the merged JSON goes")
    return p.parse_args(argv)


def wrap(impl: str, model: torch.nn.Module, device: torch.device, groups: dict):
    """`impl` is a name, optionally suffixed `_hp`: then it uses the NCCL group whose streams have
    high priority, so communication kernels get SMs ahead of the backward's compute kernels."""
    base, _, variant = impl.partition("_")
    group = groups["hp"] if variant.endswith("hp") else None
    if base == "plain":
        return model
    if base == "ours":
        return DDP(model, process_group=group)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=variant.startswith("gav"),
        process_group=group,
    )


def run_phase(impl, model, opt, batches, args, device, groups, nosync=False):
    """Warm up, then time `args.steps` steps as one block (one host sync at each end, so the CPU
    runs ahead as in real training). Returns (mean step seconds, peak bytes, last loss).

    `solo`: rank 0 trains the bare model while the other ranks wait on a CPU barrier, so the 1-GPU
    baseline is measured in the same job, interleaved with the others. The peak is counted from what
    was allocated before any wrapper existed, so memory an earlier phase failed to free is not
    charged to this one."""
    if impl == "solo":
        if dist.get_rank() == 0:
            result = run_phase("plain", model, opt, batches, args, device, groups)
        else:
            result = (0.0, 0, 0.0)
        dist.barrier(group=groups["cpu"])
        return result
    stale = torch.cuda.memory_allocated() - groups["base_bytes"] if device.type == "cuda" else 0
    wrapped = wrap(impl, model, device, groups)
    no_sync = nosync and not impl.startswith("plain")
    train_steps(wrapped, opt, batches, 0, args.warmup, device, no_sync, args.accum)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = train_steps(wrapped, opt, batches, args.warmup, args.steps, device, no_sync, args.accum)
    synchronize(device)
    elapsed = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() - stale if device.type == "cuda" else 0
    if isinstance(wrapped, DDP):
        wrapped.remove_hooks()
    del wrapped
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return elapsed, peak, loss.item()


def comm_only_seconds(model, batches, device, reps: int = 5) -> float:
    """Time of reducing all of our DDP's buckets with no compute beside it: the communication that
    overlap has to hide."""
    ddp = DDP(model)
    x, y = batches[0]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = ddp(x, y)
    loss.backward()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        for handle in [ddp.bucket_reducer(b.buffer, None) for b in ddp._buckets]:
            handle.wait()
    synchronize(device)
    elapsed = (time.perf_counter() - t0) / reps
    ddp.remove_hooks()
    for p in model.parameters():
        p.grad = None
    return elapsed


def bench(args):
    ctx = init_distributed()
    device = ctx.device
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cfg = GPT_PRESETS[args.model]
    if args.seq > cfg.block_size:
        raise SystemExit(f"--seq {args.seq} exceeds the {args.model} block size {cfg.block_size}")
    micro = args.micro_batch or (16 if args.model == "gpt2-124m" else 8)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    n_params = model.num_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator(device=device).manual_seed(1234 + ctx.rank)
    batches = []
    for _ in range(4):
        idx = torch.randint(0, cfg.vocab_size, (micro, args.seq + 1), device=device, generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))

    impls = [i for i in args.impls.split(",") if i]
    if ctx.world_size == 1:
        impls = ["plain"]  # the 1-GPU baseline: no wrapper, no communication
    synchronize(device)
    groups = {"hp": None, "cpu": None, "base_bytes": torch.cuda.memory_allocated() if device.type == "cuda" else 0}
    if ctx.world_size > 1:
        groups["cpu"] = dist.new_group(backend="gloo")
    if ctx.world_size > 1 and any(i.endswith("hp") for i in impls):
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        groups["hp"] = dist.new_group(backend="nccl", pg_options=options)
    phases: dict[str, dict] = {}
    for rnd in range(args.rounds):
        order = impls if rnd % 2 == 0 else list(reversed(impls))
        for impl in order:
            step_s, peak, loss = run_phase(impl, model, opt, batches, args, device, groups)
            ph = phases.setdefault(impl, {"step_times": [], "peak_bytes": 0})
            ph["step_times"].append(step_s)
            ph["peak_bytes"] = max(ph["peak_bytes"], peak)
            ph["last_loss"] = loss
    if args.nosync and ctx.world_size > 1:
        for impl in impls:
            if impl not in ("plain", "solo") and not impl.endswith("_hp"):  # no comm: stream priority is moot
                step_s, peak, _ = run_phase(impl, model, opt, batches, args, device, groups, nosync=True)
                phases[impl + "_nosync"] = {"step_times": [step_s], "peak_bytes": peak}

    if ctx.world_size > 1:
        phases["ours_comm_only"] = {"step_times": [comm_only_seconds(model, batches, device)], "peak_bytes": 0}

    # Every rank's median; the job is as slow as its slowest rank.
    tokens_per_step = micro * args.seq * args.accum
    summary = {}
    for name, ph in phases.items():
        med = torch.tensor([statistics.median(ph["step_times"])], device=device)
        peak = torch.tensor([float(ph["peak_bytes"])], device=device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        summary[name] = {
            "median_step_s": med.item(),
            "tokens_per_s_per_gpu": tokens_per_step / med.item(),
            "peak_mem_gib": peak.item() / 2**30,
            "rank0_phase_mean_step_s": ph["step_times"],
        }
    result = {
        "model": args.model,
        "params": n_params,
        "world_size": ctx.world_size,
        "micro_batch": micro,
        "accum": args.accum,
        "seq": args.seq,
        "tokens_per_step_per_gpu": tokens_per_step,
        "steps_per_phase": args.steps,
        "rounds": args.rounds,
        "precision": "bf16 autocast, fp32 master weights, fused AdamW",
        "phases": summary,
        **environment(),
    }
    if ctx.is_main:
        text = json.dumps(result, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        for name, s in summary.items():
            print(f"{args.model} world={ctx.world_size} {name:12s} step {s['median_step_s']*1e3:8.1f} ms  "
                  f"{s['tokens_per_s_per_gpu']:9.0f} tok/s/gpu  peak {s['peak_mem_gib']:.1f} GiB", flush=True)
    ctx.shutdown()


def summarize(paths: list[str], results_path: str | None) -> None:
    runs = [json.load(open(p)) for p in paths]
    table = ["| model | GPUs | micro-batch x accum | impl | step ms | tokens/s/GPU | vs torch DDP | peak GiB | scaling vs 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    baseline = {(r["model"], r["micro_batch"], r.get("accum", 1)): r["phases"]["plain"]["tokens_per_s_per_gpu"]
                for r in runs if r["world_size"] == 1}
    derived = []
    for r in sorted(runs, key=lambda r: (r["params"], r["micro_batch"], r.get("accum", 1), r["world_size"])):
        torch_tps = r["phases"].get("torch", {}).get("tokens_per_s_per_gpu")
        for impl, s in r["phases"].items():
            tps = s["tokens_per_s_per_gpu"]
            vs = f"{tps / torch_tps:.3f}x" if torch_tps and impl.startswith(("torch", "ours")) and not impl.endswith(("nosync", "comm_only")) else ""
            base = baseline.get((r["model"], r["micro_batch"], r.get("accum", 1)))
            if "solo" in r["phases"]:  # the 1-GPU baseline measured inside this job, interleaved
                base = r["phases"]["solo"]["tokens_per_s_per_gpu"]
            comparable = r["world_size"] > 1 and impl not in ("solo", "ours_comm_only") and not impl.endswith("nosync")
            scaling = f"{100 * tps / base:.1f}%" if base and comparable else ""
            table.append(f"| {r['model']} | {r['world_size']} | {r['micro_batch']} x {r.get('accum', 1)} | {impl} | {s['median_step_s']*1e3:.1f} | {tps:,.0f} "
                         f"| {vs} | {s['peak_mem_gib']:.1f} | {scaling} |")
            if r["world_size"] > 1 and f"{impl}_nosync" in r["phases"]:
                exposed = s["median_step_s"] - r["phases"][f"{impl}_nosync"]["median_step_s"]
                derived.append(f"{r['model']} b={r['micro_batch']}x{r.get('accum', 1)} {impl}: exposed communication {exposed*1e3:.1f} ms per step "
                               f"({100*exposed/s['median_step_s']:.1f}% of the step)")
    text = "\n".join(table)
    card = runs[0].get("card") if runs else "?"
    header = (f"Card: {card}; torch {runs[0].get('torch')}, CUDA {runs[0].get('cuda')}, NCCL {runs[0].get('nccl')}, "
              f"driver {runs[0].get('driver')}; {runs[0].get('precision')}; each figure is the median over "
              f"interleaved rounds of the mean step time of {runs[0].get('steps_per_phase')} steps.")
    print(header)
    print(text)
    for line in derived:
        print("-", line)
    if results_path:
        with open(results_path, "w") as f:
            json.dump({"runs": runs, "table_markdown": text, "header": header, "exposed": derived}, f, indent=1)


if __name__ == "__main__":
    a = parse_args()
    if a.summarize is not None:
        summarize(a.summarize, a.results)
    else:
        bench(a)
