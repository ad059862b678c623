"""Small real datasets that ship with the package, so examples and tests never download anything.

* `digits()`: the UCI "Optical Recognition of Handwritten Digits" test set (1,797 images of 8x8
  pixels, values 0..16, 10 classes), by E. Alpaydin and C. Kaynak, 1998, UCI Machine Learning
  Repository (CC BY 4.0), in the CSV form scikit-learn distributes (BSD-3-Clause). See DIGITS_NOTICE.
* `repo_text()`: this package's own Python source as bytes, a corpus for a byte-level language model.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = ["digits", "repo_text", "TextWindows"]

_HERE = Path(__file__).resolve().parent


def digits() -> TensorDataset:
    """(images (N, 64) float in [0, 1], labels (N,) int64), N = 1797."""
    with gzip.open(_HERE / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :64] / 16.0)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    return TensorDataset(x, y)


def repo_text() -> torch.Tensor:
    """The package's `.py` files, sorted by path (identical on every rank), as a 1-D tensor of bytes."""
    root = _HERE.parent
    data = b"\n\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class TextWindows(Dataset):
    """(x, y) windows of `block_size` tokens at the given starts; y is x shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int, starts: list[int]) -> None:
        self.tokens, self.block_size, self.starts = tokens, block_size, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = self.starts[i]
        chunk = self.tokens[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]
