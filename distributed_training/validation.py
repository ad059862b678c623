"""Evaluation during training: ``fit(..., eval_dataset=..., eval_every=N)``.

Every `eval_every` optimizer steps, and once more at the end of `fit`, the trainer evaluates the model
on the validation set with `DistributedTrainer.evaluate`'s machinery: each data-parallel replica
takes its exact shard of the set (uneven shards: no sample dropped, none counted twice), sums its
loss and its counts in float64, and one all-reduce adds the replicas' sums. What comes out:

    val_loss        the mean of the criterion over every validation sample
    val_accuracy    the share of samples whose highest logit is the target's   (classifiers)
    val_top<k>      the share whose target is among the k highest logits       (classifiers)
    val_perplexity  exp(val_loss), for a loss that is a mean cross-entropy      (language models)
    val_samples     how many samples were evaluated (the whole set, once)

Accuracies are counts divided by the number of samples (`correct_count`, `TopKCount`: summed, not
averaged per batch), so they are exact; a target the criterion ignores (its ``ignore_index``, -100 by
default) counts in neither the hits nor the samples. The metrics go to the logger (rank 0), to each rank's
monitor directory (``val/*``: that rank's own shard, in TensorBoard and ``eval.jsonl``) and to the
monitor's cluster view (``cluster/val_*``: the whole set's, written by rank 0), and into the step's
metrics that the checkpoints record: ``best_metric="val_accuracy"`` (``best_mode="max"``) keeps the
checkpoint of the best evaluation, which gets a checkpoint of its own when it falls between
`checkpoint_every` steps.

Evaluation leaves training as it was: the RNG streams are restored and every module's train/eval
mode too (see `DistributedTrainer.evaluate`), and the time it takes is not counted in the next
step's time. Sharded models (ZeRO-3 / FSDP) gather their parameters as for a forward, every rank in
lockstep; a pipeline evaluates through its stages.
"""

from __future__ import annotations

import collections.abc
import math
import re
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .logs import get_logger

__all__ = ["PeriodicEvaluation", "TopKCount", "auto_metrics", "correct_count", "metric_functions"]

log = get_logger()

#: The metric names `fit(eval_metrics=...)` and ``evaluation.metrics`` take (``top<k>``: any k >= 1).
METRIC_NAMES = ("accuracy", "top<k>", "perplexity")
_TOP = re.compile(r"top([1-9][0-9]*)")


def _logits(outputs: Any) -> Any:
    """A classifier's logits: the outputs themselves, or their ``"logits"`` entry (a dict) or ``.logits``
    attribute (a Hugging Face output), as a criterion reading ``out["logits"]`` takes them."""
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    return logits if torch.is_tensor(logits) else outputs


def _per_token(outputs: Any, targets: Any) -> tuple[Any, Any]:
    """Logits (..., classes) with a class target per position (...) (a language model's (batch, sequence,
    vocabulary) and (batch, sequence)) as rows: (positions, classes) and (positions,)."""
    if (torch.is_tensor(outputs) and torch.is_tensor(targets) and outputs.dim() >= 3
            and outputs.dim() == targets.dim() + 1 and outputs.shape[:-1] == targets.shape):
        return outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
    return outputs, targets


def _check_classifier_shapes(outputs: torch.Tensor, targets: torch.Tensor, name: str) -> None:
    if not (torch.is_tensor(outputs) and torch.is_tensor(targets) and outputs.dim() == 2 and targets.dim() == 1
            and not targets.is_floating_point()):
        got = (f"outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} ({targets.dtype})"
               if torch.is_tensor(outputs) and torch.is_tensor(targets) else
               f"{type(outputs).__name__} and {type(targets).__name__}")
        raise ValueError(f"eval metric {name!r} is for classifiers: it needs logits of shape (batch, classes) and "
                         f"integer class targets of shape (batch,) (or per position: (batch, sequence, classes) and "
                         f"(batch, sequence)), got {got}")


