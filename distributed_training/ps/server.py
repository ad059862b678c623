"""A server's loop: receive pushes and pulls from any worker, apply updates, answer pulls when allowed.

State: the fp32 values of this server's pieces, their optimizer state, the version (updates applied so
far), the version each worker last pulled, and, in `sync` / `ssp`, each pending step's gradients by
worker. Updates are step-aggregated: update k is the mean of the step-k gradients of the workers still
training, applied once all of them are in, in step order, summed in worker order (so that arrival order
never changes a bit). In `async` each gradient is its own update, scaled by ``1 / num_workers``.

A pull for step c is answered once ``version >= c - staleness`` (`sync` is staleness 0; `async` never
waits); until then it waits in a list while the loop serves everyone else. A final pull is answered
once every worker has finished or left and every pending step is applied. A worker's DONE is
acknowledged once every worker has sent one, which ends the loop.

Each worker's messages are read by a thread of its own (`_receive`: a header, then its payload, from that
worker's rank) into one queue that the loop serves, because a blocking receive from any source never
learns that a sender died, while a receive from one rank raises as soon as that rank's connection closes
(gloo: "Connection closed by peer", at once when the process is killed). That is how a lost worker is
found. Under `ssp` and `async` it is dropped: its pending gradients of steps not yet applied are
discarded, its waiting pulls forgotten, and the steps, the staleness gate and the final pull go on
with the others (`ServerStats.dropped`). Under `sync` the loop answers every pull and close from then
on with the lost worker's index (the workers raise `WorkerLostError`), and once each surviving worker
has been told (or is gone too) it raises `WorkerLostError` itself.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from .optim import ShardOptimizer
from .protocol import Kind, Outbox, WorkerLostError, recv_request
from .sharding import Piece

__all__ = ["Server", "ServerStats"]

log = logging.getLogger("distributed_training")


@dataclass
class ServerStats:
    """What one server did.

    Attributes:
        updates: optimizer updates applied (its final version).
        staleness: ``(worker, step, staleness)`` of every gradient applied, in order; staleness is the
            updates applied before it minus the version its worker had pulled when computing it.
        bytes_in: payload bytes received (values and indices; headers not counted).
        bytes_out: payload bytes sent in replies.
        pulls_delayed: pulls of a step that had to wait for updates (ssp / sync; final pulls not counted).
        dropped: ``(worker, step)`` of every worker lost and dropped (ssp / async), in the order found;
            step is the one it was computing (the steps it had pushed).
    """

    updates: int = 0
    staleness: list[tuple[int, int, int]] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    pulls_delayed: int = 0
    dropped: list[tuple[int, int]] = field(default_factory=list)

    @property
    def max_staleness(self) -> int:
        return max((s for _, _, s in self.staleness), default=0)


@dataclass
class _Pull:
    src: int
    worker: int
    step: int
    rows: dict[str, torch.Tensor | None]
    final: bool


class Server:
    """Server `index` of the plan; see the module docstring."""

    def __init__(self, pieces: list[Piece], full_values: dict[str, torch.Tensor], *, num_workers: int,
                 consistency: str, staleness: int, optimizer: str, lr: float, momentum: float,
                 betas: tuple[float, float], eps: float, group, worker_ranks: list[int]) -> None:
        self.pieces = pieces
        self.sparse_pieces = [p for p in pieces if p.sparse]
        self.values = {p.name: p.view(full_values[p.name].detach()).to("cpu", torch.float32).clone()
                       for p in pieces}
        self.optim = ShardOptimizer(pieces, self.values, optimizer, lr=lr, momentum=momentum, betas=betas, eps=eps)
        self.num_workers, self.consistency = num_workers, consistency
        self.staleness = 0 if consistency == "sync" else staleness
        self.group = group
        self.outbox = Outbox(group)
        self.version = 0
        self.pulled_version = [0] * num_workers
        self.pending: dict[int, dict[int, tuple[dict, int]]] = {}  # step -> worker -> (grads, version)
        self.finished: set[int] = set()
        self.done: set[int] = set()
        self.waiting: list[_Pull] = []
        self.stats = ServerStats()
        self.worker_ranks = worker_ranks
        self.pushed = [0] * num_workers  # steps each worker has pushed: the step it is computing
        self.lost: set[int] = set()
        self.failure: WorkerLostError | None = None  # sync: the first lost worker ends the training
        self.told: set[int] = set()  # sync, after a failure: workers answered with it
        self._inbox: queue.Queue = queue.Queue()

    # ---------------------------------------------------------------- loop
    def serve(self) -> ServerStats:
        """Serve until every worker has closed or is lost; return what this server did.

        Raises:
            WorkerLostError: (sync) a worker was lost; raised once every other worker has been told.
        """
        for worker in range(self.num_workers):
            threading.Thread(target=self._receive, args=(worker,), name=f"dt-ps-recv-{worker}", daemon=True).start()
        leaving: list[int] = []
        while not self._over():
            worker, request, error = self._inbox.get()
            if error is not None:
                self._lose(worker, error)
            else:
                src, kind, sender, step, values, indices = request
                if sender != worker:
                    raise RuntimeError(f"parameter server: rank {src} (worker {worker}) sent a request as worker "
                                       f"{sender}")
                self.stats.bytes_in += (0 if values is None else 4 * values.numel()) + \
                    (0 if indices is None else 8 * indices.numel())
                if kind == Kind.PUSH:
                    self.pushed[worker] = step + 1
                    if self.failure is None:
                        self._push(worker, step, self._grads(self._rows(indices), values))
                elif kind in (Kind.PULL, Kind.FINAL):
                    if kind == Kind.FINAL:
                        self.finished.add(worker)
                    self.waiting.append(_Pull(src, worker, step, self._rows(indices), kind == Kind.FINAL))
                    if kind == Kind.PULL and not self._allowed(self.waiting[-1]):
                        self.stats.pulls_delayed += 1
                else:
                    self.done.add(worker)
                    leaving.append(src)
            if self.failure is not None:  # sync: tell whoever waits for an acknowledgement now
                for src in leaving:
                    self._reply(src, self.version, torch.empty(0))
                leaving.clear()
            self._apply_ready()
            self._answer_waiting()
        if self.failure is None and self.pending:
            raise RuntimeError(f"parameter server: every worker left with steps {sorted(self.pending)} incomplete")
        # Acknowledge the DONEs only now: a worker's close() returns after every worker has closed, so no
        # message of a later ParameterServer (the same ranks, the same tags) can reach this loop.
        for src in leaving:
            self._reply(src, self.version, torch.empty(0))
        self.outbox.flush()
        self.stats.updates = self.version
        if self.failure is not None:
            raise self.failure
        return self.stats

    def _over(self) -> bool:
        if self.failure is not None:
            return len(self.told | self.lost) == self.num_workers
        return len(self.done | self.lost) == self.num_workers

    def _receive(self, worker: int) -> None:
        """(A thread per worker) read its requests into the inbox until its DONE, or until its connection
        fails (then the error goes to the inbox instead: the worker is lost)."""
        try:
            while True:
                request = recv_request(self.group, src=self.worker_ranks[worker])
                self._inbox.put((worker, request, None))
                if request[1] == Kind.DONE:
                    return
        except Exception as err:
            self._inbox.put((worker, None, err))

    # ---------------------------------------------------------------- lost workers
    def _lose(self, worker: int, error: BaseException) -> None:
        """`worker`'s connection failed: drop it (ssp / async) or fail the training (sync)."""
        if worker in self.lost:
            return
        self.lost.add(worker)
        step, rank = self.pushed[worker], self.worker_ranks[worker]
        self.waiting = [p for p in self.waiting if p.worker != worker]
        self.outbox.forget(rank)
        if self.consistency == "sync":
            if self.failure is None:
                self.failure = WorkerLostError.of(worker, rank, step, f"seen by the server: {error}")
                log.error("%s", self.failure)
            return
        self.stats.dropped.append((worker, step))
        for grads in self.pending.values():
            grads.pop(worker, None)
        self.pending = {s: grads for s, grads in self.pending.items() if grads}
        log.warning("parameter server: worker %d (rank %d) is lost at step %d and dropped; %d worker(s) go on "
                    "(%s)", worker, rank, step, self.num_workers - len(self.lost | self.done), error)

    def _reply(self, src: int, version: int, values: torch.Tensor) -> None:
        """A reply to rank `src`, carrying the failure under sync; a send that fails (the worker just died)
        loses that worker."""
        worker = self.worker_ranks.index(src)
        lost = (-1, -1) if self.failure is None else (self.failure.worker, self.failure.step)
        try:
            self.outbox.reply(src, version, values, lost)
        except RuntimeError as err:
            self._lose(worker, err)
            return
        if self.failure is not None:
            self.told.add(worker)

    # ---------------------------------------------------------------- decoding
    def _rows(self, indices: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
        """Rows of each sparse piece named by a request (None: all rows)."""
        k = len(self.sparse_pieces)
        if k == 0:
            return {}
        if indices is None or indices.numel() < k:
            raise RuntimeError(f"parameter server: a request lacks the row counts of {k} sparse piece(s)")
        counts, rows, at = indices[:k].tolist(), {}, k
        for piece, count in zip(self.sparse_pieces, counts):
            if count < 0:
                rows[piece.name] = None
            else:
                rows[piece.name] = indices[at : at + count]
                at += count
        return rows

    def _grads(self, rows: dict[str, torch.Tensor | None], values: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Split a push's values into each piece's gradient (rows of it for a sparse piece)."""
        grads, at = {}, 0
        for piece in self.pieces:
            picked = rows.get(piece.name)
            n = piece.numel if picked is None else picked.numel() * piece.row_numel
            shape = piece.local_shape if picked is None else (picked.numel(), *piece.local_shape[1:])
            grads[piece.name] = values[at : at + n].view(shape) if n else torch.zeros(shape)
            at += n
        carried = 0 if values is None else values.numel()
        if at != carried:
            raise RuntimeError(f"parameter server: a push carried {carried} values, expected {at}")
        return {"rows": rows, "grads": grads}

    # ---------------------------------------------------------------- updates
    def _push(self, worker: int, step: int, grads: dict) -> None:
        if self.consistency == "async":
            self._update({worker: (grads, self.pulled_version[worker])}, step, scale=1.0 / self.num_workers)
            return
        if step < self.version or worker in self.pending.get(step, {}):
            raise RuntimeError(f"parameter server: worker {worker} pushed step {step} twice")
        self.pending.setdefault(step, {})[worker] = (grads, self.pulled_version[worker])

    def _apply_ready(self) -> None:
        """Apply pending steps in order while the next one has every training worker's gradient."""
        if self.failure is not None:
            return
        required = set(range(self.num_workers)) - self.finished - self.done - self.lost
        while self.version in self.pending and required <= set(self.pending[self.version]):
            contributions = self.pending.pop(self.version)
            self._update(contributions, self.version, scale=1.0 / len(contributions))

    def _update(self, contributions: dict[int, tuple[dict, int]], step: int, scale: float) -> None:
        """One optimizer update from the gradients of `contributions` (worker -> (grads, version)),
        summed in worker order and multiplied by `scale`."""
        order = sorted(contributions)
        dense, sparse = {}, {}
        for piece in self.pieces:
            if piece.sparse:
                sparse[piece.name] = self._sum_rows(piece, [contributions[w][0] for w in order], scale)
            else:
                total = contributions[order[0]][0]["grads"][piece.name].clone()
                for w in order[1:]:
                    total.add_(contributions[w][0]["grads"][piece.name])
                dense[piece.name] = total.mul_(scale)
        self.optim.step(dense, sparse)
        for w in order:
            self.stats.staleness.append((w, step, self.version - contributions[w][1]))
        self.version += 1

    @staticmethod
    def _sum_rows(piece: Piece, pushes: list[dict], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique rows, their summed gradient x scale) of a sparse piece over several pushes."""
        rows = torch.cat([torch.arange(piece.rows) if p["rows"].get(piece.name) is None else p["rows"][piece.name]
                          for p in pushes])
        grads = torch.cat([p["grads"][piece.name] for p in pushes])
        unique, inverse = torch.unique(rows, return_inverse=True)
        total = torch.zeros((unique.numel(), *piece.local_shape[1:]))
        total.index_add_(0, inverse, grads)
        return unique, total.mul_(scale)

    # ---------------------------------------------------------------- pulls
    def _allowed(self, pull: _Pull) -> bool:
        if self.failure is not None:
            return True  # answered at once, with the failure
        if pull.final:
            everyone = len(self.finished | self.done | self.lost) == self.num_workers
            return everyone and not self.pending
        return self.consistency == "async" or self.version >= pull.step - self.staleness

    def _answer_waiting(self) -> None:
        still = []
        for pull in self.waiting:
            if self._allowed(pull):
                self._answer(pull)
            else:
                still.append(pull)
        self.waiting = [p for p in still if p.worker not in self.lost]  # a reply may have lost a worker

    def _answer(self, pull: _Pull) -> None:
        parts = []
        for piece in self.pieces:
            picked = None if pull.final else pull.rows.get(piece.name)
            value = self.values[piece.name]
            parts.append((value if picked is None else value[picked]).reshape(-1))
        values = torch.cat(parts) if parts else torch.empty(0)
        self.pulled_version[pull.worker] = self.version
        self.stats.bytes_out += 4 * values.numel()
        self._reply(pull.src, self.version, values)
