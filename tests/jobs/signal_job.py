"""A small training job for the signal tests, started by torchrun.

Every rank records the full model state after every step; rank 0 saves the record to
``--out/trajectory_<n>.pt`` when the process ends, however it ends (n counts the runs into --out).
Rank 0 writes the last finished step to ``--out/progress`` so that the test knows when to send a
signal. ``--step-sleep`` slows steps down; ``--slow-fsync-from`` makes every fsync of a checkpoint
written at that step or later take ``--fsync-sleep`` seconds (a slow disk), creating ``--out/writing``
when the first slow write begins.

`main(argv)` also runs inside a process group that already exists (`run_distributed`): the tests' unbroken
reference run, the same training without torchrun's processes to start.
"""

import argparse
import glob
import os
import time
import types

import torch
from torch.utils.data import TensorDataset

import distributed_training.checkpoint as checkpoint_module
from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPTConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-fsync-from", type=int, default=0)
    p.add_argument("--fsync-sleep", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (48, 17), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), strategy=args.strategy,
                                 checkpoint_dir=args.ckpt, checkpoint_every=args.every, keep_last=10, seed=7)
    rank0 = trainer.context.is_main

    if args.slow_fsync_from:
        real = os.fsync

        def slow_fsync(fd):
            if trainer.step >= args.slow_fsync_from:
                if rank0 and not os.path.exists(os.path.join(args.out, "writing")):
                    open(os.path.join(args.out, "writing"), "w").close()
                time.sleep(args.fsync_sleep)
            real(fd)

        # Only the checkpoint module sees the slow disk.
        checkpoint_module.os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
        checkpoint_module.os.fsync = slow_fsync
        checkpoint_module.os.path = os.path

    trajectory = {}

    def on_step(step: int, metrics: dict) -> None:
        trajectory[step] = trainer.strategy.model_state_dict(trainer.model)  # collective under FSDP
        if rank0:
            with open(os.path.join(args.out, "progress.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(args.out, "progress.tmp"), os.path.join(args.out, "progress"))
        time.sleep(args.step_sleep)

    try:
        with trainer:  # leaving on KeyboardInterrupt / SystemExit closes without waiting for peers
            trainer.fit(data, epochs=args.epochs, batch_size=4, log_every=1, on_step=on_step)
    finally:
        if rank0:
            n = len(glob.glob(os.path.join(args.out, "trajectory_*.pt")))
            torch.save({"trajectory": trajectory, "step": trainer.step},
                       os.path.join(args.out, f"trajectory_{n}.pt"))


if __name__ == "__main__":
    main()
