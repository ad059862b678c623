"""A small training job for the fault-injection test, started by torchrun.

With --kill-at K, rank 1 kills itself with SIGKILL after step K on the first attempt only
(TORCHELASTIC_RESTART_COUNT == 0); torchrun --max-restarts restarts every worker, and the trainer
resumes from the latest good checkpoint in --ckpt. Rank 0 saves the final full model state to --out.

With several strategies (``--strategy ddp,fsdp``; --ckpt and --out then hold ``{strategy}``), one job
trains them one after the other, each as a run of its own (its own trainer, checkpoints and --out), and
strategy number i is killed as above on attempt i (its first): attempt 0 kills the first, attempt 1
resumes it, finishes it and kills the second, and so on; a strategy whose --out exists is done and is
skipped on a later attempt. The test runs its strategies this way, one torchrun job (and one generation
of fresh workers fewer) instead of one job per strategy.

``--no-resume STRATEGIES``: those strategies' runs are ``resume=False`` (not from an earlier run's checkpoints,
which the first attempt moves aside; torchrun's restarts still resume from the run's own).

`main(argv)` also runs inside a process group that already exists (`run_distributed`): the test's unbroken
reference run, the same training without torchrun's processes to start.
"""

import argparse
import os
import signal

import torch
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPTConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-resume", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    strategies = args.strategy.split(",")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for i, strategy in enumerate(strategies):
        ckpt, out = args.ckpt.replace("{strategy}", strategy), args.out.replace("{strategy}", strategy)
        if len(strategies) > 1 and os.path.exists(out):
            continue  # finished on an earlier attempt
        _train(strategy, ckpt, out, args.kill_at if restart == i else 0, args.epochs,
               strategy not in args.no_resume.split(","))


def _train(strategy: str, ckpt: str, out: str, kill_at: int, epochs: int, resume: bool = True) -> None:
    torch.manual_seed(0)
    # Dropout draws from the RNG: resuming must restore every rank's generator to be bit-exact.
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (48, 17), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    # heartbeat_timeout 2 s (the default is 5 s, as tests/jobs/elastic_job.py and test_peer_watch.py use): rank 0's
    # collective fails at once when rank 1 is SIGKILLed, then waits that long for the watcher to name the dead peer
    # before it raises and torchrun can restart the job.
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), strategy=strategy,
                                 checkpoint_dir=ckpt, checkpoint_every=3, keep_last=2, seed=7, heartbeat_timeout=2.0,
                                 resume=resume)

    def on_step(step: int, metrics: dict) -> None:
        if kill_at and step == kill_at and trainer.context.rank == 1:
            print(f"FAULT rank 1 kills itself after step {step} of {strategy}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.fit(data, epochs=epochs, batch_size=4, log_every=1, on_step=on_step)
    state = trainer.strategy.model_state_dict(trainer.model)
    if trainer.context.is_main:
        torch.save({"state": state, "step": trainer.step, "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT")},
                   out)
    trainer.close()


if __name__ == "__main__":
    main()
