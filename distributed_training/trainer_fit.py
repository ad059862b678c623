"""`DistributedTrainer.fit` (`Fitting`, a mixin of the trainer): its arguments, checked and agreed across
ranks, the resume, the global batch (``fit(global_batch_size=...)``), the sharded loader, and the stop
signals around the epoch loop, which is in `trainer_epochs`."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .data import MapDataset, ShardedSampler, map_style, train_loader
from .global_batch import GlobalBatch, plan_global_batch
from .logs import get_logger
from .stopping import StopSignals
from .trainer_arguments import check_same_optimizer, check_same_options
from .trainer_epochs import EpochLoop
from .trainer_step import check_criterion
from .validation import PeriodicEvaluation

__all__ = ["Fitting"]

log = get_logger()
Criterion = Callable[[Any, Any], torch.Tensor]


class Fitting(EpochLoop):
    """`fit` (its loop: `EpochLoop`); the trainer provides the state it reads (see `DistributedTrainer`)."""

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
        `distributed_training.global_batch`. Each epoch's last global batch has the samples left, split
        over the replicas as they fall (each weighed by what it holds, so that step is exact too), or
        dropped with `drop_last`; only where a replica would get fewer than it can run (none; two a
        micro-batch for a model training BatchNorm layers; an interleaved pipeline's ranks) is that step
        padded to them by wrapping around (`ShardedSampler`).

        Resuming (see `resume`) is logged on rank 0 ("resumed from step N (path)"); a run that the
        checkpoint shows complete logs so and returns ``[]`` without training. SIGINT, SIGTERM and SIGHUP
        during `fit` stop every rank at the same step boundary shortly after one reaches any of them (a
        step or a checkpoint write in progress finishes first); on SIGTERM or SIGHUP (a closed terminal),
        with `save_on_preemption`, a checkpoint is written at that step. The signal then goes to the
        handler that was in place before `fit` (restored on return): by default SIGINT raises
        `KeyboardInterrupt`, SIGTERM ``SystemExit(143)`` and SIGHUP ``SystemExit(129)``, so a preempted
        job exits with nothing lost and resumes where it stopped. A second Ctrl-C (a second after the
        first) raises `KeyboardInterrupt` at once, wherever the step is stuck.

        Evaluation during training: with `eval_dataset` (a map-style validation set, or an iterable of
        this rank's batches, which `evaluate` takes as fit takes training batches), every
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
        self._check_open("fit()")
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
            if evaluation.batch_size is None and self.context.mesh.size("pipeline") > 1:  # (as evaluate says)
                raise ValueError("fit(eval_dataset=...) under a pipeline takes a map-style dataset (or a DataLoader "
                                 "over one), not an iterable of batches")
        self.evaluation = evaluation
        self._best_checked = self._check_best_metric(evaluation)  # (a training metric: at the first step)
        self._own_time, self._probe_wait = None, 0.0  # (a measure of an earlier fit's window that never logged)
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
            # At the first fit only: an optimizer may keep values of its own in its param groups, per shard
            # under ZeRO (Prodigy's step size d); the parameter server's workers step the servers' shards.
            if self.strategy.name != "parameter_server" and not self._optimizer_agreed:
                check_same_optimizer(self.optimizer, self.context.mesh.group("data"))
                self._optimizer_agreed = True
        self._fit_limits = {"epochs": epochs, "max_steps": max_steps}
        if isinstance(batch_size, int) and plan is None:  # (compared on resume: a change is said, as the others)
            self._fit_limits["batch_size"] = batch_size
        self._fit_global_batch = plan is not None and "pipeline_parallel_size" not in self.config
        self._fit_keeps_global_batch = plan is not None
        resumed_from = self._resume_or_start_fresh()
        if resumed_from is None and self.step == 0 and self.context.is_main and self.monitor.found_earlier_records:
            log.warning("%s holds an earlier run's logs: this run's, from step 0, are appended to them (TensorBoard "
                        "draws both on one curve; the plot tool keeps the last run). Give another log_dir (dtrain: "
                        "logging.dir) to keep them apart", self.monitor.log_dir)
        if self.epoch >= epochs or (max_steps is not None and self.step >= max_steps):
            if self.context.is_main and (resumed_from is not None or self.step):  # (or a second fit: from step 0)
                where = resumed_from if resumed_from is not None else "this trainer's earlier training"
                log.info("training is already complete at step %d, epoch %d (%s): nothing to do (epochs and "
                         "max_steps count from the start of training: to train further, raise them%s)", self.step,
                         self.epoch, where, "; to start again from step 0, resume=False" if resumed_from else "")
            if resumed_from is not None:
                return []  # (a second fit goes on as before: its data is checked, its end evaluated)
        elif self.checkpoints is not None:
            self._check_checkpoint_directory_writable()  # (before training, not at the first save)
        scaler = self.precision.scaler
        self._saved_at = (self.step, scaler.skipped_steps if scaler is not None else 0)
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
                              dp_world_size=self.dp_world_size, loader_batch_size=plan and plan.per_rank,
                              min_rows=self._fewest_short_rows() if _sharded(data) else 1)
        self._check_last_batch(loader)
        self._check_dataset_length(loader, resumed_from)
        if evaluation is not None and evaluation.batch_size is not None and eval_batch_size is None and not isinstance(
                eval_dataset, DataLoader):
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
        if resumed_from is not None and before is not None and before.get("requested") not in (None, plan.requested):
            log.warning("the configuration changed since checkpoint %s was written; the new values apply: "
                        "global_batch_size: %d -> %d (each step's gradient now averages another number of samples: "
                        "scale the learning rate with it if you meant to)", resumed_from, before["requested"],
                        plan.requested)
        if plan.size != plan.requested:
            log.warning("global_batch_size=%d cannot be kept at %d data-parallel replicas "
                         "(allow_global_batch_change=True): training a global batch of %d, with the learning rate "
                         "scaled by %d/%d = %.4g (linear scaling rule)", plan.requested, plan.dp_size, plan.size,
                         plan.size, plan.requested, plan.lr_scale)
        return plan
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

    def _fewest_short_rows(self) -> int:
        """The fewest samples a replica may hold in an epoch's short last step for it to be split unevenly
        (exactly) rather than padded to them (`ShardedSampler`): what the strategy needs (`smallest_batch`),
        and for a model training BatchNorm layers two a micro-batch (accumulation's, a pipeline's), as one
        sample fails there. Collective: alike on every rank (a pipeline's stages hold other modules)."""
        batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                         and not isinstance(m, torch.nn.SyncBatchNorm) and (m.training or not self.module.training)
                         for m in self.module.modules())
        with self._watched("fit's agreement on the model's BatchNorm layers"):  # (a dead peer is named)
            batch_norm = self.context.ranks_where(batch_norm) > 0
        cuts = self.gradient_accumulation_steps * self.strategy.batch_cuts()
        return max(self.strategy.smallest_batch(), 2 * cuts if batch_norm else 1)

    def _check_last_batch(self, loader) -> None:
        """Refuse now, not after an epoch, a sharded loader whose last batch the strategy cannot run."""
        smallest = self.strategy.smallest_batch()
        sampler = getattr(loader, "sampler", None)
        if (smallest <= 1 or not isinstance(sampler, ShardedSampler) or loader.drop_last
                or sampler.batch_size is not None):  # (fit's own sampler pads that step to `smallest`)
            return
        last = sampler.shard_length() % loader.batch_size  # (a sampler of the user's own)
        if 0 < last < smallest:
            raise ValueError(f"fit(): each epoch's last batch would have {last} sample(s) on this data-parallel "
                             f"replica, fewer than the {smallest} that pipeline_schedule='interleaved_1f1b' needs "
                             "(one a pipeline rank): pass fit(..., drop_last=True) or a batch_size that divides "
                             "the data")


def _sharded(data) -> bool:
    """Whether `fit` shards `data` by sample (a map-style dataset, or a DataLoader over one) rather than
    iterating it as this rank's batches (`train_loader`)."""
    inner = data.dataset if isinstance(data, DataLoader) else data
    return isinstance(inner, Dataset) and not isinstance(inner, IterableDataset)
