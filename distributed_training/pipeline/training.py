"""Pipeline parallelism in the trainer: `DistributedTrainer(..., pipeline_parallel_size=P, ...)`.

The trainer's pipeline arguments become a `PipelineOptions` (checked before any rendezvous), and the
data-parallel strategy the user chose is wrapped in a `PipelineStrategy`, which the trainer drives
through the strategy door like any other: it never asks whether a pipeline runs.

Layout. The runtime's mesh gets ``pipeline=P`` (the outermost dimension) and data parallelism over the
rest (`DistributedContext.set_mesh`): the ranks of a data-parallel group hold the same stages and see
different batches; the P ranks of a pipeline see the same batches (`fit` shards by ``mesh.dp_rank``).

Stages. The model's chain of layers (`stages.chain`: an `nn.Sequential`, our `GPT`, or an adapter's
list) is cut into S = P x V stages (V = `pipeline_chunks`, 2 by default for ``"interleaved_1f1b"``, 1
otherwise), balanced by parameter count (`partition` of `balance.layer_costs`: the largest stage
smallest); our GPT by compute with ``pipeline_balance="compute"`` (`gpt_layer_costs`), any chain by each
layer's forward + backward measured on the device at setup with ``"time"`` (averaged over the ranks so
that every rank cuts alike), both cut where the schedule's simulated step is shortest
(`balance.schedule_cut`); or cut at `pipeline_split_points` (`split_at`).
Chunk c of pipeline rank r is stage ``c * P + r``. Every rank receives the user's model object,
keeps its stages' layers and frees the rest: the other layers' parameters and buffers in the user's
model object are replaced by meta tensors (shapes only), so the model passed to the trainer is not
usable afterwards except through the trainer. Only the kept stages go to the device. A model built on
the meta device (too large for one host: ``with torch.device("meta"): model = GPT(cfg)``) is cut the
same way, and each rank gives storage to its own stages' layers only, on its device, and initialises
them there (`meta_init.materialize`, seeded by `PipelineOptions.init_seed`, the trainer's `seed`): no
rank ever holds the whole model.

One step on one rank (`forward_backward`, then the trainer's `optimizer_step`):

1. `PipelineEngine.step` runs this rank's actions of the schedule with every backward under the data-
   parallel strategy's `no_sync`: gradients accumulate over the microbatches, nothing is reduced.
2. After the step's last backward (the engine's `after_backward`; with a reduction that keeps state, or a
   tie held by more than two ranks, once every rank's schedule ended well: `PipelineEngine.after_agreement`):
   the accumulated gradients of tied parameters (the GPT's token embedding, used again by its head) are
   summed between the pipeline ranks holding a copy (`accumulated_gradient`: before any reduction, so
   sharded copies need not sit alike in their shards; two holders by message, where a holder's late
   failure is heard, more by an all-reduce over a group of them per data-parallel index); then
   `strategy.sync_gradients` reduces the accumulated gradients over the data-parallel group, once
   (DDP: all-reduce; ZeRO-1: reduce-scatter of its buckets; ZeRO-2/3: reduce-scatter of each FSDP
   unit's full gradient into its shard). Why not let the last
   microbatch's backward synchronise, as gradient accumulation does? A stage's last backward also
   produces the input gradient it sends to the previous stage, and (on CUDA) that send is ordered
   after the reduction's wait: every stage would hold up the one before it by its all-reduce, P
   reductions in a row on the critical path. Reducing after the schedule costs one exposed
   reduction on the rank that finishes last and hides the others behind the pipeline's cool-down.
3. The optimizer step (`Strategy.optimizer_step`): unscale (fp16: the overflow decision is agreed by
   every rank of the job, all stages), clip by the global norm (`clip_grad_norm`: the stage's sum of
   squares over its data-parallel group, `gradient_norm_squares`, shards summed, a tied parameter
   counted on one stage only, all-reduced over the pipeline), step. Mixed precision: the schedule
   (each stage's forward and the loss) runs in one region of the precision's autocast; fp16 scales
   the loss on the last stage (the returned loss is unscaled).

The loss is the whole batch's mean (each microbatch weighted by its share) on every rank of the
pipeline. `full_state_dict` gathers the stages into the model's own keys on rank 0. Data-parallel
strategies: those with `deferred_gradient_sync`: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` /
``"fsdp"`` and their objects (not ``"auto"``). The inner strategy wraps a container of this rank's
stages (`setup_stages`: FSDP makes each stage and each of its layers a unit, whose hooks gather the
parameters when the engine calls the stage; ZeRO-3 gathers again for every microbatch, ZeRO-2 keeps
them from the first forward to the reduction).

Checkpoints are in the one format (`checkpoint_shards`): each rank describes its stages' parameters
and optimizer state as the inner strategy holds them (DDP: whole, written by the first data-parallel
replica; ZeRO-1: whole parameters, bucket slices of the optimizer state; FSDP: shards), under the
model's own names (`named_parameters`: the GPT's tied weight is ``wte.weight``, as under DDP or FSDP),
a tied weight's copies written once (the lowest pipeline rank's pieces). So a checkpoint saved at P=2 x DP=2 loads at
P=4, or without a pipeline, and back: each rank reads the pieces its stages need, every copy of a tied
weight the same one. Buffers go by the model's keys too (`buffers`). What the inner strategy keeps per
stage (DDP's bucket layout, compression residuals) comes back only into the same cut of the model.

`evaluate` runs forward only, each batch whole through the stages: `pipeline.evaluation`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..logs import get_logger
from ..models.gpt import GPT
from ..runtime import DistributedContext
from ..strategies.base import OptimizerFactory, Strategy, checked_optimizer
from .engine import PipelineEngine
from .evaluation import PipelineEvaluation
from .balance import layer_costs, schedule_cut, split_step
from .compiled_loss import CompiledLoss
from .gpt_stages import lm_loss
from .meta_init import check_initialisable, has_meta, materialize
from .options import PipelineOptions
from .stage_state import PipelineState
from .stage_setup import (autocast_for, checkpoint_halves, describe_cut, free_other_layers, global_of,
                          refuse_block_hooks)
from .stages import Stage, chain, find_ties, partition, split_at, tied_groups

__all__ = ["PipelineOptions", "PipelineStrategy", "PipelineStages"]

log = get_logger("pipeline")

class PipelineStages(nn.Module):
    """This rank's stages (chunk c at ``stages[c]``): what the data-parallel strategy wraps and the
    optimizer steps. Its forward is not the model's (the engine runs the stages, one microbatch at a
    time), so calling it raises."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("with pipeline_parallel_size > 1 the model runs only through train_step, fit and "
                                  "evaluate (auto batch size and direct calls are not supported yet)")


