"""ZeRO stages 2 and 3 as a trainer strategy, through our `FSDP` wrapper.

* **Stage 2** (`FSDPStrategy(reshard_after_forward=False)`, ``"zero2"``): gradients are
  reduce-scattered, so gradients and optimizer state are 1/W; parameters are gathered for forward and
  kept until backward.
* **Stage 3** (`FSDPStrategy()`, ``"zero3"`` / ``"fsdp"``): parameters are sharded too and gathered
  per unit when needed.

Inside a pipeline's stages (`setup_stages`): each stage and each of its layers is a unit (the engine
calls the stages, never the wrapper's forward), the backward passes of the schedule accumulate full
gradients under `no_sync`, and `sync_gradients` reduce-scatters them once after the schedule. ZeRO-3
gathers each unit again for every microbatch's forward and backward; ZeRO-2 gathers it once per step.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint_shards import Holding, StateLayout, flat_pieces
from ..runtime import DistributedContext
from .base import (ParamNames, Strategy, check_groups_over_shards, check_optimizer_params,
                   checked_optimizer, norm_dtype, require_factory,
                   sum_of_squares)
from .fsdp import FSDP
from .fsdp_optimizers import mark_checked
from .fsdp_precision import cast_floats
from .fsdp_units import unit_roots

__all__ = ["FSDPStrategy"]


class FSDPStrategy(Strategy):
    """ZeRO-3 (default) or ZeRO-2 (`reshard_after_forward=False`) through our `FSDP` wrapper.

    Keyword arguments go to `FSDP` (``auto_wrap_policy``, ``mixed_precision``, ``cpu_offload``,
    ``sharding_strategy``, ``ranks_per_node``, ...). Checkpoints are sharded and re-shardable.
    """

    name = "fsdp"
    collective_forward = True
    deferred_gradient_sync = True

    def __init__(self, **fsdp_kwargs: Any) -> None:
        if "communication" in fsdp_kwargs:
            raise ValueError("FSDPStrategy takes no communication= (a CommunicationOptimizer): compression and "
                             "the ring / tree / hierarchical patterns apply to DDPStrategy and Zero1Strategy, whose "
                             "gradients are all-reduced; FSDP reduce-scatters its units' gradients as they are")
        takes = [n for n in inspect.signature(FSDP.__init__).parameters if n not in ("self", "module", "mesh")]
        unknown = sorted(set(fsdp_kwargs) - set(takes))
        if unknown:
            raise TypeError(f"FSDPStrategy got unexpected argument(s) {', '.join(unknown)}; it takes FSDP's: "
                            f"{', '.join(takes)}")
        self.fsdp_kwargs = fsdp_kwargs

    def check_trainer_options(self, options: dict[str, Any]) -> None:
        """The trainer's autocast (``mixed_precision=``) and this strategy's ``MixedPrecision(param_dtype=)`` name
        one compute dtype, or only one of them is given (two would fail at the first normalization layer)."""
        mp = self.fsdp_kwargs.get("mixed_precision")
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.get("mixed_precision") or "fp32")
        if mp is not None and mp.param_dtype is not None and autocast is not None and mp.param_dtype != autocast:
            raise ValueError(
                f"mixed_precision={options['mixed_precision']!r} (autocast in {autocast}) and FSDPStrategy("
                f"mixed_precision=MixedPrecision(param_dtype={mp.param_dtype})) ask for two compute dtypes: give one "
                "of them (the trainer's autocast keeps fp32 master weights either way; FSDP's param_dtype also "
                "gathers in it)")

    def planner_kind(self) -> str:
        if not self.fsdp_kwargs.get("reshard_after_forward", True):
            return "zero2"
        return "zero3_offload" if self.fsdp_kwargs.get("cpu_offload") else "zero3"

    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        self._names = ParamNames(module)  # FSDP takes the parameters out of the module
        return FSDP(module, mesh=context.mesh, **self.fsdp_kwargs)

    def setup_stages(self, module: nn.Module, stages: list[nn.Module], context: DistributedContext) -> nn.Module:
        """FSDP over `module` whose `stages` a pipeline's engine calls directly (never the wrapper's
        forward, where the root unit is gathered): each stage, and each of its layers (a `Stage`'s
        `names`), is a unit besides those of ``auto_wrap_policy``, so that every parameter sits in a
        unit whose own forward hooks gather it, and whose pre-backward hook gathers it again before
        each microbatch's backward. What only the root would hold (a parameter shared by two stages
        of this rank) is refused. Inputs are cast to ``mixed_precision.param_dtype`` at each stage,
        as the wrapper's forward casts them."""
        chosen = set(unit_roots(module, self.fsdp_kwargs.get("auto_wrap_policy")))
        path_of = {id(m): path for path, m in module.named_modules()}
        for stage in stages:
            chosen.add(path_of[id(stage)])
            chosen.update(path_of[id(stage.get_submodule(name))] for name in getattr(stage, "names", ()))
        self._names = ParamNames(module)
        kwargs = dict(self.fsdp_kwargs, auto_wrap_policy=lambda _module, path: path in chosen)
        model = FSDP(module, mesh=context.mesh, **kwargs)
        shared = [info.fqns[0] for unit in model._units if unit.is_root for info in unit.infos]
        if shared:
            raise NotImplementedError(
                f"strategy {self.name!r} with a pipeline: parameter(s) {shared[:4]} are shared by two stages of "
                "this rank, which FSDP can only gather for the whole model's forward; cut the model so that they "
                "share one stage (pipeline_split_points) or use strategy='ddp' or 'zero1'")
        # ZeRO-2 keeps each unit gathered from its first forward to the step's reduction (its forward
        # already keeps it until backward): one gather per unit and step, not one per microbatch.
        model._hold_until_sync = not model.reshard_after_forward
        if model._param_dtype is not None:
            dtype = model._param_dtype
            self._stage_hooks = [stage.register_forward_pre_hook(lambda _m, args: cast_floats(args, dtype))
                                 for stage in stages]
        return model

    def give_back(self, model: nn.Module) -> None:
        if isinstance(model, FSDP) and not model.release():  # (a pipeline's stages keep theirs)
            if dist.get_rank() == 0:
                warnings.warn("the model's full weights were not given back to it at close (cpu_offload, or they do "
                              "not fit in a GPU's free memory): the model object holds no weights; take "
                              "trainer.full_state_dict() (rank 0) or save_checkpoint() before close()", stacklevel=3)

    def measure_communication(self, model: nn.Module, on: bool) -> None:
        if isinstance(model, FSDP):  # (not a pipeline's stages: the pipeline times its own)
            model.waits.on = on

    def pop_communication_metrics(self, model: nn.Module) -> tuple[float | None, dict[str, float]]:
        # The waits in the units' all-gathers and reduce-scatters, per synchronised backward.
        return (model.waits.pop() if isinstance(model, FSDP) else None), {}

    def summon_full_params(self, model: FSDP, writeback: bool = True) -> contextlib.AbstractContextManager:
        return model.summon_full_params(writeback)

    def sync_gradients(self, model: FSDP) -> None:
        model.sync_gradients()

    def accumulated_gradient(self, model: FSDP, name: str) -> torch.Tensor:
        """The piece of its unit's full gradient (accumulated under `no_sync`) that is parameter `name`."""
        for unit in model._units:
            for info in unit.infos:
                if name in info.fqns:
                    # (in the reduce dtype where that is wider: the unit's whole sum, `FSDP._accumulated`)
                    grad = model._accumulated(unit)
                    if grad is None:
                        grad = torch.zeros_like(unit.full, dtype=model._reduce_dtype or unit.full.dtype)
                    if grad.dtype == unit.full.dtype:
                        unit.full.grad = grad
                    else:
                        unit.held_grad = grad
                    return grad[info.offset:info.offset + info.numel].view(info.shape)
        raise KeyError(f"the wrapped module has no parameter {name!r}")

    def gradient_norm_squares(self, model: FSDP, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """The sum of squares of every rank's shard gradients (one all-reduce over the shard group;
        hybrid replicas hold the same shards), less the elements of the parameters named in `skip`."""
        device = model.device if dist.get_backend(model.shard_group) == "nccl" else torch.device("cpu")
        units = [u for u in model._units if u.shard.grad is not None]
        dtype = norm_dtype([u.shard for u in model._units])
        total = sum_of_squares([u.shard.grad for u in units], device, dtype)
        if skip:
            total = total - sum_of_squares(self.reduced_gradients_of(model, skip), device, dtype)
        if model.shard_world > 1:
            dist.all_reduce(total, group=model.shard_group)
        return total

    def reduced_gradients_of(self, model: FSDP, names: frozenset[str]) -> list[torch.Tensor]:
        """The slices of this rank's shard gradients that hold the named parameters' elements."""
        views = []
        for unit in model._units:
            if unit.shard.grad is None:
                continue
            size = unit.padded // model.shard_world
            lo = model.shard_rank * size
            members = [(info.fqns[0], info.offset, info.numel) for info in unit.infos if names.intersection(info.fqns)]
            views += [unit.shard.grad[piece.local:piece.local + piece.length]
                      for piece in flat_pieces(members, lo, lo + size)]
        return views

    def setup_optimizer(self, optimizer, model: FSDP) -> torch.optim.Optimizer:
        try:
            built = require_factory(optimizer, self.name)(model.parameters())
        except ValueError as err:
            if "empty parameter list" not in str(err):
                raise
            # The usual cause: a factory over model.parameters(), which FSDP has emptied.
            raise ValueError(
                f"strategy '{self.name}': the optimizer factory built an optimizer over an empty parameter list. "
                "FSDP moves the model's parameters into this rank's shards, which are what the factory is "
                "given: use its argument, e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
            ) from err
        checked_optimizer(built)
        mark_checked(built)  # (here, collectively; not again at its first step)
        check_groups_over_shards(built, self.name, model.process_group)  # (collective: every rank of the data group)
        check_optimizer_params(
            built, model.parameters(), strategy=self.name, expected_what="this rank's shards",
            names=getattr(self, "_names", None),
            consequence="the model's parameters now live in the shards, so its steps would update tensors that "
                        "never receive a gradient and training would silently do nothing",
        )
        # Its zero_grad also drops the full gradients accumulated under no_sync (the micro-batches of a step
        # that failed, which would otherwise join the next step's: 2.9e-2 off one process in a trial).
        zero_own = built.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            zero_own(set_to_none)
            model.drop_accumulated_gradients()

        built.zero_grad = zero_grad  # type: ignore[method-assign]
        return built

    def clip_grad_norm(self, model: FSDP, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)

    def model_state_dict(self, model: FSDP) -> dict[str, Any]:
        return model.full_state_dict()

    def load_model_state_dict(self, model: FSDP, state: dict[str, Any]) -> None:
        model.load_full_state_dict(state)

    def state_layout(self, model: FSDP, optimizer: torch.optim.Optimizer | None) -> StateLayout:
        """Each unit's shard holds a slice of the unit's flat vector: pieces of the parameters it
        concatenates. Every rank writes its shards (under hybrid sharding, replicas write alike, so
        that each node's directory holds what its ranks need)."""
        holdings, shapes = {}, {}
        for unit in model._units:
            for info in unit.infos:
                shapes[info.fqns[0]] = tuple(info.shape)
            if unit.padded == 0:
                continue
            size = unit.padded // model.shard_world
            lo = model.shard_rank * size
            members = [(info.fqns[0], info.offset, info.numel) for info in unit.infos]
            holdings[id(unit.shard)] = Holding(unit.shard, flat_pieces(members, lo, lo + size))
        held = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        return StateLayout(shapes=shapes, params=list(holdings.values()), optimizer=[holdings[id(p)] for p in held])
