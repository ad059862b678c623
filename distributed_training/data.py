"""Sharding a map-style dataset across data-parallel replicas.

Every epoch, all ranks draw the same permutation (seeded by ``seed + epoch``), and the rank feeding
data-parallel replica r of W (`Mesh.dp_rank` of `Mesh.dp_size`; rank and world size while every rank is
its own replica) takes positions r, r + W, r + 2W, ... of it. Samples are therefore distinct across ranks within an epoch and
reshuffled between epochs. A rank's batches of `batch_size` are then the consecutive global batches of
the permutation: step k trains positions k*B*W .. (k+1)*B*W - 1, as one process on the whole batch would.

Every rank must run the same number of steps, or one waits forever in a collective. Given the batch size,
an epoch's short last step is split as it falls: its L samples go L // W or L // W + 1 to a replica, and
the trainer weighs each replica's loss by what it holds (`loss_weights.replica_scale`), so that step too
is exact. Only where a replica would get fewer than `min_rows` (none; for a model training BatchNorm
layers, which fail on one sample, two a micro-batch; an interleaved pipeline's ranks) is the step padded
by wrapping around, to `min_rows` a replica, as torch's `DistributedSampler` pads (to a multiple of W,
always): those few samples train twice. Without a batch size the padding is always done, to a multiple
of W; with ``drop_last`` the tail is dropped instead. For evaluation, ``pad=False`` gives each rank its
exact share and nothing is counted twice.

Every rank must see a dataset of the same length for the step counts to agree; `DistributedTrainer.fit`
checks that with one all-gather and, if lengths differ, runs every rank for the smallest count. The same
all-gather compares a fingerprint of each rank's first sample (`sample_fingerprint`): datasets of one
length but other contents (each rank read its own file) would each be trained on 1/W only, and are warned
about.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from typing import Any, Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)

from .runtime import DistributedContext
from .sample_fingerprint import WORDS as FINGERPRINT_WORDS
from .sample_fingerprint import Fingerprint, first_sample_fingerprint

__all__ = ["MapDataset", "ShardedSampler", "agree_steps_per_epoch", "map_style", "padded_tail", "train_loader"]


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
        batch_size: each replica's batch. Given, an epoch's short last step is split unevenly (exact)
            and padded only where a replica would hold fewer than `min_rows` samples: to `min_rows`.
        min_rows: the fewest samples a replica's batch may hold in the short last step.
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
        batch_size: int | None = None,
        min_rows: int = 1,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.min_rows = max(1, int(min_rows))
        self.dataset_len = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self.start = 0
        self.offset = 0

    @property
    def total(self) -> int:
        """End of the positions of the epoch's (padded) permutation that the ranks take, from `offset`:
        what remains is padded to a multiple of the world size (or its tail dropped with `drop_last`)."""
        left = max(0, self.dataset_len - self.offset)
        if self.drop_last:
            return self.offset + (left // self.num_replicas) * self.num_replicas
        if self.pad and not self._exact_tail(left):
            return self.offset + self._padded(left)
        return max(self.dataset_len, self.offset)

    def _padded(self, left: int) -> int:
        """`left` samples padded by wrapping around: to a multiple of W; given the batch size, the short
        last step as `padded_tail` says."""
        if self.batch_size is None:
            return math.ceil(left / self.num_replicas) * self.num_replicas
        tail = left % (self.batch_size * self.num_replicas)
        return left - tail + padded_tail(tail, self.num_replicas, self.batch_size, self.min_rows)

    def _exact_tail(self, left: int) -> bool:
        """Whether the last step of `left` samples is trained as it falls, unpadded."""
        if self.batch_size is None:
            return left % self.num_replicas == 0
        tail = left % (self.batch_size * self.num_replicas)
        return padded_tail(tail, self.num_replicas, self.batch_size, self.min_rows) == tail

    def set_epoch(self, epoch: int, start: int = 0, *, offset: int = 0) -> None:
        """Select the epoch's permutation; skip this rank's first `start` samples (resuming mid-epoch).

        `offset` is a position in the whole job's order instead: the first `offset` samples of the
        epoch's permutation were trained (by any number of ranks, see `distributed_training.global_batch`)
        and the ranks now shard what follows (rank r takes positions offset + r, offset + r + W, ...)."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.epoch = epoch
        self.start = start
        self.offset = offset

    def shard_length(self) -> int:
        """Samples this rank takes this epoch from `offset` (before `start` skips any)."""
        return len(range(self.offset + self.rank, self.total, self.num_replicas))

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

    #: Yield ``(epoch, index)`` keys instead of indices, for `SeededSamples` (`train_loader` sets it on the
    #: samplers of loaders with worker processes).
    keyed = False

    def __iter__(self) -> Iterator[int]:
        indices = self._indices()[self.offset + self.rank :: self.num_replicas][self.start :]
        return iter([(self.epoch, i) for i in indices] if self.keyed else indices)

    def __len__(self) -> int:
        return max(0, self.shard_length() - self.start)


