"""The trainer's checkpoints: save, load, resume (agreed across nodes).

A mixin of `DistributedTrainer`. Every strategy's state is saved in one format: the strategy says
which pieces of the full parameters and optimizer state this rank holds (`Strategy.state_layout`),
`distributed_training.checkpoint_shards` writes and reads them, so a checkpoint loads under any
strategy at any world size. Besides, each rank saves its RNG streams, its buffers and what its
strategy keeps per rank (`rank_state`, e.g. compression residuals), and rank 0 puts the trainer's
position (step, epoch, data position in samples, global batch, schedule) and the index of the pieces
in ``meta.pt``. The files and their crash-proofing are in `distributed_training.checkpoint`; `fit`'s
checkpoints written in the background (``checkpoint_async``), in `trainer_checkpoints_async` (the
base of `Checkpointing`); hyperparameters changed since the checkpoint, in `trainer_hyperparameters`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from .checkpoint import (CheckpointCorruptError, CheckpointMismatchError, load_file, read_meta, rng_state, save_file,
                         set_rng_state, sha256_file, write_meta)
from .checkpoint_async import rank_file
from .checkpoint_swap import previous_of, put_in_place, remove_stale_rank_files, staged_of, whole
from .checkpoint_lock import CheckpointDirectoryInUseError, in_use_message, lock_directory, unlock_directory
from .checkpoint_layout import DirectoryLayout, agree_on_checkpoint, detect_layout, fetch_missing_files
from .checkpoint_shards import (FORMAT, Sources, build_index, check_shapes, extra_states, host_clone, load_extra_states,
                                pack, summary, unpack_optimizer, unpack_params)
from .logs import get_logger
from .mesh import global_rank
from .stopping import checkpoint_writing
from .trainer_checkpoints_async import BackgroundCheckpointing
from .trainer_hyperparameters import HyperparameterRestore

__all__ = ["Checkpointing"]

log = get_logger()
#: The trainer's config keys that only a run with a pipeline has.
_PIPELINE_KEYS = ("pipeline_parallel_size", "pipeline_schedule", "microbatches", "pipeline_chunks")
_TENSOR_DEFAULTS = {"tensor_parallel_size": 1, "sequence_parallel": False}  # their values without tensor parallelism

#: What a failed load raises on every rank: the type the failing rank met.
_LOAD_ERRORS = {cls.__name__: cls for cls in (CheckpointCorruptError, CheckpointMismatchError, FileNotFoundError,
                                              OSError, RuntimeError, ValueError, KeyError)}

# Suffixes of single-file checkpoints, which a checkpoint directory's name should not look like.
_FILE_SUFFIXES = {".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle", ".tar", ".safetensors", ".zip"}


class Checkpointing(HyperparameterRestore, BackgroundCheckpointing):
    """`DistributedTrainer`'s checkpoint methods."""

    def _resume_or_start_fresh(self) -> str | None:
        """Load the latest good checkpoint if resuming (returning its path), or, with ``resume=False``
        at the start of training, move an earlier run's checkpoints aside."""
        if self.checkpoints is None:
            return None
        self._lock_checkpoint_directory()
        ctx = self.context
        if not self.resume:
            self._set_checkpoints_aside("resume is off")
            return None
        found = self._resume_point()
        if found is None and self.step == 0:
            # Every checkpoint there failed its check (each said why): not resumable, and not to be mixed
            # with this run's (keep-last-N would delete the new ones in favour of their later steps).
            self._set_checkpoints_aside("resume found no intact checkpoint (each one skipped is said above)")
        if found is None or int(found[1]["step"]) <= self.step:
            return None
        if found[2] is not None:  # a directory per node: bring each node the rank files it lacks
            fetch_missing_files(found[0], self.context, self._layout(found[0]), found[2], self.strategy.name)
        self.load_checkpoint(found[0])
        if ctx.is_main:
            log.info("resumed from step %d (%s)", self.step, found[0])
        return found[0]

    def _set_checkpoints_aside(self, why: str) -> None:
        """Before the first step, once: move the checkpoints already in the directory into
        ``previous_run_<k>/`` (each directory's writer; the others wait), saying `why`."""
        if self.step != 0 or self._set_aside:
            return
        self._set_aside = True
        ctx = self.context
        layout = self._layout(self.checkpoints.path_for(0))
        # Each directory's writer (rank 0, or each node's first rank with a directory per node).
        moved = self.checkpoints.set_aside() if layout.writer_of[ctx.rank] == ctx.rank else None
        if moved is not None:
            log.warning("%s: moved the checkpoints already in %s to %s; training starts from step 0", why,
                        self.checkpoints.directory, moved)
        ctx.barrier()  # nobody writes into a directory before its writer has cleared it

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

    def _unlock_checkpoint_directory(self) -> None:
        if self._locked_directory:
            unlock_directory(self._locked_directory)
        self._locked_directory = None

    def _save_numbered(self, metrics: dict[str, torch.Tensor] | None) -> None:
        """`fit`'s checkpoint of this step, under the peer watch (a peer dying meanwhile: named, not a hang)."""
        with self._watched(f"the checkpoint save of step {self.step}"):
            self._save_numbered_watched(metrics)

    def _save_numbered_watched(self, metrics: dict[str, torch.Tensor] | None) -> None:
        path = self.checkpoints.path_for(self.step)
        layout = self._layout(path)
        broadcast = not layout.shared and self.checkpoints.best_metric is not None
        if self.checkpoint_async and not broadcast:
            # The metrics stay tensors: reading a device tensor here would wait for the step's kernels.
            self._save_in_background(path, dict(metrics or {}))
            self._last_saved_step = self.step
            return
        values = {k: float(v) for k, v in (metrics or {}).items()}
        if broadcast:
            # Losses are each rank's own: every directory must rank checkpoints by the same (rank 0's) values.
            box = [values]
            dist.broadcast_object_list(box, src=global_rank(self.context.group, 0), group=self.context.group)
            values = box[0]
        if self.checkpoint_async:
            self._save_in_background(path, values)
            self._last_saved_step = self.step
            return
        self._save_checkpoint(path, values, staged=False)  # a new directory: nothing there to keep whole
        if layout.writer_of[self.context.rank] == self.context.rank:
            self.checkpoints.finalize(self.step, values)
        self.context.barrier()
        self._last_saved_step = self.step

    def _layout(self, path: str | os.PathLike) -> DirectoryLayout:
        """Which ranks share the directory that checkpoint `path` goes into (found once per directory;
        a collective the first time)."""
        parent = os.path.dirname(os.path.abspath(os.fspath(path)))
        if parent not in self._layouts:
            self._layouts[parent] = detect_layout(parent, self.context, self.checkpoint_shared)
        return self._layouts[parent]

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

    def save_checkpoint(self, path: str | os.PathLike, metrics: dict[str, float] | None = None) -> None:
        """Write a checkpoint *directory* at `path`, e.g. ``"checkpoints/last"`` (see
        `distributed_training.checkpoint`); every rank must call it.

        Each rank writes ``rank<r>.pt`` (its RNG states and buffers; its shards under ZeRO/FSDP; the
        model and optimizer on rank 0 under DDP), then rank 0 writes ``meta.pt`` (step, epoch, data
        position, scheduler, configured hyperparameters, config, metrics, checksums) last, after its own
        checksum ``meta.pt.sha256``. Files are written atomically. A path that looks like a file name
        (``last.pt``) still becomes a directory, with a warning. When each node has a directory of its
        own (see `checkpoint_shared`), each node's first rank writes a ``meta.pt`` there, listing that
        node's files. The files go into ``<path>.saving`` first, which replaces `path` once whole (two
        renames): a checkpoint already there (``checkpoints/last`` saved again) stays whole until then,
        and a save killed anywhere leaves one that `load_checkpoint(path)` loads.
        """
        path = _directory_name(path, "save_checkpoint")
        if os.path.isfile(path):
            raise FileExistsError(f"rank {self.context.rank}: save_checkpoint({path!r}): a file is there, and a "
                                  "checkpoint is a directory (one file per rank plus meta.pt): pick another name, or "
                                  "remove the file")
        self._save_checkpoint(path, metrics, staged=True)

    def _save_checkpoint(self, path: str, metrics: dict[str, float] | None, staged: bool) -> None:
        ctx = self.context
        suffix = os.path.splitext(path.rstrip("/\\"))[1]
        if suffix.lower() in _FILE_SUFFIXES and not os.path.isdir(path) and ctx.is_main:
            message = (f"save_checkpoint({path!r}) writes a directory named {os.path.basename(path)!r} (one file per "
                       f"rank plus meta.pt), not a single {suffix} file; name it without a suffix, e.g. "
                       f"{path[:-len(suffix)]!r}, and load it with load_checkpoint")
            warnings.warn(message, stacklevel=2)
        with checkpoint_writing(), self._watched(f"the checkpoint save to {path}", call=True):  # a peer failing: named
            held, packed, part = self._rank_part()
            if self.strategy.save_checkpoint_files(self.model, path, part, self._meta(held, packed, None, metrics)):
                return  # the strategy wrote it (the parameter server: its servers' state)
            target = staged_of(path) if staged else path
            digest = save_file(part, rank_file(target, ctx.rank))
            mine = (digest, summary(packed), sorted(part["buffers"]), self.dp_rank)
            every = [mine]
            if ctx.world_size > 1:
                every = [None] * ctx.world_size
                dist.all_gather_object(every, mine, group=ctx.group)
            digests = [d for d, *_ in every]
            layout = self._layout(path)
            if layout.writer_of[ctx.rank] == ctx.rank:  # rank 0, or each node's first rank with a directory per node
                meta = self._meta(held, packed, [rest for _, *rest in every], metrics)
                meta.update(layout.checksums(ctx.rank, digests))
                write_meta(meta, target)
                remove_stale_rank_files(target, ctx.world_size)
                if staged:
                    put_in_place(target, path)
            ctx.barrier()

    def _rank_part(self, to_host: Callable[[torch.Tensor], torch.Tensor] = host_clone,
                   buffers_to_host: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """(held, packed, part): what this rank holds, its packed pieces and the whole of ``rank<r>.pt``,
        every tensor copied to host memory by `to_host` (the buffers by `buffers_to_host`, default the same)."""
        held = self.strategy.state_layout(self.model, self.optimizer)
        packed = pack(held, self.optimizer, to_host=to_host)
        part: dict[str, Any] = {"rng": rng_state(), **packed}
        part.update(self.strategy.rank_state(self.model))  # e.g. error-feedback residuals, which differ by rank
        # Buffers (BatchNorm's running statistics) are updated by each rank from its own data: every
        # rank's are state, under the model's keys (a pipeline rank holds its stages' only).
        buffers_to_host = buffers_to_host or to_host
        part["buffers"] = {k: buffers_to_host(b.detach()) for k, b in self.strategy.buffers(self.model).items()}
        # the modules' `get_extra_state()`, each rank its own (where the module holds its weights)
        part["extra_state"] = extra_states(self.module) if self.strategy.whole_module else {}
        return held, packed, part

    @staticmethod
    def _meta_ranks(every: list[tuple], param_groups) -> dict[str, Any]:
        """The part of ``meta.pt`` built from every rank's (summary of its pieces, buffer keys,
        data-parallel rank)."""
        buffer_index: dict[str, list[int]] = {}
        for rank, (_, keys, _) in enumerate(every):
            for key in keys:
                buffer_index.setdefault(key, []).append(rank)
        return {
            "index": build_index([sm for sm, _, _ in every], param_groups),
            "buffer_index": buffer_index,  # key -> the ranks whose file holds that buffer
            "dp_rank_of": [dp for *_, dp in every],  # each rank's data-parallel replica
        }

    def _meta(self, held, packed: dict[str, Any], every: list[tuple] | None,
              metrics: dict[str, float] | None) -> dict[str, Any]:
        """``meta.pt`` but its checksums; `every` holds each rank's (summary of its pieces, buffer keys,
        data-parallel rank); None: without the parts built from it (`_meta_ranks`, added later)."""
        ranks = self._meta_ranks(every, packed["param_groups"]) if every is not None else {}
        # A checkpoint written after an epoch's last batch is at the start of the next epoch: a resume then
        # sees the epochs it finished (and a run that ended there, as complete).
        done = self._epoch_finished
        return {
            "step": self.step,
            "epoch": self.epoch + 1 if done else self.epoch,
            "batch_in_epoch": 0 if done else self.batch_in_epoch,
            "samples_in_epoch": 0 if done else self.samples_in_epoch,  # the data position at any size
            "dataset_len": self._dataset_len,  # of the data that position is in (fit's sharded dataset)
            "batch_size": self.batch_size,
            "global_batch": ({**dataclasses.asdict(self.global_batch), "micro_batch_limit": self.micro_batch_size}
                             if self.global_batch is not None else None),  # (the limit: before a replica's share cut it)
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.precision.state_dict() or None,  # the fp16 scaler's state
            "world_size": self.context.world_size,
            "strategy": self.strategy.name,
            "checkpoint_format": FORMAT,
            "shapes": held.shapes,
            **ranks,
            "config": self.config,
            "optimizer_hparams": self._configured_hparams,
            "fit": dict(self._fit_limits),
            "metrics": dict(metrics or {}),
            **self.strategy.shared_state(self.model),  # e.g. DDP's bucket layout
        }

    def full_state_dict(self) -> dict[str, Any]:
        """The model's state for inference or another tool, whatever the strategy: on rank 0 the plain
        module's ``state_dict()`` (same keys, full tensors on the CPU), ``{}`` on the other ranks.
        Collective (a sharded strategy gathers the parameters unit by unit): call it on every rank."""
        with self._watched("full_state_dict()", call=True):
            state = self.strategy.model_state_dict(self.model)
        if not self.context.is_main:
            return {}
        return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what `save_checkpoint` wrote, under any strategy at any world size (a DDP checkpoint
        loads under ZeRO-3 at another world size, and back): each rank reads only the files holding
        the pieces of parameters and optimizer state it now needs. What only the writing strategy
        understands (DDP's bucket layout, compression residuals) comes back under the same strategy
        and world size; otherwise it starts afresh.

        Every file read, ``meta.pt`` included, is checked against its checksum before it is loaded; a
        corrupt one raises `CheckpointCorruptError` naming it. RNG states are restored when the world
        size is unchanged (a different world draws different random streams anyway). Each rank gets
        back its own buffers (BatchNorm statistics); when the world size changed, ranks that did not
        exist before take rank 0's (under a pipeline, a stage's buffers come from a rank of the same
        data-parallel replica that held them, else from replica 0's). Hyperparameters configured
        differently from the checkpoint's keep their new values, and the changes are logged (see
        `resume`); a different optimizer class or parameter shape is an error that names it.
        """
        path = _directory_name(path, "load_checkpoint")
        ctx = self.context
        if self._staging is not None:
            self._staging.fence()  # a background snapshot's copies read what loading overwrites
        meta_path = os.path.join(path, "meta.pt")
        if not os.path.isfile(meta_path):
            # A save stopped before it replaced `path` (`checkpoint_swap.put_in_place`): its own checkpoint if whole, else
            # the one it was replacing.
            found = next((p for p in (staged_of(path), previous_of(path)) if whole(p)), None)
            if found is not None:
                if ctx.is_main:
                    log.warning("checkpoint %r is missing or incomplete (a save over it was interrupted): loading "
                                "%r", path, found)
                path, meta_path = found, os.path.join(found, "meta.pt")
        # meta.pt read and verified by every rank, which agree (a read that failed on one rank only, a
        # network file system's transient error, left the others waiting in the load's collectives).
        meta, failure = None, ""
        try:
            if not os.path.isfile(meta_path) and not os.path.isfile(path):
                steps = sorted(n for n in os.listdir(path) if n.startswith("step_")) if os.path.isdir(path) else []
                hint = (f"; it holds fit's checkpoints ({steps[-1]} the newest): load one of those, e.g. "
                        f"trainer.latest_checkpoint()[0] with checkpoint_dir={path!r}" if steps else "")
                raise FileNotFoundError(f"rank {ctx.rank}: {meta_path!r} does not exist: not a complete checkpoint{hint}")
            meta = read_meta(path)
        except (CheckpointCorruptError, OSError) as err:
            if ctx.world_size == 1:
                raise
            failure = f"{type(err).__name__}: {err}"
        self._agree_on_load(path, failure, stage="checking")
        if meta.get("checkpoint_format") != FORMAT:
            raise CheckpointMismatchError(
                f"checkpoint {path!r} was written by an earlier version of distributed_training (format "
                f"{meta.get('checkpoint_format', 'per strategy')!r}; this version reads {FORMAT!r}): resume it with "
                "the version that wrote it, or start a new run (another checkpoint directory, or resume=False / "
                "dtrain --no-resume)")
        saved_optimizer = (meta.get("config") or {}).get("optimizer")
        if saved_optimizer is not None and saved_optimizer != self.config["optimizer"]:
            raise CheckpointMismatchError(
                f"checkpoint {path!r} holds the state of a {saved_optimizer} optimizer, and this trainer's optimizer "
                f"is {self.config['optimizer']}: optimizer state cannot carry over to another class (start a new run: "
                "another checkpoint directory, or resume=False)")
        old_world = int(meta["world_size"])
        cache: dict[int, dict] = {}

        def read(k: int) -> dict:
            if k not in cache:
                name = f"rank{k}.pt"
                # rank_checksums (a directory per node) also covers rank files fetched from other nodes.
                cache[k] = load_file(os.path.join(path, name), meta.get("rank_checksums", meta["checksums"]).get(name))
            return cache[k]

        own = self.strategy.load_checkpoint_files(self.model, path, meta)
        if own is not None:  # the strategy took its state (the parameter server's servers): this rank's part
            self._load_own_part(own)
        else:
            # Every rank checks its share of the rank files before any rank copies anything, and they
            # agree: one corrupt file stops the load on every rank with the model untouched.
            self._agree_on_load(path, self._check_rank_files(path, meta, read, old_world), stage="checking")
            failure = ""
            try:
                self._load_shards(path, meta, read, old_world)
            except (FileNotFoundError, RuntimeError, ValueError, KeyError) as err:  # CheckpointCorruptError too
                failure = f"{type(err).__name__}: {err}"
                if ctx.world_size == 1:
                    raise
            self._agree_on_load(path, failure, stage="loading")
        changes = self._apply_changed_hyperparameters(meta)
        if self.lr_scheduler is not None:
            # A schedule added since the checkpoint starts where it would be after the saved steps.
            changes += self._restore_schedule(meta.get("lr_scheduler") or {"last_epoch": int(meta["step"])})
        changes += [f"{key}: {meta['fit'].get(key)} -> {value}"
                    + (f" ({self._fit_derived[key]})" if key in self._fit_derived else "")
                    for key, value in self._fit_limits.items()
                    if "fit" in meta and key in meta["fit"] and meta["fit"][key] != value]
        # With a global batch, `fit` resolves the accumulation after loading (and says what it trains, and
        # what changed): the checkpoint's resolved value is not to be compared with the configured one.
        derived = ("gradient_accumulation_steps",) if self._fit_global_batch else ()
        changes += [f"{key}: {meta['config'][key]} -> {value}" for key, value in self.config.items()
                    if key not in ("world_size", "optimizer", *derived) and key in meta.get("config", {})
                    and meta["config"][key] != value]
        # A pipeline the checkpoint was written with and this run does not have (its keys are absent).
        changes += [f"{key}: {value} -> none" for key, value in meta.get("config", {}).items()
                    if key in _PIPELINE_KEYS and key not in self.config]
        if "config" in meta:  # and one this run has that the checkpoint was written without
            changes += [f"{key}: none -> {self.config[key]}" for key in _PIPELINE_KEYS
                        if key in self.config and key not in meta["config"]]
        # Tensor parallelism the checkpoint was written with and this run does not have, or the reverse
        # (the keys are in a trainer's config only with tensor_parallel_size > 1).
        if "config" in meta:
            saved = meta["config"]
            changes += [f"{key}: {saved.get(key, default)} -> {self.config.get(key, default)}"
                        for key, default in _TENSOR_DEFAULTS.items()
                        if (key in saved) != (key in self.config) and saved.get(key, default) != self.config.get(key, default)]
        if changes and ctx.is_main:
            log.warning("the configuration changed since checkpoint %s was written; the new values apply: %s", path,
                         "; ".join(changes))
        self.precision.load_state_dict(meta.get("loss_scaler"))
        self.step = int(meta["step"])
        self.epoch = int(meta.get("epoch", 0))
        self.batch_in_epoch = int(meta.get("batch_in_epoch", 0))
        samples = meta.get("samples_in_epoch")
        self.samples_in_epoch = int(samples) if samples is not None else (None if self.batch_in_epoch else 0)
        self._saved_dataset_len = meta.get("dataset_len")
        self._previous_global_batch = meta.get("global_batch")
        previous = self._previous_global_batch or {}
        # The micro-batch limit itself, not the micro-batch it gave at the checkpoint's size (clipped there to a
        # replica's share: kept, a later run at fewer replicas would accumulate more passes than it needs).
        limit = previous.get("micro_batch_limit") or previous.get("micro_batch_size")
        if limit:
            self.micro_batch_size = int(limit)
        if meta.get("batch_size") is not None:
            self.batch_size = int(meta["batch_size"])

    def _check_rank_files(self, path: str, meta: dict[str, Any], read: Callable[[int], dict], old_world: int) -> str:
        """This rank's share of checking a checkpoint's rank files before anything is loaded: its own
        file (read, and kept for the load), and every `world_size`-th file after it that the saving job
        had beyond this one's ranks (checksum only, where this node's directory has it). '' if intact,
        else what is wrong."""
        ctx = self.context
        digests = meta.get("rank_checksums", meta["checksums"])
        try:
            for k in range(ctx.rank, old_world, ctx.world_size):
                name = f"rank{k}.pt"
                if k == ctx.rank:
                    read(k)
                elif os.path.isfile(os.path.join(path, name)) and name in digests:
                    if sha256_file(os.path.join(path, name)) != digests[name]:
                        raise CheckpointCorruptError(f"checkpoint file {os.path.join(path, name)!r} is corrupted: its "
                                                     "SHA-256 does not match meta.pt")
                elif name in digests and "rank_checksums" not in meta:  # (one directory for all: it must be here)
                    raise FileNotFoundError(f"checkpoint file {os.path.join(path, name)!r} is missing (meta.pt lists "
                                            "it): the checkpoint is incomplete")
        except (CheckpointCorruptError, OSError) as err:  # (OSError: a read error, FileNotFoundError)
            return f"{type(err).__name__}: {err}"
        return ""

    def _agree_on_load(self, path: str, failure: str, *, stage: str) -> None:
        """Every rank learns whether any rank failed `stage` ("checking" or "loading") of the load of
        `path`, and then every rank raises (naming the rank and its reason), or none does."""
        ctx = self.context
        if ctx.world_size == 1:
            every = [failure]
        else:
            every = [None] * ctx.world_size
            dist.all_gather_object(every, failure, group=ctx.group)
        failed = [(r, why) for r, why in enumerate(every) if why]
        if not failed:
            return
        first, why = failed[0]
        kind, _, reason = why.partition(": ")
        if ctx.world_size == 1:
            text = reason
        else:
            untouched = ("nothing was loaded on any rank" if stage == "checking" else
                         "ranks may hold a partly loaded state: load a good checkpoint, or build the model again")
            text = (f"loading checkpoint {path!r} failed on rank{'s' if len(failed) > 1 else ''} "
                    f"{', '.join(str(r) for r, _ in failed)} ({untouched}); rank {first}: {reason}")
        raise _LOAD_ERRORS.get(kind, RuntimeError)(text)

    def _load_shards(self, path: str, meta: dict[str, Any], read: Callable[[int], dict], old_world: int) -> None:
        """`load_checkpoint`'s parameters, optimizer state, buffers, RNG states and the strategy's own state."""
        ctx = self.context
        same_world = old_world == ctx.world_size
        try:
            held = self.strategy.state_layout(self.model, self.optimizer)
            check_shapes(meta["shapes"], held.shapes)
            sources = Sources(read, ctx.rank if ctx.rank < old_world else 0)
            unpack_params(held, meta["index"], sources)
            unpack_optimizer(held, self.optimizer, meta["index"], sources)
            self._load_buffers(meta, sources, old_world)
            if self.strategy.whole_module:
                load_extra_states(self.module, read(ctx.rank if ctx.rank < old_world else 0).get("extra_state", {}))
        except CheckpointCorruptError:
            raise
        except (RuntimeError, ValueError, KeyError) as err:
            raise CheckpointMismatchError(
                f"checkpoint {path!r} does not fit this model: {err} (a checkpoint of another model? load it into "
                "the model that wrote it, or start a new run: another checkpoint directory, or resume=False / "
                "dtrain --no-resume)") from None
        residuals = ", nor gradient compression's error-feedback residuals and step count (per rank: they start afresh)"
        if same_world:
            set_rng_state(read(ctx.rank)["rng"])
            if meta.get("strategy") == self.strategy.name:  # what only the same strategy understands
                self.strategy.load_shared_state(self.model, meta)
                self.strategy.load_rank_state(self.model, read(ctx.rank))
            elif ctx.is_main and _has_residuals(read(0)):
                log.warning("checkpoint %r was written under strategy %r, this run uses %r: its per-rank state is not "
                            "restored%s", path, meta.get("strategy"), self.strategy.name, residuals)
        elif ctx.is_main:  # once, not once a rank
            log.warning("checkpoint %r was written by %s rank(s), this run has %d: RNG states not restored%s", path,
                        meta["world_size"], ctx.world_size, residuals if _has_residuals(read(0)) else "")

    def _load_own_part(self, part: dict[str, Any]) -> None:
        """This rank's RNG states and buffers from what a strategy's `load_checkpoint_files` returned."""
        if "rng" in part:
            set_rng_state(part["rng"])
        saved = part.get("buffers", {})
        with torch.no_grad():
            for key, buffer in self.strategy.buffers(self.model).items():
                if key in saved:
                    buffer.copy_(saved[key])
        if self.strategy.whole_module:
            load_extra_states(self.module, part.get("extra_state", {}))

    def _load_buffers(self, meta: dict[str, Any], sources: Sources, old_world: int) -> None:
        """Each buffer this rank holds from a saving rank of the same data-parallel replica that held it
        (this rank's own file first), else from the lowest rank that held it: without a pipeline, each
        rank gets its own back and a rank the saving job did not have takes rank 0's; a pipeline's
        stage takes its replica's statistics, which are replica 0's when the replicas are fewer now."""
        ctx = self.context
        saved_at = meta.get("buffer_index")
        if saved_at is None:  # written before the buffer index: every rank held every buffer
            first = sources.pick([ctx.rank] if ctx.rank < old_world else [0])["buffers"]
            saved_at = {key: list(range(old_world)) for key in first}
        replica_of = meta.get("dp_rank_of") or list(range(old_world))  # before: one replica per rank
        buffers = self.strategy.buffers(self.model)
        missing = sorted(set(buffers) - set(saved_at))
        unexpected = sorted(set(saved_at) - set(self.strategy.buffer_keys(self.model)))
        if missing or unexpected:
            raise ValueError(f"buffers missing from the checkpoint {missing[:5]}, in it but not in this model "
                             f"{unexpected[:5]}")
        with torch.no_grad():
            for key, buffer in buffers.items():
                ranks = saved_at[key]
                same = [r for r in ranks if replica_of[r] == self.dp_rank]
                source = ctx.rank if ctx.rank in same else min(same or ranks)
                buffer.copy_(sources.pick([source])["buffers"][key])

def _has_residuals(rank_part: dict[str, Any]) -> bool:
    """Whether a rank file holds a compressing reducer's error-feedback residuals (`rank_state`)."""
    return bool(rank_part.get("communication", {}).get("residuals"))


def _directory_name(path, method: str) -> str:
    """`path` as a str, or a TypeError naming `method` (``os.fspath(None)`` says nothing of checkpoints)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{method}(path): path must be the checkpoint directory's name (str or os.PathLike), "
                        f"got {path!r}")
    return os.fsdecode(os.fspath(path))
