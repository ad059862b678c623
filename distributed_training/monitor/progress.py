"""The monitor's progress bar: one line on rank 0's terminal, drawn through tqdm on log steps only."""

from __future__ import annotations

__all__ = ["ProgressBar"]


class ProgressBar:
    """``step 120/1000 |####      | 12% | 8.31 steps/s | ETA 01:45, loss 2.31`` on one line, through tqdm.

    tqdm keeps the bar on the last line: whatever is written through `tqdm.write` (the package's log
    handler does so, see `distributed_training.logs`) appears above it instead of being overwritten.
    The bar moves on log steps only, so a step that does not log pays nothing for it.
    """

    _KNOWN = "step {n_fmt}/{total_fmt} |{bar:20}| {percentage:3.0f}% | {rate_fmt} | ETA {remaining}{postfix}"
    _OPEN = "step {n_fmt} | {rate_fmt}{postfix}"

    def __init__(self, stream) -> None:
        self._stream = stream
        self._bar = None

    def draw(self, step: int, total: int | None, rate: float | None, loss: float | None) -> None:
        from tqdm import tqdm

        if self._bar is None or self._bar.total != total:
            self.finish()
            self._bar = tqdm(total=total, initial=step, file=self._stream, unit=" steps", dynamic_ncols=True,
                             bar_format=self._KNOWN if total else self._OPEN, mininterval=0.0)
        if loss is not None:
            self._bar.set_postfix_str(f"loss {loss:.4g}", refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()

    def lifted(self):
        """A context in which writing to the terminal does not mix with the bar (redrawn after it)."""
        from tqdm import tqdm

        return tqdm.external_write_mode(file=self._stream)

    def finish(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.close()
            except (OSError, ValueError):
                pass
