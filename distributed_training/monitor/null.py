"""`NullMonitor`: a `Monitor` that does nothing (same methods, no files, no collectives); `ProgressOnly`:
one that only draws the progress bar."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["NullMonitor", "ProgressOnly"]


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



class ProgressOnly(NullMonitor):
    """No files and no collectives, only the progress bar (`ProgressBar` on stderr): what a trainer
    without a ``log_dir`` uses on its main rank, so that a run in a terminal still shows where it is.

    The bar moves on log steps (`log_every`) with the loss and the steps per second of the window's
    training steps (evaluations left out). A loss on a GPU is copied to the host without waiting and
    shown once the copy is done (the next log step's drawing, at the latest): nothing waits for the
    device."""

    def __init__(self, log_every: int = 50, stream=None) -> None:
        import sys

        from .progress import ProgressBar

        self.log_every = log_every
        self._bar = ProgressBar(sys.stderr if stream is None else stream)
        self._total: int | None = None
        self._last_step: int | None = None
        self._window = [0, 0.0]  # steps and their seconds since the last drawing
        self._copy = None  # (host tensor, CUDA event) of the last log step's loss on its way to the host
        self._loss: float | None = None

    @property
    def progress_lines(self) -> bool:
        return self._bar.lines

    def start(self, total_steps: int | None = None, *, step: int | None = None) -> None:
        self._total = total_steps
        self._window = [0, 0.0]
        first = step if step is not None else self._last_step or 0
        self._bar.draw(first, total_steps, None, None)

    def record_step(self, step: int, metrics: Mapping[str, float | torch.Tensor], *, samples: int,
                    step_time: float, **timings: Any) -> None:
        self._last_step = step
        self._window[0] += 1
        self._window[1] += step_time
        if step % self.log_every:
            return
        steps, seconds = self._window
        self._window = [0, 0.0]
        self._read_copy()
        loss = metrics.get("global_loss", metrics.get("loss"))  # (the replicas' mean where known)
        if isinstance(loss, torch.Tensor) and loss.is_cuda:
            host = torch.empty((), dtype=loss.dtype, pin_memory=True)
            host.copy_(loss.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._copy = (host, done)
            self._read_copy()
        elif loss is not None:
            self._loss = float(loss)
        self._bar.draw(step, self._total, steps / seconds if seconds > 0 else None, self._loss)

    def _read_copy(self) -> None:
        if self._copy is not None and self._copy[1].query():
            self._loss, self._copy = float(self._copy[0]), None

    def end_progress(self) -> None:
        if self._last_step is not None:
            self._bar.draw(self._last_step, self._total, None, None)  # where training stopped
        self._bar.finish()

    def close(self) -> None:
        self._bar.finish()
