"""distributed_training: data-parallel training from scratch on torch.distributed collectives."""

from .runtime import DistributedContext, init_distributed
from .strategies import DDP, FSDP, DDPStrategy, MixedPrecision, NaiveDDP, Strategy
from .trainer import DistributedTrainer

__all__ = [
    "DDP",
    "DDPStrategy",
    "DistributedContext",
    "DistributedTrainer",
    "FSDP",
    "MixedPrecision",
    "NaiveDDP",
    "Strategy",
    "init_distributed",
]

__version__ = "0.1.0"
