"""`evaluate()` (or `train_step`, ``--train N``) through a pipeline: seconds per evaluation (per step) of a
GPT, one torchrun job per measurement.

``torchrun --nproc_per_node=P benchmarks/pipeline_eval_bench.py --out FILE [--package DIR]``: builds the
GPT on the meta device, cuts it into P stages (`DistributedTrainer(..., pipeline_parallel_size=P)`),
evaluates `--batches` batches of `--batch` sequences of `--seq` tokens `--repeats` times (the first one
untimed) and appends one JSON line to FILE (rank 0): the package's path, the seconds of each timed
evaluation, tokens/s. `--package` puts another copy of the package first on the path: a job per copy,
alternated by the caller, compares two versions on one machine (session 40: the evaluation's
acknowledgements against the code before them). ``--train N``: instead, N timed training steps (after 3
untimed) of `--batch` x `--batches` sequences per step, cut into `--microbatches`, the seconds of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--package", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
parser.add_argument("--preset", default="gpt-1.3b")
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--batches", type=int, default=16)
parser.add_argument("--repeats", type=int, default=4)
parser.add_argument("--label", default="")
parser.add_argument("--train", type=int, default=0)
parser.add_argument("--microbatches", type=int, default=8)
args = parser.parse_args()
sys.path.insert(0, os.path.abspath(args.package))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import distributed_training  # noqa: E402
from distributed_training import DistributedTrainer  # noqa: E402
from distributed_training.models import GPT, GPT_PRESETS  # noqa: E402


def main() -> None:
    cfg = GPT_PRESETS[args.preset]
    with torch.device("meta"):
        model = GPT(cfg)
    world = int(os.environ["WORLD_SIZE"])
    fused = torch.cuda.is_available()
    trainer = DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused), progress=False,
                                 mixed_precision="bf16", pipeline_parallel_size=world,
                                 microbatches=args.microbatches if args.train else 4)
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.batches
    tokens = torch.randint(0, cfg.vocab_size, (n, args.seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    seconds, losses = [], []
    if args.train:
        batch = (tokens[:, :-1], tokens[:, 1:])
        for k in range(3 + args.train):
            sync()
            started = time.perf_counter()
            loss = trainer.train_step(batch)["loss"]
            sync()
            if k >= 3:
                seconds.append(time.perf_counter() - started)
        losses.append(float(loss))
    for k in range(0 if args.train else args.repeats):
        sync()
        started = time.perf_counter()
        losses.append(trainer.evaluate(data, batch_size=args.batch)["loss"])
        sync()
        if k:
            seconds.append(time.perf_counter() - started)
    if int(os.environ["RANK"]) == 0:
        best = min(seconds)
        with open(args.out, "a") as f:
            f.write(json.dumps({"label": args.label, "package": os.path.dirname(distributed_training.__file__),
                                "preset": args.preset, "world": world, "batch": args.batch, "seq": args.seq,
                                "batches": args.batches, "seconds": seconds, "loss": losses[-1],
                                "mode": "train" if args.train else "evaluate",
                                "tokens_per_s": n * args.seq / best}) + "\n")
    trainer.close()


if __name__ == "__main__":
    main()
