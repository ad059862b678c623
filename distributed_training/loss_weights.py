"""How much of a batch's loss each of its micro-batches stands for.

A batch cut into micro-batches (gradient accumulation, a pipeline's microbatches) must give the gradient
of the loss one process computes on the whole batch. For a criterion that averages over the batch's
rows, a micro-batch's mean loss counts by its share of the rows. But cross-entropy averages over the
targets that are not ignored (`ignore_index`, -100 in torch and Hugging Face: padding, prompt tokens), so
a micro-batch holding more ignored targets must count for less; and a criterion that sums
(``reduction="sum"``) must have its micro-batch sums added as they are. `micro_weights` gives the
weights:

* a loss module whose ``reduction`` is ``"sum"``: 1 for every micro-batch;
* integer targets (class indices): each micro-batch's count of targets other than the criterion's
  ``ignore_index`` (-100 unless the module says otherwise), over the batch's count (tensors on the
  targets' device: nothing waits for the GPU);
* anything else: the share of the rows.

A criterion that is a plain function is taken to reduce by the mean (as `F.cross_entropy`, `F.mse_loss`
do by default); for a sum, pass a loss module (``nn.CrossEntropyLoss(reduction="sum")``).

Without a criterion the model computes its loss itself. A Hugging Face model (a class with a
``loss_function``) fed a dict batch with integer ``labels`` averages over the labels other than -100,
shifted by one for a causal language model (its ``loss_type`` ``"ForCausalLM"``, or none: what its
``loss_function`` then defaults to): `label_count` counts those. A Hugging Face CTC model (``...ForCTC``,
``config.ctc_loss_reduction``) sums over its rows (``"sum"``, its default: `own_loss` stands in for a
summing criterion) or averages over them, each row's loss divided by its label length (``"mean"``: by
rows). Any other model's own loss: by rows.

Across data-parallel replicas, which average their gradients, the same holds: a replica whose batch keeps
fewer targets (or holds fewer rows) must count for less, and a summing criterion's replicas must add up.
`replica_scale` gives the factor (this replica's count x replicas / all replicas' count, one small
all-reduce; the number of replicas for a sum) that makes the average of the replicas' gradients the
gradient of the whole global batch's loss, as one process computes it. A class-weighted cross-entropy
(``weight=``) averages over its kept targets' weights: `counted` counts those. Our GPT computing its own
loss from ``(idx, targets)`` counts its targets other than -100 (`label_count`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["StepWeights", "micro_weights", "counted", "label_count", "own_loss", "replica_scale", "ReplicaScale", "weigh",
           "batch_count", "sums", "classified", "scored_targets",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100  # torch's cross-entropy / NLL default, and Hugging Face's label padding


class StepWeights:
    """A step's weights: each micro-batch's share of the whole batch (`micro_weights`) and, over several
    replicas, this replica's factor (`replica_scale`; its all-reduce starts here, and is waited for by the
    first `backward` weight). `count(i)` gives micro-batch i's count (`counted` / `label_count`), asked
    only where needed (several micro-batches or replicas, or `keep_counts`: then in `counts`, for a
    parameter server's `batch_count`). Collective over `group` when `replicas` > 1."""

    def __init__(self, criterion: Callable | None, targets: Sequence[Any], rows: Sequence[int],
                 count: Callable[[int], Any], *, group=None, replicas: int = 1, device=None,
                 keep_counts: bool = False) -> None:
        needed = len(rows) > 1 or replicas > 1 or keep_counts
        counts = self.counts = [count(i) for i in range(len(rows))] if needed else None
        self.shares = micro_weights(criterion, targets, rows, counts)
        self.scale = replica_scale(criterion, counts, group, replicas, device) if replicas > 1 else None

    def plain(self, i: int) -> bool:
        """Whether micro-batch i's loss goes in as it is (one micro-batch, one replica)."""
        return self.scale is None and isinstance(self.shares[i], float) and self.shares[i] == 1

    def reported(self, loss: torch.Tensor, i: int) -> torch.Tensor:
        """Micro-batch i's part of this replica's batch loss (what a step reports)."""
        return loss if self.plain(i) else weigh(loss, self.shares[i])

    def backward(self, loss: torch.Tensor, i: int) -> torch.Tensor:
        """Micro-batch i's loss as its backward takes it: its share, times this replica's factor."""
        if self.plain(i):
            return loss
        return weigh(loss, self.shares[i] if self.scale is None else self.shares[i] * self.scale.value())


def micro_weights(criterion: Callable | None, targets: Sequence[Any], rows: Sequence[int],
                  counts: Sequence[Any] | None = None) -> list:
    """The weight of each micro-batch's loss (see the module docstring): `targets` are the micro-batches'
    targets, `rows` their row counts; `counts`, what each micro-batch's mean is over where the caller
    knows it (a model's own loss: `label_count`). Floats, or 0-dim tensors for counted targets."""
    if _setting(criterion, "reduction", "mean") == "sum":
        return [1.0] * len(rows)
    if not sum(rows):
        # An empty batch (a replica with no rows this step, beside replicas with some): its mean is over
        # nothing (nan) and it stands for nothing: weight 0, as `weigh` gives a micro-batch of no targets.
        return [0.0] * len(rows)
    if len(rows) == 1 and counts is None:
        counts = list(rows)
    elif counts is None:
        counts = [counted(criterion, t, n) for t, n in zip(targets, rows)]
    if all(isinstance(c, int) for c in counts):
        return [n / sum(rows) for n in rows]
    # (every micro-batch's targets are class indices: `_split` cuts them alike)
    # (a sum of class weights may be below 1: divide by it as it is; 0, every target ignored, counts 0)
    whole = torch.stack([torch.as_tensor(c) for c in counts]).sum().double()
    whole = torch.where(whole > 0, whole, torch.ones_like(whole))
    return [c / whole for c in counts]


class ReplicaScale:
    """The factor of this replica's loss (see the module docstring), its all-reduce started at once and
    waited for by the first `value()`: the forward that comes before the first backward overlaps it."""

    def __init__(self, counts: Sequence[Any], group, replicas: int, device: torch.device) -> None:
        self.mine = torch.stack([torch.as_tensor(c, device=device) for c in counts]).sum()
        self.total = self.mine.clone()
        self.replicas = replicas
        self._work = dist.all_reduce(self.total, group=group, async_op=True)
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._work.wait()
            total = torch.where(self.total > 0, self.total, torch.ones_like(self.total)).double()  # sums of class
            self._value = torch.where(self.total > 0, self.mine * self.replicas / total,   # weights may be < 1
                                      torch.zeros((), dtype=torch.float64, device=self.mine.device))
        return self._value


class _Constant:
    """A summing criterion's factor: the replicas' gradients are averaged, the sums must add up."""

    def __init__(self, value: float) -> None:
        self._value = value

    def value(self) -> float:
        return self._value


def replica_scale(criterion: Callable | None, counts: Sequence[Any], group, replicas: int,
                  device: torch.device) -> ReplicaScale | _Constant | None:
    """The factor of this replica's loss, or None for one replica: the number of replicas for a criterion
    that sums (no collective), else a `ReplicaScale` over `counts` (kept targets, or rows: replicas of
    uneven batches too). Collective over `group`: every replica calls it, with counts of the same kind."""
    if replicas == 1:
        return None
    if _setting(criterion, "reduction", "mean") == "sum":
        return _Constant(float(replicas))
    return ReplicaScale(counts, group, replicas, device)


def batch_count(criterion: Callable | None, counts: Sequence[Any]) -> float | None:
    """What a replica's whole batch counts (the sum of its micro-batches' `counts`), by which a parameter
    server's ``sync`` update weighs its gradient; None for a summing criterion (its replicas add up, which
    a weighted mean cannot express)."""
    if _setting(criterion, "reduction", "mean") == "sum":
        return None
    return float(sum(float(c) for c in counts))


def weigh(loss: torch.Tensor, weight: Any) -> torch.Tensor:
    """`loss` times its `weight` (from `micro_weights` or `counted`). A micro-batch whose targets are all
    ignored has a mean over nothing (0 / 0 = nan) and weight 0: it counts 0, as it adds nothing to the
    whole batch's mean (its gradient is zero either way; the nan would only poison the reported loss).
    Decided on the device: nothing waits for the GPU."""
    if isinstance(weight, torch.Tensor):
        # (computed in float64: a float64 loss keeps its precision; others are weighed at float32 or wider)
        weight = weight.to(torch.promote_types(loss.dtype, torch.float32))
        return torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
    if weight == 0:
        return torch.zeros_like(loss)
    return loss * weight


def _base_model(model: Any) -> Any:
    """Under `torch.compile`'s module (``_orig_mod``) or a PEFT wrapper (``get_base_model()``)."""
    model = getattr(model, "_orig_mod", model)
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def _ctc_reduction(model: Any) -> str | None:
    """A Hugging Face CTC model's loss reduction (``config.ctc_loss_reduction``), else None."""
    if not type(model).__name__.endswith("ForCTC"):
        return None
    return getattr(getattr(model, "config", None), "ctc_loss_reduction", None)


class _SummedOwnLoss:
    """Stands in for the criterion of a model whose own loss sums over the batch: read as a loss module's
    ``reduction``."""

    reduction = "sum"


def own_loss(model: Any) -> Any:
    """What weighs `model`'s own loss as a criterion would (`micro_weights`, `replica_scale`, `sums`): a
    stand-in with ``reduction="sum"`` where it sums (a Hugging Face CTC model's default), else None (a
    mean, counted by `label_count`)."""
    return _SummedOwnLoss() if _ctc_reduction(_base_model(model)) == "sum" else None


def label_count(model: Any, batch: Any, rows: int):
    """What a model computing its own loss averages it over (see the module docstring): a Hugging Face
    model's labels other than -100, our GPT's targets other than -100 (0-dim tensors), else `rows`."""
    from .models.gpt import GPT

    model = _base_model(model)
    if _ctc_reduction(model) is not None:  # (a mean over rows, each by its label length; or a sum: `own_loss`)
        return rows
    if isinstance(model, GPT) and isinstance(batch, (tuple, list)) and len(batch) == 2:
        return counted(None, batch[1], rows, own=True)  # GPT(idx, targets): targets already shifted
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not _class_indices(labels) or not hasattr(type(model), "loss_function"):
        return rows
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    if (labels.dim() >= 2 and not encoder_decoder
            and getattr(model, "loss_type", None) in (None, "ForCausalLM", "ForConditionalGeneration")):
        labels = labels[..., 1:]  # a causal LM predicts token t + 1 from the tokens up to t
    return (labels != IGNORE_INDEX).sum()


def counted(criterion: Callable | None, targets: Any, rows: int, own: bool = False):
    """What `criterion`'s mean over one batch is taken over: for class-index targets, those other than
    ``ignore_index``, each by its class weight where the criterion has one (``weight=``; a 0-dim tensor),
    else `rows` (`evaluate` weighs each batch's loss by it). `own`: the model's own cross-entropy."""
    if (criterion is not None or own) and _class_indices(targets) and _setting(criterion, "reduction", "mean") == "mean":
        kept = targets != _setting(criterion, "ignore_index", IGNORE_INDEX)
        weight = _setting(criterion, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight[targets[kept]].sum()
        return kept.sum()
    return rows


def scored_targets(criterion: Callable | None, targets: Any) -> torch.Tensor | None:
    """Which of a batch's class targets (class indices: one per sample, or one per position of a sequence)
    an accuracy scores: those other than `criterion`'s ``ignore_index`` (-100 unless it says otherwise);
    None for other targets."""
    if isinstance(targets, torch.Tensor) and _class_indices(targets) and targets.dim() >= 1:
        return targets != _setting(criterion, "ignore_index", IGNORE_INDEX)
    return None


def classified(criterion: Callable | None, targets: Any, rows: int):
    """How many of a batch's targets an accuracy is over (`scored_targets`), else `rows`."""
    scored = scored_targets(criterion, targets)
    return rows if scored is None else scored.sum()


def sums(criterion: Any) -> bool:
    """Whether `criterion` sums over its batch (a loss module, or a partial, with ``reduction="sum"``)."""
    return _setting(criterion, "reduction", "mean") == "sum"


def _setting(criterion: Any, name: str, default: Any) -> Any:
    """A loss module's attribute, or a `functools.partial`'s keyword (``partial(F.cross_entropy, ...)``)."""
    if isinstance(criterion, functools.partial):
        return criterion.keywords.get(name, default)
    return getattr(criterion, name, default)


def _class_indices(targets: Any) -> bool:
    return (isinstance(targets, torch.Tensor) and not targets.is_floating_point() and not targets.is_complex()
            and targets.dtype != torch.bool)
