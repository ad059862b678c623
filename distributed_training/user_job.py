"""The user's own model, data, collate function and loss in a `dtrain` job, named by import path.

    model:   {target: "my_pkg.models:build", kwargs: {width: 256}}
    data:    {target: "my_pkg.data:Shapes", kwargs: {root: data/}, val_kwargs: {root: data/, split: val},
              collate: "my_pkg.data:collate"}
    loss:    {target: "torch.nn:CrossEntropyLoss", kwargs: {label_smoothing: 0.1}}

An import path is ``package.module:name`` (or ``package.module.name``; after the colon, dots walk
attributes: ``module:Class.build``). The directory of the config file and the working directory are
importable, so a user's ``my_pkg/`` next to the YAML needs no installation.

* ``model.target`` is called with ``model.kwargs`` and must return an `nn.Module`. It runs after
  ``torch.manual_seed(training.seed)``, so every rank builds the same initial weights.
* ``data.target`` is called with ``data.kwargs`` and returns the training set: a map-style dataset
  (``__getitem__`` and ``__len__``; sharded by `ShardedSampler`, reshuffled every epoch, split by
  ``data.val_fraction`` unless a validation set is given) or an iterable one (anything with
  ``__iter__``; read in order, sample k going to data-parallel replica ``k % W``, unless
  ``data.shard_iterable`` is false and the dataset shards itself). ``data.val_target`` (default: the
  same factory when ``data.val_kwargs`` is given) with ``data.val_kwargs`` builds the validation set.
* ``data.collate`` and ``loss.target``: a function is used as given (with its ``kwargs`` bound by
  `functools.partial`), a class is instantiated with them.
* Without ``loss.target``: cross-entropy for the built-in classifier or digits data, else none (the
  model returns the loss, `batches.model_loss`): each batch is then the model's input.

Every failure says the field, the import path and the cause (no such module, no such attribute,
the call raised, the wrong kind of result) as a `UserCodeError`, which `dtrain` reports once like
any invalid config. Every rank imports and calls the same code, so every rank fails alike before
the process group is used.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import sys
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .config import ConfigError, JobConfig
from .data import MapDataset, map_style

__all__ = ["UserCodeError", "ShardedIterable", "add_import_dirs", "import_target", "uses_user_code", "build",
           "train_data", "val_data"]


class UserCodeError(ConfigError):
    """Code a config field names could not be imported, or its call failed; the message names the field."""


# ------------------------------------------------------------------ import paths
def add_import_dirs(config_path: str | os.PathLike | None) -> None:
    """Make the config file's directory and the working directory importable (in front of the path,
    as Python does for a script's own directory), so ``my_pkg`` next to the YAML is found."""
    dirs = [os.getcwd()]
    if config_path is not None:
        dirs.insert(0, os.path.dirname(os.path.abspath(config_path)))
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)


def _split(path: str) -> tuple[str, list[str]]:
    """``"a.b:C.d"`` -> ("a.b", ["C", "d"]); ``"a.b.c"`` -> ("a.b", ["c"])."""
    module, sep, attrs = path.partition(":")
    if not sep:
        module, _, attrs = path.rpartition(".")
    return module, attrs.split(".")


