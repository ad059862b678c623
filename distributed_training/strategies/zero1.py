"""ZeRO stage 1 as a trainer strategy (`Zero1Strategy`, ``"zero1"``).

Every rank holds the whole model and, after our bucketed DDP all-reduce, the averaged gradients.
The trainable parameters are re-homed into one flat buffer per (device, dtype), padded to a multiple
of the world size W; rank r's optimizer holds only slice r of each buffer (a view, no copy), so
optimizer state is 1/W per rank. Around `optimizer.step()` two hooks do the rest: before, slice r of
the gradients becomes the shards' `.grad`; after, one `all_gather_into_tensor` per buffer writes every
rank's updated slice back into the parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.sharded import all_gather_flat, shard_size
from ..runtime import DistributedContext
from .base import ParamNames, Strategy, check_optimizer_params, require_factory
from .ddp import DDP
from .ddp_strategy import DDPBacked
from .sharded_optim import load_sharded_optimizer_state, sharded_optimizer_state

__all__ = ["Zero1Strategy"]


class _FlatGroup:
    """One (device, dtype) group of parameters re-homed into a flat padded buffer."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.size = shard_size(self.numel, world)
        self.flat = torch.zeros(self.size * world, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        self.offsets = []
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)  # the parameter now lives in the buffer
                self.offsets.append(offset)
                offset += n
        self.lo, self.hi = rank * self.size, (rank + 1) * self.size
        self.shard = nn.Parameter(self.flat[self.lo : self.hi])  # a view: the optimizer updates in place

    def gather_grad(self) -> torch.Tensor:
        """Slice [lo, hi) of the concatenated (already averaged) gradients."""
        grad = torch.zeros(self.size, dtype=self.flat.dtype, device=self.flat.device)
        for p, start in zip(self.params, self.offsets):
            end = start + p.numel()
            lo, hi = max(start, self.lo), min(end, self.hi)
            if lo < hi and p.grad is not None:
                grad[lo - self.lo : hi - self.lo].copy_(p.grad.reshape(-1)[lo - start : hi - start])
        return grad


class Zero1Strategy(DDPBacked, Strategy):
    """ZeRO stage 1: replicated parameters and gradients, optimizer state sharded 1/W.

    Keyword arguments go to our `DDP` (``bucket_cap_mb``, ...).
    """

    name = "zero1"
    sharded_checkpoint = True
    checkpoint_format = "zero1"

    def planner_kind(self) -> str:
        return "zero1"

    def __init__(self, **ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs
        self.groups: list[_FlatGroup] = []

    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        self.context = context
        self._names = ParamNames(module)
        return DDP(module, process_group=context.group, **self.ddp_kwargs)

    def setup_optimizer(self, optimizer, model: DDP) -> torch.optim.Optimizer:
        factory = require_factory(optimizer, self.name)
        world, rank = dist.get_world_size(model.process_group), dist.get_rank(model.process_group)
        by_key: dict[tuple, list[nn.Parameter]] = {}
        for p in model.module.parameters():
            if p.requires_grad:
                by_key.setdefault((p.device, p.dtype), []).append(p)
        self.groups = [_FlatGroup(ps, world, rank) for ps in by_key.values()]
        self.process_group = model.process_group
        built = factory([g.shard for g in self.groups])
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer")
        check_optimizer_params(
            built, [g.shard for g in self.groups], strategy=self.name, expected_what="this rank's shards",
            names=getattr(self, "_names", None),
            consequence="it would keep the full optimizer state on every rank (no sharding) while the shards it "
                        "was given go unused",
        )
        built.register_step_pre_hook(lambda opt, args, kwargs: self._before_step())
        built.register_step_post_hook(lambda opt, args, kwargs: self._after_step())
        return built

    def _before_step(self) -> None:
        for g in self.groups:
            g.shard.grad = g.gather_grad()

    @torch.no_grad()
    def _after_step(self) -> None:
        works = []
        for g in self.groups:
            # Gather from a copy of our slice: the output buffer contains the input otherwise.
            works.append(all_gather_flat(g.flat, g.shard.detach().clone(), self.process_group, async_op=True))
            for p in g.params:
                p.grad = None  # consumed; the next backward starts from zero as with any optimizer
        for w in works:
            w.wait()

    def sharded_state(self, model: DDP, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        keys = [str(i) for i in range(len(self.groups))]
        state = {"optimizer": sharded_optimizer_state(optimizer, keys), "world_size": dist.get_world_size(self.process_group)}
        if dist.get_rank(self.process_group) == 0:
            state["model"] = self.model_state_dict(model)
        return state

    def load_sharded_state(self, model: DDP, optimizer, read: Callable[[int], dict], old_world: int) -> None:
        self.load_model_state_dict(model, read(0)["model"])
        keys = [str(i) for i in range(len(self.groups))]
        load_sharded_optimizer_state(optimizer, keys, [g.numel for g in self.groups], lambda k: read(k)["optimizer"],
                                     read(0)["world_size"], dist.get_world_size(self.process_group),
                                     dist.get_rank(self.process_group))
