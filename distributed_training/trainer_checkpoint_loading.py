"""`DistributedTrainer.load_checkpoint`: a checkpoint of any strategy at any world size, checked before anything
is loaded and agreed across ranks (every rank raises, or none does).

A mixin of `DistributedTrainer` (under `trainer_checkpoints.Checkpointing`, which says what a checkpoint
holds). Each rank reads only the rank files holding the pieces of parameters and optimizer state it now needs
(`checkpoint_shards`), its buffers from a rank of its own data-parallel replica, and what only the writing
strategy understands where the strategy and world size are unchanged; the trainer's position and the
configuration follow, with what changed since the checkpoint said (hyperparameters: `trainer_hyperparameters`).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from .checkpoint import (CheckpointCorruptError, CheckpointMismatchError, load_file, read_meta, set_rng_state,
                         sha256_file)
from .checkpoint_shards import FORMAT, Sources, check_shapes, load_extra_states, unpack_optimizer, unpack_params
from .checkpoint_swap import previous_of, staged_of, whole
from .logs import get_logger
from .trainer_hyperparameters import HyperparameterRestore

__all__ = ["CheckpointLoading"]

log = get_logger()
#: The trainer's config keys that only a run with a pipeline has.
_PIPELINE_KEYS = ("pipeline_parallel_size", "pipeline_schedule", "microbatches", "pipeline_chunks")
_TENSOR_DEFAULTS = {"tensor_parallel_size": 1, "sequence_parallel": False}  # their values without tensor parallelism

def _pipeline_change(saved: dict, now: dict) -> str:
    """A pipeline that the checkpoint had and this run has not, or the reverse, as one change."""
    def said(config: dict) -> str:
        size = config.get("pipeline_parallel_size", 1)
        rest = ", ".join(f"{k}={config[k]}" for k in _PIPELINE_KEYS[1:] if k in config)
        return f"{size} ({rest})" if rest else f"{size} (no pipeline)"
    return f"pipeline_parallel_size: {said(saved)} -> {said(now)}"


def _note(notes: dict, key: str) -> str:
    """One of a job's own notes as a resume's change list says it; a note the job did not keep is "(none)"."""
    return repr(notes[key]) if key in notes else "(none)"


def _mismatch(path: str, err: Exception, nothing_loaded: bool = False) -> CheckpointMismatchError:
    """A checkpoint that does not fit this model; `nothing_loaded`: found before anything was copied."""
    error = CheckpointMismatchError(
        f"checkpoint {path!r} does not fit this model: {err} (a checkpoint of another model? load it into the model "
        "that wrote it, or start a new run: another checkpoint directory, or resume=False / dtrain --no-resume)")
    error.nothing_loaded = nothing_loaded
    return error


#: What a failed load raises on every rank: the type the failing rank met.
_LOAD_ERRORS = {cls.__name__: cls for cls in (CheckpointCorruptError, CheckpointMismatchError, FileNotFoundError,
                                              OSError, RuntimeError, ValueError, KeyError)}


class CheckpointLoading(HyperparameterRestore):
    """`DistributedTrainer`'s `load_checkpoint` and its parts."""

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
        self._check_open("load_checkpoint()")
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
                raise FileNotFoundError(f"{meta_path!r} does not exist: not a complete checkpoint{hint}")
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

        # A parameter server's checkpoint has rank files of its servers only (its workers' parts are
        # ``worker<i>.pt``: `_load_worker_part`); another strategy finds nothing of its own in the others.
        from_servers = meta.get("strategy") == "parameter_server" and self.strategy.name != "parameter_server"

        def read(k: int) -> dict:
            if k not in cache:
                name = f"rank{k}.pt"
                if from_servers and name not in meta["checksums"]:
                    cache[k] = {}
                    return cache[k]
                # rank_checksums (a directory per node) also covers rank files fetched from other nodes.
                if "rank_checksums" in meta and not os.path.isfile(os.path.join(path, name)):
                    raise FileNotFoundError(
                        f"checkpoint file {name} is not in {path!r}: {old_world} ranks wrote this checkpoint into a "
                        "directory per node, each holding its own node's rank files, and no node of this job holds "
                        f"{name}. Copy the other nodes' rank files (rank<k>.pt) into this directory from their "
                        "checkpoint directories, or resume with those nodes in the job")
                cache[k] = load_file(os.path.join(path, name), meta.get("rank_checksums", meta["checksums"]).get(name))
            return cache[k]

        own = self.strategy.load_checkpoint_files(self.model, path, meta)
        if own is not None:  # the strategy took its state (the parameter server's servers): this rank's part
            self._load_own_part(own)
        else:
            # Every rank checks its share of the rank files before any rank copies anything, and they
            # agree: one corrupt file stops the load on every rank with the model untouched.
            self._agree_on_load(path, self._check_rank_files(path, meta, read, old_world), stage="checking")
            failure, untouched = "", True
            try:
                self._load_shards(path, meta, read, old_world)
            except (FileNotFoundError, RuntimeError, ValueError, KeyError) as err:  # CheckpointCorruptError too
                failure, untouched = f"{type(err).__name__}: {err}", getattr(err, "nothing_loaded", False)
                if ctx.world_size == 1:
                    raise
            self._agree_on_load(path, failure, stage="loading", untouched=untouched)
        changes = self._apply_changed_hyperparameters(meta)
        if self.lr_scheduler is not None:
            # A schedule added since the checkpoint starts where it would be after the saved steps.
            changes += self._restore_schedule(meta.get("lr_scheduler") or {"last_epoch": int(meta["step"])},
                                              int(meta["step"]))
        elif meta.get("lr_scheduler"):
            changes += self._drop_schedule(meta["lr_scheduler"])
        was_derived = meta.get("fit_derived") or {}
        changes += [f"{key}: {meta['fit'].get(key)}" + (f" ({was_derived[key]})" if key in was_derived else "")
                    + f" -> {value}" + (f" ({self._fit_derived[key]})" if key in self._fit_derived else "")
                    for key, value in self._fit_limits.items()
                    if "fit" in meta and key in meta["fit"] and meta["fit"][key] != value]
        changes += self._replicas_changed(meta)
        if meta.get("notes") and self.checkpoint_notes:  # (a job's own settings: dtrain's model and data fields)
            old, now = meta["notes"], self.checkpoint_notes  # a note added or dropped since counts as a change
            changes += [f"{key}: {_note(old, key)} -> {_note(now, key)}" for key in sorted(old.keys() | now.keys())
                        if _note(old, key) != _note(now, key)]
        # With a global batch, `fit` resolves the accumulation after loading (and says what it trains, and
        # what changed): the checkpoint's resolved value is not to be compared with the configured one.
        derived = ("gradient_accumulation_steps",) if self._fit_global_batch else ()
        changes += [f"{key}: {meta['config'][key]} -> {value}" for key, value in self.config.items()
                    if key not in ("world_size", "optimizer", *derived) and key in meta.get("config", {})
                    and meta["config"][key] != value]
        # A pipeline the checkpoint was written with and this run does not have (its keys are absent).
        if "config" in meta:  # (or the reverse): said as the pipeline's size, 1 without one, and its settings
            changes += [_pipeline_change(meta["config"], self.config)] if (
                "pipeline_parallel_size" in meta["config"]) != ("pipeline_parallel_size" in self.config) else []
        # Tensor parallelism the checkpoint was written with and this run does not have, or the reverse
        # (the keys are in a trainer's config only with tensor_parallel_size > 1).
        if "config" in meta:
            saved = meta["config"]
            changes += [f"{key}: {saved.get(key, default)} -> {self.config.get(key, default)}"
                        for key, default in _TENSOR_DEFAULTS.items()
                        if (key in saved) != (key in self.config) and saved.get(key, default) != self.config.get(key, default)]
        if self.precision.scaler is not None:  # fp16's loss scaler: its settings given now apply
            changes += self.precision.scaler.changed_settings(meta.get("loss_scaler"))
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

    def _replicas_changed(self, meta: dict[str, Any]) -> list[str]:
        """Another number of data-parallel replicas than the checkpoint's, without a global batch to keep:
        each replica keeps its batch, so the global batch (and the gradient's noise) changes with them."""
        old = max(meta.get("dp_rank_of") or [-1]) + 1
        if self._fit_keeps_global_batch or old in (0, self.dp_world_size):
            return []
        per = meta.get("batch_size") or (meta.get("fit") or {}).get("batch_size")  # "auto"'s, or fit's
        now = self._fit_limits.get("batch_size", per)  # (this fit's, where it gives one: a change is said too)
        sizes = (f" ({old} x {per} = {old * per} samples -> {self.dp_world_size} x {now} = "
                 f"{self.dp_world_size * now})" if isinstance(per, int) and isinstance(now, int) else "")
        return [f"data-parallel replicas: {old} -> {self.dp_world_size}, so the global batch changed{sizes}; "
                "fit(global_batch_size=...) keeps it at any world size"]

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

    def _agree_on_load(self, path: str, failure: str, *, stage: str, untouched: bool = True) -> None:
        """Every rank learns whether any rank failed `stage` ("checking" or "loading") of the load of
        `path`, and then every rank raises (naming the rank and its reason), or none does. `untouched`:
        (loading) whether this rank failed before it copied anything (the shapes did not fit)."""
        ctx = self.context
        if ctx.world_size == 1:
            every = [(failure, untouched)]
        else:
            every = [None] * ctx.world_size
            dist.all_gather_object(every, (failure, untouched), group=ctx.group)
        failed = [(r, why) for r, (why, _) in enumerate(every) if why]
        if not failed:
            return
        first, why = failed[0]
        kind, _, reason = why.partition(": ")
        if ctx.world_size == 1:
            text = reason
        else:
            held = ("nothing was loaded on any rank" if stage == "checking" or all(u for _, u in every) else
                    "ranks may hold a partly loaded state: load a good checkpoint, or build the model again")
            text = (f"loading checkpoint {path!r} failed on rank{'s' if len(failed) > 1 else ''} "
                    f"{', '.join(str(r) for r, _ in failed)} ({held}); rank {first}: {reason}")
        raise _LOAD_ERRORS.get(kind, RuntimeError)(text)

    def _load_shards(self, path: str, meta: dict[str, Any], read: Callable[[int], dict], old_world: int) -> None:
        """`load_checkpoint`'s parameters, optimizer state, buffers, RNG states and the strategy's own state."""
        ctx = self.context
        same_world = old_world == ctx.world_size
        try:
            held = self.strategy.state_layout(self.model, self.optimizer)
            check_shapes(meta["shapes"], held.shapes)
        except (RuntimeError, ValueError, KeyError) as err:
            raise _mismatch(path, err, nothing_loaded=True) from None
        try:
            sources = Sources(read, ctx.rank if ctx.rank < old_world else 0)
            unpack_params(held, meta["index"], sources)
            unpack_optimizer(held, self.optimizer, meta["index"], sources)
            if meta.get("strategy") != "parameter_server":  # (its buffers are its workers': `_load_worker_part`)
                self._load_buffers(meta, sources, old_world)
            if self.strategy.whole_module:
                load_extra_states(self.module, read(ctx.rank if ctx.rank < old_world else 0).get("extra_state", {}))
        except CheckpointCorruptError:
            raise
        except (RuntimeError, ValueError, KeyError) as err:
            raise _mismatch(path, err) from None
        residuals = ", nor gradient compression's error-feedback residuals and step count (per rank: they start afresh)"
        if meta.get("strategy") == "parameter_server":  # (another strategy loading the servers' checkpoint)
            self._load_worker_part(path, meta)
            return
        if same_world:
            set_rng_state(read(ctx.rank)["rng"])
            self._epoch_rng = read(ctx.rank).get("epoch_rng")
            if meta.get("strategy") == self.strategy.name:  # what only the same strategy understands
                self.strategy.load_shared_state(self.model, meta)
                self.strategy.load_rank_state(self.model, read(ctx.rank))
            elif ctx.is_main and _has_residuals(read(0)):
                log.warning("checkpoint %r was written under strategy %r, this run uses %r: its per-rank state is not "
                            "restored%s", path, meta.get("strategy"), self.strategy.name, residuals)
        else:
            self._epoch_rng = None  # (this trainer's own, of an earlier fit: not the checkpoint's epoch)
        if not same_world and ctx.is_main:  # once, not once a rank
            log.warning("checkpoint %r was written by %s rank(s), this run has %d: RNG states not restored%s", path,
                        meta["world_size"], ctx.world_size, residuals if _has_residuals(read(0)) else "")

    def _load_worker_part(self, path: str, meta: dict[str, Any]) -> None:
        """A parameter server's checkpoint loaded under another strategy: each rank takes the buffers
        (BatchNorm's statistics) of the worker of its index (worker 0's where the job had fewer), and its
        RNG states only where this job has as many ranks as that one had workers."""
        ctx = self.context
        workers = len((meta.get("ps") or {}).get("worker_steps") or [])
        index = ctx.rank if ctx.rank < workers else 0
        name = f"worker{index}.pt"
        if name not in meta.get("checksums", {}):
            return
        part = load_file(os.path.join(path, name), meta["checksums"][name])
        saved, held = set(part.get("buffers", {})), set(self.strategy.buffer_keys(self.model))
        if saved != held:
            raise CheckpointMismatchError(
                f"checkpoint {path!r} does not fit this model: buffers missing from its {name} "
                f"{sorted(held - saved)[:5]}, in it but not in this model {sorted(saved - held)[:5]}")
        if workers != ctx.world_size:
            part = {k: v for k, v in part.items() if k not in ("rng", "epoch_rng")}
            if ctx.is_main:
                log.warning("checkpoint %r was written by a parameter server's %d worker(s), this run has %d rank(s): "
                            "RNG states not restored", path, workers, ctx.world_size)
        self._load_own_part(part)

    def _load_own_part(self, part: dict[str, Any]) -> None:
        """This rank's RNG states and buffers from what a strategy's `load_checkpoint_files` returned."""
        if "rng" in part:
            set_rng_state(part["rng"])
        self._epoch_rng = part.get("epoch_rng")
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
