"""Choosing a strategy and a batch size from memory estimates.

Per-rank bytes of model state for P parameters on N ranks, with fp32 master weights, fp32 gradients and
Adam's two fp32 moments (16 bytes a parameter; `param_dtype` is what gathered weights use):

    ddp            4P + 4P + 8P
    zero2          (4 + 4 + 8) P / N  +  bytes(param_dtype) P      (gathered weights kept fwd -> bwd)
    zero3          (4 + 4 + 8) P / N  +  2 x largest unit in param_dtype   (this one and the prefetched)
    zero3+offload  2 x largest unit on the device; the 16P/N of state in host memory

plus activations. `choose_strategy` takes the first of these that fits the device, in that order, since
each step down the list trades communication or host transfers for memory. `activation_bytes_per_sample`
measures activations by counting what autograd saves for backward, on any device.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["Plan", "NoStrategyFits", "choose_strategy", "model_sizes", "default_budget", "state_bytes", "activation_bytes_per_sample", "max_batch_size_for_budget",
           "find_max_batch_size"]

GIB = 2**30


@dataclass
class Plan:
    """The chosen strategy, why, and the per-rank estimates (bytes) of every candidate."""

    strategy: str
    cpu_offload: bool
    reason: str
    estimates: dict[str, float] = field(default_factory=dict)


def choose_strategy(num_params: int, world_size: int, device_bytes: float, *, activation_bytes: float = 0.0,
                    largest_unit_params: int | None = None, param_dtype_bytes: int = 2,
                    host_bytes: float | None = None, headroom: float = 0.9) -> Plan:
    """Pick DDP, ZeRO-2, ZeRO-3 or ZeRO-3 with CPU offload for this model on this hardware."""
    for name, value in (("num_params", num_params), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, value, least in (("device_bytes", device_bytes, 0.0), ("activation_bytes", activation_bytes, 0.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value < math.inf \
                or (name == "device_bytes" and value == 0):
            raise ValueError(f"{name} must be a finite number of bytes {'> 0' if name == 'device_bytes' else '>= 0'}, "
                             f"got {value!r}")
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    usable = headroom * device_bytes
    estimates = {name: state_bytes(name, num_params, world_size, largest_unit_params=largest_unit_params,
                                   param_dtype_bytes=param_dtype_bytes) + activation_bytes
                 for name in ("ddp", "zero2", "zero3", "zero3_offload")}
    p, n = float(num_params), float(world_size)
    for name in ("ddp", "zero2", "zero3"):
        if estimates[name] <= usable:
            return Plan(name, False, f"{name} needs {estimates[name] / GIB:.1f} GiB per rank of {usable / GIB:.1f} "
                                      f"usable ({headroom:.0%} of {device_bytes / GIB:.1f} GiB); "
                                      + _why_not_earlier(name, estimates, usable), estimates)
    if estimates["zero3_offload"] <= usable and (host_bytes is None or 16 * p / n <= headroom * host_bytes):
        return Plan("zero3", True, f"only ZeRO-3 with CPU offload fits: {estimates['zero3_offload'] / GIB:.1f} GiB "
                                   f"on the device, {16 * p / n / GIB:.1f} GiB of state in host memory; "
                                   + _why_not_earlier("zero3_offload", estimates, usable), estimates)
    advice = "more ranks or a larger memory budget" + (", a smaller batch or activation checkpointing"
                                                       if activation_bytes > 0 else "")
    raise NoStrategyFits(
        f"no strategy fits: even ZeRO-3 with CPU offload needs {_gib(estimates['zero3_offload'])} GiB per device "
        f"(activations {_gib(activation_bytes)} GiB) of {_gib(usable)} usable ({headroom:.0%} of "
        f"{_gib(device_bytes)} GiB); use {advice}"
    )


class NoStrategyFits(ValueError):
    """`choose_strategy` found nothing that fits the memory it was given."""


def _gib(n_bytes: float) -> str:
    """Bytes in GiB, to three significant figures (0.0 said nothing of a budget of 1 KiB)."""
    return f"{n_bytes / GIB:.3g}"


def state_bytes(strategy: str, num_params: int, world_size: int, *, largest_unit_params: int | None = None,
                param_dtype_bytes: int = 2) -> float:
    """Per-rank bytes of weights, gradients and Adam state (the table above; ``zero1`` shards only the
    optimizer state: 4P + 4P + 8P/N). Without `largest_unit_params`, a unit is taken as 1/12 of the model."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    for name, value in (("num_params", num_params), ("largest_unit_params", largest_unit_params)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0 <= value < math.inf):
            raise ValueError(f"{name} must be a finite count >= 0, got {value!r}")
    p, n = float(num_params), float(world_size)
    unit = float(largest_unit_params if largest_unit_params is not None else max(1, num_params // 12))
    table = {
        "ddp": 16 * p,
        "zero1": 8 * p + 8 * p / n,
        "zero2": 16 * p / n + param_dtype_bytes * p,
        "zero3": 16 * p / n + 2 * param_dtype_bytes * unit,
        "zero3_offload": 2 * param_dtype_bytes * unit,
    }
    if strategy not in table:
        raise ValueError(f"strategy must be one of {sorted(table)}, got {strategy!r}")
    return table[strategy]


def _why_not_earlier(chosen: str, estimates: dict[str, float], usable: float) -> str:
    order = ["ddp", "zero2", "zero3", "zero3_offload"]
    earlier = order[: order.index(chosen)]
    if not earlier:
        return "the fastest option fits"
    return "too big: " + ", ".join(f"{e} {estimates[e] / GIB:.1f} GiB" for e in earlier)


def activation_bytes_per_sample(model: nn.Module, make_batch: Callable[[int], tuple], loss_fn: Callable) -> float:
    """Bytes autograd saves for backward per sample, from forwards at batch sizes 2 and 4 (not 1:
    BatchNorm refuses a batch of one in training)."""

    def saved_bytes(batch_size: int) -> int:
        total = 0
        seen: set[int] = set()

        def pack(t: torch.Tensor):
            nonlocal total
            key = t.untyped_storage().data_ptr()
            if key not in seen:  # a storage saved by several ops counts once
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen |= params
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, make_batch(batch_size))
        del loss
        return total

    return float(max((saved_bytes(4) - saved_bytes(2)) / 2, 1))


def max_batch_size_for_budget(budget_bytes: float, fixed_bytes: float, bytes_per_sample: float,
                              multiple_of: int = 1) -> int:
    """The largest batch whose activations fit what the budget leaves after the fixed (model) bytes."""
    for name, value in (("budget_bytes", budget_bytes), ("fixed_bytes", fixed_bytes), ("bytes_per_sample", bytes_per_sample)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number of bytes >= 0, got {value!r}")
    if not bytes_per_sample > 0:
        raise ValueError("bytes_per_sample must be > 0: a sample's activations take some memory")
    room = budget_bytes - fixed_bytes
    if room < bytes_per_sample:
        raise ValueError(f"the memory budget ({budget_bytes / GIB:.2f} GiB) leaves no room for one sample after "
                         f"{fixed_bytes / GIB:.2f} GiB of model state")
    batch = int(room // bytes_per_sample)
    return max(multiple_of, batch - batch % multiple_of)


def find_max_batch_size(try_batch: Callable[[int], None], *, start: int = 1, limit: int = 1 << 16) -> int:
    """The largest batch size for which `try_batch(b)` (a forward+backward) does not run out of memory.

    Doubles until the first out-of-memory error, then bisects; each failure frees the cache so the
    search leaves the device as it found it (on GPUs: `torch.cuda.OutOfMemoryError`).
    """
    def fits(b: int) -> bool:
        try:
            try_batch(b)
            return True
        except torch.cuda.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return False

    if not fits(start):
        raise RuntimeError(f"even a batch of {start} does not fit in memory")
    good, bad = start, None
    while bad is None and good < limit:
        nxt = min(good * 2, limit)
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    if bad is None:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def model_sizes(model: nn.Module) -> tuple[int, int]:
    """Parameter count (shared tensors once) and the largest block's (a unit of FSDP's default policy,
    `fsdp_units.repeated_blocks`)."""
    from .strategies.fsdp_units import repeated_blocks

    params = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in child.parameters()) for _, child in repeated_blocks(model)]
    return params, max(blocks) if blocks else params


def default_budget(local_rank: int, local_world_size: int) -> float:
    """Per-rank memory: the GPU's total, or this process's share of the host's."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(local_rank).total_memory)
    import psutil

    return psutil.virtual_memory().total / max(1, local_world_size)
