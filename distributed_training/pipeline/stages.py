"""The model cut into pipeline stages: the chain of layers, where to cut it, and one stage's module.

A pipeline runs a model whose forward is a *chain*: a list of named layers, each taking the previous
one's output. Cutting the chain into contiguous parts gives the stages; stage s's output is stage
s + 1's input, and the last stage's output (the logits) goes to the loss.

* `chain(model)` gives the chain of an `nn.Sequential` (its children) or of our `GPT`
  (``embed``, ``block.0`` ... ``block.{n-1}``, ``head``). For any other model, write a function that
  returns the list of ``(name, module)`` pairs (an *adapter*, a few lines; the module's docstring
  shows one) and pass its result wherever a chain is expected; `chain(list)` checks it.
* `partition(costs, stages)` cuts the chain where the largest stage cost is smallest (costs: parameter
  counts, measured times, ...); `split_at(boundary_names, layer_names)` cuts it where the user says.
  Both answer *bounds*: stage s holds layers ``bounds[s]:bounds[s + 1]``.
* `Stage(layers, index, num_stages)` is one stage's `nn.Module`: its layers, registered under their
  chain names (its state_dict keys are ``"block.3.attn.qkv.weight"``, ...), run in order.
* `GPTStages(cfg).build(stage, num_stages, device)` (`gpt_stages.py`, with the GPT's chain layers and
  `lm_loss`) constructs only one stage of a GPT, with the weights the whole model would have (each
  layer initialised from its own seed), so that no rank ever materialises the whole model.
* Tied parameters (the GPT's token embedding, used again by the output head): when the layers that
  share one land on different stages, each of those stages holds its own copy; `tied_groups` says
  which stages hold copies, and `sync_tied_grads` sums the copies' gradients over a process group of
  those ranks after backward, so that every copy takes the same optimizer step.

Writing an adapter for another model: the layers' forwards must compose, each taking one tensor and
returning one tensor. For example, for Hugging Face's GPT-2 (``GPT2LMHeadModel``)::

    class Embed(nn.Module):
        def __init__(self, t):                 # t = model.transformer
            super().__init__()
            self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
        def forward(self, idx):                # (B, T) -> (B, T, C)
            pos = torch.arange(idx.size(1), device=idx.device)
            return self.drop(self.wte(idx) + self.wpe(pos))

    class Block(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block
        def forward(self, x):
            # The causal mask: GPT2Model builds it above its blocks, so a block called alone gets none
            # (transformers 5 then attends to future tokens; checked equal to GPT2LMHeadModel's logits).
            T = x.size(1)
            causal = torch.full((T, T), torch.finfo(x.dtype).min, device=x.device).triu(1)[None, None]
            out = self.block(x, attention_mask=causal)
            return out[0] if isinstance(out, tuple) else out   # some versions return a tuple

    class Head(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head
        def forward(self, x):
            return self.lm_head(self.ln_f(x))

    def gpt2_chain(model):
        t = model.transformer
        return [("embed", Embed(t)), *((f"block.{i}", Block(b)) for i, b in enumerate(t.h)),
                ("head", Head(model))]

    layers = chain(gpt2_chain(model))

`find_ties(layers)` then finds the tied embedding (the same `nn.Parameter` in ``embed`` and ``head``).
The trainer's state dicts of such a chain have `Chain`'s keys (``layers.<i>.…``); `model_keys(model,
layers)`, taken before training, maps them to the model's own (``transformer.wte.weight``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..batches import call_module
from ..models.gpt import GPT

__all__ = ["Chain", "chain", "model_keys", "partition", "split_at", "Stage", "TiedGroup", "find_ties", "tied_groups", "sync_tied_grads",
           "sum_tied_grads", "allocate", "Layers"]

Layers = list[tuple[str, nn.Module]]


# --------------------------------------------------------------------------------------------------
# The chain


def _check_chain(layers: Sequence) -> Layers:
    out: Layers = []
    seen: set[str] = set()
    for i, item in enumerate(layers):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], nn.Module)):
            raise TypeError(f"chain: item {i} must be a (name, nn.Module) pair, got {type(item).__name__} {item!r:.80}")
        name, module = item
        if not name or any(not part for part in name.split(".")):
            raise ValueError(f"chain: layer {i} has an invalid name {name!r} (non-empty parts separated by '.')")
        if name in seen:
            raise ValueError(f"chain: layer name {name!r} appears twice")
        seen.add(name)
        out.append((name, module))
    if not out:
        raise ValueError("chain: the model has no layers")
    return out


class Chain(nn.Module):
    """An adapter's ``(name, module)`` pairs as one module whose forward runs them in turn: what
    `DistributedTrainer` makes of a model given as such a list (names may hold dots, as ``"block.0"``,
    which `nn.Sequential` refuses). `chain` returns the pairs again; the state dict's keys are
    ``layers.<i>.<the layer's own keys>``."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        checked = _check_chain(layers)
        self.names = [name for name, _ in checked]
        self.layers = nn.ModuleList(module for _, module in checked)

    def forward(self, *args, **kwargs):
        # The first layer takes the model's inputs as the model would: a batch's tuple unpacked into
        # positional arguments, its dict into keywords (`batches.call_module`); the others the previous output.
        x = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            x = layer(x)
        return x


