"""What PowerSGD's compression costs a training step, per weight matrix against the whole bucket as one.

Our DDP on GPT-1.3B (bf16 autocast, fused AdamW, micro-batch 8 x 1024), one process: the step with
nothing to send (``dense``: DDP alone in its world reduces nothing), with PowerSGD rank 4 per weight
matrix (``per_matrix``: what `CommunicationOptimizer("powersgd")` does since session 33) and with each
bucket compressed as one near-square matrix (``whole_bucket``: the earlier form, kept here by a reducer
that ignores DDP's bucket layout). One GPU has no collective to hide, so the difference from ``dense`` is
compression and decoding alone: the compute PowerSGD adds to every rank's step. Also the bytes each form
puts on the wire per step. Variants alternate over rounds, each built afresh (one 1.3B model at a time).
The reference: torch's DDP alone (``torch_dense``) and with its PowerSGD hook at rank 4 (``torch_hook``:
error feedback, warm start, compressing from the third step), whose difference is what torch's form adds.

Run: ``torchrun --nproc_per_node=1 benchmarks/powersgd_cost.py --out DIR``; writes ``powersgd_cost.json``.
``--smoke``: CPU, gloo, a tiny GPT.
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import make_batches, synchronize, train_steps  # noqa: E402
from distributed_training import DDP, CommunicationOptimizer  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS, GPTConfig  # noqa: E402


class WholeBucket(CommunicationOptimizer):
    """PowerSGD with every bucket as one matrix: the layout DDP hands over is ignored."""

    def set_bucket_layout(self, layouts) -> None:
        pass


def build(variant: str, cfg, device, smoke: bool):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    if variant in ("torch_dense", "torch_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=None if smoke else [device.index])
        if variant == "torch_hook":
            state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            wrapped.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=not smoke), None
    comm = None if variant == "dense" else (WholeBucket if variant == "whole_bucket" else CommunicationOptimizer)(
        "powersgd", powersgd_rank=4)
    wrapped = DDP(model, communication=comm)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=not smoke), comm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--profile", action="store_true", help="after the rounds: the per-matrix step's top ops")
    p.add_argument("--variants", default="dense,per_matrix,whole_bucket",
                   help="comma-separated, from dense, per_matrix, whole_bucket, torch_dense, torch_hook")
    args = p.parse_args()
    dist.init_process_group("gloo" if args.smoke else "nccl")
    if args.smoke:
        device, micro, seq = torch.device("cpu"), 2, 16
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16)
    else:
        device, micro, seq = torch.device("cuda", 0), 8, 1024
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        cfg = GPT_PRESETS["gpt-1.3b"]
    batches = make_batches(cfg, micro, seq, device, 0)
    variants = tuple(args.variants.split(","))
    known = ("dense", "per_matrix", "whole_bucket", "torch_dense", "torch_hook")
    if not variants or variants[0] != "dense" or set(variants) - set(known):
        p.error(f"--variants: 'dense' first, then any of {', '.join(known[1:])}; got {args.variants!r}")
    times: dict[str, list[float]] = {v: [] for v in variants}
    sent: dict[str, float] = {}
    peak: dict[str, float] = {}
    for _ in range(args.rounds):
        for variant in variants:
            wrapped, opt, comm = build(variant, cfg, device, args.smoke)
            train_steps(wrapped, opt, batches, 0, 3, device, no_sync=False)  # warm-up, DDP's bucket rebuild
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            before = comm.bytes_sent if comm is not None else 0
            t = time.perf_counter()
            train_steps(wrapped, opt, batches, 3, args.steps, device, no_sync=False)
            synchronize(device)
            times[variant].append((time.perf_counter() - t) / args.steps * 1e3)
            sent[variant] = ((comm.bytes_sent - before) / args.steps) if comm is not None else 0.0
            if device.type == "cuda":
                peak[variant] = torch.cuda.max_memory_allocated(device) / 2**30
            print(f"[powersgd_cost] {variant}: {times[variant][-1]:.1f} ms/step, {sent[variant] / 1e6:.2f} MB sent/step",
                  flush=True)
            del wrapped, opt, comm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for variant in [v for v in ("per_matrix", "torch_hook") if args.profile and v in variants]:
        from torch.profiler import ProfilerActivity, profile  # where a form's time goes: its ops by time

        wrapped, opt, comm = build(variant, cfg, device, args.smoke)
        train_steps(wrapped, opt, batches, 0, 3, device, no_sync=False)
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            train_steps(wrapped, opt, batches, 3, 2, device, no_sync=False)
            synchronize(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"[powersgd_cost] profile of {variant}, 2 steps:", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
        del wrapped, opt, comm
        gc.collect()
    result = {"model": "tiny" if args.smoke else "gpt-1.3b", "micro": micro, "seq": seq, "rank": 4,
              "rounds": args.rounds, "steps": args.steps, "step_ms": times,
              "median_ms": {v: statistics.median(t) for v, t in times.items()},
              "bytes_sent_per_step": sent, "peak_gib": peak,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    med = result["median_ms"]
    result["added_ms"] = {v: med[v] - med["torch_dense" if v == "torch_hook" and "torch_dense" in med else "dense"]
                          for v in variants[1:]}
    print(json.dumps({k: result[k] for k in ("median_ms", "added_ms", "bytes_sent_per_step", "peak_gib")}, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "powersgd_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
