"""Job configuration for the `dtrain` command: typed sections read from YAML, validated on load.

    model:      {preset: small}                 # a GPT preset, or "classifier"
    data:       {dataset: repo_text, block_size: 64}
    training:   {strategy: ddp, epochs: 1, max_steps: 100, batch_size: 16, lr: 2e-3}
    checkpoint: {dir: checkpoints, every: 50, keep_last: 3}
    logging:    {dir: runs/exp, every: 10}

Each section is a pydantic model: a field is one annotated line (type, bounds, default) and the
docstring under it, which is also its description (``JobConfig.model_fields``). Validation is strict:
a value of the wrong type is an error, never coerced (``"no"`` is not a boolean, ``5`` is not a
path); numbers may be written in scientific notation (``1e-3``, which YAML 1.1 would read as a
string), and whole numbers such as ``1e4`` are accepted where an integer is expected. Every error
names the field's path (``training.lr``); an unknown field is an error too.

This module holds `JobConfig`, the sections of the built-in model, data, training, communication,
checkpoint and logging, and the rules between fields. The config's other parts live beside it, and
every name is importable from here too: `config_fields` (`ConfigError`, the strict field types,
`given`), `config_user` (import paths of the user's own model, data, collate and loss: the ``loss``
section and their rules), `config_optim` (the ``optimizer`` and ``schedule`` sections),
`config_evaluation` (the ``evaluation`` section) and `config_load` (YAML in and out, errors by field
path: `load_config`, `dump_config`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from .config_evaluation import EvaluationConfig
from .config_fields import ConfigError, Float, Int, PathStr, PositiveFloat, PositiveInt, Section, given
from .config_load import dump_config, load_config, parse_yaml
from .config_optim import OptimizerConfig, ScheduleConfig
from .config_user import ImportPath, Kwargs, LossConfig, check_user_code
from .models import GPT_PRESETS, VISION_PRESETS
from .pipeline.schedules import SCHEDULES

__all__ = ["JobConfig", "ConfigError", "load_config", "dump_config", "parse_yaml"]

Preset = Literal[tuple(GPT_PRESETS) + ("classifier",) + tuple(VISION_PRESETS)]  # type: ignore[valid-type]
Schedule = Literal[SCHEDULES]  # type: ignore[valid-type]


class ModelConfig(Section):
    preset: Preset = "small"
    """A GPT preset (tiny, small, gpt2-124m, gpt-1.3b), "classifier" (an MLP for the digits data) or an
    image classifier for data.dataset image_folder: resnet18, resnet50, vit_s16, vit_b16."""
    n_layer: Optional[PositiveInt] = None
    """Override the preset's number of blocks."""
    n_embd: Optional[PositiveInt] = None
    """Override the preset's width (a multiple of the preset's number of heads)."""
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Dropout probability, in [0, 1)."""
    target: Optional[ImportPath] = None
    """Your own model instead of a preset: the import path of a function or class that returns an
    nn.Module (``my_pkg.models:build``; the config file's directory and the working directory are
    importable), called with ``kwargs`` after seeding with training.seed."""
    kwargs: Kwargs = Field(default_factory=dict)
    """Keyword arguments of ``model.target``."""
    # Image presets (see distributed_training/models/vision.py); n_layer / n_embd shape a ViT.
    num_classes: Optional[PositiveInt] = None
    """Image presets: outputs of the head (null: the number of class directories in data.root)."""
    image_size: Annotated[PositiveInt, Field(le=4096)] = 224
    """Image presets: side of the square images trained on (a multiple of 16 for the ViTs)."""
    width: Optional[PositiveInt] = None
    """ResNet presets: channels of the first stage (null: the published 64), for smaller models."""
    zero_init_residual: bool = False
    """ResNet presets: start each residual block's last BatchNorm at gamma = 0 (each block the identity)."""
    channels_last: bool = False
    """Image presets: NHWC memory order for the weights and inputs (faster convolutions on GPUs)."""


