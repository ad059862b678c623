"""Classify handwritten digits (8x8 pixels, 10 classes) with `DistributedTrainer`.

The data ships with the package (`distributed_training.datasets.digits`, 1,797 images from the UCI
repository): nothing is downloaded. Run it:

    python examples/train_digits.py                                   # one process
    torchrun --standalone --nproc_per_node=2 examples/train_digits.py # two processes (gloo on CPU)
    torchrun --standalone --nproc_per_node=gpu examples/train_digits.py --strategy zero3

With ``--checkpoint-dir``, `fit` saves every ``--checkpoint-every`` steps and a later run resumes from
the newest good checkpoint, under any strategy and number of processes (e.g. train under zero3 on two
processes, stop, go on under ddp on one).

Each rank trains on its own shard of every epoch; evaluation counts every held-out image exactly once.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.datasets import digits


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(dim=1) == labels).float().mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "zero2", "zero3", "fsdp", "auto"])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="images per process per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here and resume from the newest")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints "
                   "(default: only at the end)")
    args = p.parse_args()
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        p.error("--checkpoint-every needs --checkpoint-dir")

    data = digits()
    # The same split on every rank: a seeded permutation, 20% held out.
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    val = torch.utils.data.Subset(data, order[:360].tolist())
    train = torch.utils.data.Subset(data, order[360:].tolist())

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    with DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=args.lr), strategy=args.strategy,
                            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every) as trainer:
        before = trainer.evaluate(val, F.cross_entropy, batch_size=128, metrics={"accuracy": accuracy})
        history = trainer.fit(train, epochs=args.epochs, criterion=F.cross_entropy, batch_size=args.batch_size,
                              max_steps=args.max_steps)
        after = trainer.evaluate(val, F.cross_entropy, batch_size=128, metrics={"accuracy": accuracy})
        resumed_at = trainer.step - sum(epoch["steps"] for epoch in history)  # fit loaded a checkpoint of this step
        if trainer.context.is_main:
            print(f"world size {trainer.context.world_size}, strategy {args.strategy}, {trainer.step} steps"
                  + (f" (resumed at step {resumed_at}; 'before' is the model as built)" if resumed_at else ""))
            print(f"validation loss {before['loss']:.4f} -> {after['loss']:.4f}, "
                  f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")


if __name__ == "__main__":
    main()
