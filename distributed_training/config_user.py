"""The config's fields for the user's own code (see `user_job`): import paths of a model, a dataset,
a collate function and a loss, their keyword arguments, the ``loss`` section, and the rules that
keep them apart from the built-in presets and datasets they replace.

    model:   {target: "my_pkg.models:build", kwargs: {width: 256}}
    data:    {target: "my_pkg.data:Shapes", kwargs: {root: data/}, collate: "my_pkg.data:collate"}
    loss:    {target: "torch.nn:CrossEntropyLoss", kwargs: {label_smoothing: 0.1}}

The ``model`` and ``data`` fields stay in their sections (`config.ModelConfig`, `config.DataConfig`),
typed `ImportPath` and `Kwargs` from here; `check_user_code` is the config's rule between them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Optional

from pydantic import AfterValidator, Field

from .config_fields import ConfigError, Section, given

if TYPE_CHECKING:
    from .config import JobConfig

__all__ = ["ImportPath", "Kwargs", "LossConfig", "check_user_code"]

#: A function or class named by import path: ``package.module:name`` (or ``package.module.name``).
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*[:.][A-Za-z_][\w.]*")


def _import_path(value: str) -> str:
    if not _IMPORT_PATH.fullmatch(value) or ".." in value or value.endswith("."):
        raise ValueError("an import path looks like 'package.module:name'")
    return value


ImportPath = Annotated[str, AfterValidator(_import_path)]
Kwargs = dict[str, Any]


class LossConfig(Section):
    target: Optional[ImportPath] = None
    """Import path of the loss: a function ``loss(outputs, targets)`` (``kwargs`` bound) or a class
    instantiated with ``kwargs`` (``torch.nn:CrossEntropyLoss``); batches are then (inputs, targets).
    Default: cross-entropy for the classifier / digits, else the model returns the loss (each batch is
    the model's input)."""
    kwargs: Kwargs = Field(default_factory=dict)
    """Keyword arguments of ``loss.target``."""


def check_user_code(job: JobConfig) -> None:
    """The user's own model / data (``target`` fields, see `user_job`) replace the built-in fields;
    each ``kwargs`` goes with its ``target`` (called by `JobConfig`'s validator)."""
    m, d = job.model, job.data
    if m.target is not None:
        chosen = [f"model.{f}" for f in ("preset", "n_layer", "n_embd", "dropout", "num_classes", "width",
                                          "zero_init_residual", "channels_last") if given(m, f)]
        if chosen:
            raise ConfigError(f"model.target builds your own model: {', '.join(chosen)} (the built-in presets') "
                              "cannot go with it (pass what your model takes in model.kwargs)")
    elif m.kwargs:
        raise ConfigError("model.kwargs are the arguments of model.target, which is not given")
    if d.target is not None:
        chosen = [f"data.{f}" for f in ("dataset", "block_size") if given(d, f)]
        if chosen:
            raise ConfigError(f"data.target reads your own data: {', '.join(chosen)} (the built-in datasets') "
                              "cannot go with it (pass what your dataset takes in data.kwargs)")
        if (d.val_target is not None or d.val_kwargs is not None) and given(d, "val_fraction"):
            raise ConfigError("data.val_fraction splits the training set, but data.val_target / data.val_kwargs "
                              "give the validation set: keep one of them")
    else:
        stray = [f"data.{f}" for f in ("kwargs", "val_target", "val_kwargs") if getattr(d, f)]
        if stray:
            raise ConfigError(f"{', '.join(stray)} go with data.target (your own dataset), which is not given")
    if d.collate_kwargs and d.collate is None:
        raise ConfigError("data.collate_kwargs are the arguments of data.collate, which is not given")
    if job.loss.kwargs and job.loss.target is None:
        raise ConfigError("loss.kwargs are the arguments of loss.target, which is not given")
    if (d.target is not None or d.collate is not None) and job.training.batch_size == "auto":
        raise ConfigError("training.batch_size 'auto' with data.target / data.collate is not supported yet: give "
                          "a number")
    t = job.training
    if ((m.target is not None or d.target is not None) and t.pipeline_parallel_size > 1
            and t.pipeline_balance == "time" and t.pipeline_split_points is None):
        raise ConfigError("training.pipeline_balance 'time' with model.target / data.target is not supported yet: "
                          "balance by parameters or give training.pipeline_split_points")
