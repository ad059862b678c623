"""`DistributedTrainer`: the object a training script imports.

It owns the distributed context, moves the model to this rank's device, wraps it with a strategy,
builds the optimizer over what the strategy exposes, and runs steps:

    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp")
    metrics = trainer.train_step((inputs, targets), nn.functional.cross_entropy)
    trainer.fit(dataset, epochs=3, criterion=nn.functional.cross_entropy, batch_size=32)

The trainer is the only module that knows all the others; strategies never import it. Its parts, one
concept a file: `trainer_state` (where training stands, what it was configured with), `trainer_fit` (`fit`;
`trainer_epochs`: its epoch loop), `trainer_checkpoints` (save; `trainer_checkpoint_loading`: load;
`trainer_resume`: where `fit` starts; `trainer_checkpoints_async`: in the background), `trainer_weights`
(the model's full weights), `auto_batch` (``batch_size="auto"``), `evaluation`, `batches` (what a batch
is), `hangs` (timeouts that name the missing rank), `peer_watch` (a dead peer named within seconds;
`trainer_peers`: the trainer's use of it), `data` (sharded loaders), `stopping` (signals),
`strategies.registry` (strategy names).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .activation import apply_activation_checkpointing
from .amp import DynamicLossScaler, Precision, make_precision
from .auto_batch import AutoBatchSize
from .checkpoint import CheckpointManager
from .checkpoint_async import CheckpointWriteError
from .evaluation import Evaluation
from .global_batch import check_layout_world
from .hangs import CollectiveTimeoutError
from .logs import get_logger, install_default_handler
from .monitor import Monitor, NullMonitor
from .monitor.null import ProgressOnly
from .failure_agreement import FailureAgreement
from .peer_watch import PeerFailureError
from .pipeline.meta_init import has_meta, materialize
from .pipeline.training import PipelineOptions
from .planner import model_sizes
from .runtime import DistributedContext, init_distributed
from .strategies.base import OptimizerFactory, Strategy
from .strategies.registry import check_strategy_argument, make_strategy
from .tensor.options import TensorOptions
from .trainer_checkpoints import Checkpointing
from .trainer_closing import Closing, released_if_it_raises
from .trainer_fit import Fitting
from .trainer_peers import PeerWatching
from .trainer_arguments import (check_arguments, check_optimizer, check_optimizer_after_setup, check_optimizer_layout,
                                check_no_closure, check_parallel_arguments, check_same_options, check_scheduler,
                                compile_options_of, describe_compile)
from .trainer_step import Stepping
from .trainer_state import TrainerState
from .trainer_weights import FullWeights

__all__ = ["DistributedTrainer", "CollectiveTimeoutError", "CheckpointWriteError", "PeerFailureError"]


log = get_logger()


class DistributedTrainer(Stepping, Fitting, Checkpointing, AutoBatchSize, Evaluation, FullWeights, PeerWatching,
                         Closing, TrainerState):
    """Train a model data-parallel across the processes of a torchrun job.

    Args:
        model: the user's `nn.Module`, on any device (it is moved to this rank's device). A model built
            on the meta device (``with torch.device("meta"): model = GPT(cfg)``) is given storage on
            this rank's device and initialised there from `seed` (our GPT by `GPTStages`' per-layer
            scheme; other modules by each submodule's ``reset_parameters()``, seeded per module; a
            tensor neither covers is an error naming it: `distributed_training.pipeline.meta_init`):
            with `pipeline_parallel_size` > 1 each rank only its own stages, so no rank ever holds the
            whole model; without a pipeline every rank the whole model.
        optimizer: a `torch.optim.Optimizer` built over `model.parameters()`, or a callable that
            takes parameters and returns one (needed by sharded strategies, which build the
            optimizer over their shards).
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` / ``"fsdp"``, ``"parameter_server"``,
            ``"auto"`` (the planner picks one against `memory_budget_bytes` and says why), or a `Strategy`
            object (e.g. ``DDPStrategy(bucket_cap_mb=50)``, ``FSDPStrategy(mixed_precision=...)``).
            Sharded strategies need `optimizer` as a callable.
        gradient_accumulation_steps: micro-batches per optimizer step. `train_step` splits its batch
            into this many chunks; all but the last run under `no_sync`.
        gradient_clip_val: clip gradients to this global 2-norm before each step (None: no clipping).
        lr_scheduler: optional callable taking the optimizer and returning a scheduler, stepped
            once per optimizer step.
        context: a `DistributedContext`; by default one is created from torchrun's environment.
        timeout: collective timeout in seconds when the trainer creates the context.
        seed: seed of the data sharding permutation (the same on every rank), and of the initial weights
            of a model built on the meta device (see `model`).
        checkpoint_dir: where `fit` writes numbered checkpoints (``step_*/``) and, with `resume`,
            where it resumes from the latest good one: what torchrun's ``--max-restarts`` needs.
        checkpoint_every: save every this many optimizer steps during `fit` (and at its end).
        keep_last: how many recent checkpoints to keep; `best_metric` / `best_mode`: the checkpoint
            with the best value of this metric (`train_step`'s, or an evaluation's ``val_*`` during
            `fit`) is kept too; ``best_mode="auto"`` (default) keeps the highest accuracy (``accuracy``,
            ``top<k>``) and the lowest of anything else, or say ``"min"`` / ``"max"``.
        checkpoint_shared: whether `checkpoint_dir` is one directory seen by every node (True) or one
            per node (False); None (default) finds out with marker files on a multi-node job. With a
            directory per node, each node writes, verifies and prunes its own, and a resume picks the
            newest step complete on every node (see `distributed_training.checkpoint_layout`).
        resume: resume `fit` from the latest good checkpoint in `checkpoint_dir`, if there is one (it
            says so: "resumed from step N (path)"). Hyperparameters that changed since the checkpoint
            (learning rate and the other optimizer settings, the LR schedule, `max_steps`, `epochs`)
            take their new values, and the run logs what changed; what cannot change (parameter shapes,
            the optimizer class) is an error that names it. With ``resume=False`` an earlier run's
            checkpoints in `checkpoint_dir` are moved into ``previous_run_<k>/`` there, not mixed in
            (torchrun's restarts of this run's workers resume from its own: `trainer_resume`).
        checkpoint_async: write `fit`'s checkpoints in the background: at a checkpoint step each rank
            copies what it saves to host memory (pinned on CUDA) and a thread writes it, with the same
            crash-proof steps, while training goes on; a write interrupted at any point is never taken
            for the latest good checkpoint. At most one write is in flight (a checkpoint that comes
            while the previous one is still being written waits for it, with a warning). A failed write
            raises `CheckpointWriteError` (naming the file) at the next step, checkpoint or `close`;
            `fit` returns only once its last checkpoint is complete. `save_checkpoint` stays
            synchronous. See `distributed_training.checkpoint_async`.
        save_on_preemption: on SIGTERM (what Kubernetes and batch schedulers send before killing a
            job) or SIGHUP (a closed terminal) `fit` stops at the next step boundary that every rank
            agrees on, writes a checkpoint there (with `checkpoint_dir`), and exits; SIGINT (Ctrl-C)
            stops the same way without the save (twice: at once). See `fit`.
        log_dir: write per-rank TensorBoard and JSONL metrics under ``log_dir/rank_<i>`` during `fit`
            (see `distributed_training.monitor.Monitor`); `log_every` steps apart; ranks slower than
            `straggler_threshold` times the median are flagged. `progress` draws a bar on the job's main
            rank during `fit`, with or without `log_dir` (one line per log step where stderr is no
            terminal); False: none.
        mixed_precision: ``"bf16"``, ``"fp16"`` or None (``"fp32"``): autocast for forward and loss, fp32 master
            weights. fp16 uses a `DynamicLossScaler` (ours; pass one as `loss_scaler` to tune it),
            agreed across ranks. bf16 has fp32's exponent range and needs no scaler: passing one with
            bf16 is an error. The trainer drives it through `self.precision` (see `distributed_training.amp`).
        activation_checkpointing: module classes (e.g. the transformer block class) or a callable
            ``(module, name) -> bool`` whose modules are recomputed in backward instead of keeping
            their activations (non-reentrant).
        communication: a `CommunicationOptimizer` (Top-K, bf16/fp16, PowerSGD, ring/tree, hierarchical)
            for the DDP-based strategies ``"ddp"`` and ``"zero1"``; its residuals are checkpointed.
        memory_budget_bytes: with ``strategy="auto"`` (and ``fit(batch_size="auto")`` where it
            estimates), the per-rank memory to plan for (default: the GPU's total memory, or this
            process's share of the host's on CPU). The chosen plan and its reason are in `self.plan`.
        compile: ``True``, or a dict of `torch.compile` keyword arguments (``{"backend": ...,
            "mode": ...}``), to compile the wrapped model in place (``self.model.compile(...)``): the
            forward's computation is compiled, and the strategy's communication (DDP's buffer
            broadcast, ZeRO-1's parameter all-gathers, FSDP's per-unit gathers and reshards) runs
            eagerly between compiled graphs. The model, its state dict keys and checkpoints stay as
            without it. A model compiled by you works too: per block, or whole (``torch.compile(model,
            ...)``: the module inside it is compiled in place as above, with your backend, mode and
            options unless `compile` gives others).
        pipeline_parallel_size: pipeline stages per model replica (default 1: none). The world is laid
            out as ``pipeline x data`` (the size must divide it): the model's layers (`pipeline.chain`:
            an `nn.Sequential`, our `GPT`, or an adapter's list of layers) are cut into stages, each
            rank holds its stage(s), and `strategy` (``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` /
            ``"fsdp"``; not ``"auto"``) runs data parallelism inside each stage. `train_step` batches are ``(inputs, targets)`` with a criterion (a GPT without
            one gets its language-model loss); the loss is the whole batch's on every rank. Every rank
            receives the whole model and keeps only its stages: the rest of the model object is freed
            (meta tensors); a model built on the meta device gets storage for this rank's stages only. Checkpoints are in the one format, under the model's own keys: they load
            at another pipeline size, data-parallel size or without a pipeline, and back. `evaluate`
            runs forward only through the stages. `gradient_accumulation_steps` (use `microbatches`),
            `compile` and ``batch_size="auto"`` are not supported with pipelines yet. See
            `distributed_training.pipeline.training`.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"`` or ``"zbh1"``.
        microbatches: microbatches each batch is cut into (default: `pipeline_parallel_size`); at least
            `pipeline_parallel_size` for the 1F1B family, a multiple of it for interleaved.
        pipeline_split_points: the layer names where stages 1, 2, ... start (e.g. ``["block.6"]``);
            None balances the stages by `pipeline_balance`.
        pipeline_chunks: model chunks per rank (``"interleaved_1f1b"`` only; default 2 there, else 1).
        pipeline_balance: without split points, what the stages are balanced by: ``"parameters"``
            (default), ``"compute"`` (our GPT: FLOPs per layer; better where the GPU bounds the step,
            as for wide models; a small model's step is bound by the host's launches, which parameter
            counts follow more closely) or ``"time"``: each layer's forward + backward on one
            microbatch, measured at setup on every rank's device (under `mixed_precision`'s autocast;
            a copy of one layer at a time, so a meta-device model too large for one device can be
            timed; about 20 s at most, `pipeline.balance.TIME_BUDGET_S`) and averaged over the ranks,
            so every rank cuts alike. What the cut balanced: ``trainer.strategy.layer_costs``
            (seconds per layer) and ``trainer.strategy.bounds``.
        pipeline_sample_input: with ``pipeline_balance="time"``, one microbatch's input to the model's
            first layer (a tensor, or a tuple, list or dict of tensors), e.g. ``x[:batch //
            microbatches]``. Our GPT may leave it out (token ids of shape (1, ``cfg.block_size``));
            other models must pass it. With ``"compute"`` (our GPT), one microbatch's token ids: the
            compute model takes its sequence length and tokens (default: one sequence of
            ``cfg.block_size``).
        pipeline_half_blocks: our GPT only: cut its chain at half blocks, each block two layers
            (``block.i.a``, its attention; ``block.i.m``, its MLP), so that a stage may end inside a block:
            a finer balance (measured on 4x H200 at GPT-1.3B: 1F1B's bubble 0.298 against 0.339 with whole
            blocks, the formula's 0.273). Split points may name half blocks (``"block.6.m"``); a block
            chosen for activation checkpointing has both halves checkpointed. Checkpoints keep the model's
            keys, so they load with or without it.
        pipeline_cuda_graphs: replay each stage's forward and backward as CUDA graphs, captured after
            the first step for the shape of its first microbatch (one set of activations per microbatch in
            flight, kept between steps; other shapes run eagerly, as before). For steps whose host time bounds
            them: measured on 4x H200 at GPT-1.3B, P = 4, 8 microbatches of 2 x 1024 tokens, 1F1B 134.8
            ms against 142.4 eagerly and torch's 141.2 (docs/pipeline.md); ``"zbh1"`` replays its input- and
            weight-gradient passes as graphs of their own. CUDA only; not with activation checkpointing, or ZeRO / FSDP inside the stages (``"ddp"`` only: the
            others gather parameters in module hooks, which would not replay: refused). A parameter must stay where it was at
            capture (optimizers update in place: fine).
        pipeline_compile_loss: run the last stage's loss (the criterion, or our GPT's `lm_loss`) through
            ``torch.compile`` on CUDA: one fused pass over the logits instead of several (on one H200, a
            GPT-1.3B stage of 6 blocks with the head: 109.8 ms a step against 117.8). With
            ``pipeline_balance="compute"`` the head then carries no loss in the cut. On CPU, or where
            compiling fails (a warning), the loss runs as it is.
        tensor_parallel_size: ranks that split each layer's matrices between them (default 1: none).
            The world is laid out as ``pipeline x data x tensor``, tensor innermost (consecutive
            ranks: one node); the size must divide the world. The model is changed in place by
            `tensor_parallel_plan` (its weights sliced from the full ones: tensor rank 0's, broadcast
            first), then `strategy` (``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` / ``"fsdp"``)
            runs data parallelism over the parts. A cross-entropy criterion becomes the vocabulary-
            parallel loss where the plan splits the output head by vocabulary. Checkpoints and
            `full_state_dict()` hold the plain model's full tensors. See docs/tensor_parallel.md.
        tensor_parallel_plan: module-name pattern (fnmatch, e.g. ``"blocks.*.mlp.0"``) -> ``"colwise"``
            (``("colwise", 3)`` for a fused q/k/v projection), ``"rowwise"``, ``"vocab"``,
            ``"sequence"``, ``"sequence_split"`` or ``"replicate"``; None: the model's built-in plan
            (our GPT's).
        sequence_parallel: with tensor parallelism, also split the LayerNorm and dropout regions along
            the sequence (less activation memory; the same numerics).
        num_servers, consistency, staleness, sparse_embeddings: with ``strategy="parameter_server"``
            (`strategies.parameter_server.ParameterServerStrategy`, our `distributed_training.ps`): ranks
            ``0 .. num_servers - 1`` (default 1) hold the parameters and run the optimizer the factory
            builds (SGD with momentum, Adam, AdamW without weight decay); the other ranks train, the
            data sharded over them only (`dp_rank` = rank - num_servers). `consistency`: ``"sync"``
            (default: equal to data parallelism), ``"ssp"`` (a worker at most `staleness` steps ahead of
            the slowest) or ``"async"``. `fit` on a server serves until the workers are done and returns
            ``[]``; afterwards every rank holds the final model. `sparse_embeddings`: embedding weights
            whose pushes carry only the touched rows. Under ``"ssp"`` / ``"async"`` the workers never
            meet, so a worker that dies in `fit` is dropped and the others finish (evaluation then runs
            on each worker over the whole set); under ``"sync"`` it is a `WorkerLostError` naming it.
            Checkpoints with ``"sync"`` only; not with an LR
            scheduler, gradient clipping, fp16 or pipeline / tensor parallelism yet. See
            docs/parameter_server.md.
        heartbeat_timeout: seconds of heartbeat silence after which a peer rank counts as dead (None:
            no watch). From the first `train_step` on, each rank beats in the rendezvous store from a
            background thread (a long step keeps beating: silence means the process is gone, frozen or
            cut off) and watches its neighbours; a dead peer becomes a `PeerFailureError` naming it and
            its host, raised by `train_step` (and by `fit`'s evaluations and saves, `evaluate`,
            `save_checkpoint`, `full_state_dict` and, on a GPU, `close`; a rank's own error in them is
            named to its peers alike), instead of a hang until the collective `timeout`. On NCCL
            the process group is aborted so that a blocked collective returns; a rank still blocked
            ``max(10, 2 * heartbeat_timeout)`` seconds later (gloo cannot be woken) logs the error and
            exits with status `peer_watch.EXIT_CODE` (75), for torchrun to restart. See
            `distributed_training.peer_watch`. Not for a parameter server's workers under ssp / async:
            they never meet, and the servers drop a worker that dies.
    """

    @released_if_it_raises
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
        best_mode: str = "auto",
        resume: bool = True,
        checkpoint_shared: bool | None = None,
        checkpoint_async: bool = False,
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
        compile: bool | dict[str, Any] = False,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1f1b",
        microbatches: int | None = None,
        pipeline_split_points: list[str] | None = None,
        pipeline_chunks: int | None = None,
        pipeline_balance: str = "parameters",
        pipeline_sample_input: Any = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: dict[str, Any] | None = None,
        sequence_parallel: bool = False,
        heartbeat_timeout: float | None = 5.0,
        num_servers: int | None = None,
        consistency: str | None = None,
        staleness: int | None = None,
        sparse_embeddings: list[str] | tuple[str, ...] | None = None,
        pipeline_half_blocks: bool = False,
        pipeline_cuda_graphs: bool = False,
        pipeline_compile_loss: bool = False,
    ) -> None:
        if isinstance(model, (list, tuple)) and model and all(isinstance(p, tuple) and len(p) == 2 for p in model):
            from .pipeline.stages import Chain

            model = Chain(model)  # an adapter's (name, layer) pairs (`pipeline.chain`)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module (or an adapter's list of (name, module) pairs), got "
                            f"{type(model).__name__}")
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # Its state dict's keys carry "_orig_mod.": checkpoints and full_state_dict() did not load into the
            # plain model. The module inside it is compiled in place instead (its keys stay the model's).
            theirs = compile_options_of(model)
            if pipeline_parallel_size != 1:
                how, compile = "runs it eagerly (compile is not supported with a pipeline yet)", False
            elif compile:
                how = "compiles that in place with the trainer's compile=... options"
            elif theirs is not None:
                how, compile = f"compiles that in place with its own options ({describe_compile(theirs)})", theirs
            else:
                how, compile = "compiles that in place (compile=True; pass compile={...} for options)", True
            model = model._orig_mod
            warnings.warn(f"model is a torch.compile'd module: the trainer takes the module inside it and {how}, "
                          "so that checkpoints and full_state_dict() keep the model's own keys", stacklevel=3)
        check_optimizer(optimizer, model)
        check_arguments(gradient_accumulation_steps=gradient_accumulation_steps, gradient_clip_val=gradient_clip_val,
                         heartbeat_timeout=heartbeat_timeout, mixed_precision=mixed_precision, loss_scaler=loss_scaler,
                         compile=compile, checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir,
                         checkpoint_async=checkpoint_async, lr_scheduler=lr_scheduler)
        self.checkpoints = (CheckpointManager(checkpoint_dir, keep_last=keep_last, best_metric=best_metric,
                                              best_mode=best_mode) if checkpoint_dir is not None else None)
        if context is not None and timeout is not None:
            raise ValueError("timeout= is the collective timeout of the context the trainer creates; with context= "
                             "given, set it there: init_distributed(timeout=...)")
        served = {k: v for k, v in (("num_servers", num_servers), ("consistency", consistency),
                                    ("staleness", staleness), ("sparse_embeddings", sparse_embeddings))
                  if v is not None}
        check_strategy_argument(strategy, communication, served)  # before any rendezvous
        pipeline = PipelineOptions(pipeline_parallel_size, pipeline_schedule, microbatches, pipeline_split_points,
                                   pipeline_chunks, init_seed=seed, balance=pipeline_balance,
                                   sample_input=pipeline_sample_input, mixed_precision=mixed_precision,
                                   half_blocks=pipeline_half_blocks, cuda_graphs=pipeline_cuda_graphs,
                                   compile_loss=pipeline_compile_loss)
        tensor = TensorOptions(tensor_parallel_size, tensor_parallel_plan, sequence_parallel)
        check_parallel_arguments(pipeline, tensor, strategy=strategy, microbatches=microbatches,
                                 activation_checkpointing=activation_checkpointing,
                                 gradient_accumulation_steps=gradient_accumulation_steps, compile=compile)
        self.memory_budget_bytes = memory_budget_bytes
        self._model_sizes = model_sizes(model)  # before any wrapper shards the parameters
        model_params = {id(p) for p in model.parameters()}  # (an optimizer object over them: checked after set-up)

        self._owns_context = context is None
        self.context = context if context is not None else init_distributed(timeout=timeout)
        install_default_handler(self.context.rank)
        ctx = self.context
        # First, over the whole job: what decides its collectives is the same on every rank (a log_dir
        # given on rank 0 only hung the job at its first log step, unnamed).
        check_same_options({
            "strategy": strategy if isinstance(strategy, str) else type(strategy).__name__,
            "pipeline_parallel_size": pipeline_parallel_size, "tensor_parallel_size": tensor_parallel_size,
            "gradient_accumulation_steps": gradient_accumulation_steps, "gradient_clip_val": gradient_clip_val,
            "mixed_precision": mixed_precision, "seed": seed, "log_dir": None if log_dir is None else "set",
            "log_every": log_every, "checkpoint_dir": None if checkpoint_dir is None else "set",
            "checkpoint_every": checkpoint_every, "checkpoint_async": checkpoint_async,
            "checkpoint_shared": checkpoint_shared, "resume": resume, "save_on_preemption": save_on_preemption,
            "heartbeat_timeout": heartbeat_timeout,
            # (a budget per rank is fine for batch_size="auto", which agrees on its choice; strategy "auto" does not)
            **({"memory_budget_bytes": memory_budget_bytes} if strategy == "auto" else {}),
            "activation_checkpointing": activation_checkpointing, "communication": communication,
            "compile": compile if isinstance(compile, bool) else "arguments", "loss_scaler": loss_scaler,
            "pipeline_schedule": pipeline_schedule, "microbatches": microbatches, "pipeline_chunks": pipeline_chunks,
            "pipeline_split_points": pipeline_split_points, "pipeline_balance": pipeline_balance,
            "pipeline_half_blocks": pipeline_half_blocks, "pipeline_cuda_graphs": pipeline_cuda_graphs,
            "pipeline_compile_loss": pipeline_compile_loss, "sequence_parallel": sequence_parallel,
            "tensor_parallel_plan": tensor_parallel_plan, **served,
        }, "DistributedTrainer", ctx.group)
        # Before any group or checkpoint: a job restarted at a size that cannot keep the layout fails
        # here, on every rank alike, naming the sizes that can.
        check_layout_world(ctx.world_size, pipeline.size, tensor.size)
        # Also with one stage: a context shared with an earlier pipelined trainer gets its plain mesh back.
        ctx.set_mesh(pipeline=pipeline.size, tensor=tensor.size)
        strategy, self.plan = make_strategy(strategy, model, world_size=ctx.world_size, local_rank=ctx.local_rank,
                                            local_world_size=ctx.local_world_size, communication=communication,
                                            memory_budget_bytes=memory_budget_bytes, parameter_server=served,
                                            pipeline=pipeline, tensor=tensor)
        strategy.check_trainer_options({"checkpoint_dir": checkpoint_dir, "lr_scheduler": lr_scheduler,
                                        "gradient_clip_val": gradient_clip_val, "mixed_precision": mixed_precision,
                                        "compile": compile, "checkpoint_async": checkpoint_async,
                                        "checkpoint_shared": checkpoint_shared})
        self.job_context = ctx  # the whole job (its process group is the one `close` destroys)
        # The ranks that train together (the parameter server: its workers; its servers have their own).
        self.context = strategy.setup_context(ctx)
        if self.context is not ctx:
            # The job's messages come from the first rank that trains (servers log warnings only).
            speaks = self.context.is_main and strategy.trains
            install_default_handler(0 if speaks else max(1, ctx.rank), label=ctx.rank)  # (prefixed: its global rank)
        if self.plan is not None:
            log.info("strategy auto -> %s%s (%s)", self.plan.strategy, " with CPU offload" if self.plan.cpu_offload
                     else "", self.plan.reason)
        self.strategy = strategy
        # Before a call after a failed one: did every rank fail it? (`failure_agreement`)
        self._failure_agreement = FailureAgreement(self.context.world_size, self.context.independent)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clip_val = gradient_clip_val
        self.seed = seed
        self.device = self.context.device

        if has_meta(model) and (not pipeline.enabled or tensor.enabled):
            # Built on the meta device, without a pipeline: every rank materialises the whole model
            # (with a pipeline, each rank only its stages: `PipelineStrategy`). With tensor parallelism
            # too, the plan cuts the whole model before the pipeline does: it is materialised first,
            # on the CPU (the pipeline moves its stages to the device).
            materialize(model, self.device if not pipeline.enabled else torch.device("cpu"), seed=seed)
        if not strategy.places_module:
            model.to(self.device)
        if activation_checkpointing is not None:
            apply_activation_checkpointing(model, activation_checkpointing)
            self._checkpointed_model = model  # its key/value cache, if any, turned on again at close()
        self.model = strategy.setup_module(model, self.context)
        if compile is not False:
            # In place: `self.model` stays the strategy's wrapper (what its methods take) and keeps its keys.
            self.model.compile(**(compile if isinstance(compile, dict) else {}))
        self.optimizer = strategy.setup_optimizer(optimizer, self.model)
        check_optimizer_after_setup(optimizer, model_params, self.model)
        check_no_closure(self.optimizer)
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        self._left_out = [p for p in self.model.parameters() if p.requires_grad and id(p) not in held] if (
            self.optimizer is optimizer) else []  # (an object over some of the model, stepped as given: `_zero_grad`)
        check_optimizer_layout(self.optimizer, self.model, tensor.enabled)
        # Communication is timed (DDP: perf/comm_hidden_pct, perf/comm_wire_ms) on one step per log window, the
        # straggler probe's (`_record_step` arms it before that step; the first step too), and read at the
        # window's log step.
        if log_dir is not None:
            strategy.measure_communication(self.model, True)
            strategy.time_pipeline(self.model, True)  # a pipeline's stage times and bubble, likewise
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        if self.lr_scheduler is not None:
            check_scheduler(self.lr_scheduler)
        self._init_state(gradient_accumulation_steps, checkpoint_every, resume, checkpoint_shared, checkpoint_async,
                         save_on_preemption, heartbeat_timeout)
        self._measuring = log_dir is not None  # the next step's communication is timed (see above)
        if mixed_precision == "fp16" and self.device.type == "cpu" and self.context.is_main:
            log.warning("mixed_precision='fp16' on CPU: CPUs have no fast fp16 arithmetic, so training runs several "
                        "times slower than in fp32 (about 7x for a small GPT); use 'bf16' or fp32 on CPUs")
        self.precision: Precision = make_precision(mixed_precision, self.device.type, loss_scaler=loss_scaler,
                                                   group=self.context.group)
        self.mixed_precision = None if self.precision.name == "fp32" else self.precision.name
        self._log_every = log_every  # (alike on every rank, unlike a NullMonitor's: `EpochLoop`'s global loss)
        self.monitor = (Monitor(os.fspath(log_dir), rank=self.context.rank, world_size=self.context.world_size,
                                group=self.context.group, log_every=log_every,
                                straggler_threshold=straggler_threshold,
                                progress=progress and self.context.is_main,  # one bar: the job's main rank's
                                cluster_view=not self.context.independent, member=strategy.member)
                        if log_dir is not None and strategy.trains
                        else ProgressOnly(log_every) if progress and self.context.is_main and strategy.trains
                        else NullMonitor())
        self._record_config(model, gradient_accumulation_steps, gradient_clip_val, seed, pipeline, tensor)

    # ------------------------------------------------------------------ steps
    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The fp16 loss scaler (None in fp32 and bf16): `self.precision` owns it."""
        return self.precision.scaler

    @property
    def _monitoring(self) -> bool:
        return not isinstance(self.monitor, NullMonitor)  # (ProgressOnly is one: a bar, no figures)

    @property
    def monitor_log_every(self) -> int:
        return getattr(self.monitor, "log_every", 1)

    def get_performance_metrics(self) -> dict[str, Any]:
        """Throughput, communication overhead and the cluster view over the run (see `Monitor`)."""
        return self.monitor.get_performance_metrics()
