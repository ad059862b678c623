"""The messages between workers and servers, on torch.distributed point-to-point over gloo.

A request (worker -> server) is an int64 header ``[kind, worker, step, n_values, n_indices]`` sent with
tag `HEADER`, then, when not empty, an fp32 values tensor (tag `VALUES`) and an int64 indices tensor (tag
`INDICES`). A server reads each worker's stream on a thread of its own (header, then payload, from that
worker's rank); distinct tags keep a header from ever matching a payload. A reply (server -> worker, to a
pull) is ``[version, n_values, lost_worker, lost_step]`` (tag `REPLY`) then the values (tag
`REPLY_VALUES`); ``lost_worker`` is -1, or, under ``sync``, the worker whose death ended the training
(the worker raises `WorkerLostError`).

Indices of sparse tables travel as ``[count of each sparse piece of that server..., rows...]``, rows local
to the piece; a count of -1 means "all rows" (the whole piece moves, as a dense one).

Deadlock freedom: a worker posts its receives before its sends, and sends without blocking; a server
only ever blocks to receive (a header, or a payload already posted by its sender) and replies with
non-blocking sends that it completes later (`Outbox`). See docs/parameter_server.md.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["Kind", "HEADER", "VALUES", "INDICES", "REPLY", "REPLY_VALUES", "HEADER_LEN", "REPLY_LEN",
           "WorkerLostError", "gloo_group", "Outbox", "send_request", "recv_request"]

HEADER, VALUES, INDICES, REPLY, REPLY_VALUES = 1001, 1002, 1003, 1004, 1005
HEADER_LEN = 5
REPLY_LEN = 4


class WorkerLostError(RuntimeError):
    """A worker's process is gone and the training cannot go on without it (``consistency="sync"``).

    Attributes:
        worker: the lost worker's index (its rank is ``num_servers + worker``).
        step: the step it was computing (the steps it had pushed).
    """

    def __init__(self, message: str, worker: int, step: int) -> None:
        super().__init__(message)
        self.worker, self.step = worker, step

    @classmethod
    def of(cls, worker: int, rank: int, step: int, seen_by: str) -> "WorkerLostError":
        return cls(f"parameter server: worker {worker} (rank {rank}) is lost at step {step} (its connection "
                   f"closed: the process died; {seen_by}); consistency='sync' needs every worker's gradient of "
                   "every step, so the training stops (ssp and async drop a lost worker and go on)", worker, step)


class Kind(enum.IntEnum):
    PUSH = 1    # gradients of a step: values (+ rows of sparse pieces)
    PULL = 2    # parameters for a step: (rows of sparse pieces); answered with a reply
    FINAL = 3   # this worker has pushed its last step; answered once every worker has finished
    DONE = 4    # this worker leaves; no reply


def gloo_group() -> dist.ProcessGroup | None:
    """The group the messages travel on: None (the default group) when it is gloo, else a new gloo group
    over all ranks (collective: every rank calls it)."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def send_request(dst: int, kind: Kind, worker: int, step: int, values: torch.Tensor | None,
                 indices: torch.Tensor | None, group) -> list:
    """Post a request's messages without blocking; returns the work handles (keep the tensors alive)."""
    n_values = 0 if values is None else values.numel()
    n_indices = 0 if indices is None else indices.numel()
    header = torch.tensor([int(kind), worker, step, n_values, n_indices], dtype=torch.int64)
    works = [dist.isend(header, dst=dst, group=group, tag=HEADER)]
    if n_values:
        works.append(dist.isend(values, dst=dst, group=group, tag=VALUES))
    if n_indices:
        works.append(dist.isend(indices, dst=dst, group=group, tag=INDICES))
    return works


def recv_request(group, src: int | None = None) -> tuple[int, Kind, int, int, torch.Tensor | None,
                                                        torch.Tensor | None]:
    """Block for the next request from rank `src` (None: any worker): ``(source rank, kind, worker, step,
    values, indices)``. Raises when `src`'s connection closes (gloo: "Connection closed by peer"); a
    receive from any source does not (it waits for the others)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    src = dist.recv(header, src=src, group=group, tag=HEADER)
    kind, worker, step, n_values, n_indices = header.tolist()
    values = indices = None
    if n_values:
        values = torch.empty(n_values, dtype=torch.float32)
        dist.recv(values, src=src, group=group, tag=VALUES)
    if n_indices:
        indices = torch.empty(n_indices, dtype=torch.int64)
        dist.recv(indices, src=src, group=group, tag=INDICES)
    return src, Kind(kind), worker, step, values, indices


class Outbox:
    """A server's replies in flight: non-blocking sends whose tensors are kept until they complete."""

    def __init__(self, group) -> None:
        self.group = group
        self._pending: list[tuple[int, object, tuple[torch.Tensor, ...]]] = []  # (dst, work, tensors)
        self._abandoned: list[tuple[int, object, tuple[torch.Tensor, ...]]] = []

    def reply(self, dst: int, version: int, values: torch.Tensor, lost: tuple[int, int] = (-1, -1)) -> None:
        header = torch.tensor([version, values.numel(), *lost], dtype=torch.int64)
        works = [dist.isend(header, dst=dst, group=self.group, tag=REPLY)]
        if values.numel():
            works.append(dist.isend(values, dst=dst, group=self.group, tag=REPLY_VALUES))
        self._pending.extend((dst, w, (header, values)) for w in works)
        self._pending = [p for p in self._pending if not p[1].is_completed()]

    def forget(self, dst: int) -> None:
        """Never wait for the replies to `dst` (a lost worker): they can only fail. Their tensors stay
        referenced, since gloo may still hold the buffers."""
        self._abandoned += [p for p in self._pending if p[0] == dst]
        self._pending = [p for p in self._pending if p[0] != dst]

    def flush(self) -> None:
        for _, work, _ in self._pending:
            work.wait()
        self._pending.clear()
