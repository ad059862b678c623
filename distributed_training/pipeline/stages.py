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
* `GPTStages(cfg).build(stage, num_stages, device)` constructs only one stage of a GPT, with the
  weights the whole model would have (each layer initialised from its own seed), so that no rank ever
  materialises the whole model.
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
            out = self.block(x)
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
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.gpt import GPT, Block, GPTConfig

__all__ = ["chain", "partition", "split_at", "Stage", "GPTEmbedding", "GPTHead", "GPTStages", "TiedGroup",
           "find_ties", "tied_groups", "sync_tied_grads", "layer_seed", "lm_loss", "gpt_key"]

Layers = list[tuple[str, nn.Module]]


# --------------------------------------------------------------------------------------------------
# The chain


class GPTEmbedding(nn.Module):
    """The GPT's first layer: ``drop(wte(idx) + wpe(positions))``, (B, T) token ids -> (B, T, C)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.wpe.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds block_size {self.wpe.num_embeddings}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class GPTHead(nn.Module):
    """The GPT's last layer: ``lm_head(ln_f(x))``, (B, T, C) -> logits (B, T, vocab).

    `lm_head`'s weight is the token embedding's (tied) when the embedding is on the same stage, and
    a copy of it otherwise."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on the last stage's logits: mean cross-entropy over the (B * T) tokens, the
    softmax in at least fp32 — exactly what ``GPT.forward(idx, targets)`` computes."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _gpt_chain(model: GPT) -> Layers:
    # The wrappers hold the model's own modules: running the chain trains the model's parameters.
    return [("embed", GPTEmbedding(model.wte, model.wpe, model.drop)),
            *((f"block.{i}", block) for i, block in enumerate(model.blocks)),
            ("head", GPTHead(model.ln_f, model.lm_head))]


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


def chain(model: nn.Module | Sequence[tuple[str, nn.Module]]) -> Layers:
    """The model as a chain of named layers whose forwards compose.

    * `nn.Sequential`: its children, under their names (``"0"``, ``"1"``, ... or the keys of the
      ``OrderedDict`` it was built from).
    * our `GPT`: ``[("embed", GPTEmbedding), ("block.0", Block), ..., ("head", GPTHead)]``. The layers
      hold the model's own modules (the head's weight is the embedding's, one parameter). The head
      returns logits; ``lm_loss(logits, targets)`` on them equals ``GPT.forward(idx, targets)``.
    * a list of ``(name, module)`` pairs, what an adapter for another model returns (see the module's
      docstring): checked (unique, non-empty names) and returned as a new list.

    Raises:
        TypeError: the model is none of these (the message names its type).
    """
    if isinstance(model, GPT):
        return _gpt_chain(model)
    if isinstance(model, nn.Sequential):
        # _modules, not named_children(): a module placed twice runs twice, and is two layers.
        return _check_chain(list(model._modules.items()))
    if isinstance(model, (list, tuple)):
        return _check_chain(model)
    kind = type(model)
    raise TypeError(
        f"chain() cannot cut a {kind.__module__}.{kind.__qualname__} into pipeline stages: it takes an "
        "nn.Sequential, a distributed_training GPT, or a list of (name, module) pairs whose forwards compose. "
        "For another model, write a function returning that list (an adapter: see "
        "distributed_training.pipeline.stages and docs/pipeline.md) and pass its result.")


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
        for layer in self._chain:
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
    for t in mine:
        p = stage_module.get_parameter(t.key_on(index))
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
    return len(mine)


# --------------------------------------------------------------------------------------------------
# Building one stage of a GPT


