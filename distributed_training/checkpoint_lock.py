"""One run per checkpoint directory.

Two jobs started on one `checkpoint_dir` (a job launched twice, a second config pointing at the first's
directory) would destroy each other's work: with ``resume=False`` the second moves the first's
checkpoints aside while the first writes into it, and each one's keep-last-N prunes the other's newer
steps. `fit` therefore holds an exclusive lock on ``<checkpoint_dir>/.dtrain.lock`` for the trainer's
life, taken by each directory's writer (rank 0, or each node's first rank with a directory per node)
before anything in the directory is read or moved.

It is a POSIX record lock (`fcntl.lockf`, which network file systems honour too), not an `flock`: a
process forked from the holder (a DataLoader's worker) does not inherit it, so the kernel drops it
when the holder's process ends, however it ends (SIGKILL, a lost node's restart by torchrun): a crashed
run leaves no stale lock behind. A restarted worker (torchrun's ``--max-restarts``) waits up to
`RESTART_WAIT_S` for its predecessor's lock to go. Trainers of one process share the lock (a script
that resumes in a second trainer). Where no lock can be taken (a file system without locks, a lock
file another user owns) the run goes on unlocked, with a warning; a read-only directory needs none.
The file says who holds it; the holder removes it when it closes.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
import time

try:
    import fcntl
except ImportError:  # not on Windows: no lock there
    fcntl = None

log = logging.getLogger(__name__)

LOCK_NAME = ".dtrain.lock"
#: Seconds a restarted worker waits for the lock of the incarnation it replaces (still saving, or dying).
RESTART_WAIT_S = 30.0

_held: dict[str, list[int]] = {}  # lock file -> [descriptor, trainers of this process holding it]


class CheckpointDirectoryInUseError(RuntimeError):
    """Another process (another run) holds the checkpoint directory's lock; the message names it."""


def _lock_path(directory: str | os.PathLike) -> str:
    return os.path.join(os.path.realpath(os.fspath(directory)), LOCK_NAME)


def write_problem(directory: str | os.PathLike) -> str | None:
    """Why this process cannot write into `directory` (created if missing: a read-only file system, no
    permission), found by writing a file there and removing it; None if it can. A run that saves
    checkpoints learns it before it trains, not at its first save."""
    import tempfile

    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dtrain-write-check-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def lock_directory(directory: str | os.PathLike) -> str | None:
    """Take `directory`'s run lock (creating the directory): None once this process holds it, else a
    description of the holder. Never waits."""
    path = _lock_path(directory)
    if path in _held:
        _held[path][1] += 1
        return None
    if fcntl is None:
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    deadline = time.monotonic() + (RESTART_WAIT_S if restarted else 0.0)
    for _ in range(1000):  # a holder that removed the file as this process opened it: open the new one
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        except OSError as err:
            if err.errno != errno.EROFS and os.access(os.path.dirname(path), os.W_OK):
                log.warning("cannot lock checkpoint directory %s (%s): two runs started on it would not be kept "
                            "apart", os.path.dirname(path), err)
            return None  # (a read-only directory, a finished run's mounted to be read: nothing to guard)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                log.warning("cannot lock checkpoint directory %s (%s): two runs started on it would not be kept "
                            "apart", os.path.dirname(path), err)
                return None
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            return holder or "another process"
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"host {socket.gethostname()} pid {os.getpid()}" + (f" of job {job}" if job else "")
                       + f", since {since}\n").encode(), 0)
        _held[path] = [fd, 1]
        return None
    log.warning("cannot lock checkpoint directory %s: its lock file kept being replaced; going on unlocked",
                os.path.dirname(path))
    return None


def unlock_directory(directory: str | os.PathLike) -> None:
    """Give back one trainer's hold on `directory`'s lock; the last one removes the file and unlocks."""
    path = _lock_path(directory)
    entry = _held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[path]
    try:
        os.unlink(path)  # while still locked: a process that opens the old file now sees it removed
    except OSError:
        pass
    os.close(entry[0])


def in_use_message(directory: str | os.PathLike, holder: str) -> str:
    return (f"checkpoint_dir {os.fspath(directory)!r} is in use by another run ({holder}; it holds "
            f"{_lock_path(directory)}). Two runs writing one directory move aside or prune each other's "
            "checkpoints: give this run a checkpoint_dir of its own, or stop the other run first")
