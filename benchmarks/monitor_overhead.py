"""Cost of the monitor: the same training with and without `log_dir`, interleaved, in one process.

    python benchmarks/monitor_overhead.py --out results.json        (one GPU, or CPU for a smoke run)

Two identical GPT models, each in its own `DistributedTrainer` (one with the monitor writing
TensorBoard, JSONL and NVML/psutil stats every `--log-every` steps, one without), train
`--steps` steps in turn for `--rounds` rounds; the overhead is the ratio of median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_gpu import environment  # noqa: E402

from distributed_training import DistributedTrainer, init_distributed  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-124m", choices=sorted(GPT_PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    ctx = init_distributed()
    cfg = GPT_PRESETS[args.model]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch * args.steps * 2, args.seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    log_dir = tempfile.mkdtemp(prefix="monitor-overhead-")
    trainers = {}
    for name in ("without", "with"):
        torch.manual_seed(0)
        trainers[name] = DistributedTrainer(
            GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=torch.cuda.is_available()), context=ctx,
            log_dir=log_dir if name == "with" else None, log_every=args.log_every, progress=False)
    times = {name: [] for name in trainers}

    def run(name: str, steps: int) -> float:
        t = trainers[name]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        t.fit(data, epochs=10**6, batch_size=args.batch, max_steps=t.step + steps, shuffle=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    for name in trainers:
        run(name, args.log_every)  # warm-up (and a first log step for the monitored one)
    for rnd in range(args.rounds):
        for name in (("without", "with") if rnd % 2 == 0 else ("with", "without")):
            times[name].append(run(name, args.steps))
    med = {name: statistics.median(v) for name, v in times.items()}
    overhead = (med["with"] - med["without"]) / med["without"] * 100
    perf = trainers["with"].get_performance_metrics()
    result = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps_per_phase": args.steps,
              "rounds": args.rounds, "log_every": args.log_every, "step_s": times,
              "median_step_s": med, "monitor_overhead_pct": overhead, "monitor_summary": perf,
              "event_files": sorted(os.listdir(os.path.join(log_dir, "rank_0"))), **environment()}
    print(f"without monitor {med['without'] * 1e3:.1f} ms/step, with {med['with'] * 1e3:.1f} ms/step: "
          f"overhead {overhead:+.2f}%")
    print("monitor summary:", {k: v for k, v in perf.items() if not isinstance(v, list)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    for t in trainers.values():
        t.close()
    ctx.shutdown()


if __name__ == "__main__":
    main()
