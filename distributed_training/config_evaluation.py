"""The ``evaluation:`` section of the `dtrain` config (`distributed_training.config`).

    evaluation: {every: 200, metrics: [accuracy, top5], best_metric: val_accuracy, target: {val_accuracy: 0.97}}

Its fields; the metrics it may name, and what it needs of the rest of the job, are checked by
`validation.check_job_evaluation` (alone here, with the whole job by `JobConfig`'s validator).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator, model_validator

from .config_fields import PositiveInt, Section

__all__ = ["EvaluationConfig"]


class EvaluationConfig(Section):
    every: Optional[PositiveInt] = None
    """Evaluate on the validation set every this many optimizer steps, and at the end: sharded over the
    data-parallel ranks, every sample counted once (null: only at the end). The validation set is
    data.val_fraction of the training set, or data.val_root (image_folder), or data.val_target /
    data.val_kwargs (your own data)."""
    batch_size: Optional[PositiveInt] = None
    """Samples per evaluation batch on a rank (null: what one training forward takes)."""
    metrics: Optional[list[str]] = None
    """Besides val_loss: any of accuracy, top<k> (e.g. top5: the target among the k highest logits) for
    a classifier (the digits or image presets), perplexity for a GPT (null: accuracy and top5, or
    perplexity; with your own model or data, read from the first validation sample: see
    docs/dtrain_jobs.md)."""
    best_metric: Optional[str] = None
    """Keep the checkpoint with the best value of this evaluated metric (val_loss, val_accuracy,
    val_top<k>, val_perplexity): each evaluation gets a checkpoint; needs checkpoint.dir and every."""
    best_mode: Literal["auto", "min", "max"] = "auto"
    """Whether best_metric's best is its minimum or its maximum (auto: max for accuracies, min otherwise)."""
    target: Optional[dict[str, float]] = None
    """Stop at the first evaluation that reaches this value of one evaluated metric, e.g.
    {val_accuracy: 0.97} (at least it for accuracies, at most for val_loss / val_perplexity); the run's
    results then give time_to_target_s and target_step (time to accuracy). Needs every."""

    @field_validator("metrics", mode="before")
    @classmethod
    def _one_metric(cls, value):  # (``--set evaluation.metrics=accuracy``: one name is that metric)
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _known_metrics(self) -> "EvaluationConfig":
        from .validation import check_job_evaluation

        check_job_evaluation(self)
        return self