def correct_count(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many samples of the batch (or positions, for per-token targets) have their highest logit at the
    target class (a count, summed)."""
    outputs, targets = _per_token(_logits(outputs), targets)
    _check_classifier_shapes(outputs, targets, "accuracy")
    return (outputs.argmax(dim=-1) == targets).sum()


correct_count.reduction = "sum"  # type: ignore[attr-defined]
correct_count.over_targets = True  # type: ignore[attr-defined]  # (not the rows: those ignored do not count)


class TopKCount:
    """How many samples of the batch have their target among the `k` highest logits (a count, summed).
    With `k` at least the number of classes every sample counts (said once, unless `eval_metrics="auto"`
    chose it: `quiet`)."""

    reduction = "sum"
    over_targets = True  # divided by the targets that count, as `correct_count`

    def __init__(self, k: int, quiet: bool = False) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"top-k accuracy needs an integer k >= 1, got {k!r}")
        self.k, self._said = k, quiet

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        outputs, targets = _per_token(_logits(outputs), targets)
        _check_classifier_shapes(outputs, targets, f"top{self.k}")
        if self.k >= outputs.shape[-1] and not self._said:
            self._said = True
            warnings.warn(f"top{self.k} accuracy over {outputs.shape[-1]} classes counts every sample (always 1): "
                          f"k should be below the number of classes", stacklevel=2)
        top = outputs.topk(min(self.k, outputs.shape[-1]), dim=-1).indices  # (B, k)
        return (top == targets.unsqueeze(-1)).any(dim=-1).sum()


def metric_functions(names: Sequence[str], *, parameter: str = "eval_metrics") -> tuple[dict[str, Callable], bool]:
    """(name -> per-batch function for `evaluate`, whether perplexity is asked for) for metric names;
    an unknown name is an error naming `parameter`."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ValueError(f"{parameter} must be a list of metric names ({', '.join(METRIC_NAMES)}) or 'auto', "
                         f"got {names!r}")
    functions: dict[str, Callable] = {}
    perplexity = False
    for name in names:
        top = _TOP.fullmatch(name) if isinstance(name, str) else None
        if name == "accuracy":
            functions["accuracy"] = correct_count
        elif top is not None:
            functions[name] = TopKCount(int(top.group(1)))
        elif name == "perplexity":
            perplexity = True
        else:
            raise ValueError(f"{parameter}: unknown metric {name!r} (known: {', '.join(METRIC_NAMES)}; the loss is "
                             "always evaluated)")
    return functions, perplexity


def perplexity_of(loss: float) -> float:
    """exp(loss), inf past float64's range, NaN for a NaN loss."""
    return math.exp(loss) if loss < 700 else (math.inf if loss >= 700 else math.nan)


def resolve_metrics(metrics: str | Sequence[str] | Mapping[str, Callable] | None, dataset: Any,
                    criterion: Callable | None, *, parameter: str = "eval_metrics",
                    ) -> tuple[tuple[str, ...], dict[str, Callable], bool]:
    """(names, name -> per-batch function, whether perplexity is asked for) of what `fit`'s
    ``eval_metrics`` or `evaluate`'s ``metrics`` asks for: metric names (one as a string), ``"auto"``
    (`auto_metrics`, read from `dataset`), or functions by name."""
    if metrics is None:
        return (), {}, False
    if isinstance(metrics, Mapping):
        return tuple(metrics), dict(metrics), False
    names = (auto_metrics(dataset, criterion) if metrics == "auto" else
             (metrics,) if isinstance(metrics, str) else tuple(metrics))
    functions, perplexity = metric_functions(list(names), parameter=parameter)
    if metrics == "auto":
        functions = _quiet_top_k(functions)
    check_classifier_targets(dataset, names, parameter=parameter)
    return names, functions, perplexity


def auto_metrics(dataset: Any, criterion: Callable | None) -> tuple[str, ...]:
    """What ``eval_metrics="auto"`` evaluates, read from the first sample: a criterion with an integer
    class target per sample is a classifier (accuracy and top-5); a model that computes its own loss,
    or integer targets per position (token ids), a language model (perplexity); anything else the
    loss alone."""
    if criterion is None:
        return ("perplexity",)
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - an unusual dataset: the loss alone, which always works
        return ()
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        return ()
    target = sample[1]
    if isinstance(target, int) and not isinstance(target, bool):
        return ("accuracy", "top5")
    if torch.is_tensor(target) and not target.is_floating_point() and target.dtype != torch.bool:
        return ("accuracy", "top5") if target.dim() == 0 else ("perplexity",)
    return ()


