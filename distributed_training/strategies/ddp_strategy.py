"""`DDPStrategy`: the replicated-model strategy, backed by our `DDP` wrapper; and what every strategy
built on `DDP` (this one and ZeRO-1) reports and checkpoints through it."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..runtime import DistributedContext
from .base import Strategy
from .ddp import DDP

__all__ = ["DDPStrategy", "DDPBacked"]


class DDPBacked:
    """The `Strategy` methods of a strategy whose wrapper is our `DDP`: the bucket reducer's state
    (compression residuals, per rank), the bucket layout (the same everywhere: it fixes the reduction
    order, so a resumed run reduces as the interrupted one did) and the overlap timeline."""

    def rank_state(self, model: DDP) -> dict[str, Any]:
        reducer = model.bucket_reducer
        if not hasattr(reducer, "state_dict"):
            return {}
        return {"communication": reducer.state_dict(), "communication_places": _places(model)}

    def load_rank_state(self, model: DDP, state: dict[str, Any]) -> None:
        reducer = model.bucket_reducer
        if hasattr(reducer, "load_state_dict") and "communication" in state:
            reducer.load_state_dict(state["communication"])
            saved, now = state.get("communication_places"), _places(model)
            if saved is not None and saved != now and hasattr(reducer, "rebucket"):
                # The buckets differ from the saved run's (a parameter frozen or unfrozen since): the
                # reducer's per-bucket state (error-feedback residuals) follows each parameter by name.
                moves = [(*saved[name][:2], *now[name][:2], now[name][2]) for name in now
                         if name in saved and saved[name][2] == now[name][2]]
                reducer.rebucket(moves, {b.index: b.buffer.numel() for b in model._buckets})

    def shared_state(self, model: DDP) -> dict[str, Any]:
        return {"ddp_bucket_groups": model.bucket_groups(), "ddp_rebuild_pending": model._rebuild_pending,
                "ddp_arrival_order": list(model._arrival_order or []) if model._rebuild_pending else None}

    def load_shared_state(self, model: DDP, meta: dict[str, Any]) -> None:
        # A layout over other parameters (the checkpoint was saved with others frozen) starts afresh.
        if "ddp_bucket_groups" in meta and model.bucket_layout_fits(meta["ddp_bucket_groups"]):
            model.set_bucket_groups(meta["ddp_bucket_groups"], meta.get("ddp_rebuild_pending", False),
                                    meta.get("ddp_arrival_order"))

    def loss_scale_changed(self, model: DDP, ratio: float, skipped: bool) -> None:
        follow = getattr(getattr(model, "bucket_reducer", None), "loss_scale_changed", None)
        if follow is not None:  # error feedback's residuals hold loss-scaled gradients
            follow(ratio, skipped)

    def measure_communication(self, model: DDP, on: bool) -> None:
        if model.measure_overlap != on:
            model.measure_overlap = on

    def pop_communication_metrics(self, model: DDP) -> tuple[float | None, dict[str, float]]:
        seconds, count = model.pop_exposed_comm_seconds()
        overlap = model.pop_overlap_stats()
        metrics = {}
        if overlap["passes"]:
            metrics = {"perf/comm_hidden_pct": 100.0 * overlap["hidden_fraction"],
                       "perf/comm_wire_ms": 1e3 * overlap["comm_s"] / overlap["passes"]}
        return (seconds / count if count else None), metrics

    def state_reserve_bytes(self, model: DDP, trainable_params: int) -> float:
        reducer = model.bucket_reducer
        keeps_residuals = getattr(reducer, "compression", None) in ("topk", "powersgd") and getattr(
            reducer, "error_feedback", False)
        return 4.0 * trainable_params if keeps_residuals else 0.0  # one fp32 residual per gradient


class DDPStrategy(DDPBacked, Strategy):
    """Every rank holds the whole model; gradients are averaged by bucketed all-reduce.

    Keyword arguments are passed to `DDP` (``bucket_cap_mb``, ``find_unused_parameters``,
    ``broadcast_buffers``, ``bucket_reducer``, ``communication``, ...).
    """

    name = "ddp"
    deferred_gradient_sync = True

    def __init__(self, **ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs

    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        return DDP(module, mesh=context.mesh, **self.ddp_kwargs)

    def sync_gradients(self, model: DDP) -> None:
        model.sync_gradients()

    def teardown(self, model: nn.Module) -> None:
        if isinstance(model, DDP):
            model.remove_hooks()


def _places(model: DDP) -> dict[str, tuple[int, int, int]]:
    """(bucket index, offset in its buffer, numel) of each parameter in `model`'s gradient buckets, by name."""
    places = {}
    for bucket in model._buckets:
        start = bucket.buffer.storage_offset()
        for i in bucket.param_indices:
            view = model._view_of[i]
            places[model._param_names[i]] = (bucket.index, view.storage_offset() - start, view.numel())
    return places
