"""Checkpoints on one shared directory or on one directory per node, found out at run time.

A checkpoint directory is either *shared* by every rank (one ReadWriteMany volume, NFS, a single
machine) or private to each node (one volume per Kubernetes pod, a node's local disk). The trainer
does not ask which: `detect_layout` lets every node's local rank 0 drop a marker file named after a
random token into the directory, and every rank looks for every node's marker. Ranks that see the
same markers share a directory; the lowest rank among them is the directory's *writer*. On a shared
directory that is rank 0 alone, and everything works as on one machine.

With a directory per node, each writer does for its own directory what rank 0 does for a shared one:

* it writes ``meta.pt`` last, listing (under ``checksums``) the rank files of its own node, so that
  `CheckpointManager.latest_good` on that node verifies what is there and nothing else, and keeping
  every rank's digest under ``rank_checksums``;
* it records the best checkpoint and prunes old ones (`CheckpointManager.finalize`), so no node keeps
  every checkpoint forever.

On resume the directories may disagree (a node died halfway through a save; a volume was restored from
an older snapshot; the job grew, and a new node's volume is empty or holds older steps from an earlier
time at that size), so `agree_on_checkpoint` lets the writers exchange which steps they have and picks
the newest one that verifies in every directory holding it, whose rank files those directories hold
between them. Then `fetch_missing_files` copies over the network the rank files a directory lacks:
``rank0.pt`` (the replicated model and optimizer of DDP, and the layout header of sharded strategies,
which every rank reads), the files of ranks that now run on a different node than when they saved
(torchrun orders nodes by host name, then process id), and everything a directory without the step
needs, with a ``meta.pt`` of its own. After that every rank loads from its own directory with
`DistributedTrainer.load_checkpoint`, unchanged.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import CheckpointManager, atomic_write_bytes, read_meta, write_meta

__all__ = ["DirectoryLayout", "detect_layout", "agree_on_checkpoint", "fetch_missing_files", "replicate_checkpoint"]


@dataclass(frozen=True)
class DirectoryLayout:
    """Which ranks write into the same physical directory.

    Attributes:
        writer_of: for every global rank, the rank that writes ``meta.pt`` into (and prunes) the
            directory that rank's files go to: the lowest rank sharing that directory.
    """

    writer_of: tuple[int, ...]

    @property
    def writers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.writer_of)))

    @property
    def shared(self) -> bool:
        """One directory for the whole job."""
        return len(self.writers) == 1

    def ranks_of(self, writer: int) -> tuple[int, ...]:
        """The ranks whose files go to `writer`'s directory."""
        return tuple(r for r, w in enumerate(self.writer_of) if w == writer)

    def checksums(self, rank: int, digests: list[str]) -> dict[str, Any]:
        """The checksum entries of the ``meta.pt`` that `rank` (a writer) puts in its directory."""
        every = {f"rank{k}.pt": d for k, d in enumerate(digests)}
        if self.shared:
            return {"checksums": every}
        mine = {f"rank{k}.pt": digests[k] for k in self.ranks_of(rank)}
        return {"checksums": mine, "rank_checksums": every}


def single_directory(world_size: int) -> DirectoryLayout:
    return DirectoryLayout(writer_of=(0,) * world_size)


