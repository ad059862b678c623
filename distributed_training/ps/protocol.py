"""The messages between workers and servers, on torch.distributed point-to-point over gloo.

A request (worker -> server) is an int64 header ``[kind, worker, step, n_values, n_indices, weight]`` sent with
tag `HEADER`, then, when not empty, an fp32 values tensor (tag `VALUES`) and an int64 indices tensor (tag
`INDICES`). A server reads each worker's stream on a thread of its own (header, then payload, from that
worker's rank); distinct tags keep a header from ever matching a payload. A reply (server -> worker, to a
pull) is ``[version, n_values, lost_worker, lost_step]`` (tag `REPLY`) then the values (tag
`REPLY_VALUES`); ``lost_worker`` is -1, or, under ``sync``, the worker whose death ended the training
(the worker raises `WorkerLostError`).

Messages travel on a `ProcessGroup` object directly (``pg.send`` / ``pg.recv``, ranks of that group):
the job's gloo group, or, for a worker that rejoined after a restart, a group of its own with the servers
(servers at ranks ``0 .. S - 1``, the worker at rank ``S``; see `distributed_training.ps.rejoin`), which
`torch.distributed` never registers.

A rejoining worker's first request is `Kind.JOIN`; its reply's header is ``[version, 0, -1, pushed]``:
the server's version and the steps the worker had pushed before it was lost.

A worker told of a lost worker (``sync``) sends every server `Kind.LEAVE` (not answered) before it raises,
so that each server's thread reading it returns instead of staying blocked in a receive that nothing will
ever complete (at the interpreter's exit, such a thread aborted the process).

Indices of sparse tables travel as ``[count of each sparse piece of that server..., rows...]``, rows local
to the piece; a count of -1 means "all rows" (the whole piece moves, as a dense one).

Deadlock freedom: a worker posts its receives before its sends, and sends without blocking; a server
only ever blocks to receive (a header, or a payload already posted by its sender) and replies with
non-blocking sends that it completes later (`Outbox`). See docs/parameter_server.md.

A push's ``weight`` (float64 bits in the int64 header; -1: none) is what its worker's batch counts (kept
targets, or rows) where the trainer knows it: under ``sync`` a step's update weighs each worker's gradient
by it, as data parallelism weighs its replicas.
"""

from __future__ import annotations

import enum
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["STOP_WORKER", "Kind", "HEADER", "VALUES", "INDICES", "REPLY", "REPLY_VALUES", "HEADER_LEN", "REPLY_LEN",
           "WorkerLostError", "ServerLostError", "gloo_group", "process_group", "Outbox", "send_request", "recv_request", "recv_reply",
           "close_connections"]

HEADER, VALUES, INDICES, REPLY, REPLY_VALUES = 1001, 1002, 1003, 1004, 1005
CLOSE = 1099  # never sent: a receive on it only times out (`close_connections`)
HEADER_LEN = 6
#: A reply's ``lost_worker`` when no worker is lost but the server got a signal (``lost_step``: its
#: number): the workers stop at an agreed step, as if they had got it (`fit` saves on SIGTERM).
STOP_WORKER = -2
REPLY_LEN = 4


class WorkerLostError(RuntimeError):
    """A worker's process is gone and the training cannot go on without it (``consistency="sync"``).

    Attributes:
        worker: the lost worker's index (its rank is ``num_servers + worker``).
        step: the step it was computing (the steps it had pushed).
    """

    names_lost_peer = True  # the trainer raises it as it is (no wait for its peer watch's verdict)

    def __init__(self, message: str, worker: int, step: int) -> None:
        super().__init__(message)
        self.worker, self.step = worker, step

    @classmethod
    def of(cls, worker: int, rank: int, step: int, seen_by: str) -> "WorkerLostError":
        return cls(f"parameter server: worker {worker} (rank {rank}) is lost at step {step} (its connection "
                   f"closed: the process died or its training raised, which its own output says; {seen_by}); consistency='sync' needs every worker's gradient of "
                   "every step, so the training stops (ssp and async drop a lost worker and go on)", worker, step)

    @classmethod
    def of_every(cls, lost: list[tuple[int, int, int]], seen_by: str) -> "WorkerLostError":
        """Every worker is lost, none having finished (ssp / async: nobody is left to go on without them);
        `lost`: (worker, rank, step) of each, in the order found. Names the first."""
        said = ", ".join(f"worker {w} (rank {r}) at step {s}" for w, r, s in lost)
        worker, _, step = lost[0]
        return cls(f"parameter server: every worker is lost before finishing its training ({said}; {seen_by}): "
                   "their processes died or their training raised, which their own output says", worker, step)


class ServerLostError(RuntimeError):
    """A server's process is gone: the parameters it held (and their optimizer state) went with it, under
    any consistency. Raised by the workers that find it (a failed message to or from it).

    Attributes:
        server: the lost server's index (its rank).
        step: the step the worker that raised was computing.
    """

    names_lost_peer = True  # the trainer raises it as it is (no wait for its peer watch's verdict)

    def __init__(self, message: str, server: int, step: int) -> None:
        super().__init__(message)
        self.server, self.step = server, step

    @classmethod
    def of(cls, server: int, step: int, seen_by: str) -> "ServerLostError":
        return cls(f"parameter server: server {server} (rank {server}) is lost at step {step} (its connection "
                   f"closed: the process died or its network failed; {seen_by}); its shard of the parameters and "
                   "their optimizer state went with it, so the training stops: start the job again (from its "
                   "last save_state, if any)", server, step)