def padded_tail(tail: int, replicas: int, batch_size: int, min_rows: int) -> int:
    """The samples an epoch's short last step of `tail` (fewer than a global batch) trains over `replicas`
    replicas of `batch_size`: `tail` itself where every replica holds at least `min_rows` of it (or none is
    left), else padded to `min_rows` a replica (as many as a batch holds), or one a replica more where
    that falls short of the tail. What `ShardedSampler` and dtrain's `ShardedIterable` deal."""
    if tail == 0 or tail >= min_rows * replicas:
        return tail
    return max(math.ceil(tail / replicas), min(min_rows, batch_size)) * replicas


def _check_loader_order(loader: DataLoader, shuffle: bool) -> None:
    """`fit` shards a DataLoader's dataset with its own sampler: a sampler of the user's own (weights,
    classes balanced) cannot be kept and is refused; a loader's shuffle setting that `fit`'s differs
    from is said (fit's ``shuffle`` decides)."""
    if isinstance(loader.sampler, ShardedSampler):
        return
    shuffles = isinstance(loader.sampler, RandomSampler)
    if isinstance(loader.sampler, DistributedSampler):  # shards as fit does: a script ported from torch DDP
        shuffles = loader.sampler.shuffle
    elif not isinstance(loader.sampler, (SequentialSampler, RandomSampler)):
        raise ValueError(
            f"fit() cannot use this DataLoader's sampler ({type(loader.sampler).__name__}): fit shards the loader's "
            "dataset over the data-parallel ranks with a sampler of its own, which would replace yours. Pass the "
            "dataset and batch_size (each rank gets its shard, reshuffled each epoch), or a DataLoader over an "
            "IterableDataset that yields this rank's batches (iterated as given)")
    if shuffles != bool(shuffle):
        warnings.warn(
            f"fit(shuffle={bool(shuffle)}) decides the order, not the DataLoader's shuffle={shuffles}: fit shards "
            f"the loader's dataset with its own sampler; pass fit(..., shuffle={shuffles}) for the loader's",
            UserWarning, stacklevel=4)


