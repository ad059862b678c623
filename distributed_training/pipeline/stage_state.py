"""What a pipeline rank holds of the model's state, in the model's own names: `PipelineState`, the
state half of `PipelineStrategy` (`pipeline.training`) — the whole model's state dict gathered from the
stages, loading one, the checkpoint layout of this rank's stages, buffers and per-rank state.

It reads what `PipelineStrategy.setup_module` recorded: `_own_keys` (the container's keys -> the
model's), `_model_name`, `_shapes`, `_key_order`, `_not_counted` (tied copies another rank saves),
`_buffer_names`, `_all_buffers`, `_dp_rank`, `_tensor_rank`, `inner` (the data-parallel strategy).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint_shards import Holding, StateLayout

__all__ = ["PipelineState"]


class PipelineState:
    """The state methods of `PipelineStrategy` (a mixin: see the module docstring)."""

    def model_state_dict(self, model: nn.Module, whole: Callable | None = None) -> dict[str, Any]:
        """The whole model's state with its own keys, gathered from the stages on global rank 0
        (``{}`` elsewhere). Collective over the job; the first data-parallel replica sends its stages.
        `whole` (tensor parallelism) turns a stage's state into full tensors first (collective over
        the ranks that split it, which all belong to the first replica too); then only the first of
        them sends it."""
        mine: dict[str, torch.Tensor] = {}
        ctx_rank = dist.get_rank()
        state = self.inner.model_state_dict(model)  # FSDP: gathered over the data-parallel group
        if self._dp_rank == 0:
            for key, value in state.items():
                for own in self._own_keys[key]:
                    # (a module's extra state, `get_extra_state()`, is no tensor: as it is)
                    mine[own] = value.detach().cpu().clone() if torch.is_tensor(value) else value
            if whole is not None:
                full = whole(mine)  # collective over the tensor group; on its device (NCCL: the GPU)
                # Pickled to rank 0 below: CPU tensors (a CUDA one is rebuilt there on its sender's GPU).
                mine = {k: v.cpu() for k, v in full.items()} if self._tensor_rank == 0 else {}
        gathered = [None] * dist.get_world_size() if ctx_rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if ctx_rank != 0:
            return {}
        merged = {k: v for part in gathered for k, v in part.items()}
        return {k: merged[k] for k in self._key_order if k in merged}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load the user's module's `state_dict` (either key of a tied weight will do) into this rank's
        stages; every rank passes the whole state."""
        mine = {}
        for key, own in self._own_keys.items():
            found = next((k for k in own if k in state), None)
            if found is None:
                raise KeyError(f"'{own[0]}' is missing from the state dict")
            mine[key] = state[found]
        self.inner.load_model_state_dict(model, mine)

    def state_layout(self, model: nn.Module, optimizer) -> StateLayout:
        """The inner strategy's layout of this rank's stages (DDP: whole parameters, written by the
        first data-parallel replica; ZeRO-1: whole parameters and bucket slices of the optimizer's
        state; FSDP: the shards, every rank writing its own), its pieces renamed to the model's own
        names (`named_parameters`, so a tied weight under its first name) and the whole model's
        shapes: the layout a run of the whole model has, cut by stage. Of a tied weight's copies on
        several pipeline ranks only the lowest rank's pieces are written (the copies and their
        optimizer states are equal: their gradients are summed before every step); on loading, every
        copy reads them."""
        # (a rank without parameters: its optimizer's only tensor is a placeholder, nothing to save)
        inner = self.inner.state_layout(model, optimizer if self._placeholder is None else None)
        skip = frozenset(self._model_name[name] for name in self._not_counted)

        def renamed(holding: Holding) -> Holding:
            try:
                pieces = [replace(p, key=self._model_name[p.key]) for p in holding.pieces]  # strided ones too
            except KeyError as err:
                raise ValueError(f"strategy {self.name!r} describes {err} that is none of this rank's stage "
                                 "parameters: its state cannot be checkpointed") from None
            return Holding(holding.tensor, pieces, holding.save, frozenset(p.key for p in pieces if p.key in skip))

        return StateLayout(shapes=dict(self._shapes), params=[renamed(h) for h in inner.params],
                           optimizer=[renamed(h) for h in inner.optimizer])

    def buffers(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {names[key]: b for stage, names in zip(self.unwrap(model).stages, self._buffer_names)
                for key, b in stage.named_buffers()}

    def buffer_keys(self, model: nn.Module) -> list[str]:
        return list(self._all_buffers)

    def rank_state(self, model: nn.Module) -> dict[str, Any]:
        """The inner strategy's state of this rank's stages (its bucket layout, compression residuals),
        which differs by pipeline rank, so it lives in the rank's file with the pipeline's layout: it
        comes back only into the same stages (same pipeline size, chunks and cut)."""
        return {"pipeline": {"layout": self._layout_id, "shared": self.inner.shared_state(model),
                             "rank": self.inner.rank_state(model)}}

    def load_rank_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        saved = state.get("pipeline")
        if saved is None or saved.get("layout") != self._layout_id:
            return  # another cut of the model: the inner strategy starts afresh
        self.inner.load_shared_state(model, saved["shared"])
        self.inner.load_rank_state(model, saved["rank"])
