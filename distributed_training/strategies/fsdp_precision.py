"""FSDP's mixed precision: the dtypes parameters are gathered and computed in and gradients reduced in
(`MixedPrecision`), the cast of a forward's floating-point inputs to the compute dtype, and the one
model it cannot compute that way said up front (BatchNorm against float32 running statistics)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MixedPrecision", "cast_floats", "refuse_low_precision_batchnorm"]


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for communication and compute; the shards (master weights) keep their own dtype.

    Attributes:
        param_dtype: dtype parameters are gathered and computed in (bf16 halves the gather bytes).
        reduce_dtype: dtype gradients are reduce-scattered in (default: `param_dtype`).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):  # a name ("bf16", "float32") is taken as its dtype
            value = getattr(self, field)
            if isinstance(value, str) and value.lower() in _DTYPES:
                object.__setattr__(self, field, _DTYPES[value.lower()])
            elif value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision({field}=) takes a floating-point torch.dtype (torch.bfloat16) or "
                                f"one of {', '.join(repr(k) for k in _DTYPES)}, got {value!r}")


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def refuse_low_precision_batchnorm(module: nn.Module, dtype: torch.dtype) -> None:
    """`MixedPrecision(param_dtype)` computes every parameter in `dtype`: a BatchNorm's weight too, while its
    running statistics stay float32, which `F.batch_norm` refuses at the first forward. Said up front."""
    for name, m in module.named_modules():
        if (isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.weight is not None
                and m.running_mean is not None and m.running_mean.dtype != dtype):
            raise ValueError(
                f"FSDP mixed_precision=MixedPrecision(param_dtype={dtype}) would compute BatchNorm "
                f"'{name or type(m).__name__}' in {dtype} against its {m.running_mean.dtype} running statistics, "
                "which BatchNorm refuses. Use the trainer's mixed_precision='bf16' / 'fp16' (autocast, which keeps "
                "BatchNorm in float32) for this model")


def cast_floats(tree, dtype: torch.dtype):
    flat, spec = tree_flatten(tree)
    flat = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in flat]
    return tree_unflatten(flat, spec)
