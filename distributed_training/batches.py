"""What the trainer does with a batch it does not know the shape of: move it to the device, count its
samples and tokens, split it into micro-batches, call the model on it and find the loss in what the
model returned. A batch is a tensor, or a tuple (a namedtuple too), list, dict or dataclass of them
(nested); a batch in which none of these finds a tensor is refused (`check_readable`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["map_tensors", "rebuilt", "tensors_of", "check_readable", "to_device", "batch_size_of", "batch_rows", "token_count", "split_batch", "call_module", "model_loss", "extract_loss"]


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with every tensor replaced by ``fn(tensor)``: tuples (namedtuples too), lists and
    dataclasses keep their type, mappings become dicts, anything else is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return rebuilt(batch, [map_tensors(fn, v) for v in batch])
    if _is_dataclass(batch):
        return dataclasses.replace(batch, **{k: map_tensors(fn, v) for k, v in _fields(batch).items()})
    return batch


def rebuilt(sequence: tuple | list, items: list) -> tuple | list:
    """A tuple or list of `sequence`'s type holding `items` (a namedtuple takes them as arguments)."""
    return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)


def _is_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _fields(x: Any) -> dict[str, Any]:
    """A dataclass batch's fields that its constructor takes (what `dataclasses.replace` can set)."""
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors of a nested batch, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    elif _is_dataclass(batch):
        batch = list(_fields(batch).values())
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in tensors_of(v)]
    return []


def check_readable(batch: Any) -> None:
    """Refuse a batch without a tensor the trainer can find: it counted as no rows, so its loss weighed
    nothing and the step trained nothing, silently (a plain object holding the tensors as attributes)."""
    if not tensors_of(batch):
        raise TypeError(
            f"the trainer found no tensor in a batch of type {type(batch).__name__}: it reads a batch's tensors "
            "(to move them to the device, count its rows and weigh its loss) inside tuples (namedtuples too), "
            "lists, dicts and dataclasses. Return one of those from the dataset or the collate function "
            "(e.g. a dict of tensors), with tensors in it (tokenize text before the model)")


