"""A small job for the two-node elastic harness (`tests/test_elastic_agents.py`), started by two torchrun
agents on one host (``--nnodes=1:2``): it checkpoints every step and resumes from the latest good
checkpoint at whatever world size the rendezvous gives it. Each node's local rank 0 prints one line a
step: ``ELASTIC step=<n> world=<w> attempt=<restart count> time=<unix time>``, and when it starts
(``ELASTIC start``), is ready to train (``ELASTIC ready``) or fails (``ELASTIC failed error=<type>``).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer


def _say(what: str) -> None:
    if os.environ.get("LOCAL_RANK") == "0":
        print(f"ELASTIC {what} time={time.time():.3f}", flush=True)


def main() -> None:
    _say(f"start attempt={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")  # imports done
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--step-seconds", type=float, default=0.2, help="sleep per step, so that the run lasts")
    args = p.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randn(4096, 4, generator=g))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), strategy=args.strategy,
                                 checkpoint_dir=args.ckpt, checkpoint_every=1, keep_last=3, seed=7,
                                 heartbeat_timeout=2.0, timeout=120)
    ctx = trainer.context
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def on_step(step: int, metrics: dict) -> None:
        if ctx.local_rank == 0:
            print(f"ELASTIC step={step} world={ctx.world_size} attempt={attempt} time={time.time():.3f}", flush=True)
        time.sleep(args.step_seconds)

    _say(f"ready world={ctx.world_size}")
    try:
        trainer.fit(data, epochs=1, batch_size=4, criterion=F.mse_loss, max_steps=args.steps, on_step=on_step,
                    log_every=1)
    except Exception as err:
        _say(f"failed error={type(err).__name__}")
        raise
    if ctx.local_rank == 0:
        print(f"ELASTIC done step={trainer.step} world={ctx.world_size}", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
