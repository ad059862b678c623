"""The monitor's cost, at every world size: two identical GPT models, each in its own
`DistributedTrainer` (one with `log_dir`: TensorBoard, JSONL, NVML/psutil figures and the cluster
all-gather every `log_every` steps, and DDP's communication timing on the steps it logs; one
without), train `steps` steps in turn through `fit` for `rounds` rounds, the order reversed every
other round. Each round gives one paired figure, (with - without) / without of the slowest rank's
step time; the result is their median, spread and a bootstrap 95% interval of the median, and a
verdict on "at most 1% of a step" that holds only when the interval is clear of 1%.

A timed block starts `log_every // 2` steps after a log step, so that each block holds the same
number of log steps and ends halfway between two (`fit` waits for the monitor's writer when it
returns, which a block ending on a log step would charge to the block). The host time the training
thread spends in the monitor's calls (`record_step`, and DDP's `pop_communication_metrics` on log
steps) is measured apart, per log step and per other step, and the records written are checked
(count, a finite loss, the cluster view on rank 0)."""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

from common import median_interval, one_percent_verdict, slowest, synchronize

GPU_MODEL = ("gpt2-124m", 8, 1024)
SMOKE_MODEL = ("tiny", 4, 32)


def _timed(fn, into: dict, key: str, on_log_step):
    """`fn`, adding its host seconds to ``into[key]`` on log steps, to ``into[key + "_other"]`` otherwise."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            slot = key if on_log_step() else key + "_other"
            into[slot] = into.get(slot, 0.0) + time.perf_counter() - t0
    return wrapper


def run(ctx, opts) -> dict:
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPT_PRESETS

    device, world = ctx.device, ctx.world_size
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    preset, batch, seq = (opts.models or [SMOKE_MODEL if opts.smoke else GPU_MODEL])[0]
    log_every = 2 if opts.smoke else 10
    steps = opts.steps or (2 * log_every)
    if steps % log_every:
        raise ValueError(f"monitor: --steps ({steps}) must be a multiple of log_every ({log_every}), so that every "
                         "timed block holds the same number of log steps")
    rounds = opts.rounds or (2 if opts.smoke else 10)
    cfg = GPT_PRESETS[preset]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch * 64, seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    log_dir = tempfile.mkdtemp(prefix="suite-monitor-")
    if world > 1:  # every rank writes under rank 0's directory, as a job does
        box = [log_dir]
        torch.distributed.broadcast_object_list(box, src=0)
        log_dir = box[0]
    fused = device.type == "cuda"
    trainers = {}
    for name in ("without", "with"):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        trainers[name] = DistributedTrainer(
            model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused), context=ctx,
            log_dir=log_dir if name == "with" else None, log_every=log_every, progress=False)
    monitored = trainers["with"]
    host: dict[str, float] = {}
    on_log_step = lambda: monitored.step % log_every == 0  # noqa: E731 (record_step runs after the step count moves)
    monitored.monitor.record_step = _timed(monitored.monitor.record_step, host, "record_step", on_log_step)
    monitored.strategy.pop_communication_metrics = _timed(monitored.strategy.pop_communication_metrics, host,
                                                          "pop_communication_metrics", on_log_step)

    def timed(name: str, count: int) -> float:
        t = trainers[name]
        synchronize(device)
        start = time.perf_counter()
        # 64 batches, sharded over the ranks; enough epochs never to end before max_steps.
        t.fit(data, epochs=10**6, batch_size=batch, max_steps=t.step + count, shuffle=False)
        synchronize(device)
        return (time.perf_counter() - start) / count

    for name in trainers:  # warm-up, ending halfway between two log steps (see the docstring)
        timed(name, log_every + log_every // 2)
    host.clear()
    times: dict[str, list[float]] = {"without": [], "with": []}
    for rnd in range(rounds):
        for name in (("without", "with") if rnd % 2 == 0 else ("with", "without")):
            times[name].append(timed(name, steps))
    # The slowest rank's time, round by round: a job is as slow as its slowest rank.
    flat = slowest(ctx, times["without"] + times["with"])
    times = {"without": flat[:rounds], "with": flat[rounds:]}
    paired = [100.0 * (w - wo) / wo for w, wo in zip(times["with"], times["without"])]
    med = {name: statistics.median(v) for name, v in times.items()}
    overhead = statistics.median(paired)
    low, high = median_interval(paired)
    q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
    verdict = one_percent_verdict(low, high, rounds)
    log_steps = rounds * steps // log_every
    other_steps = rounds * steps - log_steps
    host_ms = {"record_step_per_log_step": 1e3 * host.get("record_step", 0.0) / log_steps,
               "record_step_per_other_step": 1e3 * host.get("record_step_other", 0.0) / other_steps,
               "pop_communication_metrics_per_log_step": 1e3 * host.get("pop_communication_metrics", 0.0) / log_steps}

    perf = monitored.get_performance_metrics()  # also waits for the monitor's writer
    writer_thread = monitored.monitor._thread is not None
    records = _check_records(os.path.join(log_dir, f"rank_{ctx.rank}", "metrics.jsonl"), ctx.rank, world)
    result = {"status": "ok", "model": preset, "batch": batch, "seq": seq, "steps_per_phase": steps, "rounds": rounds,
              "log_every": log_every, "precision": "fp32 (TF32 matmuls), fused AdamW" if fused else "fp32 (CPU)",
              "step_s": times, "median_step_s": med,
              "monitor_overhead_pct": overhead, "paired_overhead_pct": paired,
              "overhead_pct_quartiles": [q[0], q[2]], "overhead_pct_range": [min(paired), max(paired)],
              "overhead_pct_median_ci95": [low, high], "at_most_1pct": verdict,
              "rank0_host_ms": host_ms, "writer_thread": writer_thread, "records": records,
              "monitor_summary": {k: v for k, v in perf.items() if not isinstance(v, (list, dict))},
              "event_files": sorted(f for f in os.listdir(os.path.join(log_dir, f"rank_{ctx.rank}"))
                                    if f.startswith("events.out.tfevents"))}
    if ctx.is_main:
        print(f"[monitor] world {world}: without {med['without'] * 1e3:.2f} ms/step, with {med['with'] * 1e3:.2f} "
              f"ms/step: overhead median {overhead:+.2f}% (quartiles {q[0]:+.2f} / {q[2]:+.2f}, 95% CI of the median "
              f"{low:+.2f} / {high:+.2f}); <= 1%: {verdict}; host ms per log step: record_step "
              f"{host_ms['record_step_per_log_step']:.2f}, DDP pop {host_ms['pop_communication_metrics_per_log_step']:.2f}",
              flush=True)
    for t in trainers.values():
        t.close()
    return result


def _check_records(path: str, rank: int, world: int) -> dict:
    """What the monitored trainer wrote on this rank: how many records, and whether each is whole."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    # (a loss that is not finite is written as null: strict JSON)
    finite = all(isinstance(line.get("train/loss"), (int, float)) and math.isfinite(line["train/loss"]) for line in lines)
    cluster = all("cluster/step_time_max_s" in line for line in lines) if rank == 0 and world > 1 else None
    return {"count": len(lines), "steps_increasing": all(a["step"] < b["step"] for a, b in zip(lines, lines[1:])),
            "loss_finite": finite, "cluster_view_on_rank0": cluster, "ok": bool(lines) and finite and cluster is not False}
