"""The interface every parallelism strategy implements, so the trainer never needs to know which one runs.

A strategy answers: how to wrap the model (`setup_module`), how to build the optimizer over what the
wrapper exposes (`setup_optimizer`), how to skip gradient synchronisation during accumulation
(`no_sync`), how to run backward and the optimizer step through a precision object (`backward`,
`optimizer_step`: autocast, loss scaling and skipping on overflow belong to `distributed_training.amp`;
the step's order, unscale then clip then step, to the strategy), which gradients this rank holds
(`gradients`), how to clip by the *global* gradient norm (`clip_grad_norm`), what it holds of the
model and optimizer state (`state_layout`: pieces of the full tensors, which checkpoints save and load
in one format; `model_state_dict`: the full model) and what else a checkpoint must
carry (`rank_state`: this rank's, e.g. compression residuals; `shared_state`: the same on every
rank, e.g. DDP's bucket layout; `buffers`: this rank's buffers under the model's keys), how a
strategy that runs the forward itself evaluates (`evaluate_batch`, `evaluation_sums`), what its communication cost (`measure_communication`,
`pop_communication_metrics`), what a pipeline needs of it inside its stages (`setup_stages`,
`sync_gradients` after backward passes run under `no_sync`, `accumulated_gradient`,
`gradient_norm_squares`), how a pipeline's stages spend a step (`time_pipeline`,
`pop_pipeline_timing`), and what its memory layout is to the planner (`planner_kind`,
`state_reserve_bytes`). The defaults below are those of a replicated model with nothing to report;
the other strategies override what differs.
"""

from __future__ import annotations

import abc
import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint_shards import StateLayout, whole_tensors
from ..runtime import DistributedContext

if TYPE_CHECKING:  # strategies sit below amp: they call a precision object, never build one
    from ..amp import Precision

__all__ = ["Strategy", "OptimizerFactory", "check_optimizer_params", "require_factory", "ParamNames"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ParamNames:
    """Names of a module's parameters, remembered weakly so that they can still be given once a
    wrapper has taken the tensors out of the module (FSDP) or re-homed them (ZeRO-1)."""

    def __init__(self, module: nn.Module) -> None:
        self._refs = [(weakref.ref(p), name) for name, p in module.named_parameters()]

    def name_of(self, tensor: torch.Tensor) -> str | None:
        for ref, name in self._refs:
            if ref() is tensor:
                return name
        return None


def require_factory(optimizer, name: str) -> OptimizerFactory:
    """`optimizer` if it is a factory (a callable taking parameters); sharded strategies need one, to
    build the optimizer over the shards they create."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"strategy '{name}' builds the optimizer over this rank's shards: pass a callable that takes "
            "parameters (e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)), not an optimizer"
        )
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a callable taking parameters, got {type(optimizer).__name__}")
    return optimizer


def checked_optimizer(built: Any) -> torch.optim.Optimizer:
    """`built`, what an optimizer factory returned, if it is an optimizer (else a TypeError naming it)."""
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer")
    return built


def check_groups_over_shards(optimizer: torch.optim.Optimizer, strategy: str,
                             group: "dist.ProcessGroup | None" = None) -> None:
    """Raise, on every rank of `group` alike, if a param group the factory made is empty on every rank
    while another, with other hyperparameters, is not: over flat 1-D shards (each holding slices of
    several layers), a factory that splits parameters by shape or name (decay only where
    ``p.dim() >= 2``, as nanoGPT does) or by identity (the head at a higher learning rate than the
    backbone) puts every shard in one group, so the other group's settings silently apply to nothing and
    its parameters train with the first group's. A group empty on some ranks only (a factory that reads
    which layers a shard holds) loses nothing. Collective over `group` when it has several ranks."""
    lost = _lost_group_settings(optimizer)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, lost, group=group)
        lost = {i: said for i, said in lost.items() if all(i in other for other in everyone)}
    for said in lost.values():
        raise lost_group_error(f"strategy '{strategy}' hands the optimizer factory", said,
                               "use strategy 'ddp', whose factory gets the parameters themselves")


def lost_group_error(handed: str, said: str, instead: str) -> ValueError:
    """The error for a param group whose settings (`said`) apply to no parameter over flat shards
    (`check_groups_over_shards`); `handed` says who gave the optimizer the shards, `instead` what gives it
    the layers' own parameters."""
    return ValueError(
        f"{handed} flat 1-D shards, each holding slices of several layers, and its param group with {said} is "
        "empty: no parameter trains with those settings (a split by p.dim(), by name or by the parameters "
        "themselves puts every shard in one group). For weight decay with exclusions use "
        "distributed_training.optim.param_groups with decay_by_segments under 'zero2' / 'zero3' / 'fsdp' "
        f"(docs/dtrain_jobs.md); for other per-layer settings (a learning rate per group) {instead}")


