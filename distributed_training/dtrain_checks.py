"""What a `dtrain` job checks before the rendezvous, on every rank alike (each reads the same config and
builds the same model): that the paths it writes can be written (`check_paths`), and the model-parallel
sizes against the world (torchrun's WORLD_SIZE) and the model (`check_world`; a pipeline's stages against
the model's layers: `check_pipeline_fits`); once the ranks have met, that they read the same config
(`check_same_config`). Each error is a `ConfigError` naming the config field."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError, JobConfig
from .mesh import global_rank
from .tensor.strategy import _builtin_plan

__all__ = ["check_paths", "check_world", "check_pipeline_fits", "check_same_config"]


def check_paths(cfg: JobConfig) -> None:
    """Where the job writes can be written, checked before it trains: a checkpoint.dir naming a file
    failed at the first save, an output naming a directory only after the whole run."""
    for name, path, is_dir in (("checkpoint.dir", cfg.checkpoint.dir, True), ("logging.dir", cfg.logging.dir, True),
                               ("output", cfg.output, False)):
        if path is None:
            continue
        target = Path(path)
        if target.exists() and target.is_dir() != is_dir:
            raise ConfigError(f"{name}: {path!r} is a file: name a directory" if is_dir else
                              f"{name}: {path!r} is a directory: name the file to write (e.g. {path}/model.pt)")
        existing = next(p for p in (target, *target.parents) if p.exists())
        if existing != target and not existing.is_dir():
            raise ConfigError(f"{name}: {path!r} cannot be created: {str(existing)!r} is a file")
        if existing == target and not is_dir:  # the file of an earlier run: replaced, so its directory is written
            if not os.access(target, os.W_OK):
                raise ConfigError(f"{name}: {path!r} cannot be written: no write permission on it")
            existing = target.parent
        if not os.access(existing, os.W_OK):
            read_only = hasattr(os, "statvfs") and os.statvfs(existing).f_flag & getattr(os, "ST_RDONLY", 1)
            why = "it is on a read-only file system" if read_only else "no write permission"
            raise ConfigError(f"{name}: {path!r} cannot be written: {why} ({str(existing)!r})")
        try:  # (root passes os.access everywhere: /proc, a read-only mount)
            fd, probe = tempfile.mkstemp(prefix=".dtrain-write-probe-", dir=existing)
            os.close(fd)
            os.remove(probe)
        except OSError as err:
            raise ConfigError(f"{name}: {path!r} cannot be written: creating a file in {str(existing)!r} failed "
                              f"({err.strerror or err})") from None


def check_world(cfg: JobConfig, model: nn.Module, world: int) -> None:
    """The model-parallel sizes against the world (and, with a pipeline, the model), before the rendezvous."""
    t = cfg.training
    pipelined = t.pipeline_parallel_size > 1
    if t.tensor_parallel_size > 1 and world % (t.tensor_parallel_size * t.pipeline_parallel_size):
        with_pipeline = f" x training.pipeline_parallel_size={t.pipeline_parallel_size}" if pipelined else ""
        per_replica = t.tensor_parallel_size * t.pipeline_parallel_size
        raise ConfigError(f"training.tensor_parallel_size={t.tensor_parallel_size}{with_pipeline} does not divide the "
                          f"world size {world}: run a multiple of {per_replica} processes (torchrun --nproc_per_node)")
    if t.tensor_parallel_size > 1 and t.tensor_parallel_plan is None and _builtin_plan(model) is None:
        raise ConfigError(f"training.tensor_parallel_size={t.tensor_parallel_size} needs training.tensor_parallel_plan "
                          f"for a {type(model).__name__} (module-name pattern -> colwise | rowwise | vocab | sequence | "
                          "replicate; see docs/tensor_parallel.md): only our GPT has a built-in plan")
    c = cfg.communication
    if c.hierarchical and c.ranks_per_node is not None and world % c.ranks_per_node:
        raise ConfigError(f"communication.ranks_per_node={c.ranks_per_node} does not divide the world size {world} "
                          f"(nodes of equal size): run a multiple of {c.ranks_per_node} processes, or leave it out "
                          "(torchrun's LOCAL_WORLD_SIZE)")
    if t.pipeline_cuda_graphs and pipelined and not torch.cuda.is_available():
        raise ConfigError("training.pipeline_cuda_graphs needs CUDA devices, and this machine has none: set it to "
                          "false")
    if pipelined:
        check_pipeline_fits(cfg, model)


def check_pipeline_fits(cfg: JobConfig, model: nn.Module) -> None:
    """What the pipeline fields ask of the model and the world, checked before the rendezvous (every
    rank reads the same config and builds the same model, so every rank fails alike): the world size
    (torchrun's WORLD_SIZE) a multiple of the pipeline's, no more stages than layers, split points that
    name layers, a balance the model has costs for."""
    from .models import GPT
    from .pipeline.stages import chain, split_at
    from .pipeline.training import PipelineOptions

    t = cfg.training
    options = PipelineOptions(t.pipeline_parallel_size, t.pipeline_schedule, t.microbatches,
                              t.pipeline_split_points, t.pipeline_chunks, balance=t.pipeline_balance,
                              half_blocks=t.pipeline_half_blocks)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world % options.size:
        raise ConfigError(f"training.pipeline_parallel_size={options.size} does not divide the world size {world}: "
                          f"run a multiple of {options.size} processes (torchrun --nproc_per_node)")
    try:
        names = [name for name, _ in chain(model, halves=options.half_blocks and options.enabled)]
    except ValueError as err:
        raise ConfigError(f"training.pipeline_half_blocks: {err}") from None
    if options.num_stages > len(names):
        chunks = f" x training.pipeline_chunks={options.chunks}" if options.chunks > 1 else ""
        raise ConfigError(f"training.pipeline_parallel_size={options.size}{chunks} makes {options.num_stages} stages, "
                          f"but the model has only {len(names)} layer{'s' if len(names) != 1 else ''} to cut ({', '.join(names)}): fewer stages, or "
                          "more layers (model.n_layer)")
    if options.split_points is not None:
        try:
            split_at(options.split_points, names)
        except ValueError as err:
            raise ConfigError(f"training.pipeline_split_points: {str(err).removeprefix('boundary_names: ')}") from None
    elif options.balance == "compute" and not isinstance(model, GPT):
        raise ConfigError(f"training.pipeline_balance 'compute' knows the compute of our GPT only, not of a "
                          f"{type(model).__name__}: balance by parameters or time, or give "
                          "training.pipeline_split_points")


#: Fields each node may set its own way: its own paths (node-local disks: compared by whether they are
#: given; in a ``*kwargs`` field, a string or a list of strings that looks like a path on any node), ...
PER_NODE_PATHS = {"checkpoint.dir", "logging.dir", "output", "data.root", "data.val_root"}
#: ... and, given or not, its loader's worker processes, whether its terminal shows a bar, its memory
#: budget (another GPU), its evaluation batch (ranks evaluate in lockstep whatever their batch counts).
PER_NODE_VALUES = {"data.num_workers", "logging.progress", "training.memory_budget_gb", "evaluation.batch_size"}


def _path_like(value) -> bool:
    strings = value if isinstance(value, (list, tuple)) else [value]
    return bool(strings) and all(isinstance(v, str) for v in strings) and any(
        os.sep in v or os.path.exists(v) for v in strings)


def _same_setting(a: tuple, b: tuple) -> bool:
    """Two nodes' values of one field (`check_same_config`'s entries): equal, or both given where the field
    is a node's own, or (in a ``*kwargs`` field) strings of which one looks like a path."""
    if a == b or a[0] == b[0] == "free":
        return True
    if a[0] == b[0] == "own":
        return a[1] is not None and b[1] is not None
    return a[0] == b[0] == "kwarg" and (a[2] or b[2])