def to_device(batch: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def batch_size_of(batch: Any) -> int:
    """The rows of `batch`: dim 0 of its first tensor that has one (a lone 0-dim tensor is one sample;
    inside a tuple, list or dict a 0-dim tensor, such as a scalar weight, is skipped)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    return _rows(batch)


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    elif _is_dataclass(batch):
        batch = list(_fields(batch).values())
    if isinstance(batch, (tuple, list)):
        for item in batch:
            size = _rows(item)
            if size:
                return size
    return 0


def token_count(batch: Any) -> int | None:
    """Tokens in a language-model batch: the elements of an integer input tensor."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() and inputs.dim() >= 2:
        return inputs.numel()
    return None


def split_batch(batch: Any, parts: int) -> list[tuple[Any, int]]:
    """Split every tensor of `batch` into `parts` chunks along dim 0; return (chunk, size) pairs.

    A batch smaller than `parts` (the short last batch of an epoch) is split into one chunk per sample:
    accumulation only bounds memory, so fewer micro-batches give the same gradient. The targets of an
    ``(inputs, targets)`` batch flattened to one per token (1-D, rows x tokens long for inputs of
    (rows, tokens, ...): ``tokens[:, 1:].flatten()``, as with logits flattened to (rows x tokens,
    classes)) are split at the same rows.
    """
    n = batch_size_of(batch)
    parts = min(parts, n) if n else 1
    if parts == 1:
        return [(batch, n)]
    rows = [len(piece) for piece in torch.tensor_split(torch.empty(n, 0), parts)]
    per_token = _flattened_targets(batch, n)
    _check_rows(batch, n, per_token)

    def chunk(x, k):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n:
            return torch.tensor_split(x, parts)[k]
        if x is per_token:
            tokens = x.shape[0] // n
            return x[sum(rows[:k]) * tokens:sum(rows[:k + 1]) * tokens]
        if isinstance(x, Mapping):
            return {key: chunk(v, k) for key, v in x.items()}
        if _per_sample_values(x, n):  # e.g. sequence lengths as a list of ints: cut with the rows
            return type(x)(x[sum(rows[:k]):sum(rows[:k + 1])])
        if isinstance(x, (tuple, list)):
            return rebuilt(x, [chunk(v, k) for v in x])
        if _is_dataclass(x):
            return dataclasses.replace(x, **{name: chunk(v, k) for name, v in _fields(x).items()})
        return x

    pieces = [chunk(batch, k) for k in range(parts)]
    return [(piece, batch_size_of(piece)) for piece in pieces]


def _per_sample_values(x: Any, n: int) -> bool:
    """A list of `n` plain values (numbers, strings, None): one per sample, cut with the rows."""
    return (isinstance(x, list) and len(x) == n
            and all(v is None or isinstance(v, (bool, int, float, str, bytes)) for v in x))


def _check_rows(batch: Any, n: int, per_token: torch.Tensor | None) -> None:
    """`split_batch` cuts every tensor along dim 0 at the `n` rows of the batch's first tensor; one of
    another dim 0 goes whole to every micro-batch (a mask or position ids shared by the rows). Targets
    must be cut with the rows: targets of another dim 0 (a time-major (T, B) input, whose batch is dim 1,
    beside (B,) targets) would be paired with other rows, so they are refused, naming them."""
    targets, path = None, ""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        targets, path = batch[1], "batch[1] (the targets)"
    elif isinstance(batch, Mapping) and "labels" in batch:
        targets, path = batch["labels"], "batch['labels']"
    if isinstance(targets, torch.Tensor) and targets.dim() and targets.shape[0] != n and targets is not per_token:
        raise ValueError(
            f"gradient accumulation cuts a batch along dim 0 into micro-batches, at the {n} rows of its first "
            f"tensor, but {path} has shape {tuple(targets.shape)}: put the batch dimension first in the inputs "
            "(a time-major sequence: transpose it in the model, or nn.LSTM(batch_first=True)), or train with "
            "gradient_accumulation_steps=1")


def batch_rows(batch: Any) -> int:
    """The samples of `batch` (`batch_size_of`), or of its targets where an (inputs, targets) batch's
    targets have another dim 0 (time-major inputs (T, B, ...) beside (B,) targets: B)."""
    n = batch_size_of(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        targets = batch[1]
        if (isinstance(targets, torch.Tensor) and targets.dim() and targets.shape[0] != n
                and _flattened_targets(batch, n) is None):
            return targets.shape[0]
    return n


def _flattened_targets(batch: Any, n: int) -> torch.Tensor | None:
    """The targets of an ``(inputs, targets)`` batch when they are one per token of (n, T, ...) inputs,
    flattened to n x T (what `split_batch` cuts at the inputs' rows), else None. The inputs may be a tuple
    or dict (token ids and an attention mask): their first tensor is the one read."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return None
    inputs, targets = batch
    leaves = tree_flatten(dict(inputs) if isinstance(inputs, Mapping) else inputs)[0]  # (a BatchEncoding too)
    inputs = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
    if (inputs is not None and inputs.dim() >= 2 and inputs.shape[0] == n and isinstance(targets, torch.Tensor)
            and targets.dim() == 1 and n > 0 and targets.shape[0] == n * inputs.shape[1] and inputs.shape[1] > 1):
        return targets
    return None


def call_module(module: nn.Module, inputs: Any):
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


NO_CRITERION = ("without a criterion, each batch is the model's input and the model must return the loss; for a "
                 "model that returns outputs (logits), pass criterion=..., e.g. criterion=torch.nn.functional."
                 "cross_entropy, and batches of (inputs, targets)")


def model_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a model computes itself (no criterion), with an error that says what to do otherwise."""
    try:
        output = call_module(module, batch)
    except TypeError as err:
        # The usual cause: an (inputs, targets) batch unpacked into a forward that takes only inputs.
        if isinstance(batch, (tuple, list)) and "argument" in str(err):
            raise TypeError(f"{err}: {NO_CRITERION}") from err
        raise
    return extract_loss(output)


_NONE_GIVEN = object()


def extract_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        if output.numel() != 1:
            raise ValueError(f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss: "
                             f"{NO_CRITERION}")
        return output
    if isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif hasattr(output, "loss"):
        loss = output.loss  # (a Hugging Face ModelOutput: None where no labels were given, and then not `in` it)
    else:
        loss = _NONE_GIVEN
    if loss is None:
        raise ValueError(f"the model returned {type(output).__name__} with loss=None: a Hugging Face model computes "
                         "its loss only when the batch holds 'labels' (input_ids again for a causal language "
                         f"model; -100 where a position does not count). {NO_CRITERION}")
    if loss is not _NONE_GIVEN:
        return loss
    raise TypeError(f"the model returned {type(output).__name__}, not a loss (a tensor, a dict with 'loss', or an "
                    f"object with .loss): {NO_CRITERION}")
