"""Sharding a map-style dataset across ranks.

Every epoch, all ranks draw the same permutation (seeded by ``seed + epoch``), and rank r takes
positions r, r + W, r + 2W, ... of it. Samples are therefore distinct across ranks within an epoch and
reshuffled between epochs. For training, the permutation is padded (by wrapping around) to a multiple
of the world size so that every rank runs the same number of steps and no rank waits forever in a
collective; with ``drop_last`` the tail is dropped instead. For evaluation, ``pad=False`` gives each
rank its exact share and nothing is counted twice.

Every rank must see a dataset of the same length for the step counts to agree; `DistributedTrainer.fit`
checks that with one all-gather and, if lengths differ, runs every rank for the smallest count.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized

import torch
from torch.utils.data import Sampler

__all__ = ["ShardedSampler"]


class ShardedSampler(Sampler[int]):
    """Yield this rank's indices of a dataset of `len(dataset)` samples.

    Args:
        dataset: anything with `__len__`.
        num_replicas: world size.
        rank: this rank.
        shuffle: draw a fresh permutation each epoch (call `set_epoch`).
        seed: base seed; all ranks must use the same one.
        drop_last: drop the tail that does not divide evenly instead of padding it.
        pad: pad to a multiple of `num_replicas` (training); False gives uneven exact shards.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.dataset_len = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self.start = 0
        if drop_last:
            self.total = (self.dataset_len // num_replicas) * num_replicas
        elif pad:
            self.total = math.ceil(self.dataset_len / num_replicas) * num_replicas
        else:
            self.total = self.dataset_len

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation; skip this rank's first `start` samples (resuming mid-epoch)."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.epoch = epoch
        self.start = start

    def _indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.total > len(order) and order:
            repeats = math.ceil((self.total - len(order)) / len(order))
            order += (order * repeats)[: self.total - len(order)]
        return order[: self.total]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.rank :: self.num_replicas][self.start :])

    def __len__(self) -> int:
        return max(0, len(range(self.rank, self.total, self.num_replicas)) - self.start)
