"""Training-run monitor: per-rank TensorBoard and JSONL logs, throughput, a cluster-wide straggler check.

    monitor = Monitor("runs/exp1", rank=ctx.rank, world_size=ctx.world_size, log_every=50)
    monitor.start(total_steps=10_000)
    for step in range(1, 10_001):
        t0 = time.perf_counter()
        batch = next(loader)
        t1 = time.perf_counter()
        metrics = trainer.train_step(batch, criterion)
        t2 = time.perf_counter()
        monitor.record_step(step, metrics, samples=len(batch[0]), step_time=t2 - t0, data_time=t1 - t0)
    monitor.close()

Every rank writes its own directory, ``log_dir/rank_<r>/``, holding TensorBoard event files and
``metrics.jsonl`` (one JSON object per logged step; a value that is not finite, such as a NaN loss,
is ``null``). Point ``tensorboard --logdir log_dir`` at the
parent to see the ranks side by side, or draw a PNG with
``python -m distributed_training.monitor.plot log_dir -o run.png``.

What a step costs. On most steps `record_step` adds a few numbers to running sums and returns: it
does not look at the metrics (reading a CUDA tensor would wait for the GPU), writes nothing and talks
to no other rank. Every `log_every` steps (``step % log_every == 0``) it averages the timings over the
steps since the previous log, runs **one all-gather** of each rank's mean step time, and hands the
record to the writer, which reads the system figures and writes and flushes everything.

Nor does a log step wait for the GPU. Metrics that are CUDA tensors (and, over NCCL, the all-gather's
result) are copied into pinned host memory by one asynchronous copy queued behind the step, and a
background thread waits for that copy's CUDA event, then reads the system figures and writes the
TensorBoard and JSONL records and the progress bar, while the training thread goes on queueing work.
Log records whose values are all on the host already (CPU training) are written at once, on the
calling thread (see `background`). Whatever the writer still holds is finished before
`get_performance_metrics`, `end_progress` and `close` return; a straggler warning it found is raised
on the training thread, at the next call to the monitor; an error it met is raised there too.

That all-gather makes log steps collective: **every rank of the group must call `record_step` with
the same step numbers** (ranks that skip a log step leave the others waiting in the all-gather until
the process group's timeout). To switch monitoring off, use `NullMonitor` on every rank rather than
calling the monitor on some ranks only.

Timings are the caller's to measure, since only the caller knows where data loading ends and where
communication is exposed; the monitor only aggregates them. Values logged for user metrics are those
passed at the log step (not window means: averaging them would touch every step's tensors).
Steps after the last log step count in `get_performance_metrics` but are not written.

Pipelines. With pipeline parallelism the trainer adds, on log steps, the figures of one timed step of
the window (`pipeline.PipelineTiming.metrics`): this rank's stage's ``pipeline/forward_ms`` and
``pipeline/backward_ms`` (``input_grad_ms`` / ``weight_grad_ms`` for a split backward), and the
pipeline's ``pipeline/window_ms``, ``pipeline/bubble`` (measured), ``pipeline/bubble_simulated`` and
``pipeline/bubble_formula``; `get_performance_metrics` averages the measured bubble over the log steps
that had one.

This module holds `Monitor` and `NullMonitor`; the monitor's parts live beside it: `timings` (the
window and run sums of the step timings), `writer` (the log record, the device-to-host copy and the
writer thread), `progress` (the progress bar) and `system` (host and GPU figures).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_single
from ..mesh import global_rank
from ..runtime import collective_device
from .cluster import StragglerWarning, cluster_view
from .null import NullMonitor
from .progress import ProgressBar
from .system import SystemStats
from .timings import StepTimings
from .arguments import check_monitor_arguments, check_timings, is_int
from .writer import LogRecord, WriterHandling, WriterThread, copy_to_host, json_line

__all__ = ["Monitor", "NullMonitor", "StragglerWarning"]


class Monitor(WriterHandling):
    """Log one rank's training metrics, timings and system figures; compare step times across ranks.

    Args:
        log_dir: directory of the run; this rank writes under ``log_dir/rank_<rank>``. JSONL files
            are appended to: a resumed run adds the steps after its checkpoint again, and
            `plot.load_run` keeps, from each step a run restarted at, the later run's records.
        rank: this process's rank in `group` (its global rank by default).
        world_size: number of processes in `group` (the whole job by default). When
            torch.distributed is initialised, both must match what it reports.
        group: process group of the cluster view's all-gather (None: the default group). Its first
            member (group rank 0) writes the ``cluster/*`` figures.
        log_every: log on steps where ``step % log_every == 0``.
        straggler_threshold: flag a straggler when the slowest rank's own time per step (`record_step`'s
            ``own_time``; its mean step time where not given) exceeds this multiple of the median (for an
            even number of ranks the lower of the two middle values, so that in a world of two the slower
            rank is compared with the faster one), by 5 ms or more. Must be > 1. The ``cluster/straggler``
            figure flags each log window; the `StragglerWarning` waits for the same rank to be flagged
            in two of three windows in a row (one measured step a window: a millisecond step's one-off
            spike, scheduling or a collection, flagged 17 of 600 windows of two balanced ranks,
            alternately; a rank slow in every other window is still told).
        tensorboard: write TensorBoard event files.
        jsonl: append to ``metrics.jsonl``.
        system_stats: log host CPU and memory, and the GPU's utilisation, memory, power and
            temperature when NVML is available (see `SystemStats`).
        progress: on rank 0, draw a one-line progress bar on stderr (redrawn on log steps).
        background: where log records are written. None (default): on a background thread when
            the record holds values still on a GPU (so that the training thread never waits for the
            device), at once on the calling thread otherwise; True: always on the background thread
            (file writes and system readings off the training thread, CPU runs too); False: always on
            the calling thread, which then waits for the GPU on log steps.
        cluster_view: gather the ranks' step times on log steps for the ``cluster/*`` figures and the
            straggler check (a collective over `group`). False: each rank logs alone, for ranks that
            never meet (a parameter server's workers under ssp / async).
        member: what the members of `group` are called in messages and figures: ``"rank"``, or
            ``"worker"`` when `rank` is a worker index (a parameter server's workers: ``rank_<w>`` holds
            worker w, not global rank w). Written into each JSONL record (``"member"``) when not
            ``"rank"``, for `plot`'s labels.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        log_every: int = 10,
        straggler_threshold: float = 1.5,
        tensorboard: bool = True,
        jsonl: bool = True,
        system_stats: bool = True,
        progress: bool = True,
        background: bool | None = None,
        cluster_view: bool = True,
        member: str = "rank",
    ) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        group_rank = check_monitor_arguments(
            log_dir, rank=rank, world_size=world_size, group=group, log_every=log_every,
            straggler_threshold=straggler_threshold, member=member, background=background,
            flags=dict(tensorboard=tensorboard, jsonl=jsonl, system_stats=system_stats, progress=progress))
        self.log_dir = os.fspath(log_dir)
        self.rank = int(rank)
        self.member = member
        self.world_size = int(world_size)
        self.group = group
        self.log_every = int(log_every)
        self.straggler_threshold = float(straggler_threshold)
        self.rank_dir = os.path.join(self.log_dir, f"rank_{self.rank}")
        os.makedirs(self.rank_dir, exist_ok=True)
        records = os.path.join(self.rank_dir, "metrics.jsonl")
        #: Whether this rank's directory held an earlier run's records when this monitor opened it (its own
        #: are appended to them).
        self.found_earlier_records = os.path.isfile(records) and os.path.getsize(records) > 0

        # Cluster view: one all-gather of the mean step time on every log step.
        self._cluster_on = initialised and self.world_size > 1 and bool(cluster_view)
        self._writes_cluster = group_rank == 0
        self._group_ranks: list[int] = list(range(self.world_size))
        self._gather_in = self._gather_out = None
        if self._cluster_on:
            self._group_ranks = [global_rank(group, i) for i in range(self.world_size)]
            device = collective_device(group)
            # (mean step time, own time or -1) per rank: see `record_step`'s own_time
            self._gather_in = torch.zeros(2, dtype=torch.float64, device=device)
            self._gather_out = torch.zeros(2 * self.world_size, dtype=torch.float64, device=device)

        self._writer = None
        self._writer_used = False  # (set by the first scalar written through it)
        self._jsonl = None
        self._system = None
        self._closed = False
        # The writer thread (started by the first record it is given) and what it hands back.
        self._background = background
        self._writer_thread: WriterThread | None = None
        self._warnings: list[str] = []  # straggler messages found by the writer, raised by the training thread
        try:
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self.rank_dir)
            if jsonl:
                self._jsonl = open(os.path.join(self.rank_dir, "metrics.jsonl"), "a", encoding="utf-8")
            if system_stats:
                self._system = SystemStats()
        except BaseException:
            self.close()
            raise
        self._bar = ProgressBar(sys.stderr) if progress and self.rank == 0 else None

        self._started = False
        self._mono0 = 0.0        # perf_counter() at start
        self._last_log_mono = 0.0
        self._total_steps: int | None = None
        self._last_step: int | None = None
        self._timings = StepTimings()  # the window's sums (since the last log step) and the run's
        self._cluster_last: dict[str, float] = {}
        self._straggler_events = 0
        # The members flagged in the last two windows (None: none was): one flagged again is warned of.
        self._suspects: collections.deque = collections.deque(maxlen=2)
        self._bubbles: list[float] = []  # a pipeline's measured bubble, per log step that had one
        self._bubble_formula: float | None = None

    # ----------------------------------------------------------------- public
    @property
    def progress_lines(self) -> bool:
        """True where this rank's progress is a plain line per log step with its loss (stderr is no
        terminal): a caller's own per-step log line would say the same again."""
        return self._bar is not None and self._bar.lines

    def start(self, total_steps: int | None = None, *, step: int | None = None) -> None:
        """Start the run clock (and, on rank 0, the progress bar). Called by the first `record_step`
        if you do not; calling it again restarts the clock and sets a new total. `step`: the step
        training starts from (a resumed run's), where the bar and its ETA begin (default: the last
        recorded step, else 0)."""
        if self._closed:
            raise RuntimeError("Monitor is closed")
        if total_steps is not None and (not is_int(total_steps) or total_steps < 0):
            raise ValueError(f"total_steps must be a non-negative integer or None, got {total_steps!r}")
        if step is not None and (not is_int(step) or step < 0):
            raise ValueError(f"step must be a non-negative integer or None, got {step!r}")
        self._drain()
        self._suspects.clear()  # (a window of an earlier run and one of this are not neighbours)
        if step and self._writer is not None and self.found_earlier_records and not self._writer_used:
            # A resumed run: TensorBoard drops the earlier run's events from step + 1 on (written after its
            # checkpoint, before it stopped), which it would show beside this run's and fold its curves.
            from torch.utils.tensorboard import SummaryWriter

            self._writer.close()
            self._writer = SummaryWriter(log_dir=self.rank_dir, purge_step=step + 1)
        self._started = True
        self._total_steps = None if total_steps is None else int(total_steps)
        self._mono0 = self._last_log_mono = time.perf_counter()
        if self._bar is not None:
            first = step if step is not None else 0 if self._last_step is None else self._last_step
            self._bar.draw(first, self._total_steps, None, None)

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
        """Account for one training step; on log steps, write and compare across ranks.

        Args:
            step: the step number; strictly increasing, and the same sequence on every rank.
            metrics: name -> float or 0-dim tensor (``{"loss": ..., "lr": ..., "grad_norm": ...}``);
                only read on log steps. Names without ``/`` are logged as ``train/<name>``.
            samples: samples this rank processed in the step (its share where several ranks process one
                batch: `fit` divides a replica's batch by its pipeline stages times its tensor ranks, so
                that the ``*_per_gpu`` figures add up to the job's).
            tokens: tokens this rank processed in the step, if the notion applies (its share, likewise).
            step_time: seconds the whole step took on this rank (data loading included).
            data_time: seconds of it spent waiting for data.
            comm_time: seconds of it spent in communication not hidden behind compute, if known; or of
                an earlier step's, whose step and data times are then `comm_step_time` and
                `comm_data_time` (`fit` times the communication of one step per log window, and hands
                it over at the log step).
            own_time: on a log step, seconds of a recent step this rank spent on its own work: its step
                time less what it waited for the other ranks, if known (`fit` measures it). In synchronous
                training every rank's step takes as long as the slowest rank's, so step times cannot tell a
                straggler; the straggler check compares these (the window's mean step time without them).

        Collective on log steps (``step % log_every == 0``) when torch.distributed is initialised and
        world_size > 1: every rank must make the call.
        """
        if self._closed:
            raise RuntimeError("Monitor is closed")
        if self._warnings or (self._writer_thread is not None and self._writer_thread.error is not None):
            self._surface()
        last = self._last_step
        if last is not None and step <= last:
            raise ValueError(f"step must increase from call to call: got {step} after {last}")
        check_timings(step_time=step_time, data_time=data_time, samples=samples)
        if step % self.log_every == 0:  # (read on log steps only; a bad one refused before the step is taken)
            for name, value in metrics.items():
                if not (value.numel() == 1 if isinstance(value, torch.Tensor) else hasattr(value, "__float__")):
                    raise ValueError(f"metric {name!r} at step {step} must be a number or a one-element tensor, got "
                                     f"{value!r:.80}")
        self._last_step = step
        if not self._started:
            self.start()
        self._timings.add(step_time, data_time, samples, tokens, comm_time, comm_step_time, comm_data_time)
        if step % self.log_every == 0:
            self._log(step, metrics, own_time)

    def record_eval(self, step: int, mine: Mapping[str, float], whole: Mapping[str, float], *,
                    seconds: float | None = None) -> None:
        """Log an evaluation made after `step` (see `distributed_training.validation`): `mine`, this
        rank's shard's values, as ``val/<name>`` in this rank's TensorBoard and ``eval.jsonl``; `whole`,
        the whole set's (the same on every rank), as ``cluster/<name>`` by the cluster view's writer
        (group rank 0). Not collective: the values were reduced already. ``eval.jsonl`` is a file of its
        own, so that ``metrics.jsonl`` keeps one record per step (see `plot.load_run`)."""
        if self._closed:
            raise RuntimeError("Monitor is closed")
        self._drain()  # the writer thread's records first: the files are written in step order
        scalars = {f"val/{name}": float(value) for name, value in mine.items()}
        if seconds is not None:
            scalars["val/seconds"] = float(seconds)
            # The bar's rate is training's: the evaluation's time is not in the window it divides by.
            self._last_log_mono += float(seconds)
        if self._writes_cluster:
            scalars.update({f"cluster/{name}": float(value) for name, value in whole.items()})
        now = time.time()
        if self._writer is not None:
            self._writer_used = True
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, global_step=step, walltime=now)
            self._writer.flush()
        if self._jsonl is not None:
            with open(os.path.join(self.rank_dir, "eval.jsonl"), "a", encoding="utf-8") as f:
                f.write(json_line({"step": step, "time": now, "rank": self.rank, **self._member_field(), **scalars}))

    def get_performance_metrics(self) -> dict[str, Any]:
        """Summary of the whole run so far (this rank; ``cluster_*`` from the last log step).

        Keys: steps, elapsed_s, mean_step_time_s, mean_data_time_s, samples_per_s_per_gpu,
        tokens_per_s_per_gpu, communication_overhead_pct (exposed communication time over step
        time), data_loading_pct, cluster_step_time_min_s / _mean_s / _max_s, cluster_slowest_rank,
        cluster_straggler, straggler_events, pipeline_bubble (the mean measured bubble of a pipeline over
        the log steps that logged ``pipeline/bubble``) and pipeline_bubble_formula. Figures that were
        never given are None. Waits for the writer to finish the log steps handed to it.
        """
        self._drain()
        run = self._timings.summary()
        cl = self._cluster_last
        return {
            "steps": run.pop("steps"),
            "elapsed_s": (time.perf_counter() - self._mono0) if self._started else 0.0,
            **run,
            "cluster_step_time_min_s": cl.get("cluster/step_time_min_s"),
            "cluster_step_time_mean_s": cl.get("cluster/step_time_mean_s"),
            "cluster_step_time_max_s": cl.get("cluster/step_time_max_s"),
            "cluster_slowest_rank": None if not cl else int(cl["cluster/slowest_rank"]),
            "cluster_straggler": None if not cl else bool(cl["cluster/straggler"]),
            "straggler_events": self._straggler_events,
            "pipeline_bubble": sum(self._bubbles) / len(self._bubbles) if self._bubbles else None,
            "pipeline_bubble_formula": self._bubble_formula,
        }

    def end_progress(self) -> None:
        """Close the progress bar's line (end of a `fit`), so that what is printed next starts on its own
        line; a later `start` draws a new bar. The monitor stays open. Waits for the writer to finish
        the log steps handed to it."""
        self._drain()
        if self._bar is not None:
            if self._last_step is not None and self._started:
                self._bar.draw(self._last_step, self._total_steps, None, None)  # where training stopped
            self._bar.finish()

    def close(self) -> None:
        """Let the writer finish, finish the progress bar, flush and close the files. Safe to call more
        than once."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_writer_thread", None) is not None:
            self._stop_writer()
        bar, self._bar = getattr(self, "_bar", None), None
        if bar is not None:
            bar.finish()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.flush()
            writer.close()
        f, self._jsonl = self._jsonl, None
        if f is not None:
            f.close()
        system, self._system = self._system, None
        if system is not None:
            system.close()
        if getattr(self, "_writer_thread", None) is not None:
            self._surface(stacklevel=3)  # the writer's last warnings, or its error

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- private
    def _log(self, step: int, metrics: Mapping[str, Any], own_time: float | None = None) -> None:
        """On the training thread: take this log step's figures without waiting for the device, run
        the all-gather, and write the record (or hand it to the writer thread)."""
        record = LogRecord(step=step, now=time.time())
        mono = time.perf_counter()
        device_values: list[torch.Tensor] = []
        for name, value in metrics.items():
            tag = name if "/" in name else f"train/{name}"
            if isinstance(value, torch.Tensor) and value.is_cuda:
                record.scalars[tag] = None  # filled in from the host copy
                record.device_tags.append(tag)
                device_values.append(value.detach().reshape(()))
            else:
                record.scalars[tag] = float(value)
        if record.scalars.get("pipeline/bubble") is not None:  # host values (the engine's, after its sync)
            self._bubbles.append(record.scalars["pipeline/bubble"])
            self._bubble_formula = record.scalars.get("pipeline/bubble_formula")

        record.perf = self._timings.window_perf()
        if self._cluster_on:
            # The one collective of a log step, issued here so that every rank issues it in the same
            # order relative to training's own collectives. Over NCCL nothing waits for it here.
            step_mean = record.perf["perf/step_time_s"]
            self._gather_in[0].fill_(step_mean)  # (fill_: no host-to-device copy to wait for)
            self._gather_in[1].fill_(-1.0 if own_time is None else own_time)  # -1: not measured
            all_gather_single(self._gather_out, self._gather_in, group=self.group)
            if self._gather_out.is_cuda:
                record.gathered = 2 * self.world_size
                device_values.append(self._gather_out)
            else:
                record.times = self._gather_out.tolist()
        if device_values:
            record.values, record.ready = copy_to_host(device_values)
        if self._system is not None:
            self._system.use_current_device()  # CUDA's current device is per thread: fix it here
        if self._bar is not None:
            elapsed = mono - self._last_log_mono
            record.rate = self._timings.window.n / elapsed if elapsed > 0 else None
        self._last_log_mono = mono
        self._timings.fold_window()

        if self._background or (self._background is None and (record.ready is not None or self._busy())):
            self._hand_to_writer(record)
        else:
            self._write(record)
            self._surface(stacklevel=4)  # the user's record_step call

    def _write(self, record: LogRecord) -> None:
        """Read what the device delivered, add the system figures and the cluster view, write the files
        and draw the bar: on the writer thread, or on the training thread (see `background`)."""
        scalars = record.scalars
        times = record.times
        if record.values is not None:
            record.ready.synchronize()  # this log step's copy only: later steps keep running
            values = record.values.tolist()
            for tag, value in zip(record.device_tags, values):
                scalars[tag] = value
            if record.gathered:
                times = values[len(values) - record.gathered:]
        scalars.update(record.perf)
        if self._system is not None:
            scalars.update(self._system.read())
        if times is not None:
            view = self._cluster_view(record.step, times)
            if self._writes_cluster:
                scalars.update(view)

        if self._writer is not None:
            self._writer_used = True
            add = self._writer.add_scalar
            for tag, value in scalars.items():
                add(tag, value, global_step=record.step, walltime=record.now)
            self._writer.flush()
        if self._jsonl is not None:
            line = {"step": record.step, "time": record.now, "rank": self.rank, **self._member_field()}
            line.update(scalars)
            self._jsonl.write(json_line(line))
            self._jsonl.flush()
        if self._bar is not None:
            self._bar.draw(record.step, self._total_steps, record.rate,  # (the replicas' mean where known)
                           scalars.get("train/global_loss", scalars.get("train/loss")))

    def _cluster_view(self, step: int, times: list[float]) -> dict[str, float]:
        own = times[1::2]  # (step time, own time or -1) per member
        view, straggler = cluster_view(step, times[0::2], self._group_ranks, self.member, self.straggler_threshold,
                                       own_times=own if min(own) >= 0 else None)
        self._cluster_last = view
        suspect = view["cluster/slowest_rank"] if straggler is not None else None
        if straggler is not None:
            self._straggler_events += 1
            # (in two of three windows: no one-off spike, and a rank slow every other window is still told)
            if self._writes_cluster and suspect in self._suspects:
                before = "the log window before" if self._suspects[-1] == suspect else "two log windows before"
                self._warnings.append(f"{straggler}, as in {before}")
        self._suspects.append(suspect)
        return view

    def _member_field(self) -> dict[str, str]:
        """``{"member": ...}`` in a JSONL record when the members are not ranks (nothing otherwise)."""
        return {} if self.member == "rank" else {"member": self.member}
