"""GPT training: our DDP, ZeRO-1/2/3 and compressed DDP against torch's DDP and FSDP2, in the same
processes, a freshly seeded model per phase, interleaved over rounds (reversed every other round) so
every implementation sees the same GPU, clocks and neighbours.

At world 1: the bare model (forward, backward and optimizer also timed apart, for the scaling model)
and each of our strategies with nothing to send (their own overhead). At world >= 2 also: ``solo``
(rank 0 trains the bare model while the others wait: the 1-GPU baseline inside the same job),
``<impl>_nosync`` for the DDPs (the same steps under ``no_sync``: compute only, so exposed
communication = step - nosync step), and ``ours_comm_only`` (every bucket of our DDP all-reduced with no
compute beside it: the communication overlap has to hide).

Each figure is the median over rounds of a phase's mean step time, the slowest rank's; peak memory is
counted from what was allocated before the phase (net of what earlier phases left behind)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from common import (GIB, allocated, autocast, build, gpt_units, make_batches, make_groups, run_phase, run_solo, slowest,
                    split_group_suffix, synchronize, teardown, time_compute_and_optimizer)

GPU_MODELS = [("gpt2-124m", 16, 1024), ("gpt-1.3b", 8, 1024)]
SMOKE_MODELS = [("tiny", 4, 32)]
DEFAULT_IMPLS = ["torch_ddp", "torch_ddp_gav", "ours_ddp", "zero1", "zero2", "zero3", "torch_fsdp2", "ddp_bf16",
                 "ddp_topk", "ddp_powersgd"]
NOSYNC = ("torch_ddp", "ours_ddp")


def model_state_gib(impl: str, params: int, world: int, largest_unit: int) -> float | None:
    """Per-rank GiB of fp32 weights, gradients and Adam's moments as each scheme divides them, plus what
    it keeps unsharded in bf16 (the planner's formulas); None where the planner has no formula."""
    from distributed_training.planner import state_bytes

    kind = ("ddp" if impl.startswith(("torch_ddp", "ours_ddp", "ddp_", "plain", "solo")) else
            "zero3" if impl == "torch_fsdp2" else impl)
    if kind not in ("ddp", "zero1", "zero2", "zero3"):
        return None
    return state_bytes(kind, params, world, largest_unit_params=largest_unit) / GIB


def comm_only_seconds(cfg, batches, device, ctx, reps: int = 5) -> float:
    """Seconds to reduce every bucket of our DDP once, with no compute beside it."""
    ddp, opt = build("ours_ddp", cfg, device, ctx)
    x, y = batches[0]
    with autocast(device):
        loss = ddp(x, y)
    loss.backward()  # buckets in their final (observed) order
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        for handle in [ddp.bucket_reducer(b.buffer, None) for b in ddp._buckets]:
            handle.wait()
    synchronize(device)
    elapsed = (time.perf_counter() - t0) / reps
    teardown(ddp)
    del ddp, opt, loss
    return elapsed


def run(ctx, opts) -> dict:
    device, world = ctx.device, ctx.world_size
    rounds = opts.rounds or (1 if opts.smoke else 2)
    steps = opts.steps or (1 if opts.smoke else 10)
    warmup = 1 if opts.smoke else 3
    accum = opts.accum
    requested = [i for i in (opts.impls or ",".join(DEFAULT_IMPLS)).split(",") if i]
    notes = {}
    if world == 1:  # the baseline, and each of our strategies' own overhead with nothing to send
        impls = ["plain"] + [i for i in requested if not i.startswith("torch") and split_group_suffix(i)[1] is None]
    else:
        impls = ["solo"] + requested
    groups = {"cpu": None}
    if world > 1:
        groups["cpu"] = dist.new_group(backend="gloo")
        made, notes = make_groups(impls, ctx.backend)
        groups.update(made)
        impls = [i for i in impls if split_group_suffix(i)[1] in (None, *made)]
        if ctx.backend != "nccl" and "torch_ddp_bf16" in impls:  # torch's bf16 hook needs NCCL
            notes["torch_ddp_bf16"] = "torch's bf16 compression hook needs NCCL: not measured on " + ctx.backend
            impls.remove("torch_ddp_bf16")
    models = {}
    for preset, micro, seq in opts.models or (SMOKE_MODELS if opts.smoke else GPU_MODELS):
        models[preset] = _train_model(ctx, preset, micro, seq, impls, rounds, steps, warmup, accum, groups)
    return {"status": "ok", "rounds": rounds, "steps_per_phase": steps, "warmup": warmup, "accum": accum,
            "precision": ("bf16 autocast (DDP) / bf16 params with fp32 reduce (ZeRO-2/3, FSDP2), fp32 master "
                          "weights, fused AdamW" if device.type == "cuda" else "fp32 (CPU)"),
            "notes": notes, "models": models}


def _train_model(ctx, preset, micro, seq, impls, rounds, steps, warmup, accum, groups) -> dict:
    from distributed_training.models import GPT_PRESETS

    device, world = ctx.device, ctx.world_size
    cfg = GPT_PRESETS[preset]
    if seq > cfg.block_size:
        raise ValueError(f"training: sequence {seq} exceeds {preset}'s block size {cfg.block_size}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    batches = make_batches(cfg, micro, seq, device, ctx.rank)
    synchronize(device)
    base = allocated(device)
    sizes = gpt_units(cfg)
    entry = {"params": sizes["params"], "micro_batch": micro, "accum": accum, "seq": seq,
             "tokens_per_step_per_gpu": micro * seq * accum, "phases": {}}
    if world == 1:
        entry["profile"] = time_compute_and_optimizer(cfg, batches, warmup, steps, device)

    def one(impl, no_sync=False):
        if impl == "solo":
            return run_solo(ctx, groups["cpu"], lambda: run_phase("plain", cfg, batches, warmup, steps, device, ctx,
                                                                  base, accum=accum)) or {}
        return run_phase(impl, cfg, batches, warmup, steps, device, ctx, base, no_sync=no_sync, accum=accum,
                         groups=groups)

    measured: dict[str, list] = {}
    for rnd in range(rounds):
        for impl in (impls if rnd % 2 == 0 else impls[::-1]):
            r = one(impl)
            measured.setdefault(impl, []).append(r)
            if ctx.is_main:
                print(f"[training] world {world} {preset} round {rnd} {impl:16s} {r['step_s'] * 1e3:9.2f} ms  "
                      f"peak {r['peak_bytes'] / GIB:6.2f} GiB  left {r['leftover_bytes'] / GIB:5.2f} GiB  "
                      f"loss {r['loss']:.4f}", flush=True)
    if world > 1:
        for impl in NOSYNC:
            if impl in impls:
                measured[f"{impl}_nosync"] = [one(impl, no_sync=True)]
    for impl, runs in measured.items():
        if not runs[0]:  # solo: the other ranks' empty results
            runs = [{"step_s": 0.0, "peak_bytes": 0, "leftover_bytes": 0, "loss": float("nan")}] * len(runs)
        step_s, peak_b = slowest(ctx, [statistics.median(r["step_s"] for r in runs), max(r["peak_bytes"] for r in runs)])
        ph = {"step_s": step_s, "tokens_per_s_per_gpu": micro * seq * accum / step_s, "peak_gib": peak_b / GIB,
              "rank0_round_step_s": [r["step_s"] for r in runs], "rank0_round_peak_gib": [r["peak_bytes"] / GIB for r in runs],
              "rank0_leftover_gib": [r["leftover_bytes"] / GIB for r in runs], "last_loss": runs[-1]["loss"],
              "model_state_formula_gib": model_state_gib(impl, sizes["params"], 1 if impl == "solo" else world,
                                                         sizes["largest_unit_params"])}
        if "bytes_sent_per_step" in runs[-1]:
            ph["bytes_sent_per_step"] = runs[-1]["bytes_sent_per_step"]
        entry["phases"][impl] = ph
    if world > 1 and "ours_ddp" in impls:
        seconds, = slowest(ctx, [comm_only_seconds(cfg, batches, device, ctx)])
        entry["ours_comm_only"] = {"step_s": seconds, "gradient_bytes": 4 * sizes["params"]}
    ph = entry["phases"]
    entry["exposed_comm_s"] = {impl: ph[impl]["step_s"] - ph[f"{impl}_nosync"]["step_s"] for impl in NOSYNC
                               if impl in ph and f"{impl}_nosync" in ph}
    return entry
