"""What a `DistributedTrainer` keeps track of as it trains (`TrainerState`, a mixin of it): where training
stands (step, epoch, data position: what checkpoints record and a resume restores), the global batch's cut,
the checkpoint options and their bookkeeping, and how the trainer was configured (`config`, the optimizer's
and schedule's values), which a resume compares with a checkpoint's; and which data-parallel replica this
rank feeds (`dp_rank`), which `fit` shards the data by.

The constructor sets a fresh trainer's values (`_init_state` once the optimizer and schedule exist,
`_record_config` last); `train_step`, `fit`, the checkpoints and a resume move them on.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from .checkpoint_layout import DirectoryLayout
from .global_batch import GlobalBatch
from .peer_watch import PeerWatch
from .trainer_hyperparameters import hyperparameters

if TYPE_CHECKING:
    from torch import nn

    from .pipeline.training import PipelineOptions
    from .tensor.options import TensorOptions

__all__ = ["TrainerState"]


class TrainerState:
    """The attributes of `DistributedTrainer` that its parts share, and their values at construction."""

    def _init_state(self, gradient_accumulation_steps: int, checkpoint_every: int | None, resume: bool,
                    checkpoint_shared: bool | None, checkpoint_async: bool, save_on_preemption: bool,
                    heartbeat_timeout: float | None) -> None:
        """Where training stands (step, epoch, data position), what checkpoints keep of it, and what the
        optimizer and schedule were configured with (compared with a checkpoint's on resume)."""
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of the current epoch already trained
        # The random states when this epoch's first batch was fetched from data fit cannot seek (an iterable):
        # a resumed epoch replays its start from them, as an iterable that shuffles at its start drew.
        self._epoch_rng = None
        self._open_batches = None  # the epoch's loader iterator while fit runs (its workers stopped on an error)
        self._replica_scale = None  # the last step's replica factor's value (`loss_weights.replica_scale`), if any
        self._step_failed = False  # the last train_step raised: peers may be inside its collectives
        # time.monotonic() when this rank last finished collectives with its peers (a step, an evaluation, a
        # save, fit's agreements): how long it was away from them when a peer's connection is found closed
        self._synced_at: float | None = None
        self._closed = False  # close() ran: every other call is refused
        self._optimizer_agreed = False  # fit compared the optimizer's settings across replicas (once)
        # What the monitor is told of the step whose communication is timed (`StepRecording`): its own
        # (step_time, data_time), this rank's own work in it, and whether the straggler probe has warmed up.
        self._measured_times: tuple[float, float] | None = None
        self._own_time = None
        self._probe_wait = 0.0  # seconds the measured step waited for the peers before training (probe, agreement)
        self._probed = False
        self._probe_event = None  # on a GPU: where the probed step's own work began
        # Samples of the current epoch's permutation already trained by the whole job (the data position,
        # at any size; None: a checkpoint from before it was kept, see EpochLoop._epoch_offset).
        self.samples_in_epoch: int | None = 0
        self._dataset_len: int | None = None  # fit's sharded dataset's, kept in checkpoints with the position
        self._saved_dataset_len: int | None = None  # the loaded checkpoint's
        self._epoch_finished = False  # the current epoch's last batch trained (fit): a checkpoint is at the next
        self.global_batch: GlobalBatch | None = None  # fit(global_batch_size=...): how it is cut now
        self.micro_batch_size: int | None = None  # ... and the micro-batch it keeps across sizes
        self._previous_global_batch: dict[str, int] | None = None  # the checkpoint's cut
        self._configured_accumulation = gradient_accumulation_steps
        self._lr_scale = 1.0  # the linear scaling rule's factor applied to the configured learning rate
        self.batch_size: int | None = None  # what batch_size="auto" chose (kept in checkpoints)
        self.batch_size_reason = ""
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.checkpoint_shared = checkpoint_shared
        self.checkpoint_async = checkpoint_async
        self._checkpoint_write = None  # the background write in flight (checkpoint_async), if any
        self._staging = None  # its pinned host buffers, reused from one checkpoint to the next
        self._background_id, self._background_count = None, 0  # names of background checkpoints (store)
        self._layouts: dict[str, DirectoryLayout] = {}
        self.save_on_preemption = save_on_preemption
        # What the optimizer and the schedule were configured with, before any step or resume: compared
        # with what a checkpoint was configured with, to apply (and report) changed hyperparameters.
        self._configured_hparams = hyperparameters(self.optimizer)
        self._configured_schedule = (copy.deepcopy(self.lr_scheduler.state_dict())
                                     if self.lr_scheduler is not None else None)
        self._fit_limits: dict[str, Any] = {}
        #: Limits a caller derived rather than was given (dtrain: epochs from max_steps), with the reason:
        #: a resume lists their change with it, not as a change the user made.
        self._fit_derived: dict[str, str] = {}
        #: What a job says of itself beyond the trainer's arguments (dtrain: its model and data fields), saved
        #: in each checkpoint's meta; a resume names the notes that changed since (`_notes_changed`).
        self.checkpoint_notes: dict[str, Any] = {}
        self._said_no_extra_state = False  # (a split model's modules' extra state is not kept: said once)
        # Whether the `fit` in progress sets the accumulation from a global batch (`_adopt_global_batch`):
        # then a resume does not compare the configured gradient_accumulation_steps with the checkpoint's.
        self._fit_global_batch = False
        self._fit_keeps_global_batch = False  # fit(global_batch_size=...): a resize keeps it (said by fit)
        self.heartbeat_timeout = heartbeat_timeout
        self._watch: PeerWatch | None = None  # started by `fit` or the first train_step
        self._last_saved_step: int | None = None
        # (step, the loss scaler's skipped steps) when fit started or last saved: `_refuse_non_finite`'s mark
        self._saved_at: tuple[int, int] = (0, 0)
        self._set_aside = False
        self._write_problems: list = []  # (each rank's problem writing checkpoint_dir, found as fit starts)
        self._fresh_run_key: str | None = None  # (`trainer_resume`: this resume=False run's token in the store)
        self._summoned = False  # inside `summon_full_params`
        self._locked_directory: str | None = None  # `checkpoint_dir` while this rank holds its lock ("": checked)

    def _record_config(self, model: nn.Module, gradient_accumulation_steps: int, gradient_clip_val: float | None,
                       seed: int, pipeline: PipelineOptions, tensor: TensorOptions) -> None:
        """`config`: how the trainer was built, as checkpoints record it (a resume says what changed since)."""
        self.config = {
            "strategy": self.strategy.name,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_clip_val": gradient_clip_val,
            "seed": seed,
            "world_size": self.context.world_size,
            "model": type(model).__name__,  # the user's class (a pipeline's self.module holds its stages)
            "optimizer": type(self.optimizer).__name__,
        }
        if tensor.enabled:
            self.config.update(tensor_parallel_size=tensor.size, sequence_parallel=tensor.sequence_parallel)
        if pipeline.enabled:
            self.config.update(pipeline_parallel_size=pipeline.size, pipeline_schedule=pipeline.schedule,
                               microbatches=pipeline.microbatches, pipeline_chunks=pipeline.chunks)

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank feeds (``context.mesh.dp_rank``): ranks that share it
        (tensor- or pipeline-parallel peers) must see the same batches. `fit` shards by it; so should
        a loop of your own."""
        return self.context.mesh.dp_rank

    @property
    def dp_world_size(self) -> int:
        """How many data-parallel replicas the job has (``context.mesh.dp_size``)."""
        return self.context.mesh.dp_size