class DataConfig(Section):
    dataset: Literal["repo_text", "digits", "image_folder"] = "repo_text"
    """repo_text: this package's own source as bytes (language model); digits: 8x8 handwritten digits
    shipped with the package (classification); image_folder: root/<class>/<image> files (with an
    image preset)."""
    block_size: Annotated[PositiveInt, Field(le=8192)] = 64
    """Tokens per language-model sample, 1 to 8192 (repo_text, this package's own source: about 1.5 MB)."""
    val_fraction: Annotated[Float, Field(ge=0, lt=1)] = 0.1
    """Share of the samples held out for validation, in [0, 1)."""
    target: Optional[ImportPath] = None
    """Your own training set instead of ``dataset``: the import path of a function or class called with
    ``kwargs`` that returns a map-style dataset (__getitem__, __len__: sharded and shuffled over the
    ranks, ``val_fraction`` of it held out) or an iterable of samples (read in order, sample k to
    data-parallel replica k % W)."""
    kwargs: Kwargs = Field(default_factory=dict)
    """Keyword arguments of ``data.target``."""
    val_target: Optional[ImportPath] = None
    """The validation set's factory, called with ``val_kwargs`` (default: ``data.target`` when
    ``val_kwargs`` is given; neither: ``val_fraction`` of a map-style training set)."""
    val_kwargs: Optional[Kwargs] = None
    """Keyword arguments of the validation set's factory (e.g. {split: val})."""
    collate: Optional[ImportPath] = None
    """Import path of the function (or class, instantiated with ``collate_kwargs``) that makes a batch
    of a list of samples (default: torch's, which stacks tensors)."""
    collate_kwargs: Kwargs = Field(default_factory=dict)
    """Keyword arguments of ``data.collate`` (bound to a function, or the class's)."""
    shard_iterable: bool = True
    """With an iterable ``data.target``: deal its samples to the data-parallel replicas (false: the
    dataset gives each rank its own samples, e.g. by reading torch.distributed's rank)."""
    # image_folder (see distributed_training/datasets/images.py)
    root: Optional[PathStr] = None
    """image_folder: the training images, root/<class>/<image> (jpg, png, ...; classes sorted by name)."""
    val_root: Optional[PathStr] = None
    """image_folder: the validation images, the same classes (null: val_fraction of root held out)."""
    num_workers: Annotated[Int, Field(ge=0)] = 0
    """DataLoader worker processes per rank that decode and augment the training images (0: in the
    training process)."""
    min_crop_scale: Annotated[Float, Field(gt=0, le=1)] = 0.08
    """image_folder: smallest area of an image (a fraction) that training's random-resized crop takes."""
    hflip: bool = True
    """image_folder: flip training images left-right half of the time."""
    crop_fraction: Annotated[Float, Field(gt=0, le=1)] = 0.875
    """image_folder: validation resizes the shorter side to image_size / crop_fraction, then takes the
    central image_size square."""


