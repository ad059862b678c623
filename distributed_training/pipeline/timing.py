"""Measuring a pipeline step: each rank's compute time by action, the step's window, the bubble.

`PipelineEngine.timing = True` times the coming steps (off by default: then nothing here runs, and
nothing waits for the device). Each compute action (``F``, ``B``, ``I``, ``W``) of a timed step is
wrapped in two marks (`ActionClock`): on CPU `time.perf_counter`, on CUDA two timing events recorded on
the current stream. The marks hold the compute only: a forward's start mark comes after its input was
received (on CUDA after the stream was made to wait for the received tensor, so the start event
fires when the data is there and the compute begins), a backward's after the output gradient was
received, and the end mark before the result is sent. Waiting for a message is therefore never busy
time. After the step's last message (the loss) one synchronisation with the device reads the events.

The window. `schedules.bubble_formula` is ``1 - total busy / (P x makespan)`` of `schedules.simulate`,
whose clock starts when stage 0 starts its first forward and stops when the last action of any rank
ends. The measured bubble uses the same definition, with each rank's times on a common clock. Clocks
of different processes (CUDA events of different devices, hosts of different machines) are not
comparable, so the ranks are aligned the way the simulator places them: every schedule starts each
rank with the forward of microbatch 0 on its chunk 0 (stage r on rank r), which can only begin once
stage r - 1 has finished the same forward; the simulator starts it at that instant. So rank r's first
forward is taken to start when rank r - 1's ends: rank r's clock is offset by the sum of the first
forwards' durations of the ranks before it, and the window is the latest ``offset + (last end - first
forward's start)`` over the ranks. The approximation: the P - 1 transfers of microbatch 0's activation
count as free (the simulator's assumption); every later transfer the schedule waits for shows as idle
time in the rank's own timeline, as it should. Each rank sends the others a few numbers (`rank_row`),
by message after the step's own loss message, so a rank that fails stops the others as in any step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .schedules import KINDS, bubble_formula, build_schedule, simulate

__all__ = ["ActionClock", "PipelineTiming", "combine", "rank_row"]


@dataclass(frozen=True)
class PipelineTiming:
    """One timed step of one pipeline rank (`PipelineEngine.last_timing`).

    Attributes:
        busy_ms: this rank's compute time by action kind (``"F"``, ``"B"``, ``"I"``, ``"W"``; only the
            kinds its schedule has), all chunks together.
        window_ms: the pipeline's step window: from stage 0's first forward to the end of the last
            compute of any rank (see the module docstring for how the ranks' clocks are aligned).
        bubble: the measured bubble, ``1 - sum(rank_busy_ms) / (P x window_ms)``.
        bubble_formula: `schedules.bubble_formula` for this schedule, P, microbatches and chunks (equal
            stages, backward = 2 forwards, free communication).
        bubble_simulated: `schedules.simulate`'s bubble for this schedule with each (rank, chunk,
            kind)'s measured mean duration as its cost (free communication): the bubble these stages'
            costs give. Measured minus simulated is what communication and host overhead add; simulated
            minus formula is what uneven stages (or a backward not twice the forward) add.
        rank_busy_ms: each pipeline rank's compute time, in pipeline order.
        rank: this rank's position in the pipeline.
        schedule, microbatches, chunks: the step's schedule (`microbatches` is this step's: fewer for a
            batch smaller than configured).
    """

    busy_ms: dict[str, float]
    window_ms: float
    bubble: float
    bubble_formula: float
    bubble_simulated: float
    rank_busy_ms: list[float] = field(repr=False)
    rank: int
    schedule: str
    microbatches: int
    chunks: int

    @property
    def forward_ms(self) -> float:
        return self.busy_ms.get("F", 0.0)

    @property
    def backward_ms(self) -> float:
        """The backward's compute: ``B``, or ``I`` + ``W`` (split backward)."""
        return sum(self.busy_ms.get(k, 0.0) for k in ("B", "I", "W"))

    def metrics(self, prefix: str = "pipeline/") -> dict[str, float]:
        """The figures a monitor logs (this rank's stage; the bubble is the pipeline's): forward_ms,
        backward_ms (and input_grad_ms / weight_grad_ms for a split backward), window_ms, bubble,
        bubble_formula, bubble_simulated."""
        out = {"forward_ms": self.forward_ms, "backward_ms": self.backward_ms}
        if "I" in self.busy_ms:
            out["input_grad_ms"] = self.busy_ms["I"]
            out["weight_grad_ms"] = self.busy_ms.get("W", 0.0)
        out.update(window_ms=self.window_ms, bubble=self.bubble, bubble_formula=self.bubble_formula,
                   bubble_simulated=self.bubble_simulated)
        return {prefix + k: float(v) for k, v in out.items()}


