"""Crash-proof checkpoints: atomic files, checksums, the last N kept, the best tracked, resume.

Layout of one checkpoint (a directory):

    step_000000120/
        rank0.pt ... rank{W-1}.pt   each rank's part: its RNG states, and its shards (ZeRO/FSDP) or,
                                    on rank 0 of a replicated strategy, the model and optimizer
        meta.pt.sha256              the SHA-256 of meta.pt, written by rank 0 just before it
        meta.pt                     written last by rank 0: step, epoch, data position, config,
                                    metrics, world size, and the SHA-256 of every rank file

A checkpoint counts only once `meta.pt` exists and every file, `meta.pt` included, matches its
checksum, so a crash while saving, a truncated file, a flipped bit or a file overwritten with anything
else makes `latest_good()` fall back to the previous one, with a warning. No byte of a file is
unpickled before its checksum matches; a file that still fails to load is reported as a corrupt
checkpoint file (`CheckpointCorruptError`, naming it), never with torch's advice to load untrusted
data with ``weights_only=False``. Every file is written to a temporary name, flushed, fsync'ed and
renamed (and the directory fsync'ed), so a file under its final name is always complete; a write that
fails or is interrupted removes its temporary file. Everything loads with
`torch.load(weights_only=True)`: RNG states are stored as tensors and plain Python values.

A checkpoint is a directory, so give `save_checkpoint` a directory name (``checkpoints/last``), not a
file name (``last.pt``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointManager", "CheckpointCorruptError", "CheckpointMismatchError", "atomic_write_bytes", "atomic_save",
           "save_file", "load_file",
           "read_meta", "write_meta", "rng_state", "set_rng_state"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.pt"
META_SHA256 = "meta.pt.sha256"
#: What `meta.pt` must hold for the checkpoint to be usable at all.
_META_KEYS = ("step", "world_size", "checksums")


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, incomplete, fails its checksum or does not load; the message names it."""


class CheckpointMismatchError(ValueError):
    """A good checkpoint that this trainer cannot load (another strategy's format, optimizer class or
    parameter shapes); the message says which and what to do."""


