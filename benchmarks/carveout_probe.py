"""Does leaving SMs to NCCL help DDP's scaling? Our DDP on GPT-1.3B with the matmuls told to use fewer SMs
while the all-reduce runs beside the backward.

DDP at 1.3B on 4 GPUs loses about 15 ms a step to its all-reduce although the all-reduce alone takes 25 ms
and hides behind a 110 ms backward: the profile shows the backward's matmuls 11 ms slower while NCCL's
kernels run beside them. cuBLASLt takes a target SM count (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``; torch's
``torch._C._set_sm_carveout_experimental(n)`` sets it to the card's SMs minus n, for the matmuls that go
through cuBLASLt, all of them once ``torch.backends.cuda.preferred_blas_library("cublaslt")``), so the
matmuls can leave room for NCCL's CTAs instead of sharing SMs with them. Variants, interleaved over rounds
in the same processes (instance A: DDP on the world group; B: DDP on a group whose collectives use at most
16 CTAs):

* ``default``: A, torch's default BLAS choice, no carveout (what the suite's ``ours_ddp`` runs);
* ``lt``: A with cuBLASLt for every matmul, no carveout;
* ``lt_c8``, ``lt_c16``, ``lt_c32``: A, cuBLASLt, the matmuls leaving 8 / 16 / 32 SMs;
* ``ctas16_lt_c16``: B (NCCL at most 16 CTAs), cuBLASLt leaving 16 SMs;
* ``nosync`` and ``nosync_lt``: A under ``no_sync()`` (hooks, nothing sent): the compute without
  communication, the reference for the scaling.

Run: ``torchrun --nproc_per_node=4 benchmarks/carveout_probe.py --out DIR``; writes ``carveout.json`` (every
round's slowest-rank step) and prints the medians. Diagnostic, not part of the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import limited_ctas_group, make_batches, synchronize, train_steps  # noqa: E402
from distributed_training import DDP  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS  # noqa: E402

VARIANTS = {  # name -> (instance, cuBLASLt for all matmuls, SMs left to NCCL, no_sync)
    "default": ("A", False, None, False),
    "lt": ("A", True, None, False),
    "lt_c8": ("A", True, 8, False),
    "lt_c16": ("A", True, 16, False),
    "lt_c32": ("A", True, 32, False),
    "ctas16_lt_c16": ("B", True, 16, False),
    "nosync": ("A", False, None, True),
    "nosync_lt": ("A", True, None, True),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="gpt-1.3b")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny GPT: checks the script runs")
    args = p.parse_args()
    dist.init_process_group("gloo" if args.smoke else "nccl")
    rank = dist.get_rank()
    if args.smoke:
        from distributed_training.models import GPTConfig

        device = torch.device("cpu")
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16)
        args.micro, args.seq = 2, 16
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        cfg = GPT_PRESETS[args.model]
    batches = make_batches(cfg, args.micro, args.seq, device, rank)
    names = args.variants.split(",")
    if args.smoke:  # no NCCL group options, no cuBLAS on CPU
        names = [n for n in names if VARIANTS[n][0] == "A"]
    groups = {"A": None, "B": limited_ctas_group(16) if any(VARIANTS[n][0] == "B" for n in names) else None}
    built = {}
    for inst in sorted({VARIANTS[n][0] for n in names}):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        wrapped = DDP(model, process_group=groups[inst])
        built[inst] = (wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=not args.smoke))
    default_blas = None if args.smoke else torch.backends.cuda.preferred_blas_library()
    times: dict[str, list[float]] = {n: [] for n in names}
    step = 0

    def run(name: str, count: int) -> float:
        nonlocal step
        inst, lt, carveout, nosync = VARIANTS[name]
        if not args.smoke:
            torch.backends.cuda.preferred_blas_library("cublaslt" if lt else default_blas)
            torch._C._set_sm_carveout_experimental(carveout)
        wrapped, opt = built[inst]
        synchronize(device)
        dist.barrier()
        t = time.perf_counter()
        train_steps(wrapped, opt, batches, step, count, device, no_sync=nosync)
        synchronize(device)
        step += count
        return (time.perf_counter() - t) / count

    for name in names:  # warm-up: cuBLASLt heuristics, allocator
        run(name, 3)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = torch.tensor([run(name, args.steps)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item() * 1e3)
            if rank == 0:
                print(f"round {r} {name:16s} {times[name][-1]:8.2f} ms", flush=True)
    if not args.smoke:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(default_blas)
    if rank == 0:
        med = {n: statistics.median(v) for n, v in times.items()}
        ref = med.get("nosync")
        summary = {n: {"median_ms": m, "vs_default": med["default"] / m if "default" in med else None,
                       "vs_nosync": ref / m if ref else None} for n, m in med.items()}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "carveout.json"), "w") as f:
            gpu = device.type == "cuda"
            json.dump({"card": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None, "sms":
                       torch.cuda.get_device_properties(device).multi_processor_count if gpu else None,
                       "model": "tiny" if args.smoke else args.model,
                       "micro": args.micro, "seq": args.seq, "world": dist.get_world_size(),
                       "rounds_ms": times, "summary": summary}, f, indent=1)
        print(json.dumps(summary, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
