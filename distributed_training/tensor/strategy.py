"""Tensor parallelism around a data-parallel strategy: `TensorParallelStrategy`.

The user's model is changed in place by a plan (`tensor.plan.apply_plan`: its linear layers,
embeddings and heads split between the ranks of the mesh's ``tensor`` group, each rank holding a part
of each matrix), then handed to the data-parallel strategy (DDP, ZeRO-1/2/3, FSDP), which works over
the ``data`` group on the parts as if they were whole parameters: every rank of a data-parallel group
holds the same part, so averaging and sharding them is what it always does. What only tensor
parallelism knows is added here:

* gradients of replicated parameters that see only part of the sequence (sequence parallelism:
  LayerNorms, a row-parallel bias) are partial sums: after the data-parallel reduction (the two sums
  commute), the elements this rank holds of them (`Strategy.reduced_gradients_of`: whole gradients
  under DDP, slices of shards under ZeRO and FSDP, alike on every tensor rank) are summed over the
  tensor group in one all-reduce, before clipping and the optimizer step;
* the gradient's 2-norm for clipping sums the split parameters' squares over the tensor group and
  counts the replicated ones once;
* state: checkpoints describe a split parameter's pieces in the full tensor's coordinates
  (`tensor.state.tensor_state_layout`), `full_state_dict()` gathers the parts (`full_tensors`) and
  loading a full state dict slices it (`spec.shard`), so the one checkpoint format holds;
* a criterion that is cross-entropy becomes the vocabulary-parallel loss where the plan split the
  output head by vocabulary (the logits each rank computes are its part of the vocabulary).

Every tensor rank starts from the same random state (dropout outside the split regions must draw the
same masks on every tensor rank; setup broadcasts tensor rank 0's).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint_shards import StateLayout
from ..comm.collectives import broadcast_coalesced
from ..mesh import global_rank
from ..runtime import DistributedContext
from ..strategies.base import Strategy
from .functional import WAITS
from .layers import VocabParallelEmbedding, _ParallelLinear
from .loss import _LOSS
from .options import TensorOptions
from .spec import ShardSpec, is_sequence_parallel, shard
from .undo import PlanUndo

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(Strategy):
    """A data-parallel strategy (`inner`) over the parts of a model split by tensor parallelism (see
    the module docstring)."""

    whole_module = False  # (see `Strategy.whole_module`)

    def __init__(self, inner: Strategy, options: TensorOptions) -> None:
        self.inner = inner
        self.options = options
        self.name = inner.name
        self.collective_forward = inner.collective_forward  # tensor peers see the same batches anyway
        self.places_module = inner.places_module
        self.deferred_gradient_sync = inner.deferred_gradient_sync
        self.specs: dict[str, ShardSpec] = {}  # split parameters by state_dict key
        self._vocab_loss: Callable | None = None
        self._undo: PlanUndo | None = None  # what apply_plan replaced, for `give_back`

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        self._prepare(module, context)
        return self.inner.setup_module(module, context)

    def _prepare(self, module: nn.Module, context: DistributedContext) -> None:
        from .plan import SplitTrail, apply_plan, parallel_loss

        mesh = context.mesh
        if mesh.size("tensor") != self.options.size:
            raise ValueError(f"tensor_parallel_size={self.options.size} but the mesh has {mesh.size('tensor')} "
                             "tensor-parallel ranks")
        self.group = mesh.group("tensor")
        self.tensor_rank = mesh.rank("tensor")
        self.device = context.device
        plan = self.options.plan if self.options.plan is not None else _builtin_plan(module)
        if plan is None:
            raise ValueError(f"tensor_parallel_size={self.options.size} needs a tensor_parallel_plan for a "
                             f"{type(module).__name__} (module-name pattern -> 'colwise' | 'rowwise' | 'vocab' | "
                             "'sequence' | 'replicate'; see docs/tensor_parallel.md); only our GPT has a built-in one")
        src = global_rank(self.group, 0)
        _share_random_state(self.group, src, context.device)
        _share_weights(module, src, self.group, context.device)  # the parts are cut from rank src's weights
        self._undo, self._trail = PlanUndo(), SplitTrail()
        self.specs = apply_plan(module, plan, self.group, sequence_parallel=self.options.sequence_parallel,
                                undo=self._undo, trail=self._trail)
        self._vocab_loss = parallel_loss(module)
        names = dict(module.named_parameters(remove_duplicate=False))
        self._split_names = frozenset(name for name in names if name in self.specs)
        self._replicated_names = frozenset(names) - self._split_names
        self._sequence_names = frozenset(name for name, p in names.items() if is_sequence_parallel(p))

    def check_trainer_options(self, options: dict[str, Any]) -> None:
        self.inner.check_trainer_options(options)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.inner.unwrap(model)

    def explain_failure(self, err: BaseException) -> BaseException | None:
        trail = getattr(self, "_trail", None)
        return trail.explain(err) if trail is not None else self.inner.explain_failure(err)

    @contextlib.contextmanager
    def summon_full_params(self, model: nn.Module, writeback: bool = True):
        """The data-parallel strategy's block (each rank's parts whole), in which the model's forward stays
        tensor-parallel (every rank calls it) and gives whole outputs: a head split by vocabulary gathers its
        logits (a generate() or an argmax of one's own read the whole vocabulary) and a loss the model computes
        itself is then the plain one. Its ``state_dict()`` (``save_pretrained()``) would hold this rank's
        slices: refused there, naming `full_state_dict()`."""
        module = self.unwrap(model)
        heads = [m for m in module.modules() if getattr(m, _LOSS, None) is not None and hasattr(m, "gather_output")]
        saved = [(m, m.gather_output, getattr(m, _LOSS)) for m in heads]
        # (on each split layer: a state_dict() of any module holding one, as HF's save_pretrained() of the
        # model inside a wrapper of the user's, reaches its hook)
        hooks = [m.register_state_dict_pre_hook(_refuse_sliced_state_dict) for m in module.modules()
                 if isinstance(m, (_ParallelLinear, VocabParallelEmbedding))]
        try:
            for head in heads:
                head.gather_output = True
                setattr(head, _LOSS, None)
            with self.inner.summon_full_params(model, writeback):
                yield
        finally:
            for hook in hooks:
                hook.remove()
            for head, gather, loss in saved:
                head.gather_output = gather
                setattr(head, _LOSS, loss)

    def setup_optimizer(self, optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return self.inner.setup_optimizer(optimizer, model)

    def loss_criterion(self, criterion: Callable | None) -> Callable | None:
        """Cross-entropy becomes the vocabulary-parallel loss when the head is split by vocabulary;
        another criterion cannot read a part of the logits (an error naming the plan)."""
        if self._vocab_loss is None:
            return criterion
        if criterion is None:
            # Our GPT computes its own loss (vocabulary-parallel once split), except in a pipeline,
            # whose last stage applies a criterion to the logits: there, the split one.
            return self._vocab_loss if _is_pipeline(self.inner) else None
        return self._vocab_loss.with_options_of(criterion)  # its options kept; not cross-entropy: ValueError

    # ------------------------------------------------------------------ steps (the inner strategy's)
    def no_sync(self, model: nn.Module):
        return self.inner.no_sync(model)

    def accumulated_gradient(self, model: nn.Module, name: str) -> torch.Tensor:
        return self.inner.accumulated_gradient(model, name)

    def sync_gradients(self, model: nn.Module) -> None:
        self.inner.sync_gradients(model)

    def loss_scale_changed(self, model: nn.Module, ratio: float, skipped: bool) -> None:
        self.inner.loss_scale_changed(model, ratio, skipped)

    def forward_backward(self, model, batch, criterion, precision):
        return self.inner.forward_backward(model, batch, criterion, precision)

    def backward(self, model: nn.Module, loss: torch.Tensor, precision) -> None:
        self.inner.backward(model, loss, precision)

    def gradients(self, model: nn.Module) -> list[torch.Tensor]:
        return self.inner.gradients(model)

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision,
                       max_grad_norm: float | None = None):
        if self.options.sequence_parallel and not self._replicas_checked:
            self._replicas_checked = True
            self._check_replicated_gradients(model)
        self._sum_sequence_parallel(model)
        WAITS.count_pass()
        return super().optimizer_step(model, optimizer, precision, max_grad_norm)

    def _check_replicated_gradients(self, model: nn.Module) -> None:
        """(Sequence parallelism, at the first step, before any update.) A replicated parameter that the plan did
        not style ``"sequence"`` must get the same gradient on every tensor rank: computed from whole
        activations, it does. One inside the sequence-parallel region (a LayerNorm the plan left out) sees this
        rank's part of the sequence only, and its gradient, never summed over the tensor group, is partial:
        the run would train silently wrong. Its gradient's norm differs between the tensor ranks: refused,
        naming it (every rank raises: the verdict is all-reduced over the job)."""
        names = sorted(self._replicated_names - self._sequence_names)
        device = _comm_device(self.group, self.device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        norms = torch.stack([sum((v.detach().double().pow(2).sum().to(device)
                                  for v in self.inner.reduced_gradients_of(model, frozenset({name}))), zero)
                             for name in names]) if names else zero.new_zeros(0)
        spread = torch.cat([norms, -norms])  # one MAX gives both the largest and the smallest of each
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.group)
        high, low = spread[:len(names)].tolist(), (-spread[len(names):]).tolist()
        differ = [name for name, h, lo in zip(names, high, low) if h - lo > 1e-3 * max(h, 1e-30)]
        anywhere = torch.tensor([float(bool(differ))], device=device)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if anywhere.item():
            shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
            raise ValueError(
                f"sequence_parallel: the gradients of replicated parameter(s) {shown or '(found on another rank)'} "
                "differ between the tensor-parallel ranks: their modules run inside the sequence-parallel region "
                "(on this rank's part of the sequence) but tensor_parallel_plan does not style them 'sequence', so "
                "their gradients would never be summed over the tensor group and training would be silently wrong. "
                "Add their modules to the plan with 'sequence' (LayerNorms, dropouts between the split layers)")

    _replicas_checked = False

    def _sum_sequence_parallel(self, model: nn.Module) -> None:
        """Sum over the tensor group the reduced gradients of parameters that saw part of the sequence."""
        if not self._sequence_names:
            return
        views = self.inner.reduced_gradients_of(model, self._sequence_names)
        if not views:
            return
        flat = torch.cat([v.reshape(-1) for v in views])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for v in views:
            v.copy_(flat[offset:offset + v.numel()].view_as(v))
            offset += v.numel()

    def reduced_gradients_of(self, model: nn.Module, names: frozenset[str]) -> list[torch.Tensor]:
        return self.inner.reduced_gradients_of(model, names)

    def gradient_norm_squares(self, model: nn.Module, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """Split parameters' squares summed over the tensor group (each rank holds a part), replicated
        ones counted once (every tensor rank holds the same): in one pass and one all-reduce, tensor
        rank 0 counts every gradient it holds and the other tensor ranks their split ones only; the sum
        over the tensor group is then the same on every rank. (The inner strategy's own reduction runs
        over the data-parallel group, whose ranks share a tensor rank and so what they count.)"""
        if self.options.size == 1:
            return self.inner.gradient_norm_squares(model, skip)
        counted = skip if self.tensor_rank == 0 else skip | self._replicated_names
        squares = self.inner.gradient_norm_squares(model, counted).to(_comm_device(self.group, self.device))
        dist.all_reduce(squares, group=self.group)
        return squares

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every tensor shard (`gradient_norm_squares`); returns it."""
        return self._clip_by_norm_squares(model, max_norm)

    def evaluate_batch(self, model, batch, criterion, metrics):
        """With a head split by vocabulary, the loss takes this rank's logit columns as they are, but a
        metric (an argmax, a top-k) reads the whole vocabulary: the outputs are gathered for the metrics
        (evaluation only; training never gathers the logits)."""
        if not metrics or self._vocab_loss is None:
            return self.inner.evaluate_batch(model, batch, criterion, metrics)
        if _is_pipeline(self.inner):
            raise NotImplementedError("evaluate(metrics=...) with a pipeline and an output head split by "
                                      "vocabulary ('vocab' in tensor_parallel_plan) is not supported yet: "
                                      "evaluate the loss alone (metrics=None)")
        from ..batches import call_module
        from .functional import gather_last

        inputs, targets = batch
        outputs = call_module(model if self.inner.collective_forward else self.inner.unwrap(model), inputs)
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"evaluate(metrics=...): with the output head split by vocabulary ('vocab' in "
                            f"tensor_parallel_plan) the model must return its logits as a tensor (vocabulary "
                            f"last), got {type(outputs).__name__}")
        whole = gather_last(outputs, self.group)  # (..., V): every rank's columns, in vocabulary order
        return [criterion(outputs, targets), *(fn(whole, targets) for fn in metrics.values())]

    def evaluation_begins(self, model: nn.Module) -> None:
        self.inner.evaluation_begins(model)

    def evaluation_failed(self, model: nn.Module, err: BaseException) -> None:
        self.inner.evaluation_failed(model, err)

    def evaluation_sums(self, sums: torch.Tensor) -> torch.Tensor:
        return self.inner.evaluation_sums(sums)

    def smallest_batch(self) -> int:
        return self.inner.smallest_batch()

    def batch_cuts(self) -> int:
        return self.inner.batch_cuts()

    # ------------------------------------------------------------------ state
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The plain model's state: the inner strategy's (whole over the data-parallel group), each
        split parameter gathered over the tensor group."""
        from .state import full_tensors

        def whole(state: dict[str, Any]) -> dict[str, Any]:
            on = _comm_device(self.group, self.device)
            return full_tensors({k: v.to(on) for k, v in state.items()}, self.specs, self.group)

        if _is_pipeline(self.inner):  # gathered from the stages after the tensor parts are joined
            return {k: v.cpu() for k, v in self.inner.model_state_dict(model, whole).items()}
        return whole(self.inner.model_state_dict(model))

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        local = {key: (shard(value, self.specs[key]) if key in self.specs else value) for key, value in state.items()}
        self.inner.load_model_state_dict(model, local)

    def state_layout(self, model: nn.Module, optimizer) -> StateLayout:
        from .state import tensor_state_layout

        layout = self.inner.state_layout(model, optimizer)
        # A tied weight is in the layout under its first name only (lm_head.weight is wte.weight).
        specs = {key: spec for key, spec in self.specs.items() if key in layout.shapes}
        return tensor_state_layout(layout, specs, self.tensor_rank)

    def buffers(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.inner.buffers(model)

    def buffer_keys(self, model: nn.Module) -> list[str]:
        return self.inner.buffer_keys(model)

    def rank_state(self, model: nn.Module) -> dict[str, Any]:
        return self.inner.rank_state(model)

    def load_rank_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.inner.load_rank_state(model, state)

    def shared_state(self, model: nn.Module) -> dict[str, Any]:
        return self.inner.shared_state(model)

    def load_shared_state(self, model: nn.Module, meta: dict[str, Any]) -> None:
        self.inner.load_shared_state(model, meta)

    # ------------------------------------------------------------------ monitoring, planning, teardown
    def measure_communication(self, model: nn.Module, on: bool) -> None:
        self.inner.measure_communication(model, on)
        WAITS.on = on

    def pop_communication_metrics(self, model: nn.Module):
        # The data group's exposed communication (the inner strategy's) and the layers' collectives.
        seconds, extra = self.inner.pop_communication_metrics(model)
        layers = WAITS.pop()
        if layers is not None:
            seconds = (seconds or 0.0) + layers
        return seconds, extra

    def planner_kind(self) -> str:
        return self.inner.planner_kind()

    def state_reserve_bytes(self, model: nn.Module, trainable_params: int) -> float:
        return self.inner.state_reserve_bytes(model, trainable_params)

    def give_back(self, model: nn.Module) -> None:
        """The inner strategy's, then the model's own modules back in place of the parallel layers, each
        holding its full tensors (gathered over the tensor group: every rank alike), where the whole model
        fits beside what this rank holds (not under a pipeline, whose ranks keep their stages). Decided per
        tensor group; a group that keeps its parts says so on its first rank."""
        from .state import full_tensors

        self.inner.give_back(model)
        if self._undo is None or _is_pipeline(self.inner):
            return
        module = self.inner.unwrap(model)
        # (an inner FSDP that kept its shards, cpu_offload or memory, leaves the module no parameters)
        fits = next(module.parameters(), None) is not None
        local = module.state_dict() if fits else {}
        fits = fits and all(key in local for key in self.specs)
        if fits and self.device.type == "cuda":
            need = sum(math.prod(spec.full_shape) * local[key].element_size() for key, spec in self.specs.items())
            fits = need < 0.8 * (torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)
                                 - torch.cuda.memory_allocated(self.device))
        flag = torch.tensor([int(fits)], device=_comm_device(self.group, self.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)  # (the tensor ranks decide alike)
        if not flag.item():
            if self.tensor_rank == 0:
                warnings.warn("the model's tensor-parallel layers were not given back whole at close (they do not "
                              "fit in a GPU's free memory, or the data-parallel strategy kept its shards): this "
                              "rank's model holds its own part; take trainer.full_state_dict() (rank 0) or "
                              "save_checkpoint() before close()", stacklevel=3)
            return
        on = _comm_device(self.group, self.device)
        full = full_tensors({k: v.to(on) for k, v in local.items()}, self.specs, self.group)
        del local
        self._undo.restore(module, full, self.device)
        self._undo = None

    def teardown(self, model: nn.Module) -> None:
        self.inner.teardown(model)


def _builtin_plan(module: nn.Module) -> dict[str, Any] | None:
    """The plan the package knows for `module` (our GPT's), or None."""
    from ..models.gpt import GPT
    from .plan import gpt_plan

    return gpt_plan(module.cfg) if isinstance(module, GPT) else None


def _is_pipeline(strategy: Strategy) -> bool:
    from ..pipeline.training import PipelineStrategy

    return isinstance(strategy, PipelineStrategy)


def _comm_device(group, device: torch.device) -> torch.device:
    """Where `group`'s collectives take their tensors: `device` under NCCL, else the CPU (gloo)."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _share_weights(module: nn.Module, src: int, group, device: torch.device) -> None:
    """Every rank of `group` takes global rank `src`'s parameters and buffers, whatever it built: a few
    flat messages per dtype (`broadcast_coalesced`; a model's hundreds of tensors are not hundreds of
    launches), staged through `device` under NCCL where the model is still on the CPU (ZeRO-3 and FSDP
    place it after the plan)."""
    broadcast_coalesced([*module.parameters(), *module.buffers()], src, group, via=_comm_device(group, device))


def _share_random_state(group, src: int, device: torch.device) -> None:
    """Every rank of `group` takes the random state (CPU and, on a GPU, the device's) of global rank `src`."""
    states = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]
    dist.broadcast_object_list(states, src=src, group=group, device=device if device.type == "cuda" else None)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _refuse_sliced_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """(A state-dict pre-hook inside `summon_full_params` under tensor parallelism.)"""
    raise RuntimeError("state_dict() (save_pretrained()) inside summon_full_params() under tensor parallelism: the "
                       "module holds this rank's slices of the split layers. Save trainer.full_state_dict() (whole "
                       "tensors under the model's own keys, on rank 0), or close() the trainer, which gives the whole "
                       "model back")
