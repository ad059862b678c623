"""Crash-proof checkpoints: atomic files, checksums, the last N kept, the best tracked, resume.

Layout of one checkpoint (a directory):

    step_000000120/
        rank0.pt ... rank{W-1}.pt   each rank's part: its RNG states, and its shards (ZeRO/FSDP) or,
                                    on rank 0 of a replicated strategy, the model and optimizer
        meta.pt                     written last by rank 0: step, epoch, data position, config,
                                    metrics, world size, and the SHA-256 of every rank file

A checkpoint counts only once `meta.pt` exists and every file matches its checksum, so a crash while
saving, a truncated file or a flipped bit makes `latest_good()` fall back to the previous one, with a
warning. Every file is written to a temporary name, flushed, fsync'ed and renamed (and the directory
fsync'ed), so a file under its final name is always complete. Everything loads with
`torch.load(weights_only=True)`: RNG states are stored as tensors and plain Python values.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointManager", "atomic_write_bytes", "save_file", "load_file", "rng_state", "set_rng_state"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------ files
def atomic_write_bytes(data: bytes, path: str) -> None:
    """Write `data` to `path` so that `path` is either the old file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


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


def save_file(obj: Any, path: str) -> str:
    """`torch.save` `obj` atomically; return the SHA-256 of the bytes written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(data, path)
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load_file(path: str, expected_sha256: str | None = None) -> Any:
    """Load a checkpoint file on the CPU (weights only), checking its checksum when one is given."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise ValueError(f"checkpoint file {path!r} is corrupted: its SHA-256 does not match meta.pt")
    return torch.load(path, map_location="cpu", weights_only=True)


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
class CheckpointManager:
    """Numbered checkpoints in one directory: save, find the latest good one, keep the last N and the best.

    Args:
        directory: where `step_*` checkpoint directories live.
        keep_last: how many of the most recent good checkpoints to keep (older ones are deleted).
        best_metric: name of a metric (passed to `finalize`) whose best checkpoint is always kept and
            recorded in ``best.json``.
        best_mode: ``"min"`` or ``"max"``.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3, best_metric: str | None = None,
                 best_mode: str = "min") -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.directory = os.fspath(directory)
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.best_mode = best_mode

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:09d}")

    def steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        found = [int(m.group(1)) for name in os.listdir(self.directory) if (m := _STEP_DIR.match(name))]
        return sorted(found)

    @staticmethod
    def verify(path: str) -> dict[str, Any]:
        """Return the checkpoint's metadata if it is complete and intact; raise ValueError otherwise."""
        meta_path = os.path.join(path, "meta.pt")
        if not os.path.isfile(meta_path):
            raise ValueError(f"{path!r} is incomplete: no meta.pt (the save did not finish)")
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
        for name, digest in meta.get("checksums", {}).items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise ValueError(f"{path!r} is incomplete: {name} is missing")
            if sha256_file(file) != digest:
                raise ValueError(f"{path!r} is corrupted: {name} does not match its checksum")
        return meta

    def latest_good(self) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint that verifies, warning about each newer one that does not."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                return path, self.verify(path)
            except (ValueError, RuntimeError, OSError, EOFError) as err:
                warnings.warn(f"skipping checkpoint {path}: {err}; falling back to an earlier one", stacklevel=2)
        return None

    def finalize(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """After a save (by the directory's writer: rank 0, or each node's first rank when each node has a
        directory of its own): record the best and delete what is no longer kept."""
        best = self._read_best()
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            value = float(metrics[self.best_metric])
            better = best is None or (value < best["value"] if self.best_mode == "min" else value > best["value"])
            if better:
                best = {"step": step, "metric": self.best_metric, "value": value}
                atomic_write_bytes(json.dumps(best).encode(), os.path.join(self.directory, "best.json"))
        keep = set(self.steps()[-self.keep_last:])
        if best is not None:
            keep.add(best["step"])
        for old in self.steps():
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
        with open(path) as f:
            return json.load(f)
