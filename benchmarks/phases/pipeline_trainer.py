"""Pipeline parallelism through the trainer (`DistributedTrainer(pipeline_parallel_size=P, ...)`), against
our DDP trainer on the same GPT, the same global batches and the same initial weights: tokens/s per
GPU, the most memory a rank holds, and how far each loss curve strays from DDP's.

Configurations at world W: DDP (P=1); P=2 with GPipe, 1F1B and interleaved 1F1B (2 chunks per rank);
at W >= 4 also P=4 1F1B and, when W > P, the data-parallel replicas of each pipeline (P x DP); and at
P=2 x DP>1, 1F1B with ZeRO-1, ZeRO-2 and ZeRO-3 inside the stages instead of DDP (memory per rank
falls, the loss curve stays DDP's).

``--variants big`` runs instead a GPT too large for one GPU under DDP (`_run_big`): 32 layers of width
4096 (about 6.7B parameters; 48 layers, about 9.9B, where a GPU holds more than 16 bytes x 6.7B), built
on the meta device and handed to the trainer, so that each rank materialises only its own stage; P =
the world size, bf16 autocast, AdamW (fused on CUDA), 1F1B with 8 microbatches of one 1024-token
sequence. Recorded per rank (stage): parameters, peak device memory, peak host RSS; and tokens/s per
GPU, the losses, and DDP's 16 bytes per parameter against the GPU's memory."""

from __future__ import annotations

import statistics
import time

import torch

from common import GIB, allocated, free_memory, peak, peak_reset, slowest, synchronize

GPU_MODEL = ("gpt2-124m", 16, 1024)  # preset, global batch (sequences per step), sequence length
SMOKE_MODEL = ("tiny", 8, 32)
MICROBATCHES = 8


def _configs(world: int, smoke: bool = False) -> list[tuple[str, int, str, str]]:
    configs = [("ddp", 1, "1f1b", "ddp")]
    for P in (2, 4):
        if P <= world and world % P == 0:
            schedules = ("gpipe", "1f1b", "interleaved_1f1b") if P == 2 else ("1f1b",)
            configs += [(f"P{P}xDP{world // P} {s}", P, s, "ddp") for s in schedules]
    if (world > 2 or smoke) and world % 2 == 0:  # the smoke run (2 processes) still runs their code
        configs += [(f"P2xDP{world // 2} 1f1b {z}", 2, "1f1b", z) for z in ("zero1", "zero2", "zero3")]
    return configs


def run(ctx, opts) -> dict:
    if "big" in (opts.variants or "").split(","):
        return _run_big(ctx, opts)
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
    for name, P, schedule, strategy in _configs(ctx.world_size, opts.smoke):
        torch.manual_seed(0)
        kwargs = {} if P == 1 else dict(pipeline_parallel_size=P, pipeline_schedule=schedule,
                                        microbatches=MICROBATCHES if global_batch // (ctx.world_size // P) >= MICROBATCHES
                                        else P * (2 if schedule == "interleaved_1f1b" else 1))
        trainer = DistributedTrainer(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-4), strategy=strategy,
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
        rows[name] = {"pipeline_parallel_size": P, "schedule": schedule if P > 1 else None, "strategy": strategy,
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


# ------------------------------------------------------------------ --variants big
BIG_WIDTH = dict(n_head=32, n_embd=4096, vocab_size=50304, block_size=1024)
BIG_SEQ = 1024
BIG_MICROBATCHES = 8  # of one sequence each: the global batch is 8 x 1024 tokens
DDP_BYTES_PER_PARAM = 16  # fp32 weight 4 + gradient 4 + AdamW's two moments 8, before any activation


def _big_config(device):
    """The 32-layer GPT (about 6.7B parameters), or 48 layers (about 9.9B) on a GPU that would hold
    the 32-layer one's 16 bytes per parameter (H200): too large for one GPU under DDP either way.
    CPU (smoke): a tiny one."""
    from distributed_training.models import GPTConfig

    if device.type != "cuda":
        return GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32), 32
    total = torch.cuda.get_device_properties(device).total_memory
    for n_layer in (32, 40, 48, 64):
        cfg = GPTConfig(n_layer=n_layer, **BIG_WIDTH)
        if DDP_BYTES_PER_PARAM * _gpt_params(cfg) > total:
            return cfg, BIG_SEQ
    return cfg, BIG_SEQ