def _lost_group_settings(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """{index: its settings} of this rank's empty param groups whose settings differ from every group
    that holds parameters (`check_groups_over_shards`)."""
    full = [g for g in optimizer.param_groups if g["params"]]
    if not full:
        return {}  # (check_optimizer_params names an optimizer over nothing)
    keys = [k for k in optimizer.defaults if k != "params"]
    lost = {}
    for index, group in enumerate(optimizer.param_groups):
        if group["params"] or _number(group.get("lr")) == 0:
            continue  # (an empty group at lr 0: frozen parameters, which the strategy leaves out, fine)
        # A weight decay of 0 that applies to nothing is fine too (a no-decay group that a shard-aware
        # factory, `decay_by_segments`, leaves empty); any other setting that differs is lost.
        differs = [k for k in keys if k in group and group[k] != full[0].get(k)
                   and not (k == "weight_decay" and not group[k])]
        if differs and not any(all(group.get(k) == other.get(k) for k in differs) for other in full[1:]):
            lost[index] = ", ".join(f"{k}={group[k]!r} (the trained group's {full[0].get(k)!r})" for k in differs)
    return lost


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_optimizer_params(
    optimizer: torch.optim.Optimizer,
    expected: Iterable[torch.Tensor],
    *,
    strategy: str,
    expected_what: str,
    names: ParamNames | None = None,
    consequence: str,
) -> None:
    """Raise if `optimizer` holds a tensor outside `expected`, or none of them: the optimizer a factory
    returned must hold what the strategy handed it, or its steps update tensors that never receive
    gradients (or nothing: groups built over ``model.named_parameters()`` after the strategy emptied it)."""
    allowed = {id(t) for t in expected}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in allowed]
    if not foreign and allowed and not held:
        raise ValueError(
            f"strategy '{strategy}': the optimizer holds none of {expected_what} (its parameter groups are "
            "empty), so training would silently do nothing. Build it over the parameters the factory is given, "
            "e.g. lambda params: torch.optim.SGD(params, lr=0.1). Weight-decay exclusions over flat shards: "
            "distributed_training.optim.param_groups and decay_by_segments (docs/dtrain_jobs.md)")
    if not foreign:
        return
    first = foreign[0]
    name = names.name_of(first) if names is not None else None
    shown = f"'{name}' of shape {tuple(first.shape)}" if name else f"a tensor of shape {tuple(first.shape)}"
    raise ValueError(
        f"strategy '{strategy}': the optimizer holds {len(foreign)} tensor(s) that are not {expected_what} "
        f"(first: {shown}); {consequence}. Build the optimizer over the parameters the factory is given, "
        "e.g. lambda params: torch.optim.SGD(params, lr=0.1), not over model.parameters()"
    )