# ------------------------------------------------------------------ files
@contextlib.contextmanager
def _atomic_file(path: str):
    """An unbuffered file object that becomes `path` only when the block ends without an error: written
    under a temporary name, fsynced, renamed over `path`, the directory fsynced; on an error (or
    KeyboardInterrupt mid-write) the temporary file is removed and `path` is still the old file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    handling = sys.exc_info()[1]  # an error the caller is handling: not this write's
    try:
        with open(tmp, "wb", buffering=0) as raw:
            yield raw
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        cause = _os_error_in(err, handling) if isinstance(err, Exception) else None
        if cause is not None and cause is not err:  # torch's zip writer raised again over it ("unexpected pos")
            raise OSError(cause.errno, f"writing {path} failed: {cause.strerror or cause}", path) from err
        raise
    _fsync_dir(directory)


def _os_error_in(err: BaseException, outer: BaseException | None) -> OSError | None:
    """The OSError (a full disk, a lost mount) that `err` is, or that it was raised while handling,
    raised inside the write (the chain is followed down to `outer`, what the caller was handling)."""
    seen = set()
    while err is not None and err is not outer and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Write `data` to `path` so that `path` is either the old file or the complete new one."""
    with _atomic_file(path) as f:
        view = memoryview(data)
        while view.nbytes:
            view = view[f.write(view):]


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class _HashingFile:
    """What `torch.save` writes into: every chunk goes to the file and into a SHA-256 as it comes.

    `torch.save` into a file object pickles only the skeleton (names, shapes, storage keys) in Python
    and hands each tensor's bytes over as one memoryview of the tensor's own memory, without a copy;
    ``FileIO.write`` and ``hashlib``'s update of a large buffer both release the GIL. So a big
    checkpoint written by a background thread holds the GIL for the skeleton only, and its bytes are
    never copied in memory (a ``BytesIO`` holds them all and ``getvalue()`` copies them again, under the
    GIL, which stalls a training thread that dispatches operators from Python all the time)."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        left = view
        while left.nbytes:
            written = self.raw.write(left)
            if written is None:  # a non-blocking file would say so; ours are blocking
                raise OSError("the checkpoint file did not accept the write")
            left = left[written:]
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass  # unbuffered: nothing held back


def atomic_save(obj: Any, path: str) -> str:
    """`torch.save` `obj` straight into `path`, atomically (a temporary name, fsync, rename, as
    `atomic_write_bytes`), hashing the bytes on their way; return their SHA-256.

    The file is what ``torch.save`` writes into a file object (it loads with
    ``torch.load(weights_only=True)``); no in-memory copy of it is made, and the GIL is held only
    while the skeleton is pickled (see `_HashingFile`)."""
    with _atomic_file(path) as raw:
        out = _HashingFile(raw)
        torch.save(obj, out)
    return out.sha256.hexdigest()


def save_file(obj: Any, path: str) -> str:
    """`torch.save` `obj` atomically; return the SHA-256 of the bytes written (see `atomic_save`)."""
    return atomic_save(obj, path)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load_file(path: str, expected_sha256: str | None = None, *, recorded_in: str = "meta.pt") -> Any:
    """Load a checkpoint file on the CPU (weights only), checking its checksum when one is given.

    A file that does not match its checksum or does not load raises `CheckpointCorruptError` naming it.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise CheckpointCorruptError(f"checkpoint file {path!r} is corrupted: its SHA-256 does not match "
                                     f"{recorded_in}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        # torch's own message for a file that is not a weights-only pickle advises weights_only=False,
        # i.e. executing whatever the file contains: never pass that on for a file that is corrupt.
        raise CheckpointCorruptError(
            f"checkpoint file {path!r} is corrupted or is not a checkpoint file: it does not load "
            f"({type(err).__name__})"
        ) from None


def write_meta(meta: dict[str, Any], directory: str) -> None:
    """Write `meta.pt` into a checkpoint directory, its checksum first (see the module docstring)."""
    data = _serialize(meta)
    # The checksum goes first: a crash between the two leaves no meta.pt, an incomplete checkpoint.
    atomic_write_bytes(hashlib.sha256(data).hexdigest().encode(), os.path.join(directory, META_SHA256))
    atomic_write_bytes(data, os.path.join(directory, META))


def read_meta(directory: str) -> dict[str, Any]:
    """The verified metadata of a checkpoint directory; `CheckpointCorruptError` (naming the file) if it
    is incomplete, corrupt or not a checkpoint. Every checkpoint this version reads has `meta.pt.sha256`
    (written before `meta.pt`): one without it is incomplete or was tampered with, and is refused."""
    meta_path = os.path.join(directory, META)
    if os.path.isfile(directory):
        raise CheckpointCorruptError(
            f"{directory!r} is a file, not a checkpoint directory: save_checkpoint writes a directory (one file "
            "per rank plus meta.pt); a file saved with torch.save loads with torch.load and load_state_dict")
    if not os.path.isfile(meta_path):
        raise CheckpointCorruptError(f"{directory!r} is incomplete: no meta.pt (the save did not finish)")
    sidecar = os.path.join(directory, META_SHA256)
    if not os.path.isfile(sidecar):
        raise CheckpointCorruptError(f"checkpoint {directory!r} has no {META_SHA256}, the checksum meta.pt is verified "
                                     "against before it is read: the directory is incomplete or was altered (every "
                                     "checkpoint this version writes has one)")
    with open(sidecar, "rb") as f:
        expected = f.read().decode("ascii", errors="replace").strip()
    meta = load_file(meta_path, expected, recorded_in=META_SHA256)
    if not isinstance(meta, dict) or any(key not in meta for key in _META_KEYS):
        raise CheckpointCorruptError(f"checkpoint file {meta_path!r} is corrupted or is not a checkpoint's meta.pt: "
                                     f"it must hold {', '.join(_META_KEYS)}")
    return meta


# ------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    """Every random number generator a training step may draw from, as weights-only-loadable values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


# ------------------------------------------------------------------ manager
def best_direction(metric: str | None) -> str:
    """``"max"`` for a metric that grows as the model improves (an accuracy: ``accuracy``, ``top5``,
    with or without ``val_``), ``"min"`` for any other (a loss, a perplexity)."""
    name = (metric or "").removeprefix("val_")
    return "max" if name.startswith("accuracy") or re.match(r"top\d", name) else "min"


class CheckpointManager:
    """Numbered checkpoints in one directory: save, find the latest good one, keep the last N and the best.

    Args:
        directory: where `step_*` checkpoint directories live.
        keep_last: how many of the most recent good checkpoints to keep (older ones are deleted).
        best_metric: name of a metric (passed to `finalize`) whose best checkpoint is always kept and
            recorded in ``best.json``.
        best_mode: ``"min"``, ``"max"`` or ``"auto"`` (`best_direction`: max for an accuracy, min else).
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3, best_metric: str | None = None,
                 best_mode: str = "auto") -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        if best_mode not in ("min", "max", "auto"):
            raise ValueError(f"best_mode must be 'min', 'max' or 'auto', got {best_mode!r}")
        self.directory = os.fspath(directory)
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.best_mode = best_direction(best_metric) if best_mode == "auto" else best_mode

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:09d}")

    def steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        found = [int(m.group(1)) for name in os.listdir(self.directory) if (m := _STEP_DIR.match(name))]
        return sorted(found)

    @staticmethod
    def verify(path: str) -> dict[str, Any]:
        """Return the checkpoint's metadata if every file is present and intact (`meta.pt` against
        `meta.pt.sha256`, each rank file against `meta.pt`); raise `CheckpointCorruptError` otherwise."""
        meta = read_meta(path)
        for name, digest in meta["checksums"].items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise CheckpointCorruptError(f"{path!r} is incomplete: {name} is missing")
            if sha256_file(file) != digest:
                raise CheckpointCorruptError(f"{path!r} is corrupted: {name} does not match its checksum")
        return meta

    def latest_good(self, warn: bool = True) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint that verifies, warning (with `warn`) about each newer one that does not."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                return path, self.verify(path)
            except Exception as err:  # whatever is wrong with a checkpoint, an older good one is better
                if warn:
                    warnings.warn(f"skipping checkpoint {path}: {err}; falling back to an earlier one", stacklevel=2)
        return None

    def set_aside(self) -> str | None:
        """Move this directory's checkpoints (``step_*``, ``best.json``, ``COMPLETED``) into a new
        ``previous_run_<k>/`` inside it and return that path (None if there was nothing to move).

        For a run that must not resume (``resume=False``) in a directory an earlier run used: leaving
        them would mix the two runs, and `finalize`'s keep-last-N (by step number) would delete the new
        run's checkpoints in favour of the old run's later ones. Nothing is deleted. Rank 0 only.
        """
        if not os.path.isdir(self.directory):
            return None
        names = [n for n in os.listdir(self.directory) if _STEP_DIR.match(n) or n in ("best.json", "COMPLETED")]
        if not names:
            return None
        k = 1
        while os.path.exists(os.path.join(self.directory, f"previous_run_{k}")):
            k += 1
        target = os.path.join(self.directory, f"previous_run_{k}")
        os.makedirs(target)
        for name in names:
            os.replace(os.path.join(self.directory, name), os.path.join(target, name))
        _fsync_dir(self.directory)
        return target

    def finalize(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """After a save (by the directory's writer: rank 0, or each node's first rank when each node has a
        directory of its own): record the best and delete what is no longer kept: checkpoints older than
        this `step`'s last `keep_last` (and the best); newer ones, perhaps being written, are not touched."""
        best = self._read_best()
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            value = float(metrics[self.best_metric])
            better = best is None or (value < best["value"] if self.best_mode == "min" else value > best["value"])
            if better:
                best = {"step": step, "metric": self.best_metric, "value": value}
                atomic_write_bytes(json.dumps(best).encode(), os.path.join(self.directory, "best.json"))
        # One listing, and only checkpoints up to this one count: with background writes the other
        # ranks may already be writing newer ones (a directory made after a first listing and seen by a
        # second would be taken for an old checkpoint and deleted under its writer).
        # Only finished checkpoints count towards keep_last (one whose save was killed has no meta.pt;
        # counting it would delete a good one in its place); an unfinished one older than this is removed.
        done = [s for s in self.steps() if s <= step]
        finished = [s for s in done if s == step or os.path.isfile(os.path.join(self.path_for(s), META))]
        keep = set(finished[-self.keep_last:])
        if best is not None:
            keep.add(best["step"])
        for old in done:
            if old not in keep:
                shutil.rmtree(self.path_for(old), ignore_errors=True)

    def best(self) -> tuple[str, dict[str, Any]] | None:
        """(path, record) of the best checkpoint so far, if a best metric is tracked."""
        record = self._read_best()
        return (self.path_for(record["step"]), record) if record else None

    def _read_best(self) -> dict[str, Any] | None:
        path = os.path.join(self.directory, "best.json")
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                record = json.load(f)
            int(record["step"]), float(record["value"])
            return record
        except (OSError, ValueError, KeyError, TypeError) as err:
            record = self._best_of_checkpoints()
            warnings.warn(f"{path} is damaged ({type(err).__name__}: {err}); the best checkpoint is found again from "
                          f"the checkpoints' own metrics: {record or 'none recorded one'}", stacklevel=2)
            if record is not None:
                atomic_write_bytes(json.dumps(record).encode(), path)
            return record

    def _best_of_checkpoints(self) -> dict[str, Any] | None:
        """best.json's record rebuilt from the `best_metric` value each finished checkpoint's meta.pt holds."""
        best = None
        for step in self.steps():
            try:
                value = read_meta(self.path_for(step)).get("metrics", {}).get(self.best_metric)
            except CheckpointCorruptError:
                continue
            if value is not None and (best is None or (value < best["value"] if self.best_mode == "min"
                                                       else value > best["value"])):
                best = {"step": step, "metric": self.best_metric, "value": float(value)}
        return best
