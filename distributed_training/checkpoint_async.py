"""Checkpoints written in the background (``DistributedTrainer(checkpoint_async=True)``).

At a checkpoint step each rank takes a *snapshot* of what it saves (its pieces of the parameters and
optimizer state, RNG streams, buffers, per-rank strategy state, and on a directory's writer the
contents of ``meta.pt`` but its checksums) into host memory, and hands the snapshot to one
background thread, which writes it with the same crash-proof steps as a synchronous save
(`distributed_training.checkpoint`: a temporary name, fsync, rename, ``meta.pt`` last) and prunes old
checkpoints. Training goes on meanwhile. What remains synchronous is queueing the copies to host
memory and publishing what this rank holds in the rendezvous store (a synchronous save all-gathers it).

On CUDA the copies go into pinned host buffers, allocated at the first checkpoint and reused (pinning
memory is slow). The parameters' and optimizer state's copies are issued together on a side stream
that waits for the checkpoint step's kernels, so they overlap the next step's forward and backward;
the optimizer's next ``step`` (which changes them) waits for the copies on the device first, through a
one-shot step pre-hook (`HostStaging`). Buffers (changed by the next forward) and the step's metrics
are copied on the compute stream at once. The snapshot itself never waits for the device (an optimizer
scalar such as a fused Adam's ``step`` is staged too, not read with ``.cpu()``, and the metrics are
read by the writer thread), and it runs no collective (``all_gather_object`` would read its result on
the host, waiting for every queued kernel). The writer thread waits on an event recorded behind the
copies before it reads a byte.

The write holds the GIL as little as it can (a training thread that dispatches operators from Python
needs it all the time): `torch.save` streams straight into the file (`checkpoint.atomic_save`), so
only the skeleton (names, shapes, storage keys) is pickled under the GIL; each tensor's bytes are
handed over as a memoryview of the pinned buffer, hashed (``hashlib`` releases the GIL on large
buffers) and written (``FileIO.write`` releases it too), never copied in memory.

``meta.pt`` lists the SHA-256 of every rank's file, which is known only once that rank's thread has
serialised it. The threads do not run collectives (they would race the training thread's); each rank
publishes its summary and its digest under keys of this checkpoint's own in the rendezvous store
(`DigestExchange`), and each directory's writer (rank 0, or each node's first rank with a directory per
node) waits for every rank's before writing ``meta.pt``. A rank whose write
fails publishes the error instead, so the writer gives up at once, naming it.

What holds, as for a synchronous save: a checkpoint counts only once its ``meta.pt`` is written and
every file matches its checksum, so a write interrupted at any point (an error, the process killed)
is never taken for the latest good checkpoint; the previous one is. At most one write is in flight: the
next checkpoint waits for the previous one first (and says so). An error of the writer thread is
raised by the trainer on its next step, at the next checkpoint, or in `close`, naming the file.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import queue
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["CheckpointWriteError", "HostStaging", "host_copy", "DigestExchange", "BackgroundWrite"]

#: How long a directory's writer waits for the other ranks' digests before giving up (a rank that died
#: fails the training thread's next collective long before this).
PEER_TIMEOUT_S = 1800.0


class CheckpointWriteError(RuntimeError):
    """A checkpoint written in the background could not be completed; the message names the file."""


class _Abandoned(Exception):
    """The training thread gave the write up (an error in training): stop quietly."""


# ------------------------------------------------------------------ snapshot
class HostStaging:
    """Copies of device tensors in host memory for one snapshot at a time.

    CPU tensors are cloned. A CUDA tensor gets a pinned buffer (the i-th tensor of a snapshot the
    i-th buffer, allocated at the first snapshot and reused while its shape and dtype match) and its
    copy is *deferred*: `ready` issues all of them at once (`torch._foreach_copy_`, non-blocking) on a
    side stream that first waits for everything queued so far on the current (compute) stream, so the
    copies read the state of the checkpoint step while the next step's forward and backward run. The
    compute stream must not change what they read before they are done: `guard` makes the optimizer's
    next ``step`` (what changes parameters and optimizer state) wait for them on the device first, and
    `fence` makes the compute stream wait for them at once (e.g. before a load). Tensors that change
    before the next optimizer step (BatchNorm's running statistics, updated by the forward) go through
    `now` instead: copied at once, on the current stream (its later kernels run after the copy).
    `ready` returns an event behind all of the snapshot's copies, which the writer waits for before it
    reads a byte. A snapshot's buffers are reused by the next one, so the next snapshot must wait until
    the previous write is done (the trainer keeps one write in flight at most).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._cuda = False
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device source, pinned buffer)
        self._stream: "torch.cuda.Stream | None" = None
        self._copied: "torch.cuda.Event | None" = None  # behind the side stream's copies, until fenced
        self._sources: list[torch.Tensor] = []  # kept alive until the compute stream waits for the copies
        self._hook = None

    def begin(self) -> None:
        self.fence()
        self._next, self._cuda, self._pending = 0, False, []

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if i == len(self._buffers):
            self._buffers.append(torch.empty(0))
        buffer = self._buffers[i]
        if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[i] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor`, taken when `ready` is called (see the class)."""
        tensor = tensor.detach()
        if not tensor.is_cuda:
            return tensor.cpu().clone(memory_format=torch.contiguous_format)
        buffer = self._buffer(tensor)
        self._pending.append((tensor, buffer))
        return buffer

    def now(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` taken on the current stream, before anything queued after it."""
        tensor = tensor.detach()
        if not tensor.is_cuda:
            return tensor.cpu().clone(memory_format=torch.contiguous_format)
        buffer = self._buffer(tensor)
        buffer.copy_(tensor, non_blocking=True)
        self._cuda = True
        return buffer

    def ready(self, optimizer: "torch.optim.Optimizer | None" = None) -> "torch.cuda.Event | None":
        """Issue the deferred copies; an event behind every copy of this snapshot (None when there were
        none). With `optimizer`, its next ``step`` waits for the copies (`guard`)."""
        if not self._cuda and not self._pending:
            return None
        event = torch.cuda.Event()
        if not self._pending:
            event.record()
            return event
        compute = torch.cuda.current_stream(self._pending[0][0].device)
        if self._stream is None or self._stream.device != compute.device:
            self._stream = torch.cuda.Stream(device=compute.device)
        side = self._stream
        side.wait_stream(compute)  # the checkpoint step's kernels (and the `now` copies) come first
        sources, buffers = [t for t, _ in self._pending], [b for _, b in self._pending]
        with torch.cuda.stream(side):
            try:
                torch._foreach_copy_(buffers, sources, non_blocking=True)
            except (RuntimeError, NotImplementedError):  # no foreach kernel for this mix: one by one
                for buffer, source in zip(buffers, sources):
                    buffer.copy_(source, non_blocking=True)
        event.record(side)
        self._pending, self._sources, self._copied = [], sources, event
        if optimizer is not None:
            self.guard(optimizer)
        return event

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer`'s next ``step`` fence the copies first (once)."""
        if self._copied is not None and self._hook is None:
            if not hasattr(optimizer, "register_step_pre_hook"):  # not a torch optimizer: no overlap, but safe
                self.fence()
                return
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.fence())

    def fence(self) -> None:
        """Make the current stream wait for the side stream's copies (on the device; the host goes on),
        then let go of their sources."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._copied is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._copied)
            self._copied, self._sources = None, []


def host_copy(value: Any, to_host: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with every tensor copied by `to_host` and every container rebuilt, so that training can
    go on changing the original (a scheduler's lists, a strategy's residuals) while the copy is written."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value):
        return to_host(value)
    if isinstance(value, dict):
        return {k: host_copy(v, to_host) for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v, to_host) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(host_copy(v, to_host) for v in value)
    return value  # numbers, strings, None, named tuples of plain values: not changed in place


def serialize(obj: Any) -> bytes:
    """`obj` as `torch.save` writes it, in memory (the background writer streams to the file instead:
    `checkpoint.atomic_save`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------ digests
class DigestExchange:
    """What the directory's writer needs from every rank for the checkpoint being written, through the
    rendezvous store: each rank's summary of what it holds (published by the training thread at the
    snapshot) and its file's digest (published by its writer thread once the file is written).

    Keys of their own for each checkpoint (its token, the same on every rank and never reused), rank
    and kind: a rank may snapshot the next checkpoint before a slow writer has read its values for this
    one. A digest is ``"!<error>"`` when the rank's write failed. Each rank deletes its keys of the
    checkpoint before the previous one when it publishes (`forget`): by then every writer has read them
    (a writer's training thread waits for its write before the next snapshot, and no rank gets two
    checkpoints ahead of another), so nothing accumulates in the store.
    """

    PREFIX = "distributed_training/checkpoint_digest/"
    SUMMARY = "distributed_training/checkpoint_summary/"

    def __init__(self, store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._mine: str | None = None
        self._summary: Any = None

    def publish(self, token: str, digest: str) -> None:
        if self.store is None:
            self._mine = digest
            return
        self.store.set(f"{self.PREFIX}{token}/{self.rank}", digest)

    def forget(self, token: str) -> None:
        """Delete this rank's keys of an earlier checkpoint (`token`)."""
        if self.store is not None:
            for prefix in (self.PREFIX, self.SUMMARY):
                try:
                    self.store.delete_key(f"{prefix}{token}/{self.rank}")
                except Exception:  # a store without delete_key: the keys stay (small)
                    pass

    def publish_summary(self, token: str, value: Any) -> None:
        """This rank's (picklable) summary of what it holds."""
        if self.store is None:
            self._summary = value
            return
        self.store.set(f"{self.SUMMARY}{token}/{self.rank}", pickle.dumps(value))

    def publish_error(self, token: str, message: str) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{self.PREFIX}{token}/{self.rank}", f"!{message}")
            except Exception:  # the store is gone too: the writer will time out, or the job is ending
                pass

    def collect(self, token: str, path: str, stop: threading.Event, timeout: float = PEER_TIMEOUT_S) -> list[str]:
        """Every rank's digest for checkpoint `path`, in rank order, once all are published."""
        if self.store is None:  # one rank
            return [self._mine]

        def parse(rank: int, value: bytes) -> str:
            text = value.decode()
            if text.startswith("!"):
                raise CheckpointWriteError(f"checkpoint {path!r} is incomplete: rank {rank} failed to write its "
                                           f"file: {text[1:]}")
            return text

        return self._collect(self.PREFIX, token, path, stop, timeout, parse, "write their files")

    def collect_summaries(self, token: str, path: str, stop: threading.Event,
                          timeout: float = PEER_TIMEOUT_S) -> list[Any]:
        """Every rank's summary for checkpoint `path`, in rank order."""
        if self.store is None:
            return [self._summary]
        return self._collect(self.SUMMARY, token, path, stop, timeout, lambda rank, value: pickle.loads(value),
                             "say what they hold")

    def _collect(self, prefix: str, token: str, path: str, stop: threading.Event, timeout: float,
                 parse: Callable[[int, bytes], Any], what: str) -> list[Any]:
        found: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pause = 0.002
        while True:
            for rank in range(self.world_size):
                if rank in found:
                    continue
                key = f"{prefix}{token}/{rank}"
                if not self.store.check([key]):
                    continue
                found[rank] = parse(rank, self.store.get(key))
            if len(found) == self.world_size:
                return [found[r] for r in range(self.world_size)]
            if stop.is_set():
                raise _Abandoned()
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in found]
                raise CheckpointWriteError(f"checkpoint {path!r} is incomplete: rank(s) {missing} did not {what} "
                                           f"within {timeout:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


# ------------------------------------------------------------------ the thread
class BackgroundWrite:
    """One checkpoint being written in the background: ``job(stop)`` runs on the process's writer
    thread; `stop` is set by `abandon`, and the job checks it between files (a file being written is
    finished or removed, never left half-written under its final name)."""

    def __init__(self, step: int, path: str, job: Callable[[threading.Event], None]) -> None:
        self.step, self.path = step, path
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.seconds: float | None = None  # how long the write took, once done
        self._job = job
        self._finished = threading.Event()
        _writer_queue().put(self)

    def run(self) -> None:
        try:
            self._job(self.stop)
        except _Abandoned:
            pass
        except BaseException as err:  # kept for the training thread, which raises it
            self.error = err if isinstance(err, CheckpointWriteError) else CheckpointWriteError(
                f"writing checkpoint {self.path!r} (step {self.step}) in the background failed: "
                f"{type(err).__name__}: {err}")
            if self.error is not err:
                self.error.__cause__ = err
        finally:
            self._job = None  # the snapshot can go
            self.seconds = time.perf_counter() - self.started
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> None:
        self._finished.wait()

    def abandon(self) -> None:
        """Stop the write at the next file boundary and wait for it (a file being written is finished;
        the checkpoint stays without ``meta.pt`` unless it was already complete)."""
        self.stop.set()
        self._finished.wait()

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


_queue: "queue.SimpleQueue[BackgroundWrite] | None" = None
_queue_lock = threading.Lock()


def _writer_queue() -> "queue.SimpleQueue[BackgroundWrite]":
    """The queue of the process's checkpoint writer thread, started on first use and kept (a daemon:
    starting a thread per checkpoint would make the training thread wait for it to start). Writes run
    in order, one at a time."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_queue,), name="dtrain-checkpoint-writer", daemon=True).start()
        return _queue


def _serve(jobs: "queue.SimpleQueue[BackgroundWrite]") -> None:
    while True:
        jobs.get().run()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def default_store():
    """The rendezvous store of the default process group (None on a world of one or without one)."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank}.pt")