def detect_layout(directory: str, context, shared: bool | None = None) -> DirectoryLayout:
    """Find out which ranks share `directory` (every rank must call this; it creates the directory).

    `shared=True` declares one directory for all ranks, `shared=False` one per node (the ranks with the
    same ``rank - local_rank``); None detects it with marker files, written by each node's local rank 0.
    A job on one node (``local_world_size == world_size``) needs no detection.
    """
    rank, world = context.rank, context.world_size
    if shared is True or world == 1 or (shared is None and context.local_world_size >= world):
        return single_directory(world)
    os.makedirs(directory, exist_ok=True)
    token = uuid.uuid4().hex if rank == 0 else None
    node_leader = rank - context.local_rank  # torchrun gives a node's processes consecutive ranks
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (node_leader, token), group=context.group)
    leaders = sorted({leader for leader, _ in gathered})
    if shared is False:
        return DirectoryLayout(writer_of=tuple(leader for leader, _ in gathered))
    token = gathered[0][1]

    def marker(leader: int) -> str:
        # A fresh name every time: a lookup of a name never seen before is not answered from a network
        # file system's cache of the directory's old contents.
        return os.path.join(directory, f".dtrain-node-{token}-{leader}")

    if context.local_rank == 0:
        with open(marker(rank), "x") as f:
            f.write(f"written by rank {rank}\n")
            f.flush()
            os.fsync(f.fileno())
    context.barrier()
    seen = tuple(leader for leader in leaders if os.path.exists(marker(leader)))
    seen_by: list[Any] = [None] * world
    dist.all_gather_object(seen_by, seen, group=context.group)  # every rank has looked once this returns
    if context.local_rank == 0:
        try:
            os.remove(marker(rank))
        except OSError:
            pass
    writer_of = []
    for r, (leader, _) in enumerate(gathered):
        if leader not in seen_by[r]:
            raise RuntimeError(
                f"checkpoint directory {directory!r}: rank {r} does not see the marker file that its node's local "
                f"rank 0 (rank {leader}) wrote there; the processes of one node must see the same directory")
        writer_of.append(min(seen_by[r]))
    for r, w in enumerate(writer_of):
        if seen_by[r] != seen_by[w]:
            raise RuntimeError(
                f"checkpoint directory {directory!r} is shared by some nodes and not others in a way that does not "
                f"split them into groups: rank {r} sees the markers of nodes led by ranks {list(seen_by[r])}, rank {w} "
                f"those of ranks {list(seen_by[w])}; give the job one shared directory or one per node")
    return DirectoryLayout(writer_of=tuple(writer_of))


def _gather(value: Any, context) -> list[Any]:
    out: list[Any] = [None] * context.world_size
    dist.all_gather_object(out, value, group=context.group)
    return out