def _gpt_params(cfg) -> int:
    block = 12 * cfg.n_embd ** 2 + 13 * cfg.n_embd  # qkv, proj, 2 MLP layers, their biases, 2 LayerNorms
    return cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd + cfg.n_layer * block + 2 * cfg.n_embd


def _peak_rss_bytes() -> int:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _run_big(ctx, opts) -> dict:
    import torch.distributed as dist

    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT

    device = ctx.device
    cuda = device.type == "cuda"
    P = ctx.world_size
    cfg, seq = _big_config(device)
    steps = opts.steps or (2 if opts.smoke else 3)
    warmup = 1 if opts.smoke else 2
    total_params = _gpt_params(cfg)
    rss_before = _peak_rss_bytes()
    peak_reset(device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only: no rank ever holds the whole model
    assert sum(p.numel() for p in model.parameters()) == total_params
    trainer = DistributedTrainer(
        model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=cuda), strategy="ddp",
        mixed_precision="bf16" if cuda else None, context=ctx, progress=False, seed=0,
        pipeline_parallel_size=P, pipeline_schedule="1f1b", microbatches=BIG_MICROBATCHES,
        pipeline_balance="compute")  # a wide model: the GPU bounds its step
    synchronize(device)
    setup_s = time.perf_counter() - t0
    stage_params = sum(p.numel() for p in trainer.module.parameters())
    g = torch.Generator(device=device).manual_seed(1234)  # the same batches on every rank of the pipeline
    tokens = [torch.randint(0, cfg.vocab_size, (BIG_MICROBATCHES, seq + 1), device=device, generator=g)
              for _ in range(warmup + steps)]
    losses, times = [], []
    for i, t in enumerate(tokens):
        start = time.perf_counter()
        losses.append(float(trainer.train_step((t[:, :-1].contiguous(), t[:, 1:].contiguous()))["loss"]))
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    mine = [float(stage_params), float(peak(device)), float(_peak_rss_bytes()), float(rss_before),
            statistics.median(times)]
    where = device if ctx.backend == "nccl" else torch.device("cpu")
    gathered = [torch.zeros(len(mine), dtype=torch.float64, device=where) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64, device=where))
    per_rank = [r.tolist() for r in gathered]
    trainer.close()
    del trainer, model
    free_memory(device)
    step_s = max(r[4] for r in per_rank)
    gpu_total = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    ddp_bytes = DDP_BYTES_PER_PARAM * total_params
    whole_fp32 = 4 * total_params
    return {
        "status": "ok", "mode": "big",
        "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "vocab_size": cfg.vocab_size,
                  "seq": seq, "parameters": total_params},
        "pipeline_parallel_size": P, "schedule": "1f1b", "microbatches": BIG_MICROBATCHES,
        "global_batch_tokens": BIG_MICROBATCHES * seq, "mixed_precision": "bf16" if cuda else "fp32",
        "optimizer": "AdamW (fused)" if cuda else "AdamW", "steps": steps, "setup_s": setup_s,
        "step_s": step_s, "tokens_per_s_per_gpu": BIG_MICROBATCHES * seq / step_s / ctx.world_size,
        "losses": losses,
        "stages": [{"rank": r, "parameters": int(row[0]), "peak_allocated_gib": row[1] / GIB,
                    "peak_rss_gib": row[2] / GIB, "rss_before_gib": row[3] / GIB} for r, row in enumerate(per_rank)],
        "whole_model_fp32_gib": whole_fp32 / GIB,
        "ddp_estimate_gib": ddp_bytes / GIB, "gpu_memory_gib": gpu_total / GIB,
        "fits_one_gpu_under_ddp": bool(cuda and ddp_bytes <= gpu_total) if cuda else None,
        # On CPU (smoke) the stage itself lives in host memory and the model is tiny: not a measure.
        "no_rank_held_the_whole_model": (all(row[2] < whole_fp32 for row in per_rank) and all(
            row[0] < total_params for row in per_rank)) if cuda else None,
        "note": "parameters per stage: the tied embedding counts on both the first and the last stage; "
                "peak_rss_gib: the process's peak resident host memory (whole run of the worker); "
                "ddp_estimate_gib: 16 bytes per parameter (fp32 weight, gradient, AdamW moments), before activations"
                + ("" if cuda else "; CPU smoke: tiny model, no device memory tracked"),
    }
