"""Parallelism strategies: how a model is wrapped, how its gradients are reduced, how it is saved."""

from .base import Strategy
from .ddp import DDP
from .ddp_strategy import DDPStrategy
from .naive import NaiveDDP

__all__ = ["DDP", "DDPStrategy", "NaiveDDP", "Strategy"]
from .fsdp import FSDP, MixedPrecision  # noqa: E402

__all__ += ["FSDP", "MixedPrecision"]
