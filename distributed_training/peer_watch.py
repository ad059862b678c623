"""Fast detection of a dead peer: every rank beats in the rendezvous store and watches its neighbours'
beats, so a rank whose process is gone becomes an error naming it within seconds, not a hang until the
collective timeout (30 minutes by default under NCCL).

What a beat means. A daemon thread of each rank adds 1 to ``distributed_training/alive/<rank>`` every
`PeerWatch.period` seconds, whatever the training thread is doing: inside a long step (a forward pass of
a minute, a checkpoint write, torch.compile) the beat goes on, because the thread only needs the
process to live (torch's operators release the GIL; Python switches threads every 5 ms). Silence for
`timeout` seconds therefore means the process is gone (SIGKILL, a segfault, the OOM killer), frozen
(SIGSTOP, a host swapping to death) or cut off (its node lost power or network, so that no TCP
connection was even closed), not that its step is slow. Each watcher times silence with its own
monotonic clock (it only asks "did the counter move?"), so clocks of different hosts never meet.

Who watches whom. Rank r watches ranks r+1 .. r+`watch` (mod the world), three by default: one store
round trip per watched rank and period, so the store's load grows with the world, not with its square.
The first rank that finds a dead peer writes it to ``distributed_training/peer_failure``, which every
rank reads each period (one `check`), so all ranks learn it one period later. A rank is judged only
after its first beat (before it, a slow start-up is not a death), and a rank that left cleanly
(`PeerWatch.stop`, or at interpreter exit) says so, so finishing early is never mistaken for dying.

A peer that raised. A rank whose own step raises (not a consequence of a peer: a closed connection, a
timeout, a pipeline's abort) writes its error to a key of its position (`publish_error`; a key per job
incarnation, trainer and position; the first rank to raise there is named) and the position to a log (a
counter and a key per entry, which the watchers read when the counter exists). A position is the step and
the watched block in it (`active`: the step itself, then e.g. fit's evaluation and save, or a script's
`save_checkpoint`), alike on every rank, so that a retried step, or a second failure after one the script
caught, is a new one. Its process may still be alive, or may close its sockets as it ends: either way its
peers' collectives with it cannot complete. A peer adopts the record as it would a death once it has
reached that position (on NCCL its host may be several steps ahead, its collectives there still queued on
the GPU), at once if its own collective has failed (gloo's closed connection) or `timeout` after seeing it
(a wait, as on NCCL), unless it raised at that position itself (every rank's batch was bad alike: each
says its own, and none is left with an aborted group for the steps after).

Getting the training thread out. A rank blocked in a collective on a dead peer cannot receive a Python
exception: it waits in C++. What works, measured on CPU (gloo, torch 2.13) and on 2x H200 (NCCL 2.28.9):

* A peer killed outright (its sockets closed by the kernel): gloo fails at once ("Connection closed by
  peer", no rank named). The trainer then asks the watcher for its verdict (`PeerWatch.verdict`, which
  waits up to `timeout` for it) and raises `PeerFailureError` naming the rank and its host.
* A silent peer (sockets open, nothing sent): gloo waits until the collective timeout, and
  ``ProcessGroupGloo.abort()`` does not wake it (measured: abort returns at once, the blocked all-reduce
  keeps waiting). NCCL's communicator abort does make its kernels and waits return with an error, so
  on NCCL the trainer aborts the process group on detection (`on_failure`) and the step raises.
* Whatever is still blocked `exit_after` seconds after detection inside the trainer's work (`active`:
  a step, an evaluation, a checkpoint save, `close`'s wait for the GPU; gloo's silent peer): the watcher
  logs the error and ends the process with `os._exit(EXIT_CODE)`. So does a rank stuck in its own code
  inside a step, once a peer's collective timed out naming it (`hangs.tell_stuck`), or once the store is
  gone (its holder ended) and it is still there `exit_after` later; its log shows where it was. That is
  clean where it matters: torchrun's agent sees a failed worker, stops its other workers and re-forms
  the job (``--max-restarts``, ``--nnodes=MIN:MAX``), which is the recovery anyway; a process whose peer
  is dead has no collective it can ever finish.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from typing import Callable, Sequence

from .peer_exits import EXIT_CODE, Endings

__all__ = ["PeerFailureError", "PeerWatch", "EXIT_CODE", "looks_like_peer_loss"]

log = logging.getLogger("distributed_training")


_PREFIX = "distributed_training/"
_FAILURE_KEY = _PREFIX + "peer_failure"
_GENERATIONS = itertools.count()  # the watches this process started: every rank starts its n-th alike


class PeerFailureError(RuntimeError):
    """A peer rank's process is gone (its heartbeat stopped), or its step raised an error of its own, which
    left this rank's collectives with it unable to complete: the message names it, its host and its error.

    Attributes:
        rank: the failed rank (its rank in the job).
        host: its host name and process id, as it published them (``"?"`` if it never did).
        last_step: the last training step it started (None if unknown).
        silent_s: how long its heartbeat had been silent when it was declared dead (0 if it raised).
        error: what it raised (``"ValueError: ..."``), None if its process died.
    """

    def __init__(self, message: str, rank: int, host: str, last_step: int | None, silent_s: float,
                 error: str | None = None) -> None:
        super().__init__(message)
        self.rank, self.host, self.last_step, self.silent_s, self.error = rank, host, last_step, silent_s, error


def looks_like_peer_loss(err: BaseException) -> bool:
    """Whether `err` could come from a collective whose peer is gone (worth waiting for a verdict):
    gloo's closed connections, NCCL's errors and aborts, timeouts. A shape error is not, nor an error
    that names the lost peer itself (``names_lost_peer = True``: the parameter server's `WorkerLostError`)."""
    if getattr(err, "names_lost_peer", False):
        return False
    text = str(err).lower()
    return any(marker in text for marker in ("connection closed", "connection reset", "broken pipe", "nccl",
                                             "gloo", "abort", "timed out", "timeout", "peer"))


class PeerWatch(Endings):
    """This rank's heartbeat and its watch over `watch` neighbours, on a daemon thread.

    Args:
        store: the rendezvous store (a `torch.distributed.Store`; the default group's).
        rank, world_size: this rank and the world.
        timeout: seconds of silence after which a peer counts as dead.
        period: seconds between beats and checks (default: `timeout` / 5, within [0.1, 1]).
        watch: how many following ranks this rank watches.
        exit_after: seconds after detection before the process exits (`EXIT_CODE`) if the training
            thread has not taken the error (`acknowledge`); None never exits.
        on_failure: called once, on the watcher's thread, with the error (the trainer aborts an NCCL
            process group there, which wakes a blocked collective).
        global_ranks: each member's rank in the job, where the watched ranks are a group of it (a
            parameter server's workers): messages and `PeerFailureError.rank` name those, with the
            member's index ("worker 1 (rank 3)"). None: the members are the job's ranks.
        member: what a member is called in messages with `global_ranks` (default "worker").
    """

    def __init__(self, store, rank: int, world_size: int, timeout: float, *, period: float | None = None,
                 watch: int = 3, exit_after: float | None = None,
                 on_failure: Callable[[PeerFailureError], None] | None = None,
                 global_ranks: Sequence[int] | None = None, member: str = "worker") -> None:
        if not timeout > 0:
            raise ValueError(f"heartbeat_timeout must be positive, got {timeout!r}")
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, float(timeout)
        self.period = period if period is not None else min(1.0, max(0.1, timeout / 5))
        self.peers = [(rank + k) % world_size for k in range(1, min(watch, world_size - 1) + 1)]
        self.exit_after = exit_after
        self.on_failure = on_failure
        self._global = list(global_ranks) if global_ranks is not None else None
        self._member = member
        self.failure: PeerFailureError | None = None
        self.step: int | None = None  # the training thread's current step, for messages
        self.activity: str | None = None  # what the training thread does ("training step 5"), for messages
        self._detected_at: float | None = None
        # Peers' own errors (`publish_error`): keys per trainer of this process, then per position; a peer's
        # record seen is adopted after a grace (`_check_errors`) unless this rank raises at that position
        # too. The store is the process group's, which a job's incarnation does not share with another
        # (`runtime._launch_group_store`; torch's own under torchrun, per attempt): not keyed by torchrun's
        # restart count, which is each agent's own (after one node's restart the nodes' counts differ, and
        # no rank saw a peer's error: gloo's "Connection closed by peer" instead).
        self._errors_prefix = f"{_PREFIX}raised/{next(_GENERATIONS)}/"
        # Where the training thread is: (step, block), the block counting the watched blocks (`active`) it
        # entered in that step (a step, then e.g. fit's save and evaluation, or a script's), alike on every
        # rank; a retried step or a second failure after a caught one is a new position.
        self._block, self._block_step = -1, None
        self._raised_at: tuple[int, int] | None = None  # the position this rank last raised at
        self._raised: set[tuple[int, int]] = set()  # every position this rank raised at
        self._log_read = 0  # entries of the errors' log read so far
        self._logged: list[tuple[int, int]] = []  # peers' positions this rank has not reached or judged yet
        self._pending: tuple[str, float, tuple[int, int]] | None = None  # (record, seen at, its position)
        self._adopting = threading.Lock()
        self._collective_failed_step: int | None = None  # the step in which a collective of this rank failed
        self._acknowledged = False
        self._busy = 0  # how deep the training thread is in `active()` blocks
        self._worker: int | None = None  # the training thread's ident (its stack is shown if it is stuck)
        self._step_since: tuple[int | None, float] = (None, 0.0)  # the step the watcher last saw, and since when
        self._found = threading.Event()
        self._stopped = threading.Event()
        # The torchrun agent that started this worker (its parent), watched each period (`_orphaned`).
        self._agent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._thread = threading.Thread(target=self._run, name="dt-peer-watch", daemon=True)

    # ------------------------------------------------------------ training thread
    def start(self) -> "PeerWatch":
        self.store.set(f"{_PREFIX}host/{self.rank}", f"{socket.gethostname()} pid {os.getpid()}")
        if self.store.check([f"{_PREFIX}left/{self.rank}"]):  # an earlier trainer of this process left
            self.store.delete_key(f"{_PREFIX}left/{self.rank}")
        self.store.add(self._alive(self.rank), 1)
        atexit.register(self.stop)
        self._thread.start()
        return self

    @contextlib.contextmanager
    def active(self):
        """The training thread runs the job's collectives in this block (a step, a checkpoint save):
        if it is still inside `exit_after` seconds after a failure was found, the process exits. Outside
        (a script's own work after training), a peer that ended without `stop` never ends this one."""
        if not self._busy:
            self._block, self._block_step = (self._block + 1, self.step) if self._block_step == self.step else (0, self.step)
            self._worker = threading.get_ident()
        self._busy += 1
        try:
            yield self
        finally:
            self._busy -= 1

    def raise_if_failed(self) -> None:
        """At a step boundary: raise the failure found so far, if any."""
        if self.failure is not None:
            self.acknowledge()
            raise self.failure

    def verdict(self, wait: float | None = None) -> PeerFailureError | None:
        """The failure, waiting up to `wait` seconds (default: `timeout` and two periods) for one: a
        collective that failed on a killed peer fails before the peer's silence is long enough. A peer's
        published error seen already is adopted at once (this rank's collective with it has failed)."""
        self._collective_failed_step = self.step  # a peer's error seen in this step is adopted without its grace
        self._adopt_pending(grace=0.0)
        if self.failure is None and self._thread.is_alive():
            self._found.wait(self.timeout + 2 * self.period if wait is None else wait)
        return self.failure

    def publish_error(self, err: BaseException) -> None:
        """This rank's training thread raised `err` of its own (not because of a peer): write it where the
        peers' watchers look for failures, so that a peer whose collective with this rank then fails (a
        closed connection) or waits (NCCL, or gloo while this process lives on) names this rank and its
        error within one period, instead of a closed connection without a name or a wait until the
        collective timeout. The record is a death's, with the error appended, under this position's key
        (the first rank to raise there is the one named), which the errors' log lists once."""
        position = self._position()
        first = position not in self._raised
        self._raised_at = position
        self._raised.add(position)
        self._pending = None
        text = " ".join(f"{type(err).__name__}: {err}".split())  # one line, no tabs
        text = text if len(text) <= 400 else text[:397] + "..."
        during = f" during {self.activity}" if self.activity is not None else ""
        record = "\t".join([str(self.rank), f"{socket.gethostname()} pid {os.getpid()}", "", "0", str(self.rank),
                            text + during])
        try:
            key = self._errors_key(position)
            if self.store.compare_set(key, "", record).decode() == record and first:  # the first to raise logs it
                entry = self.store.add(self._errors_prefix + "count", 1)
                self.store.set(f"{self._errors_prefix}log/{entry}", "%d.%d" % position)
        except Exception:
            pass  # the store is gone: so is the job

    def acknowledge(self) -> None:
        """The training thread raises the failure itself: the watcher need not end the process."""
        self._acknowledged = True

    def stop(self) -> None:
        """Stop beating and watching, and tell the peers this rank left on purpose. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        atexit.unregister(self.stop)
        try:
            self.store.set(f"{_PREFIX}left/{self.rank}", "1")
        except Exception:
            pass  # the store is gone already: so is the job
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 1)

    # ------------------------------------------------------------ watcher thread
    @staticmethod
    def _alive(rank: int) -> str:
        return f"{_PREFIX}alive/{rank}"

    def _run(self) -> None:
        seen: dict[int, int] = {}
        moved: dict[int, float] = {}
        while not self._stopped.wait(self.period):
            if self._orphaned():
                self._exit_orphan()
            try:
                self.store.add(self._alive(self.rank), 1)
                now = time.monotonic()
                if self.failure is None:
                    for peer in self.peers:
                        count = self.store.add(self._alive(peer), 0)  # reads without blocking
                        if count != seen.get(peer):
                            seen[peer], moved[peer] = count, now
                        elif count > 0 and now - moved[peer] > self.timeout and not self._left(peer):
                            self._declare(peer, now - moved[peer])
                            break
                if self.failure is None and self.store.check([_FAILURE_KEY]):
                    self._adopt(self.store.get(_FAILURE_KEY).decode())
                if self.failure is None:
                    self._check_errors()
                if self.failure is None and self._busy:
                    self._check_stuck(now)
            except Exception as err:  # the store stopped answering: the job is being torn down
                if self._orphaned():  # (or the agent that held it was killed: `_exit_orphan`)
                    self._exit_orphan()
                log.debug("rank %d: peer watch stopped: %s", self.rank, err)
                if self._busy and self.failure is None and self.exit_after is not None:
                    self._outlive_store()
                return
            if (self.failure is not None and not self._acknowledged and self._busy and self.exit_after is not None
                    and time.monotonic() - self._detected_at > self.exit_after):
                self._exit()

    def _left(self, peer: int) -> bool:
        return self.store.check([f"{_PREFIX}left/{peer}"])

    def left_early(self) -> PeerFailureError | None:
        """After a collective failed on a lost connection and no peer was found dead: a peer that left the
        job (its trainer closed, or its process ended: at exit, even after an error outside the trainer's
        steps, it marks itself gone) while this rank still needed it, or None. Every rank must run the same steps: one that stops early (``sys.exit()``, a loop
        over fewer batches) left gloo's bare "Connection reset" before."""
        try:
            gone = [r for r in range(self.world_size) if r != self.rank and self._left(r)]
            host = self._get(f"{_PREFIX}host/{gone[0]}") or "?" if gone else None
        except Exception:
            return None
        if not gone:
            return None
        where = (f" during {self.activity}" if self.activity is not None and self._busy
                 else f" during training step {self.step + 1}" if self.step is not None else "")
        message = (f"{self._name(self.rank)}: peer {self._name(gone[0])} (host {host}) left the job{where}: its "
                   "trainer closed or its process ended (sys.exit(), the end of its script, a loop over fewer "
                   "batches, or an error raised outside the trainer's steps: see that rank's output) while this "
                   "rank still needed it. Every rank must run the same steps and collective calls: give each as "
                   "many batches (fit does), or wrap a loop of your own in join()")
        job_rank = gone[0] if self._global is None else self._global[gone[0]]
        return PeerFailureError(message, job_rank, host, None, 0.0)

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _declare(self, peer: int, silent: float) -> None:
        host = self._get(f"{_PREFIX}host/{peer}") or "?"
        step = self._get(f"{_PREFIX}heartbeat/{peer}")  # `hangs.heartbeat`'s last published step
        self.store.set(_FAILURE_KEY, f"{peer}\t{host}\t{step or ''}\t{silent:.1f}\t{self.rank}")
        self._fail(peer, host, int(step) if step else None, silent, f"{self._name(self.rank)} saw it")

    def _position(self) -> tuple[int, int]:
        return (-1 if self.step is None else self.step, self._block)

    def _errors_key(self, position: tuple[int, int]) -> str:
        return "%s%d.%d" % (self._errors_prefix, *position)

    def _check_errors(self) -> None:
        """A peer's error published at a position this rank has reached: adopted one `timeout` after it was
        seen, unless this rank raises there too meanwhile (the same bad batch on every rank: each says its
        own; a rank that adopted and aborted there would be left broken for the steps after)."""
        if self._raised_here():
            self._pending = None
            return
        if self._pending is None:
            found = self._peer_error()
            if found is not None:
                self._pending = (*found[:1], time.monotonic(), found[1])
        failed_here = self._collective_failed_step is not None and self._collective_failed_step == self.step
        self._adopt_pending(grace=0.0 if failed_here else self.timeout)

    def stopped_with_peer(self) -> None:
        """This rank's step stopped because a peer's did, as designed (a pipeline's stop, heard by message):
        it raised at this position too, so the peer's record there is not adopted later (a retry after a
        failure every rank caught would otherwise end in `PeerFailureError`). Nothing is published."""
        position = self._position()
        self._raised_at = position
        self._raised.add(position)

    def _peer_error(self) -> tuple[str, tuple[int, int]] | None:
        """(record, position) of the earliest position a peer raised at that this rank has reached and did
        not raise at itself, or None: the errors' log read on from where the last call left it."""
        count_key = self._errors_prefix + "count"
        if not self.store.check([count_key]):  # (no write: a FileStore grows with every add)
            return None
        count = self.store.add(count_key, 0)
        while self._log_read < count:
            entry = self._get(f"{self._errors_prefix}log/{self._log_read + 1}")
            if entry is None:
                break  # being written: the next period reads it
            step, block = entry.split(".")
            self._logged.append((int(step), int(block)))
            self._log_read += 1
        here = self._position()
        for position in sorted(self._logged):
            if position > here:
                break  # not reached yet: this rank's collectives there will wait
            self._logged.remove(position)
            record = self._get(self._errors_key(position))
            if position not in self._raised and record and int(record.split("\t", 1)[0]) != self.rank:
                return record, position
        return None

    def _raised_here(self) -> bool:
        return self._raised_at is not None and self._raised_at == self._position()

    def _adopt_pending(self, grace: float) -> None:
        with self._adopting:
            pending = self._pending
            if (pending is None or self.failure is not None or time.monotonic() - pending[1] < grace
                    or self._raised_here()):
                return
            self._pending = None
            if pending[2] not in self._raised:  # (this rank raised there after the record was seen)
                self._adopt(pending[0])

    def _adopt(self, record: str) -> None:
        peer, host, step, silent, finder, *error = record.split("\t", 5)
        self._fail(int(peer), host, int(step) if step else None, float(silent), f"{self._name(int(finder))} saw it",
                   error[0] if error else None)

    def _name(self, member: int) -> str:
        """How messages name a member: its rank in the job (and its index among the watched ranks)."""
        if self._global is None:
            return f"rank {member}"
        return f"{self._member} {member} (rank {self._global[member]})"

    def _fail(self, peer: int, host: str, step: int | None, silent: float, who: str, error: str | None = None) -> None:
        where = (f" during {self.activity}" if self.activity is not None and self._busy
                 else f" during training step {self.step + 1}" if self.step is not None else "")
        if error is not None:
            message = (f"{self._name(self.rank)}: peer {self._name(peer)} (host {host}) raised {error}, so this rank's collectives "
                       f"with it cannot complete{where.replace(' during', '; this rank was in', 1)}. Its traceback is "
                       "in that rank's output")
        elif peer == self.rank:  # (a peer declared this rank dead, while it was alive: its heartbeat stalled)
            message = (f"{self._name(self.rank)}: the peers declared this rank dead ({who}): its heartbeat was not "
                       f"published for {silent:.1f}s (heartbeat_timeout={self.timeout:g}s){where}, while it was alive. "
                       "The heartbeat is a thread of this process: a call that holds Python's GIL that long (a C "
                       "extension: a tokenizer, a regular expression, pickling a large object; torch's operators "
                       "release it) stops it. Raise heartbeat_timeout above that call's time, or move the call out "
                       "of the training process (DataLoader workers)")
        else:
            # The heartbeat thread publishes the step every `hangs._Heartbeat.PERIOD_S`: the peer may have got further.
            last = f", last seen in step {step + 1} or later" if step is not None else ""
            message = (f"{self._name(self.rank)}: peer {self._name(peer)} (host {host}{last}) is dead: its heartbeat stopped "
                       f"{silent:.1f}s ago ({who}; heartbeat_timeout={self.timeout:g}s){where}. Its process was "
                       "killed, crashed, lost its node, stopped running (SIGSTOP, a frozen host) or held Python's GIL longer than that (a C extension's call: then raise heartbeat_timeout); under torchrun with --max-restarts the job restarts its "
                       "workers and resumes from the latest good checkpoint")
        job_rank = peer if self._global is None else self._global[peer]
        self.failure = PeerFailureError(message, job_rank, host, step, silent, error)
        self._detected_at = time.monotonic()
        self._found.set()
        log.error("%s", message)
        if self.on_failure is not None:
            try:
                self.on_failure(self.failure)
            except Exception as err:
                log.warning("rank %d: could not abort the process group after a peer failure: %s", self.rank, err)
