"""Memory: our trainer (DDP, bf16 autocast on GPUs) on GPT 1.3B, at the largest world of the run.

1. Activation checkpointing off and on (``activation_checkpointing=Block``), the same micro-batch:
   step ms, tokens/s per GPU, and peak memory: ``peak_gib`` everything the trainer allocated from
   before its model was built (weights, gradients, Adam's moments, DDP's buckets and the step's
   activations), ``step_peak_gib`` what a step allocates on top of what stays resident. Each variant
   starts on a freed device (cache emptied, peak statistics reset) and frees everything after it, so
   neither is charged for the other or for earlier phases.
2. ``fit(batch_size="auto")`` on a fresh trainer (checkpointing off): the batch it chose and why, how
   long the search took and its peak, then `auto_steps` training steps at that batch with no
   out-of-memory error: their peak against the card's memory, step time, and the loss (finite).

Why the largest world: that is the trainer as it runs, DDP's buckets included, and the automatic
batch size is agreed by every rank (an all-reduce MIN of each rank's search), which needs ranks.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch.utils.data import TensorDataset

from common import GIB, allocated, free_memory, make_batches, peak, peak_reset, slowest, synchronize

GPU_MODEL = ("gpt-1.3b", 8, 1024)
SMOKE_MODEL = ("tiny", 4, 32)


def _trainer(cfg, ctx, *, checkpointing: bool):
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT
    from distributed_training.models.gpt import Block

    device = ctx.device
    torch.manual_seed(0)
    with torch.device(device):  # built in place: a 1.3B model initialised on the CPU takes seconds
        model = GPT(cfg)
    fused = device.type == "cuda"
    return DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused), strategy="ddp",
                              mixed_precision="bf16" if fused else None, context=ctx, progress=False,
                              activation_checkpointing=Block if checkpointing else None)


def _checkpointing_row(cfg, ctx, batches, warmup: int, steps: int, checkpointing: bool) -> dict:
    device = ctx.device
    free_memory(device)
    synchronize(device)
    base = allocated(device)
    peak_reset(device)
    trainer = _trainer(cfg, ctx, checkpointing=checkpointing)
    for b in batches[:warmup]:
        trainer.train_step(b)
    synchronize(device)
    resident = allocated(device)
    whole = peak(device)
    peak_reset(device)
    t0 = time.perf_counter()
    for i in range(steps):
        metrics = trainer.train_step(batches[(warmup + i) % len(batches)])
    synchronize(device)
    seconds = (time.perf_counter() - t0) / steps
    loss = float(metrics["loss"])
    row = {"step_s": seconds, "peak_bytes": max(whole, peak(device)) - base, "step_peak_bytes": peak(device) - resident,
           "resident_bytes": resident - base, "loss": loss}
    trainer.close()
    del trainer, metrics
    free_memory(device)
    return row


def run(ctx, opts) -> dict:
    from distributed_training.models import GPT_PRESETS

    device, world = ctx.device, ctx.world_size
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    preset, micro, seq = (opts.models or [SMOKE_MODEL if opts.smoke else GPU_MODEL])[-1]
    cfg = GPT_PRESETS[preset]
    steps = opts.steps or (2 if opts.smoke else 5)
    warmup = 1 if opts.smoke else 2
    auto_steps = 3 if opts.smoke else 5
    batches = make_batches(cfg, micro, seq, device, ctx.rank, count=warmup + steps)
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 0

    rows = {}
    for name, on in (("off", False), ("on", True)):
        r = _checkpointing_row(cfg, ctx, batches, warmup, steps, on)
        step_s, peak_b, step_peak_b = slowest(ctx, [r["step_s"], r["peak_bytes"], r["step_peak_bytes"]])
        rows[name] = {"step_ms": 1e3 * step_s, "tokens_per_s_per_gpu": micro * seq / step_s,
                      "peak_gib": peak_b / GIB, "step_peak_gib": step_peak_b / GIB,
                      "rank0_resident_gib": r["resident_bytes"] / GIB, "rank0_loss": r["loss"]}
        if ctx.is_main:
            print(f"[memory] world {world} {preset} checkpointing {name}: {rows[name]['step_ms']:.1f} ms/step, "
                  f"{rows[name]['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, peak {rows[name]['peak_gib']:.2f} GiB "
                  f"(step {rows[name]['step_peak_gib']:.2f} GiB)", flush=True)
    del batches
    effect = {"peak_saved_gib": rows["off"]["peak_gib"] - rows["on"]["peak_gib"],
              "step_peak_ratio_on_vs_off": (rows["on"]["step_peak_gib"] / rows["off"]["step_peak_gib"]
                                            if rows["off"]["step_peak_gib"] > 0 else None),
              "slowdown_pct": 100.0 * (rows["on"]["step_ms"] / rows["off"]["step_ms"] - 1)}
    auto = _auto_batch(cfg, ctx, seq, auto_steps, total)
    return {"status": "ok", "model": preset, "micro_batch": micro, "seq": seq, "steps": steps, "warmup": warmup,
            "strategy": "ddp", "precision": "bf16 autocast, fp32 master weights, fused AdamW" if cuda else "fp32 (CPU)",
            "card_total_gib": total / GIB, "checkpointing": rows, "checkpointing_effect": effect, "auto_batch": auto,
            "note": "peak_gib: all the trainer allocated (model state included), from a freed device; step_peak_gib: "
                    "what a step adds on top of what stays resident" +
                    ("" if cuda else " (0 on CPU: not tracked)")}


def _auto_batch(cfg, ctx, seq: int, auto_steps: int, total: int) -> dict:
    """``fit(batch_size="auto")`` on a fresh trainer, then `auto_steps` steps at the batch it chose."""
    device, world = ctx.device, ctx.world_size
    free_memory(device)
    synchronize(device)
    base = allocated(device)
    peak_reset(device)
    trainer = _trainer(cfg, ctx, checkpointing=False)
    # Enough samples that the search, not the dataset (AUTO_BATCH_MIN_STEPS steps per epoch), bounds it.
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (world * 4 * (64 if device.type == "cpu" else 512), seq + 1),
                           generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    search = {}
    search_batch = trainer.auto_batch_size

    def timed_search(*args, **kwargs):  # what fit calls: its time and peak, then the steps' peak apart
        synchronize(device)
        t0 = time.perf_counter()
        chosen = search_batch(*args, **kwargs)
        synchronize(device)
        search["seconds"] = time.perf_counter() - t0
        search["peak_bytes"] = peak(device) - base
        peak_reset(device)
        return chosen

    ticks = []  # (seconds, loss) after each step: on_step reads the loss, which waits for the step to end

    def on_step(step, metrics):
        ticks.append((time.perf_counter(), metrics["loss"]))

    trainer.auto_batch_size = timed_search
    oom = None
    try:
        history = trainer.fit(data, epochs=10**6, batch_size="auto", max_steps=auto_steps, shuffle=False,
                              log_every=1, on_step=on_step)
    except torch.cuda.OutOfMemoryError as err:  # the claim fails: say so before the job ends
        oom = str(err).splitlines()[0]
        print(f"[memory] rank {ctx.rank}: out of memory training at batch_size='auto' -> {trainer.batch_size}: {oom}",
              flush=True)
        raise
    synchronize(device)
    # Steps after the first (which also creates Adam's state): the median interval between their ends.
    gaps = [b[0] - a[0] for a, b in zip(ticks, ticks[1:])]
    train_s = statistics.median(gaps) if gaps else float("nan")
    losses = [loss for _, loss in ticks]
    train_peak = peak(device) - base
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    chosen, reason, steps_done = trainer.batch_size, trainer.batch_size_reason, trainer.step
    trainer.close()
    del trainer, data, tokens
    free_memory(device)
    search_s, search_peak, train_s, train_peak_b, reserved_b = slowest(
        ctx, [search["seconds"], search["peak_bytes"], train_s, train_peak, reserved])
    out = {"batch_size": chosen, "reason": reason, "search_s": search_s, "search_peak_gib": search_peak / GIB,
           "train_steps": steps_done, "train_step_ms": 1e3 * train_s,
           "tokens_per_s_per_gpu": chosen * seq / train_s, "train_peak_gib": train_peak_b / GIB,
           "max_reserved_gib": reserved_b / GIB,
           "train_peak_fraction_of_card": train_peak_b / total if total else None,
           "losses": losses, "epoch_mean_loss": [h["train_loss"] for h in history],
           "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
           "no_oom": oom is None and steps_done == auto_steps}
    if ctx.is_main:
        print(f"[memory] world {world} batch_size='auto' -> {chosen} per rank ({reason}); search {search_s:.1f} s; "
              f"{steps_done} steps at {out['train_step_ms']:.0f} ms, peak {out['train_peak_gib']:.2f} GiB"
              + (f" of {total / GIB:.1f} GiB ({100 * out['train_peak_fraction_of_card']:.0f}%)" if total else "")
              + f", loss {losses}", flush=True)
    return out
