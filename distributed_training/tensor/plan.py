"""Applying a tensor-parallel plan to a user's model.

A plan maps module-name patterns (fnmatch, over ``model.named_modules()`` names, e.g.
``"blocks.*.attn.qkv"``) to a style (see docs/tensor_parallel.md):

* ``"colwise"`` or ``("colwise", chunks)``: an ``nn.Linear`` (or Hugging Face ``Conv1D``) split by
  output features, `chunks` > 1 for a fused projection (q/k/v: 3);
* ``"rowwise"``: the same split by input features, partial outputs summed;
* ``"vocab"``: an ``nn.Embedding`` split by vocabulary rows, or an output ``nn.Linear`` split by
  vocabulary (its logits stay split; the loss is `vocab_parallel_cross_entropy`);
* ``"sequence"``: a replicated module that, under sequence parallelism, sees this rank's part of the
  sequence (its parameters' gradients are partial sums; dropouts draw TP = 1's mask);
* ``"sequence_split"``: as ``"sequence"``, where the sequence-parallel region starts (its input is
  split along the sequence on entry);
* ``"replicate"``: left as it is (also every module no pattern matches).

`apply_plan` replaces the matched modules in place by layers built from them (the weights sliced
from the full ones, so TP = 1 and TP = N start identical), keeping the plain model's parameter keys,
and returns the split parameters' `ShardSpec` by `state_dict()` key. It checks everything first
(patterns that match nothing, styles on the wrong module type, sizes and attention heads not
divisible by the tensor size, tied parameters given different styles) and changes nothing when a
check fails.

A ``"vocab"`` output head leaves split logits: `parallel_loss(model)` gives the loss that takes them
(our GPT's ``forward(idx, targets)`` uses it), and `parallel_loss(model, criterion)` swaps a user's
cross-entropy criterion for it (both in `tensor.loss`, re-exported here).
"""

from __future__ import annotations

import collections
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping, Union

import torch
from torch import nn

from .functional import group_size, split_sequence
from .layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallelDropout, VocabParallelEmbedding,
                     is_conv1d, linear_shape)
from .loss import _LOSS, VocabParallelLoss, is_cross_entropy, parallel_loss, unsupported_loss_message
from .spec import ShardSpec, mark_sequence_parallel, spec_of
from .undo import PlanUndo

__all__ = ["STYLES", "Style", "apply_plan", "gpt_plan", "parallel_loss", "is_cross_entropy", "VocabParallelLoss",
           "unsupported_loss_message", "parse_plan"]

STYLES = ("colwise", "rowwise", "vocab", "sequence", "sequence_split", "replicate")
Style = Union[str, tuple]  # one of STYLES, or ("colwise", chunks)

# Attributes through which an attention module names its head counts: each must divide by the tensor
# size when one of its projections is split (our GPT: n_head; Hugging Face: num_heads, ...).
_HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "n_kv_head", "n_kv_heads", "num_key_value_heads",
                    "num_attention_heads")


def gpt_plan(cfg: Any = None) -> dict[str, Style]:
    """The plan for our `GPT` (`distributed_training.models.gpt`): attention split by heads (the fused
    ``qkv`` column-parallel in 3 blocks, ``proj`` row-parallel), the MLP column- then row-parallel, the
    tied embedding and output head split by vocabulary, the LayerNorms and dropouts sharded along the
    sequence under sequence parallelism (the region starts at the embedding dropout ``drop``), the
    position embedding replicated.

    `cfg` (a `GPTConfig`, optional): the plan is the same for every configuration; `apply_plan` checks
    the sizes (``n_head``, ``n_embd``, ``vocab_size``) against the tensor size.
    """
    del cfg
    return {
        "wte": "vocab",
        "wpe": "replicate",
        "drop": "sequence_split",
        "blocks.*.ln1": "sequence",
        "blocks.*.attn.qkv": ("colwise", 3),
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln2": "sequence",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "blocks.*.drop": "sequence",
        "ln_f": "sequence",
        "lm_head": "vocab",
    }


# -- applying a plan ---------------------------------------------------------------------------------

