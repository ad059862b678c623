"""How a `dtrain` job ends: its final metrics (the last evaluation during training, else one pass over the
validation set now: `final_metrics`), the line that says them, and what it leaves behind (`write_outputs`):
the trained model at ``output`` (written atomically, by one rank) and the StatefulSet's marker,
``checkpoint.dir/COMPLETED``."""

from __future__ import annotations

import math
from pathlib import Path

from .checkpoint import atomic_save
from .config import JobConfig
from .logs import get_logger
from .validation import job_final_metrics, job_results

__all__ = ["final_metrics", "write_outputs"]

log = get_logger("cli")


def final_metrics(cfg: JobConfig, trainer, val, val_data, criterion, batch_size: int) -> dict:
    """The run's last evaluation (with evaluation.every), else one pass over the validation set now."""
    if cfg.evaluation.every is not None:
        return job_results(trainer)
    if not len(val):
        return {}
    # Once, at the end: the same values `every` would give.
    functions, perplexity = job_final_metrics(cfg, val_data, criterion)
    metrics = _validate(trainer, val_data, criterion, batch_size, functions)
    if perplexity and "loss" in metrics:
        metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))
    return metrics


def write_outputs(cfg: JobConfig, trainer, metrics: dict) -> None:
    """Say how the run ended; rank 0 writes the final model (`output`) and the run's COMPLETED marker."""
    state = trainer.strategy.model_state_dict(trainer.model)  # collective: every rank
    # (the evaluation's names, val_*, with or without evaluation.every)
    named = {k if k.startswith("val_") or k in ("time_to_target_s", "target_step") else f"val_{k}": v
             for k, v in metrics.items() if k not in ("loss", "val_loss", "val_samples", "samples")}
    extra = "".join(f", {k} {v:.4g}" for k, v in named.items())
    if "loss" in metrics:
        log.info("dtrain: finished at step %d, validation loss %.4f%s", trainer.step, metrics["loss"], extra)
    else:  # (was "validation loss nan")
        log.info("dtrain: finished at step %d (no validation set: data.val_target, or data.val_fraction > 0 of a "
                 "map-style training set, gives one)", trainer.step)
    # One writer (a parameter server's servers train nothing and hold the same model).
    if trainer.context.is_main and trainer.strategy.trains:
        if cfg.output:
            Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
            try:  # (atomically: a full disk left a truncated model.pt under the final name)
                atomic_save(state, cfg.output)
            except (OSError, RuntimeError) as err:
                cause = " ".join(str(err).split())[:300]
                raise OSError(f"dtrain: writing the trained model to output {cfg.output!r} failed ({cause}; a full "
                              "disk?): nothing was written there, an earlier file stays as it was; the checkpoints "
                              "hold the model too") from err
        if cfg.checkpoint.dir:
            # The StatefulSet entrypoint idles instead of training again when this marker exists.
            Path(cfg.checkpoint.dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.checkpoint.dir) / "COMPLETED").write_text(f"step {trainer.step}\n")


def _validate(trainer, val, criterion, batch_size: int, metrics: dict | None = None) -> dict:
    """`trainer.evaluate` on the validation set; with a pipeline, where the trainer cannot evaluate yet
    (every rank raises alike, at its first batch), the run says so and goes on without."""
    try:
        return trainer.evaluate(val, criterion, batch_size=batch_size, metrics=metrics or None)
    except NotImplementedError as err:
        if trainer.config.get("pipeline_parallel_size", 1) == 1:
            raise
        if trainer.context.is_main:
            log.warning("dtrain: no validation loss: %s", err)
        return {}