def model_keys(model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> dict[str, tuple[str, ...]]:
    """``{Chain key: model keys}``: the keys in `model`'s own state dict of each key of
    ``Chain(layers)``'s (what the trainer's `full_state_dict` and checkpoints use for a model given as an
    adapter's pairs). Usually one; a module that `model` holds at several paths (T5's ``shared`` and
    ``encoder.embed_tokens``) gives each of them.

    Call it before training (the trainer frees what is not a rank's stage). Each key goes by the
    innermost module on its path that `model` holds (an adapter's wrapper, such as ``Embed`` in this
    module's docstring, is looked through): ``layers.0.wte.weight`` -> ``transformer.wte.weight``. A
    tied weight held by two modules (GPT-2's ``lm_head`` and ``wte``) is a key of each. A parameter the
    adapter holds itself, as its own attribute, goes by the model's keys of that same tensor (a timm
    ViT's ``cls_token`` and ``pos_embed``, which its root module holds).

        names = model_keys(model, pairs)
        state = {key: v for k, v in trainer.full_state_dict().items() for key in names[k]}
        model.load_state_dict(state)   # e.g. a fresh GPT2LMHeadModel, then save_pretrained

    Raises:
        ValueError: a key whose modules `model` holds none of, and whose tensor is none of the model's
            (one the adapter made itself), named.
    """
    paths_of: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths_of.setdefault(id(module), []).append(path)
    keys_of: dict[int, list[str]] = {}  # a tensor's keys in the model (a ViT's cls_token, held by its root)
    for name, tensor in model.state_dict(keep_vars=True).items():
        keys_of.setdefault(id(tensor), []).append(name)
    container = Chain(layers)
    modules = dict(container.named_modules(remove_duplicate=False))
    out = {}
    for key, tensor in container.state_dict(keep_vars=True).items():
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the innermost module on the key's path first
            module = modules.get(".".join(parts[:cut]))
            if module is not None and id(module) in paths_of:
                rest = ".".join(parts[cut:])
                out[key] = tuple(f"{path}.{rest}" if path else rest for path in paths_of[id(module)])
                break
        else:  # the adapter holds the model's own tensor as its attribute (the model's root holds it)
            if id(tensor) not in keys_of:
                raise ValueError(f"model_keys: {key!r} is no tensor of the {type(model).__name__} given, nor held by "
                                 "one of its modules (a parameter or buffer the adapter made itself?)")
            out[key] = tuple(keys_of[id(tensor)])
    return out


def chain(model: nn.Module | Sequence[tuple[str, nn.Module]], halves: bool = False) -> Layers:
    """The model as a chain of named layers whose forwards compose.

    * `nn.Sequential`: its children, under their names (``"0"``, ``"1"``, ... or the keys of the
      ``OrderedDict`` it was built from).
    * our `GPT`: ``[("embed", GPTEmbedding), ("block.0", Block), ..., ("head", GPTHead)]``. The layers
      hold the model's own modules (the head's weight is the embedding's, one parameter). The head
      returns logits; ``lm_loss(logits, targets)`` on them equals ``GPT.forward(idx, targets)``.
    * a list of ``(name, module)`` pairs, what an adapter for another model returns (see the module's
      docstring): checked (unique, non-empty names) and returned as a new list.

    `halves` (our `GPT` only): each block as two layers, ``block.i.a`` (attention) and ``block.i.m`` (MLP),
    so that a stage may end inside a block.

    Raises:
        TypeError: the model is none of these (the message names its type).
        ValueError: `halves` for a model that is not our `GPT`.
    """
    from .gpt_stages import gpt_chain  # the GPT's own chain (its module imports this one)

    if isinstance(model, GPT):
        return gpt_chain(model, halves)
    if halves:
        raise ValueError(f"half blocks cut our GPT's blocks into their attention and MLP halves; a "
                         f"{type(model).__name__} has no such blocks: cut it at whole layers")
    if isinstance(model, nn.Sequential):
        # _modules, not named_children(): a module placed twice runs twice, and is two layers.
        return _check_chain(list(model._modules.items()))
    if isinstance(model, Chain):
        return list(zip(model.names, model.layers))
    if isinstance(model, (list, tuple)):
        return _check_chain(model)
    kind = type(model)
    raise TypeError(
        f"chain() cannot cut a {kind.__module__}.{kind.__qualname__} into pipeline stages: it takes an "
        "nn.Sequential, a distributed_training GPT, or a list of (name, module) pairs whose forwards compose. "
        "For another model, write a function returning that list (an adapter: see "
        "distributed_training.pipeline.stages and docs/pipeline.md) and pass its result (dtrain: a model.target "
        "may return that list).")


# --------------------------------------------------------------------------------------------------
# Where to cut


def _check_bounds(bounds: Sequence[int], num_layers: int) -> list[int]:
    bounds = list(bounds)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_layers or any(
            b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must rise strictly from 0 to the number of layers ({num_layers}), got {bounds}")
    return bounds


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Cut a chain of layers with these costs into `stages` contiguous, non-empty parts, minimising
    the largest part's cost (the pipeline's slowest stage, or its largest memory).

    Exact, by dynamic programming (O(stages x layers^2)): ``best[k][i]``, the smallest largest part
    of layers ``[0, i)`` cut into k parts, is the minimum over j of ``max(best[k - 1][j], cost(j, i))``.
    Among the cuts reaching that optimum, a second pass takes the one with the smallest sum of squared
    part costs (the most even stages besides the largest), the earliest cut on a tie.

    Args:
        costs: one non-negative number per layer (parameter counts, measured seconds, ...).
        stages: the number of parts, 1 <= stages <= len(costs).

    Returns:
        bounds, ``stages + 1`` increasing offsets from 0 to len(costs): part s is layers
        ``bounds[s]:bounds[s + 1]``.
    """
    costs = list(costs)
    n = len(costs)
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}] must be a finite number >= 0, got {c!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if stages > n:
        raise ValueError(f"stages ({stages}) exceeds the number of layers ({n}): every stage needs at least one layer")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def part(j: int, i: int):
        return prefix[i] - prefix[j]

    inf = math.inf
    # best[k][i] for i in [k, n - (stages - k)]: the first k parts cover layers [0, i), leaving at
    # least one layer for each later part.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], part(j, i)) for j in range(k - 1, i))
    cap = best[stages][n]
    # Second pass: every part <= cap (the same subtractions as above, so the optimum itself passes),
    # smallest sum of squares.
    squares = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    squares[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                c = part(j, i)
                if c <= cap and squares[k - 1][j] + c * c < squares[k][i]:
                    squares[k][i], choice[k][i] = squares[k - 1][j] + c * c, j
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    return bounds[::-1]


def split_at(boundary_names: Sequence[str], layer_names: Sequence[str]) -> list[int]:
    """The bounds of user-given stages: each name in `boundary_names` is the layer where a new stage
    starts (``["block.6", "block.12"]`` makes three stages). No names: one stage.

    Raises:
        ValueError: a name is not a layer, or is the first layer (the first stage would be empty),
            or the names are repeated or not in the chain's order (each message names the culprit).
    """
    if isinstance(boundary_names, str):
        raise TypeError(f"boundary_names must be a list of layer names, got the string {boundary_names!r}")
    layer_names = list(layer_names)
    if not layer_names:
        raise ValueError("layer_names is empty")
    position = {name: i for i, name in enumerate(layer_names)}
    bounds = [0]
    previous = None
    for name in boundary_names:
        if name not in position:
            shown = layer_names if len(layer_names) <= 12 else layer_names[:6] + ["..."] + layer_names[-3:]
            raise ValueError(f"boundary_names: {name!r} is not a layer of the chain (layers: {shown})")
        i = position[name]
        if i == 0:
            raise ValueError(f"boundary_names: {name!r} is the first layer; a stage starting there leaves the "
                             "first stage empty (name only the layers where the second, third, ... stages start)")
        if i <= bounds[-1]:
            what = "repeated" if name == previous or i == bounds[-1] else f"out of order (after {previous!r})"
            raise ValueError(f"boundary_names: {name!r} is {what}: give the names in the chain's order")
        bounds.append(i)
        previous = name
    bounds.append(len(layer_names))
    return bounds


# --------------------------------------------------------------------------------------------------
# One stage


class Stage(nn.Module):
    """One pipeline stage: its layers, run in order.

    The layers are registered under their chain names, a dotted name making plain container modules
    on the way (``"block.3"`` is child ``"3"`` of a container ``block``: ``stage.get_submodule("block.3")``),
    so that the stage's state_dict keys are the whole chain's (``"block.3.attn.qkv.weight"``) whichever
    stage holds them.

    Attributes:
        index: this stage's position, 0 <= index < num_stages.
        num_stages: how many stages the chain was cut into.
        names: the layers' chain names, in order.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], index: int, num_stages: int) -> None:
        super().__init__()
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_stages:
            raise ValueError(f"index must be an int in [0, num_stages={num_stages}), got {index!r}")
        layers = _check_chain(layers)
        self.index = index
        self.num_stages = num_stages
        self.names = tuple(name for name, _ in layers)
        self._chain = [module for _, module in layers]  # run order (not registered twice)
        containers: set[int] = set()
        for name, module in layers:
            parent = self
            *path, leaf = name.split(".")
            for depth, part in enumerate(path):
                child = parent._modules.get(part)
                if child is None:
                    child = nn.Module()
                    self._add(parent, part, child, name)
                    containers.add(id(child))
                elif id(child) not in containers:
                    raise ValueError(f"layers: {name!r} would go inside layer {'.'.join(path[:depth + 1])!r}")
                parent = child
            if leaf in parent._modules:
                raise ValueError(f"layers: {name!r} clashes with another layer's name")
            self._add(parent, leaf, module, name)

    @staticmethod
    def _add(parent: nn.Module, part: str, module: nn.Module, name: str) -> None:
        try:
            parent.add_module(part, module)
        except KeyError as e:
            raise ValueError(f"layers: {name!r} cannot be registered ({e})") from None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x):
        """The layers in turn on `x`; the first stage's first layer takes the batch's inputs as a model
        without a pipeline does (`batches.call_module`): a tuple or list as positional arguments, a dict
        as keywords (``forward(self, input_ids, attention_mask)``)."""
        layers = iter(self._chain)
        if self.index == 0:
            x = call_module(next(layers), x)
        for layer in layers:
            x = layer(x)
        return x

    def extra_repr(self) -> str:
        return f"index={self.index}, num_stages={self.num_stages}"