def _where(err: BaseException) -> str:
    """`` (at file:line)``: the innermost frame of the traceback, where the user's code raised (none when
    the call itself failed, e.g. on an unexpected keyword)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _cause(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def import_target(path: str, field: str) -> Any:
    """The object `path` names (``package.module:attr``), or a `UserCodeError` naming `field` and the cause."""
    module_name, attrs = _split(path)
    if not module_name or not all(attrs):
        raise UserCodeError(f"{field}: {path!r} is not an import path: write 'package.module:name'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        parts = module_name.split(".")
        if err.name in {".".join(parts[:k]) for k in range(1, len(parts) + 1)}:
            raise UserCodeError(
                f"{field}: cannot import {path!r}: no module named {err.name!r} (searched the config file's "
                f"directory, the working directory {os.getcwd()!r} and the installed packages)") from None
        # The module exists but imports something that does not.
        raise UserCodeError(f"{field}: importing {module_name!r} for {path!r} raised {_cause(err)}{_where(err)}") \
            from None
    except Exception as err:
        raise UserCodeError(f"{field}: importing {module_name!r} for {path!r} raised {_cause(err)}{_where(err)}") \
            from None
    for k, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, names, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            owner = ".".join([module_name, *attrs[:k]])
            raise UserCodeError(f"{field}: cannot import {path!r}: {owner!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    return obj


def _call(path: str, kwargs: dict, field: str, kwargs_field: str) -> Any:
    """``target(**kwargs)`` for the object `path` names; a failure is a `UserCodeError` naming `field`."""
    target = import_target(path, field)
    if not callable(target):
        raise UserCodeError(f"{field}: {path!r} is a {type(target).__name__}, not a function or a class")
    try:
        return target(**kwargs)
    except Exception as err:
        shown = f"(**{kwargs_field})" if kwargs else "()"
        raise UserCodeError(f"{field}: {path}{shown} raised {_cause(err)}{_where(err)}") from err


def _callable(path: str, kwargs: dict, field: str, kwargs_field: str) -> Callable:
    """A function as named (`kwargs` bound), or an instance of the class named, built with `kwargs`."""
    target = import_target(path, field)
    if inspect.isclass(target):
        made = _call(path, kwargs, field, kwargs_field)
        if not callable(made):
            raise UserCodeError(f"{field}: {path}(...) made a {type(made).__name__}, which cannot be called")
        return made
    if not callable(target):
        raise UserCodeError(f"{field}: {path!r} is a {type(target).__name__}, not a function or a class")
    if kwargs:
        try:
            inspect.signature(target).bind_partial(**kwargs)
        except TypeError as err:
            raise UserCodeError(f"{field}: {kwargs_field} do not fit {path}: {err}") from None
        except ValueError:  # no signature to check (a builtin): the call will say
            pass
        return functools.partial(target, **kwargs)
    return target


def loss_failure(cfg: JobConfig, criterion: Any, err: BaseException) -> UserCodeError | None:
    """An error of the first training step raised inside ``loss.target``'s own code, as one naming
    ``loss.target`` / ``loss.kwargs`` (a torch loss checks some arguments only when called:
    ``label_smoothing: 2``); None for any other error. Read from the tracebacks (the criterion itself is
    passed on untouched: tensor parallelism and the loss weights recognise it by what it is). Without
    ``loss.target``, a model that returns no loss is said in the config's terms."""
    if criterion is None:
        from .batches import NO_CRITERION

        for chained in _chain(err):
            if NO_CRITERION in str(chained):
                what = str(chained).replace(NO_CRITERION, "").rstrip(" :;,.")
                return UserCodeError(f"loss.target is not set, so each batch goes to the model whole and the model "
                                     f"must return the loss: {what}. For a model that returns outputs (logits), give "
                                     "loss.target (e.g. torch.nn.functional:cross_entropy); its batches are then "
                                     "(inputs, targets)")
        return None
    if not cfg.loss.target:
        return None
    func = criterion.func if isinstance(criterion, functools.partial) else criterion
    own = getattr(type(func), "forward", None) if isinstance(func, torch.nn.Module) else func
    code = getattr(inspect.unwrap(own), "__code__", None) if own is not None else None
    if code is None:
        return None
    for chained in _chain(err):
        tb = chained.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                given = f" with loss.kwargs {cfg.loss.kwargs}" if cfg.loss.kwargs else ""
                return UserCodeError(f"loss.target: {cfg.loss.target}{given} failed on the first batch: "
                                     f"{type(chained).__name__}: {chained}")
            tb = tb.tb_next
    return None


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the exceptions it came from (its cause, else its context), each once."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


# ------------------------------------------------------------------ datasets
class _IterableDataset(IterableDataset):
    """Any iterable of samples, read once per epoch (``iter()`` each time)."""

    def __init__(self, data: Iterable) -> None:
        self.data = data

    def __iter__(self) -> Iterator:
        return iter(self.data)


