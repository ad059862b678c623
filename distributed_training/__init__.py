"""distributed_training: data-parallel training from scratch on torch.distributed collectives."""

from .comm.optimizer import CommunicationOptimizer
from .mesh import Mesh
from .runtime import DistributedContext, init_distributed
from .strategies import (DDP, FSDP, DDPStrategy, FSDPStrategy, Join, MixedPrecision, NaiveDDP, Strategy, Zero1Strategy,
                         join)
from .trainer import DistributedTrainer

__all__ = [
    "CommunicationOptimizer",
    "DDP",
    "DDPStrategy",
    "DistributedContext",
    "DistributedTrainer",
    "FSDP",
    "FSDPStrategy",
    "Join",
    "Mesh",
    "MixedPrecision",
    "NaiveDDP",
    "Strategy",
    "Zero1Strategy",
    "init_distributed",
    "join",
]

__version__ = "0.1.0"
