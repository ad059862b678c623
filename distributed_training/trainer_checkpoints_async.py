"""The trainer's checkpoints written in the background (``checkpoint_async``): `fit`'s numbered
checkpoints, copied to host memory at the checkpoint step and written by a thread while training goes on.

A mixin of `DistributedTrainer`, under `trainer_checkpoints.Checkpointing`, whose synchronous path
(`save_checkpoint`) writes the same files in the same format. At the checkpoint step the state is
snapshotted into reused pinned host buffers (`HostStaging`: parameters and optimizer state on a side
stream while the next step runs, buffers and metrics before it), and no collective runs after the
first background checkpoint's (`_background_token`): a collective's result is read on the host, which
would wait for the step's queued kernels. The thread
streams this rank's file to disk and hashes it on the way (`atomic_save`); the ranks exchange their
digests and summaries through the rendezvous store (`DigestExchange`), and each directory's writer
writes ``meta.pt`` last, so a checkpoint whose write did not complete is never resumed from. A
checkpoint waits for the previous one's write (and says so when that slows training); a write that
failed raises `CheckpointWriteError` at the next step, at `wait_for_checkpoint` or at `close`. The
machinery is in `distributed_training.checkpoint_async`.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import atomic_save, write_meta
from .mesh import global_rank
from .checkpoint_async import (BackgroundWrite, CheckpointWriteError, DigestExchange, HostStaging, default_store,
                               host_copy, rank_file)
from .checkpoint_shards import host_clone, summary
from .logs import get_logger

__all__ = ["BackgroundCheckpointing"]

log = get_logger()

# A wait for the previous background write that is not worth a warning: under this many seconds, or
# under this share of the training time between the two checkpoints (what the wait slows training by).
_NEGLIGIBLE_WAIT_S = 0.1
_NEGLIGIBLE_WAIT_SHARE = 0.05


class BackgroundCheckpointing:
    """`DistributedTrainer`'s background checkpoint methods (the base of `Checkpointing`, whose
    `_rank_part`, `_layout` and `_meta` they build the snapshot with)."""

    def _save_in_background(self, path: str, metrics: dict[str, Any]) -> None:
        """`fit`'s numbered checkpoint with ``checkpoint_async``: snapshot now, write in a thread (see
        `distributed_training.checkpoint_async`). Waits for the previous write first (and says so).
        `metrics`: floats or 0-dim tensors (copied with the snapshot, read by the writer thread)."""
        ctx = self.context
        previous = self._checkpoint_write
        if previous is not None:
            if not previous.done():
                started = time.perf_counter()
                training = started - previous.started  # the steps trained while it was being written
                previous.wait()
                waited = time.perf_counter() - started
                if waited >= _NEGLIGIBLE_WAIT_S and waited >= _NEGLIGIBLE_WAIT_SHARE * training:
                    # previous.seconds (set before wait() returns): the write's whole duration, from its start.
                    log.warning("rank %d: the checkpoint of step %d waited %.2f s for the background write of step "
                                "%d, which took %.2f s in all while %d step(s) trained in %.2f s: checkpoints come "
                                "faster than they are written; raise checkpoint_every", ctx.rank, self.step,
                                min(waited, previous.seconds or waited),  # (a loaded host wakes this a bit after the end)
                                previous.step, previous.seconds, self.step - previous.step, training)
            self._checkpoint_write = None
            previous.raise_error()
        if self._staging is None:
            self._staging = HostStaging()
        staging = self._staging
        staging.begin()
        # Parameters and optimizer state are copied on a side stream while the next step runs (the
        # optimizer's next step waits for the copies); buffers, which the next forward changes, and the
        # metrics are copied on the compute stream before it.
        held, packed, part = self._rank_part(staging, buffers_to_host=staging.now)
        # What is not copied by the staging yet: small values that training goes on changing in place.
        # (The RNG states are fresh objects already; optim_scalars went through the staging.)
        part = {k: v if k in ("params", "optim", "optim_scalars", "buffers", "rng", "epoch_rng") else host_copy(v, host_clone)
                for k, v in part.items()}
        metrics = {k: staging.now(v) if torch.is_tensor(v) else v for k, v in metrics.items()}
        ready = staging.ready(self.optimizer)
        # No collective here: one would read its result on the host and so wait for the device (all the
        # step's queued kernels). The checkpoint's name in the store is this incarnation's (agreed once,
        # at its first background checkpoint) plus a count; what each rank holds goes through the store
        # too, read by the directory's writer in its thread.
        token = self._background_token()
        layout = self._layout(path)
        rank, writer = ctx.rank, layout.writer_of[ctx.rank] == ctx.rank
        exchange = DigestExchange(default_store() if ctx.world_size > 1 else None, rank, ctx.world_size)
        mine = (summary(packed), sorted(part["buffers"]), self.dp_rank)
        exchange.publish_summary(token, mine)
        if self._background_count > 2:
            exchange.forget(f"{self._background_id}.{self._background_count - 2}")
        meta = host_copy(self._meta(held, packed, None, None), host_clone) if writer else None
        param_groups = packed["param_groups"]
        manager, step = self.checkpoints, self.step
        os.makedirs(path, exist_ok=True)

        def job(stop) -> None:
            file = rank_file(path, rank)
            try:
                if ready is not None:
                    ready.synchronize()  # the device-to-host copies of the snapshot are done
                if stop.is_set():
                    exchange.publish_error(token, "the write was abandoned")
                    return
                # Streamed into the file and hashed on the way: the GIL is held for the pickled
                # skeleton only, and the bytes are never copied in memory (`atomic_save`).
                digest = atomic_save(part, file)
            except BaseException as err:
                message = f"rank {rank}: writing checkpoint file {file!r} (step {step}) failed: {type(err).__name__}: {err}"
                exchange.publish_error(token, message)
                raise CheckpointWriteError(message) from err
            exchange.publish(token, digest)
            values = {k: float(v) for k, v in metrics.items()}
            if not writer:
                return
            digests = exchange.collect(token, path, stop)
            meta.update(self._meta_ranks(exchange.collect_summaries(token, path, stop), param_groups))
            meta["metrics"] = values
            meta.update(layout.checksums(rank, digests))
            try:
                write_meta(meta, path)
            except BaseException as err:
                raise CheckpointWriteError(f"rank {rank}: writing {os.path.join(path, 'meta.pt')!r} (step {step}) "
                                           f"failed: {type(err).__name__}: {err}") from err
            manager.finalize(step, values)

        self._checkpoint_write = BackgroundWrite(step, path, job)

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background (``checkpoint_async``) is complete
        on every rank; raise `CheckpointWriteError` (naming the file) if its write failed here, or
        saying so if it failed on another rank. `fit` calls it before returning, `close` too. With
        ``checkpoint_async``, every rank must call it (one all-reduce: a rank's own write ends before
        the writer's ``meta.pt``, which this also waits for)."""
        write, self._checkpoint_write = self._checkpoint_write, None
        error = None
        if write is not None:
            write.wait()
            error, write.error = write.error, None
        if self.checkpoint_async and self.context.world_size > 1:
            if not self.context.every_rank(error is None) and error is None:
                where = f"checkpoint {write.path!r} (step {write.step})" if write is not None else "a checkpoint"
                error = CheckpointWriteError(f"rank {self.context.rank}: {where} was not completed: the background "
                                             "write failed on another rank (its error names the file)")
        if error is not None:
            raise error

    def _check_checkpoint_write(self) -> None:
        """At each step: raise the error of a background write that has failed (it does not wait)."""
        write = self._checkpoint_write
        if write is not None and write.done():
            self._checkpoint_write = None
            write.raise_error()

    def _abandon_checkpoint_write(self) -> None:
        """On an error in training: stop the background write at its next file boundary (what was not
        completed stays without meta.pt, so it is never resumed from), reporting rather than raising
        an error of its own."""
        write, self._checkpoint_write = self._checkpoint_write, None
        if write is None:
            return
        write.abandon()
        if write.error is not None:
            log.error("rank %d: %s", self.context.rank, write.error)

    def _background_token(self) -> str:
        """The name of this background checkpoint in the rendezvous store, the same on every rank: an id
        of this incarnation of the job (rank 0's draw, broadcast at the first background checkpoint: the
        only collective of the later ones' snapshots) and a count (every rank checkpoints at the same
        steps). A restarted job draws a new id, so values a previous incarnation left in the store are
        never taken for this one's."""
        if self._background_id is None:
            drawn = [uuid.uuid4().hex]
            if self.context.world_size > 1:
                dist.broadcast_object_list(drawn, src=global_rank(self.context.group, 0), group=self.context.group)
            self._background_id, self._background_count = drawn[0], 0
        self._background_count += 1
        return f"{self._background_id}.{self._background_count}"