class TrainingConfig(Section):
    strategy: Literal["ddp", "zero1", "zero2", "zero3", "fsdp", "auto", "parameter_server"] = "ddp"
    """``auto``: the planner picks DDP, ZeRO-2 or ZeRO-3 (+ CPU offload) from memory estimates;
    ``parameter_server``: ranks 0 .. num_servers - 1 hold the parameters and run the optimizer, the
    others train (see docs/parameter_server.md); no clipping there (training.gradient_clip_val's default
    does not apply, another value is an error)."""
    num_servers: PositiveInt = 1
    """strategy parameter_server: server ranks (fewer than the world size: at least one worker)."""
    consistency: Literal["sync", "ssp", "async"] = "sync"
    """strategy parameter_server: sync (equal to data parallelism), ssp (a worker at most ``staleness``
    steps ahead of the slowest) or async (each gradient applied on arrival)."""
    staleness: Annotated[Int, Field(ge=0)] = 0
    """strategy parameter_server with consistency ssp: the staleness bound (0: sync)."""
    epochs: Annotated[Int, Field(ge=0)] = 1
    """Passes over the training set; with ``max_steps``, as many more as those steps need."""
    max_steps: Optional[PositiveInt] = None
    """Optimizer steps to train for; when given, it wins over ``epochs`` (more epochs are run if needed)."""
    batch_size: PositiveInt | Literal["auto"] = 16
    """Samples per rank per optimizer step; ``auto``: the largest that fits (probed on GPUs, estimated
    against ``memory_budget_gb`` on CPU and for sharded strategies), at most a quarter of a rank's
    share of the data and 1024; null: the default (``--set training.batch_size=null`` drops a config's
    value, e.g. to give ``global_batch_size`` instead)."""
    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size_null(cls, value: Any) -> Any:
        return cls.model_fields["batch_size"].default if value is None else value

    global_batch_size: Optional[PositiveInt] = None
    """Samples per optimizer step over all data-parallel replicas, instead of ``batch_size`` a rank:
    kept at any world size (a job resumed at another size recomputes each replica's share and the
    accumulation, and continues from the exact sample of the epoch). A size that does not divide it is
    refused at start with the sizes that do (see ``allow_global_batch_change``)."""
    micro_batch_size: Optional[PositiveInt] = None
    """With ``global_batch_size``: the most samples one forward and backward takes on a rank (default:
    the first start's share a rank, cut in ``gradient_accumulation_steps``; kept by checkpoints)."""
    allow_global_batch_change: bool = False
    """With ``global_batch_size``, at a size that does not divide it: train the nearest multiple of the
    data-parallel size instead, with the learning rate scaled linearly (the run says so)."""
    lr: PositiveFloat = 2e-3
    """The learning rate, whatever optimizer.name (the older spelling of optimizer.lr)."""
    weight_decay: Annotated[Float, Field(ge=0)] = 0.0
    """Weight decay (0: none; the older spelling of optimizer.weight_decay): decoupled for adamw / lamb, L2
    for sgd / lars."""
    gradient_accumulation_steps: PositiveInt = 1
    """Micro-batches per optimizer step: each step's batch is split in this many, gradients
    synchronised only on the last."""
    gradient_clip_val: Optional[PositiveFloat] = 1.0
    """Clip gradients to this global 2-norm (null: no clipping)."""
    label_smoothing: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Classifiers: cross-entropy against targets smoothed by this much, in [0, 1) (0.1 for ImageNet)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """bf16 / fp16: autocast with fp32 master weights; fp16 adds our dynamic loss scaler (GPUs: on CPUs
    fp16 is several times slower than fp32)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations."""
    memory_budget_gb: Optional[PositiveFloat] = None
    """Per-rank memory in GiB (2^30 bytes) that strategy=auto and batch_size=auto plan for (default: the
    GPU's, or this process's share of the host's)."""
    seed: Annotated[Int, Field(ge=0, lt=2**63)] = 0
    """Seed of the model's initialisation, the data order and dropout (the same on every rank)."""
    timeout_s: PositiveFloat = 600.0
    """Collective timeout in seconds."""
    heartbeat_timeout_s: Optional[PositiveFloat] = 5.0
    """Seconds without a rank's heartbeat after which its peers declare it dead and stop (null: no watch).
    Raise it above the longest call your code makes that holds Python's GIL (a C tokenizer, a large
    pickle): the heartbeat is a thread of the training process."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages per model replica (1: no pipeline). The model's layers are cut into this many
    stages, one per rank, and ``strategy`` (ddp, zero1, zero2, zero3 / fsdp; not auto) runs data
    parallelism inside each stage over the world size / pipeline_parallel_size replicas; it must
    divide the world size."""
    pipeline_schedule: Schedule = "1f1b"
    """Order of the microbatches' forward and backward passes: gpipe, 1f1b, interleaved_1f1b (several
    model chunks per rank) or zbh1 (zero-bubble, the backward split into input and weight passes)."""
    microbatches: Optional[PositiveInt] = None
    """Microbatches each batch is cut into for the pipeline (null: pipeline_parallel_size); at least
    pipeline_parallel_size for the 1f1b family, a multiple of it for interleaved_1f1b, at most
    batch_size."""
    pipeline_split_points: Optional[list[Annotated[str, Field(min_length=1)]]] = None
    """Layer names where stages 1, 2, ... start (e.g. [block.6] for a GPT: embed, block.0, ...,
    head); null: the stages cut as pipeline_balance says."""
    pipeline_chunks: Optional[PositiveInt] = None
    """Model chunks per rank: interleaved_1f1b only (null: 2 there, 1 for the others)."""
    pipeline_balance: Literal["parameters", "compute", "time"] = "parameters"
    """Without pipeline_split_points, what the stages are balanced by: parameter counts; (a GPT only)
    its layers' compute, better for wide models, whose step the GPU bounds; or time: each layer's
    forward + backward measured at setup on one microbatch of the job's inputs (batch_size /
    microbatches rows), averaged over the ranks (up to about 20 s more at start). Parameter counts even
    the stages' memory; compute and time cut where the schedule's simulated step is shortest."""
    pipeline_half_blocks: bool = False
    """A GPT only: cut its chain at half blocks (block.i.a, the attention; block.i.m, the MLP), so
    that a stage may end inside a block: a finer balance; split points may then name half blocks."""
    pipeline_cuda_graphs: bool = False
    """Replay each stage's forward and backward as CUDA graphs (captured after the first step, for
    its input shape; other shapes run eagerly): fewer host launches where the host bounds the step.
    zbh1 replays its input- and weight-gradient passes as graphs of their own. CUDA only; not with
    activation_checkpointing, or zero1 / zero2 / zero3 / fsdp inside the stages (only ddp)."""
    pipeline_compile_loss: bool = False
    """Run the last stage's loss through torch.compile on CUDA: one fused pass over the logits instead
    of several, so the stage with the head carries no extra loss work (the compute balance then counts
    none). On CPU, or where compiling fails (a warning), the loss runs as it is."""
    tensor_parallel_size: PositiveInt = 1
    """Ranks that split each layer's matrices between them (1: none): consecutive ranks, one node;
    ``strategy`` (ddp, zero1, zero2, zero3 / fsdp; not auto) runs data parallelism over the world size
    / tensor_parallel_size replicas. The GPT has a built-in plan (attention split by heads: n_head
    must be divisible by it)."""
    tensor_parallel_plan: Optional[dict[str, Union[str, list[Union[str, int]]]]] = None
    """Module-name pattern -> colwise ([colwise, 3] for a fused q/k/v), rowwise, vocab, sequence,
    sequence_split or replicate (null: the model's built-in plan)."""
    sequence_parallel: bool = False
    """With tensor parallelism, split the LayerNorm and dropout regions along the sequence too (less
    activation memory, the same numerics); data.block_size must be divisible by tensor_parallel_size."""


