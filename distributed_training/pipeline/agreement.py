"""Did the whole job fail, or one pipeline only? Asked after a pipeline's failed step or evaluation.

Within a pipeline a failure reaches every rank (stops, acknowledgements: `p2p`), and the pipeline goes
on. Ranks of the job outside it (its data-parallel replicas, its tensor-parallel peers) hear nothing: if
the same batch failed there too (a bad batch on every replica, a failure in every tensor peer's stage) they
raise as well, and the job goes on; if not, they are inside collectives with this pipeline's ranks
(a reduction, a tensor-parallel layer's all-reduce), which this pipeline's next call would pair with the
wrong ones: on gloo a silent mix of two steps (seen in a review: a tensor-parallel peer's evaluation
completed by this rank's next training step). So after a failure each rank counts itself in the
rendezvous store and waits until every rank of the job has counted itself for the same failure; if they
do not within `AGREE_S`, the pipeline refuses every later call (`FailureAgreement.check`): restart from a
checkpoint. Its error is published for the peer watch first (`Strategy.report_failure`), which ends the
others meanwhile (before the first training step no watch runs: they wait for the collective timeout).
Nothing is asked where the pipeline is the whole job, nor after a peer went away (the job is ending); a
timeout refuses the later calls at once.
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

__all__ = ["FailureAgreement", "AGREE_S"]

#: Seconds to wait for the job's other ranks to fail too (their peer watch ends a rank blocked with this
#: pipeline within ``heartbeat_timeout`` + ``max(10, 2 * heartbeat_timeout)`` seconds: 15 s by default).
AGREE_S = 30.0

_setups = itertools.count()  # one per pipeline built in this process: alike on every rank (same order)


class FailureAgreement:
    def __init__(self, pipeline_size: int) -> None:
        self.needed = dist.get_world_size() > pipeline_size
        self.key = f"distributed_training/pipeline_failures/{next(_setups)}/"
        self.failures = 0
        self.broken: str | None = None

    def check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def after(self, err: BaseException, what: str, report=None) -> None:
        """This rank's `what` (``"training step"``, ``"evaluate()"``) raised `err`: wait for the job's
        other ranks to raise too, or raise, and refuse every later call. `report(err)` publishes the error
        for the peer watch first (`Strategy.report_failure`), so that a peer blocked with this rank is
        ended meanwhile."""
        from ..hangs import _store, is_timeout
        from ..peer_watch import PeerFailureError, looks_like_peer_loss

        if not self.needed or not isinstance(err, Exception):
            return
        if is_timeout(err):  # a peer never came: its collectives and this rank's are out of step for good
            self.broken = (f"{what} timed out waiting for a peer ({err}): the ranks' collectives are out of step, "
                           "so the pipeline refuses every further call: restart from the latest checkpoint")
            return
        if isinstance(err, PeerFailureError) or getattr(err, "peer_lost", False) or looks_like_peer_loss(err):
            return
        store = _store()
        if store is None:
            return
        if report is not None:
            report(err)
        self.failures += 1
        key, world = f"{self.key}{self.failures}", dist.get_world_size()
        count, deadline = store.add(key, 1), time.monotonic() + AGREE_S
        while count < world and time.monotonic() < deadline:
            time.sleep(0.01)
            count = store.add(key, 0)
        if count < world:
            self.broken = (f"{what} failed on {count} of the job's {world} ranks only (this one's error: {err}): the "
                           "others did not, so they may be inside collectives with this pipeline's ranks, which a "
                           "later call would pair with the wrong ones. The pipeline refuses every further call: "
                           "restart from the latest checkpoint (the other ranks are ended by the peer watch)")
            raise RuntimeError(self.broken) from err
