"""Giving back what a `DistributedTrainer` holds (a mixin of it, and its constructor's guard): at `close`,
the trained weights to the model you passed, the peer watch, a background checkpoint write, the
checkpoint directory's lock, the monitor's files, the strategy's hooks and the process group it
created; and, when the constructor raises, what it had set up by then."""

from __future__ import annotations

import contextlib
import functools
import sys

from .activation import restore_key_value_cache
from .checkpoint_async import CheckpointWriteError
from .hangs import stop_heartbeat

__all__ = ["Closing", "released_if_it_raises"]


def released_if_it_raises(init):
    """`DistributedTrainer.__init__`, which, when it raises, gives back what it had set up: the process
    group it created and the monitor's files (a script or notebook that catches the error, a dtrain run
    refused by its config, can build another trainer; the group stayed initialised)."""

    @functools.wraps(init)
    def constructed(self, *args, **kwargs) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            monitor = getattr(self, "monitor", None)
            if monitor is not None:
                with contextlib.suppress(Exception):
                    monitor.close()
            context = getattr(self, "job_context", None) or getattr(self, "context", None)
            if getattr(self, "_owns_context", False) and context is not None:
                context.shutdown(barrier=False)  # (the peers may never get this far)
            raise

    return constructed


class Closing:
    """`close` and the context manager, on the trainer's strategy, model, monitor, watch and context."""

    def close(self, barrier: bool = True) -> None:
        """Wait for a checkpoint being written in the background (``checkpoint_async``; abandon it when
        closing on an error, ``barrier=False``), remove the strategy's hooks and, if the trainer created
        it, destroy the process group. A background write that failed raises `CheckpointWriteError`
        here, after the rest is closed. Watching the peers stops first (this rank's leaving is not
        a death); on a GPU, this rank's queued work is waited for before, under the watch, so that a
        peer that raised or died in the last steps (which the host ran ahead of) raises
        `PeerFailureError` naming it here, after the rest is closed, instead of a hang. Under ZeRO-2/3,
        FSDP and tensor parallelism a clean close (every rank) gathers the trained weights back into the
        model you passed (its own modules in place of the parallel layers), whole on every rank, so that
        its ``state_dict()``, ``save_pretrained()`` or a plain forward work (where they fit a GPU's free
        memory; not with ``cpu_offload``, nor under a pipeline, whose ranks hold their stages: a warning
        says so).

        Called while an exception propagates (``try: trainer.fit(...) finally: trainer.close()``) or
        after a `train_step` that raised, it does not wait for the peers (as ``barrier=False``): they may
        be inside the failed step's collectives, which this rank's barrier would never answer, and the
        job would hang until the collective timeout instead of failing. A second call does nothing; any
        other use of the trainer after it raises (`_check_open`)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if barrier and (self._step_failed or sys.exc_info()[0] is not None):
            barrier = False
        error = self._drain_watched() if barrier else None  # a peer's failure in the last steps, named
        # (a failed peer joins nothing)
        barrier = barrier and error is None and (self._watch is None or self._watch.failure is None)
        if barrier:  # every rank is here: the model you passed gets its full weights back (ZeRO-2/3, FSDP)
            try:
                with self._watched("closing the trainer (the model's weights given back)"):
                    self.strategy.give_back(self.model)
            except Exception as err:  # (a peer failed meanwhile: named; the rest still closes)
                error, barrier = err, False
        if self._watch is not None:
            self._watch.stop()  # first: the peers must not take this rank's leaving for a death
        stop_heartbeat()  # no daemon thread may be inside a store call when the process exits
        if barrier and self.checkpoint_async:  # every rank closes: the wait agrees on the outcome
            try:
                self.wait_for_checkpoint()
            except CheckpointWriteError as err:
                error = err
        else:
            self._abandon_checkpoint_write()
        self._unlock_checkpoint_directory()  # after the last write: another run may start on the directory
        self.monitor.close()
        self.strategy.teardown(self.model)
        if getattr(self, "_checkpointed_model", None) is not None:
            restore_key_value_cache(self._checkpointed_model)
        if self._owns_context:
            self.job_context.shutdown(barrier=barrier)
        if error is not None:
            raise error

    def _check_open(self, what: str) -> None:
        """Refuse `what` on a closed trainer: its hooks, monitor and process group are given back, so a step
        trained on silently in one process (the model you passed changed) and failed with torch's "process
        group has not been initialized" under torchrun."""
        if self._closed:
            raise RuntimeError(f"{what} after close(): this DistributedTrainer is closed (its process group, "
                               "hooks and monitor were given back); build a new one to go on training")

    def __enter__(self) -> "Closing":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(barrier=exc_type is None)