def layer_seed(seed: int, name: str) -> int:
    """The seed of one layer (or one tied parameter): the first 8 bytes of
    ``sha256(f"{seed}/{name}")``, as a non-negative 63-bit integer. Independent of the cut, the
    device and the number of layers, so any stage can initialise its layers without the others."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def gpt_key(key: str) -> str:
    """A chain key's name in `GPT`'s state_dict: ``"block.3.ln1.weight"`` -> ``"blocks.3.ln1.weight"``,
    ``"embed.wte.weight"`` -> ``"wte.weight"``, ``"head.lm_head.weight"`` -> ``"lm_head.weight"``."""
    layer, _, rest = key.partition(".")
    if layer in ("embed", "head"):
        return rest
    if layer == "block":
        return "blocks." + rest
    raise ValueError(f"key {key!r} is not a GPT chain key (embed.*, block.*, head.*)")


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of `module` uninitialised storage on `device`, leaving
    parameters that are already real (a tied weight from another layer) as they are."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                mod._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                raise NotImplementedError(f"buffer {name!r}: GPT layers have none; initialise it here if added")


class GPTStages:
    """Builds one pipeline stage of a `GPT`, without constructing the rest of the model.

    The chain is ``embed``, ``block.0`` ... ``block.{n_layer-1}``, ``head`` (as `chain(GPT(cfg))`).
    By default the stages are balanced by parameter count (`costs`: the token embedding counts in
    both ``embed`` and ``head``, which both use it); `split` (boundary names, `split_at`) or `costs`
    (e.g. measured times) choose another cut.

    Initialisation (the scheme that makes every stage agree with the whole model): each layer is
    built on the meta device, given storage on `device`, and initialised by a generator on `device`
    seeded with ``layer_seed(seed, layer name)``, drawing its parameters in `named_parameters` order
    with GPT's rules (Linear and Embedding weights N(0, 0.02); the residual projections ``attn.proj``
    and ``mlp.2`` N(0, 0.02 / sqrt(2 n_layer)); biases 0; LayerNorm 1 and 0). The tied token embedding
    is drawn by its own generator, seeded with ``layer_seed(seed, "embed.wte.weight")``, on each stage
    that holds a copy. So a layer's weights depend only on (seed, its name, cfg, device type): equal
    whatever the cut, and ``build(0, 1, device)`` (everything in one stage) is the single-process
    reference. They are not those of ``torch.manual_seed(k); GPT(cfg)`` (one stream for everything);
    `model()` gives a `GPT` holding exactly these weights. CPU and CUDA generators differ, so compare
    builds on the same device type. The global RNG is not touched.

    Attributes:
        cfg: the model's shape.
        seed: the base seed.
    """

    #: The GPT's tied parameter: the token embedding, used again by the output head.
    TIES = (("embed.wte.weight", "head.lm_head.weight"),)

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.seed = seed
        self._costs: list[int] | None = None

    def layer_names(self) -> list[str]:
        return ["embed", *(f"block.{i}" for i in range(self.cfg.n_layer)), "head"]

    def _make(self, name: str) -> nn.Module:
        cfg = self.cfg
        if name == "embed":
            return GPTEmbedding(nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd),
                                nn.Dropout(cfg.dropout))
        if name == "head":
            return GPTHead(nn.LayerNorm(cfg.n_embd), nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))
        return Block(cfg)

    def costs(self) -> list[int]:
        """Parameters per layer (counted on the meta device: nothing allocated)."""
        if self._costs is None:
            with torch.device("meta"):
                self._costs = [sum(p.numel() for p in self._make(name).parameters()) for name in self.layer_names()]
        return list(self._costs)

    def bounds(self, num_stages: int, split: Sequence[str] | None = None,
               costs: Sequence[float] | None = None) -> list[int]:
        """Where the chain is cut: `split` (boundary names) if given, else `partition` of `costs`
        (default: parameter counts)."""
        names = self.layer_names()
        if split is not None:
            if costs is not None:
                raise ValueError("give split (where stages start) or costs (to balance), not both")
            bounds = split_at(split, names)
            if len(bounds) - 1 != num_stages:
                raise ValueError(f"split names {len(bounds) - 1} stages ({list(split)}) but num_stages is {num_stages}")
            return bounds
        if costs is not None and len(costs) != len(names):
            raise ValueError(f"costs has {len(costs)} entries, one per layer of the chain expected ({len(names)}: "
                             f"embed, {self.cfg.n_layer} blocks, head)")
        if num_stages > len(names):
            raise ValueError(f"num_stages ({num_stages}) exceeds the GPT's {len(names)} layers "
                             f"(embed, {self.cfg.n_layer} blocks, head)")
        return partition(self.costs() if costs is None else costs, num_stages)

    def stage_names(self, stage: int, num_stages: int, split: Sequence[str] | None = None,
                    costs: Sequence[float] | None = None) -> list[str]:
        """The layer names of stage `stage`."""
        bounds = self.bounds(num_stages, split, costs)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise ValueError(f"stage must be an int in [0, num_stages={num_stages}), got {stage!r}")
        return self.layer_names()[bounds[stage]:bounds[stage + 1]]

    def tied_groups(self, num_stages: int, split: Sequence[str] | None = None,
                    costs: Sequence[float] | None = None) -> list[TiedGroup]:
        """The ties to sync for this cut: ``[TiedGroup("embed.wte.weight", (0, S - 1), ("embed.wte.weight",
        "head.lm_head.weight"))]`` when S > 1, ``[]`` for one stage."""
        return tied_groups(self.TIES, self.layer_names(), self.bounds(num_stages, split, costs))

    def build(self, stage: int, num_stages: int, device: torch.device | str = "cpu",
              split: Sequence[str] | None = None, costs: Sequence[float] | None = None) -> Stage:
        """Construct stage `stage` of `num_stages` on `device`, and only it.

        With ``device="meta"`` the stage has shapes and no storage (nothing initialised)."""
        device = torch.device(device)
        names = self.stage_names(stage, num_stages, split, costs)
        n_layer = self.cfg.n_layer
        layers: Layers = []
        for name in names:
            with torch.device("meta"):
                layer = self._make(name)
            tied = None
            if name == "head" and layers and layers[0][0] == "embed":
                tied = layers[0][1].wte.weight  # same stage: one parameter, two uses
                layer.lm_head.weight = tied
            if device.type != "meta":
                _materialise(layer, device)
                with torch.no_grad():
                    _init_layer(layer, torch.Generator(device=device).manual_seed(layer_seed(self.seed, name)),
                                n_layer, skip=self._tied_params(name, layer))
                    if tied is None and name in ("embed", "head"):
                        weight = layer.wte.weight if name == "embed" else layer.lm_head.weight
                        nn.init.normal_(weight, 0.0, 0.02, torch.Generator(device=device).manual_seed(
                            layer_seed(self.seed, self.TIES[0][0])))
            layers.append((name, layer))
        return Stage(layers, stage, num_stages)

    @staticmethod
    def _tied_params(name: str, layer: nn.Module) -> set[int]:
        if name == "embed":
            return {id(layer.wte.weight)}
        if name == "head":
            return {id(layer.lm_head.weight)}
        return set()

    def model(self, device: torch.device | str = "cpu") -> GPT:
        """A whole `GPT` holding exactly the weights of ``build(0, 1, device)``: the single-process
        reference for a pipeline built with these stages (``GPT.forward(idx, targets)`` equals the
        chain followed by `lm_loss`)."""
        whole = self.build(0, 1, device)
        with torch.device("meta"):
            gpt = GPT(self.cfg)
        embed, head = whole.get_submodule("embed"), whole.get_submodule("head")
        gpt.wte, gpt.wpe, gpt.drop = embed.wte, embed.wpe, embed.drop
        gpt.blocks = nn.ModuleList(whole.get_submodule(f"block.{i}") for i in range(self.cfg.n_layer))
        gpt.ln_f, gpt.lm_head = head.ln_f, head.lm_head  # lm_head.weight is wte.weight: one stage
        return gpt


def _init_layer(layer: nn.Module, generator: torch.Generator, n_layer: int, skip: set[int]) -> None:
    """GPT's initialisation of one layer from its own generator; parameters in `skip` are left alone."""
    done = set(skip)
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    for mname, module in layer.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in done:
                continue
            key = f"{mname}.{pname}" if mname else pname
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(p) if pname == "weight" else nn.init.zeros_(p)
            elif isinstance(module, (nn.Linear, nn.Embedding)) and pname == "weight":
                std = residual_std if key.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std, generator)
            elif isinstance(module, nn.Linear) and pname == "bias":
                nn.init.zeros_(p)
            else:
                raise NotImplementedError(f"no initialisation rule for {key!r} ({type(module).__name__})")
            done.add(id(p))
