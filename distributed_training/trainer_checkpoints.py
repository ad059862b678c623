"""The trainer's checkpoints: what one holds, and how it is saved (`save_checkpoint`, `fit`'s numbered ones).

A mixin of `DistributedTrainer`. Every strategy's state is saved in one format: the strategy says
which pieces of the full parameters and optimizer state this rank holds (`Strategy.state_layout`),
`distributed_training.checkpoint_shards` writes and reads them, so a checkpoint loads under any
strategy at any world size. Besides, each rank saves its RNG streams, its buffers and what its
strategy keeps per rank (`rank_state`, e.g. compression residuals), and rank 0 puts the trainer's
position (step, epoch, data position in samples, global batch, schedule) and the index of the pieces
in ``meta.pt``. The files and their crash-proofing are in `distributed_training.checkpoint`. The other
parts of `Checkpointing`, one concept a file: loading, in `trainer_checkpoint_loading` (hyperparameters
changed since the checkpoint, in `trainer_hyperparameters`); where `fit` starts (the resume point agreed
across ranks and nodes, the directory's lock), in `trainer_resume`; `fit`'s checkpoints written in the
background (``checkpoint_async``), in `trainer_checkpoints_async`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from .checkpoint import rng_state, save_file, write_meta
from .checkpoint_async import rank_file
from .checkpoint_swap import put_in_place, remove_stale_rank_files, staged_of
from .checkpoint_layout import DirectoryLayout, detect_layout
from .checkpoint_shards import (FORMAT, build_index, extra_state_key, extra_states, host_clone, modules_with_extra_state,
                                pack, summary)
from .mesh import global_rank
from .stopping import checkpoint_writing
from .trainer_checkpoint_loading import CheckpointLoading, _directory_name
from .trainer_checkpoints_async import BackgroundCheckpointing
from .trainer_resume import Resuming

__all__ = ["Checkpointing", "NonFiniteLossError"]

# Suffixes of single-file checkpoints, which a checkpoint directory's name should not look like.
_FILE_SUFFIXES = {".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle", ".tar", ".safetensors", ".zip"}


class NonFiniteLossError(FloatingPointError):
    """`fit` stopped before saving a step whose training had gone non-finite (see `_refuse_non_finite`)."""


class Checkpointing(Resuming, CheckpointLoading, BackgroundCheckpointing):
    """`DistributedTrainer`'s checkpoint methods."""

    def _refuse_non_finite(self, metrics: dict[str, torch.Tensor] | None) -> None:
        """Before `fit` saves this step: raise `NonFiniteLossError` on every rank if training went non-finite
        since its last save, so that no such checkpoint is written and ``keep_last`` never prunes the good
        ones for it (a trial: nan inputs on one rank made every rank's weights nan; the run saved on, its
        last good checkpoints pruned, and ended with exit 0). Without a loss scaler: a rank's loss at this
        step, or the gradient norm, is not finite (one small gather a save). With fp16's: every step since
        the last save was skipped for an overflow and the scale is at its smallest (nothing trained, and
        no scale keeps the gradients finite); the scaler's decisions are agreed, so no collective."""
        started, skipped_then = self._saved_at
        scaler = self.precision.scaler
        last = (f"the last checkpoint is step {self._last_saved_step}'s" if self._last_saved_step is not None
                else "no checkpoint was saved before")
        if scaler is not None:
            since = self.step - started
            if since > 0 and scaler.skipped_steps - skipped_then == since and scaler.scale <= scaler.min_scale:
                raise NonFiniteLossError(
                    f"training steps {started + 1} to {self.step} all overflowed in fp16 and were skipped, with the "
                    f"loss scale now at its smallest ({scaler.min_scale:g}): nothing trained, and no scale keeps the "
                    f"gradients finite (nan or inf in the data, or a diverged model). fit stops without saving step "
                    f"{self.step} ({last})")
            self._saved_at = (self.step, scaler.skipped_steps)
            return
        bad = ", ".join(f"{k} {float(v):g}" for k, v in (metrics or {}).items()
                        if k in ("loss", "grad_norm") and v is not None and not torch.isfinite(torch.as_tensor(v)).all())
        said = [bad]
        ctx = self.context
        if ctx.world_size > 1 and not ctx.independent:
            said = [None] * ctx.world_size
            dist.all_gather_object(said, bad, group=ctx.group)
        found = [(rank, what) for rank, what in enumerate(said) if what]
        if found:
            where = "; ".join(f"rank {rank}: {what}" if len(said) > 1 else what for rank, what in found)
            raise NonFiniteLossError(
                f"training step {self.step}: not finite ({where}): the weights are no longer finite, or will not "
                f"be after this step. fit stops without saving it ({last}, with finite weights if written before "
                "the loss went wrong): resume from a good one with a lower learning rate or gradient clipping, "
                "or look at the data these steps trained on" + (
                    "" if "grad_norm" in where else
                    ". A loss nan alone, its gradients finite, is a criterion's mean over a batch or micro-batch "
                    "whose every target it ignores: a lambda or function with an ignore_index other than -100, "
                    "which the trainer cannot read (it counts those targets): pass nn.CrossEntropyLoss("
                    "ignore_index=...) or functools.partial(F.cross_entropy, ignore_index=...)"))
        self._saved_at = (self.step, 0)

    def _save_numbered(self, metrics: dict[str, torch.Tensor] | None) -> None:
        """`fit`'s checkpoint of this step, under the peer watch (a peer dying meanwhile: named, not a hang)."""
        with self._watched(f"the checkpoint save of step {self.step}"):
            self._save_numbered_watched(metrics)

    def _save_numbered_watched(self, metrics: dict[str, torch.Tensor] | None) -> None:
        self._refuse_non_finite(metrics)
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
        self._check_open("save_checkpoint()")
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
            with _naming_the_file(rank_file(target, ctx.rank), ctx.rank, self.step):
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
                with _naming_the_file(os.path.join(target, "meta.pt"), ctx.rank, self.step):
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
        if self._epoch_rng is not None and self.batch_in_epoch:
            part["epoch_rng"] = self._epoch_rng
        part.update(self.strategy.rank_state(self.model))  # e.g. error-feedback residuals, which differ by rank
        # Buffers (BatchNorm's running statistics) are updated by each rank from its own data: every
        # rank's are state, under the model's keys (a pipeline rank holds its stages' only).
        buffers_to_host = buffers_to_host or to_host
        part["buffers"] = {k: buffers_to_host(b.detach()) for k, b in self.strategy.buffers(self.model).items()}
        # the modules' `get_extra_state()`, each rank its own (where the module is the user's whole tree)
        part["extra_state"] = extra_states(self.module) if self.strategy.whole_module else self._no_extra_state()
        return held, packed, part

    def _no_extra_state(self) -> dict[str, Any]:
        """Under a strategy that splits the module (a pipeline, tensor parallelism), modules' extra state is not
        kept: said once, naming them."""
        kept = [extra_state_key(name) for name, _ in modules_with_extra_state(self.module)]
        if kept and not self._said_no_extra_state and self.context.is_main:
            self._said_no_extra_state = True
            warnings.warn(f"checkpoint: the extra state of {', '.join(kept[:5])}{' ...' if len(kept) > 5 else ''} "
                          "(get_extra_state()) is not kept in checkpoints of a model split by a pipeline or by "
                          "tensor parallelism: a resume starts it from the module's own", stacklevel=4)
        return {}

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
            "fit_derived": dict(self._fit_derived),  # which of those a job derived (dtrain's epochs)
            "notes": dict(self.checkpoint_notes),  # a job's own settings (dtrain's model and data fields)
            "metrics": dict(metrics or {}),
            **self.strategy.shared_state(self.model),  # e.g. DDP's bucket layout
        }


@contextlib.contextmanager
def _naming_the_file(path: str, rank: int, step: int):
    """An OSError of a synchronous checkpoint write (a full disk, a read-only mount) said with the file and the
    step, as a background write's `CheckpointWriteError` is (torch.save's own says "[Errno 28] No space left on
    device" alone); the type is kept, so that code catching OSError still does."""
    try:
        yield
    except OSError as err:
        raise type(err)(err.errno, f"rank {rank}: writing checkpoint file {path!r} (step {step}) failed: "
                                   f"{err.strerror or err}") from err
