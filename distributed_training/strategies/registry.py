"""Strategy names (``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"fsdp"``, ``"parameter_server"``,
``"auto"``) and the
objects they stand for: the one place the trainer's `strategy=` argument is turned into a `Strategy`.

A new strategy is one file under `strategies/` plus one entry in `STRATEGIES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from ..planner import NoStrategyFits, Plan, choose_strategy, default_budget, model_sizes
from .base import Strategy
from .ddp_strategy import DDPStrategy
from .fsdp_strategy import FSDPStrategy
from .parameter_server import ParameterServerStrategy
from .zero1 import Zero1Strategy

if TYPE_CHECKING:
    from ..pipeline.training import PipelineOptions
    from ..tensor.options import TensorOptions

__all__ = ["STRATEGIES", "check_strategy_argument", "make_strategy"]

#: name -> factory (the DDP-backed ones, ddp and zero1, take ``communication=``; the others no argument).
STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "ddp": DDPStrategy,
    "zero1": Zero1Strategy,
    "zero2": lambda: FSDPStrategy(reshard_after_forward=False),
    "zero3": FSDPStrategy,
    "fsdp": FSDPStrategy,
    "parameter_server": ParameterServerStrategy,
}
_TAKE_COMMUNICATION = ("ddp", "zero1")  # gradient all-reduce: where a CommunicationOptimizer plugs in


def check_strategy_argument(strategy: Any, communication: Any = None,
                            parameter_server: dict[str, Any] | None = None) -> None:
    """Raise for a `strategy` / `communication` / `parameter_server` options combination the trainer
    cannot use (before any rendezvous). `parameter_server`: the trainer's ``num_servers``,
    ``consistency``, ``staleness`` and ``sparse_embeddings`` that were given (not None)."""
    if communication is not None and not callable(communication):
        hint = f": CommunicationOptimizer({communication!r})?" if isinstance(communication, str) else ""
        raise TypeError(f"communication must be a CommunicationOptimizer, got {communication!r}{hint}")
    given = sorted(parameter_server or {})
    if given and strategy != "parameter_server":
        where = ("to the Strategy object you pass (ParameterServerStrategy(...))" if isinstance(strategy, Strategy)
                 else f"with strategy 'parameter_server', not {strategy!r}")
        raise ValueError(f"{', '.join(given)}= appl{'ies' if len(given) == 1 else 'y'} {where}")
    if strategy == "parameter_server":
        ParameterServerStrategy(**(parameter_server or {}))  # the options' errors, before any rendezvous
    if isinstance(strategy, Strategy):
        if communication is not None:
            raise ValueError("communication= goes to the Strategy object you pass (e.g. DDPStrategy(communication=...)), "
                             "not to the trainer")
        return
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name or a Strategy object, got {type(strategy).__name__}")
    if strategy not in STRATEGIES and strategy != "auto":
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES) + ['auto']} or a Strategy object, got {strategy!r}")
    if communication is not None and strategy not in _TAKE_COMMUNICATION:
        raise ValueError(f"communication= applies to strategy 'ddp' or 'zero1' (gradient all-reduce), got {strategy!r}; "
                         "for a Strategy object, pass communication= to it")


def make_strategy(strategy: str | Strategy, model: nn.Module, *, world_size: int, local_rank: int = 0,
                  local_world_size: int | None = None, communication: Any = None,
                  memory_budget_bytes: float | None = None,
                  parameter_server: dict[str, Any] | None = None,
                  pipeline: "PipelineOptions | None" = None,
                  tensor: "TensorOptions | None" = None) -> tuple[Strategy, Plan | None]:
    """The `Strategy` for the trainer's `strategy` argument, and the planner's `Plan` when it was
    ``"auto"`` (chosen from `model`'s size, `world_size` and the memory budget). A name keeps its
    spelling (``"zero3"`` stays ``"zero3"`` in messages and checkpoints). With a `pipeline` of more
    than one stage, the data-parallel strategy runs inside each stage (`PipelineStrategy`); with
    tensor parallelism, over the parts of the split model (`TensorParallelStrategy`)."""
    check_strategy_argument(strategy, communication, parameter_server)
    served = strategy == "parameter_server" or isinstance(strategy, ParameterServerStrategy)
    for options, size in ((tensor, "tensor_parallel_size"), (pipeline, "pipeline_parallel_size")):
        if served and options is not None and options.enabled:
            raise NotImplementedError(f"strategy 'parameter_server' with {size}={options.size} is not supported")
    if tensor is not None and tensor.enabled:
        from ..tensor.strategy import TensorParallelStrategy  # the tensor package builds on this one

        if strategy == "auto":
            raise NotImplementedError(f"strategy='auto' with tensor_parallel_size={tensor.size} is not supported "
                                      "yet: pass strategy='ddp', 'zero1', 'zero2', 'zero3' or 'fsdp'")
        inner, _ = make_strategy(strategy, model, world_size=world_size, local_rank=local_rank,
                                 local_world_size=local_world_size, communication=communication, pipeline=pipeline)
        return TensorParallelStrategy(inner, tensor), None
    if pipeline is not None and pipeline.enabled:
        from ..pipeline.training import PipelineStrategy  # the pipeline package builds on this one

        if strategy == "auto":
            raise NotImplementedError(f"strategy='auto' with pipeline_parallel_size={pipeline.size} is not supported "
                                      "yet: pass strategy='ddp', 'zero1', 'zero2' or 'zero3'")
        inner, _ = make_strategy(strategy, model, world_size=world_size, local_rank=local_rank,
                                 local_world_size=local_world_size, communication=communication)
        return PipelineStrategy(inner, pipeline), None
    if isinstance(strategy, Strategy):
        return strategy, None
    plan = None
    name = strategy
    if strategy == "auto":
        params, unit = model_sizes(model)
        budget = (memory_budget_bytes if memory_budget_bytes is not None
                  else default_budget(local_rank, local_world_size or world_size))
        try:
            plan = choose_strategy(params, world_size, budget, largest_unit_params=unit)
        except NoStrategyFits as err:
            given = (f"memory_budget_bytes={memory_budget_bytes:.4g}" if memory_budget_bytes is not None
                     else "this device's free memory")
            raise NoStrategyFits(f"strategy='auto' with {given}: {err}") from None
        name = plan.strategy
        built: Strategy = (DDPStrategy() if name == "ddp" else
                           FSDPStrategy(reshard_after_forward=name == "zero3", cpu_offload=plan.cpu_offload))
    elif name == "parameter_server":
        built = ParameterServerStrategy(**(parameter_server or {}))
    else:
        built = STRATEGIES[name](communication=communication) if communication is not None else STRATEGIES[name]()
    built.name = name
    return built, plan