def check_classifier_targets(dataset: Any, names: Sequence[str], *, parameter: str = "eval_metrics") -> None:
    """Refuse classifier metrics (``accuracy``, ``top<k>``) for a validation set whose first sample's target is
    no class index (a float: a regression), before training rather than at the first evaluation. Integer
    targets per position (a language model's token ids) pass: the metric scores each position. Samples that
    are not an (inputs, target) pair (a collate function's to shape) pass."""
    wanted = [n for n in names if n == "accuracy" or n.startswith("top")]
    if not wanted:
        return
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - read at the first evaluation instead
        return
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        return
    target = sample[1]
    if isinstance(target, float):
        got = "a float"
    elif torch.is_tensor(target) and target.is_floating_point():
        got = f"a {str(target.dtype).removeprefix('torch.')} tensor of shape {tuple(target.shape)}"
    else:
        return
    raise ValueError(f"{parameter}: {wanted[0]} is for classifiers (integer classes: one per sample or per position), "
                     f"but the validation "
                     f"set's first target is {got}: leave it out (the loss is always evaluated)")


class PeriodicEvaluation:
    """What `fit` evaluates, how often, and what it does with the results (log, monitor, keep-best).

    Args:
        dataset: the validation set: a map-style `Dataset` (or a `DataLoader` over one, whose batch
            size and collate function are used).
        every: evaluate after every this many optimizer steps (None: only at the end of `fit`).
        batch_size: samples per evaluation batch on a replica.
        metrics: metric names (see `METRIC_NAMES`), ``"auto"`` (see `auto_metrics`), or a mapping of
            name -> ``fn(outputs, targets)`` as `evaluate` takes.
        criterion: the training criterion (None: the model computes its loss).
        target: ``{name: value}``, one of the evaluated values (``val_accuracy``, ``val_loss``, ...): the
            first evaluation that reaches it (at least `value` for accuracies, at most for losses and
            perplexity) ends training and is recorded in `reached` (its step, value and the seconds of
            training since `start`): time to accuracy.
    """

    def __init__(self, dataset: Dataset | DataLoader, every: int | None, batch_size: int | None,
                 metrics: str | Sequence[str] | Mapping[str, Callable], criterion: Callable | None,
                 target: Mapping[str, float] | None = None) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"eval_every must be a positive integer (optimizer steps) or None, got {every!r}")
        from .evaluation import batches_as_given

        inner = dataset.dataset if isinstance(dataset, DataLoader) else dataset
        given = batches_as_given(dataset)  # each rank's own batches, as `evaluate` takes them
        if not given and (isinstance(inner, IterableDataset) or not isinstance(inner, Dataset)):
            raise ValueError("eval_dataset must be a map-style Dataset (or a DataLoader over one), which each "
                             "replica evaluates an exact shard of, or an iterable of this rank's batches (a DataLoader "
                             f"over an IterableDataset); got {type(inner).__name__}")
        if given and every is not None and isinstance(dataset, collections.abc.Iterator):
            raise ValueError(f"eval_dataset is an iterator ({type(dataset).__name__}), used up by its first "
                             f"evaluation, but eval_every={every} evaluates again: pass something iter() gives "
                             "again each time (a DataLoader over an IterableDataset, a list of samples)")
        if given:
            batch_size = None  # (not used: each item is a batch)
        elif isinstance(dataset, DataLoader):
            from .evaluation import _evaluated_samples

            batch_size = dataset.batch_size
            _evaluated_samples(dataset, inner, batch_size or 1)  # its sampler: refused before training, not at the first evaluation
        if not given and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"eval_batch_size must be a positive integer, got {batch_size!r}")
        self.dataset, self.every, self.batch_size, self.criterion = dataset, every, batch_size, criterion
        self.names, self.functions, self.perplexity = resolve_metrics(metrics, inner, criterion)
        if self.functions and criterion is None:
            raise ValueError(f"eval_metrics {list(self.functions)} are computed from (outputs, targets): they need "
                             "a criterion (a model that computes its own loss gets val_loss and val_perplexity)")
        self.history: list[dict[str, float]] = []  # every evaluation of the run: {"step", "seconds", "val_*"}
        self.last_step: int | None = None
        self.target = self._check_target(target)
        self.reached: dict[str, float] | None = None  # the evaluation that reached `target`
        self._started = time.perf_counter()

    def _check_target(self, target: Mapping[str, float] | None) -> tuple[str, float, bool] | None:
        """(name, value, higher is better) of `target`, checked against what an evaluation gives."""
        if target is None:
            return None
        if not isinstance(target, Mapping) or len(target) != 1:
            raise ValueError(f"eval_target must be one {{metric: value}}, e.g. {{'val_accuracy': 0.97}}, got {target!r}")
        (name, value), = target.items()
        keys = [k for k in self.keys if k != "val_samples"]
        if name not in keys:
            raise ValueError(f"eval_target names {name!r}, which the evaluation does not give (it gives "
                             f"{', '.join(keys)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"eval_target's value for {name} must be a finite number, got {value!r}")
        if self.every is None:
            raise ValueError("eval_target needs eval_every: the target is checked at each evaluation during training")
        return name, float(value), name.startswith(("val_accuracy", "val_top"))

    def start(self) -> None:
        """Training starts now: what `history`'s and `reached`'s seconds count from."""
        self._started = time.perf_counter()

    @property
    def keys(self) -> list[str]:
        """The names of the values an evaluation gives (what ``best_metric`` may name)."""
        return (["val_loss"] + [f"val_{name}" for name in self.functions]
                + (["val_perplexity"] if self.perplexity else []) + ["val_samples"])

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0 and step != self.last_step

    def feeds(self, best_metric: str | None) -> bool:
        """Whether the checkpoints' keep-best metric is one of ours (then an evaluation gets a checkpoint)."""
        return best_metric is not None and best_metric in self.keys

    def run(self, trainer: Any, step: int) -> dict[str, float]:
        """Evaluate now (every rank: collective), log and record it; return the whole set's values."""
        started = time.perf_counter()
        names, local, total = trainer._evaluation_sums(self.dataset, self.criterion, batch_size=self.batch_size,
                                                       metrics=self.functions or None)
        values = self._values(names, total.tolist())
        mine = self._values(names, local.tolist())
        seconds = time.perf_counter() - started
        elapsed = time.perf_counter() - self._started
        self.history.append({"step": step, "seconds": elapsed, **values})
        self.last_step = step
        trainer.monitor.record_eval(step, {k.removeprefix("val_"): v for k, v in mine.items()},
                                    values, seconds=seconds)
        if trainer.context.is_main:
            shown = " | ".join(f"{k} {v:.6g}" for k, v in values.items() if k != "val_samples")
            log.info("step %d | %s (%d samples, %.2f s)", step, shown, int(values["val_samples"]), seconds)
        if self.target is not None and self.reached is None:
            name, goal, higher = self.target
            value = values[name]
            if value >= goal if higher else value <= goal:  # the same on every rank: the values are global
                self.reached = {"step": step, "metric": name, "value": value, "target": goal, "seconds": elapsed}
                if trainer.context.is_main:
                    log.info("step %d | reached the target %s %s %g (%.6g) after %.2f s of training: stopping", step,
                             name, ">=" if higher else "<=", goal, value, elapsed)
        return values

    def _values(self, names: list[str], sums: list[float]) -> dict[str, float]:
        count = sums[-1]
        values = {f"val_{name}": (sums[k] / count if count else math.nan) for k, name in enumerate(names)}
        if self.perplexity:
            loss = values["val_loss"]
            values["val_perplexity"] = perplexity_of(loss)
        values["val_samples"] = count
        return values


# ------------------------------------------------------------------ dtrain's `evaluation:` section
def _user_code(job: Any) -> bool:
    """Whether the job trains the user's own model or data (``model.target`` / ``data.target``)."""
    return getattr(job.model, "target", None) is not None or getattr(job.data, "target", None) is not None


def _job_metric_names(section: Any, job: Any) -> list[str] | str:
    """The metrics a dtrain job evaluates: the section's, or its model's defaults ("auto" for the
    user's own model or data: read from the first validation sample, see `auto_metrics`)."""
    if section.metrics is not None:
        return list(section.metrics)
    if _user_code(job):
        return "auto"
    classifier = job.model.preset == "classifier" or job.data.dataset == "image_folder"
    # (a classifier's defaults as "auto" chooses them: top5 over 5 classes or fewer, always 1, not warned about)
    return "auto" if classifier else ["perplexity"]


def check_job_evaluation(section: Any, job: Any = None) -> None:
    """The ``evaluation`` section's rules (`config.EvaluationConfig`): alone (`job` None) and with the
    rest of the job; each error names the field to change."""
    from .config import ConfigError

    if section.metrics is not None:
        try:
            metric_functions(section.metrics, parameter="evaluation.metrics")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if job is None:
        return
    user = _user_code(job)
    images = job.data.dataset == "image_folder"
    if section.every is not None and job.data.val_fraction == 0 and not user and not (images and job.data.val_root):
        raise ConfigError("evaluation.every needs a validation set: set data.val_fraction > 0"
                          + (" or data.val_root" if images else ""))
    names = _job_metric_names(section, job)
    if not user and job.model.preset != "classifier" and not images:
        wrong = [n for n in names if n != "perplexity"]
        if wrong:
            raise ConfigError(f"evaluation.metrics: {wrong[0]} is for classifiers (model.preset classifier); a GPT "
                              "is evaluated by val_loss and perplexity")
    if not user and (job.model.preset == "classifier" or images) and "perplexity" in names:
        raise ConfigError("evaluation.metrics: perplexity is for language models (a GPT preset); a classifier is "
                          "evaluated by val_loss, accuracy and top<k>")
    keys = ["val_loss"] + [f"val_{n}" for n in (names if names != "auto" else ("accuracy", "top<k>", "perplexity"))]

    def known(name: str) -> bool:
        return name in keys or names == "auto" and name.startswith("val_top") and _TOP.fullmatch(name[4:]) is not None

    if section.target is not None:
        if len(section.target) != 1:
            raise ConfigError(f"evaluation.target must be one metric and its value, e.g. {{val_accuracy: 0.97}}, got "
                              f"{section.target!r}")
        (name, value), = section.target.items()
        if not known(name):
            raise ConfigError(f"evaluation.target must name one of what the job evaluates ({', '.join(keys)}), got "
                              f"{name!r}")
        if not math.isfinite(value):
            raise ConfigError(f"evaluation.target's value for {name} must be a finite number, got {value!r}")
        if section.every is None:
            raise ConfigError("evaluation.target needs evaluation.every (the evaluations that check it)")
    if section.best_metric is not None:
        if not known(section.best_metric):
            raise ConfigError(f"evaluation.best_metric must be one of what the job evaluates ({', '.join(keys)}), "
                              f"got {section.best_metric!r}")
        if job.checkpoint.dir is None:
            raise ConfigError("evaluation.best_metric keeps the best checkpoint: it needs checkpoint.dir")
        if section.every is None:
            raise ConfigError("evaluation.best_metric needs evaluation.every (the evaluations it chooses from)")


def job_best_checkpoint(job: Any) -> dict[str, str]:
    """The trainer's keep-best arguments from ``evaluation.best_metric`` / ``best_mode`` (none: {})."""
    section = job.evaluation
    if section.best_metric is None:
        return {}
    from .checkpoint import best_direction

    mode = section.best_mode
    if mode == "auto":
        mode = best_direction(section.best_metric)
    return {"best_metric": section.best_metric, "best_mode": mode}


def job_fit_evaluation(job: Any, val: Dataset) -> dict[str, Any]:
    """`fit`'s evaluation arguments from the ``evaluation`` section (no ``every``: {}, dtrain evaluates
    once at the end as before)."""
    section = job.evaluation
    if section.every is None:
        return {}
    return {"eval_dataset": val, "eval_every": section.every, "eval_batch_size": section.batch_size,
            "eval_metrics": _job_metric_names(section, job), "eval_target": section.target}


def job_final_metrics(job: Any, val: Any, criterion: Callable | None) -> tuple[dict[str, Callable], bool]:
    """Without ``evaluation.every`` dtrain evaluates once, at the end: the job's metrics for that pass
    (`evaluate`'s functions, and whether to add perplexity), as ``every`` would have evaluated them."""
    names = _job_metric_names(job.evaluation, job)
    auto = names == "auto"
    if auto:
        inner = getattr(val, "dataset", val)
        names = auto_metrics(inner, criterion) if hasattr(inner, "__getitem__") else ()
    functions, perplexity = metric_functions(list(names), parameter="evaluation.metrics")
    return (_quiet_top_k(functions) if auto else functions), perplexity


def _quiet_top_k(functions: dict[str, Callable]) -> dict[str, Callable]:
    """Top-k chosen by "auto": k at or above the number of classes is 1 by definition, not the user's mistake."""
    return {k: TopKCount(f.k, quiet=True) if isinstance(f, TopKCount) else f for k, f in functions.items()}


def job_results(trainer: Any) -> dict[str, float]:
    """The last evaluation's values, as dtrain returns them (``loss``: the validation loss)."""
    evaluation = trainer.evaluation
    if evaluation is None or not evaluation.history:
        return {}
    last = {k: v for k, v in evaluation.history[-1].items() if k not in ("step", "seconds")}
    results = {"loss": last["val_loss"], **last}
    if evaluation.reached is not None:  # evaluation.target: time to accuracy
        results.update(time_to_target_s=evaluation.reached["seconds"], target_step=evaluation.reached["step"])
    return results
