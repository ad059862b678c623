"""Stopping a training loop cleanly on SIGINT (Ctrl-C), SIGTERM (preemption) and SIGHUP (the terminal
closed, an ssh session dropped), with every rank agreeing.

A signal may reach only some ranks (one process killed by hand, a node drained) or reach them while
they are at different steps. A rank that simply stopped would leave its peers waiting in the next
collective until the timeout, and a rank interrupted in the middle of a checkpoint write would leave
a half-written file. So the handlers only record the signal; at each step boundary the ranks
all-reduce (MAX) what they have received, and stop together at the step where any of them had.
Ranks that never meet (`DistributedContext.independent`: a parameter server's workers under ssp /
async) each stop on the signal they got, at their own step.

The all-reduce of step k is started without waiting and read at step k + 1's boundary, so the host
never waits for the device's current step: a signal stops the loop one or two steps after it arrives.

A second Ctrl-C that reaches the process, `AGAIN_AFTER_S` or more after the first, raises
`KeyboardInterrupt` at once: a step stuck in a data loader or a peer never reaches the boundary. (A
launcher that forwards the signal to workers still in the terminal's process group delivers one press
twice within milliseconds: that is still one.) torchrun starts its workers in sessions of their own and
forwards one signal only: there a second Ctrl-C stops torchrun, which then ends its workers itself.

Python runs a signal's handler only between bytecodes of the main thread, so a main thread inside one
long call of native code (a collective waiting for a peer, a long backward) would hear neither press
until it returned (a trial: two presses during a 12 s step, the first said at its end, then a clean stop).
So the C-level handler's wake-up byte (`signal.set_wakeup_fd`) is read by a thread of ours as the signal
arrives: a second press that the main thread has not acted on within `AGAIN_AFTER_S` ends the process
with status 130 (``os._exit``: no ``finally`` blocks, as a stop "at once" from inside native code has to
be), unless a checkpoint write is in progress, which the main thread finishes first as above.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from .logs import get_logger
from .runtime import DistributedContext

__all__ = ["StopSignals", "SAVING_SIGNALS", "finishing"]

log = get_logger(__name__)

# All-reduced as a MAX, so a signal that saves (SIGTERM, SIGHUP) wins over SIGINT (stop) when ranks got
# different ones.
_PRIORITY = {signal.SIGINT: 1, signal.SIGTERM: 2, signal.SIGHUP: 3}
#: The signals on which `fit` saves a checkpoint before it stops (with ``save_on_preemption``).
SAVING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Seconds after a first SIGINT from which another one raises KeyboardInterrupt at once.
AGAIN_AFTER_S = 1.0
_BY_PRIORITY = {code: sig for sig, code in _PRIORITY.items()}
# Synchronous checkpoint writes in progress on this thread (`checkpoint_writing`), and a second Ctrl-C that
# came during one: raised once it is complete (interrupted, it left an empty directory, exit status 1).
_writes = {"depth": 0, "interrupted": False}
_said = {"ignored_sigint": False}  # what this process has said once


@contextlib.contextmanager
def checkpoint_writing():
    """A synchronous checkpoint write: a second Ctrl-C during it raises `KeyboardInterrupt` once it is
    complete (and every rank's part with it), not in the middle."""
    _writes["depth"] += 1
    interrupted = False
    try:
        yield
    finally:
        _writes["depth"] -= 1
        if _writes["depth"] == 0:  # (cleared even when the write failed: a later write must not raise it)
            interrupted, _writes["interrupted"] = _writes["interrupted"], False
    if interrupted:  # (only after a write that completed: a failed one raises its own error)
        raise KeyboardInterrupt("Ctrl-C pressed twice: stopped at once after the checkpoint write it came during")


def _under_torchrun() -> bool:
    """A torchrun worker: torchrun forwards a first Ctrl-C as SIGINT and answers a second with SIGTERM."""
    return "TORCHELASTIC_RESTART_COUNT" in os.environ


@contextlib.contextmanager
def finishing(what: str):
    """Work that ends a run after its training (dtrain's final evaluation and outputs): SIGTERM and SIGHUP
    (a preemption's) that arrive during it are held until it is complete. Yields the list of signals held,
    for the caller to act on once it has also closed (`SystemExit(128 + signal)`, as `fit` does). Stopped
    half-way, the run would hold its last checkpoint but not the model file it promised. Only signals at
    their default action are held (an ignored one stays ignored, a handler of one's own stays in place);
    outside the main thread (no handlers there), a plain block."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum, frame) -> None:
        if not held:
            log.warning("%s received during %s: it completes first, then the process stops",
                        signal.Signals(signum).name, what)
        held.append(signum)

    before = {sig: signal.signal(sig, hold) for sig in SAVING_SIGNALS if signal.getsignal(sig) is signal.SIG_DFL}
    try:
        yield held
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class StopSignals:
    """Within ``with``: SIGINT, SIGTERM and SIGHUP set a flag instead of interrupting (a second Ctrl-C
    raises `KeyboardInterrupt` at once); `agreed()` at each step
    boundary says, identically on every rank, whether and on which signal to stop.

    Handlers are installed only in the main thread (Python delivers signals there), only when every
    rank can install them (one all-reduce on entry, `every_rank`), never over a signal that was ignored
    (``SIG_IGN``), and the previous handlers are restored on exit. After a stop, `deliver()` hands the
    signal to the previous handler: Python's default turns SIGINT into `KeyboardInterrupt`; SIGTERM's
    and SIGHUP's default (terminate) becomes ``SystemExit(128 + signal)`` so that ``finally`` blocks and ``with``
    statements still run.
    """

    def __init__(self, context: DistributedContext, device: torch.device, every_rank: Callable[[bool], bool],
                 enabled: bool = True) -> None:
        self.context = context
        self.device = device if context.backend == "nccl" else torch.device("cpu")
        self.every_rank = every_rank
        self.enabled = enabled
        self.received = 0  # priority code of the strongest signal this rank got
        self.signal: signal.Signals | None = None  # what the ranks agreed to stop on
        self._previous: dict[signal.Signals, object] = {}
        self._pending = None
        self._first_interrupt: float | None = None  # when this rank's first SIGINT came
        self._wakeup: tuple[int, int, int] | None = None  # (read end, write end, the wake-up fd before ours)
        self._raised = False  # the main thread raised for a second press
        self._said_first = threading.Lock()  # taken by whichever hears the first press first (thread, handler)

    # ------------------------------------------------------------ handlers
    def __enter__(self) -> "StopSignals":
        main = threading.current_thread() is threading.main_thread()
        # A collective per step needs every rank: agree once whether all of them can take part.
        self.active = self.every_rank(self.enabled and main) if self.enabled else False
        if self.active:
            for sig in _PRIORITY:
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN:
                    if sig == signal.SIGINT and self.context.rank == 0 and not _said["ignored_sigint"]:
                        _said["ignored_sigint"] = True
                        log.info("SIGINT is ignored in this process (started as a background job of a script, or "
                                 "by a launcher that ignores it): Ctrl-C will not stop it; SIGTERM does")
                    continue  # the launcher wants this signal ignored (nohup, a background job): respect it
                self._previous[sig] = previous
                signal.signal(sig, self._record)
            if signal.SIGINT in self._previous:
                self._watch_presses()
        return self

    def _watch_presses(self) -> None:
        """Hear SIGINT as it arrives, in a thread of ours (see the module's docstring). Not where the
        process has a wake-up fd already (an asyncio loop's): it keeps it."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read), os.close(write)
            return
        if before != -1:
            signal.set_wakeup_fd(before)
            os.close(read), os.close(write)
            return
        self._wakeup = (read, write, before)
        threading.Thread(target=self._hear_presses, args=(read,), name="distributed_training-ctrl-c",
                         daemon=True).start()

    def _hear_presses(self, read: int) -> None:
        first = None
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                data = b""
            if not data:  # our write end closed (`restore`): the read end is this thread's to close
                os.close(read)
                return
            now = time.monotonic()
            if first is None:
                if signal.SIGINT in data:  # said now: the main thread may not run its handler for a whole step
                    first = now
                    self._say_first_press()
                continue
            # A second press; under torchrun the press reaches torchrun, which ends its workers with SIGTERM.
            terminated = signal.SIGTERM in data and _under_torchrun()
            if not terminated and (signal.SIGINT not in data or now - first <= AGAIN_AFTER_S):
                continue
            time.sleep(AGAIN_AFTER_S)  # the main thread's own handler, if it can run, raises meanwhile
            if self._raised or self._wakeup is None or _writes["depth"]:
                continue
            log.warning("Ctrl-C again while this rank is inside a long native call (a collective waiting for a "
                        "peer, a long backward): exiting now, with status 130")
            os._exit(130)

    def _record(self, signum, frame) -> None:
        # Only a flag: raising here could abandon a checkpoint write or a collective half done. But a
        # user who presses Ctrl-C again wants out now, whatever is stuck.
        sig = signal.Signals(signum)
        # Under torchrun a second Ctrl-C reaches torchrun, which ends its workers with SIGTERM: a second press
        # (elsewhere a SIGTERM after a SIGINT is a scheduler's escalation, which saves as any SIGTERM).
        again = sig == signal.SIGTERM and self._first_interrupt is not None and _under_torchrun()
        if sig == signal.SIGINT or again:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
                self._say_first_press()
            elif again or now - self._first_interrupt > AGAIN_AFTER_S:
                self.restore()
                if _writes["depth"] and threading.current_thread() is threading.main_thread():
                    if not _writes["interrupted"]:
                        log.warning("SIGINT again during a checkpoint write: stopping at once when it is complete")
                    _writes["interrupted"] = True
                    return
                self._raised = True
                raise KeyboardInterrupt("Ctrl-C pressed twice: stopped at once, not at a step boundary")
        self.received = max(self.received, _PRIORITY[sig])

    def _say_first_press(self) -> None:
        """Say the first Ctrl-C once, on rank 0 (every rank got it: a launcher forwards it)."""
        if self.context.rank == 0 and self._said_first.acquire(blocking=False):
            log.warning("SIGINT: stopping at the next step boundary, with the other ranks (press Ctrl-C again to "
                        "stop at once)")

    def request(self, sig: signal.Signals, why: str) -> None:
        """Stop as if `sig` had reached this rank (a parameter server's server got it: the workers stop,
        and save, with it); `why` is said once."""
        if _PRIORITY[sig] > self.received and self.context.rank == 0:
            log.warning("%s: stopping at the next step boundary", why)
        self.received = max(self.received, _PRIORITY[sig])

    def pending(self) -> signal.Signals | None:
        """The strongest signal this rank got so far (not yet agreed on), or None."""
        return _BY_PRIORITY.get(self.received)

    def __exit__(self, exc_type, *exc) -> None:
        self.restore()
        if exc_type is None:
            self._drain()
        # On an error, a pending all-reduce is abandoned: a peer may be gone, and waiting could hang.

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            _, write, before = wakeup
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(before)
            os.close(write)  # (the thread then reads the end of the pipe, and closes its read end)

    # ------------------------------------------------------------ agreement
    def agreed(self) -> signal.Signals | None:
        """At a step boundary, on every rank alike: the signal to stop on, or None to go on."""
        if not self.active or self.signal is not None:
            return self.signal
        if self._alone:
            code = self.received
        else:
            flag = torch.full((1,), self.received, dtype=torch.int32, device=self.device)  # no host-to-device copy
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.context.group, async_op=True)
            previous, self._pending = self._pending, _in_flight(work, flag)
            code = self._read(previous)
        self.signal = _BY_PRIORITY.get(code)
        return self.signal

    def finish(self) -> signal.Signals | None:
        """After the last step (and its checkpoint): a last, waited-for agreement, so a signal that
        arrived during the final steps is not acted on by some ranks only."""
        if not self.active or self.signal is not None:
            self._drain()
            return self.signal
        if self._alone:
            code = self.received
        else:
            code = max(self._drain(), self.received)
            flag = torch.full((1,), code, dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.context.group)
            code = int(flag.item())
        self.signal = _BY_PRIORITY.get(code)
        return self.signal

    @property
    def _alone(self) -> bool:
        """Whether this rank decides by itself: a world of one, or independent ranks (a parameter
        server's workers under ssp / async), each of which stops on the signal it got; a launcher's
        SIGTERM reaches every one of them anyway."""
        return self.context.world_size == 1 or self.context.independent

    def _drain(self) -> int:
        pending, self._pending = self._pending, None
        return self._read(pending)

    @staticmethod
    def _read(pending) -> int:
        if pending is None:
            return 0
        work, value, copied = pending
        if copied is not None:
            copied.synchronize()  # up to this flag's copy only: the steps queued after it keep running
        else:
            work.wait()
        return int(value[0])

    # ------------------------------------------------------------ after the stop
    def deliver(self) -> None:
        """Once the handlers are restored: pass the agreed signal on as if it had just arrived."""
        sig = self.signal
        if sig is None:
            return
        handler = signal.getsignal(sig)
        if callable(handler):
            handler(sig, None)  # Python's default for SIGINT raises KeyboardInterrupt; a user's own runs
            return
        raise SystemExit(128 + int(sig))


def _in_flight(work, flag: torch.Tensor):
    """(work, where the value will be, CUDA event or None) for a flag all-reduce just started. On CUDA
    the value is copied to pinned host memory behind the all-reduce, so reading it later waits for that
    copy alone, where ``flag.item()`` would wait for everything queued on the stream since."""
    if not flag.is_cuda:
        return work, flag, None
    work.wait()  # on CUDA, a stream-side wait: the copy below runs after the all-reduce; the host goes on
    host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return None, host, copied
