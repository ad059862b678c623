"""ZeRO stage 1 as a trainer strategy (`Zero1Strategy`, ``"zero1"``): every rank holds the whole
model, the optimizer state is sharded 1/W, and gradients are reduce-scattered into the shard each
rank owns.

The wrapper that does it, `Zero1DDP` (our `DDP` with buckets padded to W and cut into one slice per
rank), and the whole algorithm (layout, one step, the all-gather's overlap with the next forward,
what differs from DDP) are in `zero1_ddp.py`; `Zero1DDP` is importable from here too. This module
builds the optimizer over this rank's slices, hooks its step (wait for the parameters and attach the
slices' gradients before it, all-gather the parameters after it, zero the buckets with its
``zero_grad``), and says what a checkpoint holds of each rank's shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint_shards import Holding, StateLayout, flat_pieces, whole_tensors
from ..runtime import DistributedContext, collective_device
from .base import (ParamNames, Strategy, check_groups_over_shards, check_optimizer_params,
                   checked_optimizer, norm_dtype, require_factory,
                   sum_of_squares)
from .ddp import DDP
from .ddp_strategy import DDPBacked
from .zero1_ddp import Zero1DDP, _BucketShard

__all__ = ["Zero1Strategy", "Zero1DDP"]


class Zero1Strategy(DDPBacked, Strategy):
    """ZeRO stage 1: replicated parameters, gradients reduce-scattered, optimizer state sharded 1/W.

    Args:
        overlap_param_gather: overlap the all-gather of the updated parameters with the next forward
            (default True; see `zero1_ddp`); False waits for it inside ``optimizer.step()``.
        **ddp_kwargs: passed to `Zero1DDP`, that is to our `DDP` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``communication``, ...).
    """

    name = "zero1"
    deferred_gradient_sync = True

    def planner_kind(self) -> str:
        return "zero1"

    def __init__(self, *, overlap_param_gather: bool = True, **ddp_kwargs: Any) -> None:
        self.overlap_param_gather = bool(overlap_param_gather)
        self.ddp_kwargs = ddp_kwargs
        self.groups: list[_BucketShard] = []

    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        self.context = context
        self._names = ParamNames(module)
        return Zero1DDP(module, mesh=context.mesh, overlap_param_gather=self.overlap_param_gather, **self.ddp_kwargs)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module, its parameters whole: waits for the all-gathers the last step left in flight
        (so ``DistributedTrainer.module`` and the default state-dict methods read gathered parameters)."""
        if isinstance(model, Zero1DDP):
            model.wait_for_parameters()
        return getattr(model, "module", model)

    def backward(self, model: Zero1DDP, loss: torch.Tensor, precision) -> None:
        model._settle_before_backward()  # what the forward did not wait for, before autograd reads it
        super().backward(model, loss, precision)

    def gradients(self, model: Zero1DDP) -> list[torch.Tensor]:
        """This rank's reduced slice of each bucket: what its optimizer consumes, and all that fp16
        unscaling and the overflow check need (ranks agree on overflow), not the whole buckets."""
        return [s.grad for s in model.shards]

    def setup_optimizer(self, optimizer, model: Zero1DDP) -> torch.optim.Optimizer:
        factory = require_factory(optimizer, self.name)
        self.groups = model.shards
        self.process_group = model.process_group
        shards = [s.param for s in self.groups]
        if not shards:
            # Nothing to train here (every parameter frozen, e.g. a frozen pipeline stage): the factory's
            # optimizer over the frozen parameters, as DDP's would be, which never steps anything; with no
            # parameters at all, over an empty placeholder (so that lr schedules and logging find its groups).
            frozen = list(model.module.parameters())
            built = factory(frozen or [nn.Parameter(torch.zeros(0, device=self.context.device))])
        else:
            built = factory(shards)
        checked_optimizer(built)
        check_groups_over_shards(built, self.name, model.process_group)  # (collective: every rank)
        if shards:
            check_optimizer_params(
                built, shards, strategy=self.name, expected_what="this rank's shards",
                names=getattr(self, "_names", None),
                consequence="it would keep the full optimizer state on every rank (no sharding) while the shards it "
                            "was given go unused",
            )
        model.attach_shard_grads()
        built.register_step_pre_hook(lambda opt, args, kwargs: model.prepare_step())
        built.register_step_post_hook(lambda opt, args, kwargs: model.gather_parameters())
        _zero_grad_clears_buckets(built, model)
        return built

    def clip_grad_norm(self, model: Zero1DDP, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)

    def sync_gradients(self, model: Zero1DDP) -> None:
        """Reduce-scatter, bucket by bucket, what the backward passes accumulated under `no_sync`: this
        rank's slice of each bucket becomes the mean (DDP's `sync_gradients` with ZeRO-1's reducer)."""
        model.sync_gradients()

    def gradient_norm_squares(self, model: Zero1DDP, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """The sum of squares of every rank's reduced slices (one all-reduce over the data-parallel
        group), less the elements of the parameters named in `skip` that fall in them."""
        grads = [s.grad for s in model.shards]
        device = collective_device(model.process_group, grads[0].device if grads else None)
        dtype = norm_dtype([s.flat for s in model.shards])
        total = sum_of_squares(grads, device, dtype)
        if skip:
            total = total - sum_of_squares(self.reduced_gradients_of(model, skip), device, dtype)
        if model.world_size > 1:
            dist.all_reduce(total, group=model.process_group)
        return total

    def reduced_gradients_of(self, model: Zero1DDP, names: frozenset[str]) -> list[torch.Tensor]:
        """The slices of this rank's reduced bucket slices that hold the named parameters' elements."""
        aliases: dict[int, list[str]] = {}
        for name, p in model.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        views = []
        for s in model.shards:
            if s.grad is None:
                continue
            members = [(aliases[id(p)][0], start, p.numel()) for p, start in s.members
                       if names.intersection(aliases[id(p)])]
            views += [s.grad[piece.local:piece.local + piece.length] for piece in flat_pieces(members, s.lo, s.hi)]
        return views

    def teardown(self, model: nn.Module) -> None:
        if isinstance(model, DDP):
            model.remove_hooks()  # Zero1DDP's waits for the parameters first

    def load_shared_state(self, model: Zero1DDP, meta: dict[str, Any]) -> None:
        """Nothing to restore: the bucket layout is fixed when the model is wrapped (the optimizer's
        shards are slices of it), and checkpoints hold pieces of full tensors, whatever the layout."""

    def state_layout(self, model: Zero1DDP, optimizer: torch.optim.Optimizer | None) -> StateLayout:
        """Parameters are replicated (rank 0 writes them whole); each rank's optimizer shard is a slice
        of a bucket's parameter buffer: pieces of the parameters in it, which every rank writes."""
        model.wait_for_parameters()  # checkpoints read the parameters, and loading writes them
        named = list(model.module.named_parameters())
        name_of = {id(p): name for name, p in named}
        first = dist.get_rank(model.process_group) == 0
        shards = {}
        for s in self.groups:
            members = [(name_of[id(p)], start, p.numel()) for p, start in s.members]
            shards[id(s.param)] = Holding(s.param, flat_pieces(members, s.lo, s.hi))
        held = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
        return StateLayout(shapes={name: tuple(p.shape) for name, p in named}, params=whole_tensors(named, first),
                           optimizer=[shards[id(p)] for p in held if id(p) in shards])  # not: frozen, no state


def _zero_grad_clears_buckets(optimizer: torch.optim.Optimizer, model: Zero1DDP) -> None:
    """Make ``optimizer.zero_grad()`` also zero the model's gradient buckets.

    The optimizer's gradients are slices of the buckets, and the trainer (like any loop) calls
    ``zero_grad`` after every step, skipped ones (fp16 overflow) included: that is the moment the
    reduced gradients are spent. torch offers no zero_grad hook, hence the wrapper on the instance."""
    zero_own = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        zero_own(set_to_none)
        model.zero_grad_buckets()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

