"""A global batch that stays what the user asked for at any data-parallel size (`fit(global_batch_size=...)`).

The user fixes the samples per optimizer step over the whole job, B. At W data-parallel replicas each
replica takes b = B / W of them, in ceil(b / m) micro-batches of at most m samples (`micro_batch_size`:
what one forward and backward may hold in memory), the gradients accumulated before the one
synchronisation of the step. A job restarted at another W (a node lost or added) recomputes b and the
accumulation, so every optimizer step still averages the gradient over the same B samples, and the
loss curve does not jump.

W must divide B: replicas average their gradients with equal weights, which is the mean over the
global batch only when they hold equal shares. Where W does not divide B, the start is refused with
the sizes that do (like DeepSpeed's list of valid GPU counts), unless the user allows a change: then B
becomes the multiple of W nearest to it (the smaller one on a tie) and the learning rate follows the
linear scaling rule, lr x B' / B, and the run says both.

The data position is kept in samples, not steps (`DistributedTrainer.samples_in_epoch`): the first
`samples_in_epoch` entries of the epoch's permutation are trained, whatever the sizes that trained them,
and a resumed epoch continues from the next (see `ShardedSampler.set_epoch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GlobalBatch", "check_layout_world", "plan_global_batch", "valid_data_parallel_sizes", "valid_world_sizes"]


def valid_data_parallel_sizes(global_batch_size: int) -> list[int]:
    """The data-parallel sizes that keep `global_batch_size` exactly: its divisors."""
    small = [d for d in range(1, math.isqrt(global_batch_size) + 1) if global_batch_size % d == 0]
    return sorted(set(small + [global_batch_size // d for d in small]))


def valid_world_sizes(global_batch_size: int | None = None, *, ranks_per_replica: int = 1,
                      up_to: int | None = None) -> list[int]:
    """The world sizes that keep a layout of `ranks_per_replica` ranks a data-parallel replica (pipeline x
    tensor parallel sizes) and, given, `global_batch_size`: multiples of `ranks_per_replica` whose
    data-parallel size divides the global batch. Without a global batch the multiples are endless: the
    first four, or those up to `up_to`."""
    if global_batch_size is None:
        count = 4 if up_to is None else up_to // ranks_per_replica
        return [ranks_per_replica * k for k in range(1, count + 1)]
    sizes = [ranks_per_replica * d for d in valid_data_parallel_sizes(global_batch_size)]
    return [w for w in sizes if up_to is None or w <= up_to]


def check_layout_world(world_size: int, pipeline: int = 1, tensor: int = 1) -> None:
    """Raise ValueError unless `world_size` keeps the model-parallel layout: ``pipeline x tensor`` ranks
    a data-parallel replica, so the world must be a multiple of their product. The message names the
    sizes that do (and what a global batch adds), for a job restarted at another size (elastic)."""
    per_replica = pipeline * tensor
    if world_size % per_replica == 0:
        return
    sizes = ", ".join(map(str, valid_world_sizes(ranks_per_replica=per_replica)))
    raise ValueError(
        f"world size {world_size} cannot keep pipeline_parallel_size={pipeline} x tensor_parallel_size={tensor}: "
        f"the world must be a multiple of {per_replica} ({sizes}, ...), {per_replica} rank(s) a data-parallel "
        f"replica (the data-parallel size is world / {per_replica}); with fit(global_batch_size=B) that "
        f"data-parallel size must also divide B. Start at one of those sizes, or change pipeline_parallel_size / "
        "tensor_parallel_size (checkpoints load at any of them)")


@dataclass(frozen=True)
class GlobalBatch:
    """How one optimizer step's global batch is cut at the current data-parallel size.

    Attributes:
        requested: the global batch the user asked for (`fit(global_batch_size=...)`).
        size: the global batch trained: `requested`, or the nearest multiple of `dp_size` where the
            user allowed a change.
        dp_size: data-parallel replicas now.
        per_rank: samples each replica takes per step (``size // dp_size``).
        micro_batch_size: the most samples one forward and backward takes on a replica (None until the
            trainer resolves it: `with_micro_batch`).
        accumulation: micro-batches per step on each replica (``ceil(per_rank / micro_batch_size)``).
    """

    requested: int
    size: int
    dp_size: int
    per_rank: int
    micro_batch_size: int | None = None
    accumulation: int = 1

    @property
    def lr_scale(self) -> float:
        """What the linear scaling rule multiplies the configured learning rate by: ``size / requested``."""
        return self.size / self.requested

    def with_micro_batch(self, micro_batch_size: int) -> "GlobalBatch":
        """This plan with the per-replica batch cut into micro-batches of at most `micro_batch_size`."""
        micro = min(micro_batch_size, self.per_rank)
        return GlobalBatch(self.requested, self.size, self.dp_size, self.per_rank, micro,
                           -(-self.per_rank // micro))

    def describe(self) -> str:
        micro = (f" in {self.accumulation} micro-batch(es) of at most {self.micro_batch_size}"
                 if self.micro_batch_size is not None else "")
        return (f"global batch {self.size} = {self.dp_size} data-parallel replica(s) x {self.per_rank} sample(s)"
                f"{micro}")


def plan_global_batch(global_batch_size: int, dp_size: int, *, allow_change: bool = False,
                      others: int = 1) -> GlobalBatch:
    """Cut `global_batch_size` over `dp_size` replicas, or raise ValueError naming the sizes that keep it.

    Args:
        global_batch_size: samples per optimizer step over all replicas.
        dp_size: data-parallel replicas now.
        allow_change: where `dp_size` does not divide the global batch, train the nearest multiple of
            `dp_size` instead (the caller scales the learning rate by `GlobalBatch.lr_scale`).
        others: ranks per replica (tensor x pipeline parallel sizes), to name world sizes in the error.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if global_batch_size % dp_size == 0:
        return GlobalBatch(global_batch_size, global_batch_size, dp_size, global_batch_size // dp_size)
    if not allow_change:
        valid = valid_data_parallel_sizes(global_batch_size)
        worlds = (f" (world sizes {', '.join(str(v * others) for v in valid)} at {others} ranks a replica)"
                  if others > 1 else "")
        raise ValueError(
            f"global_batch_size={global_batch_size} cannot be split evenly over {dp_size} data-parallel replicas: "
            f"the data-parallel sizes that keep it are {', '.join(map(str, valid))}{worlds}. Run at one of those "
            "sizes, or pass allow_global_batch_change=True (dtrain: training.allow_global_batch_change: true) to "
            f"train the nearest multiple of {dp_size} with the learning rate scaled linearly")
    per_rank = max(1, math.ceil(global_batch_size / dp_size - 0.5))  # nearest; the smaller on a tie
    return GlobalBatch(global_batch_size, per_rank * dp_size, dp_size, per_rank)
