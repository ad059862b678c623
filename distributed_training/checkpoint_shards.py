"""One checkpoint format for every strategy: each rank writes the pieces of full tensors it holds.

Every strategy keeps a model's parameters (and the optimizer's state of them) in one of a few
shapes: whole tensors (DDP; ZeRO-1's parameters), or slices of flat vectors that concatenate several
parameters (FSDP's unit shards; ZeRO-1's optimizer shards). Whatever the shape, what a rank holds is
a set of *pieces*: elements ``[start, start + length)`` of a parameter's flattened full tensor, named
by its key in the plain module's ``state_dict()``, found at offset ``local`` of a local tensor. A
strategy describes its pieces (`Strategy.state_layout` -> `StateLayout`); this module does the rest,
the same way for all of them:

* **save**: each rank puts the pieces it is asked to write into its ``rank<r>.pt`` (parameters under
  ``params``, optimizer state under ``optim``; a state tensor of the local tensor's size is cut into
  the same pieces, a scalar such as Adam's ``step`` is kept whole), and the ranks agree on an *index*
  (key -> which rank holds which elements) that rank 0 puts in ``meta.pt`` with every full shape;
* **load**: each rank asks its own strategy which pieces it needs now, looks them up in the index and
  reads only the files that hold them (its own first), whatever strategy and world size wrote them.

A tensor-parallel rank's parameter is not a contiguous part of the full tensor but a few *regular
runs* of it (a row-parallel weight [out, in] holds ``out`` runs of ``in / T`` elements): its pieces are
*strided* (``count`` runs, ``stride`` apart in the full tensor; see `Piece` and
`distributed_training.tensor.state`), saved as one tensor each, and a loader intersects the runs it
asks for with the saved ones arithmetically (a few strided copies per pair, never one per run).

So a checkpoint written by DDP at world 2 loads under ZeRO-3 at world 3, and back; one written at
TP = 2 x DP = 2 loads at TP = 1 or TP = 4. The files keep the
crash-proof properties of `distributed_training.checkpoint` (atomic, checksummed); this module only
decides what goes in them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["FORMAT", "Piece", "Holding", "StateLayout", "whole_tensors", "flat_pieces", "pack", "summary",
           "extra_states", "load_extra_states", "extra_state_key", "modules_with_extra_state", "read_extra_state",
           "build_index", "check_shapes", "Sources", "unpack_params", "unpack_optimizer"]

#: The value of ``checkpoint_format`` in ``meta.pt``. Strided pieces did not change it: a file without
#: them is written exactly as before, and every file written before reads the same way.
FORMAT = "pieces/1"


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of the flattened full tensor `key`, held at elements
    ``[local, local + length)`` of a local tensor.

    A *strided* piece (``count > 1``: a tensor-parallel shard, see `distributed_training.tensor.state`)
    is `count` such runs: run i is elements ``[start + i * stride, ... + length)`` of the full tensor,
    held at ``[local + i * local_stride, ... + length)`` (`local_stride` None: right after run i - 1).
    Its saved data is one tensor of ``count * length`` elements, run after run. The defaults make a
    piece of one run, as every strategy without tensor parallelism describes them."""

    key: str
    start: int
    length: int
    local: int
    count: int = 1
    stride: int = 0
    local_stride: int | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"piece of '{self.key}': count {self.count} (runs) must be at least 1")
        if self.count > 1 and (self.stride < self.length or self.step < self.length):
            raise ValueError(f"piece of '{self.key}': runs of {self.length} elements overlap (stride {self.stride}, "
                             f"local_stride {self.local_stride})")

    @property
    def numel(self) -> int:
        return self.count * self.length

    @property
    def step(self) -> int:
        """Elements between the starts of two runs in the local tensor."""
        return self.length if self.local_stride is None else self.local_stride


@dataclass
class Holding:
    """A local tensor and the pieces of full tensors it holds; `save` says whether this rank writes
    them (one replica writes what several hold); pieces of the keys in `not_saved` are loaded but
    written by another rank (a pipeline's copy of a tied weight, inside a shard of several)."""

    tensor: torch.Tensor
    pieces: list[Piece]
    save: bool = True
    not_saved: frozenset[str] = frozenset()