def agree_on_checkpoint(manager: CheckpointManager, context,
                        layout: DirectoryLayout) -> tuple[str, dict[str, Any], dict[int, dict]] | None:
    """The newest checkpoint every directory can have: intact wherever it is, and whole between them
    (every rank must call this).

    A step qualifies when every directory that holds it complete (``meta.pt`` present) verifies it, those
    directories agree on its files' digests (the same save), and together they hold every rank file it
    lists. A directory *without* the step (a new node's empty volume when the job grows; a volume kept
    from an earlier size, holding only older steps) does not disqualify it: `fetch_missing_files` gives
    it the files it needs and a ``meta.pt`` of its own. A directory whose own copy is damaged does, as
    does a step whose files nobody holds in full (a node died while saving it).

    Returns ``(path, meta, inventory)`` with this rank's path, the checkpoint's metadata, and, for each
    writer, ``{"files": the rank files its directory holds, "rank_checksums": every rank file's digest,
    "world_size": the saving world size, "strategy": ...}``, plus ``"meta"`` (what to write there) for a
    directory that lacks the step; None when no step qualifies. Only writers read their directories;
    each round costs one small all-gather, newest step first.
    """
    rank = context.rank
    writers = layout.writers
    is_writer = layout.writer_of[rank] == rank
    complete = ([s for s in manager.steps() if os.path.isfile(os.path.join(manager.path_for(s), "meta.pt"))]
                if is_writer else None)
    held = {w: set(steps) for w, steps in enumerate(_gather(complete, context)) if w in writers}
    candidates = set().union(*held.values())
    share_missing: list[int] = []  # steps passed over because some rank's file is in no directory here
    while True:
        if not candidates:
            by_writer = {w: sorted(s) for w, s in held.items() if s}
            if share_missing:
                # A node that held part of every checkpoint is not here (lost without a stop, its
                # volume elsewhere): starting from step 0 would throw the run away. Same on every rank.
                raise RuntimeError(
                    f"checkpoints exist in the nodes' directories (complete steps by the rank writing each: "
                    f"{by_writer}) but none is whole among the nodes here: step(s) {sorted(share_missing)} lack "
                    "rank files that no directory here holds (with a checkpoint directory per node, a node lost "
                    "without a stop takes its share of each checkpoint with it). Bring that node or its volume "
                    "back (the job resumes once it rejoins), or use one shared checkpoint directory; to start from "
                    "step 0 instead, move the checkpoints away (or set resume off)")
            if any(held.values()) and rank == 0:
                warnings.warn(
                    "no checkpoint is intact and whole over the nodes' checkpoint directories (complete steps by "
                    f"the rank writing each directory: {by_writer}); training starts from step 0", stacklevel=3)
            return None
        step = max(candidates)
        candidates.discard(step)
        path = manager.path_for(step)
        answer: Any = None  # None: this directory lacks the step
        if is_writer and step in held[rank]:
            try:
                meta = manager.verify(path)
                answer = {"files": sorted(meta["checksums"]),
                          "rank_checksums": meta.get("rank_checksums", meta["checksums"]),
                          "world_size": int(meta["world_size"]), "strategy": meta.get("strategy")}
            except (ValueError, RuntimeError, OSError, EOFError) as err:
                warnings.warn(f"rank {rank}: skipping checkpoint {path}: {err}; falling back to an earlier one",
                              stacklevel=3)
                answer = str(err)
        answers = {w: a for w, a in enumerate(_gather(answer, context)) if w in writers}
        holders = [w for w, a in answers.items() if isinstance(a, dict)]
        if any(isinstance(a, str) for a in answers.values()) or not holders:
            continue
        digests = answers[holders[0]]["rank_checksums"]
        if any(answers[w]["rank_checksums"] != digests for w in holders):
            if rank == 0:
                warnings.warn(f"skipping checkpoint step {step}: the nodes' directories hold different saves of it "
                              "(their rank files' digests differ); falling back to an earlier one", stacklevel=3)
            continue
        if not set(digests) <= set().union(*(answers[w]["files"] for w in holders)):
            share_missing.append(step)  # some rank's file is nowhere here: a node died saving it, or is gone
            continue
        lacking = [w for w in writers if answers[w] is None]
        if layout.writer_of[rank] in holders:
            meta = read_meta(path)  # verified against its checksum, as every reader does
        else:
            meta = None
        if lacking:
            box = [meta]
            dist.broadcast_object_list(box, src=holders[0], group=context.group)
            meta = box[0]
            for w in lacking:
                answers[w] = {"files": [], "rank_checksums": digests, "world_size": answers[holders[0]]["world_size"],
                              "strategy": answers[holders[0]]["strategy"], "meta": meta}
        return path, meta, answers


def _needed_files(layout: DirectoryLayout, writer: int, world_size: int, saved_world: int, same_strategy: bool) -> set[str]:
    """Rank files `load_checkpoint` may read in `writer`'s directory: rank 0's (replicated parameters)
    and its own ranks' under the same strategy and world size; every file otherwise (re-sharding)."""
    if saved_world != world_size or not same_strategy:
        return {f"rank{k}.pt" for k in range(saved_world)}
    return {"rank0.pt"} | {f"rank{r}.pt" for r in layout.ranks_of(writer)}