class CommunicationConfig(Section):
    bucket_cap_mb: Optional[PositiveFloat] = None
    """Size in MiB of the gradient buckets DDP and ZeRO-1 reduce while backward runs (null: 100 under
    Top-K compression, else 25)."""
    compression: Literal["none", "topk", "bf16", "fp16", "powersgd"] = "none"
    """Gradient compression for the DDP-based strategies (ddp, zero1)."""
    compression_ratio: Annotated[Float, Field(gt=0, le=1)] = 0.01
    """Top-K density, in (0, 1]."""
    error_feedback: bool = True
    """Top-K / PowerSGD: add what compression dropped to the next step's gradient."""
    pattern: Literal["nccl", "ring", "tree"] = "nccl"
    """How gradients are all-reduced: NCCL's (or gloo's) own, or our ring or tree of
    point-to-point messages."""
    hierarchical: bool = False
    """Reduce-scatter inside each node, all-reduce across nodes, all-gather inside (for slow links
    between nodes)."""
    ranks_per_node: Optional[PositiveInt] = None
    """With ``hierarchical``: ranks per node (default: the launcher's LOCAL_WORLD_SIZE)."""
    powersgd_rank: PositiveInt = 4
    """PowerSGD: the rank r of each weight matrix's approximation (r x (rows + cols) values sent)."""
    warmup_steps: Annotated[Int, Field(ge=0)] = 0
    """Top-K: steps over which the density decays from 1 (dense) to compression_ratio."""
    topk_select: Literal["blockmax", "exact", "chunked", "sampled"] = "blockmax"
    """Top-K: how entries are chosen (blockmax: each row of 1/ratio values' largest; exact: one top-k)."""