# --------------------------------------------------------------------------------------------------
# Tied parameters


@dataclass(frozen=True)
class TiedGroup:
    """One parameter that layers on several stages use: each of those stages holds a copy, and the
    copies' gradients must be summed over them after backward.

    Attributes:
        name: the parameter's key at its first use in the chain (``"embed.wte.weight"``).
        stages: the stages holding a copy, ascending (at least two).
        keys: the copy's key on each of those stages, in the same order (``"head.lm_head.weight"`` on
            the last stage of a GPT).
    """

    name: str
    stages: tuple[int, ...]
    keys: tuple[str, ...]

    def key_on(self, stage: int) -> str:
        """The copy's parameter name in stage `stage`'s module."""
        try:
            return self.keys[self.stages.index(stage)]
        except ValueError:
            raise ValueError(f"stage {stage} holds no copy of {self.name!r} (stages {list(self.stages)})") from None


def find_ties(layers: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, ...]]:
    """The parameters that several layers of a chain share (the same `nn.Parameter` object), each as
    its keys in the chain, in chain order: ``[("embed.wte.weight", "head.lm_head.weight")]`` for a GPT."""
    uses: dict[int, list[tuple[str, str]]] = {}
    for name, module in layers:
        for key, p in module.named_parameters(remove_duplicate=False):
            uses.setdefault(id(p), []).append((name, f"{name}.{key}"))
    return [tuple(key for _, key in found) for found in uses.values() if len({name for name, _ in found}) > 1]


