"""Tensor and sequence parallelism (docs/tensor_parallel.md): parallel layers built from a user's
modules, the plan that places them (`apply_plan`, `gpt_plan`), and `ShardSpec`, the description of a
split parameter's place in the full one."""

from .layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallelDropout, VocabParallelEmbedding,
                     vocab_parallel_cross_entropy)
from .plan import (STYLES, VocabParallelLoss, apply_plan, gpt_plan, is_cross_entropy, parallel_loss,
                   unsupported_loss_message)
from .spec import ShardSpec, is_sequence_parallel, mark_sequence_parallel, runs, set_spec, shard, spec_of, unshard

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "STYLES",
    "SequenceParallelDropout",
    "ShardSpec",
    "VocabParallelEmbedding",
    "VocabParallelLoss",
    "apply_plan",
    "gpt_plan",
    "is_cross_entropy",
    "is_sequence_parallel",
    "mark_sequence_parallel",
    "parallel_loss",
    "runs",
    "set_spec",
    "shard",
    "spec_of",
    "unshard",
    "unsupported_loss_message",
    "vocab_parallel_cross_entropy",
]
