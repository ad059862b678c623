"""The loss of a vocabulary-parallel output head (docs/tensor_parallel.md).

A ``"vocab"`` output head (`apply_plan`) leaves each rank its columns of the logits; its
`VocabParallelLoss` (the cross-entropy that never gathers them, `vocab_parallel_cross_entropy`) rides
on the head. `parallel_loss(model)` finds it (our GPT's ``forward(idx, targets)`` uses it), and
`parallel_loss(model, criterion)` / `VocabParallelLoss.with_options_of` take a user's cross-entropy
criterion's options; any other criterion cannot read a part of the logits (an error naming the plan).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .layers import vocab_parallel_cross_entropy

__all__ = ["VocabParallelLoss", "parallel_loss", "is_cross_entropy", "unsupported_loss_message"]

_LOSS = "_dt_parallel_loss"  # on a vocabulary-parallel output head: its VocabParallelLoss


@dataclasses.dataclass(frozen=True)
class VocabParallelLoss:
    """The cross-entropy of a vocabulary-parallel head: ``loss(local_logits, targets)``, logits
    (..., vocab / T) holding vocabulary ids ``vocab_start ...`` of this rank, targets (...) the full ids.

    Attributes:
        group: the tensor group the head is split over.
        vocab_start: the first vocabulary id of this rank's columns.
        ignore_index: targets equal to it count for nothing (as `F.cross_entropy`).
        reduction: ``"mean"`` (over the targets not ignored), ``"sum"`` or ``"none"``.
        label_smoothing: as `F.cross_entropy`'s.
    """

    group: Any
    vocab_start: int
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0

    def __call__(self, local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, targets, self.group, vocab_start=self.vocab_start,
                                            ignore_index=self.ignore_index, reduction=self.reduction,
                                            label_smoothing=self.label_smoothing)

    def __deepcopy__(self, memo: dict) -> "VocabParallelLoss":
        return self  # immutable, and a process group cannot be copied

    def with_options_of(self, criterion: Callable) -> "VocabParallelLoss":
        """This loss with `criterion`'s ``ignore_index``, ``reduction`` and ``label_smoothing``; a
        criterion that is not a plain cross-entropy (`is_cross_entropy`) cannot take split logits:
        ValueError (`unsupported_loss_message`)."""
        options = _cross_entropy_options(criterion)
        if options is None:
            raise ValueError(unsupported_loss_message(criterion))
        return dataclasses.replace(self, **options)


def parallel_loss(model: nn.Module, criterion: Callable | None = None) -> VocabParallelLoss | None:
    """The loss of `model`'s vocabulary-parallel output head, or None when it has none.

    With a `criterion`, the loss keeps its ``ignore_index``, ``reduction`` and ``label_smoothing``; a
    criterion that is not a plain cross-entropy (`is_cross_entropy`) cannot take split logits:
    ValueError (`unsupported_loss_message`).
    """
    # A plain loop (no comprehension): our GPT calls this in forward, which torch.compile traces whole.
    loss = None
    for module in model.modules():
        found = getattr(module, _LOSS, None)
        if found is not None and loss is not None and found is not loss:
            raise ValueError("the model has several vocabulary-parallel output heads ('vocab' style on an "
                             "nn.Linear in tensor_parallel_plan); a loss can be found for one only")
        loss = found if found is not None else loss
    if loss is None or criterion is None:
        return loss
    return loss.with_options_of(criterion)


def is_cross_entropy(criterion: Callable) -> bool:
    """Whether `criterion` is a cross-entropy that the vocabulary-parallel loss computes equally:
    `F.cross_entropy` (or a `functools.partial` of it setting only ``ignore_index`` / ``reduction`` /
    ``label_smoothing``), or an `nn.CrossEntropyLoss` without class weights."""
    return _cross_entropy_options(criterion) is not None


def unsupported_loss_message(criterion: Callable) -> str:
    """The ValueError message for a `criterion` that cannot take a vocabulary-split head's logits."""
    name = getattr(criterion, "__qualname__", None) or repr(criterion)
    if isinstance(criterion, nn.CrossEntropyLoss) and criterion.weight is not None:
        return (f"tensor_parallel_plan splits the output head by vocabulary ('vocab'): its logits hold this rank's "
                f"columns only, and the vocabulary-parallel cross-entropy it needs takes no class weights, but the "
                f"criterion {name} has weight= (ignore_index, reduction and label_smoothing are kept). Drop the "
                f"weights, or give the output head (and the embedding tied to it) another style than 'vocab'")
    return (f"tensor_parallel_plan splits the output head by vocabulary ('vocab'): its logits hold this rank's "
            f"columns only, so the loss must be the vocabulary-parallel cross-entropy, but the criterion {name} "
            f"is not F.cross_entropy or nn.CrossEntropyLoss (without class weights; ignore_index, reduction and "
            f"label_smoothing are kept). Use one of those, or give the output head (and the embedding tied to "
            f"it) another style than 'vocab'")


def _cross_entropy_options(criterion: Callable) -> dict | None:
    """The `VocabParallelLoss` fields `criterion` sets (``{}`` for plain `F.cross_entropy`), or None
    when it is not a cross-entropy the vocabulary-parallel loss computes equally."""
    if criterion is F.cross_entropy:
        return {}
    if isinstance(criterion, functools.partial) and criterion.func is F.cross_entropy and not criterion.args:
        if set(criterion.keywords) <= {"ignore_index", "reduction", "label_smoothing"}:
            return dict(criterion.keywords)
        return None
    if isinstance(criterion, nn.CrossEntropyLoss):
        if criterion.weight is not None:
            return None
        return {"ignore_index": criterion.ignore_index, "reduction": criterion.reduction,
                "label_smoothing": criterion.label_smoothing}
    return None