def apply_plan(model: nn.Module, plan: Mapping[str, Style], group: Any = None, *, sequence_parallel: bool = False,
               sequence_dim: int = 1, undo: PlanUndo | None = None,
               trail: SplitTrail | None = None) -> dict[str, ShardSpec]:
    """Make `model` tensor-parallel over `group` (None: the default group) in place.

    Every module name of ``model.named_modules()`` takes the style of the first pattern of `plan`
    (in its order) that matches it, ``"replicate"`` when none does. Matched modules are replaced on
    their parent by the parallel layers built from them, so the parameter keys stay the plain
    model's. A parameter used by two modules (a tied embedding and output head) stays one local
    parameter, shared by both replacements, which must be given the same style.

    With `sequence_parallel`, the ``"sequence"`` / ``"sequence_split"`` regions run on this rank's
    part of dimension `sequence_dim` (their parameters are marked `mark_sequence_parallel`), column-
    parallel and vocabulary heads gather their input along it, and row-parallel layers reduce-scatter
    their output along it. Without it those two styles act as ``"replicate"``.

    With `undo` (a `PlanUndo`), what it replaced and hooked is recorded there, for `PlanUndo.restore` to
    give the model its own modules back, and the replaced modules' parameters go to the meta device.
    With `trail` (a `SplitTrail`), forward hooks record the last layer whose output is split, for errors.

    Returns:
        the split parameters' `ShardSpec` by their key in ``model.state_dict()`` (tied parameters
        under each of their keys).

    Raises:
        ValueError: a pattern matches no module, an unknown style, a style on a module type it does not
            apply to, sizes or heads not divisible by the tensor size, tied parameters with different
            styles, or a model that already holds split parameters. The model is left untouched.
    """
    rules = parse_plan(plan)
    size = group_size(group)
    already = [n for n, p in model.named_parameters() if spec_of(p) is not None]
    if already:
        raise ValueError(f"apply_plan: the model already holds tensor-parallel parameters ({already[0]}, ...); "
                         "apply a plan once, to the plain model")

    # 1. Match: the first pattern wins; every pattern must match something.
    styles: dict[str, tuple[nn.Module, str, int]] = {}
    matched = set()
    for name, module in model.named_modules():
        for pattern, style, chunks in rules:
            if name and fnmatchcase(name, pattern):
                matched.add(pattern)
                if not sequence_parallel and style in ("sequence", "sequence_split"):
                    style = "replicate"
                styles[name] = (module, style, chunks)
                break
    unmatched = [pattern for pattern, _, _ in rules if pattern not in matched]
    if unmatched:
        raise ValueError(f"tensor_parallel_plan: pattern {unmatched[0]!r} matches no module of the model "
                         f"({type(model).__name__}; module names look like {_examples(model)})")
    if sequence_parallel and size > 1 and not any(style == "sequence_split" for _, style, _ in styles.values()):
        # Without a start the input is never split: every tensor rank would see the whole sequence, and the
        # colwise layers' gathers along the sequence would train on it T times over (silently wrong numbers).
        raise ValueError("sequence_parallel=True needs a module styled 'sequence_split' in tensor_parallel_plan: "
                         "the sequence-parallel region starts there (its input, the whole sequence, is split "
                         "along dimension {}), e.g. the embedding's dropout, or an nn.Identity placed before the "
                         "first block; {} has none. Add one, or leave sequence_parallel off"
                         .format(sequence_dim, type(model).__name__))

    # 2. Check every module, then the ties, before changing anything.
    for name, (module, style, chunks) in styles.items():
        _check(model, name, module, style, chunks, size)
    _check_ties(model, styles)

    # 3. Build the replacements (the model is not touched yet); tied parameters become one.
    built: dict[str, nn.Module] = {}
    local_of: dict[int, nn.Parameter] = {}
    for name, (module, style, chunks) in styles.items():
        new = _build(module, style, chunks, group, sequence_parallel, sequence_dim)
        if new is None:
            continue
        new.plan_name = name  # (for its errors)
        for pname, param in module._parameters.items():
            if param is None:
                continue
            if pname not in new._parameters:
                raise RuntimeError(f"{type(new).__name__} built from {name} has no parameter {pname!r}")
            if id(param) in local_of:
                first = local_of[id(param)]
                if spec_of(first) != spec_of(new._parameters[pname]):
                    raise ValueError(f"tensor_parallel_plan: {name}.{pname} is tied to another module's parameter "
                                     f"that is split differently ({spec_of(first)} vs "
                                     f"{spec_of(new._parameters[pname])})")
                setattr(new, pname, first)
            else:
                local_of[id(param)] = new._parameters[pname]
        built[name] = new

    # 4. Install them at every name the module has, mark the sequence regions, keep the head's loss.
    entry = SequenceEntry(sequence_dim)
    checked = [new for new in built.values() if isinstance(new, ColumnParallelLinear) and new.sequence_parallel]
    for new in checked:
        new.sequence_entry = entry
    names_of: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(name)
    specs: dict[str, ShardSpec] = {}
    for name, (module, style, _) in styles.items():
        new = built.get(name, module)
        for place in names_of[id(module)]:
            if new is not module:
                (undo or PlanUndo()).replace(model, place, module, new)
            for pname, param in new._parameters.items():
                if param is not None and spec_of(param) is not None:
                    specs[f"{place}.{pname}"] = spec_of(param)
        if style in ("sequence", "sequence_split"):
            for param in new.parameters():
                if spec_of(param) is None:
                    mark_sequence_parallel(param)
        hooks = undo.hooks if undo is not None else []
        if style == "sequence_split":
            hooks.append(new.register_forward_pre_hook(_split_input(group, sequence_dim, entry)))
        if style == "sequence" and checked:
            hooks.append(new.register_forward_pre_hook(_part_input(group, sequence_dim, entry)))
        if style == "vocab" and _is_linear(module):
            spec = spec_of(new.weight)
            setattr(new, _LOSS, VocabParallelLoss(group, spec.rank * spec.part if spec is not None else 0))
        if trail is not None and isinstance(new, (ColumnParallelLinear, RowParallelLinear)):
            hooks.append(new.register_forward_hook(trail.hook(name, style, new)))
    if trail is not None:
        hooks = undo.hooks if undo is not None else []
        hooks.append(model.register_forward_pre_hook(trail.reset))
        hooks.append(model.register_forward_hook(trail.finished))
    if undo is not None:
        undo.free_originals()
    return specs


