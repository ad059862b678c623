"""`DistributedTrainer`: the object a training script imports.

It owns the distributed context, moves the model to this rank's device, wraps it with a strategy,
builds the optimizer over what the strategy exposes, and runs steps:

    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp")
    metrics = trainer.train_step((inputs, targets), nn.functional.cross_entropy)
    trainer.fit(dataset, epochs=3, criterion=nn.functional.cross_entropy, batch_size=32)

The trainer is the only module that knows all the others; strategies never import it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import time
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .activation import apply_activation_checkpointing
from .amp import DynamicLossScaler
from .checkpoint_layout import DirectoryLayout, agree_on_checkpoint, detect_layout, fetch_missing_files
from .checkpoint import (CheckpointCorruptError, CheckpointManager, CheckpointMismatchError, load_file, read_meta, rng_state, save_file,
                         set_rng_state, write_meta)
from .data import ShardedSampler
from .logs import get_logger, install_default_handler
from .monitor import Monitor, NullMonitor
from .strategies.ddp import DDP
from .runtime import DistributedContext, init_distributed
from .strategies.base import OptimizerFactory, Strategy
from .strategies.ddp_strategy import DDPStrategy
from .strategies.zero import FSDPStrategy, Zero1Strategy
from .stopping import StopSignals

__all__ = ["DistributedTrainer", "CollectiveTimeoutError"]

_log = logging.getLogger("distributed_training")

# Suffixes of single-file checkpoints, which a checkpoint directory's name should not look like.
_FILE_SUFFIXES = {".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle", ".tar", ".safetensors", ".zip"}

Criterion = Callable[[Any, Any], torch.Tensor]

log = get_logger()

#: ``fit(batch_size="auto")`` never picks more samples per rank than this, nor more than leaves
#: `AUTO_BATCH_MIN_STEPS` optimizer steps per epoch: the largest batch that fits in memory is seldom
#: the one that trains best, and on a CPU host (or for a small model) it is the whole shard.
AUTO_BATCH_MAX = 1024
AUTO_BATCH_MIN_STEPS = 4

_STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "ddp": DDPStrategy,
    "zero1": Zero1Strategy,
    "zero2": lambda: FSDPStrategy(reshard_after_forward=False),
    "zero3": FSDPStrategy,
    "fsdp": FSDPStrategy,
}


class DistributedTrainer:
    """Train a model data-parallel across the processes of a torchrun job.

    Args:
        model: the user's `nn.Module`, on any device (it is moved to this rank's device).
        optimizer: a `torch.optim.Optimizer` built over `model.parameters()`, or a callable that
            takes parameters and returns one (needed by sharded strategies, which build the
            optimizer over their shards).
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` / ``"fsdp"``, or a `Strategy`
            object (e.g. ``DDPStrategy(bucket_cap_mb=50)``, ``FSDPStrategy(mixed_precision=...)``).
            Sharded strategies need `optimizer` as a callable.
        gradient_accumulation_steps: micro-batches per optimizer step. `train_step` splits its batch
            into this many chunks; all but the last run under `no_sync`.
        gradient_clip_val: clip gradients to this global 2-norm before each step (None: no clipping).
        lr_scheduler: optional callable taking the optimizer and returning a scheduler, stepped
            once per optimizer step.
        context: a `DistributedContext`; by default one is created from torchrun's environment.
        timeout: collective timeout in seconds when the trainer creates the context.
        seed: seed of the data sharding permutation (the same on every rank).
        checkpoint_dir: where `fit` writes numbered checkpoints (``step_*/``) and, with `resume`,
            where it resumes from the latest good one: what torchrun's ``--max-restarts`` needs.
        checkpoint_every: save every this many optimizer steps during `fit` (and at its end).
        keep_last: how many recent checkpoints to keep; `best_metric` / `best_mode`: the checkpoint
            with the best value of this metric (from `train_step`'s metrics) is kept too.
        resume: resume `fit` from the latest good checkpoint in `checkpoint_dir`, if there is one.
        checkpoint_shared: whether `checkpoint_dir` is one directory seen by every node (True) or one
            per node (False); None (default) finds out with marker files on a multi-node job. With a
            directory per node, each node writes, verifies and prunes its own, and a resume picks the
            newest step complete on every node (see `distributed_training.checkpoint_layout`).
        resume: resume `fit` from the latest good checkpoint in `checkpoint_dir`, if there is one (it
            says so: "resumed from step N (path)"). Hyperparameters that changed since the checkpoint
            (learning rate and the other optimizer settings, the LR schedule, `max_steps`, `epochs`)
            take their new values, and the run logs what changed; what cannot change (parameter shapes,
            the optimizer class) is an error that names it. With ``resume=False`` an earlier run's
            checkpoints in `checkpoint_dir` are moved into ``previous_run_<k>/`` there, not mixed in.
        save_on_preemption: on SIGTERM (what Kubernetes and batch schedulers send before killing a
            job) `fit` stops at the next step boundary that every rank agrees on, writes a checkpoint
            there (with `checkpoint_dir`), and exits; SIGINT (Ctrl-C) stops the same way without the
            save. See `fit`.
        log_dir: write per-rank TensorBoard and JSONL metrics under ``log_dir/rank_<i>`` during `fit`
            (see `distributed_training.monitor.Monitor`); `log_every` steps apart; ranks slower than
            `straggler_threshold` times the median are flagged; `progress` draws a bar on rank 0.
        mixed_precision: ``"bf16"``, ``"fp16"`` or None: autocast for forward and loss, fp32 master
            weights. fp16 uses a `DynamicLossScaler` (ours; pass one to tune it), agreed across ranks.
            bf16 has fp32's exponent range and needs no scaler: passing one with bf16 is an error.
        activation_checkpointing: module classes (e.g. the transformer block class) or a callable
            ``(module, name) -> bool`` whose modules are recomputed in backward instead of keeping
            their activations (non-reentrant).
        communication: a `CommunicationOptimizer` (Top-K, bf16/fp16, PowerSGD, ring/tree, hierarchical)
            for the DDP-based strategies ``"ddp"`` and ``"zero1"``; its residuals are checkpointed.
        memory_budget_bytes: with ``strategy="auto"`` (and ``fit(batch_size="auto")`` where it
            estimates), the per-rank memory to plan for (default: the GPU's total memory, or this
            process's share of the host's on CPU). The chosen plan and its reason are in `self.plan`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        strategy: str | Strategy = "ddp",
        gradient_accumulation_steps: int = 1,
        gradient_clip_val: float | None = None,
        *,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        context: DistributedContext | None = None,
        timeout: float | None = None,
        seed: int = 0,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_last: int = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        resume: bool = True,
        checkpoint_shared: bool | None = None,
        save_on_preemption: bool = True,
        log_dir: str | os.PathLike | None = None,
        log_every: int = 10,
        straggler_threshold: float = 1.5,
        progress: bool = True,
        mixed_precision: str | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        activation_checkpointing: Any = None,
        communication: Any = None,
        memory_budget_bytes: float | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val must be positive or None, got {gradient_clip_val!r}")
        if mixed_precision not in (None, "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'bf16', 'fp16' or None, got {mixed_precision!r}")
        if loss_scaler is not None and mixed_precision != "fp16":
            raise ValueError(
                f"a loss scaler is for fp16 only: with mixed_precision={mixed_precision!r} gradients keep fp32's "
                "exponent range (bf16 has the same 8 exponent bits), so there is nothing to rescue from underflow"
            )
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive integer or None, got {checkpoint_every!r}")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write to")
        self.checkpoints = (CheckpointManager(checkpoint_dir, keep_last=keep_last, best_metric=best_metric,
                                              best_mode=best_mode) if checkpoint_dir is not None else None)
        if communication is not None:
            if strategy == "ddp":
                strategy = DDPStrategy(communication=communication)
            elif strategy == "zero1":
                strategy = Zero1Strategy(communication=communication)
            else:
                raise ValueError(
                    f"communication= applies to strategy 'ddp' or 'zero1' (gradient all-reduce), got {strategy!r}; "
                    "for a Strategy object, pass communication= to it"
                )
        self.plan = None
        self.memory_budget_bytes = memory_budget_bytes
        self._model_sizes = _model_sizes(model)  # before any wrapper shards the parameters
        if strategy == "auto":
            strategy, self.plan = _auto_strategy(model, memory_budget_bytes)
        if isinstance(strategy, str):
            if strategy not in _STRATEGIES:
                raise ValueError(f"strategy must be one of {sorted(_STRATEGIES) + ['auto']} or a Strategy object, got {strategy!r}")
            name, strategy = strategy, _STRATEGIES[strategy]()
            strategy.name = name  # "zero3" stays "zero3" in messages and checkpoints, not its class's "fsdp"
        elif not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a name or a Strategy object, got {type(strategy).__name__}")

        self._owns_context = context is None
        self.context = context if context is not None else init_distributed(timeout=timeout)
        install_default_handler(self.context.rank)
        if self.plan is not None:
            log.info("strategy auto -> %s%s (%s)", self.plan.strategy, " with CPU offload" if self.plan.cpu_offload
                     else "", self.plan.reason)
        self.strategy = strategy
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clip_val = gradient_clip_val
        self.seed = seed
        self.device = self.context.device

        model.to(self.device)
        if activation_checkpointing is not None:
            apply_activation_checkpointing(model, activation_checkpointing)
        self.model = strategy.setup_module(model, self.context)
        self.optimizer = strategy.setup_optimizer(optimizer, self.model)
        # DDP times its buckets (comm_hidden_pct / comm_wire_ms) only on the steps the monitor logs:
        # `_record_step` arms it for the step before each log step.
        self._measured_ddp = self.model if isinstance(self.model, DDP) and log_dir is not None else None
        if self._measured_ddp is not None:
            self._measured_ddp.measure_overlap = log_every == 1
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of the current epoch already trained (the data position)
        self.batch_size: int | None = None  # what batch_size="auto" chose (kept in checkpoints)
        self.batch_size_reason = ""
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.checkpoint_shared = checkpoint_shared
        self._layouts: dict[str, DirectoryLayout] = {}
        self.save_on_preemption = save_on_preemption
        # What the optimizer and the schedule were configured with, before any step or resume: compared
        # with what a checkpoint was configured with, to apply (and report) changed hyperparameters.
        self._configured_hparams = _hyperparameters(self.optimizer)
        self._configured_schedule = (copy.deepcopy(self.lr_scheduler.state_dict())
                                     if self.lr_scheduler is not None else None)
        self._fit_limits: dict[str, Any] = {}
        self._last_saved_step: int | None = None
        self._set_aside = False
        self.mixed_precision = mixed_precision
        if mixed_precision == "fp16" and self.device.type == "cpu" and self.context.is_main:
            log.warning("mixed_precision='fp16' on CPU: CPUs have no fast fp16 arithmetic, so training runs several "
                        "times slower than in fp32 (about 7x for a small GPT); use 'bf16' or fp32 on CPUs")
        self.loss_scaler = loss_scaler if loss_scaler is not None else (
            DynamicLossScaler(group=self.context.group) if mixed_precision == "fp16" else None)
        self.monitor = (Monitor(os.fspath(log_dir), rank=self.context.rank, world_size=self.context.world_size,
                                group=self.context.group, log_every=log_every,
                                straggler_threshold=straggler_threshold, progress=progress)
                        if log_dir is not None else NullMonitor())
        self.config = {
            "strategy": strategy.name,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_clip_val": gradient_clip_val,
            "seed": seed,
            "world_size": self.context.world_size,
            "model": type(self.module).__name__,
            "optimizer": type(self.optimizer).__name__,
        }

    # ------------------------------------------------------------------ steps
    @property
    def module(self) -> nn.Module:
        """The user's model, unwrapped."""
        return self.strategy.unwrap(self.model)

    def train_step(self, batch: Any, criterion: Criterion | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step on `batch`; returns ``{"loss", "lr"[, "grad_norm"]}``.

        `batch` is ``(inputs, targets)`` when a `criterion` is given (the loss is
        ``criterion(model(inputs), targets)``); without one, `batch` is the model's input and the
        model returns the loss (a tensor, a dict with ``"loss"``, or an object with ``.loss``).
        Inputs that are tuples are unpacked as positional arguments, dicts as keyword arguments.

        The loss values are 0-dim tensors on the device: reading one (``float(...)``) waits for the
        GPU, so do it only when logging.
        """
        self._heartbeat()
        try:
            return self._train_step(batch, criterion)
        except RuntimeError as err:
            if _is_timeout(err):
                raise CollectiveTimeoutError(self._diagnose_timeout(err)) from err
            raise

    def _train_step(self, batch: Any, criterion: Criterion | None) -> dict[str, torch.Tensor]:
        if not self.model.training:  # train() walks every module: not per step, and it would undo a
            self.model.train()       # submodule the user put in eval mode on purpose (frozen BatchNorm)
        batch = _to_device(batch, self.device)
        micro_batches = _split_batch(batch, self.gradient_accumulation_steps)
        total = sum(size for _, size in micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for k, (micro, size) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.strategy.no_sync(self.model):
                with self._autocast():
                    loss = self._loss(micro, criterion)
                # Weight by the micro-batch's share so that the accumulated gradient is the gradient of
                # the mean loss over the whole batch, even when the batch does not split evenly.
                weighted = loss * (size / total)
                (self.loss_scaler.scale_loss(weighted) if self.loss_scaler else weighted).backward()
            loss_sum += loss.detach().float() * (size / total)

        metrics: dict[str, torch.Tensor] = {"loss": loss_sum}
        if self.loss_scaler is not None:
            metrics["loss_scale"] = torch.tensor(self.loss_scaler.scale)
            # Unscale before clipping, so the threshold applies to the true gradients.
            self.loss_scaler.unscale_(p.grad for p in self.model.parameters())
        if self.gradient_clip_val is not None:
            metrics["grad_norm"] = self.strategy.clip_grad_norm(self.model, self.gradient_clip_val)
        metrics["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])
        if self.loss_scaler is not None:
            self.loss_scaler.step(self.optimizer, (p.grad for p in self.model.parameters()))
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        return metrics

    def _autocast(self):
        if self.mixed_precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _loss(self, batch: Any, criterion: Criterion | None) -> torch.Tensor:
        if criterion is None:
            return _model_loss(self.model, batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("with a criterion, each batch must be an (inputs, targets) pair")
        inputs, targets = batch
        return criterion(_call(self.model, inputs), targets)

    # ------------------------------------------------------------------ loops
    def fit(
        self,
        data: Dataset | DataLoader | Iterable,
        epochs: int = 1,
        criterion: Criterion | None = None,
        *,
        batch_size: int | str | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        max_steps: int | None = None,
        log_every: int = 50,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train until `epochs` epochs (or `max_steps` optimizer steps) are done in total; return one
        summary per epoch trained by this call.

        Both limits count from the start of training, not from this call, so a restarted job that
        resumes from a checkpoint (see `checkpoint_dir`) finishes the same run instead of a longer one.

        A map-style `Dataset` (or a `DataLoader` over one) is sharded across ranks with
        `ShardedSampler`: each rank sees distinct samples, reshuffled every epoch, and every rank runs
        the same number of steps; a resumed epoch skips the samples already trained. Any other
        iterable is used as given; ranks that run out of batches early stop everyone at the shortest
        (one tiny all-reduce per step), so uneven inputs never hang the job.
        `on_step(step, metrics)` is called every `log_every` steps, and after the last step, with float
        metrics. Losses (in `on_step` and in the returned summaries) are this rank's own, not averaged
        across ranks: averaging would cost a collective per step; `evaluate` gives the global figure.
        ``batch_size="auto"`` picks the largest batch that fits (see `auto_batch_size`) once; a run
        resumed from a checkpoint keeps the batch size it started with.

        Resuming (see `resume`) is logged on rank 0 ("resumed from step N (path)"); a run that the
        checkpoint shows complete logs so and returns ``[]`` without training. SIGINT and SIGTERM during
        `fit` stop every rank at the same step boundary shortly after either reaches any of them (a step
        or a checkpoint write in progress finishes first); on SIGTERM, with `save_on_preemption`, a
        checkpoint is written at that step. The signal then goes to the handler that was in place
        before `fit` (restored on return): by default SIGINT raises `KeyboardInterrupt` and SIGTERM
        ``SystemExit(143)``, so a preempted job exits with nothing lost and resumes where it stopped.
        """
        if not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
        if isinstance(batch_size, str) and batch_size != "auto":
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
        if not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive integer, got {log_every!r}")
        self._fit_limits = {"epochs": epochs, "max_steps": max_steps}
        resumed_from = self._resume_or_start_fresh()
        if resumed_from is not None and (self.epoch >= epochs or (max_steps is not None and self.step >= max_steps)):
            if self.context.is_main:
                _log.info("training is already complete at step %d (%s): nothing to do", self.step, resumed_from)
            return []
        if batch_size == "auto":
            if self.batch_size is None:  # not restored from a checkpoint: a resumed run keeps its batch size
                self.auto_batch_size(data, criterion)
            batch_size = self.batch_size
        loader = self._train_loader(data, batch_size, shuffle, drop_last, num_workers)
        with StopSignals(self.context, self.device, self._every_rank_has) as stop:
            try:
                history = self._train_epochs(loader, epochs, criterion, max_steps, log_every, on_step, stop)
            finally:
                self.monitor.end_progress()  # what the script prints next gets a line of its own
        stop.deliver()  # after a stop on a signal: raises (by default), with the handlers of before restored
        return history

    def _train_epochs(self, loader, epochs, criterion, max_steps, log_every, on_step,
                      stop: StopSignals) -> list[dict[str, float]]:
        sampler = getattr(loader, "sampler", None)
        sharded = isinstance(sampler, ShardedSampler)
        history = []
        done = lambda: max_steps is not None and self.step >= max_steps  # noqa: E731
        total = max_steps
        if sharded:
            per_epoch = self._agree_steps_per_epoch(loader, sampler)
            by_epochs = epochs * per_epoch
            total = by_epochs if max_steps is None else min(max_steps, by_epochs)
            if max_steps is not None and by_epochs < max_steps:
                log.info("fit: epochs=%d of %d steps end training at step %d, before max_steps=%d (pass more epochs "
                         "to reach it)", epochs, per_epoch, by_epochs, max_steps)
        self.monitor.start(total)
        while self.epoch < epochs and not done():
            skip = self.batch_in_epoch
            if sharded:
                sampler.set_epoch(self.epoch, start=skip * loader.batch_size)
                skip = 0
            elif hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            started = time.perf_counter()
            loss_sum, steps, metrics, logged, exhausted = None, 0, None, True, False
            # A DataLoader draws a base seed from the global RNG when iterated; keep that draw off the
            # stream training uses, so that a resumed epoch sees the same random numbers as an unbroken one.
            with torch.random.fork_rng(devices=[]):
                batches = iter(loader)
            for _ in range(skip):  # a resumed epoch over a loader we cannot seek: replay its start
                next(batches, None)
            last_end = time.perf_counter()
            while not done():
                if sharded and self.batch_in_epoch >= per_epoch:
                    exhausted = True  # a rank with a longer dataset stops with the others
                    break
                batch = next(batches, None)
                fetched = time.perf_counter()
                has_batch = batch is not None if sharded else self._every_rank_has(batch is not None)
                if not has_batch:
                    exhausted = True
                    break
                metrics = self.train_step(batch, criterion)
                self.batch_in_epoch += 1
                now = time.perf_counter()
                metrics = self._record_step(batch, metrics, step_time=now - last_end, data_time=fetched - last_end)
                last_end = now
                loss_sum = metrics["loss"] if loss_sum is None else loss_sum + metrics["loss"]
                steps += 1
                logged = self.step % log_every == 0
                if on_step is not None and logged:
                    on_step(self.step, {k: float(v) for k, v in metrics.items()})
                if self.checkpoint_every and self.step % self.checkpoint_every == 0:
                    self._save_numbered(metrics)
                if stop.agreed() is not None:
                    break
            if on_step is not None and not logged and metrics is not None:
                on_step(self.step, {k: float(v) for k, v in metrics.items()})
            history.append({
                "epoch": self.epoch,
                "steps": steps,
                "train_loss": float(loss_sum / steps) if steps else float("nan"),
                "seconds": time.perf_counter() - started,
            })
            if not exhausted:
                break  # max_steps reached inside the epoch: it stays the current one
            self.epoch += 1
            self.batch_in_epoch = 0
        if stop.signal is None:
            if self.checkpoints is not None and (not self.checkpoint_every or self.step % self.checkpoint_every):
                self._save_numbered(metrics)
            stop.finish()  # a signal during the last steps: acted on by every rank or by none
        if stop.signal is not None:
            self._stop_on_signal(stop.signal, metrics)
        return history

    def _record_step(self, batch: Any, metrics: dict[str, torch.Tensor], *, step_time: float,
                     data_time: float) -> dict[str, torch.Tensor]:
        """Hand the step just trained to the monitor (with DDP's overlap figures on log steps); returns
        the metrics with those figures added."""
        if not self._monitoring:
            return metrics
        comm = None
        ddp = self._measured_ddp
        log_every = self.monitor_log_every
        if ddp is not None and self.step % log_every == 0:
            seconds, count = ddp.pop_exposed_comm_seconds()
            comm = seconds / count if count else None
            overlap = ddp.pop_overlap_stats()
            if overlap["passes"]:
                metrics = {**metrics, "comm_hidden_pct": torch.tensor(100.0 * overlap["hidden_fraction"]),
                           "comm_wire_ms": torch.tensor(1e3 * overlap["comm_s"] / overlap["passes"])}
        if ddp is not None:
            # Timing every bucket costs events and a side-stream wait per bucket: measure only the step
            # that will be logged next.
            measure = (self.step + 1) % log_every == 0
            if ddp.measure_overlap != measure:
                ddp.measure_overlap = measure
        self.monitor.record_step(self.step, metrics, samples=_batch_size(batch), tokens=_token_count(batch),
                                 step_time=step_time, data_time=data_time, comm_time=comm)
        return metrics

    def _stop_on_signal(self, sig, metrics: dict[str, torch.Tensor] | None) -> None:
        """Every rank, at the step boundary they agreed on: save on SIGTERM if asked, and say why we stop."""
        ctx = self.context
        if sig == signal.SIGTERM and self.save_on_preemption and self.checkpoints is not None:
            if self._last_saved_step != self.step:
                self._save_numbered(metrics)
            if ctx.is_main:
                _log.warning("stopping at step %d on %s: checkpoint saved to %s", self.step, sig.name,
                             self.checkpoints.path_for(self.step))
        elif ctx.is_main:
            saved = (f"; the last checkpoint is at step {self._last_saved_step}" if self._last_saved_step is not None
                     else "")
            _log.warning("stopping at step %d on %s (no checkpoint written for the stop%s)", self.step, sig.name,
                         saved)

    def _resume_or_start_fresh(self) -> str | None:
        """Load the latest good checkpoint if resuming (returning its path), or, with ``resume=False``
        at the start of training, move an earlier run's checkpoints aside."""
        if self.checkpoints is None:
            return None
        ctx = self.context
        if not self.resume:
            if self.step == 0 and not self._set_aside:
                self._set_aside = True
                layout = self._layout(self.checkpoints.path_for(0))
                # Each directory's writer (rank 0, or each node's first rank with a directory per node).
                moved = self.checkpoints.set_aside() if layout.writer_of[ctx.rank] == ctx.rank else None
                if moved is not None:
                    _log.warning("resume is off: moved the checkpoints already in %s to %s; training starts "
                                 "from step 0", self.checkpoints.directory, moved)
                ctx.barrier()  # nobody writes into a directory before its writer has cleared it
            return None
        found = self._resume_point()
        if found is None or int(found[1]["step"]) <= self.step:
            return None
        if found[2] is not None:  # a directory per node: bring each node the rank files it lacks
            fetch_missing_files(found[0], self.context, self._layout(found[0]), found[2])
        self.load_checkpoint(found[0])
        if ctx.is_main:
            _log.info("resumed from step %d (%s)", self.step, found[0])
        return found[0]

    @property
    def _monitoring(self) -> bool:
        return not isinstance(self.monitor, NullMonitor)

    @property
    def monitor_log_every(self) -> int:
        return getattr(self.monitor, "log_every", 1)

    def get_performance_metrics(self) -> dict[str, Any]:
        """Throughput, communication overhead and the cluster view over the run (see `Monitor`)."""
        return self.monitor.get_performance_metrics()

    def _any_rank_has(self, has_batch: bool) -> bool:
        return not self._every_rank_has(not has_batch)

    def _every_rank_has(self, has_batch: bool) -> bool:
        """Whether every rank still has a batch (one tiny all-reduce): stop together, never hang."""
        if self.context.world_size == 1:
            return has_batch
        device = self.device if self.context.backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if has_batch else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.context.group)
        return bool(flag.item())

    def _agree_steps_per_epoch(self, loader: DataLoader, sampler: ShardedSampler) -> int:
        """Steps per epoch of a sharded loader, the same on every rank.

        Every rank shards the dataset *it* was given; if their lengths differ (each rank read its own
        file, say), so do their step counts, and a rank that stopped early would leave the others
        waiting in a collective forever. One small all-gather at the start of `fit` finds out, and
        every rank then runs the smallest count (with a warning naming each rank's length)."""
        samples = len(range(sampler.rank, sampler.total, sampler.num_replicas))
        steps = samples // loader.batch_size if loader.drop_last else -(-samples // loader.batch_size)
        ctx = self.context
        if ctx.world_size == 1:
            return steps
        device = self.device if ctx.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([sampler.dataset_len, steps], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, mine, group=ctx.group)
        lengths = [int(t[0]) for t in gathered]
        counts = [int(t[1]) for t in gathered]
        if len(set(lengths)) > 1 or len(set(counts)) > 1:
            warnings.warn(
                "fit(): the dataset's length differs across ranks ("
                + ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
                + f"), which gives {counts} steps per epoch; every rank runs {min(counts)} so that none waits for "
                "the others forever. fit() shards a map-style dataset as one dataset seen by every rank: for data "
                "of your own per rank, pass an IterableDataset (ranks then stop together at the shortest)",
                RuntimeWarning, stacklevel=3,
            )
        return min(counts)

    def _save_numbered(self, metrics: dict[str, torch.Tensor] | None) -> None:
        values = {k: float(v) for k, v in (metrics or {}).items()}
        path = self.checkpoints.path_for(self.step)
        layout = self._layout(path)
        if not layout.shared and self.checkpoints.best_metric is not None:
            # Losses are each rank's own: every directory must rank checkpoints by the same (rank 0's) values.
            box = [values]
            dist.broadcast_object_list(box, src=0, group=self.context.group)
            values = box[0]
        self.save_checkpoint(path, metrics=values)
        if layout.writer_of[self.context.rank] == self.context.rank:
            self.checkpoints.finalize(self.step, values)
        self.context.barrier()
        self._last_saved_step = self.step

    def _layout(self, path: str | os.PathLike) -> DirectoryLayout:
        """Which ranks share the directory that checkpoint `path` goes into (found once per directory;
        a collective the first time)."""
        parent = os.path.dirname(os.path.abspath(os.fspath(path)))
        if parent not in self._layouts:
            self._layouts[parent] = detect_layout(parent, self.context, self.checkpoint_shared)
        return self._layouts[parent]

    def latest_checkpoint(self) -> tuple[str, dict[str, Any]] | None:
        """(path, meta) of the checkpoint `fit` resumes from, or None; every rank must call it.

        With one shared directory this is `CheckpointManager.latest_good`. With one directory per node,
        the newest step that is complete and intact on every node, so that no two nodes load different
        steps.
        """
        found = self._resume_point() if self.checkpoints is not None else None
        return found[:2] if found is not None else None

    def _resume_point(self) -> tuple[str, dict[str, Any], dict | None] | None:
        layout = self._layout(self.checkpoints.path_for(0))
        if layout.shared:
            found = self.checkpoints.latest_good()
            return (*found, None) if found is not None else None
        return agree_on_checkpoint(self.checkpoints, self.context, layout)

    def _train_loader(self, data, batch_size, shuffle, drop_last, num_workers):
        ctx = self.context
        if isinstance(data, DataLoader):
            if isinstance(data.dataset, IterableDataset) or isinstance(data.sampler, ShardedSampler):
                return data
            if data.batch_size is None:
                raise ValueError("fit() needs a DataLoader with a batch_size (batch_sampler loaders are used as given)")
            sampler = ShardedSampler(data.dataset, ctx.world_size, ctx.rank, shuffle=shuffle, seed=self.seed,
                                     drop_last=drop_last)
            return DataLoader(
                data.dataset, batch_size=data.batch_size, sampler=sampler, collate_fn=data.collate_fn,
                num_workers=data.num_workers, pin_memory=data.pin_memory, drop_last=data.drop_last or drop_last,
            )
        if isinstance(data, IterableDataset) or not isinstance(data, Dataset):
            return data
        if batch_size is None or batch_size < 1:
            raise ValueError(f"fit() on a Dataset needs batch_size >= 1, got {batch_size!r}")
        sampler = ShardedSampler(data, ctx.world_size, ctx.rank, shuffle=shuffle, seed=self.seed, drop_last=drop_last)
        return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                          pin_memory=self.device.type == "cuda", drop_last=drop_last)

    # ------------------------------------------------------------------ batch size
    def auto_batch_size(self, data: Dataset, criterion: Criterion | None = None, *, method: str | None = None,
                        headroom: float = 0.9, max_batch_size: int | None = AUTO_BATCH_MAX,
                        min_steps_per_epoch: int = AUTO_BATCH_MIN_STEPS) -> int:
        """The largest batch per rank (samples per optimizer step) that fits in memory; every rank agrees.

        Two methods (`method=None` chooses):

        * ``"probe"`` (GPUs, with strategies whose forward runs no collective: DDP, ZeRO-1): forward and
          backward on real batches from `data` under ``no_sync``, doubling the micro-batch until the
          first out-of-memory error, then bisecting; each failure frees the cache. The optimizer state
          that the first step will create (Adam's two fp32 moments, unless it exists already) and
          ``1 - headroom`` of the device are held back during the search.
        * ``"estimate"`` (CPU, and sharded strategies, whose per-rank search could leave peers waiting
          in a collective): `headroom` of the memory budget (``memory_budget_bytes``, else the GPU's
          memory or this process's share of host memory), less the per-rank weights, gradients and Adam
          state of this strategy (`distributed_training.planner.state_bytes`), divided by the
          activation bytes autograd saves per sample (measured on two real batches).

        Each rank's answer is all-reduced with MIN. With gradient accumulation the search is over the
        micro-batch, and the batch is that times `gradient_accumulation_steps`. The result (also in
        `self.batch_size`, its explanation in `self.batch_size_reason`) never exceeds `max_batch_size`
        (default `AUTO_BATCH_MAX`, 1024; None: no such cap) nor what leaves `min_steps_per_epoch`
        optimizer steps per epoch of this rank's share of `data` (default `AUTO_BATCH_MIN_STEPS`, 4).
        The reason says which bound applied. Dropout's RNG and BatchNorm's statistics are restored after the
        search; if it fails on one rank, every rank raises.
        """
        if isinstance(data, DataLoader) or isinstance(data, IterableDataset) or not isinstance(data, Dataset):
            raise TypeError("batch_size='auto' needs a map-style Dataset (it builds trial batches from it), got "
                            f"{type(data).__name__}")
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        ctx, accum = self.context, self.gradient_accumulation_steps
        if len(data) == 0:
            raise ValueError("batch_size='auto' got an empty dataset")
        if not isinstance(min_steps_per_epoch, int) or min_steps_per_epoch < 1:
            raise ValueError(f"min_steps_per_epoch must be an integer >= 1, got {min_steps_per_epoch!r}")
        share = -(-len(data) // ctx.world_size)  # a rank's samples per epoch (the sampler pads the last ones)
        limit = max(1, share // (min_steps_per_epoch * accum))
        limit_why = f"{min_steps_per_epoch} steps per epoch over this rank's {share} samples"
        if max_batch_size is not None:
            if not isinstance(max_batch_size, int) or max_batch_size < accum:
                raise ValueError(f"max_batch_size must be an integer >= gradient_accumulation_steps ({accum}), "
                                 f"got {max_batch_size!r}")
            if max_batch_size // accum < limit:
                limit, limit_why = max_batch_size // accum, f"max_batch_size={max_batch_size}"
        collective_forward = getattr(self.strategy, "collective_forward", False)
        if method is None:
            method = "probe" if self.device.type == "cuda" and not collective_forward else "estimate"
        if method not in ("probe", "estimate"):
            raise ValueError(f"method must be 'probe', 'estimate' or None, got {method!r}")
        if method == "probe" and collective_forward:
            raise ValueError(f"method='probe' cannot be used with strategy {self.strategy.name!r}: its forward runs "
                             "collectives, and a rank that runs out of memory would leave its peers waiting")

        def make(b: int) -> Any:
            return _to_device(torch.utils.data.default_collate([data[i % len(data)] for i in range(b)]), self.device)

        def loss_of(_model: nn.Module, batch: Any) -> torch.Tensor:
            with self._autocast():
                return self._loss(batch, criterion)

        # The search must leave no trace: dropout's RNG and BatchNorm's statistics are put back.
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        self.model.train()
        failure, micro, why = None, 0, ""
        try:
            if method == "probe":
                micro, why = self._probe_batch(make, loss_of, limit, headroom)
            else:
                micro, why = self._estimate_batch(make, loss_of, limit, headroom)
        except Exception as err:  # every rank must still reach the agreement below, or its peers wait there
            failure = err
        finally:
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], self.device)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        if ctx.world_size > 1:
            agreed = torch.tensor([micro], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctx.group)
            if failure is None and 0 < int(agreed) != micro:
                why += f"; another rank fits only {int(agreed)}"
            micro = int(agreed)
        if failure is not None:
            raise failure
        if micro < 1:
            raise RuntimeError(f"rank {ctx.rank}: batch_size='auto' failed on another rank (its error says why)")
        self.batch_size = micro * accum
        if micro == limit:
            why += f"; capped at {limit} by {limit_why}"
        self.batch_size_reason = why + (f"; x {accum} accumulation steps" if accum > 1 else "")
        log.info("batch_size auto -> %d per rank (%s)", self.batch_size, self.batch_size_reason)
        return self.batch_size

    def _probe_batch(self, make, loss_of, limit: int, headroom: float) -> tuple[int, str]:
        from .planner import find_max_batch_size

        reserve = self._first_step_reserve()
        if self.device.type == "cuda":
            reserve += (1 - headroom) * torch.cuda.get_device_properties(self.device).total_memory
        held = torch.empty(int(reserve), dtype=torch.uint8, device=self.device)

        def try_batch(b: int) -> None:
            try:
                with self.strategy.no_sync(self.model):
                    loss_of(self.model, make(b)).float().backward()
            finally:
                self.optimizer.zero_grad(set_to_none=True)

        try:
            micro = find_max_batch_size(try_batch, limit=limit)
        finally:
            del held
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return micro, (f"probed: micro-batches up to {micro} fit (search limit {limit}) with {reserve / 2**30:.2f} "
                       "GiB held back for optimizer state, compression residuals and headroom")

    def _estimate_batch(self, make, loss_of, limit: int, headroom: float) -> tuple[int, str]:
        from .planner import activation_bytes_per_sample, max_batch_size_for_budget, state_bytes

        ctx = self.context
        budget = self.memory_budget_bytes if self.memory_budget_bytes is not None else _default_budget()
        params, unit = self._model_sizes
        kind = _planner_kind(self.strategy)
        fixed = state_bytes(kind, params, ctx.world_size, largest_unit_params=unit,
                            param_dtype_bytes=2 if self.mixed_precision else 4)
        per_sample = activation_bytes_per_sample(self.model, make, loss_of)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            micro = min(limit, max_batch_size_for_budget(headroom * budget, fixed, per_sample))
        except ValueError as err:
            raise ValueError(f"rank {ctx.rank}: batch_size='auto' with memory_budget_bytes={budget:.0f}: {err}") from None
        return micro, (f"estimated: {headroom:.0%} of {budget / 2**30:.2f} GiB, less {fixed / 2**30:.2f} GiB of {kind} "
                       f"model state, at {per_sample / 2**20:.2f} MiB of activations per sample gives micro-batches "
                       f"of {micro} (limit {limit})")

    def _first_step_reserve(self) -> float:
        """Bytes the first real step will allocate that a forward/backward does not: Adam's two fp32
        moments per trainable parameter (unless the optimizer state exists, after a step or a resume),
        and the fp32 error-feedback residuals of Top-K or PowerSGD compression."""
        trainable = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad)
        reserve = 0.0 if any(len(v) for v in self.optimizer.state.values()) else 8.0 * trainable
        reducer = getattr(self.model, "bucket_reducer", None)
        if getattr(reducer, "compression", None) in ("topk", "powersgd") and getattr(reducer, "error_feedback", False):
            reserve += 4.0 * trainable
        return reserve

    @torch.no_grad()
    def evaluate(
        self,
        data: Dataset | DataLoader,
        criterion: Criterion | None = None,
        *,
        batch_size: int | None = None,
        metrics: Mapping[str, Callable[[Any, Any], torch.Tensor]] | None = None,
    ) -> dict[str, float]:
        """Mean loss (and optional per-sample metrics) over the whole dataset, across all ranks.

        Each rank evaluates its exact shard (no padding, nothing counted twice) with the unwrapped
        module, so uneven shard sizes cannot stall a collective; one all-reduce sums the results.
        `metrics` maps a name to ``fn(outputs, targets) -> per-batch mean``, weighted by batch size.
        """
        ctx = self.context
        if isinstance(data, DataLoader):
            dataset, bs, collate = data.dataset, data.batch_size, data.collate_fn
        else:
            dataset, bs, collate = data, batch_size, None
        if bs is None:
            raise ValueError("evaluate() needs batch_size (or a DataLoader with one)")
        if metrics and criterion is None:
            raise ValueError("evaluate(metrics=...) needs a criterion: metrics are computed from (outputs, targets)")
        sampler = ShardedSampler(dataset, ctx.world_size, ctx.rank, shuffle=False, pad=False)
        loader = DataLoader(dataset, batch_size=bs, sampler=sampler, collate_fn=collate)
        # Sharded models gather parameters inside forward, a collective: every rank must run as many
        # forwards as the others, so a rank whose shard is exhausted repeats a batch with weight 0.
        # Replicated models evaluate the bare module, with no collective per batch.
        # (A sharded model keeps its parameters in the wrapper's shards even in a world of one.)
        lockstep = self.strategy.collective_forward and ctx.world_size > 1
        module = self.model if self.strategy.collective_forward else self.module
        was_training = module.training
        module.eval()
        names = ["loss", *(metrics or {})]
        sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)
        batches, previous = iter(loader), None
        try:
            while True:
                batch = next(batches, None)
                if lockstep:
                    if not self._any_rank_has(batch is not None):
                        break
                    if batch is None and previous is None:
                        batch = next(iter(DataLoader(dataset, batch_size=1, collate_fn=collate)))
                elif batch is None:
                    break
                weight = 1.0
                if batch is None:
                    batch, weight = previous, 0.0
                previous = batch
                batch = _to_device(batch, self.device)
                n = _batch_size(batch) * weight
                if criterion is None:
                    values = [_model_loss(module, batch)]
                else:
                    inputs, targets = batch
                    outputs = _call(module, inputs)
                    values = [criterion(outputs, targets)]
                    values += [fn(outputs, targets) for fn in (metrics or {}).values()]
                for k, v in enumerate(values):
                    sums[k] += v.detach().double() * n
                sums[-1] += n
        finally:
            module.train(was_training)
        if ctx.world_size > 1:
            dist.all_reduce(sums, group=ctx.group)
        count = sums[-1].item()
        return {name: (sums[k].item() / count if count else float("nan")) for k, name in enumerate(names)}

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | os.PathLike, metrics: dict[str, float] | None = None) -> None:
        """Write a checkpoint *directory* at `path`, e.g. ``"checkpoints/last"`` (see
        `distributed_training.checkpoint`); every rank must call it.

        Each rank writes ``rank<r>.pt`` (its RNG states and buffers; its shards under ZeRO/FSDP; the
        model and optimizer on rank 0 under DDP), then rank 0 writes ``meta.pt`` (step, epoch, data
        position, scheduler, configured hyperparameters, config, metrics, checksums) last, after its own
        checksum ``meta.pt.sha256``. Files are written atomically. A path that looks like a file name
        (``last.pt``) still becomes a directory, with a warning. When each node has a directory of its
        own (see `checkpoint_shared`), each node's first rank writes a ``meta.pt`` there, listing that
        node's files.
        """
        path = os.fspath(path)
        ctx = self.context
        suffix = os.path.splitext(path.rstrip("/\\"))[1]
        if suffix.lower() in _FILE_SUFFIXES and not os.path.isdir(path) and ctx.is_main:
            message = (f"save_checkpoint({path!r}) writes a directory named {os.path.basename(path)!r} (one file per "
                       f"rank plus meta.pt), not a single {suffix} file; name it without a suffix, e.g. "
                       f"{path[:-len(suffix)]!r}, and load it with load_checkpoint")
            warnings.warn(message, stacklevel=2)
        part: dict[str, Any] = {"rng": rng_state()}
        reducer = getattr(self.model, "bucket_reducer", None)
        if hasattr(reducer, "state_dict"):
            part["communication"] = reducer.state_dict()  # per-rank: error-feedback residuals differ by rank
        if self.strategy.sharded_checkpoint:
            part.update(self.strategy.sharded_state(self.model, self.optimizer))
        elif ctx.is_main:
            part["model"] = self.strategy.model_state_dict(self.model)
            part["optimizer"] = self.strategy.optimizer_state_dict(self.optimizer)
        if "model" not in part:
            # Buffers (BatchNorm's running statistics) are updated by each rank from its own data: the
            # other ranks' are state too. (Rank 0's are in the model; FSDP's shards carry every rank's.)
            part["buffers"] = {k: b.detach().cpu().clone() for k, b in self.module.named_buffers()}
        digest = save_file(part, os.path.join(path, f"rank{ctx.rank}.pt"))
        digests = [digest]
        if ctx.world_size > 1:
            digests = [None] * ctx.world_size
            dist.all_gather_object(digests, digest, group=ctx.group)
        layout = self._layout(path)
        if layout.writer_of[ctx.rank] == ctx.rank:  # rank 0, or each node's first rank with a directory per node
            meta = {
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "batch_size": self.batch_size,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
                "world_size": ctx.world_size,
                "strategy": self.strategy.name,
                "checkpoint_format": _checkpoint_format(self.strategy),
                "config": self.config,
                "optimizer_hparams": self._configured_hparams,
                "fit": dict(self._fit_limits),
                "metrics": dict(metrics or {}),
                **layout.checksums(ctx.rank, digests),
            }
            if isinstance(self.model, DDP):
                meta["ddp_bucket_groups"] = self.model.bucket_groups()
            write_meta(meta, path)
        ctx.barrier()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what `save_checkpoint` wrote, at this world size or (ZeRO/FSDP) any other.

        Every file read, ``meta.pt`` included, is checked against its checksum before it is loaded; a
        corrupt one raises `CheckpointCorruptError` naming it. RNG states are restored when the world
        size is unchanged (a different world draws different random streams anyway). Each rank gets
        back its own buffers (BatchNorm statistics); when the world size changed, ranks that did not
        exist before take rank 0's. Hyperparameters configured differently from the checkpoint's keep
        their new values, and the changes are logged (see `resume`); a different optimizer class or
        parameter shape is an error that names it.
        """
        path = os.fspath(path)
        ctx = self.context
        meta_path = os.path.join(path, "meta.pt")
        if not os.path.isfile(meta_path) and not os.path.isfile(path):
            raise FileNotFoundError(f"rank {ctx.rank}: {meta_path!r} does not exist: not a complete checkpoint")
        meta = read_meta(path)
        saved_format = meta.get("checkpoint_format") or _FORMAT_OF_NAME.get(meta.get("strategy"))
        if saved_format is not None and saved_format != _checkpoint_format(self.strategy):
            # Until one format serves every strategy (issue 13), say so instead of failing on a missing key.
            raise CheckpointMismatchError(
                f"checkpoint {path!r} was written by strategy {meta.get('strategy')!r}, whose checkpoint format "
                f"({saved_format}) strategy {self.strategy.name!r} cannot read yet: resume with strategy "
                f"{meta.get('strategy')!r}, or start a new run (another checkpoint directory, or resume=False / "
                "dtrain --no-resume); trainer.full_state_dict() of the old run loads into any strategy")
        saved_optimizer = (meta.get("config") or {}).get("optimizer")
        if saved_optimizer is not None and saved_optimizer != self.config["optimizer"]:
            raise CheckpointMismatchError(f"checkpoint {path!r} holds the state of a {saved_optimizer} optimizer, and this trainer's "
                             f"is a {self.config['optimizer']}: optimizer state cannot carry over to another class "
                             "(start a new run: another checkpoint directory, or resume=False)")
        old_world = int(meta["world_size"])
        cache: dict[int, dict] = {}

        def read(k: int) -> dict:
            if k not in cache:
                name = f"rank{k}.pt"
                # rank_checksums (a directory per node) also covers rank files fetched from other nodes.
                cache[k] = load_file(os.path.join(path, name), meta.get("rank_checksums", meta["checksums"]).get(name))
            return cache[k]

        try:
            if self.strategy.sharded_checkpoint:
                self.strategy.load_sharded_state(self.model, self.optimizer, read, int(meta["world_size"]))
            else:
                state = read(0)
                if "model" not in state:
                    raise ValueError("rank0.pt holds no model: the checkpoint was written by a sharded strategy")
                self.strategy.load_model_state_dict(self.model, state["model"])
                self.strategy.load_optimizer_state_dict(self.optimizer, state["optimizer"])
            own = read(ctx.rank) if ctx.rank < old_world else {}
            if "buffers" in own:
                buffers = dict(self.module.named_buffers())
                with torch.no_grad():
                    for key, value in own["buffers"].items():
                        buffers[key].copy_(value)
        except CheckpointCorruptError:
            raise
        except (RuntimeError, ValueError, KeyError) as err:
            raise type(err)(f"checkpoint {path!r} does not fit this model: {err}") from None
        if isinstance(self.model, DDP) and "ddp_bucket_groups" in meta and int(meta["world_size"]) == ctx.world_size:
            self.model.set_bucket_groups(meta["ddp_bucket_groups"])
        if int(meta["world_size"]) == ctx.world_size:
            set_rng_state(read(ctx.rank)["rng"])
            reducer = getattr(self.model, "bucket_reducer", None)
            if hasattr(reducer, "load_state_dict") and "communication" in read(ctx.rank):
                reducer.load_state_dict(read(ctx.rank)["communication"])
        else:
            warnings.warn(f"checkpoint {path!r} was written by {meta['world_size']} ranks: RNG states not restored")
        changes = self._apply_changed_hyperparameters(meta)
        if self.lr_scheduler is not None:
            # A schedule added since the checkpoint starts where it would be after the saved steps.
            changes += self._restore_schedule(meta.get("lr_scheduler") or {"last_epoch": int(meta["step"])})
        changes += [f"{key}: {meta['fit'].get(key)} -> {value}" for key, value in self._fit_limits.items()
                    if "fit" in meta and key in meta["fit"] and meta["fit"][key] != value]
        changes += [f"{key}: {meta['config'][key]} -> {value}" for key, value in self.config.items()
                    if key not in ("world_size", "optimizer") and key in meta.get("config", {})
                    and meta["config"][key] != value]
        if changes and ctx.is_main:
            _log.warning("the configuration changed since checkpoint %s was written; the new values apply: %s", path,
                         "; ".join(changes))
        if self.loss_scaler is not None and meta.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        self.step = int(meta["step"])
        self.epoch = int(meta.get("epoch", 0))
        self.batch_in_epoch = int(meta.get("batch_in_epoch", 0))
        if meta.get("batch_size") is not None:
            self.batch_size = int(meta["batch_size"])

    def _apply_changed_hyperparameters(self, meta: dict[str, Any]) -> list[str]:
        """Loading the optimizer's state brings back the saved param groups' hyperparameters: where this
        trainer was configured differently from the run that wrote the checkpoint, put the new value
        back, and describe the change. Values the run itself changed (a schedule's lr) are left alone."""
        saved = meta.get("optimizer_hparams")
        groups = self.optimizer.param_groups
        if saved is None or len(saved) != len(groups):
            return []  # a checkpoint from before hyperparameters were recorded
        changes = []
        for i, (old, new, group) in enumerate(zip(saved, self._configured_hparams, groups)):
            for key, value in new.items():
                if self.lr_scheduler is not None and key in ("lr", "initial_lr"):
                    continue  # the schedule is rebuilt from its new configuration (see _restore_schedule)
                if key in old and not _same(old[key], value):
                    group[key] = copy.deepcopy(value)
                    where = f"param_groups[{i}]." if len(groups) > 1 else ""
                    changes.append(f"optimizer {where}{key}: {_show(old[key])} -> {_show(value)}")
        return changes

    def _restore_schedule(self, saved: dict[str, Any]) -> list[str]:
        """Bring the LR scheduler to the checkpoint's step *as it is configured now*.

        Loading the saved scheduler state would bring back the old run's base learning rates and
        schedule parameters. Instead the scheduler is reset to its state at construction and stepped
        as many times as the saved one was (microseconds per step); with an unchanged configuration that
        reproduces the saved state exactly, and with a changed one (lr, warmup, decay, a schedule given
        as a function) the new schedule applies from here on. Returns what differs from the saved state.
        """
        sched, fresh = self.lr_scheduler, self._configured_schedule
        for group, configured in zip(self.optimizer.param_groups, self._configured_hparams):
            for key in ("lr", "initial_lr"):
                if key in configured:
                    group[key] = copy.deepcopy(configured[key])
        sched.load_state_dict(copy.deepcopy(fresh))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": we only replay
            for _ in range(int(saved.get("last_epoch", 0)) - int(fresh.get("last_epoch", 0))):
                sched.step()
        now = sched.state_dict()
        counters = {"last_epoch", "_step_count", "_last_lr", "_is_initial", "_get_lr_called_within_step"}
        changes = [f"lr_scheduler {key}: {_show(saved.get(key))} -> {_show(now.get(key))}"
                   for key in sorted(set(saved) | set(now), key=str)
                   if key not in counters and not _same(saved.get(key), now.get(key))]
        if "_last_lr" in saved and not _same(saved["_last_lr"], now.get("_last_lr")):
            changes.append(f"learning rate at step {saved.get('last_epoch')}: "
                           f"{_show(saved['_last_lr'])} -> {_show(now.get('_last_lr'))}")
        return changes

    # ----------------------------------------------------------- hang diagnosis
    def _heartbeat(self) -> None:
        """Publish this rank's step in the rendezvous store, so a timeout can name who is missing."""
        store = _store()
        if store is not None and self.context.world_size > 1:
            store.set(f"distributed_training/heartbeat/{self.context.rank}", str(self.step))

    def _diagnose_timeout(self, err: Exception) -> str:
        ctx = self.context
        where = f"rank {ctx.rank}: a collective timed out during training step {self.step + 1}"
        op = _operation_of(err)
        if op:
            where += f" in {op}"
        store = _store()
        if store is None:
            return f"{where}: {err}"
        behind = []
        for r in range(ctx.world_size):
            key = f"distributed_training/heartbeat/{r}"
            try:
                seen = int(store.get(key)) if store.check([key]) else None
            except Exception:
                seen = None
            if seen is None or seen < self.step:
                behind.append(f"rank {r} (last seen at step {seen + 1 if seen is not None else 'none'})")
        if behind:
            return f"{where}; missing: {', '.join(behind)} never reached step {self.step + 1}. Cause: {err}"
        return f"{where}; every rank reached step {self.step + 1}, so a rank is stuck inside it. Cause: {err}"

    # -------------------------------------------------------------- teardown
    def close(self, barrier: bool = True) -> None:
        """Remove the strategy's hooks and, if the trainer created it, destroy the process group."""
        self.monitor.close()
        self.strategy.teardown(self.model)
        if self._owns_context:
            self.context.shutdown(barrier=barrier)

    def __enter__(self) -> "DistributedTrainer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(barrier=exc_type is None)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A copy of each param group's settings (lr, betas, weight decay, ...), without the parameters."""
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return repr(value)


# Checkpoint formats by strategy class: FSDP's (ZeRO-2/3, any world size), ZeRO-1's, the replicated one.
_FORMAT_OF_NAME = {"ddp": "replicated", "zero1": "zero1", "zero2": "fsdp", "zero3": "fsdp", "fsdp": "fsdp"}


def _checkpoint_format(strategy: Strategy) -> str:
    if isinstance(strategy, FSDPStrategy):
        return "fsdp"
    if isinstance(strategy, Zero1Strategy):
        return "zero1"
    return "replicated" if not strategy.sharded_checkpoint else type(strategy).__name__


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))


def _default_budget() -> float:
    """Per-rank memory: the GPU's total, or this process's share of the host's."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory)
    import psutil

    return psutil.virtual_memory().total / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", _world_size())))


def _model_sizes(model: nn.Module) -> tuple[int, int]:
    """Parameter count (shared tensors once) and the largest block's (a child of any ModuleList)."""
    params = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in child.parameters()) for m in model.modules() if isinstance(m, nn.ModuleList)
              for child in m]
    return params, max(blocks) if blocks else params


def _planner_kind(strategy: Strategy) -> str:
    """The planner's name for a strategy's memory layout (unknown strategies are taken as DDP, the largest)."""
    if isinstance(strategy, FSDPStrategy):
        kw = strategy.fsdp_kwargs
        if not kw.get("reshard_after_forward", True):
            return "zero2"
        return "zero3_offload" if kw.get("cpu_offload") else "zero3"
    return "zero1" if isinstance(strategy, Zero1Strategy) else "ddp"


def _auto_strategy(model: nn.Module, budget: float | None):
    """Pick a strategy from the planner's memory estimates (see `distributed_training.planner`)."""
    from .planner import choose_strategy

    params, unit = _model_sizes(model)
    plan = choose_strategy(params, _world_size(), budget if budget is not None else _default_budget(),
                           largest_unit_params=unit)
    if plan.strategy == "ddp":
        return DDPStrategy(), plan
    strategy = FSDPStrategy(reshard_after_forward=plan.strategy == "zero3", cpu_offload=plan.cpu_offload)
    strategy.name = plan.strategy
    return strategy, plan


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the configured timeout; the message names the missing ranks."""


def _is_timeout(err: Exception) -> bool:
    text = str(err).lower()
    return "timeout" in text or "timed out" in text


def _operation_of(err: Exception) -> str:
    text = str(err)
    for marker in ("DDP ", "FSDP "):
        if marker in text:
            return text[text.index(marker):].split(":")[0]
    return ""


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


# ---------------------------------------------------------------- batch helpers
def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0


def _token_count(batch: Any) -> int | None:
    """Tokens in a language-model batch: the elements of an integer input tensor."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() and inputs.dim() >= 2:
        return inputs.numel()
    return None


def _split_batch(batch: Any, parts: int) -> list[tuple[Any, int]]:
    """Split every tensor of `batch` into `parts` chunks along dim 0; return (chunk, size) pairs.

    A batch smaller than `parts` (the short last batch of an epoch) is split into one chunk per sample:
    accumulation only bounds memory, so fewer micro-batches give the same gradient.
    """
    n = _batch_size(batch)
    parts = min(parts, n) if n else 1
    if parts == 1:
        return [(batch, n)]

    def chunk(x, k):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n:
            return torch.tensor_split(x, parts)[k]
        if isinstance(x, Mapping):
            return {key: chunk(v, k) for key, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(chunk(v, k) for v in x)
        return x

    pieces = [chunk(batch, k) for k in range(parts)]
    return [(piece, _batch_size(piece)) for piece in pieces]


def _call(module: nn.Module, inputs: Any):
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


_NO_CRITERION = ("without a criterion, each batch is the model's input and the model must return the loss; for a "
                 "model that returns outputs (logits), pass criterion=..., e.g. criterion=torch.nn.functional."
                 "cross_entropy, and batches of (inputs, targets)")


def _model_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a model computes itself (no criterion), with an error that says what to do otherwise."""
    try:
        output = _call(module, batch)
    except TypeError as err:
        # The usual cause: an (inputs, targets) batch unpacked into a forward that takes only inputs.
        if isinstance(batch, (tuple, list)) and "argument" in str(err):
            raise TypeError(f"{err}: {_NO_CRITERION}") from err
        raise
    return _extract_loss(output)


def _extract_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        if output.numel() != 1:
            raise ValueError(f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss: "
                             f"{_NO_CRITERION}")
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if hasattr(output, "loss"):
        return output.loss
    raise TypeError(
        "without a criterion the model must return the loss (a tensor, a dict with 'loss', or an object with .loss); "
        f"it returned {type(output).__name__}"
    )
