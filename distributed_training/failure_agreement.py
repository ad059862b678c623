"""After a failed call, did every rank of the job fail it? Asked before this rank's next call.

A loop that catches a failed `train_step` (or `evaluate`, a save, ``full_state_dict()``) on every rank
and goes on is supported: every rank dropped the same work. If only some ranks raised, the others are
inside collectives with them (an all-reduce of the failed step, a tensor-parallel layer's, the next
step's), and the failed ranks' next call would pair its collectives with those: on gloo a silent mix of
two steps, or a collective mismatch (seen in trials: one rank completed two "ok" steps 5.2e-2 off one
process; a tensor-parallel peer's evaluation completed by its peer's next training step). So a failed
call counts itself in the rendezvous store (one ``add``, no wait: a job that ends on the error ends at
once), and the next call first waits until every rank of the job has counted the same failure
(`FailureAgreement.check`). If they have not within `AGREE_S`, or a peer is found dead meanwhile, the
trainer refuses that call and every later one: restart from the latest checkpoint (the failed rank's
error, published for the peer watch, ends the others). A pipeline's own ranks always fail together
(`pipeline.p2p`); its data-parallel replicas and tensor-parallel peers only if the same batch fails there.

Not counted: a peer's death or error adopted (`PeerFailureError`, a pipeline's peer gone), Ctrl-C.
Independent ranks (a parameter server's workers under ssp / async) never agree. A rank that fails the
same call more than `AGREE_S` later than another (a bad sample far into its shard) is taken for one that
did not fail: the earlier rank refuses.
"""

from __future__ import annotations

import itertools
import time

__all__ = ["FailureAgreement", "AGREE_S"]

#: Seconds the next call waits for the job's other ranks to have failed too (a rank blocked with this one
#: is ended by its peer watch within ``heartbeat_timeout`` + ``max(10, 2 * heartbeat_timeout)`` seconds).
AGREE_S = 30.0

_trainers = itertools.count()  # one per trainer of this process: alike on every rank (built in the same order)


class FailureAgreement:
    def __init__(self, world_size: int, independent: bool) -> None:
        self.world = world_size
        self.needed = world_size > 1 and not independent
        self.key = f"distributed_training/failures/{next(_trainers)}/"
        self.failures = 0
        self.pending: tuple[str, str, str] | None = None  # (store key, what failed, its error) to agree on
        self.refusal: str | None = None

    def failed(self, err: BaseException, what: str) -> None:
        """This rank's `what` (``"training step 5"``) raised `err`: count it (no wait)."""
        from .hangs import _store
        from .peer_watch import PeerFailureError

        if not self.needed or not isinstance(err, Exception) or self.refusal is not None:
            return
        # (By type, not by text: an error of the user's own that mentions a timeout or a peer is counted,
        # as every rank that raised it counts it. A collective's timeout or a lost connection is counted
        # too: the peer that never came does not count, so the next call refuses.)
        if isinstance(err, PeerFailureError) or getattr(err, "peer_lost", False):
            return
        store = _store()
        if store is None:
            return
        self.failures += 1
        key = f"{self.key}{self.failures}"
        try:
            store.add(key, 1)
        except Exception:  # the store's host is gone (rank 0's process, its node's agent): `check` refuses
            pass
        self.pending = (key, what, str(err).splitlines()[0][:300] if str(err) else type(err).__name__)

    def check(self, watch=None) -> None:
        """Before a call: raise RuntimeError if an earlier failure was not every rank's (waiting up to
        `AGREE_S` for the others to count theirs, less if `watch` finds a peer dead or failed)."""
        if self.pending is not None:
            from .hangs import _store

            key, what, error = self.pending
            self.pending = None
            store = _store()
            if store is not None:
                try:
                    count, deadline = store.add(key, 0), time.monotonic() + AGREE_S
                    while (count < self.world and time.monotonic() < deadline
                           and (watch is None or watch.failure is None)):
                        time.sleep(0.01)
                        count = store.add(key, 0)
                except Exception as err:
                    self.refusal = (f"{what} failed (this rank's error: {error}), and the job's rendezvous store "
                                    f"cannot be reached ({err}): its host (rank 0, or its node's torchrun agent) may "
                                    "have ended, and whether every rank failed it cannot be learnt. The trainer "
                                    "refuses this call and every later one: restart the job from the latest "
                                    "checkpoint")
                    raise RuntimeError(self.refusal) from err
                if count < self.world:
                    self.refusal = (f"{what} failed on {count} of the job's {self.world} ranks only (this one's "
                                    f"error: {error}): the others may be inside collectives with this rank, which "
                                    "a later call would pair with the wrong ones. The trainer refuses this call "
                                    "and every later one: restart from the latest checkpoint (the other ranks "
                                    "are ended by the peer watch)")
        if self.refusal is not None:
            raise RuntimeError(self.refusal)
