"""How a `dtrain` job cuts its epochs: whether each epoch's last batch is left out (``fit(drop_last=True)``)
because the pipeline's schedule cannot run it (`short_last_batch`) or BatchNorm would see one value a channel
in it (`batch_norm_tail`), and how many epochs ``training.max_steps`` needs, counted from where a resumed
checkpoint stands (`epochs_for`)."""

from __future__ import annotations

import math

from torch import nn

from .logs import get_logger

__all__ = ["short_last_batch", "batch_norm_tail", "epochs_for"]

log = get_logger("cli")


def short_last_batch(trainer, train, batch_size: int) -> bool:
    """Whether an epoch ends with a batch the pipeline cannot run (`smallest_batch`: interleaved needs a
    sample per pipeline rank; other schedules run a short batch in fewer microbatches): then that batch is
    left out (``fit(drop_last=True)``), where fit would refuse it."""
    from .data import ShardedSampler

    smallest = trainer.strategy.smallest_batch()
    last = ShardedSampler(train, trainer.dp_world_size, 0, batch_size=batch_size, min_rows=smallest).short_rows()
    if 0 < last < smallest:
        log.info("dtrain: each epoch's last batch (%d samples) is too small for training.pipeline_schedule=%r, "
                 "which needs at least %d (one a pipeline rank): left out", last,
                 trainer.config["pipeline_schedule"], smallest)
        return True
    return False


def batch_norm_tail(trainer, model: nn.Module, train, batch_size: int, iterable: bool,
                    micro_batch_size: int | None = None) -> bool:
    """Whether each epoch ends with a batch (or, under accumulation, micro-batches) of one sample a
    replica while the model trains BatchNorm layers: one that sees a single value a channel then (a
    ResNet's last layers on small images: 1x1) raises "Expected more than 1 value per channel", at every
    epoch's end and again after each resume, and the job never finishes. Then that batch is left out
    (``fit(drop_last=True)``, which the epochs for max_steps count too), and said. `micro_batch_size`:
    ``training.micro_batch_size`` with a global batch (fit cuts a rank's `batch_size` into
    ``ceil(batch_size / micro_batch_size)`` micro-batches, the short last batch into as many); else
    the trainer's ``gradient_accumulation_steps`` are the cuts."""
    from .data import ShardedSampler

    if iterable or not isinstance(batch_size, int):
        return False
    cuts = trainer.gradient_accumulation_steps
    if micro_batch_size is not None:
        cuts = -(-batch_size // min(micro_batch_size, batch_size))
    # (the smallest replica's share of the last step, as fit deals it to a model training BatchNorm)
    last = ShardedSampler(train, trainer.dp_world_size, 0, batch_size=batch_size, min_rows=2 * cuts).short_rows()
    if not 0 < last < 2 * cuts:
        return False
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm) and m.training
               for m in model.modules()):
        return False
    log.info("dtrain: each epoch's last batch would hold %d sample(s) a replica%s, on which the model's "
             "BatchNorm layers may see one value a channel and fail: left out (a %s that leaves 2 or more a "
             "micro-batch keeps it)", last, "" if cuts == 1 else f", cut in {cuts} micro-batches",
             "training.batch_size" if micro_batch_size is None else "training.global_batch_size or micro_batch_size")
    return True


def epochs_for(epochs: int, max_steps: int | None, train, batch_size: int | None, world_size: int,
                drop_last: bool = False, resumed: dict | None = None) -> int:
    """`epochs`, or more when `max_steps` asks for more steps than `epochs` passes hold.

    A dtrain user who writes ``max_steps`` means that many steps, so it wins over ``epochs`` (whose
    default, 1, would otherwise stop a short dataset's run early); the change is logged. A run resumed
    from `resumed` (a checkpoint's meta) counts from its epoch and step: written at another batch or
    world size, its epochs held other numbers of steps."""
    if max_steps is None or not batch_size:
        return epochs
    from .data import ShardedSampler

    per_rank = len(ShardedSampler(train, world_size, 0))  # what fit() gives each rank per epoch
    per_epoch = max(1, per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size))
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