class Strategy(abc.ABC):
    """Base class of DDP, FSDP and ZeRO strategies."""

    name: str = "strategy"
    #: True when the wrapped model's forward runs collectives (FSDP gathers parameters): every rank must
    #: then run the same number of forwards, evaluation included.
    collective_forward: bool = False
    #: True when the data-parallel replicas average their gradients over the mesh's data group, so that
    #: the trainer may weigh each replica's loss by its share of the batch (`loss_weights.StepWeights`,
    #: one all-reduce of the counts a step); False for replicas that never meet (a parameter server's
    #: workers, which survive a dead peer).
    replicas_meet: bool = True
    #: Whether `train_step` tells the strategy what each step's batch counts (`set_batch_count`): a
    #: parameter server's ``sync`` servers weigh each worker's gradient by it.
    wants_batch_count: bool = False
    #: True when `setup_module` moves (what it keeps of) the model to the device itself; otherwise the
    #: trainer moves the whole model there first.
    places_module: bool = False
    #: True when `sync_gradients` can reduce, after the fact, gradients that backward passes accumulated
    #: under `no_sync`: what running each pipeline stage's data parallelism needs.
    deferred_gradient_sync: bool = False

    #: False on a rank that does not train (a parameter server's server): its `fit` runs `serve`.
    trains: bool = True
    #: Whether the unwrapped module is the user's whole module tree, under its own keys (FSDP's is: its
    #: parameters live in shards; a pipeline rank's stages or a tensor-parallel split are not): checkpoints
    #: then keep its modules' extra state (``get_extra_state()``); otherwise it is warned of and left out.
    whole_module: bool = True
    #: What the ranks of the context this strategy gives the trainer are (the monitor's `member`):
    #: ``"worker"`` for a parameter server's workers, whose context rank is the worker index.
    member: str = "rank"

    def check_trainer_options(self, options: dict[str, Any]) -> None:
        """Raise for a trainer option (by its argument name, e.g. ``checkpoint_dir``) this strategy does
        not run; called before any rendezvous."""

    def setup_context(self, context: DistributedContext) -> DistributedContext:
        """The context the trainer runs on from now on: `context` itself, or (the parameter server) one
        over the ranks that train together. Collective over the job (it may create groups)."""
        return context

    def serve(self, model: nn.Module) -> Any:
        """On a rank that does not train (`trains` False): what its `fit` runs instead."""
        raise NotImplementedError(f"strategy {self.name!r} trains on every rank: nothing to serve")

    def end_fit(self, model: nn.Module) -> None:
        """At the end of a training rank's `fit`, after its last step and evaluation."""

    @abc.abstractmethod
    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        """Wrap `module` (already on `context.device`) for training; return the wrapper."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper."""
        return getattr(model, "module", model)

    def summon_full_params(self, model: nn.Module, writeback: bool = True) -> contextlib.AbstractContextManager:
        """A block in which the unwrapped module holds its full weights (a sharded strategy gathers
        them, and with `writeback` copies what the block wrote into them back into its shards; this one
        holds them already: what is written stays)."""
        return contextlib.nullcontext()

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer | OptimizerFactory, model: nn.Module
    ) -> torch.optim.Optimizer:
        """Build the optimizer from a factory over `model.parameters()`, or accept a built one."""
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if not callable(optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a callable taking parameters, "
                f"got {type(optimizer).__name__}"
            )
        built = checked_optimizer(optimizer(model.parameters()))
        # A replicated model's parameters are the user's own tensors, so a factory that ignores its
        # argument and uses model.parameters() is fine; anything else gets no averaged gradient.
        check_optimizer_params(built, model.parameters(), strategy=self.name,
                               expected_what="parameters of the wrapped model",
                               consequence="their gradients are not averaged across ranks, so replicas would diverge")
        return built

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Skip gradient synchronisation for the backward passes inside the block."""
        no_sync = getattr(model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def setup_stages(self, module: nn.Module, stages: list[nn.Module], context: DistributedContext) -> nn.Module:
        """Wrap `module` (on `context.device`), whose submodules `stages` the caller runs itself, one
        microbatch after another and never through the wrapper's forward (a pipeline's engine), with
        every backward under `no_sync` and one `sync_gradients` after them. Default: `setup_module`
        (a replicated model's wrapper needs nothing from its forward); FSDP makes each stage and each
        of its layers a unit, so that their own hooks gather and free the parameters."""
        return self.setup_module(module, context)

    def accumulated_gradient(self, model: nn.Module, name: str) -> torch.Tensor:
        """The gradient that backward passes accumulated under `no_sync` for the parameter `name` of the
        wrapped module (any of its names if it has several), not yet reduced: a tensor of the
        parameter's shape to change in place before `sync_gradients` (zeros, kept, if none yet). A
        pipeline sums a tied weight's copies through it. Here: the parameter's ``.grad``."""
        for key, p in self.unwrap(model).named_parameters(remove_duplicate=False):
            if key == name:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                return p.grad
        raise KeyError(f"the wrapped module has no parameter {name!r}")

    def gradient_norm_squares(self, model: nn.Module, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """The sum of squares of the model's reduced gradients (after `sync_gradients` or a synchronised
        backward) over the data-parallel group: a float32 0-dim tensor, the same on every rank of the
        group (a collective where gradients are sharded). Parameters named in `skip` (names in the
        wrapped module) are left out: a pipeline counts a tied weight's copies once. Here: replicated
        gradients, each rank holds them all."""
        named = _named_once(self.unwrap(model))
        grads = [p.grad for name, p in named if p.grad is not None and not (name & skip)]
        return sum_of_squares(grads, dtype=norm_dtype([p for _, p in named]))

    def reduced_gradients_of(self, model: nn.Module, names: frozenset[str]) -> list[torch.Tensor]:
        """Views of this rank's reduced gradients (after the step's synchronisation) holding the
        elements of the parameters named in `names` (names in the wrapped module): a replicated
        model's whole ``.grad``; a sharded one's slices of its shards. Ranks whose models have the
        same shapes get views of the same sizes in the same order (tensor parallelism sums them over
        its tensor group in place). Here: replicated gradients."""
        return [p.grad for name, p in _named_once(self.unwrap(model)) if p.grad is not None and (name & names)]

    def sync_gradients(self, model: nn.Module) -> None:
        """Reduce, now, the gradients that backward passes accumulated under `no_sync` (every rank of
        the data-parallel group calls it at the same point). Only where `deferred_gradient_sync`."""
        raise NotImplementedError(f"strategy {self.name!r} cannot reduce gradients after the backward passes "
                                  "(sync_gradients): what pipeline parallelism needs")

    def forward_backward(self, model: nn.Module, batch: Any, criterion: Callable | None,
                         precision: Precision) -> torch.Tensor | None:
        """Run forward and backward of the whole `batch` and return its mean loss (a 0-dim tensor),
        for a strategy that schedules them itself (a pipeline); None (the default): the trainer runs
        its micro-batch loop with `no_sync` and `backward`."""
        return None

    def loss_criterion(self, criterion: Callable | None) -> Callable | None:
        """The criterion the trainer applies to the model's outputs (train and evaluate): `criterion`
        itself, unless the strategy's model computes something else than the user's outputs (tensor
        parallelism: its part of the vocabulary's logits)."""
        return criterion

    def backward(self, model: nn.Module, loss: torch.Tensor, precision: Precision) -> None:
        """Backward from one micro-batch's `loss` (the precision object scales it where it must); the
        wrapper's hooks synchronise the gradients unless this runs under `no_sync`."""
        precision.backward(loss)

    def gradients(self, model: nn.Module) -> list[torch.Tensor]:
        """The gradients this rank holds after backward, that the optimizer step consumes (a
        replicated model: every parameter's; FSDP: its shards', which are its parameters)."""
        return [p.grad for p in model.parameters() if p.grad is not None]

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                       max_grad_norm: float | None = None) -> tuple[bool, torch.Tensor | None]:
        """Unscale the gradients, clip them to `max_grad_norm` (`clip_grad_norm`: global over ranks
        and shards), then step unless some rank overflowed; return (stepped, the norm before
        clipping or None). Every rank takes the same decision: the precision object agrees on it.

        Clipping runs on a skipped step too (every rank alike, as the decision is agreed): its norm is
        then inf or NaN, which the step's metrics show."""
        grads = self.gradients(model) if precision.reads_gradients else []
        scaler = getattr(precision, "scaler", None)
        before = scaler.scale if scaler is not None else None
        precision.unscale_(grads)  # before clipping, so the threshold applies to the true gradients
        norm = self.clip_grad_norm(model, max_grad_norm) if max_grad_norm is not None else None
        stepped = precision.step(optimizer, grads)
        if before is not None:
            self.loss_scale_changed(model, scaler.scale / before, skipped=not stepped)
        return stepped, norm

    def stop_requested(self, model: nn.Module) -> tuple[int, int] | None:
        """(rank, signal number) when a process this rank depends on but does not share a stop agreement
        with (a parameter server's server) got a signal to stop; checked by `fit` at step boundaries."""
        return None

    def set_batch_count(self, model: nn.Module, count: float | None) -> None:
        """What this rank's batch of the coming optimizer step counts (targets kept, or rows; None for a
        summing criterion), for a strategy that `wants_batch_count`."""

    def loss_scale_changed(self, model: nn.Module, ratio: float, skipped: bool) -> None:
        """The loss scaler (fp16) multiplied its scale by `ratio` after this step, which it skipped for an
        overflow if `skipped`: for state kept in loss-scaled units (compression's error-feedback residuals,
        `CommunicationOptimizer.loss_scale_changed`). Nothing by default."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients in place by their global 2-norm; return the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _clip_by_norm_squares(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """`clip_grad_norm` for a strategy whose `gradient_norm_squares` already spans every rank that
        holds a part of the model (a pipeline's stages, tensor parallelism's shards): the gradients this
        rank steps (`gradients`) scaled by ``min(1, max_norm / (norm + 1e-6))``; returns the norm
        before clipping, the same on every rank."""
        norm = self.gradient_norm_squares(model).sqrt()
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = self.gradients(model)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return norm

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full model state, with the same keys as the user's module's `state_dict()`."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def state_layout(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> StateLayout:
        """What this rank holds of the parameters and of the optimizer's state, as pieces of the full
        tensors (see `distributed_training.checkpoint_shards`): what checkpoints save and load, in one
        format for every strategy. Here: whole replicated tensors, which rank 0 writes."""
        module = self.unwrap(model)
        named = list(module.named_parameters())
        group = getattr(model, "process_group", None)
        first = not torch.distributed.is_initialized() or torch.distributed.get_rank(group) == 0
        name_of = {id(p): name for name, p in named}
        held = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        return StateLayout(shapes={name: tuple(p.shape) for name, p in named},
                           params=whole_tensors(named, first),
                           optimizer=whole_tensors([(name_of[id(p)], p) for p in held], first))

    def buffers(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's buffers (BatchNorm's running statistics) under the user's module's keys: what
        checkpoints save per rank and load back by key. Here: the whole module's."""
        return dict(self.unwrap(model).named_buffers())

    def buffer_keys(self, model: nn.Module) -> list[str]:
        """The keys of the whole model's buffers, held by this rank or not (a checkpoint holding any
        other does not fit the model)."""
        return list(self.buffers(model))

    def evaluation_begins(self, model: nn.Module) -> None:
        """`evaluate` starts its batches, on every rank (a pipeline listens for its peers' failures)."""

    def evaluation_failed(self, model: nn.Module, err: BaseException) -> None:
        """`evaluate` raised `err` on this rank before `evaluation_sums` (a pipeline stops its peers)."""

    def evaluate_batch(self, model: nn.Module, batch: Any, criterion: Callable | None,
                       metrics: dict[str, Callable] | None) -> list[torch.Tensor] | None:
        """The mean loss of `batch` (then each metric's mean), forward only, for a strategy that runs
        the model's forward itself (a pipeline): ranks that do not compute them return zeros, which
        `evaluation_sums` completes. None (the default): `evaluate` calls the module."""
        return None

    def evaluation_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """`evaluate`'s sums on this rank, completed with what only other ranks of the same data-parallel
        replica computed (a pipeline: its last stage), before they are summed over the replicas.
        Collective over those ranks; here: nothing to add."""
        return sums

    def rank_state(self, model: nn.Module) -> dict[str, Any]:
        """What this rank alone must checkpoint besides model and optimizer (keys of ``rank<r>.pt``)."""
        return {}

    def load_rank_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Restore `rank_state` from this rank's file (only at the same world size)."""

    def save_checkpoint_files(self, model: nn.Module, path: str, part: dict[str, Any], meta: dict[str, Any]) -> bool:
        """Write the checkpoint at `path` in place of the trainer's writer, for a strategy whose state the
        trainer does not hold (the parameter server's servers): `part` is this rank's file as the trainer
        would write it (RNG states, buffers), `meta` the trainer's entries of ``meta.pt`` (step, epoch,
        data position, config). Collective over the trainer's ranks. False (here): the trainer writes."""
        return False

    def load_checkpoint_files(self, model: nn.Module, path: str, meta: dict[str, Any]) -> dict[str, Any] | None:
        """Read back what `save_checkpoint_files` wrote: take the strategy's state and return this rank's
        part (``rng``, ``buffers``; ``{}``: none). None (here): the trainer reads the checkpoint."""
        return None

    def shared_state(self, model: nn.Module) -> dict[str, Any]:
        """What the checkpoint's ``meta.pt`` must carry, the same on every rank."""
        return {}

    def load_shared_state(self, model: nn.Module, meta: dict[str, Any]) -> None:
        """Restore `shared_state` from ``meta.pt`` (only at the same world size)."""

    def measure_communication(self, model: nn.Module, on: bool) -> None:
        """Time (or stop timing) the communication of the coming steps; costs something, so the trainer
        turns it on only for steps it logs."""

    def pop_communication_metrics(self, model: nn.Module) -> tuple[float | None, dict[str, float]]:
        """(exposed communication seconds per step or None, extra metrics) since the last call."""
        return None, {}

    def explain_failure(self, err: BaseException) -> BaseException | None:
        """`err`, raised by a training or evaluation forward, told with what only the strategy knows (a
        tensor-parallel plan that hands a layer part of its input), or None to raise it as it is."""
        return None

    def smallest_batch(self) -> int:
        """The fewest samples a training batch may have (a pipeline's interleaved schedule: one per
        pipeline rank); `fit` pads an epoch's short last step to it (`ShardedSampler`)."""
        return 1

    def batch_cuts(self) -> int:
        """How many pieces the strategy itself cuts a batch into (a pipeline's microbatches), 1 otherwise."""
        return 1

    def time_pipeline(self, model: nn.Module, on: bool) -> None:
        """Time (or stop timing) the pipeline schedule's compute in the coming steps: a pipeline's busy time
        per stage and its measured bubble (`pipeline.PipelineTiming`); nothing without a pipeline. A timed
        step waits for the device once, so the trainer turns it on for one step per log window, on every
        rank alike (the ranks of a pipeline exchange their figures by message)."""

    def pop_pipeline_timing(self, model: nn.Module) -> dict[str, float] | None:
        """The figures of the latest timed pipeline step not popped yet (``pipeline/forward_ms``,
        ``pipeline/backward_ms``, ``pipeline/bubble``, ``pipeline/bubble_formula``, ...: see
        `pipeline.PipelineTiming.metrics`), or None: no pipeline, or no timed step since the last call."""
        return None

    def planner_kind(self) -> str:
        """The planner's name for this memory layout (`distributed_training.planner`): ``"ddp"``,
        ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"zero3_offload"``."""
        return "ddp"

    def state_reserve_bytes(self, model: nn.Module, trainable_params: int) -> float:
        """Bytes of state the first step allocates besides the optimizer's (e.g. compression residuals)."""
        return 0.0

    def give_back(self, model: nn.Module) -> None:
        """At a clean `close` (every rank, before `teardown`): leave the user's module holding its full
        weights, where the strategy moved them elsewhere (FSDP's shards). Collective where it gathers."""

    def teardown(self, model: nn.Module) -> None:
        """Release what `setup_module` attached (hooks, buffers)."""


def _named_once(module: nn.Module) -> list[tuple[frozenset[str], nn.Parameter]]:
    """Each parameter of `module` once, with every name it has there (a shared one has several)."""
    names: dict[int, set[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
        params[id(p)] = p
    return [(frozenset(names[i]), params[i]) for i in params]


def norm_dtype(tensors) -> torch.dtype:
    """What a gradient norm over `tensors` is summed in: float64 where every one is float64 (a float64
    model), else float32. Every rank alike: pass the parameters or shards, which every rank holds, not
    only the gradients present; a pipeline's stages of a model of mixed dtypes all sum in float32."""
    tensors = list(tensors)
    return torch.float64 if tensors and all(t.dtype == torch.float64 for t in tensors) else torch.float32


def sum_of_squares(grads: list[torch.Tensor], device: torch.device | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The sum of squares of `grads` in `dtype` (0-dim, on `device` or the first gradient's)."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device or torch.device("cpu"))
    total = torch.stack([n.to(dtype) for n in torch._foreach_norm(grads)]).square().sum()
    return total.to(device) if device is not None else total
