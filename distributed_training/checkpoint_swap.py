"""Replacing a checkpoint directory whole: `DistributedTrainer.save_checkpoint(path)` writes into
``<path>.saving`` (`staged_of`) and its directory's writer renames it in (`put_in_place`), what was there
stepping aside to ``<path>.previous`` (`previous_of`) until the new one has its name. Killed anywhere, a
whole checkpoint (`whole`) is left at one of the three, which `load_checkpoint` looks at in that order.
See docs/resilience.md.
"""

from __future__ import annotations

import os
import re
import shutil
import time

from .checkpoint import CheckpointCorruptError, _fsync_dir, read_meta, sha256_file

__all__ = ["staged_of", "previous_of", "whole", "put_in_place", "remove_stale_rank_files"]


def remove_stale_rank_files(path: str, world_size: int) -> None:
    """The rank files of an earlier save into the same directory by more ranks (``checkpoints/last``
    saved at 2 ranks, then at 1): nothing reads them (meta.pt lists the files), but they look like part
    of the checkpoint."""
    for name in os.listdir(path):
        stem, ext = os.path.splitext(name)
        if ext == ".pt" and stem.startswith("rank") and stem[4:].isdigit() and int(stem[4:]) >= world_size:
            try:
                os.remove(os.path.join(path, name))
            except OSError:
                pass  # (another node's writer removed it first, on a shared directory)


#: The files a checkpoint directory holds: rank files, meta.pt and its checksum, and write temporaries.
_CHECKPOINT_FILE = re.compile(r"^(rank\d+\.pt|meta\.pt|meta\.pt\.sha256)(\.tmp\.\d+)?$")


def staged_of(path: str) -> str:
    """Where a save over the checkpoint at `path` writes before it is swapped in."""
    return os.path.normpath(path) + ".saving"


def previous_of(path: str) -> str:
    """Where the checkpoint at `path` waits while a new one takes its name (`put_in_place`)."""
    return os.path.normpath(path) + ".previous"


def whole(path: str) -> bool:
    """Whether `path` holds a whole checkpoint: its meta.pt intact and every file it lists there, each
    matching its checksum (a `.saving` a later save began to overwrite does not)."""
    try:
        meta = read_meta(path)
        return all(os.path.isfile(os.path.join(path, name)) and sha256_file(os.path.join(path, name)) == digest
                   for name, digest in meta["checksums"].items())
    except (CheckpointCorruptError, FileNotFoundError, KeyError, OSError):
        return False


def put_in_place(staged: str, path: str) -> None:
    """Give the whole checkpoint `staged` the name `path`. What is there (a checkpoint, a symlink, a
    save's leftovers) steps aside to `previous_of(path)` first and is removed after, so a crash leaves a
    whole checkpoint at `path`, at `staged` or at `previous_of(path)` (`load_checkpoint` looks in that
    order). A directory holding other files than a checkpoint's gets the files moved in instead, one by
    one, meta.pt last (as saves into it always did)."""
    previous = previous_of(path)
    _remove(previous)  # an earlier save's leftover: `path` or `staged` is newer and whole
    if os.path.isdir(path) and not os.path.islink(path) and not all(_CHECKPOINT_FILE.match(n) for n in os.listdir(path)):
        for name in sorted(os.listdir(staged), key=lambda n: (n == "meta.pt", n.startswith("meta.pt"))):
            os.replace(os.path.join(staged, name), os.path.join(path, name))
        _fsync_dir(path)
        _remove(staged)
        return
    if os.path.lexists(path):
        os.rename(path, previous)
    os.rename(staged, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    _remove(previous)


def _remove(path: str) -> None:
    """Remove a file, a symlink (not what it points to) or a directory tree, whichever `path` is; what
    cannot be removed (a file held open on NFS) is renamed out of the way."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            os.rename(path, f"{path}.stale-{time.time_ns()}")
