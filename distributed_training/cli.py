"""`dtrain`: run one training job from a YAML config, under torchrun or as a single process.

    torchrun --nproc_per_node=2 -m distributed_training job.yaml
    dtrain job.yaml --set training.max_steps=100 --set training.strategy=zero3
    dtrain --print-config              # the defaults, as YAML, to start a config from
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, JobConfig, load_config

__all__ = ["main", "run_job"]

_EPILOG = """\
config sections (every field optional; see distributed_training/config.py):
  model:          preset (tiny|small|gpt2-124m|gpt-1.3b|classifier), n_layer, n_embd, dropout
  data:           dataset (repo_text|digits), block_size, val_fraction
  training:       strategy (ddp|zero1|zero2|zero3|fsdp|auto), epochs, max_steps, batch_size (or auto), lr,
                  weight_decay, gradient_accumulation_steps, gradient_clip_val, precision (fp32|bf16|fp16),
                  activation_checkpointing, memory_budget_gb, seed, timeout_s
  communication:  bucket_cap_mb, compression (none|topk|bf16|fp16|powersgd), compression_ratio,
                  error_feedback, pattern (nccl|ring|tree), hierarchical, ranks_per_node
  checkpoint:     dir, every, keep_last, resume, save_on_preemption
                  (a restarted job resumes from dir unless resume is false or --no-resume is given;
                  SIGTERM saves a checkpoint and stops, SIGINT stops)
  logging:        dir, every, progress
  output:         path where rank 0 saves the final model state

examples:
  torchrun --nproc_per_node=2 -m distributed_training examples/configs/gpt_cpu.yaml
  dtrain job.yaml --set training.strategy=zero3 --set training.max_steps=200
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtrain",
        description="Train a model data-parallel from a YAML config (run it under torchrun for several processes).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="the job's YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), e.g. --set training.lr=3e-4")
    p.add_argument("--print-config", action="store_true", help="print the effective config as YAML and exit")
    p.add_argument("--no-resume", action="store_true",
                   help="start from step 0 even if checkpoint.dir holds checkpoints (they are moved into "
                        "checkpoint.dir/previous_run_<k>/); the same as --set checkpoint.resume=false")
    return p


def _build(cfg: JobConfig):
    """(model, train set, validation set, criterion or None) for the config."""
    from .datasets import TextWindows, digits, repo_text
    from .models import GPT, GPT_PRESETS

    g = torch.Generator().manual_seed(cfg.training.seed)
    if cfg.data.dataset == "digits":
        data = digits()
        order = torch.randperm(len(data), generator=g)
        n_val = int(len(data) * cfg.data.val_fraction)
        train = torch.utils.data.Subset(data, order[n_val:].tolist())
        val = torch.utils.data.Subset(data, order[:n_val].tolist())
        torch.manual_seed(cfg.training.seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(cfg.model.dropout), nn.Linear(128, 10))
        return model, train, val, F.cross_entropy
    tokens = repo_text()
    block = cfg.data.block_size
    starts = list(range(0, len(tokens) - block - 1, block))
    every = max(2, round(1 / cfg.data.val_fraction)) if cfg.data.val_fraction > 0 else 0
    val_starts = starts[::every] if every else []
    train_starts = [s for s in starts if s not in set(val_starts)]
    preset = GPT_PRESETS[cfg.model.preset]
    shape = {"vocab_size": 256, "block_size": max(block, preset.block_size), "dropout": cfg.model.dropout}
    if cfg.model.n_layer is not None:
        shape["n_layer"] = cfg.model.n_layer
    if cfg.model.n_embd is not None:
        shape["n_embd"] = cfg.model.n_embd
    import dataclasses

    torch.manual_seed(cfg.training.seed)
    model = GPT(dataclasses.replace(preset, **shape))
    return model, TextWindows(tokens, block, train_starts), TextWindows(tokens, block, val_starts), None


