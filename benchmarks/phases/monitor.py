"""The monitor's cost: two identical GPT models, each in its own `DistributedTrainer` (one with the
monitor writing TensorBoard, JSONL and NVML/psutil stats every `log_every` steps, one without), train
`steps` steps in turn for `rounds` rounds through `fit`; the overhead is the ratio of median step times."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

from common import synchronize

GPU_MODEL = ("gpt2-124m", 8, 1024)
SMOKE_MODEL = ("tiny", 4, 32)


def run(ctx, opts) -> dict:
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPT_PRESETS

    device = ctx.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    preset, batch, seq = (opts.models or [SMOKE_MODEL if opts.smoke else GPU_MODEL])[0]
    steps = opts.steps or (4 if opts.smoke else 20)
    rounds = opts.rounds or (1 if opts.smoke else 3)
    log_every = 2 if opts.smoke else 10
    cfg = GPT_PRESETS[preset]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch * steps * 2, seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    log_dir = tempfile.mkdtemp(prefix="suite-monitor-")
    fused = device.type == "cuda"
    trainers = {}
    for name in ("without", "with"):
        torch.manual_seed(0)
        trainers[name] = DistributedTrainer(
            GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused), context=ctx,
            log_dir=log_dir if name == "with" else None, log_every=log_every, progress=False)
    times = {name: [] for name in trainers}

    def timed(name: str, count: int) -> float:
        t = trainers[name]
        synchronize(device)
        start = time.perf_counter()
        t.fit(data, epochs=10**6, batch_size=batch, max_steps=t.step + count, shuffle=False)
        synchronize(device)
        return (time.perf_counter() - start) / count

    for name in trainers:
        timed(name, log_every)  # warm-up (and a first log step for the monitored one)
    for rnd in range(rounds):
        for name in (("without", "with") if rnd % 2 == 0 else ("with", "without")):
            times[name].append(timed(name, steps))
    med = {name: statistics.median(v) for name, v in times.items()}
    overhead = (med["with"] - med["without"]) / med["without"] * 100
    perf = trainers["with"].get_performance_metrics()
    result = {"status": "ok", "model": preset, "batch": batch, "seq": seq, "steps_per_phase": steps, "rounds": rounds,
              "log_every": log_every, "step_s": times, "median_step_s": med, "monitor_overhead_pct": overhead,
              "monitor_summary": {k: v for k, v in perf.items() if not isinstance(v, (list, dict))},
              "event_files": sorted(os.listdir(os.path.join(log_dir, "rank_0")))}
    print(f"[monitor] without {med['without'] * 1e3:.1f} ms/step, with {med['with'] * 1e3:.1f} ms/step: "
          f"overhead {overhead:+.2f}%", flush=True)
    for t in trainers.values():
        t.close()
    return result
