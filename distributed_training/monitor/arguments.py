"""The checks of `Monitor`'s arguments (each error names its argument) and of `record_step`'s timings."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

import torch.distributed as dist

from .cluster import MEMBERS

__all__ = ["check_monitor_arguments", "check_timings", "is_int"]


def check_monitor_arguments(log_dir: Any, *, rank: Any, world_size: Any, group: Any, log_every: Any,
                            straggler_threshold: Any, member: Any, background: Any, flags: dict[str, Any]) -> int:
    """Raise ValueError naming the first bad argument of `Monitor` (`flags`: its switches by name);
    returns this rank's rank in `group` (0 when torch.distributed is not initialised)."""
    if not isinstance(log_dir, (str, os.PathLike)) or os.fspath(log_dir) == "":
        raise ValueError(f"log_dir must be a non-empty path, got {log_dir!r}")
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    if not is_int(log_every) or log_every < 1:
        raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
    if (
        not isinstance(straggler_threshold, numbers.Real)
        or isinstance(straggler_threshold, bool)
        or not math.isfinite(straggler_threshold)
        or straggler_threshold <= 1
    ):
        raise ValueError(f"straggler_threshold must be a finite number > 1, got {straggler_threshold!r}")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if member not in MEMBERS:
        raise ValueError(f"member must be one of {MEMBERS}, got {member!r}")
    if background is not None and not isinstance(background, bool):
        raise ValueError(f"background must be True, False or None, got {background!r}")

    initialised = dist.is_available() and dist.is_initialized()
    if group is not None and not initialised:
        raise ValueError("group was given but torch.distributed is not initialised")
    group_rank = 0
    if initialised:
        dist_world = dist.get_world_size(group)
        if world_size != dist_world:
            raise ValueError(
                f"world_size={world_size} but the process group has {dist_world} ranks"
            )
        group_rank = dist.get_rank(group)
        if rank != group_rank:
            where = "" if group is None else " in the given group"
            raise ValueError(f"rank={rank} but torch.distributed says this is rank {group_rank}{where}")
    return group_rank


def check_timings(**figures: float) -> None:
    """`record_step`'s timings and counts: finite and not negative (a negative step time gave negative
    throughput, a NaN one a NaN mean)."""
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
