"""The trainer's tensor-parallel arguments (`TensorOptions`), checked where they are given: by
`DistributedTrainer` before any rendezvous, and by a `dtrain` config when it loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .plan import parse_plan

__all__ = ["TensorOptions"]


@dataclass(frozen=True)
class TensorOptions:
    """Attributes:
        size: ranks that split each layer's matrices between them (``tensor_parallel_size``); 1: none.
        plan: module-name pattern -> style (``tensor_parallel_plan``); None: the model's built-in plan
            (our GPT's), an error for other models. At `size` 1 a plan is checked and not applied (the
            same config runs the model whole: TP = 1 and TP = N start identical).
        sequence_parallel: LayerNorm and dropout regions split along the sequence too
            (``sequence_parallel``); needs `size` > 1.
    """

    size: int = 1
    plan: Any = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.size!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.size == 1:
            raise ValueError("sequence_parallel=True splits the sequence between tensor-parallel ranks: it needs "
                             "tensor_parallel_size > 1")
        if self.plan is not None:
            if not isinstance(self.plan, dict) or not self.plan:
                raise TypeError("tensor_parallel_plan must be a non-empty dict of module-name pattern -> style, got "
                                f"{type(self.plan).__name__}")
            parse_plan(self.plan)  # apply_plan's own rules: an error naming the entry

    @property
    def enabled(self) -> bool:
        return self.size > 1