class ActionClock:
    """Marks around one rank's compute actions during one step: `start` before the compute, `stop`
    after it. On CUDA the marks are timing events on the current stream (taken from a pool, so a
    step creates none after the first), read by `row` after one wait for the last of them."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pool: list = []
        self.spans: list[tuple[str, int, int, object, object]] = []  # (kind, microbatch, chunk, start, end)

    def reset(self) -> None:
        if self.cuda:
            self._pool += [mark for span in self.spans for mark in span[3:]]
        self.spans = []

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, kind: str, microbatch: int, chunk: int, start) -> None:
        self.spans.append((kind, microbatch, chunk, start, self.start()))

    def times_ms(self) -> list[tuple[str, int, int, float, float]]:
        """The spans as (kind, microbatch, chunk, start, end), in ms from the first span's start."""
        if not self.spans:
            return []
        origin = self.spans[0][3]
        if self.cuda:
            self.spans[-1][4].synchronize()  # the step's compute only: what was queued after it runs on
            return [(k, m, c, origin.elapsed_time(s), origin.elapsed_time(e)) for k, m, c, s, e in self.spans]
        return [(k, m, c, (s - origin) * 1e3, (e - origin) * 1e3) for k, m, c, s, e in self.spans]


def rank_row(spans: Sequence[tuple[str, int, int, float, float]], chunks: int) -> list[float]:
    """What a rank tells the others about its step: ``[first forward's ms, span ms, busy ms of (chunk 0,
    F), (chunk 0, B), (chunk 0, I), (chunk 0, W), (chunk 1, F), ...]``. The first forward is that of
    microbatch 0 on chunk 0 (every schedule's first action); the span runs from its start to the end
    of the rank's last compute."""
    anchor = next(((s, e) for k, m, c, s, e in spans if (k, m, c) == ("F", 0, 0)), None)
    if anchor is None:
        raise RuntimeError("timing a pipeline step: this rank ran no forward of microbatch 0 on chunk 0, which "
                           "every schedule starts with")
    busy = [0.0] * (len(KINDS) * chunks)
    for k, _, c, s, e in spans:
        busy[c * len(KINDS) + KINDS.index(k)] += e - s
    return [anchor[1] - anchor[0], max(e for *_, e in spans) - anchor[0], *busy]


def combine(rows: Sequence[Sequence[float]], *, rank: int, schedule: str, microbatches: int,
            chunks: int = 1) -> PipelineTiming:
    """The step's `PipelineTiming` from every pipeline rank's `rank_row` (in pipeline order), as seen
    from pipeline rank `rank`. Rank r's clock starts ``sum(first forward of ranks < r)`` after rank 0's
    (see the module docstring)."""
    P, V, n = len(rows), chunks, len(KINDS)
    offset, window = 0.0, 0.0
    for row in rows:
        window = max(window, offset + row[1])
        offset += row[0]
    busy = [[[row[2 + c * n + i] for i in range(n)] for c in range(V)] for row in rows]  # [rank][chunk][kind]
    rank_busy = [sum(map(sum, b)) for b in busy]
    bubble = 1.0 - sum(rank_busy) / (P * window) if window > 0 else 0.0
    plan = build_schedule(schedule, P, microbatches, chunks=V)
    counts = [[[0] * n for _ in range(V)] for _ in range(P)]
    for r, actions in enumerate(plan):
        for a in actions:
            counts[r][a.chunk][KINDS.index(a.kind)] += 1

    def cost(r, action):
        i = KINDS.index(action.kind)
        return busy[r][action.chunk][i] / counts[r][action.chunk][i]

    simulated = simulate(plan, P, V, costs=cost, microbatches=microbatches).bubble
    kinds = {k: sum(busy[rank][c][i] for c in range(V)) for i, k in enumerate(KINDS)
             if any(counts[rank][c][i] for c in range(V))}
    return PipelineTiming(busy_ms=kinds, window_ms=window, bubble=bubble,
                          bubble_formula=bubble_formula(schedule, P, microbatches, chunks=V),
                          bubble_simulated=simulated, rank_busy_ms=rank_busy, rank=rank, schedule=schedule,
                          microbatches=microbatches, chunks=V)