@dataclass
class StateLayout:
    """What a rank holds: `shapes` of every parameter key, `params` (the parameters' storage) and
    `optimizer` (one holding per parameter of the optimizer, in its order)."""

    shapes: dict[str, tuple[int, ...]]
    params: list[Holding]
    optimizer: list[Holding] = field(default_factory=list)


def whole_tensors(named: list[tuple[str, torch.Tensor]], save: bool) -> list[Holding]:
    """Holdings of replicated parameters: each one a single piece, the whole tensor."""
    return [Holding(t, [Piece(key, 0, t.numel(), 0)], save) for key, t in named]


def flat_pieces(members: list[tuple[str, int, int]], lo: int, hi: int) -> list[Piece]:
    """The pieces of a slice ``[lo, hi)`` of a flat vector that concatenates parameters, given as
    ``(key, offset in the vector, numel)``; the slice's own element 0 is ``local`` 0."""
    pieces = []
    for key, offset, numel in members:
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            pieces.append(Piece(key, a - offset, b - a, a - lo))
    return pieces


def _grid(flat: torch.Tensor, at: int, count: int, length: int, step: int) -> torch.Tensor:
    """The (count, length) view of `count` runs of `length` elements of the 1-d `flat`, ``step`` apart
    from element `at` on."""
    return flat.as_strided((count, length), (step if count > 1 else 1, 1), flat.storage_offset() + at)


