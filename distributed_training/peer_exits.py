"""How a rank's peer watch ends its process (`PeerWatch`'s part for it): where the training thread can never
get out by itself, ``os._exit(EXIT_CODE)`` after logging why and where that thread was. Four cases: a failure
found while the thread stays blocked in the job's work (`_exit`); the torchrun agent that started this worker
gone (`_exit_orphan`); the peers' collectives timed out waiting for this rank, stuck in its own code inside
a step (`_check_stuck`); the store gone while the thread stays in one step (`_outlive_store`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

from .hangs import stuck_key

__all__ = ["EXIT_CODE", "Endings"]

log = logging.getLogger("distributed_training")

# The exit status of a rank ended by its watcher (a peer died and the rank stayed blocked): EX_TEMPFAIL,
# "try again", which is what torchrun's restart does.
EXIT_CODE = 75


class Endings:
    """The process-ending half of `PeerWatch` (a mixin: the step, the store and the flags are its)."""

    def _check_stuck(self, now: float) -> None:
        """The training thread has been in one step for `timeout` seconds or more: read whether a peer's
        collective timed out waiting for it (`hangs.tell_stuck`), and if so end the process, showing where
        the training thread is."""
        step = self.step
        if step != self._step_since[0]:
            self._step_since = (step, now)
            return
        if step is None or now - self._step_since[1] < self.timeout:
            return
        record = self._get(stuck_key(self.rank))
        if record is None or record.split("\t")[0] != str(step):
            return
        by = int(record.split("\t")[1])
        self._end("%s: the collective of %s in training step %d timed out waiting for this rank, which is stuck "
                  "inside that step outside its collectives (its forward, loss or data, a slow read, a hung "
                  "kernel or device) and would never reach a step boundary to stop at. The training thread is "
                  "here:\n%sExiting with status %d", self._name(self.rank), self._name(by), step + 1,
                  self._worker_stack(), EXIT_CODE)

    def _outlive_store(self) -> None:
        """The store stopped answering while the training thread is inside the job's work: the process that
        held it ended (rank 0 without torchrun, after the job failed). If the training thread is still in
        the same step `exit_after` seconds later, it is stuck where no collective can fail (its peers are
        gone, and so is the store through which they would have said so): end the process."""
        step, since = self.step, time.monotonic()
        while not self._stopped.wait(self.period):
            if not self._busy or self.step != step:
                return
            if time.monotonic() - since > self.exit_after:
                where = f"training step {step + 1}" if step is not None else "the job's work"
                self._end("%s: the job's store stopped answering (the process that held it ended: the job failed or "
                          "was stopped) while this rank was in %s, where it still is %gs later, stuck outside any "
                          "collective. The training thread is here:\n%sExiting with status %d",
                          self._name(self.rank), where, self.exit_after, self._worker_stack(), EXIT_CODE)

    def _worker_stack(self) -> str:
        """The last frames of the training thread's stack, as a traceback shows them."""
        frame = sys._current_frames().get(self._worker) if self._worker is not None else None
        return "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(its stack is not readable)\n"

    @staticmethod
    def _end(message: str, *args) -> None:
        """Log `message` as an error and end the process with `EXIT_CODE` (``os._exit``: the training thread
        cannot be interrupted; logging's own flush is skipped, so the handlers are flushed first)."""
        log.error(message, *args)
        for handler in log.handlers + logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_CODE)

    def _orphaned(self) -> bool:
        return self._agent is not None and os.getppid() != self._agent

    def _exit_orphan(self) -> None:
        """The torchrun agent that started this worker is gone (SIGKILL, the OOM killer): it can no longer
        stop, restart or collect this worker, and its store is gone with it, so the watch would see nothing
        more; left alone, the worker trained on to the end as an orphan (holding its GPU and the checkpoint
        directory's lock against the job's next launch). End it, as the agent would have."""
        self._end("%s: the torchrun agent that started this worker (pid %d) is gone (killed: SIGKILL, the OOM "
                  "killer?): ending this orphaned worker, which no agent can stop or restart, with status %d. "
                  "Relaunch the job to resume from its last checkpoint", self._name(self.rank), self._agent,
                  EXIT_CODE)

    def _exit(self) -> None:
        self._end("%s. The training thread stayed blocked for %gs after the failure was found: exiting with "
                  "status %d", self.failure, self.exit_after, EXIT_CODE)
