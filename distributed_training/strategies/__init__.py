"""Parallelism strategies: how a model is wrapped, how its gradients are reduced, how it is saved."""

from .base import Strategy
from .ddp import DDP
from .ddp_strategy import DDPStrategy
from .fsdp import FSDP, MixedPrecision
from .join import Join, join
from .naive import NaiveDDP
from .fsdp_strategy import FSDPStrategy
from .parameter_server import ParameterServerStrategy
from .zero1 import Zero1Strategy

__all__ = [
    "DDP", "DDPStrategy", "FSDP", "FSDPStrategy", "Join", "MixedPrecision", "NaiveDDP", "ParameterServerStrategy", "Strategy", "Zero1Strategy", "join",
]