def agree_steps_per_epoch(loader: DataLoader, sampler: ShardedSampler, ctx: DistributedContext, *,
                          warn: bool = True) -> int:
    """Steps per epoch of a sharded loader (from the sampler's `offset`), the same on every rank.

    Every rank shards the dataset *it* was given; if their lengths differ (each rank read its own
    file, say), so do their step counts, and a rank that stopped early would leave the others
    waiting in a collective forever. One small all-gather at the start of `fit` finds out, and
    every rank then runs the smallest count (with a warning naming each rank's length). Independent
    ranks (`DistributedContext.independent`) wait for nobody: each runs its own count."""
    samples = sampler.shard_length()
    steps = samples // loader.batch_size if loader.drop_last else -(-samples // loader.batch_size)
    if ctx.world_size == 1 or ctx.independent:
        return steps
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    dataset = loader.dataset.dataset if isinstance(loader.dataset, SeededSamples) else loader.dataset
    # (Not with loader workers: a dataset that opens its file at its first read, in each worker, would open
    # it here in the training process, which its workers then inherit or cannot pickle.)
    first = first_sample_fingerprint(dataset) if warn and not loader.num_workers else None
    words = first.words() if first is not None else [0] * FINGERPRINT_WORDS
    mine = torch.tensor([sampler.dataset_len, steps, loader.batch_size, *words], dtype=torch.int64, device=device)
    gathered = [t.tolist() for t in _all_gather(mine, ctx)]
    lengths = [t[0] for t in gathered]
    counts = [t[1] for t in gathered]
    firsts = [Fingerprint.from_words(t[3:]) for t in gathered]
    # Named by their ranks in the job, as the log prefixes are (a group's members: a parameter server's workers).
    ranks = dist.get_process_group_ranks(ctx.group) if ctx.group is not None else range(ctx.world_size)
    known = [(r, f) for r, f in zip(ranks, firsts) if f is not None]
    differ = [r for r, f in known if not f.matches(known[0][1])]
    if warn and len(set(lengths)) == 1 and differ:
        warnings.warn(
            f"fit(): the dataset differs across ranks (its first sample on rank {differ[0]} is not rank "
            f"{known[0][0]}'s), though its length ({lengths[0]}) is the same: fit() shards a map-style dataset as one "
            f"dataset seen by every rank, so each rank trains on 1/{ctx.world_size} of its own. Give every rank the "
            "same dataset, or, for data of your own per rank, an IterableDataset", RuntimeWarning, stacklevel=3)
    sizes = [t[2] for t in gathered]
    if warn and len(set(lengths)) == 1 and len(set(sizes)) > 1:
        warnings.warn(
            "fit(): the batch size differs across ranks ("
            + ", ".join(f"rank {r}: {b}" for r, b in zip(ranks, sizes))
            + f"), which gives {counts} steps per epoch over the {lengths[0]} samples; every rank runs {min(counts)} "
            "so that none waits for the others forever, and the rest of the epoch is left out: give every rank "
            "the same batch size", RuntimeWarning, stacklevel=3)
    elif warn and (len(set(lengths)) > 1 or len(set(counts)) > 1):
        warnings.warn(
            "fit(): the dataset's length differs across ranks ("
            + ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, lengths))
            + f"), which gives {counts} steps per epoch; every rank runs {min(counts)} so that none waits for "
            "the others forever. fit() shards a map-style dataset as one dataset seen by every rank: for data "
            "of your own per rank, pass an IterableDataset (ranks then stop together at the shortest)",
            RuntimeWarning, stacklevel=3,
        )
    return min(counts)


class MapDataset(Dataset):
    """A map-style dataset that is not a `torch.utils.data.Dataset` (a list of samples, a Hugging Face
    ``datasets.Dataset``, a class of one's own with ``__getitem__`` and ``__len__``), wrapped so that
    `fit` shards and batches it as `DataLoader` would take it, instead of reading its items as batches."""

    def __init__(self, data) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def _all_gather(mine: torch.Tensor, ctx: DistributedContext) -> list[torch.Tensor]:
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return gathered


def map_style(data) -> bool:
    """Whether `data` is a map-style collection of samples that is not a torch `Dataset` (`MapDataset`)."""
    return (not isinstance(data, (Dataset, DataLoader, str, bytes, dict)) and hasattr(data, "__getitem__")
            and hasattr(data, "__len__"))


