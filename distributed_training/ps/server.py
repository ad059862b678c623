"""A server's loop: receive pushes and pulls from any worker, apply updates, answer pulls when allowed
(how a push decodes and how pushes combine into one update: `update`).

State: the fp32 values of this server's pieces, their optimizer state, the version (updates applied so
far), the version each worker last pulled, the steps each worker has pushed, and, in `sync` (and `ssp`
with bound 0, which is `sync`), each pending step's gradients by worker. Under `sync` updates are
step-aggregated: update k is the mean of the step-k gradients of the workers still training, applied
once all of them are in, in step order, summed in worker order (so that arrival order never changes a
bit). In `async` and in `ssp` with a bound s >= 1 each gradient is its own update, applied on arrival,
scaled by ``1 / num_workers``.

A pull for step c is answered under `sync` once ``version >= c``, under `ssp` once the slowest worker
still training has pushed every step ``< c - s`` (`_slowest_step`), under `async` at once; until then it
waits in a list while the loop serves everyone else. A final pull is answered
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
has been told (or is gone too) it raises `WorkerLostError` itself. The log says what happened in our
words; gloo's own text of the failed receive is logged at debug level and chained to the error
(``__cause__``).

No receive thread outlives `serve`: a thread blocked in a gloo receive when the interpreter exits is
unwound while it waits and the process aborts ("terminate called without an active exception"). Each
thread returns after its worker's DONE, after a LEAVE (a worker told of a lost worker sends one before
it raises), or when its connection fails; `serve` waits for them, and if a worker still says nothing
after `LEAVE_GRACE` seconds (hung, or too old to send LEAVE) it closes this server's connections
(`protocol.close_connections`), which makes the receive raise.

A lost worker may come back (`ssp` / `async`; `distributed_training.ps.rejoin`): a restarted process asks
in the rendezvous store, a watcher thread (`_watch_joins`) builds a gloo group of the servers and it, and
the loop reads the worker on that group from then on. Its `JOIN` is answered with the step it continues
from (the steps it had pushed; under `ssp` at least the slowest training worker's step, with bound 0 the
version, so that nobody waits for it and no applied step is computed again). Until its first request
names that step, updates from the step this server proposed on are held (step-aggregated: so that no
server applies a step the worker will take part in without it), and the `ssp` gate counts it at that
step; from then on it counts for every step from its start, as any worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from .optim import ShardOptimizer
from .protocol import STOP_WORKER, Kind, Outbox, WorkerLostError, close_connections, process_group, recv_request
from .sharding import Piece
from .update import combine, split_push, split_rows

__all__ = ["Server", "ServerStats"]

log = logging.getLogger("distributed_training")

LEAVE_GRACE = 5.0  # seconds `serve` waits for the workers' last messages before closing its connections


@dataclass
class ServerStats:
    """What one server did.

    Attributes:
        updates: optimizer updates applied (its final version).
        staleness: ``(worker, step, staleness)`` of every gradient applied, in order; staleness is the
            updates applied before it minus the version its worker had pulled when computing it (sync,
            async), or under ssp (s >= 1) in steps: its step minus the slowest training worker's step
            when its worker pulled (at most s).
        bytes_in: payload bytes received (values and indices; headers not counted).
        bytes_out: payload bytes sent in replies.
        pulls_delayed: pulls of a step that had to wait (sync: for updates; ssp: for the slowest worker's
            pushes; final pulls not counted).
        dropped: ``(worker, step)`` of every worker lost and dropped (ssp / async), in the order found;
            step is the one it was computing (the steps it had pushed).
        rejoined: ``(worker, step)`` of every worker that came back after a restart, in order; step is
            the one it continued from.
    """

    updates: int = 0
    staleness: list[tuple[int, int, int]] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    pulls_delayed: int = 0
    dropped: list[tuple[int, int]] = field(default_factory=list)
    rejoined: list[tuple[int, int]] = field(default_factory=list)

    @property
    def max_staleness(self) -> int:
        return max((s for _, _, s in self.staleness), default=0)


@dataclass
class _Pull:
    worker: int
    step: int
    rows: dict[str, torch.Tensor | None]
    final: bool


class Server:
    """Server `index` of the plan; see the module docstring."""

    def __init__(self, pieces: list[Piece], full_values: dict[str, torch.Tensor], *, num_workers: int,
                 consistency: str, staleness: int, optimizer: str, lr: float, momentum: float,
                 betas: tuple[float, float], eps: float, group, worker_ranks: list[int],
                 joins=None, index: int = 0, num_servers: int = 1, join_timeout: float = 300.0) -> None:
        """`group`: the job's gloo group (None: the default group), worker `w` at rank `worker_ranks[w]`.
        `joins`: the store where restarted workers ask to rejoin (None: they cannot); this server is
        rank `index` of `num_servers` in the group built for one; `join_timeout`: that group's timeout."""
        self.pieces = pieces
        self.sparse_pieces = [p for p in pieces if p.sparse]
        self.values = {p.name: p.view(full_values[p.name].detach()).to("cpu", torch.float32).clone()
                       for p in pieces}
        self.optim = ShardOptimizer(pieces, self.values, optimizer, lr=lr, momentum=momentum, betas=betas, eps=eps)
        self.num_workers, self.consistency = num_workers, consistency
        self.staleness = 0 if consistency == "sync" else staleness
        # Each gradient its own update, as it comes (async; ssp with a bound of 1 or more), or one update a
        # step of every worker's gradient (sync; ssp with bound 0, which is sync).
        self.eager = consistency == "async" or self.staleness > 0
        self.outbox = Outbox()
        pg = process_group(group)
        self.links: dict[int, tuple] = {w: (pg, r) for w, r in enumerate(worker_ranks)}  # worker -> (pg, rank)
        self.version = 0
        self.pulled_version = [0] * num_workers
        self.pulled_clock = [0] * num_workers  # (eager ssp) the slowest worker's step when each last pulled
        # step -> worker -> (grads, version, weight or None)
        self.pending: dict[int, dict[int, tuple[dict, int, float | None]]] = {}
        #: () -> the signal number this server's process got (0: none), told to workers in pull replies
        self.stop_requested: Callable[[], int] | None = None
        self.finished: set[int] = set()
        self.done: set[int] = set()
        self.waiting: list[_Pull] = []
        self.stats = ServerStats()
        self.worker_ranks = worker_ranks  # the job's ranks, for messages (a rejoined worker's link is elsewhere)
        self.pushed = [0] * num_workers  # steps each worker has pushed: the step it is computing
        self.lost: set[int] = set()
        self.failure: WorkerLostError | None = None  # sync: the first lost worker ends the training
        self.told: set[int] = set()  # sync, after a failure: workers answered with it
        self.joins, self.index, self.num_servers, self.join_timeout = joins, index, num_servers, join_timeout
        self.joining: dict[int, int] = {}  # rejoined worker -> the step this server proposed, until it starts
        self.joined_at: dict[int, int] = {}  # rejoined worker -> the step it continued from
        self._inbox: queue.Queue = queue.Queue()  # (worker, request, error, joined group)
        self._serving = False
        self._receivers: list[tuple[int, threading.Thread, object, int]] = []  # (worker, thread, pg, rank)

    # ---------------------------------------------------------------- loop
    def serve(self) -> ServerStats:
        """Serve until every worker has closed or is lost; return what this server did.

        Raises:
            WorkerLostError: (sync) a worker was lost; raised once every other worker has been told.
        """
        for worker in range(self.num_workers):
            self._start_receiving(worker)
        self._serving = True
        watcher = None
        if self.joins is not None and self.consistency != "sync":
            watcher = threading.Thread(target=self._watch_joins, name="dt-ps-joins", daemon=True)
            watcher.start()
        leaving: list[int] = []
        try:
            while not self._over():
                worker, request, error, joined = self._inbox.get()
                if joined is not None:
                    self._rejoin(worker, joined)
                elif error is not None:
                    self._lose(worker, error)
                else:
                    kind, sender, step, values, indices, weight = request
                    if sender != worker:
                        raise RuntimeError(f"parameter server: rank {self.links[worker][1]} (worker {worker}) "
                                           f"sent a request as worker {sender}")
                    self.stats.bytes_in += (0 if values is None else 4 * values.numel()) + \
                        (0 if indices is None else 8 * indices.numel())
                    if kind == Kind.JOIN:
                        self._answer_join(worker)
                        continue
                    if kind == Kind.LEAVE:  # (sync) told of the failure by a server: it sends nothing more
                        self.told.add(worker)
                        continue
                    if worker in self.joining:  # its first request after JOIN: the step it continues from
                        del self.joining[worker]
                        self.joined_at[worker] = step
                        self.pushed[worker] = max(self.pushed[worker], step)  # (it computes that step now)
                        self.stats.rejoined.append((worker, step))
                    if kind == Kind.PUSH:
                        self.pushed[worker] = step + 1
                        if self.failure is None:
                            rows = split_rows(self.sparse_pieces, indices)
                            self._push(worker, step, split_push(self.pieces, rows, values), weight)
                    elif kind in (Kind.PULL, Kind.FINAL):
                        if kind == Kind.FINAL:
                            self.finished.add(worker)
                        rows = split_rows(self.sparse_pieces, indices)
                        self.waiting.append(_Pull(worker, step, rows, kind == Kind.FINAL))
                        if kind == Kind.PULL and not self._allowed(self.waiting[-1]):
                            self.stats.pulls_delayed += 1
                    else:
                        self.done.add(worker)
                        leaving.append(worker)
                if self.failure is not None:  # sync: tell whoever waits for an acknowledgement now
                    for w in leaving:
                        self._reply(w, self.version, torch.empty(0))
                    leaving.clear()
                self._apply_ready()
                self._answer_waiting()
            if self.failure is None and self.pending:
                raise RuntimeError(f"parameter server: every worker left with steps {sorted(self.pending)} "
                                   "incomplete")
        except BaseException:
            self._serving = False
            self._stop_receiving(grace=0.0)  # an error of ours: nobody will be answered
            raise
        finally:
            self._serving = False  # no more rejoins; the watcher not left inside a store call at exit
            if watcher is not None:
                watcher.join(timeout=5.0)  # a poll; longer only while a rejoining group connects
        # Acknowledge the DONEs only now: a worker's close() returns after every worker has closed, so no
        # message of a later ParameterServer (the same ranks, the same tags) can reach this loop.
        for w in leaving:
            self._reply(w, self.version, torch.empty(0))
        self.outbox.flush()
        self._stop_receiving(grace=LEAVE_GRACE)
        self.stats.updates = self.version
        if self.failure is None and self.lost and not (self.done | self.finished):  # (ssp / async)
            self.failure = WorkerLostError.of_every(
                [(w, self.worker_ranks[w], s) for w, s in self.stats.dropped], f"seen by server {self.index}")
            log.error("%s", self.failure)
        if self.failure is not None:
            raise self.failure
        return self.stats

    def _over(self) -> bool:
        if self.failure is not None:
            return len(self.told | self.lost) == self.num_workers
        return len(self.done | self.lost) == self.num_workers

    def _start_receiving(self, worker: int) -> None:
        pg, rank = self.links[worker]
        thread = threading.Thread(target=self._receive, args=(worker, pg, rank), name=f"dt-ps-recv-{worker}",
                                  daemon=True)
        self._receivers.append((worker, thread, pg, rank))
        thread.start()

    def _receive(self, worker: int, pg, rank: int) -> None:
        """(A thread per worker) read its requests into the inbox until its DONE or LEAVE, or until its
        connection fails (then the error goes to the inbox instead: the worker is lost)."""
        try:
            while True:
                request = recv_request(pg, rank)
                self._inbox.put((worker, request, None, None))
                if request[0] in (Kind.DONE, Kind.LEAVE):
                    return
        except Exception as err:
            self._inbox.put((worker, None, err, None))

    def _stop_receiving(self, grace: float) -> None:
        """Return with no receive thread left blocked in gloo: wait up to `grace` seconds for each to
        end (its worker's DONE or LEAVE, or its connection failing), then close the connections of the
        groups some are still blocked on (`protocol.close_connections`) and wait for those."""
        deadline = time.monotonic() + grace
        for _, thread, _, _ in self._receivers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [(w, pg, rank) for w, thread, pg, rank in self._receivers if thread.is_alive()]
        if stuck:
            if grace:
                log.warning("parameter server %d: worker(s) %s sent nothing more within %.0f s of the end; "
                            "closing this server's connections so that no receive is left waiting",
                            self.index, sorted({w for w, _, _ in stuck}), grace)
            closed = set()
            for _, pg, rank in stuck:
                if id(pg) not in closed:
                    closed.add(id(pg))
                    close_connections(pg, rank)
            for _, thread, _, _ in self._receivers:
                thread.join(timeout=1.0)
        self._receivers = [r for r in self._receivers if r[1].is_alive()]

    # ---------------------------------------------------------------- rejoins
    def _watch_joins(self) -> None:
        """(A thread, ssp / async) answer a restarted worker's request to rejoin (`ps.rejoin`): for a worker
        that is lost, count this server in, build the gloo group of the servers and it (this server at rank
        `index`, the worker at rank `num_servers`), and hand it to the loop."""
        seen = {w: self.joins.add(f"join/{w}", 0) for w in range(self.num_workers)}
        while self._serving:
            for worker in range(self.num_workers):
                request = self.joins.add(f"join/{worker}", 0)
                if request > seen[worker] and worker in self.lost:
                    seen[worker] = request
                    prefix = f"join/{worker}/{request}"
                    if self.joins.check([prefix + "/withdrawn"]):
                        continue  # its process gave up waiting (asked while the worker still ran)
                    self.joins.add(prefix + "/accepted", 1)
                    try:
                        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.joins), self.index,
                                                   self.num_servers + 1, timedelta(seconds=self.join_timeout))
                    except Exception as err:  # the worker died again while connecting: it stays lost
                        log.warning("parameter server %d: worker %d asked to rejoin but could not connect "
                                    "(it stays lost; it may ask again)", self.index, worker)
                        log.debug("parameter server %d: worker %d's rejoin: %s", self.index, worker, err)
                        continue
                    self._inbox.put((worker, None, None, pg))
            time.sleep(0.2)

    def _rejoin(self, worker: int, pg) -> None:
        """A lost worker is back on group `pg`: read it there; it counts once its JOIN is answered."""
        if not self._serving or worker not in self.lost:
            return
        self.lost.discard(worker)
        self.done.discard(worker)
        self.finished.discard(worker)
        self.links[worker] = (pg, self.num_servers)
        self.joining[worker] = -1  # until its JOIN: hold nothing yet
        self._start_receiving(worker)
        log.warning("parameter server: worker %d rejoined", worker)

    def _answer_join(self, worker: int) -> None:
        """Propose the step `worker` continues from; hold updates from that step until it starts."""
        proposal = self.pushed[worker]
        if self.consistency == "ssp":  # not behind the slowest worker still training: nobody waits for it
            slowest = self._slowest_step(besides=worker) if self.eager else self.version
            proposal = max(proposal, slowest) if slowest != float("inf") else proposal
        self.joining[worker] = proposal
        self._reply(worker, self.version, torch.empty(0), info=proposal)

    # ---------------------------------------------------------------- lost workers
    def _lose(self, worker: int, error: BaseException) -> None:
        """`worker`'s connection failed: drop it (ssp / async) or fail the training (sync)."""
        if worker in self.lost:
            return
        self.lost.add(worker)
        step, rank = self.pushed[worker], self.worker_ranks[worker]
        self.waiting = [p for p in self.waiting if p.worker != worker]
        self.outbox.forget(worker)
        self.joining.pop(worker, None)
        # gloo's text ("Connection closed by peer ... GLHF") says little to a user: ours says what happened
        # and what comes next; the backend's is for debugging (and the error's __cause__ under sync)
        log.debug("parameter server %d: worker %d (rank %d): %s", self.index, worker, rank, error)
        if self.consistency == "sync":
            if self.failure is None:
                self.failure = WorkerLostError.of(worker, rank, step, f"seen by server {self.index}")
                self.failure.__cause__ = error
                log.error("%s", self.failure)
            return
        self.stats.dropped.append((worker, step))
        discarded = sum(worker in grads for grads in self.pending.values())
        for grads in self.pending.values():
            grads.pop(worker, None)
        self.pending = {s: grads for s, grads in self.pending.items() if grads}
        left = self.num_workers - len(self.lost | self.done)
        log.warning("parameter server %d: worker %d (rank %d) is lost at step %d (its connection closed: the "
                    "process died or its network failed) and is dropped: %d gradient(s) of it not yet applied "
                    "are discarded and %d worker(s) go on without it%s", self.index, worker, rank, step, discarded,
                    left, "; it may rejoin after a restart" if self.joins is not None else "")

    def _reply(self, worker: int, version: int, values: torch.Tensor, info: int = -1) -> None:
        """A reply to `worker`, carrying the failure under sync (else `info` in its last field); a send that
        fails (the worker just died) loses that worker."""
        lost = (-1, info) if self.failure is None else (self.failure.worker, self.failure.step)
        stop = self.stop_requested() if self.stop_requested is not None and info == -1 else 0
        if stop and self.failure is None:
            lost = (STOP_WORKER, stop)  # this server got a signal: the workers stop with it (and save)
        pg, rank = self.links[worker]
        try:
            self.outbox.reply(worker, pg, rank, version, values, lost)
        except RuntimeError as err:
            self._lose(worker, err)
            return
        if self.failure is not None:
            self.told.add(worker)

    # ---------------------------------------------------------------- updates
    def _push(self, worker: int, step: int, grads: dict, weight: float | None = None) -> None:
        if self.eager:
            # async: staleness in updates since its pull; ssp: in steps, this one's over the slowest
            # worker's when it pulled (at most the bound: the pull waited for that)
            stale = step - self.pulled_clock[worker] if self.consistency == "ssp" else \
                self.version - self.pulled_version[worker]
            self._update({worker: grads}, {worker: stale}, step, scale=1.0 / self.num_workers)
            return
        if step < self.version or worker in self.pending.get(step, {}):
            raise RuntimeError(f"parameter server: worker {worker} pushed step {step} twice")
        self.pending.setdefault(step, {})[worker] = (grads, self.pulled_version[worker], weight)

    def _apply_ready(self) -> None:
        """Apply pending steps in order while the next one has every training worker's gradient."""
        if self.failure is not None:
            return
        while self.version in self.pending and self._required(self.version) <= set(self.pending[self.version]):
            contributions = self.pending.pop(self.version)
            # Each worker's gradient weighted by what its batch counts (targets kept, or rows), as data
            # parallelism weighs its replicas: the whole batch's mean. Without every weight: the plain mean.
            weights = {w: weight for w, (_, _, weight) in contributions.items()}
            total = sum(weights.values()) if None not in weights.values() else 0.0
            scale = {w: weight / total for w, weight in weights.items()} if total > 0 else 1.0 / len(contributions)
            self._update({w: grads for w, (grads, _, _) in contributions.items()},
                         {w: self.version - pulled for w, (_, pulled, _) in contributions.items()},
                         self.version, scale=scale)

    def _required(self, step: int) -> set[int]:
        """The workers whose gradient step `step` waits for: those training, from the step they (re)joined
        at; a worker rejoining (between its JOIN and its first request) holds the steps from the one
        proposed to it."""
        required = set()
        for w in range(self.num_workers):
            if w in self.finished or w in self.done or w in self.lost:
                continue
            if w in self.joining:
                if step >= self.joining[w] >= 0:
                    required.add(w)
            elif step >= self.joined_at.get(w, 0):
                required.add(w)
        return required

    def _update(self, contributions: dict[int, dict], staleness: dict[int, int], step: int,
                scale: float | dict[int, float]) -> None:
        """One optimizer update from the pushes of `contributions` (worker -> its push; `combine`, scaled
        by `scale` or each by its worker's, a dict); `staleness`: each one's, for the statistics."""
        dense, sparse = combine(self.pieces, contributions, scale)
        self.optim.step(dense, sparse)
        for w in sorted(contributions):
            self.stats.staleness.append((w, step, staleness[w]))
        self.version += 1

    # ---------------------------------------------------------------- pulls
    def _allowed(self, pull: _Pull) -> bool:
        if self.failure is not None:
            return True  # answered at once, with the failure
        if pull.final:
            everyone = len(self.finished | self.done | self.lost) == self.num_workers
            return everyone and not self.pending
        if self.consistency == "async":
            return True
        if self.eager:  # ssp: not more than `staleness` steps ahead of the slowest worker still training
            return self._slowest_step() >= pull.step - self.staleness
        return self.version >= pull.step - self.staleness

    def _slowest_step(self, besides: int | None = None) -> float:
        """The step the slowest worker still training computes (the steps it has pushed); inf if none.
        A rejoining worker counts from the step this server proposed to it once its JOIN is answered (it
        starts there or later: the others must not run more than the bound past it while it gets going,
        before its first request comes), and not before (the proposal is not behind the others)."""
        steps = []
        for w in range(self.num_workers):
            if w == besides or w in self.finished or w in self.done or w in self.lost:
                continue
            if w not in self.joining:
                steps.append(self.pushed[w])
            elif self.joining[w] >= 0:
                steps.append(self.joining[w])
        return min(steps, default=float("inf"))

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
        self.pulled_clock[pull.worker] = min(pull.step, self._slowest_step())
        self.stats.bytes_out += 4 * values.numel()
        self._reply(pull.worker, self.version, values)
