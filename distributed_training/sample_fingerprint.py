"""A fingerprint of a dataset's first sample, which `fit` compares across ranks (`data.steps_per_epoch`):
datasets of one length but other contents on each rank (each rank read its own file) would each be
trained on 1/W only, and are warned about.

Exact where the data is exact, tolerant where it is not:

* integer and boolean tensors, the shapes and dtypes, numbers other than floats, bytes and the structure
  (keys, order) go into a CRC-32, which must be equal;
* floating values go into four float64 sums (their sum and that of their magnitudes, each also weighted
  by position), equal within `FLOAT_TOLERANCE` of the magnitudes: a standardisation computed with another
  thread count or instruction set differs in the last bits, not by that much;
* strings are left out: a sample may carry a node's own path to its file.

Only the first `HEAD_BYTES` of a tensor count, taken along its leading dimensions before anything is
copied (a permuted volume is not made contiguous whole).
"""

from __future__ import annotations

import random
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FLOAT_TOLERANCE", "Fingerprint", "first_sample_fingerprint"]

#: Relative tolerance of the floating sums (to the sum of magnitudes).
FLOAT_TOLERANCE = 1e-5
#: Bytes of each tensor that count.
HEAD_BYTES = 1 << 20
#: The positions' weights cycle through 1 .. WEIGHT_CYCLE (two samples holding the same values in another order differ).
WEIGHT_CYCLE = 251
#: Int64 words of `Fingerprint.words`.
WORDS = 6


@dataclass(frozen=True)
class Fingerprint:
    exact: int  # CRC-32 of everything but the floating values and the strings
    sums: tuple[float, float, float, float]  # floating values: sum, sum of |x|, and both weighted by position

    def words(self) -> list[int]:
        """As int64 words for an all-gather: a 1 (present), the CRC, the sums' float64 bits."""
        bits = torch.tensor(self.sums, dtype=torch.float64).view(torch.int64).tolist()
        return [1, self.exact, *bits]

    @staticmethod
    def from_words(words: list[int]) -> "Fingerprint | None":
        if not words[0]:
            return None
        sums = torch.tensor(words[2:WORDS], dtype=torch.int64).view(torch.float64).tolist()
        return Fingerprint(int(words[1]), tuple(sums))

    def matches(self, other: "Fingerprint") -> bool:
        (s, a, w, aw), (s2, a2, w2, aw2) = self.sums, other.sums
        return (self.exact == other.exact and abs(a - a2) <= FLOAT_TOLERANCE * max(a, a2)
                and abs(s - s2) <= FLOAT_TOLERANCE * max(a, a2) and abs(aw - aw2) <= FLOAT_TOLERANCE * max(aw, aw2)
                and abs(w - w2) <= FLOAT_TOLERANCE * max(aw, aw2))


def first_sample_fingerprint(dataset: Any) -> Fingerprint | None:
    """The `Fingerprint` of a map-style dataset's first sample; None where it says nothing: it cannot be
    read, or two reads differ. Each read draws from generators seeded alike on every rank (torch's CPU
    one, Python's, NumPy's; not a GPU's), so a random augmentation draws the same on every rank; they are
    left as they were."""
    numpy = sys.modules.get("numpy")
    try:
        with torch.random.fork_rng(devices=[]):
            state, np_state = random.getstate(), numpy.random.get_state() if numpy else None
            try:
                reads = []
                for _ in range(2):
                    torch.default_generator.manual_seed(0)  # (torch.manual_seed would reseed the GPUs' too)
                    random.seed(0)
                    if numpy:
                        numpy.random.seed(0)
                    walk = _Walk()
                    walk.add(dataset[0])
                    reads.append(walk.fingerprint())
            finally:
                random.setstate(state)
                if numpy:
                    numpy.random.set_state(np_state)
    except Exception:  # noqa: BLE001 - the loader reads it and raises its own error, where it belongs
        return None
    return reads[0] if reads[0].matches(reads[1]) else None


class _Walk:
    """Goes through a sample: tensors, arrays, numbers, bytes, dicts, lists and tuples, in order."""

    def __init__(self) -> None:
        self.crc = 0
        self.sums = torch.zeros(4, dtype=torch.float64)

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.crc, tuple(self.sums.tolist()))

    def _exact(self, data: bytes) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def add(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._tensor(value.detach())
        elif isinstance(value, dict):
            for key in sorted(value, key=repr):
                self._exact(repr(key).encode())
                self.add(value[key])
        elif isinstance(value, (list, tuple)):
            self._exact(b"[%d]" % len(value))
            for item in value:
                self.add(item)
        elif isinstance(value, (str, bytes)):
            if isinstance(value, bytes):
                self._exact(value)
        elif isinstance(value, float):
            self._tensor(torch.tensor([value], dtype=torch.float64))
        elif value is None or isinstance(value, (int, complex)):
            self._exact(repr(value).encode())
        elif hasattr(value, "__array__"):
            try:
                self._tensor(torch.as_tensor(value.__array__()))
            except (TypeError, ValueError, RuntimeError):
                pass
        # (an object of another kind says nothing: its repr may hold its address)

    def _tensor(self, t: torch.Tensor) -> None:
        self._exact(repr((tuple(t.shape), t.dtype)).encode())
        head = _head(t, HEAD_BYTES // max(1, t.element_size())).reshape(-1).cpu()
        if head.is_complex():
            head = torch.view_as_real(head).reshape(-1)
        if head.is_floating_point():
            x = head.double()
            weights = torch.arange(x.numel(), dtype=torch.float64).remainder_(WEIGHT_CYCLE).add_(1)
            magnitude = x.abs()
            self.sums += torch.stack([x.sum(), magnitude.sum(), (x * weights).sum(), (magnitude * weights).sum()])
        elif head.numel():
            self._exact(head.contiguous().view(torch.uint8).numpy().tobytes())


def _head(t: torch.Tensor, limit: int) -> torch.Tensor:
    """The first `limit` elements' worth of `t` in its leading dimensions, as a view (nothing copied)."""
    while t.numel() > limit and t.dim() > 0:
        row = t.numel() // t.shape[0]
        if row <= limit:
            return t[: max(1, limit // row)]
        t = t[0]
    return t