def tied_groups(ties: Iterable[Sequence[str]], layer_names: Sequence[str], bounds: Sequence[int]) -> list[TiedGroup]:
    """Which stages hold a copy of each tied parameter, for a chain cut at `bounds`.

    Args:
        ties: each tie as the keys of its uses in the chain (what `find_ties` returns, or what a
            builder knows, e.g. `GPTStages.TIES`).
        layer_names: the chain's layer names, in order.
        bounds: the cut (from `partition` or `split_at`).

    Returns:
        One `TiedGroup` per tie whose uses fall on two or more stages (a tie inside one stage stays
        one parameter there: nothing to sync), with the stage's first use as its key there.
    """
    layer_names = list(layer_names)
    bounds = _check_bounds(bounds, len(layer_names))
    stage_of = {}
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        for name in layer_names[lo:hi]:
            stage_of[name] = s
    by_length = sorted(layer_names, key=len, reverse=True)  # longest prefix first: "block.1" before "block"
    groups = []
    for tie in ties:
        per_stage: dict[int, str] = {}
        for key in tie:
            owner = next((name for name in by_length if key.startswith(name + ".")), None)
            if owner is None:
                raise ValueError(f"ties: {key!r} is not a parameter key of any layer of the chain")
            per_stage.setdefault(stage_of[owner], key)
        if len(per_stage) > 1:
            stages = tuple(sorted(per_stage))
            groups.append(TiedGroup(tie[0], stages, tuple(per_stage[s] for s in stages)))
    return groups


