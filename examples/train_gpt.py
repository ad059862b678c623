"""Train a small character-level GPT with `DistributedTrainer` (data-parallel, strategy="ddp").

The corpus needs no download: it is this repository's own Python source (``distributed_training/**/*.py``)
plus README.md when there is one, read as raw bytes, so the vocabulary is the 256 byte values.
Ten percent of the text is held out and evaluated before and after training.

Run it from a checkout, after ``pip install -e .``:

    # one process (a world of one; no torchrun needed)
    python examples/train_gpt.py

    # two processes on one CPU machine (gloo)
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py

    # one process per GPU (the trainer picks cuda:LOCAL_RANK and NCCL by itself)
    torchrun --standalone --nproc_per_node=gpu examples/train_gpt.py --steps 500 --batch-size 64

    # more: a bigger model, gradient accumulation, a checkpoint at the end
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --n-layer 6 --n-embd 192 \\
        --grad-accum 2 --checkpoint checkpoints/gpt

The same script runs unchanged in all of these: nothing below names a device or a backend.
`--batch-size` is per process and per optimizer step, so the global batch is
``batch_size * world_size`` windows; `--grad-accum` splits each process's batch into that many
micro-batches (it changes memory use, not the result).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPT_PRESETS

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 256  # one token per byte: no tokenizer to fit, and any text encodes


def load_corpus(root: Path = REPO_ROOT) -> torch.Tensor:
    """The package's source files (and README.md, if present) as one long tensor of byte values.

    Files are read in sorted order so that every rank, on every node, builds the identical corpus:
    the train/validation split and the windows below depend on it.
    """
    paths = sorted((root / "distributed_training").rglob("*.py"))
    readme = root / "README.md"
    if readme.is_file():
        paths.append(readme)
    if not paths:
        raise FileNotFoundError(f"no source files found under {root / 'distributed_training'}")
    data = b"\n\n".join(p.read_bytes() for p in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class CharWindows(Dataset):
    """Samples ``(x, y)``: `block_size` bytes from each start offset, and the same bytes shifted by one.

    Predicting y[t] from x[:t+1] at every position t is the language-modelling objective; GPT
    computes the cross-entropy itself when it is given the targets.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, starts: list[int]) -> None:
        if any(s < 0 or s + block_size + 1 > len(tokens) for s in starts):
            raise ValueError("every window (plus its one-token shift) must lie inside the corpus")
        self.tokens = tokens
        self.block_size = block_size
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        chunk = self.tokens[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def split_windows(tokens: torch.Tensor, block_size: int, val_every: int = 10) -> tuple[list[int], list[int]]:
    """Non-overlapping window offsets; every `val_every`-th window is held out for validation.

    Taking validation windows from all over the corpus (rather than its last 10%, which would be
    just the last few files) keeps the two sets alike, so the validation loss tracks the training
    loss instead of measuring how different `testing.py` is from `data.py`.
    """
    starts = list(range(0, len(tokens) - block_size - 1, block_size))
    train = [s for k, s in enumerate(starts) if k % val_every != val_every - 1]
    val = [s for k, s in enumerate(starts) if k % val_every == val_every - 1]
    return train, val


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(GPT_PRESETS), help="model shape to start from")
    p.add_argument("--n-layer", type=int, help="override the preset's number of blocks")
    p.add_argument("--n-head", type=int, help="override the preset's attention heads")
    p.add_argument("--n-embd", type=int, help="override the preset's width")
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    p.add_argument("--batch-size", type=int, default=16, help="windows per process per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--log-every", type=int, help="log every N steps (default: 10 lines per run)")
    p.add_argument("--checkpoint", type=Path, help="checkpoint directory to save model and optimizer state to at the end")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.batch_size < args.grad_accum:
        p.error("--batch-size must be at least --grad-accum (each micro-batch needs a sample)")
    if args.log_every is None:
        args.log_every = max(1, args.steps // 10)
    return args


def warmup_cosine(total_steps: int, warmup_steps: int, floor: float = 0.1):
    """LR multiplier: linear warm-up, then cosine decay to `floor` of the peak.

    Warm-up matters because Adam's first updates, made from barely-initialised second-moment
    estimates, are large; at a peak of a few 1e-3 they can throw a fresh transformer into a bad region.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    preset = GPT_PRESETS[args.preset]
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_head", args.n_head), ("n_embd", args.n_embd)) if v}
    cfg = dataclasses.replace(preset, vocab_size=VOCAB_SIZE, block_size=args.block_size, **overrides)

    # The same seed on every rank gives every rank the same initial weights. DDP broadcasts rank 0's
    # weights anyway, but then a world of one and a world of two start from the same model.
    torch.manual_seed(args.seed)
    model = GPT(cfg)

    tokens = load_corpus()
    train_starts, val_starts = split_windows(tokens, cfg.block_size)
    val_set = CharWindows(tokens, cfg.block_size, val_starts)

    def optimizer(params):
        # A factory rather than a built optimizer: the strategy decides which parameters it sees.
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    warmup = max(1, args.steps // 10)
    with DistributedTrainer(
        model,
        optimizer,
        strategy="ddp",
        gradient_accumulation_steps=args.grad_accum,
        gradient_clip_val=1.0,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, warmup)),
        seed=args.seed,
    ) as trainer:
        ctx = trainer.context
        if trainer.device.type == "cpu" and ctx.local_world_size > 1:
            # torchrun sets OMP_NUM_THREADS=1 for every worker; on a CPU-only run give each process
            # its share of the cores instead. More threads than that would oversubscribe the cores,
            # and a rank whose threads are descheduled stalls every other rank at the all-reduce.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // ctx.local_world_size))

        global_batch = args.batch_size * ctx.world_size
        # Keep a whole number of global batches. fit() would otherwise end each epoch on a short
        # batch, and a short batch with fewer samples than --grad-accum cannot be split into
        # micro-batches (the trainer raises). It also keeps every step's gradient over the same
        # number of tokens. At most global_batch - 1 windows go unused.
        usable = len(train_starts) - len(train_starts) % global_batch
        if usable == 0:
            raise SystemExit(
                f"the corpus has {len(train_starts)} training windows, fewer than one global batch of "
                f"{global_batch}: lower --batch-size or --block-size"
            )
        train_set = CharWindows(tokens, cfg.block_size, train_starts[:usable])
        # fit() shards the windows across ranks (each window goes to one rank per epoch, reshuffled
        # every epoch), so an epoch is len(train_set) / global_batch steps.
        steps_per_epoch = len(train_set) // global_batch
        epochs = math.ceil(args.steps / steps_per_epoch)

        if ctx.is_main:
            print(
                f"world size {ctx.world_size} on {trainer.device} ({ctx.backend}) | "
                f"model {model.num_parameters() / 1e6:.2f}M params "
                f"(n_layer={cfg.n_layer}, n_head={cfg.n_head}, n_embd={cfg.n_embd}, block={cfg.block_size}) | "
                f"corpus {len(tokens):,} bytes: {len(train_set)} train / {len(val_set)} val windows | "
                f"global batch {global_batch} x {cfg.block_size} bytes, {args.steps} steps over {epochs} epoch(s)",
                flush=True,
            )

        # The loss of an untrained model is about ln(256) = 5.55: uniform over bytes.
        val_before = trainer.evaluate(val_set, batch_size=args.batch_size)["loss"]

        logged: list[tuple[int, float]] = []

        def on_step(step: int, metrics: dict[str, float]) -> None:
            # `metrics["loss"]` is this rank's own batch loss (not averaged over ranks): cheap, and
            # good enough to watch training; evaluate() below gives the exact all-rank figure.
            logged.append((step, metrics["loss"]))
            if ctx.is_main:
                print(
                    f"step {step:5d} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
                    f"grad norm {metrics['grad_norm']:.3f}",
                    flush=True,
                )

        started = time.perf_counter()
        trainer.fit(
            train_set,
            epochs=epochs,
            criterion=None,  # each batch (x, y) is passed as model(x, y), which returns the mean loss
            batch_size=args.batch_size,
            max_steps=args.steps,
            log_every=args.log_every,
            on_step=on_step,
        )
        seconds = time.perf_counter() - started

        val_after = trainer.evaluate(val_set, batch_size=args.batch_size)["loss"]
        if args.checkpoint is not None:
            # Collective: every rank must call it (rank 0 writes, the others wait for the file).
            trainer.save_checkpoint(args.checkpoint)

        if ctx.is_main:
            tokens_seen = trainer.step * global_batch * cfg.block_size
            print(f"trained {trainer.step} steps in {seconds:.1f}s ({tokens_seen / seconds:,.0f} bytes/s)")
            (first_step, first_loss), (last_step, last_loss) = logged[0], logged[-1]
            print(f"train loss: {first_loss:.4f} (step {first_step}) -> {last_loss:.4f} (step {last_step})")
            print(f"val loss: {val_before:.4f} before training -> {val_after:.4f} after")
            if args.checkpoint is not None:
                print(f"checkpoint written to {args.checkpoint}")
            print("sample:", repr(generate(trainer.module, tokens[:16], 120, trainer.device)))


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, length: int, device: torch.device, top_k: int = 8) -> str:
    """Continue `prompt` by `length` bytes, sampling each from the model's top-k predictions."""
    was_training = model.training
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = prompt.to(device).unsqueeze(0)
    for _ in range(length):
        logits = model(idx[:, -model.cfg.block_size :])[0, -1].float().cpu()
        top = torch.topk(logits, top_k)
        choice = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=g)]
        idx = torch.cat([idx, choice.to(device).view(1, 1)], dim=1)
    model.train(was_training)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    main()