def train_loader(data, ctx: DistributedContext, *, batch_size, shuffle: bool, drop_last: bool, num_workers: int,
                 seed: int, dp_rank: int | None = None, dp_world_size: int | None = None,
                 loader_batch_size: int | None = None, min_rows: int = 1):
    """What `fit` iterates: a map-style dataset (or a DataLoader over one) sharded with `ShardedSampler`
    over the data-parallel replicas (`dp_world_size` of them, this rank feeding `dp_rank`; default: the
    context mesh's), anything else as given. `loader_batch_size` (a global batch's share) replaces a
    given DataLoader's batch size, and a DataLoader already sharded is rebuilt with it. `min_rows`: the
    fewest samples a replica's batch holds in an epoch's short last step (padded to it where fewer are
    left: `ShardedSampler`)."""
    dp_rank = ctx.mesh.dp_rank if dp_rank is None else dp_rank
    dp_world_size = ctx.mesh.dp_size if dp_world_size is None else dp_world_size
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset) or (isinstance(data.sampler, ShardedSampler)
                                                         and loader_batch_size is None):
            return data
        if data.batch_size is None and loader_batch_size is None:
            raise ValueError("fit() shards a DataLoader's dataset over the data-parallel replicas by sample, which "
                             "needs its batch_size; this one has none (a batch_sampler, or batch_size=None). Pass "
                             "a DataLoader with a batch_size, or an iterable of this rank's own batches (a batch sampler "
                             "that shards for this rank, in an iterable that is not a DataLoader: any such iterable "
                             "is used as given, and one that iter() gives again each epoch serves every epoch)")
        _check_loader_order(data, shuffle)
        size = loader_batch_size or data.batch_size
        # (the loader's own drop_last too: each replica's short batch dropped, their count must agree)
        sampler = ShardedSampler(data.dataset, dp_world_size, dp_rank, shuffle=shuffle, seed=seed,
                                 drop_last=data.drop_last or drop_last, batch_size=size, min_rows=min_rows)
        workers = dict(persistent_workers=data.persistent_workers, prefetch_factor=data.prefetch_factor,
                       multiprocessing_context=data.multiprocessing_context) if data.num_workers else {}
        sampler.keyed = bool(data.num_workers)
        return DataLoader(
            SeededSamples(data.dataset, seed) if data.num_workers else data.dataset,
            batch_size=size, sampler=sampler, collate_fn=data.collate_fn,
            num_workers=data.num_workers, pin_memory=data.pin_memory, drop_last=data.drop_last or drop_last,
            worker_init_fn=WorkerSignals(data.worker_init_fn), timeout=data.timeout, **workers,
        )
    if isinstance(data, IterableDataset) or not isinstance(data, Dataset):
        if isinstance(batch_size, int):
            warnings.warn(f"fit(batch_size={batch_size}) is not used: a {type(data).__name__} is iterated as given, "
                          "each item one batch, on every rank as it is; for fit to shard and batch samples, pass a "
                          "map-style dataset (a torch Dataset, or a list of samples)", UserWarning, stacklevel=3)
        return data
    if batch_size is None or batch_size < 1:
        raise ValueError(f"fit() on a Dataset needs batch_size >= 1, got {batch_size!r}")
    sampler = ShardedSampler(data, dp_world_size, dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last,
                             batch_size=batch_size, min_rows=min_rows)
    sampler.keyed = bool(num_workers)
    return DataLoader(SeededSamples(data, seed) if num_workers else data, batch_size=batch_size, sampler=sampler,
                      num_workers=num_workers,
                      pin_memory=ctx.device.type == "cuda", drop_last=drop_last,
                      worker_init_fn=WorkerSignals(None) if num_workers else None)


#: A loader worker's SIGTERM that it ignored (one sent to the whole process group) and how long it then
#: lives at most if nobody shuts it down.
_TERMED = {"once": False}
IGNORED_SIGTERM_LIVES_S = 900  # (past a long save on the signal: a torn one is worse)


