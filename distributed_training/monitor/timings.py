"""The monitor's step accounting: sums of the caller's timings over the log window and over the run.

`Monitor.record_step` adds each step's figures to the *window* (the steps since the previous log
step): a few additions, nothing read from a device. A log step turns the window into its ``perf/*``
figures (means and rates) and folds it into the *run* sums, from which `get_performance_metrics`
draws its summary (the run plus the window still open, so steps after the last log step count).
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepTimings"]


class _Sums:
    """Sums over some steps of the figures `record_step` is given."""

    __slots__ = ("n", "step", "data", "samples", "comm", "comm_n", "comm_step", "comm_data", "tokens", "tok_step")

    def __init__(self) -> None:
        self.n = 0               # steps
        self.step = 0.0          # step time
        self.data = 0.0          # data-loading time
        self.samples = 0
        self.comm = 0.0          # exposed communication time, over the steps that gave one
        self.comm_n = 0          # steps that gave comm_time
        self.comm_step = 0.0     # step time of the steps whose communication comm_time measured
        self.comm_data = 0.0     # their data-loading time
        self.tokens = 0
        self.tok_step = 0.0      # step time of the steps that gave tokens

    def plus(self, other: "_Sums") -> "_Sums":
        total = _Sums()
        for name in self.__slots__:
            setattr(total, name, getattr(self, name) + getattr(other, name))
        return total


class StepTimings:
    """One rank's step timings: the open window's sums (`window`) and the run's (`run`)."""

    __slots__ = ("window", "run")

    def __init__(self) -> None:
        self.window = _Sums()
        self.run = _Sums()

    def add(self, step_time: float, data_time: float, samples: int, tokens: int | None,
            comm_time: float | None, comm_step_time: float | None = None, comm_data_time: float | None = None) -> None:
        """Account for one step (`tokens` and `comm_time` None where the caller does not know them;
        `comm_time` is of the step whose times are `comm_step_time` and `comm_data_time`, by default this
        one's)."""
        w = self.window
        w.n += 1
        w.step += step_time
        w.data += data_time
        w.samples += samples
        if comm_time is not None:
            w.comm += comm_time
            w.comm_n += 1
            w.comm_step += step_time if comm_step_time is None else comm_step_time
            w.comm_data += data_time if comm_data_time is None else comm_data_time
        if tokens is not None:
            w.tokens += tokens
            w.tok_step += step_time

    def window_perf(self) -> dict[str, float]:
        """The open window's ``perf/*`` figures: mean step, data, compute and communication times, the
        exposed share of communication, samples and tokens per second. The window must hold a step."""
        w = self.window
        step_mean = w.step / w.n
        data_mean = w.data / w.n
        perf = {"perf/step_time_s": step_mean, "perf/data_time_s": data_mean}
        if w.comm_n:
            # Of the steps whose communication was measured: their own step, data and communication times
            # (a step measured on a GPU by events and on the host by the clock: its parts may overlap).
            comm_mean = w.comm / w.comm_n
            perf["perf/compute_time_s"] = max(0.0, (w.comm_step - w.comm_data) / w.comm_n - comm_mean)
            perf["perf/comm_time_s"] = comm_mean
            if w.comm_step > 0:
                perf["perf/exposed_comm_pct"] = min(100.0, 100.0 * w.comm / w.comm_step)
        if w.step > 0:
            perf["perf/samples_per_s"] = w.samples / w.step
        if w.tok_step > 0:
            perf["perf/tokens_per_s"] = w.tokens / w.tok_step
        return perf

    def fold_window(self) -> None:
        """Add the window to the run and open a new, empty one (at each log step)."""
        self.run = self.run.plus(self.window)
        self.window = _Sums()

    def summary(self) -> dict[str, Any]:
        """The run so far, the open window included: steps, mean_step_time_s, mean_data_time_s,
        samples_per_s_per_gpu, tokens_per_s_per_gpu, communication_overhead_pct and data_loading_pct
        (None where never given, or over no time)."""
        t = self.run.plus(self.window)
        return {
            "steps": t.n,
            "mean_step_time_s": t.step / t.n if t.n else None,
            "mean_data_time_s": t.data / t.n if t.n else None,
            "samples_per_s_per_gpu": t.samples / t.step if t.step > 0 else None,
            "tokens_per_s_per_gpu": t.tokens / t.tok_step if t.tok_step > 0 else None,
            "communication_overhead_pct": 100.0 * t.comm / t.comm_step if t.comm_n and t.comm_step > 0 else None,
            "data_loading_pct": 100.0 * t.data / t.step if t.step > 0 else None,
        }
