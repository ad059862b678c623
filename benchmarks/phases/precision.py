"""Mixed precision: the same GPT trained by our trainer (DDP) in fp32, bf16 autocast and fp16 autocast
with our dynamic loss scaler, from the same seed on the same batches, interleaved over rounds: median
step time, peak memory, and how far each loss curve strays from fp32's (the numerics' cost)."""

from __future__ import annotations

import statistics
import time

import torch

from common import GIB, allocated, free_memory, make_batches, peak, peak_reset, slowest, synchronize

PRECISIONS = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}
GPU_MODEL = ("gpt2-124m", 8, 1024)
SMOKE_MODEL = ("tiny", 4, 32)


def run(ctx, opts) -> dict:
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here: the reference curve
    try:
        return _run(ctx, opts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(ctx, opts) -> dict:
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPT_PRESETS

    device = ctx.device
    preset, micro, seq = (opts.models or [SMOKE_MODEL if opts.smoke else GPU_MODEL])[0]
    cfg = GPT_PRESETS[preset]
    steps = opts.steps or (3 if opts.smoke else 10)
    rounds = opts.rounds or (1 if opts.smoke else 2)
    batches = make_batches(cfg, micro, seq, device, ctx.rank, count=steps)
    fused = device.type == "cuda"
    trainers, losses, times, peaks = {}, {}, {}, {}
    for name, mp in PRECISIONS.items():
        torch.manual_seed(0)
        trainers[name] = DistributedTrainer(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused),
                                            strategy="ddp", mixed_precision=mp, context=ctx, progress=False)
        losses[name] = [float(trainers[name].train_step(b)["loss"]) for b in batches]  # warm-up, and the curve
    for rnd in range(rounds):
        for name in (list(PRECISIONS) if rnd % 2 == 0 else list(PRECISIONS)[::-1]):
            synchronize(device)
            peak_reset(device)
            in_use = allocated(device)
            t0 = time.perf_counter()
            for b in batches:
                trainers[name].train_step(b)
            synchronize(device)
            times.setdefault(name, []).append((time.perf_counter() - t0) / steps)
            peaks[name] = max(peaks.get(name, 0), peak(device) - in_use)
    rows = {}
    for name in PRECISIONS:
        step_s, transient = slowest(ctx, [statistics.median(times[name]), peaks[name]])
        rows[name] = {"step_s": step_s, "tokens_per_s_per_gpu": micro * seq / step_s, "step_peak_gib": transient / GIB,
                      "round_step_s": times[name], "loss_curve": losses[name],
                      "max_abs_loss_diff_vs_fp32": max(abs(a - b) for a, b in zip(losses[name], losses["fp32"]))}
        scaler = getattr(trainers[name], "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "scale"):
            rows[name]["final_loss_scale"] = float(scaler.scale)
        trainers[name].close()
    del trainers
    free_memory(device)
    return {"status": "ok", "model": preset, "micro_batch": micro, "seq": seq, "steps": steps, "rounds": rounds,
            "strategy": "ddp", "tf32": False, "precisions": rows,
            "note": "step_peak_gib: the most a step allocates on top of what stays resident" +
                    ("" if device.type == "cuda" else " (0 on CPU: not tracked)")}
