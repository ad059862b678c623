"""Pipeline parallelism through the trainer (`DistributedTrainer(pipeline_parallel_size=P, ...)`), against
our DDP trainer on the same GPT, the same global batches and the same initial weights: tokens/s per
GPU, the most memory a rank holds, and how far each loss curve strays from DDP's.

Configurations at world W: DDP (P=1); P=2 with GPipe, 1F1B and interleaved 1F1B (2 chunks per rank);
at W >= 4 also P=4 1F1B and, when W > P, the data-parallel replicas of each pipeline (P x DP)."""

from __future__ import annotations

import statistics
import time

import torch

from common import GIB, allocated, free_memory, peak, peak_reset, slowest, synchronize

GPU_MODEL = ("gpt2-124m", 16, 1024)  # preset, global batch (sequences per step), sequence length
SMOKE_MODEL = ("tiny", 8, 32)
MICROBATCHES = 8


def _configs(world: int) -> list[tuple[str, int, str]]:
    configs = [("ddp", 1, "1f1b")]
    for P in (2, 4):
        if P <= world and world % P == 0:
            schedules = ("gpipe", "1f1b", "interleaved_1f1b") if P == 2 else ("1f1b",)
            configs += [(f"P{P}xDP{world // P} {s}", P, s) for s in schedules]
    return configs


def run(ctx, opts) -> dict:
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPT_PRESETS

    device = ctx.device
    preset, global_batch, seq = (opts.models or [SMOKE_MODEL if opts.smoke else GPU_MODEL])[0]
    cfg = GPT_PRESETS[preset]
    steps = opts.steps or (2 if opts.smoke else 6)
    warmup = 1 if opts.smoke else 2
    g = torch.Generator(device=device).manual_seed(1234)  # the same global batches on every rank
    tokens = [torch.randint(0, cfg.vocab_size, (global_batch, seq + 1), device=device, generator=g)
              for _ in range(warmup + steps)]
    mixed = "bf16" if device.type == "cuda" else None
    rows, curves = {}, {}
    for name, P, schedule in _configs(ctx.world_size):
        torch.manual_seed(0)
        kwargs = {} if P == 1 else dict(pipeline_parallel_size=P, pipeline_schedule=schedule,
                                        microbatches=MICROBATCHES if global_batch // (ctx.world_size // P) >= MICROBATCHES
                                        else P * (2 if schedule == "interleaved_1f1b" else 1))
        trainer = DistributedTrainer(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-4), strategy="ddp",
                                     mixed_precision=mixed, context=ctx, progress=False, **kwargs)
        dp, d = trainer.dp_world_size, trainer.dp_rank
        per = global_batch // dp
        batches = [(t[d * per:(d + 1) * per, :-1].contiguous(), t[d * per:(d + 1) * per, 1:].contiguous())
                   for t in tokens]
        losses = []
        for b in batches[:warmup]:
            losses.append(trainer.train_step(b)["loss"])
        synchronize(device)
        peak_reset(device)
        in_use = allocated(device)
        times = []
        for b in batches[warmup:]:
            t0 = time.perf_counter()
            losses.append(trainer.train_step(b)["loss"])
            synchronize(device)
            times.append(time.perf_counter() - t0)
        # Every replica's loss is its own batch's: the mean over replicas is the global batch's.
        curve = torch.stack([l.float() for l in losses]).to(device if ctx.backend == "nccl" else "cpu")
        if ctx.world_size > 1:
            torch.distributed.all_reduce(curve)
            curve /= ctx.world_size  # every rank of a replica holds the same loss
        step_s, held = slowest(ctx, [statistics.median(times), peak(device)])
        curves[name] = curve.tolist()
        rows[name] = {"pipeline_parallel_size": P, "schedule": schedule if P > 1 else None,
                      "microbatches": kwargs.get("microbatches"), "step_s": step_s,
                      "tokens_per_s_per_gpu": global_batch * seq / step_s / ctx.world_size,
                      "peak_gib": held / GIB, "resident_gib_before_step": in_use / GIB, "loss_curve": curves[name]}
        trainer.close()
        del trainer
        free_memory(device)
    for name, row in rows.items():
        row["max_abs_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(curves[name], curves["ddp"]))
        row["speed_vs_ddp"] = row["tokens_per_s_per_gpu"] / rows["ddp"]["tokens_per_s_per_gpu"]
    return {"status": "ok", "model": preset, "global_batch": global_batch, "seq": seq, "steps": steps,
            "mixed_precision": mixed or "fp32", "configs": rows,
            "note": "loss curves: mean over ranks of the step's loss (the global batch's); peak_gib: max over ranks"
                    + ("" if device.type == "cuda" else " (0 on CPU: not tracked)")}
