"""`fit(batch_size="auto")`: the largest batch per rank that fits in memory, agreed by every rank.

A mixin of `DistributedTrainer` (it needs the trainer's model, strategy, optimizer and context); the
search and the estimate it runs are in `distributed_training.planner`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .batches import to_device
from .logs import get_logger
from .planner import (activation_bytes_per_sample, default_budget, find_max_batch_size, max_batch_size_for_budget,
                      state_bytes)

__all__ = ["AutoBatchSize", "AUTO_BATCH_MAX", "AUTO_BATCH_MIN_STEPS"]

log = get_logger()
Criterion = Callable[[Any, Any], torch.Tensor]

#: ``fit(batch_size="auto")`` never picks more samples per rank than this, nor more than leaves
#: `AUTO_BATCH_MIN_STEPS` optimizer steps per epoch: the largest batch that fits in memory is seldom
#: the one that trains best, and on a CPU host (or for a small model) it is the whole shard.
AUTO_BATCH_MAX = 1024
AUTO_BATCH_MIN_STEPS = 4


class AutoBatchSize:
    """`DistributedTrainer.auto_batch_size` and its two methods (probe, estimate)."""

    def auto_batch_size(self, data: Dataset, criterion: Criterion | None = None, *, method: str | None = None,
                        headroom: float = 0.9, max_batch_size: int | None = AUTO_BATCH_MAX,
                        min_steps_per_epoch: int = AUTO_BATCH_MIN_STEPS) -> int:
        """The largest batch per rank (samples per optimizer step) that fits in memory; every rank agrees.

        Two methods (`method=None` chooses):

        * ``"probe"`` (GPUs, with strategies whose forward runs no collective: DDP, ZeRO-1): forward and
          backward on real batches from `data` under ``no_sync``, doubling the micro-batch until the
          first out-of-memory error, then bisecting; each failure frees the cache. The optimizer state
          that the first step will create (Adam's two fp32 moments, unless it exists already) and
          ``1 - headroom`` of the device are held back during the search.
        * ``"estimate"`` (CPU, and sharded strategies, whose per-rank search could leave peers waiting
          in a collective): `headroom` of the memory budget (``memory_budget_bytes``, else the GPU's
          memory or this process's share of host memory), less the per-rank weights, gradients and Adam
          state of this strategy (`distributed_training.planner.state_bytes`), divided by the
          activation bytes autograd saves per sample (measured on two real batches).

        Each rank's answer is all-reduced with MIN. With gradient accumulation the search is over the
        micro-batch, and the batch is that times `gradient_accumulation_steps`. The result (also in
        `self.batch_size`, its explanation in `self.batch_size_reason`) never exceeds `max_batch_size`
        (default `AUTO_BATCH_MAX`, 1024; None: no such cap) nor what leaves `min_steps_per_epoch`
        optimizer steps per epoch of this rank's share of `data` (default `AUTO_BATCH_MIN_STEPS`, 4).
        The reason says which bound applied. Dropout's RNG and BatchNorm's statistics are restored after the
        search; if it fails on one rank, every rank raises.
        """
        if isinstance(data, DataLoader) or isinstance(data, IterableDataset) or not isinstance(data, Dataset):
            raise TypeError("batch_size='auto' needs a map-style Dataset (it builds trial batches from it), got "
                            f"{type(data).__name__}")
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        ctx, accum = self.context, self.gradient_accumulation_steps
        if len(data) == 0:
            raise ValueError("batch_size='auto' got an empty dataset")
        if not isinstance(min_steps_per_epoch, int) or min_steps_per_epoch < 1:
            raise ValueError(f"min_steps_per_epoch must be an integer >= 1, got {min_steps_per_epoch!r}")
        share = -(-len(data) // ctx.world_size)  # a rank's samples per epoch (the sampler pads the last ones)
        limit = max(1, share // (min_steps_per_epoch * accum))
        limit_why = f"{min_steps_per_epoch} steps per epoch over this rank's {share} samples"
        if max_batch_size is not None:
            if not isinstance(max_batch_size, int) or max_batch_size < accum:
                raise ValueError(f"max_batch_size must be an integer >= gradient_accumulation_steps ({accum}), "
                                 f"got {max_batch_size!r}")
            if max_batch_size // accum < limit:
                limit, limit_why = max_batch_size // accum, f"max_batch_size={max_batch_size}"
        collective_forward = self.strategy.collective_forward
        if method is None:
            method = "probe" if self.device.type == "cuda" and not collective_forward else "estimate"
        if method not in ("probe", "estimate"):
            raise ValueError(f"method must be 'probe', 'estimate' or None, got {method!r}")
        if method == "probe" and collective_forward:
            raise ValueError(f"method='probe' cannot be used with strategy {self.strategy.name!r}: its forward runs "
                             "collectives, and a rank that runs out of memory would leave its peers waiting")

        def make(b: int) -> Any:
            return to_device(torch.utils.data.default_collate([data[i % len(data)] for i in range(b)]), self.device)

        def loss_of(_model: nn.Module, batch: Any) -> torch.Tensor:
            with self.precision.autocast():
                return self._loss(batch, criterion)

        # The search must leave no trace: dropout's RNG and BatchNorm's statistics are put back.
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        modes = [(m, m.training) for m in self.model.modules()]  # (a submodule frozen in eval mode stays so)
        if not self.model.training:  # as train_step does
            self.model.train()
        failure, micro, why = None, 0, ""
        try:
            if method == "probe":
                micro, why = self._probe_batch(make, loss_of, limit, headroom)
            else:
                micro, why = self._estimate_batch(make, loss_of, limit, headroom)
        except Exception as err:  # every rank must still reach the agreement below, or its peers wait there
            failure = err
        finally:
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], self.device)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            for m, mode in modes:
                m.training = mode
        if ctx.world_size > 1:
            agreed = torch.tensor([micro], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctx.group)
            if failure is None and 0 < int(agreed) != micro:
                why += f"; another rank fits only {int(agreed)}"
            micro = int(agreed)
        if failure is not None:
            raise failure
        if micro < 1:
            raise RuntimeError(f"rank {ctx.rank}: batch_size='auto' failed on another rank (its error says why)")
        self.batch_size = micro * accum
        if micro == limit:
            why += f"; capped at {limit} by {limit_why}"
        self.batch_size_reason = why + (f"; x {accum} accumulation steps" if accum > 1 else "")
        log.info("batch_size auto -> %d per rank (%s)", self.batch_size, self.batch_size_reason)
        return self.batch_size

    def _probe_batch(self, make, loss_of, limit: int, headroom: float) -> tuple[int, str]:

        reserve = self._first_step_reserve()
        if self.device.type == "cuda":
            reserve += (1 - headroom) * torch.cuda.get_device_properties(self.device).total_memory
        held = torch.empty(int(reserve), dtype=torch.uint8, device=self.device)

        def try_batch(b: int) -> None:
            try:
                with self.strategy.no_sync(self.model):
                    loss_of(self.model, make(b)).float().backward()
            finally:
                self.optimizer.zero_grad(set_to_none=True)

        try:
            micro = find_max_batch_size(try_batch, limit=limit)
        finally:
            del held
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return micro, (f"probed: micro-batches up to {micro} fit (search limit {limit}) with {reserve / 2**30:.2f} "
                       "GiB held back for optimizer state, compression residuals and headroom")

    def _estimate_batch(self, make, loss_of, limit: int, headroom: float) -> tuple[int, str]:

        ctx = self.context
        budget = (self.memory_budget_bytes if self.memory_budget_bytes is not None
                  else default_budget(ctx.local_rank, ctx.local_world_size))
        params, unit = self._model_sizes
        kind = self.strategy.planner_kind()
        fixed = state_bytes(kind, params, ctx.world_size, largest_unit_params=unit,
                            param_dtype_bytes=2 if self.mixed_precision else 4)
        per_sample = activation_bytes_per_sample(self.model, make, loss_of)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            micro = min(limit, max_batch_size_for_budget(headroom * budget, fixed, per_sample))
        except ValueError as err:
            raise ValueError(f"rank {ctx.rank}: batch_size='auto' with memory_budget_bytes={budget:.0f}: {err}") from None
        return micro, (f"estimated: {headroom:.0%} of {budget / 2**30:.2f} GiB, less {fixed / 2**30:.2f} GiB of {kind} "
                       f"model state, at {per_sample / 2**20:.2f} MiB of activations per sample gives micro-batches "
                       f"of {micro} (limit {limit})")

    def _first_step_reserve(self) -> float:
        """Bytes the first real step will allocate that a forward/backward does not: Adam's two fp32
        moments per trainable parameter (unless the optimizer state exists, after a step or a resume),
        and the fp32 error-feedback residuals of Top-K or PowerSGD compression."""
        trainable = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad)
        reserve = 0.0 if any(len(v) for v in self.optimizer.state.values()) else 8.0 * trainable
        return reserve + self.strategy.state_reserve_bytes(self.model, trainable)