class PipelineStrategy(PipelineState, PipelineEvaluation, Strategy):
    """A data-parallel strategy run inside each stage of a pipeline (see the module docstring).

    Args:
        inner: the data-parallel strategy (DDP, ZeRO-1, FSDP): it wraps this rank's stages
            (`setup_stages`), reduces their gradients over the data-parallel group after the schedule
            (`sync_gradients`), builds the optimizer, and says what it holds of the gradients
            (`gradient_norm_squares`, `accumulated_gradient`) and of the state (`state_layout`).
        options: the pipeline's shape, schedule and microbatches.
    """

    whole_module = False  # (see `Strategy.whole_module`)

    places_module = True

    def __init__(self, inner: Strategy, options: PipelineOptions) -> None:
        if not inner.deferred_gradient_sync:
            raise NotImplementedError(
                f"strategy {inner.name!r} with pipeline_parallel_size={options.size} is not supported yet: each "
                "stage's gradients must be reduced once after the schedule's backward passes (sync_gradients); "
                "use strategy='ddp', 'zero1', 'zero2', 'zero3' or 'fsdp'")
        self.inner = inner
        self.options = options
        self.name = inner.name
        self.collective_forward = inner.collective_forward  # FSDP gathers in each stage's forward
        self._placeholder: nn.Parameter | None = None  # the optimizer's tensor on a rank without parameters
        self.precision = None  # the trainer's, set by forward_backward

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        opts = self.options
        mesh = context.mesh
        P, V, S = opts.size, opts.chunks, opts.num_stages
        if mesh.size("pipeline") != P:
            raise RuntimeError(f"the context's mesh has pipeline={mesh.size('pipeline')}, not {P}: call "
                               f"context.set_mesh(pipeline={P}) first (the trainer does)")
        if opts.half_blocks and not isinstance(module, GPT):
            raise ValueError(f"pipeline_half_blocks=True cuts our GPT's blocks into their attention and MLP halves; "
                             f"a {type(module).__name__} has no such blocks: leave it False (or cut at "
                             "pipeline_split_points)")
        if opts.half_blocks:
            refuse_block_hooks(module)
        layers = chain(module, halves=opts.half_blocks)
        if opts.half_blocks:
            checkpoint_halves(module, layers)
        names = [name for name, _ in layers]
        if S > len(layers):
            raise ValueError(f"pipeline_parallel_size={P} x pipeline_chunks={V} = {S} stages, but the model has only "
                             f"{len(layers)} layer{'s' if len(layers) != 1 else ''} to cut ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})")
        if opts.split_points is not None:
            try:
                bounds = split_at(opts.split_points, names)
            except ValueError as err:
                raise ValueError(f"pipeline_split_points: {str(err).removeprefix('boundary_names: ')}") from None
            costs = None
        else:
            # The GPT's loss counts on the head's layer unless it is compiled (CUDA only: on a CPU it runs
            # as it is).
            counted_loss = not (opts.compile_loss and torch.device(context.device).type == "cuda")
            if has_meta(module) and opts.balance == "time":
                check_initialisable(module, layers)  # its error before any timing, on every rank alike
            costs = layer_costs(module, layers, opts.balance, device=context.device, sample=opts.sample_input,
                                autocast=autocast_for(opts.mixed_precision, context.device), group=context.group,
                                collective_device=context.device if context.backend == "nccl" else None,
                                loss=counted_loss)
            if opts.balance == "parameters":
                bounds = partition(costs, S)  # memory: the largest stage as small as it can be
            else:  # time: the schedule's simulated step as short as it can be
                forward, backward = split_step(module, layers, opts.balance, costs, opts.sample_input,
                                               loss=counted_loss)
                bounds = schedule_cut(forward, backward, opts.schedule, P, opts.microbatch_count, V)
        #: What the cut balanced (one cost per chain layer: parameters, FLOPs per token or seconds; None
        #: with pipeline_split_points) and the cut (stage s holds chain layers bounds[s]:bounds[s + 1]).
        self.layer_costs: list[float] | None = costs
        self.bounds = list(bounds)
        if context.is_main:
            log.info("pipeline: %d stages %s: %s", S, "at pipeline_split_points" if costs is None else
                     f"balanced by {opts.balance}", describe_cut(names, bounds, costs, opts.balance))
        rank = mesh.rank("pipeline")
        self.device = context.device
        self._dp_rank = mesh.dp_rank
        self._tensor_rank = mesh.rank("tensor")
        self._mine = [c * P + rank for c in range(V)]  # stage of each chunk
        stages = [Stage(layers[bounds[s]:bounds[s + 1]], s, S) for s in self._mine]

        # The model's own state_dict keys of each stage key (both keys of a tied weight), taken now:
        # moving the stages to the device replaces buffer objects.
        origin: dict[int, list[str]] = {}
        self._key_order = list(module.state_dict(keep_vars=True))
        for key, tensor in module.state_dict(keep_vars=True).items():
            origin.setdefault(id(tensor), []).append(key)
        self._keys = [{key: origin.get(id(t), [key]) for key, t in stage.state_dict(keep_vars=True).items()}
                      for stage in stages]
        # The checkpoint format's names: each parameter (and buffer) under its name in the model's
        # named_parameters (named_buffers), the tied weight under its first name there ("wte.weight"),
        # as a DDP or FSDP run of the same model names them; shapes of the whole model.
        param_name = {id(p): name for name, p in module.named_parameters()}
        buffer_name = {id(b): name for name, b in module.named_buffers()}
        self._shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        self._param_names = [{key: param_name[id(p)] for key, p in stage.named_parameters()} for stage in stages]
        self._buffer_names = [{key: buffer_name[id(b)] for key, b in stage.named_buffers()} for stage in stages]
        self._all_buffers = list(buffer_name.values())
        self._layout_id = {"pipeline": P, "chunks": V, "bounds": list(bounds)}

        ties = find_ties(layers)  # by parameter identity: before materialising gives each copy its own
        meta = has_meta(module)
        if meta:
            # A model built on the meta device: only this rank's layers get storage, on the device,
            # and their initial weights (`meta_init`); the rest of the model object stays meta. The
            # whole chain is checked first, so that every rank refuses alike.
            check_initialisable(module, layers)
            materialize(module, self.device, seed=opts.init_seed,
                        layers=[pair for s in self._mine for pair in layers[bounds[s]:bounds[s + 1]]])
        firsts = self._setup_ties(layers, names, bounds, ties, context)
        if meta and not isinstance(module, GPT):
            # A tie's copies on later stages take the value of the first stage's (its first owner's
            # initialisation: what one process materialising the whole model gets). The GPT's copies
            # are drawn equal on every stage already.
            for param, group, source in firsts:
                dist.broadcast(param.data, src=source, group=group)
        free_other_layers(module, stages)
        for stage in stages:
            stage.to(self.device)

        container = PipelineStages(stages)
        self._name_container(container, stages)
        wrapped = self.inner.setup_stages(container, list(stages), context)
        self._model = wrapped
        up = down = header = group = mesh.group("pipeline")
        if context.backend == "nccl":
            up, down, header = self._nccl_pipeline_groups(context)
        self._pipe_group = group
        ranks = [global_of(context, r) for r in mesh.ranks("pipeline")]
        self._pipe_rank, self._pipe_ranks = rank, ranks
        self.engine = PipelineEngine(list(stages), ranks=ranks, rank=rank,
                                     group=group, up_group=up, down_group=down, header_group=header,
                                     schedule=opts.schedule, microbatches=opts.microbatches, loss_fn=self._loss,
                                     device=self.device, after_backward=self._after_backward,
                                     cuda_graphs=opts.cuda_graphs)
        self.engine.data_group, self.engine.data_size = mesh.group("data"), mesh.dp_size
        # Only once every stage's schedule has ended well (`PipelineEngine.after_agreement`): a tied weight
        # held by more than two ranks is summed by a collective with other stages, which one that failed
        # would never join (two holders exchange messages instead: `_after_backward`); and a reduction that
        # keeps state (compression's error-feedback residuals, PowerSGD's matrices) would keep a step that an
        # earlier stage's late failure drops (its reduction is exposed then: the price).
        stateful = hasattr(getattr(wrapped, "bucket_reducer", None), "state_dict")
        self.engine.after_agreement = any(len(holders) > 2 for *_, holders in self._ties) or stateful
        self.engine.lockstep_replicas = self.inner.collective_forward
        if self.engine.lockstep_replicas and mesh.dp_size > 1:
            self.engine.rows_group = mesh.host_group("data")
        self._loss_fn: Callable | None = None
        self._default_loss = lm_loss if isinstance(module, GPT) else None
        return wrapped

    def _name_container(self, container: PipelineStages, stages: Sequence[Stage]) -> None:
        """The model's names of what the inner strategy names in `container` (``"stages.{c}." + the
        stage's key``): `_model_name` for parameters (every name of each, shared or not), `_own_keys`
        for state_dict keys (each to both keys of a tied weight)."""
        self._model_name: dict[str, str] = {}
        for c, stage in enumerate(stages):
            first = {id(p): key for key, p in stage.named_parameters()}
            for key, p in stage.named_parameters(remove_duplicate=False):
                self._model_name[f"stages.{c}.{key}"] = self._param_names[c][first[id(p)]]
        self._own_keys = {f"stages.{c}.{key}": own for c, keys in enumerate(self._keys) for key, own in keys.items()}
        # And back: the container's names of each model name (every name of a shared parameter too).
        self._container_names: dict[str, list[str]] = {}
        for c, stage in enumerate(stages):
            for key, p in stage.named_parameters(remove_duplicate=False):
                for own in self._keys[c].get(key, [key]):
                    self._container_names.setdefault(own, []).append(f"stages.{c}.{key}")

    def _in_container(self, names: frozenset[str]) -> frozenset[str]:
        """The container's names of the parameters the model calls `names` (those on this rank)."""
        return frozenset(c for name in names for c in self._container_names.get(name, ()))

    def _setup_ties(self, layers, names, bounds, ties, context: DistributedContext) -> list[tuple[nn.Parameter, Any, int]]:
        """Groups over the pipeline ranks holding copies of each tied parameter, one per data-parallel
        index (collective: every rank creates every group, in the same order), and this rank's copies.
        Returns, per copy this rank holds, (copy, group, global rank of the tie's first stage)."""
        mesh = context.mesh
        pipeline_ranks = mesh.ranks("pipeline")
        firsts = []
        P, rank = self.options.size, mesh.rank("pipeline")
        by_key = {}
        for s in self._mine:
            for name, layer in layers[bounds[s]:bounds[s + 1]]:
                for key, p in layer.named_parameters(remove_duplicate=False):
                    by_key[f"{name}.{key}"] = p
        # (this rank's copy's name in the stages' container, the holders' group, the holders' pipeline ranks)
        self._ties: list[tuple[str, Any, tuple[int, ...]]] = []
        not_counted: set[str] = set()  # copies whose gradient (and state) another rank counts (and saves)
        made: dict[tuple[int, ...], Any] = {}
        for tie in tied_groups(ties, names, bounds):
            holders = tuple(sorted({s % P for s in tie.stages}))
            if len(holders) < 2:
                continue  # all copies on one rank: the same parameter there, its gradient already the sum
            if holders not in made:
                mine = None
                for pipeline in mesh.layout.groups("pipeline"):
                    members = [pipeline[i] for i in holders]
                    group = (mesh.group("pipeline") if len(members) == P else
                             dist.new_group([global_of(context, r) for r in members]))
                    if mesh.rank() in members:
                        mine = group
                made[holders] = mine
            if rank in holders:
                s = next(s for s in tie.stages if s % P == rank)
                param = by_key[tie.key_on(s)]
                name = f"stages.{self._mine.index(s)}.{tie.key_on(s)}"
                self._ties.append((name, made[holders], holders))
                firsts.append((param, made[holders], global_of(context, pipeline_ranks[tie.stages[0] % P])))
                if rank != holders[0]:
                    not_counted.add(name)
        self._not_counted = frozenset(not_counted)
        return firsts

    def _nccl_pipeline_groups(self, context: DistributedContext):
        """The payload groups (one per direction) and the gloo header group of this rank's pipeline
        (`p2p.StageLink`); every rank creates those of every pipeline, in the same order."""
        mesh = context.mesh
        mine = None
        for pipeline in mesh.layout.groups("pipeline"):
            ranks = [global_of(context, r) for r in pipeline]
            groups = (dist.new_group(ranks), dist.new_group(ranks), dist.new_group(ranks, backend="gloo"))
            if mesh.rank() in pipeline:
                mine = groups
        return mine

    def check_trainer_options(self, options: dict[str, Any]) -> None:
        self.inner.check_trainer_options(options)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.inner.unwrap(model)

    def give_back(self, model: nn.Module) -> None:
        # Each rank holds its own stage only: the model passed keeps those weights, the other stages'
        # parameters stay on the meta device (gathering the whole model on every rank is what a pipeline is
        # there to avoid), so its state_dict() would save meta tensors. Said once, by rank 0.
        if dist.get_rank() == 0:
            warnings.warn("under a pipeline the model you passed keeps only this rank's stage's weights after "
                          "close (under tensor parallelism too, this rank's part of them; the other stages' "
                          "parameters are on the meta device): take "
                          "trainer.full_state_dict() (rank 0; pipeline.model_keys maps an adapter's keys back to "
                          "the model's) or save_checkpoint() before close()", stacklevel=3)

    def summon_full_params(self, model: nn.Module, writeback: bool = True):
        return self.inner.summon_full_params(model, writeback)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer | OptimizerFactory,
                        model: nn.Module) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise TypeError(f"with pipeline_parallel_size={self.options.size} the optimizer is built over this "
                            "rank's stages only: pass a callable that takes parameters (e.g. lambda params: "
                            f"torch.optim.AdamW(params, lr=3e-4)), not {type(optimizer).__name__}")
        if next(iter(model.parameters()), None) is None:
            # This rank's stages hold no parameter (only layers like ReLU or Flatten: a model may leave no
            # other cut at this many stages). Its optimizer is still the factory's, over one empty
            # placeholder, so the hyperparameters and an lr schedule are there as on the other ranks;
            # its steps change nothing, and the checkpoints hold no optimizer state of this rank.
            self._placeholder = nn.Parameter(torch.zeros(0, device=self.device))
            return checked_optimizer(optimizer([self._placeholder]))
        return self.inner.setup_optimizer(optimizer, model)

    # ------------------------------------------------------------------ a step
    def loss_criterion(self, criterion: Callable | None) -> Callable | None:
        """The user's criterion, or our GPT's language-model loss where none is given (what the last
        stage applies: `evaluate` counts a batch's targets by it)."""
        return criterion if criterion is not None else getattr(self, "_default_loss", None)

    def _criterion_and_pair(self, criterion: Callable | None, batch: Any, caller: str):
        if criterion is None:
            if self._default_loss is None:
                raise ValueError(f"with pipeline_parallel_size > 1 {caller} needs a criterion: the last stage "
                                 "computes the loss from its output and the targets (the model's own loss is "
                                 "not available); a GPT without one uses its language-model loss")
            criterion = self._default_loss
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("with pipeline_parallel_size > 1 each batch must be an (inputs, targets) pair: the first "
                             "stage reads the inputs, the last the targets")
        return criterion, batch[0], batch[1]

    def forward_backward(self, model: nn.Module, batch: Any, criterion: Callable | None,
                         precision) -> torch.Tensor:
        criterion, inputs, targets = self._criterion_and_pair(criterion, batch, "train_step")
        self._loss_fn, self.precision = self._compiled(criterion), precision
        self.engine.criterion = criterion  # the microbatches' loss weights follow its reduction (loss_weights)
        scaler = precision.scaler
        self._scale = scaler.scale if scaler is not None else None
        before = getattr(model, "before_forward", None)
        if before is not None:  # the data-parallel wrapper's buffer broadcast (BatchNorm statistics)
            before()
        # One autocast region around the whole schedule (not one per stage forward): leaving the
        # outermost region drops autocast's cache of low-precision weights, which every microbatch's
        # forward would then cast again (GPT-2 124M on 2x H100: about 200 extra casts a step).
        with self.inner.no_sync(model), precision.autocast():
            loss = self.engine.step(inputs, targets)
        return loss / self._scale if self._scale is not None else loss

    def _compiled(self, criterion: Callable) -> Callable:
        """`criterion` through `CompiledLoss` with ``pipeline_compile_loss`` (one per criterion object,
        kept: compiled once), else as it is."""
        if not self.options.compile_loss:
            return criterion
        cache = self.__dict__.setdefault("_compiled_losses", {})
        if id(criterion) not in cache:
            cache[id(criterion)] = (criterion, CompiledLoss(criterion))
        return cache[id(criterion)][1]

    def _loss(self, output, target) -> torch.Tensor:
        loss = self._loss_fn(output, target)  # under the step's autocast (forward_backward)
        return loss * self._scale if self._scale is not None else loss

    def _after_backward(self) -> None:
        # A tied weight's copies: their accumulated gradients summed before the data-parallel reduction
        # (which is linear), so the copies need not sit alike in their shards.
        # Two holders (the GPT's first and last stage) exchange them by message, so that one whose stage
        # failed late in the step (its stop heard instead) cannot leave the other waiting in a collective;
        # more holders all-reduce, once the step's end is agreed (`after_agreement`).
        link, me = self.engine.link, self._pipe_rank
        for name, group, holders in self._ties:
            grad = self.inner.accumulated_gradient(self._model, name)
            if len(holders) > 2:
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
                continue
            other = holders[1] if me == holders[0] else holders[0]
            link.send(grad, me, other)
            theirs = link.recv(me, other)
            link.wait_all()  # (the send has read `grad` before it changes; on NCCL: in stream order)
            grad.add_(theirs)  # (a + b == b + a: the copies stay equal, bit for bit)
        self.inner.sync_gradients(self._model)

    def time_pipeline(self, model: nn.Module, on: bool) -> None:
        self.engine.timing = on

    def pop_pipeline_timing(self, model: nn.Module) -> dict[str, float] | None:
        timing, self.engine.last_timing = self.engine.last_timing, None
        return None if timing is None else timing.metrics()

    def loss_scale_changed(self, model: nn.Module, ratio: float, skipped: bool) -> None:
        self.inner.loss_scale_changed(self._model, ratio, skipped)

    def no_sync(self, model: nn.Module):
        return self.inner.no_sync(model)  # a pipeline step syncs once anyway; kept for the interface

    def gradients(self, model: nn.Module) -> list[torch.Tensor]:
        return self.inner.gradients(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the 2-norm of the whole model's gradient: the sum of squares of this stage's
        gradients over its data-parallel group (`gradient_norm_squares`: DDP's replicas hold them all,
        ZeRO's and FSDP's shards are summed over the group), a tied parameter's copies counted once (on
        the lowest pipeline rank holding one), summed over the pipeline; each rank scales what its
        optimizer steps (`gradients`)."""
        return self._clip_by_norm_squares(model, max_norm)

    def gradient_norm_squares(self, model: nn.Module, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """The sum of squares of the whole model's gradients (every stage, every shard; a tied
        parameter's copies once), less the parameters the model names in `skip`; on every rank."""
        squares = self.inner.gradient_norm_squares(model, self._not_counted | self._in_container(skip))
        squares = squares.to(self.device)
        if self.options.size > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self._pipe_group)
        return squares

    def reduced_gradients_of(self, model: nn.Module, names: frozenset[str]) -> list[torch.Tensor]:
        return self.inner.reduced_gradients_of(model, self._in_container(names))

    def planner_kind(self) -> str:
        return self.inner.planner_kind()

    def teardown(self, model: nn.Module) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and engine.graphs is not None:
            # The CUDA graphs' memory pools back to the allocator now (a trainer built after this one in the
            # same process would otherwise find them held: 36 GiB after three graphed GPT-1.3B trainers at
            # P = 2, session 28); the engine runs eagerly if stepped again.
            engine.graphs.clear()
            engine.graphs = None
        self.inner.teardown(model)
