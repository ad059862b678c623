"""Job configuration for the `dtrain` command: nested dataclasses read from YAML, validated on load.

    model:      {preset: small}                 # a GPT preset, or "classifier"
    data:       {dataset: repo_text, block_size: 64}
    training:   {strategy: ddp, epochs: 1, max_steps: 100, batch_size: 16, lr: 0.002}
    checkpoint: {dir: checkpoints, every: 50, keep_last: 3}
    logging:    {dir: runs/exp, every: 10}

Every field has a default a user would choose; an unknown or invalid field is an error that names it
(``training.batch_size must be an integer >= 1, got 0``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

__all__ = ["JobConfig", "ConfigError", "load_config"]


class ConfigError(ValueError):
    """A configuration field is unknown or invalid; the message names it."""


@dataclass
class ModelConfig:
    preset: str = "small"
    """A GPT preset (tiny, small, gpt2-124m, gpt-1.3b) or "classifier" (an MLP for the digits data)."""
    n_layer: int | None = None
    """Override the preset's number of blocks."""
    n_embd: int | None = None
    """Override the preset's width."""
    dropout: float = 0.0


@dataclass
class DataConfig:
    dataset: Literal["repo_text", "digits"] = "repo_text"
    """repo_text: this package's own source as bytes (language model); digits: 8x8 handwritten digits
    shipped with the package (classification)."""
    block_size: int = 64
    """Tokens per language-model sample."""
    val_fraction: float = 0.1


@dataclass
class TrainingConfig:
    strategy: Literal["ddp", "zero1", "zero2", "zero3", "fsdp", "auto"] = "ddp"
    """``auto``: the planner picks DDP, ZeRO-2 or ZeRO-3 (+ CPU offload) from memory estimates."""
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int | Literal["auto"] = 16
    """Samples per rank per optimizer step; ``auto``: the largest that fits (probed on GPUs, estimated
    against ``memory_budget_gb`` on CPU and for sharded strategies)."""
    lr: float = 2e-3
    weight_decay: float = 0.0
    gradient_accumulation_steps: int = 1
    gradient_clip_val: float | None = 1.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """bf16 / fp16: autocast with fp32 master weights; fp16 adds our dynamic loss scaler."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations."""
    memory_budget_gb: float | None = None
    """Per-rank memory in GiB (2^30 bytes) that strategy=auto and batch_size=auto plan for (default: the
    GPU's, or this process's share of the host's)."""
    seed: int = 0
    timeout_s: float = 600.0
    """Collective timeout."""


@dataclass
class CommunicationConfig:
    bucket_cap_mb: float = 25.0
    compression: Literal["none", "topk", "bf16", "fp16", "powersgd"] = "none"
    """Gradient compression for the DDP-based strategies (ddp, zero1)."""
    compression_ratio: float = 0.01
    """Top-K density."""
    error_feedback: bool = True
    pattern: Literal["nccl", "ring", "tree"] = "nccl"
    hierarchical: bool = False
    ranks_per_node: int | None = None


@dataclass
class CheckpointConfig:
    dir: str | None = None
    every: int | None = None
    keep_last: int = 3
    resume: bool = True
    """Resume from the latest good checkpoint in ``dir``; false (or ``dtrain --no-resume``): start from
    step 0, after moving the checkpoints already in ``dir`` into ``dir/previous_run_<k>/``."""
    save_on_preemption: bool = True
    """On SIGTERM (a pod or batch job being stopped), save a checkpoint at the step where training stops."""


@dataclass
class LoggingConfig:
    dir: str | None = None
    every: int = 10
    progress: bool = True


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output: str | None = None
    """Where rank 0 writes the final model state (a torch file); optional."""

    def __post_init__(self) -> None:
        t = self.training
        _positive_int("training.epochs", t.epochs, allow_zero=True)
        if t.batch_size != "auto" and (not isinstance(t.batch_size, int) or isinstance(t.batch_size, bool)
                                       or t.batch_size < 1):
            raise ConfigError(f"training.batch_size must be an integer >= 1 or 'auto', got {t.batch_size!r}")
        if t.memory_budget_gb is not None:
            _positive_float("training.memory_budget_gb", t.memory_budget_gb)
        _positive_int("training.gradient_accumulation_steps", t.gradient_accumulation_steps)
        if t.max_steps is not None:
            _positive_int("training.max_steps", t.max_steps)
        _positive_float("training.lr", t.lr)
        _positive_float("training.timeout_s", t.timeout_s)
        if t.gradient_clip_val is not None:
            _positive_float("training.gradient_clip_val", t.gradient_clip_val)
        _positive_int("data.block_size", self.data.block_size)
        if not 0.0 <= self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.data.val_fraction!r}")
        if not 0.0 <= self.model.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.model.dropout!r}")
        c = self.communication
        _positive_float("communication.bucket_cap_mb", c.bucket_cap_mb)
        if not 0 < c.compression_ratio <= 1:
            raise ConfigError(f"communication.compression_ratio must be in (0, 1], got {c.compression_ratio!r}")
        custom = c.compression != "none" or c.pattern != "nccl" or c.hierarchical
        if custom and t.strategy not in ("ddp", "zero1"):  # "auto" may pick a sharded strategy
            raise ConfigError(f"communication.compression / pattern / hierarchical apply to training.strategy ddp or "
                              f"zero1, not {t.strategy!r}")
        if self.checkpoint.every is not None:
            _positive_int("checkpoint.every", self.checkpoint.every)
            if self.checkpoint.dir is None:
                raise ConfigError("checkpoint.every needs checkpoint.dir")
        _positive_int("checkpoint.keep_last", self.checkpoint.keep_last)
        for name in ("resume", "save_on_preemption"):
            if not isinstance(getattr(self.checkpoint, name), bool):
                raise ConfigError(f"checkpoint.{name} must be true or false, got {getattr(self.checkpoint, name)!r}")
        _positive_int("logging.every", self.logging.every)
        from .models import GPT_PRESETS

        if self.model.preset != "classifier" and self.model.preset not in GPT_PRESETS:
            raise ConfigError(f"model.preset must be one of {sorted(GPT_PRESETS) + ['classifier']}, got {self.model.preset!r}")
        if (self.model.preset == "classifier") != (self.data.dataset == "digits"):
            raise ConfigError("model.preset 'classifier' goes with data.dataset 'digits' (and GPT presets with 'repo_text')")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive_int(name: str, value: Any, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def _build(cls, values: Any, path: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(values).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown field {path + '.' if path else ''}{unknown[0]} (known: {', '.join(sorted(known))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        name = f"{path}.{f.name}" if path else f.name
        value, hint = values[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, value, name)
            continue
        choices = get_args(hint) if getattr(hint, "__origin__", None) is Literal else None
        if choices and value not in choices:
            raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")
        kwargs[f.name] = value
    return cls(**kwargs)


def load_config(source: str | dict, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML file (or a dict), apply ``section.field=value`` overrides, validate."""
    import yaml

    if isinstance(source, dict):
        raw = source
    else:
        try:
            with open(source) as f:
                raw = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {source!r} does not exist") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {source!r} is not valid YAML: {err}") from None
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(text)
    return _build(JobConfig, raw, "")
