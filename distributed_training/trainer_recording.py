"""What `fit` tells the monitor of each step: its figures, the strategy's communication and pipeline
timings on log steps, and each rank's own work per step for the straggler check.

A mixin of `DistributedTrainer` (under `trainer_epochs.EpochLoop`).
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
import torch.distributed as dist

from .batches import batch_size_of, token_count

__all__ = ["StepRecording"]


class StepRecording:
    """`_record_step` and `_straggler_probe`, on the trainer's monitor, strategy, model and step."""

    def _record_step(self, batch: Any, metrics: dict[str, torch.Tensor], *, step_time: float,
                     data_time: float, span: float | None = None) -> dict[str, torch.Tensor]:
        """Hand the step just trained to the monitor (with the strategy's communication figures, and a
        pipeline's stage times and bubble, on log steps); returns the metrics with those figures added.
        `step_time` runs from the last step's end (its logging, callbacks and saves included: the loop's
        pace); `span`, from this step's fetch on: what the measured step's compute is read from (its time
        less its data and communication), or the last log step's logging counted as the next one's compute."""
        if not self._monitoring:  # (a progress bar only, if any: `ProgressOnly`)
            self.monitor.record_step(self.step, metrics, samples=0, step_time=step_time)
            return metrics
        comm, pipeline = None, None
        log_every = self.monitor_log_every
        if self._measuring:  # this step's communication was timed: keep its own times
            self._measured_times = (step_time if span is None else span, data_time)
        if self.step % log_every == 0:
            comm, extra = self.strategy.pop_communication_metrics(self.model)
            if extra:
                metrics = {**metrics, **{k: torch.tensor(v) for k, v in extra.items()}}
            pipeline = self.strategy.pop_pipeline_timing(self.model)
            if pipeline:
                metrics = {**metrics, **{k: torch.tensor(v) for k, v in pipeline.items()}}
        # Timing communication costs events (DDP: per bucket): only for one step of each window, the
        # straggler probe's (`_probed_step`). Reading its events at the log step ending that window does not
        # wait for the GPU where they are long done; where the drawn step is the log step itself, it does.
        self._measuring = self._probed_step(self.step + 1)
        self.strategy.measure_communication(self.model, self._measuring)
        self.strategy.time_pipeline(self.model, self.step % log_every == 0)
        own = None
        if self.step % log_every == 0 and self._own_time is not None:
            own, self._own_time = max(0.0, _seconds(self._own_time) - (comm or 0.0)), None  # less its wait in backward
            if pipeline:
                # A pipeline step reports no communication time: its waits for the other stages' activations
                # and gradients were all "own work", alike on every rank. Its own is its stage's compute, as the
                # pipeline's timing of a step of this window measured it.
                own = (pipeline["pipeline/forward_ms"] + pipeline["pipeline/backward_ms"]) / 1e3
        if self.step % log_every == 0:
            # The measured step's wait for the others before it trained (the straggler probe's, a per-batch
            # agreement's: a slower peer's data) is communication too, not this rank's compute.
            if comm is not None:
                comm += self._probe_wait
            self._probe_wait = 0.0
        measured = self._measured_times if comm is not None else None
        # A replica's stages and tensor ranks all handle its whole batch: each GPU's share is theirs over them.
        mesh = self.context.mesh
        ways = mesh.size("pipeline") * mesh.size("tensor")
        tokens = token_count(batch)
        self.monitor.record_step(self.step, metrics, samples=batch_size_of(batch) / ways,
                                 tokens=tokens / ways if tokens is not None else None,
                                 step_time=step_time, data_time=data_time, comm_time=comm, own_time=own,
                                 comm_step_time=measured[0] if measured else None,
                                 comm_data_time=measured[1] if measured else None)
        return metrics

    def _with_global_loss(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On a log step with several data-parallel replicas: the metrics and ``global_loss``, the whole
        global batch's loss as one process computes it (each replica's loss times its factor, `loss_weights.
        replica_scale`, averaged: one one-element all-reduce), what the bar and dtrain's line show; each
        rank's ``loss`` stays its own replica's. Without a factor (a pipeline's step) the replicas' mean."""
        if (self.dp_world_size < 2 or not self.strategy.replicas_meet or self.context.independent
                or not isinstance(metrics.get("loss"), torch.Tensor)):
            return metrics
        factor = self._replica_scale if self._replica_scale is not None else 1.0
        total = metrics["loss"].detach().double() * factor
        with self._watched(f"the mean loss over the replicas after training step {self.step}"):
            dist.all_reduce(total, group=self.context.mesh.group("data"))
        return {**metrics, "global_loss": (total / self.dp_world_size).float()}

    def _straggler_probe(self) -> float | None:
        """On the step whose communication is measured (one drawn in each log window), before it trains:
        seconds this rank waits for the others to have their batch, or None on other steps. What it
        waits here is another rank's data loading; what it waits in the step is in the communication
        figures: the two out of its step time leave its own work, which the straggler check compares
        (in synchronous training every rank's step lasts as long as the slowest one's). Costs one tiny
        all-reduce per log window (and, on a GPU, draining this rank's queue first: see `_own_work`). The
        first step this trainer trains is not probed: it warms up (kernels, allocator, communicators)."""
        due, self._probed = self._probe_due(), True
        if not due:
            return None
        group = self.monitor.group
        device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        with self._watched(f"the straggler probe before training step {self.step + 1}"):  # a dead peer named
            if device.type == "cuda":
                self._wait_for_device()
            start = time.perf_counter()
            flag = torch.zeros(1, device=device)
            dist.all_reduce(flag, group=group)
            flag.item()  # on the host: waited for every rank
        if self.device.type == "cuda":  # the step's own work on the GPU starts here (see `_own_work`)
            self._probe_event = torch.cuda.Event(enable_timing=True)
            self._probe_event.record()
        return time.perf_counter() - start

    def _probe_due(self) -> bool:
        """Whether `_straggler_probe` probes before the coming step (the same answer on every rank)."""
        return (self._probed and self._monitoring and self._probed_step(self.step + 1)
                and self.monitor._cluster_on)

    def _probed_step(self, step: int) -> bool:
        """Whether `step` is its log window's measured one: drawn afresh for each window from the window's
        number, alike on every rank. (It was always the window's first: a rank slow on every other step, or
        every fifth, with a log window of an even length, or of five, was never measured slow.)"""
        every = self.monitor_log_every
        window, position = divmod(step - 1, every)
        return position == random.Random(window).randrange(every)

    def _own_work(self, host_s: float, fetch_s: float) -> float | tuple:
        """The probed step's own work, given its host time less the probe's wait (`host_s`) and its data
        fetch (`fetch_s`). On a GPU the host runs ahead of the device, and draining its queue before the
        probe waits for the peers' collectives of the last steps too: the own work is the fetch and the
        GPU's span from the probe to the step's end (the peers' waits in it are exposed communication,
        which `_record_step` takes off), read at the log step from ``(fetch_s, start, end)``."""
        start, self._probe_event = self._probe_event, None
        if start is None:
            return host_s
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return fetch_s, start, end


def _seconds(own: float | tuple) -> float:
    """`StepRecording._own_work`'s figure in seconds (a GPU's events: long done by the log step)."""
    if isinstance(own, tuple):
        fetch_s, start, end = own
        end.synchronize()
        return fetch_s + start.elapsed_time(end) / 1e3
    return own
