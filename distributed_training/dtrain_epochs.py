"""How many epochs a `dtrain` job's ``training.max_steps`` needs, counted from where a resumed checkpoint
stands (`epochs_for`). (An epoch's short last step that a pipeline's schedule or BatchNorm cannot run split
over the replicas, `fit` pads: `data.ShardedSampler`.)"""

from __future__ import annotations

import math

from .logs import get_logger

__all__ = ["epochs_for"]

log = get_logger("cli")


def epochs_for(epochs: int, max_steps: int | None, train, batch_size: int | None, world_size: int,
               resumed: dict | None = None) -> int:
    """`epochs`, or more when `max_steps` asks for more steps than `epochs` passes hold.

    A dtrain user who writes ``max_steps`` means that many steps, so it wins over ``epochs`` (whose
    default, 1, would otherwise stop a short dataset's run early); the change is logged. A run resumed
    from `resumed` (a checkpoint's meta) counts from its epoch and step: written at another batch or
    world size, its epochs held other numbers of steps."""
    if max_steps is None or not batch_size:
        return epochs
    from .data import ShardedSampler

    per_rank = len(ShardedSampler(train, world_size, 0))  # what fit() gives each rank per epoch
    per_epoch = max(1, math.ceil(per_rank / batch_size))
    needed = math.ceil(max_steps / per_epoch)
    if resumed is not None:
        left = max(0, max_steps - int(resumed.get("step", 0)))
        partial = 1 if resumed.get("batch_in_epoch") or resumed.get("samples_in_epoch") else 0
        if partial:  # the steps the resumed epoch still holds come first
            if resumed.get("samples_in_epoch"):
                rest = math.ceil(max(0, len(train) - int(resumed["samples_in_epoch"])) / (batch_size * world_size))
            else:
                rest = per_epoch - int(resumed.get("batch_in_epoch", 0))
            left = max(0, left - max(0, rest))
        needed = max(needed, int(resumed.get("epoch", 0)) + partial + math.ceil(left / per_epoch))
    if needed > epochs:
        log.info("dtrain: training.max_steps=%d needs %d epochs of %d steps (%d samples per rank, batch %d): "
                 "training for %d epochs instead of training.epochs=%d", max_steps, needed, per_epoch, per_rank,
                 batch_size, needed, epochs)
        return needed
    return epochs
