"""`fit`'s epoch loop (`EpochLoop`, a mixin of `DistributedTrainer`, under `trainer_fit.Fitting`): the steps
of each epoch (a resumed one from where the checkpoint's data position says), the monitor's record of each
step (`trainer_recording`), the evaluations and periodic checkpoints, and stopping on a signal at a step
boundary every rank agreed on."""

from __future__ import annotations

import math
import signal
import time
import warnings

import torch

from .checkpoint import rng_state, set_rng_state
from .checkpoint_layout import replicate_checkpoint
from .data import ShardedSampler, agree_steps_per_epoch, stop_workers
from .logs import get_logger
from .stopping import SAVING_SIGNALS, StopSignals
from .trainer_recording import StepRecording
from .validation import PeriodicEvaluation

__all__ = ["EpochLoop"]

log = get_logger()


class EpochLoop(StepRecording):
    """`fit`'s loop over epochs and steps; `Fitting.fit` sets it up (see `DistributedTrainer`)."""

    def _epoch_offset(self, loader) -> int:
        """Samples of the current epoch already trained by the whole job (a checkpoint from before the
        count was kept: its step count times this job's global batch, right at an unchanged size)."""
        if self.samples_in_epoch is None:
            self.samples_in_epoch = self.batch_in_epoch * loader.batch_size * loader.sampler.num_replicas
        return self.samples_in_epoch

    def _train_epochs(self, loader, *args, **kwargs) -> list[dict[str, float]]:
        """`_run_epochs`; on an error, the epoch's loader workers are stopped before it leaves (`stop_workers`)."""
        try:
            return self._run_epochs(loader, *args, **kwargs)
        except BaseException:
            stop_workers(self._open_batches, loader)
            raise
        finally:
            self._open_batches = None

    def _run_epochs(self, loader, epochs, criterion, max_steps, log_every, on_step,
                    stop: StopSignals, evaluation: PeriodicEvaluation | None = None) -> list[dict[str, float]]:
        sampler = getattr(loader, "sampler", None)
        sharded = isinstance(sampler, ShardedSampler)
        history = []
        self._epoch_finished = False
        reached = lambda: evaluation is not None and evaluation.reached is not None  # noqa: E731
        done = lambda: (max_steps is not None and self.step >= max_steps) or reached()  # noqa: E731
        total = max_steps
        if sharded:
            sampler.set_epoch(self.epoch)  # a whole epoch's steps
            per_epoch = agree_steps_per_epoch(loader, sampler, self.context)
            if per_epoch == 0 and sampler.shard_length() >= (loader.batch_size if loader.drop_last else 1):
                raise ValueError(  # (this rank has a step: another's data has none)
                    f"fit(): another rank's training data gives no step in an epoch (this rank's: "
                    f"{sampler.dataset_len} sample(s)); the warning above names each rank's dataset length: "
                    "an empty dataset or a wrong path on that rank?")
            if per_epoch == 0:  # (every rank agreed on the fewest)
                raise ValueError(
                    f"fit(): the training data gives no step in an epoch: {sampler.dataset_len} sample(s) over "
                    f"{sampler.num_replicas} data-parallel replica(s) in batches of {loader.batch_size}"
                    + (" with drop_last=True" if loader.drop_last else "") + ". An empty dataset or a wrong path?")
            # The steps left in the current epoch, where the data position says (in samples: the job
            # may have trained them at another size) and every rank agrees.
            offset = self._epoch_offset(loader)
            sampler.set_epoch(self.epoch, offset=offset)
            left = agree_steps_per_epoch(loader, sampler, self.context, warn=False) if offset else per_epoch
            by_epochs = self.step + left + max(0, epochs - self.epoch - 1) * per_epoch
            total = by_epochs if max_steps is None else min(max_steps, by_epochs)
            if max_steps is not None and by_epochs < max_steps:
                log.info("fit: epochs=%d of %d steps end training at step %d, before max_steps=%d (pass more epochs "
                         "to reach it)", epochs, per_epoch, by_epochs, max_steps)
        self.monitor.start(total, step=self.step)  # a resumed run's bar and ETA start where it resumed
        self.data_wait_s = 0.0  # seconds this call waited for its next batch (a loader's start included)
        if evaluation is not None:
            evaluation.start()
        self._peer_watch()  # (on every rank before the first batch: a rank whose data raises is named from there)
        while self.epoch < epochs and not done():
            skip = self.batch_in_epoch
            if sharded:
                sampler.set_epoch(self.epoch, offset=self._epoch_offset(loader))
                epoch_end = self.batch_in_epoch + left
                left = per_epoch  # the epochs after the first start at their beginning
                skip = 0
            elif hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            started = time.perf_counter()
            loss_sum, steps, metrics, logged, exhausted, evaluated = None, 0, None, True, False, None
            # A DataLoader draws a base seed from the global RNG when iterated; keep that draw off the
            # stream training uses, so that a resumed epoch sees the same random numbers as an unbroken one.
            restored = None
            if skip and self._epoch_rng is not None:  # a resumed epoch over data fit cannot seek: from the states
                restored = rng_state()                # the epoch began with (an iterable shuffling at iter(), or a
                set_rng_state(self._epoch_rng)        # loader's workers' seeds), then the checkpoint's again
            with torch.random.fork_rng(devices=[]), self._fetching(sharded):
                batches = self._open_batches = iter(loader)
            if skip:  # a resumed epoch over a loader we cannot seek: replay its start, drawing nothing from
                state = restored if restored is not None else rng_state()  # the streams the checkpoint restored
                with self._fetching(sharded):
                    for _ in range(skip):
                        next(batches, None)
                set_rng_state(state)
            elif not sharded:
                self._epoch_rng = rng_state()
            last_end = time.perf_counter()
            while not done():
                if sharded and self.batch_in_epoch >= epoch_end:
                    exhausted = True  # a rank with a longer dataset stops with the others
                    break
                began = time.perf_counter()  # (after the last step's logging, on_step, evaluation, save)
                with self._fetching(sharded):  # (an error of the data: published where the peers wait)
                    batch = next(batches, None)
                fetched = agreed = time.perf_counter()
                if sharded:
                    has_batch = batch is not None
                else:
                    # (a collective: a peer dead here is named, as in a step)
                    with self._watched(f"the agreement on a batch before training step {self.step + 1}"):
                        having = self.context.ranks_where(batch is not None)
                    ranks = self.context.meeting_ranks
                    has_batch = having == ranks
                    agreed = time.perf_counter()  # (its wait: a slower rank's fetch, not this one's work)
                    if 0 < having < ranks and self.context.is_main:
                        who = self.strategy.member  # ("rank", or a parameter server's "worker")
                        warnings.warn(
                            f"fit(): epoch {self.epoch} ends at step {self.step}, where {ranks - having} of {ranks} "
                            f"{who}s' data ran out: the batches the other {having} still had are not trained in "
                            f"this epoch (every {who} stops with the first to run out). Give each {who} as many "
                            "batches, or pass a map-style dataset, which fit shards exactly", stacklevel=4)
                if not has_batch:
                    exhausted = True
                    break
                waited = self._straggler_probe()
                metrics = self.train_step(batch, criterion)
                self.batch_in_epoch += 1
                if sharded:  # the step's global batch: the next B x W positions, or the epoch's rest
                    # (counted as the sampler deals them, alike on every rank: a batch's first tensor may not
                    # be batch-first, and the last step's replicas may hold unequal shares)
                    self.samples_in_epoch = min(self.samples_in_epoch + loader.batch_size * sampler.num_replicas,
                                                sampler.total)
                    self._epoch_finished = self.batch_in_epoch >= epoch_end  # what a checkpoint of this step says
                now = time.perf_counter()
                # (the fetch alone: since `last_end` came the last step's logging, global loss, callbacks,
                # save and stop agreement, which the monitor counted as data loading: 34-40% of a small step)
                self.data_wait_s += fetched - began
                if waited is not None:  # the measured step: its data and compute less its wait on the others
                    # (not what one rank did after the last step alone)
                    self._own_time = self._own_work(now - began - waited - (agreed - fetched), fetched - began)
                    self._probe_wait = waited + (agreed - fetched)  # (its communication: a wait for the others)
                if self.step % log_every == 0 or self.step % self._log_every == 0:  # (fit's or the bar's)
                    metrics = self._with_global_loss(metrics)  # (alike on every rank: the arguments are)
                metrics = self._record_step(batch, metrics, step_time=now - last_end, data_time=fetched - began,
                                            span=now - began)
                # (what checkpoints record: with a log_dir, a log step's hold the communication figures too)
                if not self._best_checked and (self.step % log_every == 0 or not self._monitoring):
                    self._best_checked = self._check_best_metric(evaluation, metrics)
                last_end = now
                loss_sum = metrics["loss"] if loss_sum is None else loss_sum + metrics["loss"]
                steps += 1
                logged = self.step % log_every == 0
                if on_step is not None and logged:
                    on_step(self.step, {k: float(v) for k, v in metrics.items()})
                best_now = False
                if evaluation is not None and evaluation.due(self.step):
                    evaluated = self._evaluate_now(evaluation)
                    metrics = {**metrics, **evaluated}  # what the checkpoint of this step records
                    best_now = self.checkpoints is not None and evaluation.feeds(self.checkpoints.best_metric)
                    last_end = time.perf_counter()  # the evaluation is not the next step's time
                if (self.checkpoint_every and self.step % self.checkpoint_every == 0) or best_now:
                    self._save_numbered(metrics)
                told = self.strategy.stop_requested(self.model)
                if told is not None:  # a parameter server's server got a signal: stop with it
                    stop.request(signal.Signals(told[1]), f"parameter server {told[0]} got {signal.Signals(told[1]).name}")
                with self._watched(f"the agreement on a stop signal after training step {self.step}"):
                    stopping = stop.agreed() is not None  # (a collective: a failed peer is named here too)
                if stopping:
                    break
            if on_step is not None and not logged and metrics is not None:
                on_step(self.step, {k: float(v) for k, v in metrics.items()})
            if not sharded and exhausted and not steps and not skip and not history and self.batch_in_epoch == 0:
                raise ValueError(f"fit(): the training data ({type(loader).__name__}) yielded no batch in epoch "
                                 f"{self.epoch} on at least one rank (every rank stops with the first to run out). "
                                 "An empty dataset or a wrong path?")
            if not sharded and exhausted and not steps and not skip and history and self.batch_in_epoch == 0:
                if self.context.is_main:  # an iterator (a generator) is used up after one pass: say so, once
                    warnings.warn(f"fit(): the training data yielded no batch in epoch {self.epoch}, after "
                                  f"{len(history)} epoch(s) that had some: an iterator (a generator?) is used up "
                                  f"after one pass, so training stops here; to train {epochs} epochs pass data "
                                  "that can be iterated again (a list, a Dataset, a DataLoader)", stacklevel=4)
                break
            if steps or not exhausted:  # (an epoch resumed at its end, by an older checkpoint, trained nothing)
                history.append({
                    "epoch": self.epoch,
                    "steps": steps,
                    "train_loss": float(loss_sum / steps) if steps else float("nan"),
                    "seconds": time.perf_counter() - started,
                    **(evaluated or {}),  # the epoch's last evaluation
                })
                loss = history[-1]["train_loss"]
                if steps and self.precision.scaler is None and not math.isfinite(loss):
                    # (with checkpoints, the next save stops it: `_refuse_non_finite`)
                    log.warning("fit(): epoch %d's mean training loss on rank %d is %s: the weights are likely no "
                                "longer finite (a lower learning rate, gradient clipping, or the data?)", self.epoch,
                                self.context.rank, loss)
            if not exhausted:
                break  # max_steps reached inside the epoch: it stays the current one
            self.epoch += 1
            self.batch_in_epoch = 0
            self.samples_in_epoch = 0
            self._epoch_finished = False
        if stop.signal is None:
            if evaluation is not None and evaluation.last_step != self.step and metrics is not None:
                evaluated = self._evaluate_now(evaluation)  # the end of training is always evaluated
                metrics = {**metrics, **evaluated}
                if history:
                    history[-1].update(evaluated)
            if self.checkpoints is not None and self._last_saved_step != self.step and (
                    not self.checkpoint_every or self.step % self.checkpoint_every):
                self._save_numbered(metrics)
            with self._watched(f"the agreement on a stop signal after training step {self.step}"):
                stop.finish()  # a signal during the last steps: acted on by every rank or by none
        if stop.signal is not None:
            self._stop_on_signal(stop.signal, metrics, bool(stop.received))
        return history

    def _check_best_metric(self, evaluation: PeriodicEvaluation | None, metrics: dict | None = None) -> bool:
        """Refuse a `best_metric` that this fit never records (it kept no best checkpoint, silently, while
        `keep_last` pruned the others): an evaluation's value is checked before training, anything else
        against the first step's metrics, or the first log step's with a log_dir (whose hold the communication
        and pipeline figures too); the same names on every rank, so every rank raises alike.
        Returns whether the check is done."""
        best = self.checkpoints.best_metric if self.checkpoints is not None else None
        evaluated = evaluation.keys if evaluation is not None else []
        if best is None or best in evaluated:
            return True
        if best.startswith("val_"):
            if evaluation is None:
                raise ValueError(f"best_metric={best!r} is an evaluation's value: pass fit an eval_dataset (and "
                                 "eval_every to evaluate during training)")
            raise ValueError(f"best_metric={best!r} is none of the values the evaluation gives "
                             f"({', '.join(evaluated)})")
        if metrics is None:
            return False  # a training metric: known after the first step
        if best not in metrics:
            also = f" and the evaluation's ({', '.join(evaluated)})" if evaluated else ""
            raise ValueError(f"best_metric={best!r} is none of the values this fit records: train_step's "
                             f"({', '.join(metrics)}){also}")
        return True

    def _evaluate_now(self, evaluation: PeriodicEvaluation) -> dict[str, float]:
        """`evaluation` at this step, on every rank (a peer dying meanwhile is named, as in a step)."""
        with self._watched(f"the evaluation after step {self.step}"):
            return evaluation.run(self, self.step)

    def _stop_on_signal(self, sig, metrics: dict[str, torch.Tensor] | None, signalled: bool = True) -> None:
        """Every rank, at the step boundary they agreed on: save on SIGTERM if asked, and say why we stop.
        `signalled`: whether this rank got the signal itself (its peers may have got it for all)."""
        ctx = self.context
        if sig in SAVING_SIGNALS and self.save_on_preemption and self.checkpoints is not None:
            if self._last_saved_step != self.step:
                self._save_numbered(metrics)
            self.wait_for_checkpoint()  # checkpoint_async: complete before the process is told to exit
            path = self.checkpoints.path_for(self.step)
            # A directory per node: a node told to stop may be leaving for good (a scale-down); every
            # node gets its files, so the others can resume from this step without it.
            replicate_checkpoint(path, ctx, self._layout(path), signalled=signalled)
            if ctx.is_main:
                log.warning("stopping at step %d on %s: checkpoint saved to %s", self.step, sig.name,
                             self.checkpoints.path_for(self.step))
        elif ctx.is_main:
            saved = (f"; the last checkpoint is at step {self._last_saved_step}" if self._last_saved_step is not None
                     else "")
            log.warning("stopping at step %d on %s (no checkpoint written for the stop%s)", self.step, sig.name,
                         saved)