def parse_plan(plan: Mapping[str, Style]) -> list[tuple[str, str, int]]:
    """`plan`'s entries as ``(pattern, style, chunks)`` in its order (``chunks`` 1 but for
    ``("colwise", chunks)``). Raises TypeError (not a mapping) or ValueError naming the entry (an empty
    or non-string pattern, an unknown style, a malformed fused style)."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"tensor_parallel_plan must be a mapping of module-name patterns to styles, got "
                        f"{type(plan).__name__}")
    rules = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"tensor_parallel_plan: a pattern must be a non-empty string, got {pattern!r}")
        chunks = 1
        if isinstance(style, (tuple, list)):
            if (len(style) != 2 or style[0] != "colwise" or not isinstance(style[1], int)
                    or isinstance(style[1], bool) or style[1] < 1):
                raise ValueError(f"tensor_parallel_plan[{pattern!r}]: {style!r} is not a style; a fused "
                                 "projection is ('colwise', chunks) with an integer chunks >= 1")
            style, chunks = style
        if style not in STYLES:
            raise ValueError(f"tensor_parallel_plan[{pattern!r}]: unknown style {style!r}; expected one of "
                             f"{list(STYLES)} or ('colwise', chunks)")
        rules.append((pattern, style, chunks))
    return rules


def _examples(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n][:4]
    return ", ".join(repr(n) for n in names) + (", ..." if names else "(none)")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D."""
    return linear_shape(module, "apply_plan")[:2]


_APPLIES_TO = {"colwise": "nn.Linear or Conv1D", "rowwise": "nn.Linear or Conv1D",
               "vocab": "nn.Embedding, or an output nn.Linear or Conv1D"}