class ShardedIterable(IterableDataset):
    """An iterable's samples dealt to the data-parallel replicas: replica `rank` of `world_size` takes
    samples rank, rank + W, rank + 2W, ... (in the order the dataset gives them).

    Step i's batches over the W replicas are therefore samples ``i*b*W`` to ``(i+1)*b*W - 1`` (b a
    replica's batch, `batch_size`): one process reading the iterable in batches of b*W trains the same
    global batches, the epoch's short last one too (its replicas weighed by their rows). Where a replica
    would hold fewer than `min_rows` samples of that step (none; two a micro-batch for a model training
    BatchNorm: the trainer's rule, `Fitting._fewest_short_rows`), the step is padded with samples from the
    stream's start, as `ShardedSampler` pads (every replica reads the whole stream, so each knows its
    length at the end): before, every rank stopped with the first to run out, and the samples left were
    not trained (`fit` warned). Without `batch_size`, no padding.
    """

    def __init__(self, data: Iterable, rank: int, world_size: int, batch_size: int | None = None,
                 min_rows: int = 1) -> None:
        self.data, self.rank, self.world_size, self.batch_size = data, rank, world_size, batch_size
        self.min_rows = max(1, int(min_rows))

    def __iter__(self) -> Iterator:
        from .data import padded_tail

        w = self.world_size
        kept = w * min(self.min_rows, self.batch_size or 1)  # (the most a padding can repeat)
        head, count = [], 0  # (the stream's first samples: what the padding repeats)
        for count, sample in enumerate(self.data, start=1):
            if count <= kept:
                head.append(sample)
            if (count - 1) % w == self.rank:
                yield sample
        if not self.batch_size:
            return
        tail = count % (self.batch_size * w)
        # The padded positions past the stream's end, wrapping around to its start (none where exact).
        for position in range(tail, padded_tail(tail, w, self.batch_size, self.min_rows)):
            if position % w == self.rank:
                yield head[(position - tail) % len(head)]


def _dataset(made: Any, field: str, path: str) -> Dataset:
    """What a data factory returned, as a map-style `Dataset` or an `IterableDataset`."""
    if isinstance(made, IterableDataset) or (isinstance(made, Dataset) and hasattr(made, "__len__")):
        return made
    if map_style(made):
        return MapDataset(made)
    if hasattr(made, "__iter__") and not isinstance(made, (str, bytes, dict)):
        return _IterableDataset(made)
    raise UserCodeError(f"{field}: {path} returned a {type(made).__name__}, not a dataset: a map-style one "
                        "(__getitem__ and __len__) or an iterable of samples (__iter__)")


def is_iterable(data: Any) -> bool:
    return isinstance(data, IterableDataset)


# ------------------------------------------------------------------ the job's parts
def uses_user_code(cfg: JobConfig) -> bool:
    """Whether the config names any code of the user's (then `build` makes the job's parts)."""
    return bool(cfg.model.target or cfg.data.target or cfg.data.collate or cfg.loss.target)