def check_same_config(cfg: JobConfig, trainer) -> None:
    """Every rank must train under one config: a node whose YAML (or ``--set``) says another learning rate,
    schedule or weight decay trains its replica its own way, and the replicas drift apart without an error
    (0.52 apart after 20 steps at lr 0.003 on one node and 0.03 on the other, in a trial). One all-gather
    of the flattened config over the training ranks; raises on every rank alike, naming the first field
    that differs."""
    import torch.distributed as dist

    ctx = trainer.context
    if ctx.world_size == 1 or ctx.independent:
        return
    mine = {}

    def flatten(prefix: str, value, in_kwargs: bool = False) -> None:
        if isinstance(value, dict) and not prefix.endswith("tensor_parallel_plan"):
            for key, item in value.items():
                flatten(f"{prefix}.{key}" if prefix else key, item, in_kwargs or prefix.endswith("kwargs"))
        elif prefix in PER_NODE_PATHS or prefix in PER_NODE_VALUES:
            mine[prefix] = ("own" if prefix in PER_NODE_PATHS else "free", None if value is None else repr(value))
        elif in_kwargs and (isinstance(value, str) or isinstance(value, (list, tuple)) and value
                            and all(isinstance(v, str) for v in value)):
            mine[prefix] = ("kwarg", repr(value), _path_like(value))
        else:
            mine[prefix] = ("value", repr(value))

    flatten("", cfg.model_dump())
    every: list = [None] * dist.get_world_size(ctx.group)
    dist.all_gather_object(every, mine, group=ctx.group)
    for name in sorted(set().union(*every)):
        values = [config.get(name, ("value", "not given")) for config in every]
        other = next((r for r, value in enumerate(values) if not _same_setting(value, values[0])), None)
        if other is not None:
            ranks = global_rank(ctx.group, 0), global_rank(ctx.group, other)
            if values[0][0] == "own":  # a node's own value: compared by whether it is given
                given = ["one" if v[1] is not None else "none" for v in (values[0], values[other])]
                raise ConfigError(f"{name} is given on some ranks only: rank {ranks[0]} has {given[0]}, rank "
                                  f"{ranks[1]} {given[1]}: give every node the same config")
            raise ConfigError(f"{name} differs across ranks: rank {ranks[0]} has {values[0][1]}, rank {ranks[1]} has "
                              f"{values[other][1]} (each node read its own config file or --set): give every node the "
                              "same config")
