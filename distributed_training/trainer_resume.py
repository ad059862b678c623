"""Where `fit` starts: the latest good checkpoint in `checkpoint_dir` (``resume``), or step 0 with an earlier
run's checkpoints moved aside (``resume=False``), under the directory's run lock.

``resume=False`` means "not from an earlier run": when torchrun restarts this run's workers (a rank died,
``--max-restarts``, or the job's membership changed), the new ones resume from the run's own checkpoints, as
with ``resume=True`` (they had started over from step 0 at every restart, the work lost; a trial). Which
checkpoints are the run's own: at its fresh start the first rank draws a random token and leaves it in
torchrun's rendezvous store, which lives as long as the launch (its agent's store, shared with the
workers since torch 2.4), and each directory's writer writes it into `RUN_MARKER`. A later start finds the
same token in both only within that launch: a new launch (whatever its ``--rdzv-id``, whose default is
"none") has a new store, and a second trainer of the same script has a key of its own. The decision is the
first rank's, told to all. Where the workers keep a store of their own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``)
it is gone at a restart, and the restart starts fresh, as before.

A mixin of `DistributedTrainer` (under `trainer_checkpoints.Checkpointing`). The resume point is one step for
every rank: with one shared directory the first rank picks it and broadcasts it (a read that failed on one
rank only must not make it load an older step than its peers); with a directory per node the nodes agree on
the newest step intact and whole between them (`checkpoint_layout.agree_on_checkpoint`), and each node is
brought the rank files it lacks. The lock that keeps two runs out of one directory is `checkpoint_lock`'s.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import uuid
from typing import Any

import torch.distributed as dist

from .checkpoint_layout import agree_on_checkpoint, fetch_missing_files
from .checkpoint_lock import (CheckpointDirectoryInUseError, in_use_message, lock_directory, unlock_directory,
                              write_problem)
from .hangs import _store
from .logs import get_logger
from .mesh import global_rank

__all__ = ["Resuming", "RUN_MARKER"]

log = get_logger()

#: In `checkpoint_dir`: the token of the ``resume=False`` run whose checkpoints the directory holds.
RUN_MARKER = ".run_id"

_RUNS = itertools.count()  # resume=False trainers of this process, in the order they first fit (alike on all ranks)


def _launch_store() -> Any:
    """The rendezvous store under every prefix (the group's: `runtime._launch_group_store`)."""
    store = _store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class Resuming:
    """`DistributedTrainer`'s choice of where `fit` starts, and its hold on `checkpoint_dir`."""

    def _resume_or_start_fresh(self) -> str | None:
        """Load the latest good checkpoint if resuming (returning its path), or, with ``resume=False``
        at the start of training, move an earlier run's checkpoints aside."""
        if self.checkpoints is None:
            return None
        self._lock_checkpoint_directory()
        self._write_problems = self._gather_write_problems()
        ctx = self.context
        if not self.resume and not self._restarted_fresh_run():
            self._check_checkpoint_directory_writable()  # (before anything is moved or written there)
            self._set_checkpoints_aside("resume is off")
            return None
        found = self._resume_point()
        if found is None and self.step == 0:
            # Every checkpoint there failed its check (each said why): not resumable, and not to be mixed
            # with this run's (keep-last-N would delete the new ones in favour of their later steps).
            self._check_checkpoint_directory_writable()
            self._set_checkpoints_aside("resume found no intact checkpoint (each one skipped is said above)")
        if found is None or int(found[1]["step"]) <= self.step:
            return None
        if found[2] is not None:  # a directory per node: bring each node the rank files it lacks
            fetch_missing_files(found[0], self.context, self._layout(found[0]), found[2], self.strategy.name)
        self.load_checkpoint(found[0])
        if ctx.is_main:
            log.info("resumed from step %d (%s)%s", self.step, found[0], "" if self.resume else
                     ": resume is off, but torchrun restarted this run's workers, and these checkpoints are "
                     "the run's own")
        return found[0]

    def _restarted_fresh_run(self) -> bool:
        """Whether this start is torchrun's restart of a ``resume=False`` run that began in this directory
        (the first rank's verdict, told to every rank): it then resumes from the run's own checkpoints."""
        if self.step != 0 or self._set_aside:
            return False
        ctx, key = self.context, self._run_key()
        token = None
        if ctx.rank == 0:
            store = _launch_store()
            try:
                token = store.get(key).decode() if store is not None and store.check([key]) else None
            except Exception:  # (a store without the key's check, or gone)
                token = None
        writer = self._layout(self.checkpoints.path_for(0)).writer_of[ctx.rank] == ctx.rank
        marker = None
        if writer:
            try:
                with open(os.path.join(self.checkpoints.directory, RUN_MARKER)) as f:
                    marker = f.read().strip()
            except OSError:
                marker = None
        seen = [(token, marker)]
        if ctx.world_size > 1:
            seen = [None] * ctx.world_size
            dist.all_gather_object(seen, (token, marker), group=ctx.group)
        token = seen[0][0]
        # (A directory per node: a replaced node's writer has none, the others the token.)
        return token is not None and any(m == token for _, m in seen)

    def _run_key(self) -> str:
        if self._fresh_run_key is None:
            where = hashlib.sha1(os.path.realpath(self.checkpoints.directory).encode()).hexdigest()[:16]
            self._fresh_run_key = f"distributed_training/fresh_runs/{where}/{next(_RUNS)}"
        return self._fresh_run_key

    def _set_checkpoints_aside(self, why: str) -> None:
        """Before the first step, once: move the checkpoints already in the directory into
        ``previous_run_<k>/`` (each directory's writer; the others wait), saying `why`."""
        if self.step != 0 or self._set_aside:
            return
        self._set_aside = True
        ctx = self.context
        layout = self._layout(self.checkpoints.path_for(0))
        # Each directory's writer (rank 0, or each node's first rank with a directory per node).
        writer = layout.writer_of[ctx.rank] == ctx.rank
        moved = self.checkpoints.set_aside() if writer else None
        if not self.resume:  # what a restart of this run may resume from: its token, in the store and beside
            self._leave_run_token(writer)
        if moved is not None:
            log.warning("%s: moved the checkpoints already in %s to %s; training starts from step 0", why,
                        self.checkpoints.directory, moved)
        ctx.barrier()  # nobody writes into a directory before its writer has cleared it

    def _leave_run_token(self, writer: bool) -> None:
        """A fresh ``resume=False`` start: a new token in the launch's store (the first rank) and in
        `RUN_MARKER` (each directory's writer), for `_restarted_fresh_run`."""
        ctx, key = self.context, self._run_key()
        store = _launch_store() if ctx.rank == 0 else None
        box = [uuid.uuid4().hex if store is not None else None]
        if ctx.world_size > 1:
            dist.broadcast_object_list(box, src=global_rank(ctx.group, 0), group=ctx.group)
        token = box[0]
        if token is None:
            return
        if writer:
            _write_marker(self.checkpoints.directory, token)
        if ctx.rank == 0:
            try:
                store.set(key, token)
            except Exception:  # (nothing to resume from on a restart: it starts fresh)
                pass

    def _lock_checkpoint_directory(self) -> None:
        """Hold `checkpoint_dir`'s run lock for the trainer's life (`checkpoint_lock`): each directory's
        writer takes it, and every rank raises if any writer found it held by another run."""
        if self._locked_directory is not None:
            return
        ctx, directory = self.context, self.checkpoints.directory
        writer = self._layout(self.checkpoints.path_for(0)).writer_of[ctx.rank] == ctx.rank
        holder = lock_directory(directory) if writer else None
        holders = [holder]
        if ctx.world_size > 1:
            holders = [None] * ctx.world_size
            dist.all_gather_object(holders, holder, group=ctx.group)
        found = [(rank, h) for rank, h in enumerate(holders) if h is not None]
        if found:
            if writer and holder is None:
                unlock_directory(directory)
            rank, h = found[0]
            raise CheckpointDirectoryInUseError(in_use_message(directory, h)
                                                + (f" (rank {rank} found it)" if ctx.world_size > 1 else ""))
        self._locked_directory = directory if writer else ""

    def _gather_write_problems(self) -> list[str | None]:
        """Each rank's `write_problem` with `checkpoint_dir` (None where it can write, or does not write
        there), gathered on every rank: collective, once per fit, before anything is written there."""
        ctx, directory = self.context, self.checkpoints.directory
        writer = self._layout(self.checkpoints.path_for(0)).writer_of[ctx.rank] == ctx.rank
        problems = [write_problem(directory) if writer else None]
        if ctx.world_size > 1:
            problems = [None] * ctx.world_size
            dist.all_gather_object(problems, write_problem(directory) if writer else None, group=ctx.group)
        return problems

    def _check_checkpoint_directory_writable(self) -> None:
        """Raise, on every rank alike (from what `_gather_write_problems` found), if a rank that writes
        checkpoints cannot write into `checkpoint_dir` (a read-only mount, no permission): fit would train
        a whole interval and fail at its first save, or fail on that rank alone setting an earlier run's
        checkpoints aside while the others wait. Called only where training will happen: a finished
        run's read-only directory may still be resumed from by a fit with nothing left to train."""
        ctx, directory = self.context, self.checkpoints.directory
        for rank, problem in enumerate(self._write_problems):
            if problem is not None:
                raise OSError(f"checkpoint_dir {os.fspath(directory)!r} cannot be written ({problem}"
                              + (f", on rank {rank}" if ctx.world_size > 1 else "") + "): fit saves its checkpoints "
                              "there. Give a writable directory, or leave checkpoint_dir out to train without them")

    def _unlock_checkpoint_directory(self) -> None:
        if self._locked_directory:
            unlock_directory(self._locked_directory)
        self._locked_directory = None

    def latest_checkpoint(self) -> tuple[str, dict[str, Any]] | None:
        """(path, meta) of the checkpoint `fit` resumes from, or None; every rank must call it.

        With one shared directory this is `CheckpointManager.latest_good` as the first rank finds it (told to
        the others: no two ranks load different steps after a read failed on one). With one directory per node,
        the newest step that is intact wherever it is held and whole between the nodes
        (`checkpoint_layout.agree_on_checkpoint`), so that no two nodes load different steps.
        """
        found = self._resume_point() if self.checkpoints is not None else None
        return found[:2] if found is not None else None

    def _resume_point(self) -> tuple[str, dict[str, Any], dict | None] | None:
        layout = self._layout(self.checkpoints.path_for(0))
        if layout.shared:
            # Every rank reads the same directory: the first rank picks, says what it skips, and tells the
            # others (each verifying on its own, a read that failed on one rank only made it load an
            # older step than its peers: a silent mix, then a crash).
            ctx = self.context
            # (the group's first rank: a parameter server's servers have no main rank among them)
            found = self.checkpoints.latest_good(warn=True) if ctx.rank == 0 else None
            if ctx.world_size > 1:
                box = [found]
                dist.broadcast_object_list(box, src=global_rank(ctx.group, 0), group=ctx.group)
                found = box[0]
            return (*found, None) if found is not None else None
        return agree_on_checkpoint(self.checkpoints, self.context, layout)


def _write_marker(directory: str, token: str) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{RUN_MARKER}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, RUN_MARKER))
