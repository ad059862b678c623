"""What takes a log step off the training thread: the record, the device-to-host copy, the writer thread.

On a log step the training thread fills a `LogRecord` with what it has on the host, queues one
asynchronous copy of the values still on a GPU into pinned memory (`copy_to_host`, which returns the
CUDA event after which the copy may be read), and hands the record to a `WriterThread`. The thread
writes records in the order it got them, through the function it was given (`Monitor._write`: wait
for the record's event, read the system figures, write TensorBoard and JSONL, draw the bar). An error
it meets is kept in `WriterThread.error` for the training thread to raise; records handed over after
it are dropped until that error has been taken (`take_error`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import queue
import threading
import warnings
import weakref
from typing import Any, Callable

import torch

from .cluster import StragglerWarning

__all__ = ["LogRecord", "WriterHandling", "WriterThread", "copy_to_host", "json_line"]


def json_line(record: dict[str, Any]) -> str:
    """One line of ``metrics.jsonl`` / ``eval.jsonl``: strict JSON, so a value that is not a finite
    number (a NaN loss, an infinite gradient norm) is written as ``null``; ``json.dumps`` alone writes
    ``NaN`` / ``Infinity``, which Python reads but jq, JavaScript and most JSON tools refuse."""
    return json.dumps(_finite_or_null(record), allow_nan=False) + "\n"


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


class LogRecord:
    """One log step on its way to the files: what the training thread took at the step, and where the
    values that the device still has to deliver will land."""

    __slots__ = ("step", "now", "scalars", "perf", "device_tags", "values", "ready", "gathered", "times", "rate")

    def __init__(self, step: int, now: float) -> None:
        self.step = step
        self.now = now                                 # time.time() of the step, the records' walltime
        self.scalars: dict[str, float | None] = {}     # the metrics by tag, None where still on the device
        self.perf: dict[str, float] = {}               # the window's timings
        self.device_tags: list[str] = []               # tags whose values come first in `values`
        self.values: torch.Tensor | None = None        # pinned host copy of the device's values
        self.ready: Any = None                         # CUDA event: `values` is complete
        self.gathered = 0                              # the last `gathered` values are the ranks' step times
        self.times: list[float] | None = None          # the ranks' step times, read on the host (gloo)
        self.rate: float | None = None                 # steps per second since the previous log step


def copy_to_host(values: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """Queue one copy of CUDA `values` (0-dim metrics and 1-dim buffers, any dtype) into pinned host
    memory, as float64 (which holds every fp32, bf16 and fp16 value, and integers to 2**53, exactly);
    return it and the CUDA event after which it may be read. Nothing here waits for the device."""
    device = values[0].device
    flat = torch.cat([v.reshape(-1).to(device=device, dtype=torch.float64) for v in values])
    host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    ready = torch.cuda.Event(blocking=True)  # the writer sleeps while it waits, rather than spin on a core
    ready.record(torch.cuda.current_stream(device))
    return host, ready


class WriterThread:
    """A daemon thread that passes each record handed to it to `write`, in order, one at a time.

    Started on construction. `put` blocks once `max_waiting` records wait (a slow disk): the training
    thread then waits for the writer rather than pile up records. `join` waits until everything handed
    over is written; `stop` does so and ends the thread (`thread` is None afterwards).
    """

    def __init__(self, write: Callable[[LogRecord], None], *, name: str, max_waiting: int = 8) -> None:
        self._write = write
        self._queue: queue.Queue = queue.Queue(maxsize=max_waiting)
        self.error: BaseException | None = None  # the first error `write` raised, until taken
        self.thread: threading.Thread | None = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, record: LogRecord) -> None:
        self._queue.put(record)

    def busy(self) -> bool:
        """Whether records handed over are still unwritten (a record written now must wait its turn)."""
        return self._queue.unfinished_tasks > 0

    def join(self) -> None:
        """Wait until every record handed over has been written (or dropped after an error)."""
        self._queue.join()

    def take_error(self) -> BaseException | None:
        """The error the thread met, if any; the thread writes the records handed over after this call."""
        err, self.error = self.error, None
        return err

    def stop(self) -> None:
        """Write what is left, then end the thread. Safe to call more than once."""
        thread, self.thread = self.thread, None
        if thread is not None:
            self._queue.join()
            self._queue.put(None)
            thread.join()

    def _loop(self) -> None:
        while True:
            record = self._queue.get()
            try:
                if record is None:
                    return
                if self.error is None:
                    self._write(record)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                self.error = err
            finally:
                self._queue.task_done()


class WriterHandling:
    """`Monitor`'s side of its writer thread: started by the first record handed over, drained before a
    file is written out of turn, stopped at close; what it found (straggler messages, an error) raised
    on the training thread. Uses the monitor's ``rank``, ``rank_dir``, ``_bar`` and ``_warnings``."""

    _writer_thread: WriterThread | None

    @property
    def _thread(self) -> threading.Thread | None:
        """The writer thread while it runs (None before the first hand-over and after `close`)."""
        writer = self._writer_thread
        return writer.thread if writer is not None else None

    def _hand_to_writer(self, record: LogRecord) -> None:
        if self._writer_thread is None:
            self._writer_thread = WriterThread(self._write, name=f"monitor-writer-rank{self.rank}")
            # A script that ends without closing the monitor still gets its last records written.
            self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
            atexit.register(self._at_exit)
        self._writer_thread.put(record)

    def _busy(self) -> bool:
        """Whether the writer still holds records (a record written now must wait its turn)."""
        return self._writer_thread is not None and self._writer_thread.busy()

    def _drain(self, stacklevel: int = 3) -> None:
        """Wait until the writer has written everything handed to it; raise what it found."""
        if self._writer_thread is not None:
            self._writer_thread.join()
        self._surface(stacklevel + 1)

    def _surface(self, stacklevel: int = 3) -> None:
        """On the training thread: warn of the stragglers the writer found, raise the error it met.
        `stacklevel` as `warnings.warn` counts it from here (3: the caller of the public method that
        called this one directly)."""
        while self._warnings:
            message = self._warnings.pop(0)
            with self._bar.lifted() if self._bar is not None else contextlib.nullcontext():
                warnings.warn(message, StragglerWarning, stacklevel=stacklevel)
        err = self._writer_thread.take_error() if self._writer_thread is not None else None
        if err is not None:
            raise RuntimeError(f"the monitor could not write its log under {self.rank_dir}: {err}") from err

    def _stop_writer(self) -> None:
        if self._writer_thread.thread is not None:
            atexit.unregister(self._at_exit)
            self._writer_thread.stop()


def _close_at_exit(ref: "weakref.ReferenceType[WriterHandling]") -> None:
    monitor = ref()
    if monitor is not None:
        try:
            monitor.close()
        except Exception:  # noqa: BLE001 - the interpreter is exiting: nobody to tell
            pass
