"""`NullMonitor`: a `Monitor` that does nothing (same methods, no files, no collectives)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["NullMonitor"]


class NullMonitor:
    """A `Monitor` that does nothing: same methods, no files, no collectives.

    Use it on every rank to switch monitoring off without touching the training loop.
    """

    progress_lines = False
    found_earlier_records = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self, total_steps: int | None = None, *, step: int | None = None) -> None:
        pass

    def record_step(
        self,
        step: int,
        metrics: Mapping[str, float | torch.Tensor],
        *,
        samples: int,
        tokens: int | None = None,
        step_time: float,
        data_time: float = 0.0,
        comm_time: float | None = None,
        own_time: float | None = None,
        comm_step_time: float | None = None,
        comm_data_time: float | None = None,
    ) -> None:
        pass

    def record_eval(self, step: int, mine: Mapping[str, float], whole: Mapping[str, float], *,
                    seconds: float | None = None) -> None:
        pass

    def get_performance_metrics(self) -> dict[str, Any]:
        return {}

    def end_progress(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullMonitor":
        return self

    def __exit__(self, *exc) -> None:
        pass