def _check(model: nn.Module, name: str, module: nn.Module, style: str, chunks: int, size: int) -> None:
    kind = type(module).__name__
    where = f"tensor_parallel_plan: {name} ({kind}, style {style!r})"
    if style in _APPLIES_TO:
        fits = _is_linear(module) or (style == "vocab" and isinstance(module, nn.Embedding))
        if not fits:
            raise ValueError(f"tensor_parallel_plan: style {style!r} cannot apply to {name} ({kind}); it applies "
                             f"to an {_APPLIES_TO[style]}")
    if style == "colwise":
        out = _features(module)[1]
        if out % (chunks * size):
            blocks = f" ({chunks} blocks of {out // chunks})" if chunks > 1 else ""
            raise ValueError(f"{where}: output features {out}{blocks} do not split into T={size} equal parts")
    elif style == "rowwise":
        fan_in = _features(module)[0]
        if fan_in % size:
            raise ValueError(f"{where}: input features {fan_in} do not split into T={size} equal parts")
    elif style == "vocab":
        vocab = module.num_embeddings if isinstance(module, nn.Embedding) else _features(module)[1]
        if vocab % size:
            raise ValueError(f"{where}: vocabulary size {vocab} does not split into T={size} equal parts")
        if isinstance(module, nn.Embedding):
            for option, off in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
                if getattr(module, option) != off:
                    raise ValueError(f"{where}: nn.Embedding's {option}={getattr(module, option)!r} needs the whole "
                                     "vocabulary on one rank; turn it off, or leave the embedding out of the plan "
                                     "(replicated)")
    if style in ("colwise", "rowwise"):
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        for attribute in _HEAD_ATTRIBUTES:
            heads = getattr(parent, attribute, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % size:
                raise ValueError(f"{where}: its attention {parent_name or '(the model)'} has {attribute}={heads} "
                                 f"heads, which do not split between T={size} ranks")
        # Head counts may live elsewhere (Hugging Face's Llama keeps them in its config), but an attention
        # with a `head_dim` shows whether this rank's part of a projection is a whole number of heads
        # (grouped key/value heads fewer than T would otherwise fail in the first forward's reshape).
        head_dim = getattr(parent, "head_dim", None)
        fan_in, out = _features(module)
        if style == "colwise" and chunks == 1:
            _check_not_fused(where, parent_name, parent, out, size)
        width = out // chunks if style == "colwise" else fan_in
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0 and (width // size) % head_dim:
            what = (f"output features {out}" + (f" ({chunks} blocks of {width})" if chunks > 1 else "")
                    if style == "colwise" else f"input features {fan_in}")
            raise ValueError(f"{where}: its {what} split between T={size} ranks give {width // size} a rank, not "
                             f"a whole number of heads of head_dim={head_dim} (its attention {parent_name or '(the model)'} "
                             f"has {width // head_dim} heads there, which do not split between T={size} ranks)")


def _check_not_fused(where: str, parent_name: str, parent: nn.Module, out: int, size: int) -> None:
    """A plain 'colwise' on the fused q/k/v projection of an attention whose layout is known to be
    ``[q | k | v]`` (our GPT's ``qkv``, Hugging Face GPT-2's ``c_attn``): a plain split gives rank 0 all of q
    and part of k, silently wrong numbers (2.5e-3 off one process after a step); ``("colwise", 3)`` splits
    each block by heads. Other models lay fused projections out otherwise (Bloom and GPTBigCode per head,
    where a plain split is right; grouped key/value heads in blocks of unequal size), so only these two
    are checked: a rule on sizes alone refused right plans and advised wrong ones (a review)."""
    from ..models.gpt import CausalSelfAttention

    known = isinstance(parent, CausalSelfAttention) or type(parent).__name__ == "GPT2Attention"
    heads, head_dim = getattr(parent, "n_head", None) or getattr(parent, "num_heads", None), getattr(parent, "head_dim", None)
    if not known or size == 1 or not isinstance(heads, int) or not isinstance(head_dim, int):
        return
    if out == 3 * heads * head_dim:
        raise ValueError(f"{where}: the fused q, k and v of its attention {parent_name or '(the model)'} ({out} "
                         f"output features, 3 blocks of {heads} heads x head_dim {head_dim}), which a plain split would "
                         "cut across the blocks (rank 0 all of q and part of k); give it ('colwise', 3), which splits "
                         "each block by heads")


def _check_ties(model: nn.Module, styles: dict[str, tuple[nn.Module, str, int]]) -> None:
    """A parameter held by several modules must be split the same way in each."""
    holders: dict[int, list[tuple[str, tuple[str, int], nn.Module]]] = {}
    for name, module in model.named_modules():
        _, style, chunks = styles.get(name, (module, "replicate", 1))
        for pname, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((f"{name}.{pname}" if name else pname, (style, chunks),
                                                          module))
    for uses in holders.values():
        (first, style, _), *others = uses
        for other, other_style, _ in others:
            if other_style == style:
                continue
            message = (f"tensor_parallel_plan: {first} and {other} are one (tied) parameter but their modules have "
                       f"the styles {_show(style)} and {_show(other_style)}")
            # A holder no style can split (a parameter of its own on a module that is no Linear or Embedding,
            # as BERT's prediction head holds its decoder's bias): the split one must stay whole.
            whole = [(n, m) for n, _, m in uses if not (_is_linear(m) or isinstance(m, nn.Embedding))]
            if whole:
                held, module = whole[0]
                split = [n.rpartition(".")[0] or n for n, st, _ in uses if st[0] not in ("replicate", "sequence")]
                raise ValueError(f"{message}; {held} belongs to a {type(module).__name__}, which no style splits "
                                 "(only nn.Linear, Conv1D and nn.Embedding modules are), so leave "
                                 f"{' and '.join(split)} out of the plan (replicated), or untie the parameter")
            raise ValueError(f"{message}; give both the same style (a tied embedding and output head: 'vocab' on "
                             "both)")


def _show(style: tuple[str, int]) -> str:
    return repr(style[0]) if style[1] == 1 else repr(style)


def _build(module: nn.Module, style: str, chunks: int, group: Any, sequence_parallel: bool,
           sequence_dim: int) -> nn.Module | None:
    """The parallel layer replacing `module`, or None when it stays."""
    sp = {"sequence_parallel": sequence_parallel, "sequence_dim": sequence_dim}
    if style == "colwise":
        return ColumnParallelLinear.from_module(module, group, chunks=chunks, **sp)
    if style == "rowwise":
        return RowParallelLinear.from_module(module, group, **sp)
    if style == "vocab":
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_module(module, group)
        return ColumnParallelLinear.from_module(module, group, **sp)
    if style in ("sequence", "sequence_split") and isinstance(module, nn.Dropout):
        return SequenceParallelDropout.from_module(module, group, sequence_dim=sequence_dim)
    return None


def _split_input(group: Any, dim: int, entry: "SequenceEntry") -> Callable:
    """A forward pre-hook: the module's first input split along the sequence (bwd all-gather), its
    length recorded in `entry`."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        size = group_size(group)
        if size > 1 and args[0].dim() > dim:
            entry.began(args[0].shape[dim], size, split=True)
        return (split_sequence(args[0], group, dim), *args[1:])

    return hook


def _part_input(group: Any, dim: int, entry: "SequenceEntry") -> Callable:
    """A forward pre-hook of a 'sequence' module: its input is this rank's part of the sequence. Where the
    'sequence_split' module never runs in this process (a pipeline's later stage), its length gives the
    whole sequence's to `entry`."""

    def hook(module: nn.Module, args: tuple) -> None:
        if not entry.split_seen and args and isinstance(args[0], torch.Tensor) and args[0].dim() > dim:
            size = group_size(group)
            if size > 1:
                entry.began(args[0].shape[dim] * size, size, split=False)

    return hook


class SplitTrail:
    """The last parallel layer of a forward whose output is left split by feature (a 'colwise' layer
    not yet met by its 'rowwise' partner, a 'vocab' head), for a forward that then fails on a shape: a
    plan whose 'colwise' layer feeds a layer it does not split, or whose 'vocab' layer is not the output
    head, hands that layer 1/T of the features it expects, and torch's error ("mat1 and mat2 shapes
    cannot be multiplied") names neither the layer nor the plan (`explain`)."""

    def __init__(self) -> None:
        self.split: tuple[str, str] | None = None

    def reset(self, module: nn.Module, args: Any) -> None:  # (the model's forward pre-hook)
        if not torch.compiler.is_compiling():
            self.split = None

    def hook(self, name: str, style: str, layer: nn.Module) -> Callable:
        whole = isinstance(layer, RowParallelLinear) or getattr(layer, "gather_output", False)

        def ran(module: nn.Module, args: Any, out: Any) -> None:
            if not torch.compiler.is_compiling():  # (no side effect in a compiled graph; its errors differ anyway)
                self.split = None if whole else (name, style)
        return ran

    def finished(self, module: nn.Module, args: Any, out: Any) -> None:  # (the model's forward hook)
        """A forward that returns a 'colwise' layer's split output (no 'rowwise' layer took it): the loss
        would read this rank's part of the features as the whole (silently, where the targets fit it)."""
        if self.split is not None and self.split[1] == "colwise" and not torch.compiler.is_compiling():
            raise ValueError(
                f"tensor_parallel_plan: the model's output comes from {self.split[0]} ('colwise') with no 'rowwise' "
                "layer after it, so it holds this rank's part of the features only: give that layer's partner "
                "'rowwise', or leave the output layer out of the plan (replicated; 'vocab' for a language "
                "model's head, whose logits the vocabulary-parallel loss reads)")

    def explain(self, err: BaseException) -> BaseException | None:
        """`err` (a shape error after a split output) told with the layer and the plan, else None (also
        for the vocabulary-parallel loss's own errors: the targets, not the plan)."""
        if self.split is None or type(err) not in (RuntimeError, ValueError):
            return None
        if (not any(word in str(err) for word in ("shape", "size", "values to unpack"))
                or _raised_in(err, "vocab_parallel_cross_entropy")):
            return None
        name, style = self.split
        return type(err)(
            f"{err} (tensor parallelism: the last split layer to run before this error was {name} ({style!r}), "
            "whose output holds this rank's part of its features only. If the plan is the cause: a 'colwise' "
            "layer must feed a 'rowwise' one, which gives the whole output back; 'vocab' splits only the output "
            "head, whose logits go to the loss; and an attention that reads its head count or width from "
            "attributes must be given this rank's (num_heads / T; HF GPT-2's num_heads, split_size and "
            "embed_dim): see docs/tensor_parallel.md)")


def _raised_in(err: BaseException, function: str) -> bool:
    """Whether `err`'s traceback passes through a function of that name."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


class SequenceEntry:
    """Where the sequence-parallel region began last (the 'sequence_split' module's input; on a pipeline's
    later stage, which receives its part, a 'sequence' module's input times the tensor size): the whole
    sequence's length, which a column-parallel layer's input must not have along the sequence, where it
    holds this rank's part. A model that reshapes inside the region (Hugging Face GPT-2 views the output
    of `ln_f` as ``(-1, S, C)``, which turns ``(B, S / T, C)`` into ``(B / T, S, C)``) would have the
    layer gather the rows of other sequences as its own: wrong numbers from the first step, raised
    instead. Not where that length is also a part of a recent start's (an encoder-decoder whose decoder's
    whole length is the encoder's part, met in its cross-attention; a recomputed pass of an earlier
    input): a reshape is caught at the first step, where no such coincidence is.

    Eager forwards only: inside a compiled graph this bookkeeping would be guarded on (the recent parts'
    count), so that each new sequence length recompiled the model, past dynamic shapes, until torch's
    recompile limit ran it eagerly; a compiled model's reshape fails in the layer's own shapes instead."""

    RECENT = 16

    def __init__(self, dim: int) -> None:
        self.dim, self.length, self.parts = dim, None, collections.deque(maxlen=self.RECENT)
        self.split_seen = False  # whether the 'sequence_split' module ran in this process (else: a later stage)

    def began(self, length: int, size: int, split: bool) -> None:
        """The whole sequence's `length` over `size` ranks, from the split's input (`split`) or, where no
        split runs, from a 'sequence' module's part."""
        if torch.compiler.is_compiling():
            return
        self.split_seen |= split
        self.length = length
        if not self.parts or self.parts[-1] != length // size:
            self.parts.append(length // size)

    def check(self, x: torch.Tensor, layer: nn.Module) -> None:
        if (not torch.compiler.is_compiling() and self.length is not None and x.dim() > self.dim and x.shape[self.dim] == self.length
                and self.length not in self.parts):
            raise RuntimeError(
                f"sequence parallelism: the input of {type(layer).__name__} ({layer.extra_repr()}) has shape "
                f"{tuple(x.shape)}, the whole sequence ({self.length}) along dimension {self.dim}, where this rank's "
                f"part of it was expected: the model reshaped the sequence-parallel activations on the way (e.g. "
                f"Hugging Face GPT-2's view(-1, seq_len, hidden) after ln_f), which mixes the batch's sequences. "
                "Leave sequence_parallel off for this model, or end the sequence-parallel region before the reshape")
