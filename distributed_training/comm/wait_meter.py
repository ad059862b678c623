"""Exposed communication: how long a rank is held up by its collectives, measured on the steps the
trainer logs (the straggler check subtracts it from the step to leave the rank's own work).

`DDP` times its one wait after backward itself (`strategies/overlap.py`); FSDP waits in every unit's
all-gather and reduce-scatter, tensor parallelism in every layer's collective: both time those waits
with a `WaitMeter`. On a GPU a wait holds up the compute stream, not the host: two CUDA events around it
measure the stall (read at the next log step, long done by then); on the CPU the host blocks, and the
wall clock measures it.
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["WaitMeter"]

_OFF = contextlib.nullcontext()


class WaitMeter:
    """Sums the waits inside `waiting` blocks while `on`; `passes` counts what the owner calls a pass
    (a synchronised backward, an optimizer step), so that `pop` can say seconds per pass."""

    #: Event pairs kept at most (nobody reading: a bounded recent window).
    KEEP = 4096

    def __init__(self) -> None:
        self.on = False
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.passes = 0

    def waiting(self, device: torch.device) -> contextlib.AbstractContextManager:
        """A block whose time is a wait (a shared no-op while off: FSDP asks per unit, every step)."""
        return _OFF if not self.on else self._timed(device)

    @contextlib.contextmanager
    def _timed(self, device: torch.device):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((start, end))
                if len(self._events) > self.KEEP:
                    del self._events[: self.KEEP // 2]
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self._host_s += time.perf_counter() - start_s

    def count_pass(self) -> None:
        if self.on:
            self.passes += 1

    def pop(self) -> float | None:
        """Seconds waited per pass since the last call (None: no pass measured). On a GPU this waits
        for the recorded events: call it when logging."""
        seconds, passes = self._host_s, self.passes
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self._host_s, self._events, self.passes = 0.0, [], 0
        return seconds / passes if passes else None
