"""`DDPStrategy`: the replicated-model strategy, backed by our `DDP` wrapper."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..runtime import DistributedContext
from .base import Strategy
from .ddp import DDP

__all__ = ["DDPStrategy"]


class DDPStrategy(Strategy):
    """Every rank holds the whole model; gradients are averaged by bucketed all-reduce.

    Keyword arguments are passed to `DDP` (``bucket_cap_mb``, ``find_unused_parameters``,
    ``broadcast_buffers``, ``bucket_reducer``, ...).
    """

    name = "ddp"

    def __init__(self, **ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs

    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        return DDP(module, process_group=context.group, **self.ddp_kwargs)

    def teardown(self, model: nn.Module) -> None:
        if isinstance(model, DDP):
            model.remove_hooks()