def build(cfg: JobConfig, builtin: Callable[[JobConfig], tuple]) -> tuple:
    """(model, train set, validation set, criterion or None), the user's parts where the config names
    them, the built-in ones (`builtin`, dtrain's own `_build`) elsewhere."""
    from .models import VISION_PRESETS

    m, d = cfg.model, cfg.data
    model = train = val = criterion = None
    vision = m.preset in VISION_PRESETS
    if vision and d.target and not m.target:
        # An image preset on the user's data: the preset's model, its classes given (no folder to count).
        from .image_job import classification_loss
        from .models import build_vision_model

        if m.num_classes is None:
            raise ConfigError(f"model.preset {m.preset!r} on data.target needs model.num_classes (the classes of "
                              "your data: with data.dataset image_folder they are counted from the folder)")
        torch.manual_seed(cfg.training.seed)  # the same initial weights on every rank
        model = build_vision_model(m.preset, m.num_classes, m.image_size, width=m.width, depth=m.n_layer,
                                   dim=m.n_embd, zero_init_residual=m.zero_init_residual,
                                   channels_last=m.channels_last)
        criterion = classification_loss(cfg)
    elif not (m.target and d.target):
        # The built-in half of the job (with its loss: cross-entropy for digits, the GPT's own for text),
        # from a copy of the config without the user's parts.
        plain = cfg.model_copy(update={
            "model": m.model_copy(update={"target": None, "preset": "classifier" if d.dataset == "digits" and m.target
                                          else "resnet18" if d.dataset == "image_folder" and m.target
                                          else m.preset}),
            "data": d.model_copy(update={"target": None, "collate": None, "dataset": "digits"
                                         if m.preset == "classifier" and d.target else d.dataset}),
            "loss": cfg.loss.model_copy(update={"target": None}),
        })
        model, train, val, criterion = builtin(plain)
    if m.target:
        torch.manual_seed(cfg.training.seed)  # the same initial weights on every rank
        model = _call(m.target, m.kwargs, "model.target", "model.kwargs")
        if (isinstance(model, (list, tuple)) and model
                and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], nn.Module) for p in model)):
            from .pipeline.stages import Chain  # a pipeline adapter's (name, module) pairs: their chain

            try:
                model = Chain(model)  # names may hold dots ("block.0"), which nn.Sequential refuses
            except ValueError as e:
                raise UserCodeError(f"model.target: {m.target} returned (name, module) pairs that are no chain: {e}") from None
        if not isinstance(model, nn.Module):
            raise UserCodeError(f"model.target: {m.target} returned a {type(model).__name__}, not a torch.nn.Module")
    if d.target:
        train, val = _datasets(cfg)
        if is_iterable(train) and cfg.training.global_batch_size is not None:
            raise UserCodeError(f"training.global_batch_size needs a map-style dataset (__getitem__ and __len__), "
                                f"but data.target {d.target} returned an iterable one: give training.batch_size")
    _collate(cfg)  # a collate function that cannot be imported fails now, not at the first batch
    if cfg.loss.target:
        criterion = _callable(cfg.loss.target, cfg.loss.kwargs, "loss.target", "loss.kwargs")
    if d.target and criterion is not None:
        _check_pairs(cfg, train)
    if cfg.training.pipeline_parallel_size > 1 and m.target:
        _check_cuttable(cfg, model)
    return model, train, val, criterion