class CheckpointConfig(Section):
    dir: Optional[PathStr] = None
    """Directory of the run's checkpoints (``step_<N>/`` each); null: no checkpoints."""
    every: Optional[PositiveInt] = None
    """Save every this many steps (null: only at the end of training)."""
    keep_last: PositiveInt = 3
    """Checkpoints kept in ``dir``; older ones are deleted."""
    resume: bool = True
    """Resume from the latest good checkpoint in ``dir``; false (or ``dtrain --no-resume``): start from
    step 0, after moving the checkpoints already in ``dir`` into ``dir/previous_run_<k>/`` (torchrun's
    restarts of the run's workers resume from the run's own)."""
    save_on_preemption: bool = True
    """On SIGTERM (a pod or batch job being stopped), save a checkpoint at the step where training stops."""
    asynchronous: bool = False
    """Write checkpoints in the background: the state is copied to host memory at the checkpoint step and a
    thread writes it while training goes on (crash-proof all the same; see ``checkpoint_async``)."""


class LoggingConfig(Section):
    dir: Optional[PathStr] = None
    """Directory of the per-rank TensorBoard and JSONL metrics (null: no monitor)."""
    every: PositiveInt = 10
    """Log metrics every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0 (drawn by the monitor: only with logging.dir set; without it, dtrain
    prints a line per log step)."""


class JobConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output: Optional[PathStr] = None
    """Where rank 0 writes the final model state (a torch file); optional."""

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, values: Any) -> Any:
        # `training:` with nothing under it reads as None in YAML: the section's defaults.
        if isinstance(values, dict):
            return {k: ({} if v is None and k in cls.model_fields and k != "output" else v) for k, v in values.items()}
        return values

    @model_validator(mode="after")
    def _fields_agree(self) -> "JobConfig":
        # Rules between fields; each error still starts with the path of the field to change.
        t, c, m = self.training, self.communication, self.model
        check_user_code(self)
        user_code = m.target is not None or self.data.target is not None
        family = "digits" if m.preset == "classifier" else "image_folder" if m.preset in VISION_PRESETS else "repo_text"
        if not user_code and family != self.data.dataset:
            raise ConfigError(f"model.preset {m.preset!r} does not go with data.dataset {self.data.dataset!r}: "
                              f"{m.preset!r} needs {family!r} (the preset 'classifier' goes with 'digits', the image "
                              f"presets ({', '.join(VISION_PRESETS)}) with 'image_folder' and GPT presets with "
                              "'repo_text')")
        from .image_job import check_config

        check_config(self)
        if m.n_embd is not None and m.preset in GPT_PRESETS and m.n_embd % GPT_PRESETS[m.preset].n_head:
            raise ConfigError(f"model.n_embd must be a multiple of preset {m.preset!r}'s "
                              f"{GPT_PRESETS[m.preset].n_head} attention heads, got {m.n_embd}")
        custom = c.compression != "none" or c.pattern != "nccl" or c.hierarchical
        if custom and t.strategy not in ("ddp", "zero1"):  # "auto" may pick a sharded strategy
            raise ConfigError(f"communication.compression / pattern / hierarchical apply to training.strategy ddp or "
                              f"zero1, not {t.strategy!r}")
        if c.compression != "none" and c.hierarchical:
            raise ConfigError(f"communication.hierarchical and communication.compression {c.compression!r} cannot be "
                              "combined yet: choose one")
        if c.hierarchical and c.pattern != "nccl":
            raise ConfigError(f"communication.hierarchical runs the backend's collectives in and across nodes; "
                              f"communication.pattern {c.pattern!r} is another way to all-reduce a bucket: choose one")
        if given(c, "error_feedback") and c.compression not in ("topk", "powersgd"):
            raise ConfigError(f"communication.error_feedback applies to communication.compression 'topk' or "
                              f"'powersgd', not {c.compression!r}: set the compression, or leave error_feedback out")
        if c.compression != "none" and c.pattern != "nccl":
            raise ConfigError(f"communication.pattern {c.pattern!r} is how uncompressed buckets are all-reduced; "
                              f"communication.compression {c.compression!r} sends its own messages: choose one")
        for name, applies in (("powersgd_rank", "powersgd"), ("compression_ratio", "topk"), ("warmup_steps", "topk"),
                              ("topk_select", "topk")):
            if given(c, name) and c.compression != applies:
                raise ConfigError(f"communication.{name} applies to communication.compression {applies!r}, not "
                                  f"{c.compression!r}: set the compression, or leave {name} out")
        if c.ranks_per_node is not None and not c.hierarchical:
            raise ConfigError("communication.ranks_per_node is the node size of hierarchical all-reduce: set "
                              "communication.hierarchical: true with it, or leave it out")
        if t.epochs == 0 and t.max_steps is None:
            raise ConfigError("training.epochs is 0 and training.max_steps is not given: nothing would be trained "
                              "(give epochs >= 1, or max_steps)")
        if self.checkpoint.every is not None and self.checkpoint.dir is None:
            raise ConfigError("checkpoint.every needs checkpoint.dir")
        if t.global_batch_size is not None and given(t, "batch_size"):
            raise ConfigError("training.batch_size (a rank's) and training.global_batch_size (the whole job's): give "
                              "one of them (training.micro_batch_size bounds a rank's forward with the global one; "
                              "--set training.batch_size=null drops a config's batch_size)")
        if t.micro_batch_size is not None and t.global_batch_size is None:
            raise ConfigError("training.micro_batch_size needs training.global_batch_size (with training.batch_size, "
                              "set training.gradient_accumulation_steps)")
        if t.global_batch_size is not None and t.pipeline_parallel_size > 1:
            raise ConfigError("training.global_batch_size with training.pipeline_parallel_size > 1 is not supported by "
                              "dtrain yet: give training.batch_size")
        self._pipeline_agrees()
        self._tensor_agrees()
        self._parameter_server_agrees()
        from .optim_job import check_optimizer_fields
        from .validation import check_job_evaluation

        check_optimizer_fields(self)
        check_job_evaluation(self.evaluation, self)
        return self


    def _parameter_server_agrees(self) -> None:
        """The parameter-server fields, and what strategy parameter_server does not run with (yet)."""
        t, o, s = self.training, self.optimizer, self.schedule
        if t.strategy != "parameter_server":
            stray = [f"training.{f}" for f in ("num_servers", "consistency", "staleness") if given(t, f)]
            if stray:
                one = len(stray) == 1
                raise ConfigError(f"{', '.join(stray)} appl{'ies' if one else 'y'} to training.strategy "
                                  f"parameter_server, not {t.strategy!r}: leave {'it' if one else 'them'} out")
            return
        if t.staleness and t.consistency != "ssp":
            raise ConfigError(f"training.staleness applies to training.consistency ssp, not {t.consistency!r}")
        unsupported = [
            ("training.pipeline_parallel_size", t.pipeline_parallel_size > 1),
            ("training.tensor_parallel_size", t.tensor_parallel_size > 1),
            ("training.gradient_clip_val", given(t, "gradient_clip_val") and t.gradient_clip_val is not None),
            ("training.precision fp16", t.precision == "fp16"),
            ("checkpoint.dir", self.checkpoint.dir is not None),
            (f"schedule.kind {s.kind}", s.kind != "constant"),
            ("schedule.warmup_steps", bool(s.warmup_steps)),
            (f"optimizer.name {o.name}", o.name not in ("sgd", "adamw")),
            ("optimizer.nesterov", o.name == "sgd" and o.nesterov),
            ("optimizer.weight_decay / training.weight_decay",
             (o.weight_decay if o.weight_decay is not None else t.weight_decay) > 0),
        ]
        for name, value in unsupported:
            if value:
                raise ConfigError(f"{name} with training.strategy parameter_server is not supported yet by dtrain "
                                  "(its servers run SGD with momentum or Adam at a constant learning rate, without "
                                  "clipping or weight decay; checkpoints of a sync run are the Python trainer's, "
                                  "DistributedTrainer(checkpoint_dir=...), not dtrain's yet)")

    def _tensor_agrees(self) -> None:
        """The tensor-parallel fields checked by the trainer's own rules (`TensorOptions`), each error
        naming its ``training.`` path, and what tensor parallelism does not run with (yet)."""
        from .tensor.options import TensorOptions

        t = self.training
        plan = ({k: tuple(v) if isinstance(v, list) else v for k, v in t.tensor_parallel_plan.items()}
                if t.tensor_parallel_plan is not None else None)
        try:
            options = TensorOptions(t.tensor_parallel_size, plan, t.sequence_parallel)
        except (TypeError, ValueError) as err:
            raise ConfigError(training_paths(str(err))) from None
        if not options.enabled:
            return
        size = f"training.tensor_parallel_size={options.size}"
        if t.strategy == "auto":
            raise ConfigError(f"training.strategy 'auto' with {size} is not supported yet: choose the data "
                              "parallelism over the tensor-parallel groups (ddp, zero1, zero2, zero3 or fsdp)")
        if t.sequence_parallel and self.data.block_size % options.size:
            raise ConfigError(f"training.sequence_parallel splits each sequence between the {options.size} tensor "
                              f"ranks: data.block_size ({self.data.block_size}) must be divisible by {size}")

    def _pipeline_agrees(self) -> None:
        """The pipeline fields checked by the trainer's own rules (`PipelineOptions`), each error naming
        its ``training.`` path, and the combinations the pipeline does not run (yet). What needs the
        model or the world size (more stages than layers, an unknown split name, a world size that
        pipeline_parallel_size does not divide) is checked by `dtrain` when it has them."""
        from .pipeline.training import PipelineOptions

        t = self.training
        try:
            options = PipelineOptions(t.pipeline_parallel_size, t.pipeline_schedule, t.microbatches,
                                      t.pipeline_split_points, t.pipeline_chunks, balance=t.pipeline_balance,
                                      half_blocks=t.pipeline_half_blocks, cuda_graphs=t.pipeline_cuda_graphs,
                                      compile_loss=t.pipeline_compile_loss)
        except (TypeError, ValueError) as err:
            raise ConfigError(training_paths(str(err))) from None
        if not options.enabled:
            return
        size = f"training.pipeline_parallel_size={options.size}"
        if t.strategy == "auto":
            raise ConfigError(f"training.strategy 'auto' with {size} is not supported yet: choose each stage's "
                              "data parallelism (ddp, zero1, zero2, zero3 or fsdp)")
        if t.pipeline_cuda_graphs and (t.activation_checkpointing or t.strategy != "ddp" or t.tensor_parallel_size > 1):
            raise ConfigError("training.pipeline_cuda_graphs does not combine with " + (
                "training.activation_checkpointing" if t.activation_checkpointing else
                f"training.strategy {t.strategy!r}" if t.strategy != "ddp" else "training.tensor_parallel_size > 1")
                + ": use ddp inside the stages, without checkpointing or tensor parallelism")
        if t.gradient_accumulation_steps != 1:
            raise ConfigError(f"training.gradient_accumulation_steps with {size} is not supported: set "
                              "training.microbatches instead (the pipeline accumulates over its microbatches)")
        if t.batch_size == "auto":
            raise ConfigError(f"training.batch_size 'auto' with {size} is not supported yet: give a number")
        if options.microbatches > t.batch_size:
            raise ConfigError(f"training.microbatches ({options.microbatches}) must be <= training.batch_size "
                              f"({t.batch_size}): each microbatch needs at least one sample")


#: The trainer's pipeline arguments, which are fields of the config's ``training`` section.
_PIPELINE_ARGUMENTS = re.compile(r"(?<![\w.])(pipeline_parallel_size|pipeline_schedule|microbatches|"
                                 r"pipeline_split_points|pipeline_chunks|pipeline_balance|pipeline_half_blocks|"
                                 r"pipeline_cuda_graphs|pipeline_compile_loss|"
                                 r"tensor_parallel_size|"
                                 r"tensor_parallel_plan|sequence_parallel)\b")


def training_paths(message: str) -> str:
    """A trainer message about its pipeline arguments, with each argument named by its config path
    (``microbatches`` -> ``training.microbatches``)."""
    return _PIPELINE_ARGUMENTS.sub(r"training.\1", message)