class Kind(enum.IntEnum):
    PUSH = 1    # gradients of a step: values (+ rows of sparse pieces)
    PULL = 2    # parameters for a step: (rows of sparse pieces); answered with a reply
    FINAL = 3   # this worker has pushed its last step; answered once every worker has finished
    DONE = 4    # this worker leaves; acknowledged once every worker has
    JOIN = 5    # a restarted worker is back (on a group of its own); answered with the version and its steps
    LEAVE = 6   # (sync) this worker was told of a lost worker and stops; not answered, nothing follows


def gloo_group() -> dist.ProcessGroup | None:
    """The group the messages travel on: None (the default group) when it is gloo, else a new gloo group
    over all ranks (collective: every rank calls it)."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def process_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The `ProcessGroup` object of `group` (None: the default group)."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def close_connections(pg: dist.ProcessGroup, src: int) -> None:
    """Close this rank's connections on `pg` (all of them, not only the one to rank `src`), so that every
    receive blocked on them raises at once.

    gloo has no call for it (``abort`` / ``shutdown`` leave a blocked receive blocked); but a receive
    whose wait times out closes the connections ("Application timeout caused pair closure"), and a
    receive on a tag nobody sends (`CLOSE`) can only time out. The group is of no use afterwards on
    this rank: a last resort, for a server that ends while a worker it has told to stop still says
    nothing."""
    try:
        pg.recv([torch.empty(1)], src, CLOSE).wait(timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the expected timeout (or the connection had already failed)


def _weight_bits(weight: float | None) -> int:
    return int(torch.tensor([-1.0 if weight is None else float(weight)], dtype=torch.float64).view(torch.int64))


def send_request(pg: dist.ProcessGroup, dst: int, kind: Kind, worker: int, step: int,
                 values: torch.Tensor | None, indices: torch.Tensor | None, weight: float | None = None) -> list:
    """Post a request's messages to rank `dst` of `pg` without blocking; returns the work handles (keep
    the tensors alive until they complete)."""
    n_values = 0 if values is None else values.numel()
    n_indices = 0 if indices is None else indices.numel()
    header = torch.tensor([int(kind), worker, step, n_values, n_indices, _weight_bits(weight)], dtype=torch.int64)
    works = [pg.send([header], dst, HEADER)]
    if n_values:
        works.append(pg.send([values], dst, VALUES))
    if n_indices:
        works.append(pg.send([indices], dst, INDICES))
    return works


def recv_request(pg: dist.ProcessGroup, src: int) -> tuple[Kind, int, int, torch.Tensor | None, torch.Tensor | None,
                                                            float | None]:
    """Block for the next request from rank `src` of `pg`: ``(kind, worker, step, values, indices, weight)``.
    Raises when `src`'s connection closes (gloo: "Connection closed by peer"); a receive from any source
    would not (it waits for the others), which is why a server reads each worker on a thread of its own."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    pg.recv([header], src, HEADER).wait()
    weight = float(header[5:].view(torch.float64))
    kind, worker, step, n_values, n_indices, _ = header.tolist()
    values = indices = None
    if n_values:
        values = torch.empty(n_values, dtype=torch.float32)
        pg.recv([values], src, VALUES).wait()
    if n_indices:
        indices = torch.empty(n_indices, dtype=torch.int64)
        pg.recv([indices], src, INDICES).wait()
    return Kind(kind), worker, step, values, indices, (None if weight < 0 else weight)


def recv_reply(pg: dist.ProcessGroup, src: int, n_values: int) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Post the receives of a reply from rank `src` of `pg` carrying `n_values` values: ``(works, header,
    values)``; the header is ``[version, n_values, lost_worker, lost_step]`` once the works complete."""
    header, values = torch.empty(REPLY_LEN, dtype=torch.int64), torch.empty(n_values)
    works = [pg.recv([header], src, REPLY)]
    if n_values:
        works.append(pg.recv([values], src, REPLY_VALUES))
    return works, header, values


class Outbox:
    """A server's replies in flight: non-blocking sends whose tensors are kept until they complete,
    by worker."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, object, tuple[torch.Tensor, ...]]] = []  # (worker, work, tensors)
        self._abandoned: list[tuple[int, object, tuple[torch.Tensor, ...]]] = []

    def reply(self, worker: int, pg: dist.ProcessGroup, dst: int, version: int, values: torch.Tensor,
              lost: tuple[int, int] = (-1, -1)) -> None:
        """Send `worker` (rank `dst` of `pg`) a reply without blocking."""
        header = torch.tensor([version, values.numel(), *lost], dtype=torch.int64)
        works = [pg.send([header], dst, REPLY)]
        if values.numel():
            works.append(pg.send([values], dst, REPLY_VALUES))
        self._pending.extend((worker, w, (header, values)) for w in works)
        self._pending = [p for p in self._pending if not p[1].is_completed()]

    def forget(self, worker: int) -> None:
        """Never wait for the replies to `worker` (lost): they can only fail. Their tensors stay
        referenced, since gloo may still hold the buffers."""
        # Those whose sends have ended (failed or not) let go of their buffers now.
        self._abandoned = [p for p in self._abandoned if not p[1].is_completed()]
        self._abandoned += [p for p in self._pending if p[0] == worker]
        self._pending = [p for p in self._pending if p[0] != worker]

    def flush(self) -> None:
        for _, work, _ in self._pending:
            work.wait()
        self._pending.clear()
