"""distributed_training: data, pipeline and tensor parallelism from scratch on torch.distributed collectives."""

from .amp import DynamicLossScaler
from .comm.optimizer import CommunicationOptimizer
from .hangs import CollectiveTimeoutError
from .mesh import Mesh
from .peer_watch import PeerFailureError
from .runtime import DistributedContext, init_distributed
from .strategies import (DDP, FSDP, DDPStrategy, FSDPStrategy, Join, MixedPrecision, NaiveDDP, Strategy, Zero1Strategy,
                         join)
from .trainer import DistributedTrainer
from .trainer_checkpoints import NonFiniteLossError

__all__ = [
    "CollectiveTimeoutError",
    "CommunicationOptimizer",
    "DDP",
    "DDPStrategy",
    "DistributedContext",
    "DistributedTrainer",
    "DynamicLossScaler",
    "FSDP",
    "FSDPStrategy",
    "Join",
    "Mesh",
    "MixedPrecision",
    "NaiveDDP",
    "NonFiniteLossError",
    "PeerFailureError",
    "Strategy",
    "Zero1Strategy",
    "init_distributed",
    "join",
]

__version__ = "0.1.0"
