"""The job `dtrain` runs: the model, data and trainer a config describes, trained, evaluated and saved
(`run_job`), with what must be checked after a resume (the schedule's length, a run already complete).
Its other parts: what is checked before the rendezvous (the paths it writes, the world against the
model-parallel sizes, a pipeline against the model), in `dtrain_checks`; the epochs it trains and each
epoch's last batch, in `dtrain_epochs`; its final metrics and the model it writes to ``output``, in
`dtrain_results`. `cli` parses the command line and reports what goes wrong once."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import ConfigError, JobConfig, training_paths
from .dtrain_checks import check_paths, check_same_config, check_world
from .dtrain_epochs import epochs_for
from .dtrain_results import final_metrics, write_outputs
from .global_batch import plan_global_batch
from .logs import get_logger
from .planner import NoStrategyFits
from .stopping import finishing
from .validation import check_classifier_targets, job_best_checkpoint, job_fit_evaluation

__all__ = ["run_job"]

log = get_logger("cli")


def _build(cfg: JobConfig):
    """(model, train set, validation set, criterion or None) for the config."""
    from . import user_job

    if user_job.uses_user_code(cfg):  # model.target, data.target, ...: the user's own parts
        return user_job.build(cfg, builtin=_build)
    from .datasets import TextWindows, digits, repo_text
    from .models import GPT, GPT_PRESETS

    if cfg.data.dataset == "image_folder":
        from .image_job import build_image_job

        return build_image_job(cfg)
    g = torch.Generator().manual_seed(cfg.training.seed)
    if cfg.data.dataset == "digits":
        data = digits()
        order = torch.randperm(len(data), generator=g)
        n_val = int(len(data) * cfg.data.val_fraction)
        train = torch.utils.data.Subset(data, order[n_val:].tolist())
        val = torch.utils.data.Subset(data, order[:n_val].tolist())
        torch.manual_seed(cfg.training.seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(cfg.model.dropout), nn.Linear(128, 10))
        from .image_job import classification_loss

        return model, train, val, classification_loss(cfg)
    tokens = repo_text()
    block = cfg.data.block_size
    starts = list(range(0, len(tokens) - block - 1, block))
    every = max(2, round(1 / cfg.data.val_fraction)) if cfg.data.val_fraction > 0 else 0
    val_starts = starts[::every] if every else []
    held_out = set(val_starts)  # built once: in the comprehension it was rebuilt for every window
    train_starts = [s for s in starts if s not in held_out]
    preset = GPT_PRESETS[cfg.model.preset]
    shape = {"vocab_size": 256, "block_size": max(block, preset.block_size), "dropout": cfg.model.dropout}
    if cfg.model.n_layer is not None:
        shape["n_layer"] = cfg.model.n_layer
    if cfg.model.n_embd is not None:
        shape["n_embd"] = cfg.model.n_embd
    import dataclasses

    # Built on the meta device (shapes only): the trainer gives storage to what each rank runs (with a
    # pipeline, its stages only, so no rank holds the whole model) and initialises it from
    # training.seed by the GPT's per-layer scheme (`GPTStages`), the same weights at every pipeline
    # size on one device type.
    with torch.device("meta"):
        model = GPT(dataclasses.replace(preset, **shape))
    torch.manual_seed(cfg.training.seed)  # dropout's draws (the weights come from `GPTStages`' own seeds)
    return model, TextWindows(tokens, block, train_starts), TextWindows(tokens, block, val_starts), None


def run_job(cfg: JobConfig) -> dict:
    """Train as the config says; return rank 0's final metrics (others: {})."""
    from . import user_job
    from .optim_job import job_optimizer, schedule_steps
    from .trainer import DistributedTrainer

    check_paths(cfg)
    model, train, val, criterion = _build(cfg)
    if cfg.evaluation.every is not None and not len(val):  # (your own data: known once it is built)
        raise ConfigError("evaluation.every needs a validation set, and this job's is empty: give data.val_target "
                          "(or data.val_kwargs), or data.val_fraction > 0 of a map-style training set large enough "
                          "to leave a sample")
    classifying = [n for n in cfg.evaluation.metrics or () if n != "perplexity"]
    if criterion is None and classifying:  # (failed at the final evaluation, after training)
        raise ConfigError(f"evaluation.metrics: {classifying[0]} compares the model's outputs with the targets, but "
                          "this job has no loss.target: its model computes its own loss from each batch, and is "
                          "evaluated by val_loss and perplexity. Give loss.target (batches are then (inputs, "
                          "targets)), or leave evaluation.metrics out")
    if cfg.evaluation.metrics is not None and len(val):
        try:  # (failed at the first evaluation, after training)
            check_classifier_targets(val, cfg.evaluation.metrics, parameter="evaluation.metrics")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    n_params = sum(p.numel() for p in model.parameters())  # before a sharded strategy moves them into its shards
    t = cfg.training
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # checked before the rendezvous: torchrun's value
    strategy, served = _job_strategy(cfg, world)
    pipelined = t.pipeline_parallel_size > 1
    check_world(cfg, model, world)
    replicas = max(1, (world - (t.num_servers if served else 0)) // (t.pipeline_parallel_size * t.tensor_parallel_size))
    if t.global_batch_size is not None and not t.allow_global_batch_change:
        try:  # what fit() would refuse on every rank once the model is built, said once before it
            plan_global_batch(t.global_batch_size, replicas, others=t.pipeline_parallel_size * t.tensor_parallel_size)
        except ValueError as err:
            raise ConfigError(f"training.global_batch_size: {err}") from None
    optimizer, lr_scheduler = job_optimizer(
        cfg, model, total_steps=schedule_steps(cfg, train, replicas, user_job.is_iterable(train), _resume_meta(cfg)))
    try:
        trainer = DistributedTrainer(
            model, optimizer, lr_scheduler=lr_scheduler, strategy=strategy,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            gradient_clip_val=None if served else t.gradient_clip_val,  # (config: not given with the parameter server)
            **served,
            timeout=t.timeout_s, heartbeat_timeout=t.heartbeat_timeout_s, seed=t.seed, checkpoint_dir=cfg.checkpoint.dir,
            checkpoint_every=cfg.checkpoint.every, keep_last=cfg.checkpoint.keep_last, resume=cfg.checkpoint.resume,
            **job_best_checkpoint(cfg),
            save_on_preemption=cfg.checkpoint.save_on_preemption, checkpoint_async=cfg.checkpoint.asynchronous,
            log_dir=cfg.logging.dir,
            log_every=cfg.logging.every, progress=cfg.logging.progress and cfg.logging.dir is not None,
            mixed_precision=None if t.precision == "fp32" else t.precision,
            activation_checkpointing=_block_classes(model) if t.activation_checkpointing else None,
            memory_budget_bytes=t.memory_budget_gb * 2**30 if t.memory_budget_gb is not None else None,
            pipeline_parallel_size=t.pipeline_parallel_size, pipeline_schedule=t.pipeline_schedule,
            microbatches=t.microbatches, pipeline_split_points=t.pipeline_split_points,
            pipeline_chunks=t.pipeline_chunks, pipeline_balance=t.pipeline_balance,
            pipeline_sample_input=_sample_input(cfg, model), pipeline_half_blocks=t.pipeline_half_blocks,
            pipeline_cuda_graphs=t.pipeline_cuda_graphs, pipeline_compile_loss=t.pipeline_compile_loss,
            tensor_parallel_size=t.tensor_parallel_size, sequence_parallel=t.sequence_parallel,
            tensor_parallel_plan=({k: tuple(v) if isinstance(v, list) else v for k, v in t.tensor_parallel_plan.items()}
                                  if t.tensor_parallel_plan is not None else None),
        )
    except NotImplementedError as err:
        if not pipelined:
            raise
        # What the trainer does not run with a pipeline (yet), refused on every rank alike before any
        # step: said as the config field to change.
        raise ConfigError(training_paths(str(err)).replace("checkpoint_dir", "checkpoint.dir")) from None
    except NoStrategyFits as err:  # training.strategy: auto, and nothing fits the budget
        budget = (f"training.memory_budget_gb={t.memory_budget_gb}" if t.memory_budget_gb is not None
                  else "this device's free memory")
        raise ConfigError(f"training.strategy auto with {budget}: {str(err).split(': ', 1)[-1]}") from None
    except ValueError as err:
        if not str(err).startswith("tensor_parallel_plan"):
            raise
        # A plan that does not fit the model is known once the model is built, on every rank alike.
        raise ConfigError(f"training.{err}") from None
    trainer.checkpoint_notes = _notes(cfg)  # (a resume names those that changed)
    ctx = trainer.context
    finished = False  # an error on this rank: close without the barrier its peers would never reach
    held: list[int] = []  # signals held during the final evaluation and outputs (`stopping.finishing`)
    try:
        check_same_config(cfg, trainer)
        log.info("dtrain: %s with %s parameters, strategy %s%s, world size %d on %s, %s training samples",
                 type(model).__name__, f"{n_params:,}", trainer.strategy.name,
                 _layout(trainer, t), trainer.job_context.world_size, ctx.device, user_job.sample_count(train))
        batching = {"batch_size": t.batch_size}
        if t.global_batch_size is not None:  # fit() cuts it at this size (and says how)
            batching = {"global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
                        "allow_global_batch_change": t.allow_global_batch_change}
            batch_size = max(1, round(t.global_batch_size / trainer.dp_world_size))  # a rank's share
        else:
            if t.batch_size == "auto" and trainer.batch_size is None and not _resuming(trainer):
                trainer.auto_batch_size(train, criterion)  # logs what it chose and why
            batch_size = t.batch_size if t.batch_size != "auto" else trainer.batch_size
            if batch_size is None and _resuming(trainer):  # fit() restores the batch size "auto" chose before
                batch_size = trainer.latest_checkpoint()[1].get("batch_size")  # (agreed: every rank calls it)
        # (fit() pads an epoch's short last step where a pipeline's schedule or BatchNorm cannot run it split)
        epochs = (user_job.iterable_epochs(t.epochs, t.max_steps) if user_job.is_iterable(train) else
                  epochs_for(t.epochs, t.max_steps, train, batch_size, trainer.dp_world_size,
                             _resume_meta(cfg) if t.max_steps is not None else None))
        if epochs != t.epochs:
            trainer._fit_derived["epochs"] = "derived from training.max_steps"
        if _already_complete(trainer, cfg, epochs):
            finished = True
            return {}
        dealt = user_job.is_iterable(train) and cfg.data.shard_iterable and trainer.dp_world_size > 1
        data = user_job.train_data(cfg, train, batch_size, trainer.dp_rank, trainer.dp_world_size,
                                   trainer._fewest_short_rows() if dealt else 1)  # (as fit pads a map-style set)
        val_data = user_job.val_data(cfg, val, trainer.batch_size or batch_size)
        from .image_job import input_watch

        watch = input_watch(train, cfg)  # image folders: decode vs training rates, said after fit
        first_step = trainer.step
        try:
            trainer.fit(data, epochs=epochs, criterion=criterion, **batching, max_steps=t.max_steps,
                        log_every=cfg.logging.every, num_workers=cfg.data.num_workers,
                        **job_fit_evaluation(cfg, val_data),
                        on_step=_step_logger(trainer) if ctx.is_main else None)
        except ValueError as err:
            # Metrics read from the data (evaluation.metrics not given): known only now, on every rank alike.
            said = str(err)
            if said.startswith("eval_target names"):
                raise ConfigError(f"evaluation.target {said.removeprefix('eval_target ')}: name one of those, or "
                                  "list the metric in evaluation.metrics") from None
            if said.startswith("best_metric="):
                advice = ", or list the metric in evaluation.metrics" if said.startswith("best_metric='val_") else ""
                raise ConfigError(f"evaluation.{said}: name one of those{advice}") from None
            _raise_loss_failure(cfg, criterion, err, trainer.step == first_step)
            raise
        except Exception as err:
            _raise_loss_failure(cfg, criterion, err, trainer.step == first_step)
            raise
        watch.report(getattr(trainer, "data_wait_s", None))
        with finishing("the final evaluation and the outputs") as held:
            metrics = final_metrics(cfg, trainer, val, val_data, criterion, trainer.batch_size or batch_size)
            write_outputs(cfg, trainer, metrics)
        finished = True
        return metrics if ctx.is_main else {}
    finally:
        with warnings.catch_warnings():  # (its advice is for a script: dtrain has written its outputs already)
            warnings.filterwarnings("ignore", message="under a pipeline the model you passed keeps only")
            trainer.close(barrier=finished)
        if held:  # a preemption during them: the process stops now that they and the close are done
            raise SystemExit(128 + held[0])


def _job_strategy(cfg: JobConfig, world: int) -> tuple[Any, dict]:
    """The trainer's `strategy` argument (a name, or a strategy object carrying the communication
    section), and the parameter server's keyword arguments ({} for the other strategies)."""
    t, c = cfg.training, cfg.communication
    strategy = t.strategy
    communication = None
    if c.compression != "none" or c.pattern != "nccl" or c.hierarchical:
        from .comm.optimizer import CommunicationOptimizer

        communication = CommunicationOptimizer(
            None if c.compression == "none" else c.compression, compression_ratio=c.compression_ratio,
            error_feedback=c.error_feedback, pattern=c.pattern, hierarchical=c.hierarchical,
            ranks_per_node=c.ranks_per_node, powersgd_rank=c.powersgd_rank, warmup_steps=c.warmup_steps,
            topk_select=c.topk_select)
    if strategy in ("ddp", "zero1"):
        from .strategies import DDPStrategy, Zero1Strategy

        cls = DDPStrategy if strategy == "ddp" else Zero1Strategy
        strategy = cls(bucket_cap_mb=c.bucket_cap_mb, communication=communication)
    served = {}
    if strategy == "parameter_server":
        if t.num_servers >= world:
            raise ConfigError(f"training.num_servers={t.num_servers} leaves no worker in a world of {world}: run more "
                              f"processes than servers (torchrun --nproc_per_node) or lower training.num_servers")
        served = {"num_servers": t.num_servers, "consistency": t.consistency, "staleness": t.staleness}
    return strategy, served


def _raise_loss_failure(cfg: JobConfig, criterion: Any, err: BaseException, first: bool) -> None:
    """Before any step trained: an error inside ``loss.target``'s code, raised as one naming the field."""
    from .user_job import loss_failure

    named = loss_failure(cfg, criterion, err) if first else None
    if named is not None:
        raise named from err


def _layout(trainer, t) -> str:
    """What the start-up line says of the ranks' layout beyond the strategy (pipeline, tensor, servers)."""
    pipelined = t.pipeline_parallel_size > 1
    chunks = trainer.config["pipeline_chunks"] if pipelined else 1
    stages = (f"{t.pipeline_parallel_size * chunks} stages ({t.pipeline_parallel_size} ranks x {chunks} chunks, "
              if chunks > 1 else f"{t.pipeline_parallel_size} stages (")
    layout = [f"pipeline of {stages}{trainer.config['pipeline_schedule']}, {trainer.config['microbatches']} "
              "microbatches)"] if pipelined else []
    if t.tensor_parallel_size > 1:
        layout.append(f"tensor-parallel over {t.tensor_parallel_size} ranks"
                      f"{' with sequence parallelism' if t.sequence_parallel else ''}")
    if t.strategy == "parameter_server":
        return (f" ({t.num_servers} server(s), {trainer.dp_world_size} worker(s), consistency "
                f"{t.consistency}{f', staleness {t.staleness}' if t.consistency == 'ssp' else ''})")
    return f", {' x '.join(layout)} x {trainer.dp_world_size} data-parallel" if layout else ""


def _sample_input(cfg: JobConfig, model: nn.Module) -> torch.Tensor | None:
    """With training.pipeline_balance 'time': one microbatch of the job's inputs, which the layers are
    timed on; with 'compute' (a GPT), one microbatch of token ids, whose shape the compute model takes;
    None otherwise. batch_size / microbatches rows of data.block_size token ids for a GPT preset, of 64
    pixels for the classifier."""
    from .models import GPT

    t = cfg.training
    if (t.pipeline_parallel_size == 1 or t.pipeline_balance not in ("time", "compute")
            or t.pipeline_split_points is not None or (t.pipeline_balance == "compute" and not isinstance(model, GPT))):
        return None
    batch = t.batch_size if isinstance(t.batch_size, int) else 1  # "auto" is refused with a pipeline
    rows = max(1, batch // (t.microbatches or t.pipeline_parallel_size))
    g = torch.Generator().manual_seed(0)
    if isinstance(model, GPT):
        return torch.randint(0, model.cfg.vocab_size, (rows, cfg.data.block_size), generator=g)
    return torch.rand(rows, 64, generator=g)  # the classifier's 8x8 digits


def _block_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes of the repeated blocks (children of any ModuleList): what activation checkpointing wraps."""
    found = {type(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m}
    if not found:
        raise ConfigError(f"training.activation_checkpointing: {type(model).__name__} has no repeated blocks to checkpoint")
    return tuple(found)


def _resume_meta(cfg: JobConfig) -> dict | None:
    """The metadata of the checkpoint this job would resume from (None: none, or resume is off), read
    before the trainer exists (the learning-rate schedule's length depends on it)."""
    if not cfg.checkpoint.dir or not cfg.checkpoint.resume or not os.path.isdir(cfg.checkpoint.dir):
        return None
    from .checkpoint import CheckpointCorruptError, CheckpointManager, read_meta

    manager = CheckpointManager(cfg.checkpoint.dir)
    for step in sorted(manager.steps(), reverse=True):  # meta.pt only: the trainer checks the rank files
        try:
            return read_meta(manager.path_for(step))
        except CheckpointCorruptError:
            continue
    return None


def _already_complete(trainer, cfg: JobConfig, epochs: int) -> bool:
    """Whether the checkpoint a resume would load is the end of this run (its step reached
    training.max_steps, or its epoch the epochs to train) and its final evaluation and outputs were
    written (checkpoint.dir/COMPLETED, the StatefulSet's marker): then say so, what to change, and train,
    evaluate and save nothing. Collective, like a resume: every rank reads the same checkpoint and agrees."""
    if trainer.checkpoints is None or not trainer.resume:
        return False
    found = trainer.latest_checkpoint()
    if found is None:
        return False
    path, meta = found
    step, epoch, max_steps = int(meta["step"]), int(meta.get("epoch", 0)), cfg.training.max_steps
    reached = ("training.max_steps" if max_steps is not None and step >= max_steps else  # (max_steps is the
               "training.epochs" if max_steps is None and epoch >= epochs else None)   # steps trained: it rules)
    if step == 0 or reached is None:  # what `fit` resumes from, and when it would train nothing
        return False
    from .checkpoint_shards import check_shapes

    try:  # a finished run of another model is not this run (a resume of it would fail at the load)
        check_shapes(meta.get("shapes", {}), trainer.strategy.state_layout(trainer.model, trainer.optimizer).shapes)
    except ValueError as err:
        raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} holds a finished run of another model ({err}): "
                          "to train this one, start over with --no-resume (checkpoint.resume: false; the "
                          "old run is kept beside it) or choose another checkpoint.dir") from None
    limit = f"training.max_steps={max_steps}" if reached == "training.max_steps" else f"{epochs} epoch(s)"
    # The marker is written after the final evaluation and outputs: without it the run stopped during them
    # (a preemption, a crash), and `fit` loads the last checkpoint, trains nothing, and they follow.
    # Any rank's view, over the whole job (its writer is the main rank of those that train).
    ended = [None] * dist.get_world_size()
    dist.all_gather_object(ended, (Path(cfg.checkpoint.dir) / "COMPLETED").exists())
    if not any(ended):
        if trainer.context.is_main:
            log.info("dtrain: the run reached its end at step %d (%s, checkpoint %s) but stopped before its final "
                     "evaluation and outputs were complete: they follow now", step, limit, path)
        return False
    if trainer.context.is_main:
        log.info("dtrain: the run is already complete at step %d (%s, checkpoint %s): nothing trained or saved. "
                 "To train further, raise training.max_steps or training.epochs; to start again from step 0, set "
                 "checkpoint.resume: false (dtrain --no-resume)", step, limit, path)
    return True


def _resuming(trainer) -> bool:
    # Collective (every rank agrees), so no rank runs the batch size search while another skips it.
    return trainer.checkpoints is not None and trainer.resume and trainer.latest_checkpoint() is not None


def _notes(cfg) -> dict:
    """The config's model, data and loss fields that the trainer's own settings do not show, for its
    checkpoints: a resume whose dataset or model arguments changed says so, as for the learning rate."""
    m, d, loss = cfg.model, cfg.data, cfg.loss
    fields = {"model.target": m.target, "model.kwargs": m.kwargs, "data.dataset": d.dataset, "data.root": d.root,
              "data.target": d.target, "data.kwargs": d.kwargs, "data.collate": d.collate,
              "data.collate_kwargs": d.collate_kwargs, "loss.target": loss.target, "loss.kwargs": loss.kwargs}
    return {key: value for key, value in fields.items() if value not in (None, {})}


def _step_logger(trainer):
    """dtrain's line per log step, ``step     10 | loss 3.3389`` (the global batch's loss), above the bar in
    a terminal (the loss's history); left out where the progress is plain lines (stderr no terminal),
    whose own line per log step already says the step and the loss."""
    def on_step(step, metrics):
        if not trainer.monitor.progress_lines:
            log.info("step %6d | loss %.4f", step, metrics.get("global_loss", metrics["loss"]))
    return on_step
