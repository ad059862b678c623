"""How much of DDP's bucket communication backward hid: the timeline behind `DDP.pop_overlap_stats`."""

from __future__ import annotations

import os
import time

import torch

__all__ = ["OverlapTimeline", "CommTiming"]


class OverlapTimeline:
    """Per-bucket [launch, done] intervals and the end of backward, for `DDP.pop_overlap_stats`.

    CUDA: an event on the compute stream when a bucket is handed over (its gradients are ready), and
    one on a side stream made to wait for the bucket's collectives, which therefore fires when they
    finish; nothing is added to the compute stream's dependencies. CPU: host clocks, with the end
    taken in the work's completion callback (which takes the GIL on gloo's thread: a small cost, paid
    only while measuring). Communication time is the union of the intervals;
    what lies after backward's end is exposed, the rest hidden, except for a reducer that ran
    synchronously inside the hook (no work returned): all of its time held backward up, so it counts
    as exposed. For a `CommunicationOptimizer` the interval starts before its compression kernels and
    ends with its collectives; work done in its `wait()` (decoding, PowerSGD's second all-reduce) is
    not in it, so the hidden share is an upper bound there.
    """

    def __init__(self) -> None:
        self._side: torch.cuda.Stream | None = None
        self._current: list = []      # [(start, end-holder)] of the backward in progress
        self._passes: list = []       # finished backwards: (intervals, backward_end)

    def launch(self, buffer: torch.Tensor):
        if buffer.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def begin(self) -> None:
        self._current = []

    def track(self, start, handle, owned: bool = True) -> None:
        works = getattr(handle, "works", None)
        works = [handle] if works is None else works
        works = [w for w in works if hasattr(w, "get_future")]
        # A reducer that returns no work (ring, tree, hierarchical) ran inside the hook: it blocked backward.
        blocking = not works
        if isinstance(start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            if blocking:
                end.record()
            else:
                # NCCL's wait() orders the *current* stream after the collective and then lets go of
                # the tensors it was holding for it; only do it on the side stream when those tensors
                # outlive the handle (never a custom reducer's temporaries), and not when the wait
                # would block the host (TORCH_NCCL_BLOCKING_WAIT).
                if not owned or os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
                    return
                if self._side is None:
                    self._side = torch.cuda.Stream()
                with torch.cuda.stream(self._side):
                    for w in works:
                        w.wait()  # a stream-side wait: the side stream, not the host, waits for the transfer
                    end.record()
            self._current.append((start, end, blocking))
            return
        futures = []
        for w in works:
            try:
                futures.append(w.get_future())
            except RuntimeError:  # a work without a future (gloo's reduce-scatter, made of other collectives)
                return  # this transfer goes untimed
        holder = [time.perf_counter() if blocking else None]
        if futures:
            remaining = [len(futures)]

            def done(_fut, holder=holder, remaining=remaining) -> None:
                remaining[0] -= 1
                if remaining[0] == 0:
                    holder[0] = time.perf_counter()

            for future in futures:
                future.then(done)
        self._current.append((start, holder, blocking))

    def backward_done(self, timing) -> None:
        self._passes.append((self._current, timing))
        self._current = []
        if len(self._passes) > 256:  # nobody is reading them: keep a bounded recent window
            del self._passes[:128]

    def pop(self) -> dict[str, float]:
        comm = exposed = 0.0
        passes = 0
        for intervals, end_of_backward in self._passes:
            if not intervals:
                continue
            if isinstance(end_of_backward, torch.cuda.Event):
                end_of_backward.synchronize()
                intervals[-1][1].synchronize()
                origin = intervals[0][0]
                spans = [(origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3, blocking)
                         for a, b, blocking in intervals]
                backward = origin.elapsed_time(end_of_backward) / 1e3
            else:
                spans = [(a, b[0], blocking) for a, b, blocking in intervals if b[0] is not None]
                backward = end_of_backward
            exposed += sum(b - a for a, b, blocking in spans if blocking)
            spans = [(a, b) for a, b, _ in spans]
            busy, last = 0.0, None
            for a, b in sorted(spans):
                a = a if last is None else max(a, last)
                if b > a:
                    busy += b - a
                last = b if last is None else max(last, b)
            comm += busy
            exposed += max(0.0, max(b for _, b in spans) - backward) if spans else 0.0
            passes += 1
        self._passes = []
        exposed = min(exposed, comm)
        return {"comm_s": comm, "exposed_s": exposed, "hidden_s": comm - exposed,
                "hidden_fraction": (comm - exposed) / comm if comm > 0 else 0.0, "passes": passes}


class CommTiming:
    """DDP's measurement of its own communication (with ``measure_overlap=True``): the wait after
    backward per pass (`pop_exposed_comm_seconds`) and the hidden share (`pop_overlap_stats`, through
    `OverlapTimeline`). A mixin of `DDP`, which owns ``measure_overlap``, ``_buckets``, ``_overlap`` and
    the ``_comm_*`` counters it reads and resets."""

    def _start_comm_timer(self):
        if not self.measure_overlap:  # nobody will read it: keep the hot path free of events
            return None
        if self._buckets and self._buckets[0].buffer.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _stop_comm_timer(self, start) -> None:
        if start is None:
            return
        if isinstance(start, float):
            self._comm_host_seconds += time.perf_counter() - start
            self._comm_count += 1
        else:
            _close_span(start, self._comm_events)

    def _add_blocking_comm(self, start) -> None:
        """A bucket reducer that communicated inside its call (ring / tree / hierarchical patterns, which
        return completed work) from `start` (`_start_comm_timer`) to now: communication that the
        backward waited for, added to the pass's exposed time (`_stop_comm_timer` times only the wait
        after backward). Without it a rank's wait for a slow peer inside those calls was counted as its
        own work, and the straggler check named no one, or a fast rank."""
        if isinstance(start, float):
            self._comm_host_seconds += time.perf_counter() - start
        else:
            _close_span(start, self._comm_blocking_events)

    def pop_exposed_comm_seconds(self) -> tuple[float, int]:
        """(seconds, backward passes) of communication left exposed since the last call: the time the
        compute stream (or, on CPU, the host) waited for buckets after backward's last gradient
        (needs ``measure_overlap=True``).

        On CUDA this waits for the recorded events: call it when logging, not every step."""
        seconds, count = self._comm_host_seconds, self._comm_count
        for start, end in self._comm_events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
            count += 1
        for start, end in self._comm_blocking_events:  # (within the passes counted)
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self._comm_host_seconds, self._comm_count, self._comm_events = 0.0, 0, []
        self._comm_blocking_events = []
        return seconds, count

    def pop_overlap_stats(self) -> dict[str, float]:
        """How much bucket communication backward hid, over the backward passes since the last call
        (needs ``measure_overlap=True``): ``comm_s`` (time some bucket was on the wire), ``exposed_s``
        (of it, after backward's last gradient), ``hidden_s`` and ``hidden_fraction``, ``passes``.
        On CUDA this waits for the recorded events: call it when logging, not every step."""
        return self._overlap.pop()


def _close_span(start: torch.cuda.Event, spans: list, keep: int = 4096) -> None:
    """End a span begun by the CUDA event `start` now, on the current stream, and keep it in `spans`
    (a bounded recent window: nobody may be reading them)."""
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    spans.append((start, end))
    if len(spans) > keep:
        del spans[:keep // 2]
