"""distributed_training: data-parallel training from scratch on torch.distributed collectives."""

from .comm.optimizer import CommunicationOptimizer
from .runtime import DistributedContext, init_distributed
from .strategies import DDP, FSDP, DDPStrategy, FSDPStrategy, MixedPrecision, NaiveDDP, Strategy, Zero1Strategy
from .trainer import DistributedTrainer

__all__ = [
    "CommunicationOptimizer",
    "DDP",
    "DDPStrategy",
    "DistributedContext",
    "DistributedTrainer",
    "FSDP",
    "FSDPStrategy",
    "MixedPrecision",
    "NaiveDDP",
    "Strategy",
    "Zero1Strategy",
    "init_distributed",
]

__version__ = "0.1.0"