def _check_pairs(cfg: JobConfig, train: Any) -> None:
    """With a loss, each batch must be (inputs, targets): a map-style dataset whose samples are dicts
    (torch's default collate makes a dict of batches of them) needs ``data.collate``. Read from the
    first sample (an iterable one is not read ahead of training)."""
    from collections.abc import Mapping

    if is_iterable(train):
        return
    try:
        sample = train[0]
    except Exception:  # noqa: BLE001 - an empty or unusual dataset: training will say what is wrong
        return
    loss = f"loss.target {cfg.loss.target}" if cfg.loss.target else "the classifier's cross-entropy"
    if cfg.data.collate is not None:  # what it makes of a list of one sample (its random draws undone)
        import random

        collate = _collate(cfg)
        numpy = sys.modules.get("numpy")
        state = random.getstate(), numpy.random.get_state() if numpy is not None else None
        try:
            with torch.random.fork_rng(devices=[]):
                batch = collate([sample])
        except Exception:  # noqa: BLE001 - training will say what is wrong, with the collate's own error
            return
        finally:
            random.setstate(state[0])
            if numpy is not None:
                numpy.random.set_state(state[1])
        if isinstance(batch, Mapping) or not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            made = (f"a dict (keys {', '.join(repr(k) for k in list(batch)[:6])})" if isinstance(batch, Mapping)
                    else f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
            raise UserCodeError(f"data.collate: {cfg.data.collate} made {made} of a list of samples, and {loss} "
                                "takes (inputs, targets) batches: return an (inputs, targets) pair; or, for a model "
                                "that takes the dict's keys as arguments and returns its loss, leave out loss.target")
        return
    if isinstance(sample, Mapping):
        keys = ", ".join(repr(k) for k in list(sample)[:6])
        raise UserCodeError(f"data.target: the samples of {cfg.data.target} are dicts (keys {keys}), and {loss} "
                            "takes (inputs, targets) batches: give data.collate, a function that makes a list of "
                            "samples into an (inputs, targets) pair (torch's default collate keeps the dict); or, "
                            "for a model that takes the dict's keys as arguments and returns its loss, leave out "
                            "loss.target")


def _datasets(cfg: JobConfig) -> tuple[Dataset, Any]:
    """The user's training set, and the validation set: its own factory's, a share of a map-style
    training set (``data.val_fraction``, drawn from training.seed), or none (``[]``)."""
    d = cfg.data
    train = _dataset(_call(d.target, d.kwargs, "data.target", "data.kwargs"), "data.target", d.target)
    if d.val_target or d.val_kwargs is not None:
        path = d.val_target or d.target
        field = "data.val_target" if d.val_target else "data.target"
        val = _dataset(_call(path, d.val_kwargs or {}, field, "data.val_kwargs"), field, path)
        if is_iterable(val):  # evaluate() shards by index: a validation stream is read into memory once
            val = MapDataset(list(val))
        return train, val
    if is_iterable(train) or d.val_fraction == 0:
        return train, []
    g = torch.Generator().manual_seed(cfg.training.seed)
    order = torch.randperm(len(train), generator=g).tolist()
    n_val = int(len(train) * d.val_fraction)
    return torch.utils.data.Subset(train, order[n_val:]), torch.utils.data.Subset(train, order[:n_val])


def _check_cuttable(cfg: JobConfig, model: nn.Module) -> None:
    from .pipeline.stages import chain

    try:
        chain(model)
    except TypeError as err:
        raise UserCodeError(f"model.target: training.pipeline_parallel_size={cfg.training.pipeline_parallel_size} "
                            f"cuts the model into stages, but {err}") from None


def train_data(cfg: JobConfig, train: Dataset, batch_size: int | None, dp_rank: int, dp_world_size: int,
               min_rows: int = 1):
    """What `fit` reads: a map-style set as given (or a DataLoader with ``data.collate``, which `fit`
    re-shards); an iterable one dealt to the replicas (`ShardedIterable`, unless it shards itself; its
    short last step padded to `min_rows` a replica where fewer are left) and batched here."""
    collate = _collate(cfg)
    if is_iterable(train):
        if cfg.data.shard_iterable and dp_world_size > 1:
            train = ShardedIterable(train, dp_rank, dp_world_size, batch_size, min_rows)
        return DataLoader(train, batch_size=batch_size, collate_fn=collate)
    if collate is not None:  # (shuffle: what fit does to it, so that fit does not warn of a difference)
        return DataLoader(train, batch_size=batch_size, collate_fn=collate, shuffle=True,
                          num_workers=cfg.data.num_workers)  # (which fit's re-sharded loader keeps)
    return train


def val_data(cfg: JobConfig, val: Dataset, batch_size: int):
    """What `evaluate` reads: the validation set, batched with ``data.collate`` when there is one."""
    collate = _collate(cfg)
    return DataLoader(val, batch_size=batch_size, collate_fn=collate) if collate is not None else val


def _collate(cfg: JobConfig) -> Callable | None:
    c = cfg.data.collate
    return _callable(c, cfg.data.collate_kwargs, "data.collate", "data.collate_kwargs") if c else None


def sample_count(train: Any) -> str:
    """The training set's size for the log line (an iterable's may be unknown)."""
    try:
        return f"{len(train):,}"
    except TypeError:
        return "an iterable of"


def iterable_epochs(epochs: int, max_steps: int | None) -> int:
    """Epochs for an iterable training set, whose steps per epoch are unknown: with ``max_steps``, as
    many as could be needed (an epoch has at least one step; `fit` stops at ``max_steps``)."""
    return epochs if max_steps is None else max(epochs, max_steps)
