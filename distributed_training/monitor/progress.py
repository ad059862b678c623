"""The monitor's progress bar: one line on rank 0's terminal, drawn through tqdm on log steps only; where
stderr is no terminal (a log file, a pipe, a job scheduler's capture) one plain line per log step instead."""

from __future__ import annotations

import contextlib
import os
import time

__all__ = ["ProgressBar"]


class ProgressBar:
    """``step 120/1000 |####      | 12% | 8.31 steps/s | ETA 01:45, loss 2.31`` on one line, through tqdm.

    tqdm keeps the bar on the last line: whatever is written through `tqdm.write` (the package's log
    handler does so, see `distributed_training.logs`) appears above it instead of being overwritten.
    The bar moves on log steps only, so a step that does not log pays nothing for it.
    """

    # (rate_noinv_fmt: "0.72 steps/s" when slow, not tqdm's inverted "1.39s/ steps")
    _KNOWN = "step {n_fmt}/{total_fmt} |{bar:20}| {percentage:3.0f}% | {rate_noinv_fmt} | ETA {remaining}{postfix}"
    _OPEN = "step {n_fmt} | {rate_noinv_fmt}{postfix}"

    def __init__(self, stream) -> None:
        self._stream = stream
        self._bar = None
        try:
            self._terminal = stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or closed
            self._terminal = False
        self._line_step: int | None = None  # the last step written as a line (no terminal)
        self._line_start: tuple[float, int] | None = None  # (time, step) of the first line: for the ETA

    @property
    def lines(self) -> bool:
        """Whether it writes plain lines (no terminal): each log step's line already says the step and loss."""
        return not self._terminal

    def draw(self, step: int, total: int | None, rate: float | None, loss: float | None) -> None:
        if not self._terminal:
            self._draw_line(step, total, rate, loss)
            return
        from tqdm import tqdm

        if self._bar is None or self._bar.total != total:
            self.finish()
            columns, lines = _size(self._stream)
            sized = columns > 0 and lines > 0  # (a terminal that says it has no rows or columns: tqdm drew nothing)
            self._bar = tqdm(total=total, initial=step, file=self._stream, unit=" steps", dynamic_ncols=sized,
                             ncols=None if sized else columns or 100, nrows=None if sized else lines or 24,
                             bar_format=self._KNOWN if total else self._OPEN, mininterval=0.0)
        if loss is not None:
            self._bar.set_postfix_str(f"loss {loss:.4g}", refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()

    def _draw_line(self, step: int, total: int | None, rate: float | None, loss: float | None) -> None:
        """One line per step drawn, ``step 120/1000 (12%) | 8.31 steps/s | ETA 01:45 | loss 2.31``: a redraw of
        the same step writes nothing (a log file gets no carriage returns and no repeated lines)."""
        if step == self._line_step:
            return
        now = time.monotonic()
        if self._line_start is None or self._line_step is None or step < self._line_step:
            self._line_start = (now, step)
        self._line_step = step
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
        if rate:
            parts.append(f"{rate:.2f} steps/s" if rate >= 1 else f"{1 / rate:.2f} s/step")
        started, first = self._line_start
        if total and step > first and step < total:
            left = (total - step) * (now - started) / (step - first)
            parts.append(f"ETA {int(left // 60):02d}:{int(left % 60):02d}")
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        try:
            self._stream.write(" | ".join(parts) + "\n")
            self._stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the run goes on without its progress lines
            pass

    def lifted(self):
        """A context in which writing to the terminal does not mix with the bar (redrawn after it)."""
        if not self._terminal:
            return contextlib.nullcontext()  # plain lines: nothing to lift
        from tqdm import tqdm

        return tqdm.external_write_mode(file=self._stream)

    def finish(self) -> None:
        self._line_step = self._line_start = None
        bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.close()
            except (OSError, ValueError):
                pass


def _size(stream) -> tuple[int, int]:
    """The terminal's columns and lines (0 where it does not say: a pseudo-terminal nobody sized)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 0, 0
    return size.columns, size.lines