def fetch_missing_files(path: str, context, layout: DirectoryLayout, inventory: dict[int, dict],
                        strategy: str | None = None, *, every_file: bool = False) -> list[tuple]:
    """Copy into each directory the rank files of checkpoint `path` it lacks (every rank must call this);
    a directory that lacked the whole step then gets its own ``meta.pt``.

    Each missing file is sent by the lowest writer that has it to the writer of the directory that
    needs it, checked against the digest in ``rank_checksums`` and written atomically. The transfers
    run in one order that every rank computes alike, so they cannot deadlock. Returns the transfers as
    ``(source rank, destination rank, file name)``. `strategy` is the loading strategy's name: under
    another one than the checkpoint's, a rank may need any file. `every_file`: every directory gets
    every rank file (`replicate_checkpoint`).
    """
    rank = context.rank
    transfers = []
    for writer in layout.writers:
        entry = inventory[writer]
        same_strategy = entry.get("strategy") == strategy
        needed = (set(entry["rank_checksums"]) if every_file else
                  _needed_files(layout, writer, context.world_size, entry["world_size"], same_strategy))
        for name in sorted(needed - set(entry["files"])):
            sources = [w for w in layout.writers if name in inventory[w]["files"]]
            if not sources:
                raise RuntimeError(
                    f"checkpoint {path!r}: no node's directory holds {name} (the ranks writing the directories have "
                    f"{ {w: inventory[w]['files'] for w in layout.writers} }); it cannot be resumed")
            transfers.append((sources[0], writer, name))
    lacking = [w for w in layout.writers if "meta" in inventory[w]]
    if rank in lacking:
        os.makedirs(path, exist_ok=True)
    device = context.device if context.backend == "nccl" else torch.device("cpu")
    for src, dst, name in transfers:
        if rank == src:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
            dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst, group=context.group)
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst, group=context.group)
        elif rank == dst:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(size, src, group=context.group)
            buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            dist.recv(buffer, src, group=context.group)
            data = buffer.cpu().numpy().tobytes()
            expected = inventory[dst]["rank_checksums"].get(name)
            if hashlib.sha256(data).hexdigest() != expected:
                raise ValueError(f"rank {rank}: {name} of checkpoint {path!r}, received from rank {src}, does not "
                                 "match the checksum in meta.pt")
            atomic_write_bytes(data, os.path.join(path, name))
    if rank in lacking:
        # Last, as a save does: a meta.pt of this directory's own, listing the rank files it now holds, so
        # the step verifies here (and is pruned by keep_last) like one this node wrote itself.
        received = {name for _, dst, name in transfers if dst == rank}
        every = inventory[rank]["rank_checksums"]
        write_meta({**inventory[rank]["meta"], "checksums": {n: every[n] for n in sorted(received)},
                    "rank_checksums": every}, path)
    if transfers or lacking:
        context.barrier()  # the other ranks of a node read what its writer received
    return transfers


def replicate_checkpoint(path: str, context, layout: DirectoryLayout, signalled: bool = False) -> list[tuple]:
    """Make checkpoint `path` whole in every node's directory (every rank must call this, after the save).

    With a directory per node each holds only its own ranks' files, so a node that leaves for good takes
    its share of the checkpoint with it: under a sharded strategy, or at any other world size, the nodes
    that stay could not resume from it. `fit` calls this for the checkpoint of a stop on SIGTERM (a
    Kubernetes scale-down SIGTERMs the pod it removes): every directory gets every rank file over the
    network, then its writer rewrites ``meta.pt`` to list them all, so the step verifies there and
    `agree_on_checkpoint` finds it whole among whichever nodes come back. A crash between that
    ``meta.pt.sha256`` and ``meta.pt`` leaves the step damaged in that directory only (an earlier step is
    resumed). Returns the transfers, as `fetch_missing_files`.

    `signalled`: whether this rank got the stop signal itself. When every rank did, nothing is copied:
    the whole job is stopping (torchrun restarting every node's workers to grow the job; every pod
    deleted), and no node is known to leave while others stay. A node removed at the same moment as
    the job grows is the case this leaves out (its files stay on its volume only).
    """
    if layout.shared:
        return []
    if all(_gather(bool(signalled), context)):
        return []
    rank = context.rank
    is_writer = layout.writer_of[rank] == rank
    answer = None
    if is_writer:
        meta = read_meta(path)
        answer = {"files": sorted(meta["checksums"]), "rank_checksums": meta.get("rank_checksums", meta["checksums"]),
                  "world_size": int(meta["world_size"]), "strategy": meta.get("strategy")}
    inventory = {w: a for w, a in enumerate(_gather(answer, context)) if w in layout.writers}
    transfers = fetch_missing_files(path, context, layout, inventory, every_file=True)
    if is_writer and any(dst == rank for _, dst, _ in transfers):
        meta = read_meta(path)
        write_meta({**meta, "checksums": dict(meta["rank_checksums"])}, path)
    context.barrier()
    return transfers