def _local_view(flat: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's elements of the local tensor `flat` (1-d): a flat view when its runs are
    contiguous there, else a (count, length) view."""
    if piece.count == 1 or piece.step == piece.length:
        return flat[piece.local : piece.local + piece.numel]
    return _grid(flat, piece.local, piece.count, piece.length, piece.step)


def host_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in (pageable) host memory, contiguous: what a synchronous save writes."""
    return tensor.cpu().clone(memory_format=torch.contiguous_format)


def _cut(value: torch.Tensor, piece: Piece, to_host: Callable[[torch.Tensor], torch.Tensor] = host_clone) -> torch.Tensor:
    return to_host(_local_view(value.detach().reshape(-1), piece)).reshape(-1)


def _entry(piece: Piece, data: torch.Tensor) -> tuple:
    """A saved piece in a rank's file: ``(start, data)``, as always, or for a strided piece
    ``(start, data, length, count, stride)``."""
    return (piece.start, data) if piece.count == 1 else (piece.start, data, piece.length, piece.count, piece.stride)


def pack(layout: StateLayout, optimizer: torch.optim.Optimizer | None, *,
         to_host: Callable[[torch.Tensor], torch.Tensor] = host_clone) -> dict[str, Any]:
    """This rank's part of a checkpoint: the pieces it writes (``params``, ``optim``: key -> list of
    ``(start, data)``, or ``(start, data, length, count, stride)`` for a strided piece; ``optim_scalars``:
    key -> {name: value}) and the optimizer's hyperparameters. Each piece is copied to host memory by
    `to_host` (default: a plain clone; an asynchronous save passes pinned buffers, see
    `distributed_training.checkpoint_async.HostStaging`)."""
    params: dict[str, list] = {}
    for holding in layout.params:
        if holding.save:
            for piece in holding.pieces:
                if piece.key in holding.not_saved:
                    continue
                params.setdefault(piece.key, []).append(_entry(piece, _cut(holding.tensor, piece, to_host)))
    optim: dict[str, dict[str, list]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        elementwise = _elementwise_names(optimizer)
        for holding in layout.optimizer:
            if not holding.save:
                continue
            state = optimizer.state.get(holding.tensor, {})
            for piece in holding.pieces:
                if piece.key in holding.not_saved:
                    continue
                for name, value in state.items():
                    if torch.is_tensor(value) and (value.dim() > 0 and value.numel() == holding.tensor.numel()
                                                   or _elementwise_of_a_0dim(holding.tensor, name, value, elementwise)):
                        optim.setdefault(piece.key, {}).setdefault(name, []).append(_entry(piece, _cut(value, piece, to_host)))
                    else:
                        # (through `to_host` too: a CUDA step count copied with .cpu() would wait for the device)
                        scalars.setdefault(piece.key, {})[name] = to_host(value.detach()) if torch.is_tensor(value) else value
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"params": params, "optim": optim, "optim_scalars": scalars, "param_groups": groups}


def _elementwise_names(optimizer: torch.optim.Optimizer) -> tuple[set, set]:
    """The optimizer's state names kept per element (Adam's ``exp_avg``) and those kept as one value (its
    ``step``), as its parameters of one or more dimensions show them."""
    per_element, scalar = set(), set()
    for p, state in optimizer.state.items():
        if torch.is_tensor(p) and p.dim() > 0:
            for name, value in state.items():
                if torch.is_tensor(value):
                    (per_element if value.shape == p.shape and value.dim() > 0 else scalar).add(name)
    return per_element, scalar - per_element


def _elementwise_of_a_0dim(tensor: torch.Tensor, name: str, value: torch.Tensor, names: tuple[set, set]) -> bool:
    """Whether `value`, state `name` of a 0-dim parameter (a learned temperature, CLIP's ``logit_scale``), is
    per element: its shape, (), is a step count's too. Saved as a scalar, it could not be loaded where that
    parameter is one element of a flat shard (ZeRO-1/2/3). Where no other parameter shows it: all but a
    ``step``."""
    if tensor.dim() != 0 or value.dim() != 0:
        return False
    per_element, scalar = names
    return name in per_element or (name not in scalar and name != "step")


def summary(packed: dict[str, Any]) -> dict[str, Any]:
    """What one rank's `pack` holds, without the data: small enough to gather from every rank."""
    def spans(pieces):
        return [(entry[0], entry[1].numel()) if len(entry) == 2 else (entry[0], *entry[2:]) for entry in pieces]
    return {"params": {key: spans(pieces) for key, pieces in packed["params"].items()},
            "optim": {key: (sorted(names), spans(next(iter(names.values())))) for key, names in packed["optim"].items()},
            "optim_scalars": list(packed["optim_scalars"])}


def build_index(summaries: list[dict[str, Any]], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Key -> which ranks hold which elements, from every rank's `summary` in rank order: spans
    ``(rank, start, length)``, or ``(rank, start, length, count, stride)`` for strided pieces."""
    index: dict[str, Any] = {"params": {}, "optim": {}, "optim_names": {}, "optim_scalars": {},
                             "param_groups": param_groups}
    for rank, part in enumerate(summaries):
        for key, spans in part["params"].items():
            index["params"].setdefault(key, []).extend((rank, *span) for span in spans)
        for key, (names, spans) in part["optim"].items():
            index["optim_names"].setdefault(key, names)
            index["optim"].setdefault(key, []).extend((rank, *span) for span in spans)
        for key in part["optim_scalars"]:
            index["optim_scalars"].setdefault(key, []).append(rank)
    return index


class Sources:
    """Finds the saved pieces that cover an element range, reading as few rank files as it can."""

    def __init__(self, read: Callable[[int], dict], own_rank: int) -> None:
        self.read = read
        self.own = own_rank
        self.opened: set[int] = set()

    def _order(self, ranks):
        return sorted(ranks, key=lambda r: (r != self.own, r not in self.opened, r))

    def pick(self, ranks: list[int]) -> dict:
        """The file of one of `ranks` (this rank's own, or one already read, if among them)."""
        rank = self._order(ranks)[0]
        self.opened.add(rank)
        return self.read(rank)

    def fill(self, out: torch.Tensor, spans: list[tuple[int, ...]], start: int, length: int,
             fetch: Callable[[dict, int], torch.Tensor], what: str, count: int = 1, stride: int = 0) -> None:
        """Copy `count` runs of `length` elements of a full tensor, run i from element
        ``start + i * stride`` on, into `out` (flat, ``count * length`` long, run after run), from the
        saved `spans` ``(rank, start, length[, count, stride])``; `fetch(file, saved_start)` returns a
        saved piece's data (run after run).

        Files are tried in `_order` and one is read only if it holds an element still missing. Each
        (wanted, saved) pair of run patterns meets in at most a few regular blocks (`_overlaps`), each
        one strided copy: loading a pattern saved alike is a single copy, whatever the run count."""
        want = _Runs(start, length, count, stride if count > 1 else 0, 0, length)
        total = left = count * length
        if not total:  # (a zero-size parameter: nothing to copy, and nothing saved overlaps it)
            return
        missing: torch.Tensor | None = None  # None: all of it (most loads are one copy: no mask needed)
        order = {r: i for i, r in enumerate(self._order({s[0] for s in spans}))}
        for span in sorted(spans, key=lambda s: order[s[0]]):
            rank, s_start, s_len, s_count, s_stride = (*span, 1, 0)[:5]
            blocks = _overlaps(want, _Runs(s_start, s_len, s_count, s_stride, 0, s_len))
            if missing is not None:
                blocks = [b for b in blocks if _grid(missing, b[2], b[0], b[1], b[3]).any()]
            if not blocks:
                continue
            data = fetch(self.read(rank), s_start).reshape(-1)
            self.opened.add(rank)
            for n, run, at, step, s_at, s_step in blocks:
                dst, src = _grid(out, at, n, run, step), _grid(data, s_at, n, run, s_step)
                if missing is None and n * run == total:
                    dst.copy_(src)
                    return
                if missing is None:
                    missing = torch.ones(total, dtype=torch.bool)
                holes = _grid(missing, at, n, run, step)
                if holes.all():
                    dst.copy_(src)
                    left -= n * run
                else:  # partly filled from another file already (replicas that hold overlapping pieces)
                    dst.copy_(torch.where(holes, src.to(dst.dtype), dst))
                    left -= int(holes.sum())
                holes.fill_(False)
            if not left:
                return
        first = 0 if missing is None else int(missing.nonzero()[0])
        i, offset = divmod(first, length)
        raise ValueError(f"{what}: {left} elements, the first element {start + i * stride + offset}, are in no rank's "
                         "file of the checkpoint")


class _Runs(NamedTuple):
    """`count` runs of `length` elements of a full tensor (run i from element ``full + i * stride``)
    lying in a flat buffer from ``at + i * step`` on."""

    full: int
    length: int
    count: int
    stride: int
    at: int
    step: int


def _rows(r: _Runs, stride: int) -> list[_Runs]:
    """A single run `r` cut into rows of `stride` elements (then the rest), to meet runs `stride` apart."""
    rows, rest = divmod(r.length, stride)
    out = [_Runs(r.full, stride, rows, stride, r.at, stride)] if rows else []
    return out + ([_Runs(r.full + rows * stride, rest, 1, stride, r.at + rows * stride, stride)] if rest else [])


def _overlaps(a: _Runs, b: _Runs) -> list[tuple[int, int, int, int, int, int]]:
    """Where the runs of `a` and of `b` hold the same elements of the full tensor, as blocks ``(count,
    length, at in a's buffer, step there, at in b's buffer, step there)``: `count` runs of `length`
    elements each. A few blocks for any run counts (one when the patterns are equal); only runs of
    two patterns of different strides (which no split of one tensor gives) are met one by one."""
    if a.count == 1 and b.count == 1:
        lo, hi = max(a.full, b.full), min(a.full + a.length, b.full + b.length)
        return [(1, hi - lo, a.at + lo - a.full, 1, b.at + lo - b.full, 1)] if lo < hi else []
    if a.count > 1 and b.count > 1 and a.stride != b.stride:
        return [block for i in range(a.count)
                for block in _overlaps(_Runs(a.full + i * a.stride, a.length, 1, 0, a.at + i * a.step, 1), b)]
    stride = a.stride if a.count > 1 else b.stride
    a_parts = _rows(a, stride) if a.length > stride else [a]
    b_parts = _rows(b, stride) if b.length > stride else [b]
    return [block for pa in a_parts for pb in b_parts for block in _same_stride(pa, pb, stride)]


def _same_stride(a: _Runs, b: _Runs, stride: int) -> list[tuple[int, int, int, int, int, int]]:
    """`_overlaps` of two patterns of runs `stride` apart, none longer than `stride` (a single run's
    stride is taken to be `stride`). Run i of `a` can meet only run ``i + k`` of `b` for the one or two
    shifts k that bring them within a row of each other; for each, the common part sits at the same
    place of every such pair of runs: one block."""
    d = a.full - b.full
    blocks = []
    # k from the first shift at which b's run i + k ends after a's run i starts, to the last at which it
    # starts before a's run i ends
    for k in range((d - b.length) // stride + 1, -(-(d + a.length) // stride)):
        lo, hi = max(a.full, b.full + k * stride), min(a.full + a.length, b.full + k * stride + b.length)
        first, last = max(0, -k), min(a.count, b.count - k)
        if lo < hi and first < last:
            blocks.append((last - first, hi - lo, a.at + first * a.step + lo - a.full, a.step,
                           b.at + (first + k) * b.step + lo - b.full - k * stride, b.step))
    return blocks


def _piece_of(pieces: list, start: int) -> torch.Tensor:
    for entry in pieces:
        if entry[0] == start:
            return entry[1]
    raise KeyError(start)


def check_shapes(saved: dict[str, tuple], mine: dict[str, tuple]) -> None:
    """Raise `ValueError` naming the first parameter missing, unexpected or of another shape."""
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        chained = (all(k.startswith("layers.") for k in saved) and not all(k.startswith("layers.") for k in mine))
        hint = ("; its keys are an adapter chain's (`layers.<i>.*`: a model passed to the trainer as (name, "
                "layer) pairs): load it into a trainer given the same pairs, at any pipeline size (1 included), "
                "and map `full_state_dict()`'s keys back with `pipeline.model_keys(model, pairs)`" if chained else "")
        raise ValueError(f"parameters missing from the checkpoint {missing[:5]}, in it but not in this model "
                         f"{unexpected[:5]}{hint}")
    for key, shape in mine.items():
        if tuple(saved[key]) != tuple(shape):
            raise ValueError(f"'{key}': the checkpoint has shape {list(saved[key])}, this model {list(shape)}")


@torch.no_grad()
def unpack_params(layout: StateLayout, index: dict[str, Any], sources: Sources) -> None:
    """Fill this rank's parameter storage from the checkpoint."""
    for holding in layout.params:
        flat = holding.tensor.detach().view(-1)
        for piece in holding.pieces:
            buffer = torch.empty(piece.numel, dtype=flat.dtype)
            sources.fill(buffer, index["params"].get(piece.key, []), piece.start, piece.length,
                         lambda f, s, k=piece.key: _piece_of(f["params"][k], s), f"parameter '{piece.key}'",
                         piece.count, piece.stride)
            target = _local_view(flat, piece)
            target.copy_(buffer.view(target.shape))


def _same_decay(saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """A saved group's hyperparameters with its weight decay where this optimizer keeps it: in
    ``segment_weight_decay`` when torch's AdamW / SGD decay flat shards by element
    (`optim.decay_by_segments`, the optimizer's own ``weight_decay`` then 0), else in ``weight_decay``."""
    saved = dict(saved)
    if "segment_weight_decay" in mine and "segment_weight_decay" not in saved:
        saved["segment_weight_decay"], saved["weight_decay"] = saved["weight_decay"], 0.0
    elif "segment_weight_decay" in saved and "segment_weight_decay" not in mine:
        saved["weight_decay"] = saved.pop("segment_weight_decay")
    return saved


def unpack_optimizer(layout: StateLayout, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                     sources: Sources) -> None:
    """Rebuild this rank's optimizer state from the checkpoint and load it (torch casts each state
    tensor to its parameter's dtype and device). The saved hyperparameters of each param group come
    back when the optimizer has as many groups as the saved one."""
    position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for holding in layout.optimizer:
        entry: dict[str, Any] = {}
        for piece in holding.pieces:  # scalars (Adam's step) are alike for all pieces of one parameter
            ranks = index["optim_scalars"].get(piece.key)
            if ranks:
                entry = {**sources.pick(ranks)["optim_scalars"][piece.key], **entry}
        names = sorted({name for piece in holding.pieces for name in index["optim_names"].get(piece.key, [])})
        stateless = [piece.key for piece in holding.pieces if not index["optim_names"].get(piece.key)]
        if names and stateless:
            from .checkpoint import CheckpointMismatchError  # (checkpoint imports this module)

            raise CheckpointMismatchError(
                f"the checkpoint has no optimizer state for {stateless[0]!r} (it had no gradient when saved: frozen "
                f"or unused), and this rank's optimizer keeps it in one tensor with parameters that have some "
                f"({', '.join(sorted({p.key for p in holding.pieces} - set(stateless))[:3])}): a shard or bucket "
                "holds one state and one step count, so a part of it cannot start afresh. To change which "
                "parameters train, load the model's weights instead (the saved run's full_state_dict(), loaded "
                "into the model before building the trainer) and let the optimizer start afresh; under ddp each "
                "parameter keeps its own state, and a checkpoint loads across such a change")
        for name in names:
            flat = torch.zeros(holding.tensor.numel(), dtype=holding.tensor.dtype)
            for piece in holding.pieces:
                target = _local_view(flat, piece)
                buffer = target if target.dim() == 1 else torch.empty(piece.numel, dtype=flat.dtype)
                sources.fill(buffer, index["optim"].get(piece.key, []), piece.start, piece.length,
                             lambda f, s, k=piece.key, n=name: _piece_of(f["optim"][k][n], s),
                             f"optimizer state '{name}' of '{piece.key}'", piece.count, piece.stride)
                if buffer is not target:
                    target.copy_(buffer.view(target.shape))
            entry[name] = flat.view(holding.tensor.shape)
        if entry:
            state[position[id(holding.tensor)]] = entry
    current = optimizer.state_dict()["param_groups"]
    saved = index.get("param_groups") or []
    groups = ([dict(_same_decay(old, mine), params=mine["params"]) for old, mine in zip(saved, current)]
              if len(saved) == len(current) else current)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def extra_states(module: torch.nn.Module) -> dict[str, Any]:
    """What `module`'s submodules keep besides tensors (``get_extra_state()``, under the state dict's
    ``<prefix>_extra_state`` keys), copied: only those that override it (an fp8 recipe's metadata, a
    vocabulary, a counter), and only what a checkpoint reads back under ``weights_only`` (tensors,
    numbers, strings and containers of them: another object is left out, with a warning)."""
    import copy
    import warnings

    out = {}
    for name, m in modules_with_extra_state(module):
        key = extra_state_key(name)
        value = read_extra_state(name, m)
        if _plain(value):
            out[key] = copy.deepcopy(value)
        else:
            warnings.warn(f"checkpoint: {key} ({type(value).__name__}) is left out: a checkpoint keeps a module's extra "
                          "state only as tensors, numbers, strings and lists / tuples / dicts of them", stacklevel=3)
    return out


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def load_extra_states(module: torch.nn.Module, states: dict[str, Any]) -> None:
    """Give `module`'s submodules back what `extra_states` took (``set_extra_state``), by key."""
    for name, m in module.named_modules():
        if extra_state_key(name) in states:
            m.set_extra_state(states[extra_state_key(name)])


def extra_state_key(name: str) -> str:
    """The state-dict key of submodule `name`'s extra state."""
    return f"{name}._extra_state" if name else "_extra_state"


def read_extra_state(name: str, module: torch.nn.Module) -> Any:
    """``module.get_extra_state()``; an error says which module's, and that under ZeRO-2/3 / FSDP the
    weights it might read are freed between steps."""
    try:
        return module.get_extra_state()
    except Exception as err:
        raise RuntimeError(f"{extra_state_key(name)}: {type(module).__name__}.get_extra_state() raised "
                           f"{type(err).__name__}: {err} (under ZeRO-2/3 / FSDP a module's weights are freed between "
                           "steps: extra state must not read them)") from err


def modules_with_extra_state(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The submodules that keep extra state (``get_extra_state`` overridden), with their names."""
    base = torch.nn.Module.get_extra_state
    return [(name, m) for name, m in module.named_modules() if type(m).get_extra_state is not base]