def sync_tied_grads(stage_module: nn.Module, tied: Iterable[TiedGroup], group=None, *,
                    stage: int | None = None) -> int:
    """Sum the gradients of this stage's copies of tied parameters over `group`, in place.

    Call it after backward (all micro-batches) and before the optimizer step, on every rank of `group`:
    the ranks holding the stages of the ties (one rank per stage; with data parallelism, the engine
    makes one such group per data-parallel index). Afterwards every copy has the gradient the one
    shared parameter would have had, and identical copies stay identical through the optimizer step.
    A copy without a gradient (unused this step) counts as zeros and gets the sum.

    Args:
        stage_module: this stage's module (a `Stage`, or any module whose parameter names are the keys).
        tied: the ties to sync (`tied_groups`); those not held by this stage are skipped. Those held
            must all span the same stages, the members of `group`.
        group: the process group of the ranks holding copies (``None``: the default group).
        stage: this stage's index (default: ``stage_module.index``).

    Returns:
        How many tensors were all-reduced (0: this stage holds none of the ties, nothing communicated).
    """
    index = stage_module.index if stage is None else stage
    mine = [t for t in tied if index in t.stages]
    if not mine:
        return 0
    spans = {t.stages for t in mine}
    if len(spans) > 1:
        raise ValueError(f"tied: these ties span different stages {sorted(spans)}; sync each set of stages over "
                         "its own group")
    size = dist.get_world_size(group)
    if size != len(mine[0].stages):
        raise ValueError(f"group has {size} ranks but the ties span {len(mine[0].stages)} stages "
                         f"{list(mine[0].stages)}: pass the group of the ranks holding the copies")
    return sum_tied_grads([stage_module.get_parameter(t.key_on(index)) for t in mine], group)


def sum_tied_grads(params: Sequence[nn.Parameter], group=None) -> int:
    """Sum the gradients of these copies of tied parameters over `group`, in place (`sync_tied_grads`,
    after its checks; the trainer's pipeline sums through its data-parallel strategy instead,
    `Strategy.accumulated_gradient`, as a copy's gradient may be a piece of a sharded unit's). A copy without a gradient (unused this step) counts as zeros and gets the sum. Every rank
    of `group` passes its copies of the same ties, in the same order. Returns how many were reduced."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
    return len(params)


def allocate(modules: Iterable[nn.Module], device: torch.device | str) -> list[torch.Tensor]:
    """Give the meta parameters and buffers of `modules` (and their submodules) uninitialised storage on
    `device`, slot by slot, leaving real tensors as they are. A meta tensor held in several slots (a
    tied weight, a module placed twice) becomes one new tensor in all of them, so ties stay ties; the
    slots of modules not passed (another stage's layers) keep the meta tensor. Returns the new
    tensors, each once, in the order met."""
    device = torch.device(device)
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, its replacement)
    seen: set[int] = set()
    for top in modules:
        for module in top.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for slots, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in list(slots.items()):
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in new:
                        empty = torch.empty_like(t, device=device)
                        new[id(t)] = (t, nn.Parameter(empty, t.requires_grad) if is_param else empty)
                    slots[name] = new[id(t)][1]
    return [replacement for _, replacement in new.values()]
