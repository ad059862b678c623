"""The trainer's watch over its peers (`DistributedTrainer`'s part for it): the heartbeat and `PeerWatch`
started at the first step or collective call (an evaluation, a save, ``full_state_dict()``), the
collectives of a step run under the watch, an error from a dead (or failed) peer turned into
`PeerFailureError`, this rank's own error published for its peers, and NCCL collectives aborted when the
watcher finds a peer dead or failed."""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from .hangs import (CollectiveTimeoutError, _store as _default_store, block_activities_or_steps,
                    diagnose_block_timeout, is_timeout, publish_block)
from .peer_watch import PeerFailureError, PeerWatch, looks_like_peer_loss
from .pipeline.p2p import PipelineAborted

__all__ = ["PeerWatching"]


class PeerWatching:
    """Mixed into `DistributedTrainer`; uses its ``context``, ``heartbeat_timeout`` and ``_watch``."""

    # Seconds after a peer's death is found before a rank still blocked in the job's work exits
    # (`PeerWatch`'s exit_after). None, the default: max(10, 2 * heartbeat_timeout). For tests only, which
    # set it on a trainer before its first step so as not to sit through the 10 s.
    _peer_exit_after: float | None = None

    def _peer_watch(self) -> PeerWatch | None:
        """This rank's heartbeat and watch over its peers (`heartbeat_timeout`), started at the first step or
        collective call.
        Independent ranks (a parameter server's workers under ssp / async) watch nobody: a peer that
        dies is dropped by the servers, and the others go on."""
        if (self._watch is None and self.heartbeat_timeout is not None and self.context.world_size > 1
                and not self.context.independent):
            store = _default_store()
            if store is None:
                return None
            timeout = float(self.heartbeat_timeout)
            exit_after = max(10.0, 2 * timeout) if self._peer_exit_after is None else self._peer_exit_after
            # A role's group (a parameter server's workers) watches its members by their index in it, and
            # names them by their rank in the job, as the log prefixes do.
            members = (dist.get_process_group_ranks(self.context.group) if self.context is not self.job_context
                       else None)
            self._watch = PeerWatch(store, self.context.rank, self.context.world_size, timeout,
                                    exit_after=exit_after, on_failure=self._abort_collectives,
                                    global_ranks=members).start()
        return self._watch

    def _failed(self, err: Exception) -> None:
        """The job's collectives (a step, an evaluation, a checkpoint save) raised `err` on this rank. Raise
        `PeerFailureError` if a peer's death or error caused it (`_raise_if_peer_died`). Else, if it is
        this rank's own error (not a timeout or a closed connection, which a peer causes), publish it
        (`PeerWatch.publish_error`): the peers, left inside collectives this rank will not join, then
        raise an error naming this rank and its error rather than gloo's nameless "connection closed",
        and on NCCL they are woken instead of waiting for the collective timeout."""
        if isinstance(err, RuntimeError):
            self._raise_if_peer_died(err)
        self._publish_own_error(err)

    def _publish_own_error(self, err: BaseException, activity: str | None = None) -> None:
        """Publish `err` for the peers (`PeerWatch.publish_error`) unless a peer caused it (a lost peer, a
        failure found) or it is no error of the job's (Ctrl-C, an exit). Where this rank
        published at this position already (inside a step), the first record stays: `activity` only says
        where an error raised outside the watched blocks was (fit's logging, `on_step`)."""
        watch = self._watch
        if watch is not None and isinstance(err, PipelineAborted) and getattr(err, "stopped_by_peer", False):
            watch.stopped_with_peer()  # (its peer published its own error: not to be adopted on a retry)
        if (watch is None or watch.failure is not None or not isinstance(err, Exception) or looks_like_peer_loss(err)
                or isinstance(err, (PeerFailureError, PipelineAborted))):
            return
        if activity is not None:
            watch.activity = activity
        watch.publish_error(err)

    def _raise_if_peer_died(self, err: RuntimeError) -> None:
        """Raise `PeerFailureError` (from `err`) if `err` came from a dead peer, as the watcher finds.

        A collective on a killed peer fails at once, without naming it: wait for the watcher's verdict
        (up to `heartbeat_timeout`). One that timed out has given the watcher its whole timeout
        already: take what it knows."""
        watch = self._watch
        if getattr(err, "names_lost_peer", False):
            return  # e.g. the parameter server's WorkerLostError (sync): it names the dead worker, raised as it is
        if watch is None or (not looks_like_peer_loss(err) and (watch.failure is None or watch.failure.error)):
            # After a peer's death any error is its consequence (an aborted NCCL group's too); after a peer's
            # own error, only those of a lost peer: this rank may have raised the same error itself.
            return
        failure = watch.verdict(wait=0 if is_timeout(err) else None)
        if failure is not None:
            watch.acknowledge()
            raise failure from err

    @contextlib.contextmanager
    def _watched(self, activity: str, call: bool = False):
        """A block of the job's collectives outside a step (an evaluation, a checkpoint save, a gather), under
        the peer watch, its error handled as a step's (`_failed`): a peer's death or error is named within
        seconds instead of a hang (NCCL) or a nameless closed connection (gloo), and this rank's own error
        is published for its peers. A failure found already raises at once, as at a step's start. Inside a
        watched block already (fit's save calls `save_checkpoint`), that block's handling is the one.
        `call`: a collective call the user makes (a save, an evaluation, ``full_state_dict()``), said in the
        rendezvous store while it lasts, so that a timeout there, or in the step its peers went on to,
        names where each rank is (such a call made on rank 0 only waited for the collective timeout and
        said only "never reached step N")."""
        if call:
            self._peer_watch()  # (started here too: a call before the first step, failing on some ranks only)
            self._failure_agreement.check(self._watch)  # an earlier failed call: every rank's?
        if self._watch is None or self._watch._busy:
            try:
                yield
            except Exception as err:
                if call and self._watch is None:
                    self._failure_agreement.failed(err, activity)
                raise
            self._synced_at = time.monotonic()
            return
        self._watch.raise_if_failed()
        if call:
            publish_block(self.context, activity)
        with self._watching(activity):
            try:
                yield
            except Exception as err:
                self._failed(err)  # (inside the block: a failure found meanwhile is said during `activity`)
                if call:
                    self._failure_agreement.failed(err, activity)
                # (left published: the peers' own timeouts read it after this one). gloo closes the
                # connection of a collective that timed out: the rank whose wait ended second sees that.
                if call and (is_timeout(err) or (looks_like_peer_loss(err) and any(
                        a != activity for r, a in block_activities_or_steps(self.context).items()))):
                    raise CollectiveTimeoutError(diagnose_block_timeout(self.context, self.step, activity,
                                                                        err)) from err
                if call:
                    publish_block(self.context, "")
                raise
            except BaseException:  # (Ctrl-C, an exit: not a place to report)
                if call:
                    publish_block(self.context, "")
                raise
            if call:
                publish_block(self.context, "")
        self._synced_at = time.monotonic()  # (the block's collectives done with the peers)
        # A failure found during the block: on NCCL the watcher aborted the group, and a collective waiting
        # for the failed peer then ends without an error, its output this rank's own values (an evaluation
        # returned this rank's sums as the job's, on 2x H200): nothing the block made can be used. (gloo's
        # are never aborted: a block that ended there did its collectives; the next call raises.)
        if self.context.backend == "nccl":
            self._watch.raise_if_failed()

    @contextlib.contextmanager
    def _fetching(self, sharded: bool):
        """`fit` reads its data in this block: an error of the data (a corrupt sample, a collate that
        raises, a dataset's own connection reset) is published where the peers wait for this rank next,
        so that they name it and its error instead of waiting for a closed connection or the collective
        timeout: the agreement on a batch (a loader `fit` does not shard), else the straggler probe when
        one is due, else the next training step."""
        try:
            yield
        except Exception as err:
            watch = self._watch
            if watch is not None and watch.failure is None:  # (after a peer's failure: its consequence)
                probe = self._probe_due()
                if sharded and not probe:
                    watch.step = self.step  # (what `train_step` sets before its block)
                with self._watching(f"loading its batch for training step {self.step + 1}"):
                    watch.publish_error(err)  # (its own, whatever it says: not a collective's lost peer)
            raise

    def _watching(self, activity: str | None = None):
        """A block of the job's collectives, under the peer watch if there is one (`PeerWatch.active`);
        `activity` says what it is in a dead peer's message ("training step 5")."""
        if self._watch is None:
            return contextlib.nullcontext()
        self._watch.activity = activity
        return self._watch.active()

    def _drain_watched(self) -> Exception | None:
        """At `close`, on a GPU: wait for this rank's queued work under the watch. Its host may have run
        steps ahead of its collectives (nothing in a step waits for the GPU), so a peer that raised or died
        in those steps is found here, and named (the error returned), instead of a hang in whatever waits
        for the GPU next (the process group's destruction). A failure the script was told of already is
        not returned again (`close` then waits for nothing)."""
        watch = self._watch
        if watch is None or self.device.type != "cuda" or (watch.failure is not None and watch._acknowledged):
            return None
        try:
            with self._watched("closing the trainer (the last steps' collectives)"):
                self._wait_for_device()
            watch.raise_if_failed()
        except Exception as err:
            return err
        return None

    def _wait_for_device(self) -> None:
        """Wait until this rank's GPU has done what is queued: polled, so that the training thread is never
        blocked in the driver while the watcher aborts NCCL, and leaves as soon as a peer's failure is found."""
        import torch

        done = torch.cuda.Event()
        done.record()
        while not done.query() and (self._watch is None or self._watch.failure is None):
            time.sleep(0.002)

    def _abort_collectives(self, failure: PeerFailureError) -> None:
        """On the watcher's thread, when a peer is dead: abort an NCCL process group, which makes a
        collective waiting for the peer return with an error. gloo's abort does not wake a blocked
        collective (measured), so a gloo group is left for the watcher's exit (see `peer_watch`)."""
        if self.context.backend == "nccl":
            import torch.distributed as dist

            dist.distributed_c10d._abort_process_group()
