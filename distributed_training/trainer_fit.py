"""`DistributedTrainer.fit` and its epoch loop (`Fitting`, a mixin of the trainer): the sharded loader,
the steps of each epoch (resumed where a checkpoint left off), the monitor's record of each step, the
periodic checkpoints, and stopping on a signal at a step boundary every rank agreed on."""

from __future__ import annotations

import signal
import time
import warnings
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .batches import batch_size_of
from .checkpoint import rng_state, set_rng_state
from .checkpoint_layout import replicate_checkpoint
from .data import MapDataset, ShardedSampler, agree_steps_per_epoch, map_style, train_loader
from .global_batch import GlobalBatch, plan_global_batch
from .logs import get_logger
from .stopping import SAVING_SIGNALS, StopSignals
from .trainer_arguments import check_same_options
from .trainer_step import check_criterion
from .trainer_recording import StepRecording
from .validation import PeriodicEvaluation

__all__ = ["Fitting"]

log = get_logger()
Criterion = Callable[[Any, Any], torch.Tensor]


class Fitting(StepRecording):
    """`fit` and its loop; the trainer provides the state it reads (see `DistributedTrainer`)."""

    #: The last `fit`'s evaluation during training (its `history` holds every evaluation's values), if any.
    evaluation: PeriodicEvaluation | None = None

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
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        allow_global_batch_change: bool = False,
        eval_dataset: Dataset | DataLoader | None = None,
        eval_every: int | None = None,
        eval_batch_size: int | None = None,
        eval_metrics: str | list[str] | dict[str, Callable] = "auto",
        eval_target: dict[str, float] | None = None,
    ) -> list[dict[str, float]]:
        """Train until `epochs` epochs (or `max_steps` optimizer steps) are done in total; return one
        summary per epoch trained by this call.

        Both limits count from the start of training, not from this call, so a restarted job that
        resumes from a checkpoint (see `checkpoint_dir`) finishes the same run instead of a longer one.

        A map-style `Dataset` (or a `DataLoader` over one) is sharded across ranks with
        `ShardedSampler`: each rank sees distinct samples, reshuffled every epoch, and every rank runs
        the same number of steps; a resumed epoch skips the samples already trained. Any other
        iterable is used as given, each item one batch (a list with `batch_size` is refused: samples
        or batches? a list of samples goes in as ``MapDataset(samples)``; any other indexable
        collection with a length, e.g. a Hugging Face ``datasets.Dataset``, is taken as samples when
        a batch size is given); ranks that run out of batches early stop everyone at the shortest
        (one tiny all-reduce per step), so uneven inputs never hang the job.
        `on_step(step, metrics)` is called every `log_every` steps, and after the last step, with float
        metrics. Losses (in `on_step` and in the returned summaries) are this rank's own, not averaged
        across ranks: averaging would cost a collective per step; `evaluate` gives the global figure.
        ``batch_size="auto"`` picks the largest batch that fits (see `auto_batch_size`) once; a run
        resumed from a checkpoint keeps the batch size it started with.

        `batch_size` is per data-parallel replica: the global batch is ``batch_size x dp_world_size``
        and changes with it. ``global_batch_size=B`` fixes the samples per optimizer step over the
        whole job instead (not with `batch_size`; a map-style dataset): at W data-parallel replicas
        each takes B / W, in ``ceil((B / W) / micro_batch_size)`` accumulated micro-batches.
        `micro_batch_size` (the most samples one forward and backward takes on a replica) defaults to
        what the run's first start used: B / W there, cut in the trainer's
        `gradient_accumulation_steps`; a checkpoint keeps it. A job resumed at another size
        recomputes both (and logs them) and continues from the exact sample of the epoch where the
        checkpoint was, so every sample is trained once per epoch and each step averages the gradient
        over B samples, as at the old size. A size W that does not divide B is an error naming the
        sizes that do, unless ``allow_global_batch_change=True``: then the nearest multiple of W is
        trained, and the learning rate (the optimizer's ``lr``, and a scheduler's base rates) is scaled
        by the same factor (the linear scaling rule), with a warning that says so. See
        `distributed_training.global_batch`. Each epoch's last global batch has the samples left
        (padded by wrapping around to a multiple of W, or dropped with `drop_last`).

        Resuming (see `resume`) is logged on rank 0 ("resumed from step N (path)"); a run that the
        checkpoint shows complete logs so and returns ``[]`` without training. SIGINT, SIGTERM and SIGHUP
        during `fit` stop every rank at the same step boundary shortly after one reaches any of them (a
        step or a checkpoint write in progress finishes first); on SIGTERM or SIGHUP (a closed terminal),
        with `save_on_preemption`, a checkpoint is written at that step. The signal then goes to the
        handler that was in place before `fit` (restored on return): by default SIGINT raises
        `KeyboardInterrupt`, SIGTERM ``SystemExit(143)`` and SIGHUP ``SystemExit(129)``, so a preempted
        job exits with nothing lost and resumes where it stopped. A second Ctrl-C (a second after the
        first) raises `KeyboardInterrupt` at once, wherever the step is stuck.

        Evaluation during training: with `eval_dataset` (a map-style validation set), every
        `eval_every` optimizer steps (counted from the start of training, as a resumed run counts them)
        and once after the last step, the model is evaluated on the whole set, sharded over the
        data-parallel replicas with every sample counted once. ``val_loss``, ``val_samples`` and what
        `eval_metrics` asks for (``"auto"``: ``accuracy`` and ``top5`` for a classifier, ``perplexity``
        for a language model; or a list of ``accuracy``, ``top<k>``, ``perplexity``; or a mapping of
        ``fn(outputs, targets)`` as `evaluate` takes) are logged (rank 0), written to the monitor
        (``val/*`` per rank, ``cluster/val_*``), added to the epoch summaries, kept in
        ``self.evaluation.history``, and recorded with the checkpoints: ``best_metric="val_accuracy"``
        keeps the best evaluated model (an evaluation step gets a checkpoint when `best_metric` is one
        of its values). `eval_batch_size` defaults to the training batch of a replica. Evaluation
        changes nothing in training: the steps after it are those of a run without it, bit for bit.
        ``eval_target={"val_accuracy": 0.97}`` (one evaluated value; at least it for accuracies, at most
        for losses and perplexity) ends training at the first evaluation that reaches it, as `max_steps`
        would (a final checkpoint included); ``self.evaluation.reached`` then holds its step, value and
        the seconds of training since this call started (time to accuracy; every evaluation in
        ``history`` has its seconds too). A run resumed later does not know the target was reached.
        See `distributed_training.validation`.
        """
        if not isinstance(epochs, int) or epochs < 0:
            hint = " (fit's arguments are data, epochs, criterion: pass criterion= by name)" if callable(epochs) else ""
            raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}{hint}")
        check_criterion(criterion)
        if isinstance(batch_size, str) and batch_size != "auto":
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
        if not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive integer, got {log_every!r}")
        if map_style(data) and (batch_size is not None or global_batch_size is not None):
            if isinstance(data, (list, tuple)):  # samples (as DataLoader reads it) or batches (as fit did)?
                name, value = (("batch_size", batch_size) if batch_size is not None else
                               ("global_batch_size", global_batch_size))
                raise ValueError(
                    f"fit({name}={value}) with a {type(data).__name__}: is it a list of samples or of batches? Of "
                    f"samples: pass MapDataset(samples) (distributed_training.data), which fit shards and batches "
                    f"by {name}; of batches: leave out {name} (each item is then one batch, on every rank as it is)")
            data = MapDataset(data)  # e.g. a Hugging Face datasets.Dataset: sharded and batched like a Dataset
        if map_style(eval_dataset):
            eval_dataset = MapDataset(eval_dataset)  # (evaluate takes a list of samples as it is)
        plan = None
        if global_batch_size is not None:
            self._check_global_batch_arguments(data, batch_size, micro_batch_size)
            plan = plan_global_batch(global_batch_size, self.dp_world_size, allow_change=allow_global_batch_change,
                                     others=self.context.world_size // self.dp_world_size)
            # Before a resume, which compares the configured rate with the checkpoint's (and says so).
            self._scale_learning_rate(plan.lr_scale)
        elif micro_batch_size is not None:
            raise ValueError("fit(micro_batch_size=...) needs global_batch_size (with batch_size, a replica's batch "
                             "is cut by the trainer's gradient_accumulation_steps)")
        if eval_dataset is None and (eval_every is not None or eval_target is not None):
            name = f"eval_every={eval_every!r}" if eval_every is not None else f"eval_target={eval_target!r}"
            raise ValueError(f"fit({name}) needs an eval_dataset to evaluate on")
        evaluation = None
        if eval_dataset is not None:  # checked now; its default batch size is known once the loader is built
            evaluation = PeriodicEvaluation(eval_dataset, eval_every, 1 if eval_batch_size is None else eval_batch_size,
                                            eval_metrics, criterion, eval_target)
        self.evaluation = evaluation
        self._best_checked = self._check_best_metric(evaluation)  # (a training metric: at the first step)
        self._own_time = None  # (a measure of an earlier fit's window that never logged)
        if not self.strategy.trains:  # a parameter server's server: it serves the workers' fit
            # A signal (torchrun's SIGTERM reaches every rank) waits until the workers, which stop on it,
            # have left: a server that died at once would fail their last pulls.
            # The workers hear of it in the server's replies, and stop (and save) at a step they agree on.
            with StopSignals(self.context, self.device, self.context.every_rank) as stop:
                self.strategy.serve(self.model, lambda: int(stop.pending() or 0))
                stop.finish()
            stop.deliver()
            return []
        if not self.context.independent:  # (ranks that never meet: a parameter server's ssp / async workers)
            check_same_options({
                "data kind": "a map-style dataset, sharded" if _sharded(data) else "an iterable of batches",
                "epochs": epochs,
                "max_steps": max_steps, "shuffle": shuffle, "drop_last": drop_last,
                "batch_size": "auto" if batch_size == "auto" else "a number or None",
                "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
                "allow_global_batch_change": allow_global_batch_change,
                "eval_dataset": None if eval_dataset is None else "set", "eval_every": eval_every,
                "eval_metrics": eval_metrics, "eval_target": eval_target,
            }, "fit", self.context.group)
        self._fit_limits = {"epochs": epochs, "max_steps": max_steps}
        self._fit_global_batch = plan is not None and "pipeline_parallel_size" not in self.config
        resumed_from = self._resume_or_start_fresh()
        if resumed_from is None and self.step == 0 and self.context.is_main and self.monitor.found_earlier_records:
            log.warning("%s holds an earlier run's logs: this run's, from step 0, are appended to them (TensorBoard "
                        "draws both on one curve; the plot tool keeps the last run). Give another log_dir (dtrain: "
                        "logging.dir) to keep them apart", self.monitor.log_dir)
        if resumed_from is not None and (self.epoch >= epochs or (max_steps is not None and self.step >= max_steps)):
            if self.context.is_main:
                log.info("training is already complete at step %d (%s): nothing to do (to train further, raise "
                         "epochs or max_steps; to start again from step 0, resume=False)", self.step, resumed_from)
            return []
        if plan is not None:
            plan = self._adopt_global_batch(plan, micro_batch_size, resumed_from)
            batch_size = plan.per_rank
        if (isinstance(data, DataLoader) and plan is None and isinstance(batch_size, int)
                and batch_size != data.batch_size):
            warnings.warn(f"fit(batch_size={batch_size}) is not used: the DataLoader given brings its own batch size "
                          f"({data.batch_size}), which fit keeps; pass the dataset instead (fit shards it and batches "
                          "it by batch_size), or build the DataLoader with the batch you want", UserWarning,
                          stacklevel=2)
        if batch_size == "auto":
            if self.batch_size is None:  # not restored from a checkpoint: a resumed run keeps its batch size
                self.auto_batch_size(data, criterion)
            batch_size = self.batch_size
        loader = train_loader(data, self.context, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                              num_workers=num_workers, seed=self.seed, dp_rank=self.dp_rank,
                              dp_world_size=self.dp_world_size, loader_batch_size=plan and plan.per_rank)
        self._check_last_batch(loader)
        self._check_dataset_length(loader, resumed_from)
        if evaluation is not None and eval_batch_size is None and not isinstance(eval_dataset, DataLoader):
            # What one training forward takes on a replica (its batch cut in the accumulation steps).
            size = getattr(loader, "batch_size", None)
            if not isinstance(size, int):
                raise ValueError("fit(eval_dataset=...) over an iterable of batches needs eval_batch_size")
            evaluation.batch_size = -(-size // self.gradient_accumulation_steps)
        with StopSignals(self.context, self.device, self.context.every_rank) as stop:
            try:
                history = self._train_epochs(loader, epochs, criterion, max_steps, log_every, on_step, stop,
                                             evaluation)
                self.strategy.end_fit(self.model)  # the parameter server: the final parameters, on every rank
            except BaseException as err:
                # An error of this rank's outside the blocks that publish it (fit's logging, `on_step`, a
                # warning turned into an error): told to the peers, which wait in the next collective.
                self._publish_own_error(err, f"fit, after training step {self.step}")
                self._abandon_checkpoint_write()  # checkpoint_async: a peer may be gone; never wait on it
                raise
            finally:
                self.monitor.end_progress()  # what the script prints next gets a line of its own
            self.wait_for_checkpoint()  # checkpoint_async: the last checkpoint is complete before fit returns
        stop.deliver()  # after a stop on a signal: raises (by default), with the handlers of before restored
        return history

    # ------------------------------------------------------------ global batch
    def _check_global_batch_arguments(self, data, batch_size, micro_batch_size) -> None:
        if batch_size is not None:
            raise ValueError(f"fit() got batch_size={batch_size!r} (per data-parallel replica) and global_batch_size "
                             "(over the whole job): pass one of them (micro_batch_size bounds a replica's "
                             "forward with global_batch_size)")
        if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                             or micro_batch_size < 1):
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        if micro_batch_size is not None and "pipeline_parallel_size" in self.config:
            raise ValueError("fit(micro_batch_size=...) with a pipeline: the pipeline cuts each replica's batch in "
                             "`microbatches` itself (DistributedTrainer(microbatches=...))")
        dataset = data.dataset if isinstance(data, DataLoader) else data
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
            raise ValueError("fit(global_batch_size=...) needs a map-style Dataset (or a DataLoader over one): the "
                             "trainer must shard it to keep the global batch and the sample position at any size; "
                             f"got {type(data).__name__}")

    def _scale_learning_rate(self, scale: float) -> None:
        """Make the configured learning rate `scale` times the one the trainer was built with (the linear
        scaling rule for a global batch that had to change): the optimizer's ``lr`` / ``initial_lr`` and a
        scheduler's base rates, and the configured values a resume compares with."""
        factor = scale / self._lr_scale
        if factor == 1:
            return
        for group, configured in zip(self.optimizer.param_groups, self._configured_hparams):
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * factor
                if key in configured:
                    configured[key] = configured[key] * factor
        if self.lr_scheduler is not None:
            if hasattr(self.lr_scheduler, "base_lrs"):
                self.lr_scheduler.base_lrs = [lr * factor for lr in self.lr_scheduler.base_lrs]
            for key in ("base_lrs", "_last_lr"):
                if key in self._configured_schedule:
                    self._configured_schedule[key] = [lr * factor for lr in self._configured_schedule[key]]
        self._lr_scale = scale

    def _adopt_global_batch(self, plan: GlobalBatch, micro_batch_size: int | None,
                            resumed_from: str | None) -> GlobalBatch:
        """Resolve the micro-batch (given, else the checkpoint's, else the first start's), set the
        trainer's accumulation from it, and say what each replica trains (and what changed)."""
        pipelined = "pipeline_parallel_size" in self.config
        if pipelined:
            plan = plan.with_micro_batch(plan.per_rank)  # the pipeline cuts the batch in its microbatches
        else:
            micro = micro_batch_size or self.micro_batch_size or -(-plan.per_rank // self._configured_accumulation)
            plan = plan.with_micro_batch(micro)
            self.micro_batch_size = micro
            self.gradient_accumulation_steps = plan.accumulation
            self.config["gradient_accumulation_steps"] = plan.accumulation
        before = self._previous_global_batch
        self.global_batch = plan
        if not self.context.is_main:
            return plan
        message = "fit: " + plan.describe()
        if resumed_from is not None and before is not None and (before["dp_size"], before["size"]) != (plan.dp_size,
                                                                                                        plan.size):
            message += (f" (the checkpoint was trained at {before['dp_size']} x {before['per_rank']}"
                        f"{' in ' + str(before['accumulation']) + ' micro-batch(es)' if not pipelined else ''}"
                        f" = {before['size']}; the epoch continues at sample {self.samples_in_epoch})")
        elif (resumed_from is not None and before is not None and not pipelined
              and before.get("accumulation") not in (None, plan.accumulation)):
            message += (f" (the checkpoint was trained in {before['accumulation']} micro-batch(es) of at most "
                        f"{before.get('micro_batch_size')})")
        log.info("%s", message)
        if plan.size != plan.requested:
            log.warning("global_batch_size=%d cannot be kept at %d data-parallel replicas "
                         "(allow_global_batch_change=True): training a global batch of %d, with the learning rate "
                         "scaled by %d/%d = %.4g (linear scaling rule)", plan.requested, plan.dp_size, plan.size,
                         plan.size, plan.requested, plan.lr_scale)
        return plan

    def _epoch_offset(self, loader) -> int:
        """Samples of the current epoch already trained by the whole job (a checkpoint from before the
        count was kept: its step count times this job's global batch, right at an unchanged size)."""
        if self.samples_in_epoch is None:
            self.samples_in_epoch = self.batch_in_epoch * loader.batch_size * loader.sampler.num_replicas
        return self.samples_in_epoch

    def _check_dataset_length(self, loader, resumed_from: str | None) -> None:
        """Record the sharded dataset's length (what checkpoints keep beside the data position) and say
        when a resumed epoch continues over data of another length than the one it started on: its
        saved position then points into another order (some samples trained twice in that epoch, others
        not at all)."""
        sampler = getattr(loader, "sampler", None)
        saved, self._dataset_len = self._saved_dataset_len, getattr(sampler, "dataset_len", None)
        if (resumed_from is not None and isinstance(sampler, ShardedSampler) and saved is not None
                and saved != sampler.dataset_len and self.samples_in_epoch and self.context.is_main):
            log.warning("the training data has %d samples, the run in checkpoint %s had %d: epoch %d continues at "
                        "sample %d of the new data's order, so in this epoch some samples may train twice and others "
                        "not at all (the next epochs are whole). Resume with the data the run started on, or start "
                        "again (resume=False)", sampler.dataset_len, resumed_from, saved, self.epoch,
                        self.samples_in_epoch)

    def _check_last_batch(self, loader) -> None:
        """Refuse now, not after an epoch, a sharded loader whose last batch the strategy cannot run."""
        smallest = self.strategy.smallest_batch()
        sampler = getattr(loader, "sampler", None)
        if smallest <= 1 or not isinstance(sampler, ShardedSampler) or loader.drop_last:
            return
        last = sampler.shard_length() % loader.batch_size
        if 0 < last < smallest:
            raise ValueError(f"fit(): each epoch's last batch would have {last} sample(s) on this data-parallel "
                             f"replica, fewer than the {smallest} that pipeline_schedule='interleaved_1f1b' needs "
                             "(one a pipeline rank): pass fit(..., drop_last=True) or a batch_size that divides "
                             "the data")

    def _train_epochs(self, loader, epochs, criterion, max_steps, log_every, on_step,
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
            with torch.random.fork_rng(devices=[]), self._fetching(sharded):
                batches = iter(loader)
            if skip:  # a resumed epoch over a loader we cannot seek: replay its start, drawing nothing from
                state = rng_state()  # the random streams the checkpoint restored (a loader's augmentation would)
                with self._fetching(sharded):
                    for _ in range(skip):
                        next(batches, None)
                set_rng_state(state)
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
                        has_batch = self.context.every_rank(batch is not None)
                    agreed = time.perf_counter()  # (its wait: a slower rank's fetch, not this one's work)
                if not has_batch:
                    exhausted = True
                    break
                waited = self._straggler_probe()
                metrics = self.train_step(batch, criterion)
                self.batch_in_epoch += 1
                if sharded:  # every replica trained as many samples as this one (the sampler pads)
                    self.samples_in_epoch += batch_size_of(batch) * sampler.num_replicas
                    self._epoch_finished = self.batch_in_epoch >= epoch_end  # what a checkpoint of this step says
                now = time.perf_counter()
                self.data_wait_s += fetched - last_end
                if waited is not None:  # the measured step: its data and compute less its wait on the others
                    # (not what one rank did after the last step alone)
                    self._own_time = self._own_work(now - began - waited - (agreed - fetched), fetched - began)
                metrics = self._record_step(batch, metrics, step_time=now - last_end, data_time=fetched - last_end)
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


def _sharded(data) -> bool:
    """Whether `fit` shards `data` by sample (a map-style dataset, or a DataLoader over one) rather than
    iterating it as this rank's batches (`train_loader`)."""
    inner = data.dataset if isinstance(data, DataLoader) else data
    return isinstance(inner, Dataset) and not isinstance(inner, IterableDataset)