def run_job(cfg: JobConfig) -> dict:
    """Train as the config says; return rank 0's final metrics (others: {})."""
    from .trainer import DistributedTrainer

    model, train, val, criterion = _build(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    t = cfg.training
    strategy = t.strategy
    c = cfg.communication
    communication = None
    if c.compression != "none" or c.pattern != "nccl" or c.hierarchical:
        from .comm.optimizer import CommunicationOptimizer

        communication = CommunicationOptimizer(
            None if c.compression == "none" else c.compression, compression_ratio=c.compression_ratio,
            error_feedback=c.error_feedback, pattern=c.pattern, hierarchical=c.hierarchical,
            ranks_per_node=c.ranks_per_node)
    if strategy in ("ddp", "zero1"):
        from .strategies import DDPStrategy, Zero1Strategy

        cls = DDPStrategy if strategy == "ddp" else Zero1Strategy
        strategy = cls(bucket_cap_mb=c.bucket_cap_mb, communication=communication)
    lr, wd = t.lr, t.weight_decay
    trainer = DistributedTrainer(
        model, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd), strategy=strategy,
        gradient_accumulation_steps=t.gradient_accumulation_steps, gradient_clip_val=t.gradient_clip_val,
        timeout=t.timeout_s, seed=t.seed, checkpoint_dir=cfg.checkpoint.dir, checkpoint_every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last, resume=cfg.checkpoint.resume,
        save_on_preemption=cfg.checkpoint.save_on_preemption, log_dir=cfg.logging.dir, log_every=cfg.logging.every,
        progress=cfg.logging.progress and cfg.logging.dir is not None,
        mixed_precision=None if t.precision == "fp32" else t.precision,
        activation_checkpointing=_block_classes(model) if t.activation_checkpointing else None,
        memory_budget_bytes=t.memory_budget_gb * 2**30 if t.memory_budget_gb is not None else None,
    )
    ctx = trainer.context
    try:
        if ctx.is_main:
            print(f"dtrain: {type(trainer.module).__name__} with {n_params:,} "
                  f"parameters, strategy {trainer.strategy.name}, world size {ctx.world_size} on {ctx.device}, "
                  f"{len(train):,} training samples", flush=True)
        if t.batch_size == "auto" and trainer.batch_size is None and not _resuming(trainer):
            trainer.auto_batch_size(train, criterion)
            if ctx.is_main:
                print(f"dtrain: batch_size auto -> {trainer.batch_size} per rank ({trainer.batch_size_reason})", flush=True)
        if trainer.plan is not None and ctx.is_main:
            print(f"dtrain: strategy auto -> {trainer.plan.strategy}"
                  f"{' with CPU offload' if trainer.plan.cpu_offload else ''} ({trainer.plan.reason})", flush=True)
        trainer.fit(train, epochs=t.epochs, criterion=criterion, batch_size=t.batch_size, max_steps=t.max_steps,
                    log_every=cfg.logging.every,
                    on_step=(lambda step, m: print(f"step {step:6d} | loss {m['loss']:.4f}", flush=True))
                    if ctx.is_main else None)
        eval_batch = trainer.batch_size if t.batch_size == "auto" else t.batch_size
        metrics = trainer.evaluate(val, criterion, batch_size=eval_batch) if len(val) else {}
        state = trainer.strategy.model_state_dict(trainer.model)
        if ctx.is_main:
            print(f"dtrain: finished at step {trainer.step}, validation loss {metrics.get('loss', math.nan):.4f}",
                  flush=True)
            if cfg.output:
                Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, cfg.output)
            if cfg.checkpoint.dir:
                # The StatefulSet entrypoint idles instead of training again when this marker exists.
                Path(cfg.checkpoint.dir).mkdir(parents=True, exist_ok=True)
                (Path(cfg.checkpoint.dir) / "COMPLETED").write_text(f"step {trainer.step}\n")
        return metrics if ctx.is_main else {}
    finally:
        trainer.close()


def _block_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes of the repeated blocks (children of any ModuleList): what activation checkpointing wraps."""
    found = {type(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m}
    if not found:
        raise ConfigError(f"training.activation_checkpointing: {type(model).__name__} has no repeated blocks to checkpoint")
    return tuple(found)


def _resuming(trainer) -> bool:
    return trainer.checkpoints is not None and trainer.resume and trainer.checkpoints.latest_good() is not None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = args.overrides + (["checkpoint.resume=false"] if args.no_resume else [])
    try:
        if args.print_config:
            import yaml

            cfg = load_config(args.config if args.config else {}, overrides)
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if not args.config:
            parser.error("a config file is required (or --print-config)")
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"dtrain: invalid config: {err}", file=sys.stderr)
        return 2
    run_job(cfg)
    return 0


def entry() -> None:
    """The `dtrain` command: `main`, then leave without running the interpreter's finalizers.

    By the time `main` returns, the checkpoint, the output and the logs are written and closed and the
    process group is destroyed. What remains is interpreter and C++ static teardown, where a
    communication library's background thread can still be joinable and abort the process
    ("terminate called without an active exception"). Under torchrun such an abort after a finished
    job makes the agent restart the worker, which then waits for peers that have already left.
    """
    code = 1
    try:
        code = main()
    except SystemExit as stop:  # argparse errors and --help; sys.exit("message") means status 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()  # flush and close every logging handler, as a normal exit would
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    entry()
