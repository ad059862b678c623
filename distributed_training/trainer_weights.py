"""The user's model and its full weights, whatever the strategy (ZeRO-2/3 and FSDP keep a shard per rank,
tensor parallelism slices, a pipeline its stages): `module` (the model unwrapped), `summon_full_params`
(a block in which it holds them) and `full_state_dict` (a copy of them on rank 0, for inference or
another tool). A mixin of `DistributedTrainer`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["FullWeights"]


class FullWeights:
    """`DistributedTrainer`'s access to the model and its full weights."""

    @property
    def module(self) -> nn.Module:
        """The user's model, unwrapped."""
        return self.strategy.unwrap(self.model)

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """A block in which `module` holds its full weights, as parameters, whatever the strategy
        (ZeRO-2/3 and FSDP keep only a shard per rank outside a step: this gathers them, in the
        shards' dtype, fp32 under mixed precision, on the device, or on the CPU with ``cpu_offload``;
        the others hold them already): for a forward of your own, HF's ``generate()`` or
        ``save_pretrained()``. Collective: every rank enters it. What the block writes into the weights
        stays (`writeback`, as torch's FSDP: copied into the shards when it ends; make the same change
        on every rank); ``writeback=False`` drops it. `train_step` / `evaluate` are refused inside it. Under
        tensor parallelism each rank's module still holds its slices: its forward is tensor-parallel, with
        whole outputs (a vocabulary-split head gathers its logits), and ``state_dict()`` is refused there;
        under a pipeline each rank holds its own stages. A copy of the module made
        inside it (``copy.deepcopy``, every rank) holds its own weights, without FSDP's hooks."""
        self._check_open("summon_full_params()")
        with self.strategy.summon_full_params(self.model, writeback):
            self._summoned = True
            try:
                yield
            finally:
                self._summoned = False

    def _check_not_summoned(self, what: str) -> None:
        if self._summoned:
            raise RuntimeError(f"{what} inside summon_full_params(): the weights there are a gathered copy; "
                               "train and evaluate outside the block")

    def full_state_dict(self) -> dict[str, Any]:
        """The model's state for inference or another tool, whatever the strategy: on rank 0 the plain
        module's ``state_dict()`` (same keys, full tensors on the CPU), ``{}`` on the other ranks.
        Collective (a sharded strategy gathers the parameters unit by unit): call it on every rank."""
        self._check_open("full_state_dict()")
        with self._watched("full_state_dict()", call=True):
            state = self.strategy.model_state_dict(self.model)
        if not self.context.is_main:
            return {}
        return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
