"""A small job for the two-node elastic harness (`tests/test_elastic_agents.py`), started by two torchrun
agents on one host (``--nnodes=1:2``): one epoch of ``--steps`` global batches of `GLOBAL_BATCH` samples
(`fit(global_batch_size=...)`: the same batches at any world size), a checkpoint every step, resumed from
the latest good checkpoint at whatever world size the rendezvous gives it.

Each node's local rank 0 prints one line a step: ``ELASTIC step=<n> world=<w> attempt=<restart count>
time=<unix time>``, and when it starts (``ELASTIC start``), is ready to train (``ELASTIC ready``) or fails
(``ELASTIC failed error=<type>``).

With ``--records DIR`` every rank also writes, after each completed step, what it trained: one file
``<attempt>-w<world>-r<rank>-s<step>.pt`` holding ``{"attempt", "world", "rank", "step", "time",
"indices", "params"}``. `attempt` names one incarnation of the job (rank 0 draws it at start and
broadcasts it: a torchrun restart count is each agent's own), `indices` are the dataset indices this
rank trained in the step (the targets' last column carries them), `params` the model's full parameters
after the step (on rank 0 under every strategy, through `full_state_dict`; on every rank under DDP, whose
ranks hold them all; None otherwise). A file is written under a temporary name and renamed, so a worker
SIGKILLed mid-write leaves no torn record (at most a ``*.tmp`` the reader skips).

With ``--hold FILE``, while FILE exists the job does not end its epoch: from step ``steps - 4`` on, each
worker waits after its step until FILE is removed or it receives SIGTERM (its agent restarting it to grow
the job), at most 120 s, and local rank 0 prints ``ELASTIC held step=<n> seconds=<s>``. The harness holds
while it waits for a joining node, so that a slow machine cannot finish the epoch at the smaller size
first; a SIGTERM ends the wait at once, so the time to grow is not lengthened by it.
"""

import argparse
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer

GLOBAL_BATCH = 8  # divisible by both world sizes of the harness (2 nodes x 2, 1 node x 2)
SEED, LR, MOMENTUM = 7, 0.01, 0.9  # the trainer's seed draws the epoch's permutation (seed + epoch)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def build_data(steps: int) -> TensorDataset:
    """`steps` global batches: (x, [y, index]) pairs, the target's last column the sample's index."""
    n = steps * GLOBAL_BATCH
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.cat([y, torch.arange(n, dtype=torch.float32)[:, None]], dim=1))


def criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target[:, :-1])


def _say(what: str) -> None:
    if os.environ.get("LOCAL_RANK") == "0":
        print(f"ELASTIC {what} time={time.time():.3f}", flush=True)


def _write_record(directory: str, record: dict) -> None:
    name = f"{record['attempt']}-w{record['world']}-r{record['rank']}-s{record['step']}.pt"
    tmp = os.path.join(directory, name + ".tmp")
    torch.save(record, tmp)
    os.replace(tmp, os.path.join(directory, name))


def main() -> None:
    _say(f"start attempt={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")  # imports done
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=60, help="global batches in the dataset: the epoch's steps")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--records", default=None, help="directory for the per-step records (see the module's doc)")
    p.add_argument("--step-seconds", type=float, default=0.2, help="sleep per step, so that the run lasts")
    p.add_argument("--hold", default=None, help="while this file exists, do not end the epoch (see the module's doc)")
    args = p.parse_args()
    torch.set_num_threads(1)

    trainer = DistributedTrainer(build_model(), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM),
                                 strategy=args.strategy, checkpoint_dir=args.ckpt, checkpoint_every=1, keep_last=3,
                                 seed=SEED, heartbeat_timeout=2.0, timeout=120, progress=False)
    ctx = trainer.context
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    token = [f"{time.time_ns()}-{os.getpid()}" if ctx.rank == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one name for this incarnation on every rank
    attempt = token[0]
    seen: list[int] = []
    terminated = threading.Event()  # SIGTERM seen inside fit (fit's own handler still gets it)

    def counting(out, target):
        seen.extend(int(i) for i in target[:, -1].tolist())  # every micro-batch of the step
        return criterion(out, target)

    def params() -> dict | None:
        # Collective under a sharded strategy: run as the trainer runs its own collectives, so that a
        # peer dying now is named (PeerFailureError), not a bare gloo error.
        try:
            with trainer._watching():
                full = trainer.full_state_dict()
        except RuntimeError as err:
            trainer._raise_if_peer_died(err)
            raise
        if ctx.rank == 0:
            return full
        if args.strategy == "ddp":
            return {k: v.detach().cpu().clone() for k, v in trainer.module.state_dict().items()}
        return None

    def hold(step: int) -> None:
        if not args.hold:
            return
        handler = signal.getsignal(signal.SIGTERM)  # fit's: a flag acted on at a step boundary
        if getattr(handler, "__name__", "") != "chained":  # from the first step on, so no SIGTERM is missed
            def chained(signum, frame):
                terminated.set()
                handler(signum, frame)
            signal.signal(signal.SIGTERM, chained)  # fit restores its predecessor's handler on return
        if step < args.steps - 4 or not os.path.exists(args.hold):
            return
        started = time.monotonic()
        while os.path.exists(args.hold) and not terminated.is_set() and time.monotonic() - started < 120:
            terminated.wait(0.05)
        if ctx.local_rank == 0:
            print(f"ELASTIC held step={step} seconds={time.monotonic() - started:.2f}", flush=True)

    def on_step(step: int, metrics: dict) -> None:
        if args.records:
            _write_record(args.records, {"attempt": attempt, "world": ctx.world_size, "rank": ctx.rank,
                                         "step": step, "time": time.time(), "indices": list(seen),
                                         "params": params()})
        seen.clear()
        if ctx.local_rank == 0:
            print(f"ELASTIC step={step} world={ctx.world_size} attempt={restarts} time={time.time():.3f}", flush=True)
        hold(step)
        time.sleep(args.step_seconds)

    _say(f"ready world={ctx.world_size}")
    try:
        trainer.fit(build_data(args.steps), epochs=1, criterion=counting, global_batch_size=GLOBAL_BATCH,
                    on_step=on_step, log_every=1)
    except Exception as err:
        _say(f"failed error={type(err).__name__}")
        raise
    if ctx.local_rank == 0:
        print(f"ELASTIC done step={trainer.step} world={ctx.world_size}", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
