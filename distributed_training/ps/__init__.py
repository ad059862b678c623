"""A parameter server on torch.distributed point-to-point messages (gloo): sharded servers hold the
parameters and run the optimizer; workers pull parameters and push gradients, under ``sync``, ``ssp``
(bounded staleness) or ``async`` consistency, with sparse embedding tables that move only touched rows.

See docs/parameter_server.md for the design.
"""

from .parameter_server import ParameterServer
from .protocol import ServerLostError, WorkerLostError
from .rejoin import job_store, rejoin
from .server import ServerStats
from .sharding import Piece, ShardPlan, plan_shards
from .state import ServerState

__all__ = ["ParameterServer", "ServerStats", "WorkerLostError", "ServerLostError", "Piece", "ShardPlan", "plan_shards", "ServerState",
           "rejoin", "job_store"]