def _worker_sigterm(signum, frame) -> None:
    """A loader worker's SIGTERM handler. One sent to the whole process group (a scheduler's stop) while
    the training process trains is ignored once: that process stops at a step boundary, saves, and then
    shuts its workers down, which a worker killed by the signal made fail ("DataLoader worker is killed
    by signal"). The worker ends as by default where its DataLoader is shutting it down (its done event
    set), on a second SIGTERM (a shutdown's terminate, multiprocessing's at exit), or after
    `IGNORED_SIGTERM_LIVES_S` (SIGALRM) if nobody does."""
    import os
    import signal

    shutting = False
    while frame is not None:  # torch's worker loop holds the event its DataLoader sets to shut it down
        if frame.f_code.co_name == "_worker_loop":
            done = frame.f_locals.get("done_event")
            shutting = done is None or done.is_set()
            break
        frame = frame.f_back
    else:
        shutting = True  # (not inside a worker loop: nothing to keep alive)
    if shutting or _TERMED["once"]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _TERMED["once"] = True
    signal.alarm(IGNORED_SIGTERM_LIVES_S)


def stop_workers(batches: Any, loader: Any = None) -> None:
    """End a DataLoader iterator's worker processes now, as its end or its garbage collection would: `fit`
    left by an error keeps its iterator alive in the traceback, and at the interpreter's exit
    multiprocessing's terminate is the workers' first SIGTERM, which they ignore while training goes on
    (`_worker_sigterm`): the failed process then waited `IGNORED_SIGTERM_LIVES_S` instead of exiting.
    A ``persistent_workers`` `loader` keeps that iterator to reuse it: it is let go, so that the
    loader's next epoch (a later fit) starts new workers rather than resetting stopped ones."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # (torch's multi-process iterator)
    if shutdown is not None:
        with contextlib.suppress(Exception):
            shutdown()
        if loader is not None and getattr(loader, "_iterator", None) is batches:
            loader._iterator = None


class SeededSamples(Dataset):
    """A map-style dataset read in DataLoader worker processes, each sample with the worker's random number
    generators (torch's, Python's, NumPy's) seeded from the job's seed, the epoch and the sample's index:
    the keys are ``(epoch, index)`` (`ShardedSampler.keyed`). A sample's random augmentation is then the
    same whichever worker reads it and however many there are, so a run resumed in the middle of an
    epoch draws what the unbroken run drew (a worker's generator otherwise advanced over the samples it
    happened to read since the epoch began: a resume, restarting the workers at another sample, drew
    other augmentations, 1.9 off the unbroken run's weights in a trial). The training process's own
    generators are not touched."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def _reseed(self, epoch: int, index: int) -> None:
        import sys

        value = (((self.seed * 1_000_003) + epoch) * 2_147_483_647 + index) % (2**63 - 1)
        torch.manual_seed(value)
        random.seed(value)
        numpy = sys.modules.get("numpy")  # (only if the dataset's code uses it)
        if numpy is not None:
            numpy.random.seed(value % 2**32)

    def __getitem__(self, key):
        epoch, index = key
        self._reseed(epoch, index)
        return self.dataset[index]


class WorkerSignals:
    """A DataLoader's `worker_init_fn` that first makes its worker ignore SIGINT and SIGHUP, and a first
    SIGTERM while training goes on (`_worker_sigterm`), then calls `fn` (the user's, if any). A signal sent
    to the job's whole process group (Ctrl-C in a terminal, ``kill -TERM -<pgid>``, Slurm's scancel,
    systemd) reached the workers too: they died, and the training process's save on that signal failed
    ("DataLoader worker is killed by signal: Terminated", raised by torch's SIGCHLD handler). The training
    process stops at a step boundary and shuts its workers down; a worker whose parent is gone exits by
    itself (DataLoader's watchdog)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        import signal

        for number in (signal.SIGINT, getattr(signal, "SIGHUP", None)):
            if number is not None:
                signal.signal(number, signal.SIG_IGN)
        if hasattr(signal, "SIGALRM"):  # (POSIX)
            signal.signal(signal.SIGTERM, _worker_sigterm)
        if self.fn is not None:
            self.fn(worker_id)
