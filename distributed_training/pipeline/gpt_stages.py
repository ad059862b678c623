"""One pipeline stage of our GPT: its chain layers (`GPTEmbedding`, the blocks, `GPTHead`), its loss on
the last stage's logits (`lm_loss`), and `GPTStages`, which constructs only one stage, with the weights
the whole model would have (each layer initialised from its own seed: `layer_seed`), so that no rank
ever materialises the whole model. The generic chain, cuts and ties are in `stages.py`.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import GPT, Block, GPTConfig
from .stages import Layers, Stage, TiedGroup, allocate, partition, split_at, tied_groups

__all__ = ["AttentionHalf", "GPTEmbedding", "GPTHead", "GPTStages", "MLPHalf", "gpt_chain", "gpt_key",
           "init_gpt_layers", "layer_seed", "lm_loss"]


# --------------------------------------------------------------------------------------------------
# The GPT's chain


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


class AttentionHalf(nn.Module):
    """The first residual half of a `Block`: ``x + drop(attn(ln1(x)))``, under the block's own attribute
    names (``ln1``, ``attn``), so that its parameters' keys are the block's."""

    def __init__(self, ln1: nn.LayerNorm, attn: nn.Module, drop: nn.Dropout) -> None:
        super().__init__()
        self.ln1, self.attn, self.drop = ln1, attn, drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.attn(self.ln1(x)))


class MLPHalf(nn.Module):
    """The second residual half of a `Block`: ``x + drop(mlp(ln2(x)))`` (``ln2``, ``mlp``)."""

    def __init__(self, ln2: nn.LayerNorm, mlp: nn.Module, drop: nn.Dropout) -> None:
        super().__init__()
        self.ln2, self.mlp, self.drop = ln2, mlp, drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(self.ln2(x)))


#: The suffixes of a block's two halves in a chain cut at half blocks (``block.3.a``, ``block.3.m``).
HALVES = ("a", "m")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on the last stage's logits: mean cross-entropy over the (B * T) tokens, the
    softmax in at least fp32 — exactly what ``GPT.forward(idx, targets)`` computes."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_chain(model: GPT, halves: bool = False) -> Layers:
    """Our GPT as a chain: ``embed``, ``block.0`` ... ``block.{n-1}``, ``head`` (what `chain` returns for it).
    With `halves`, each block is two layers, ``block.i.a`` (`AttentionHalf`) and ``block.i.m`` (`MLPHalf`),
    holding the block's own modules: together they compute exactly the block's forward."""
    # The wrappers hold the model's own modules: running the chain trains the model's parameters.
    blocks: Layers = []
    for i, block in enumerate(model.blocks):
        if halves:
            blocks += [(f"block.{i}.{HALVES[0]}", AttentionHalf(block.ln1, block.attn, block.drop)),
                       (f"block.{i}.{HALVES[1]}", MLPHalf(block.ln2, block.mlp, block.drop))]
        else:
            blocks.append((f"block.{i}", block))
    return [("embed", GPTEmbedding(model.wte, model.wpe, model.drop)), *blocks,
            ("head", GPTHead(model.ln_f, model.lm_head))]


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
        index, _, rest = rest.partition(".")
        half, _, inner = rest.partition(".")
        return f"blocks.{index}.{inner if half in HALVES else rest}"  # block.3.a.ln1.weight: a half block
    raise ValueError(f"key {key!r} is not a GPT chain key (embed.*, block.*, head.*)")


# The compute model of our GPT's layers (`gpt_layer_costs`). Units: the time of one forward FLOP of a
# large bf16 matmul (the MLP's), per token. The constants were fitted to one run (4x H200, GPT-1.3B, bf16,
# 8 microbatches of 2 x 1024 tokens, CUDA graphs, session 27: `pipeline_2026-11-28_4xh200_s27.md`), where
# each stage's forward and backward were timed at two cuts: an MLP half took 2.24 / 5.7 ms a step (forward
# / backward), an attention half 1.72 / 4.4, the head 11.46 / 19.1, the embedding 0.0 / 2.2.

#: The attention core (flash attention, 2 T C FLOPs a token forward) with the layer norm, dropout and
#: residual around it, per FLOP of that core: the attention half forwards in 0.77 of the MLP half's time
#: although its FLOPs are 0.56 of them.
ATTENTION_CORE_COST = 4.3
#: A block's backward over its forward (2 for matmuls alone; the attention's backward and the elementwise
#: work make it 2.54 for the MLP half and 2.56 for the attention half).
BACKWARD_RATIO = 2.55
#: The head's loss (`lm_loss`: the softmax over the vocabulary in fp32, memory-bound) per token and
#: vocabulary entry: forward and backward. It moves ~28 bytes a logit, which costs far more than its FLOPs.
LOSS_FLOPS_PER_LOGIT = 2730.0
LOSS_BACKWARD_PER_LOGIT = 930.0
#: The token embedding's backward writes a dense V x C gradient (and adds it into ``.grad``) once per
#: microbatch, whatever its tokens: the cost per entry of that table, per microbatch.
EMBED_BACKWARD_PER_ENTRY = 1300.0


def gpt_layer_costs(cfg: GPTConfig, seq: int | None = None, halves: bool = False, loss: bool = True,
                    microbatch_tokens: int | None = None) -> tuple[list[float], list[float]]:
    """(forward, backward) cost per token of each layer of the GPT's chain (``embed``, the blocks or their
    halves, ``head``), at sequence length `seq` (default `cfg.block_size`) with `microbatch_tokens` tokens
    per microbatch (default one sequence), in units of one forward matmul FLOP (see the constants above).

    * a block: its matmuls, 24 C^2 (qkv 6 C^2, the attention's projection 2 C^2, the MLP 16 C^2), and the
      causal attention core, 2 T C, weighted by `ATTENTION_CORE_COST`; with `halves` two entries, the
      attention half (8 C^2 + the core) and the MLP half (16 C^2). Backward: `BACKWARD_RATIO` times that.
    * ``head``: the vocabulary projection, 2 C V forward and `BACKWARD_RATIO` times it backward, plus (with
      `loss`, the default) the loss: `LOSS_FLOPS_PER_LOGIT` / `LOSS_BACKWARD_PER_LOGIT` x V.
    * ``embed``: a lookup forward (C: next to nothing); backward the dense gradient of the V x C token
      embedding, `EMBED_BACKWARD_PER_ENTRY` x V x C per microbatch, spread over its tokens.

    Fitted to one GPU and model (see above): the cut it gives is right where the ratios hold (wide GPTs on
    an H100 / H200 class GPU, bf16). Parameter counts, the trainer's default, weigh the tied embedding (a
    lookup) like the head (a matmul over the vocabulary); FLOPs alone miss the loss and the attention's
    elementwise work (with matmul FLOPs only, the last of 4 stages' forward took 29 ms against the others'
    25-26 in session 23); and a narrow model's step is bound by the host's kernel launches, which none of
    this sees (GPT-2 124M cut by FLOPs kept the first rank busy 151 ms a step and the last 38, 2x H200):
    ``pipeline_balance="time"`` measures instead."""
    C, T = cfg.n_embd, cfg.block_size if seq is None else seq
    tokens = T if microbatch_tokens is None else microbatch_tokens
    attention, mlp = 8.0 * C * C + ATTENTION_CORE_COST * 2.0 * T * C, 16.0 * C * C
    blocks = [attention, mlp] * cfg.n_layer if halves else [attention + mlp] * cfg.n_layer
    V = cfg.vocab_size
    head_f = 2.0 * C * V + (LOSS_FLOPS_PER_LOGIT * V if loss else 0.0)
    head_b = BACKWARD_RATIO * 2.0 * C * V + (LOSS_BACKWARD_PER_LOGIT * V if loss else 0.0)
    forward = [float(C), *blocks, head_f]
    backward = [EMBED_BACKWARD_PER_ENTRY * V * C / tokens, *(BACKWARD_RATIO * b for b in blocks), head_b]
    return forward, backward


def gpt_layer_flops(cfg: GPTConfig, seq: int | None = None, halves: bool = False, loss: bool = True) -> list[float]:
    """Each layer's forward cost per token (`gpt_layer_costs`' first list): the matmul FLOPs, the attention
    core weighted, and with `loss` the head's softmax."""
    return gpt_layer_costs(cfg, seq, halves=halves, loss=loss)[0]


class GPTStages:
    """Builds one pipeline stage of a `GPT`, without constructing the rest of the model.

    The chain is ``embed``, ``block.0`` ... ``block.{n_layer-1}``, ``head`` (as `chain(GPT(cfg))`).
    By default the stages are balanced by parameter count (`costs`: the token embedding counts in
    both ``embed`` and ``head``, which both use it); `split` (boundary names, `split_at`) or `costs`
    (e.g. `compute_costs()`, measured times) choose another cut.

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

    def __init__(self, cfg: GPTConfig, seed: int = 0, halves: bool = False) -> None:
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.seed = seed
        self.halves = bool(halves)
        self._costs: list[int] | None = None

    def layer_names(self) -> list[str]:
        """``embed``, ``block.0`` ... ``block.{n-1}``, ``head``; with `halves` each block is two layers,
        ``block.i.a`` (its attention half) and ``block.i.m`` (its MLP half), so stages can be cut
        between them: twice as fine a balance."""
        blocks = ([f"block.{i}.{h}" for i in range(self.cfg.n_layer) for h in HALVES] if self.halves
                  else [f"block.{i}" for i in range(self.cfg.n_layer)])
        return ["embed", *blocks, "head"]

    def _make(self, name: str) -> nn.Module:
        cfg = self.cfg
        if name == "embed":
            return GPTEmbedding(nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd),
                                nn.Dropout(cfg.dropout))
        if name == "head":
            return GPTHead(nn.LayerNorm(cfg.n_embd), nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))
        block = Block(cfg)
        if name.endswith(".a"):
            return AttentionHalf(block.ln1, block.attn, block.drop)
        if name.endswith(".m"):
            return MLPHalf(block.ln2, block.mlp, nn.Dropout(cfg.dropout))
        return block

    def compute_costs(self, seq: int | None = None, loss: bool = True,
                      microbatch_tokens: int | None = None) -> list[float]:
        """Each layer's forward + backward cost per token (`gpt_layer_costs`): pass as `costs` to balance
        by compute (or `step_costs` to `balance.schedule_cut`, for a schedule)."""
        forward, backward = self.step_costs(seq, loss, microbatch_tokens)
        return [f + b for f, b in zip(forward, backward)]

    def step_costs(self, seq: int | None = None, loss: bool = True,
                   microbatch_tokens: int | None = None) -> tuple[list[float], list[float]]:
        """(forward, backward) per layer: `gpt_layer_costs` of this chain."""
        return gpt_layer_costs(self.cfg, seq, halves=self.halves, loss=loss, microbatch_tokens=microbatch_tokens)

    def costs(self) -> list[int]:
        """Parameters per layer (counted on the meta device: nothing allocated), what the stages are
        balanced by by default; the tied token embedding counts in both ``embed`` and ``head``."""
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
        blocks = f"{self.cfg.n_layer} blocks" + (" in halves" if self.halves else "")
        if costs is not None and len(costs) != len(names):
            raise ValueError(f"costs has {len(costs)} entries, one per layer of the chain expected ({len(names)}: "
                             f"embed, {blocks}, head)")
        if num_stages > len(names):
            raise ValueError(f"num_stages ({num_stages}) exceeds the GPT's {len(names)} layers (embed, {blocks}, head)")
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
        layers: Layers = []
        for name in names:
            with torch.device("meta"):
                layer = self._make(name)
            if name == "head" and layers and layers[0][0] == "embed":
                layer.lm_head.weight = layers[0][1].wte.weight  # same stage: one parameter, two uses
            layers.append((name, layer))
        if device.type != "meta":
            allocate([layer for _, layer in layers], device)
            init_gpt_layers(layers, self.cfg.n_layer, self.seed, self.cfg)
        return Stage(layers, stage, num_stages)

    def model(self, device: torch.device | str = "cpu") -> GPT:
        """A whole `GPT` holding exactly the weights of ``build(0, 1, device)``: the single-process
        reference for a pipeline built with these stages (``GPT.forward(idx, targets)`` equals the
        chain followed by `lm_loss`)."""
        whole = self.build(0, 1, device)
        with torch.device("meta"):
            gpt = GPT(self.cfg)
        embed, head = whole.get_submodule("embed"), whole.get_submodule("head")
        gpt.wte, gpt.wpe, gpt.drop = embed.wte, embed.wpe, embed.drop
        gpt.blocks = nn.ModuleList(self._whole_block(whole, i) for i in range(self.cfg.n_layer))
        gpt.ln_f, gpt.lm_head = head.ln_f, head.lm_head  # lm_head.weight is wte.weight: one stage
        return gpt

    def _whole_block(self, whole: Stage, i: int) -> nn.Module:
        """Block i of a one-stage build, reassembled from its halves when the chain has them."""
        if not self.halves:
            return whole.get_submodule(f"block.{i}")
        attention, mlp = (whole.get_submodule(f"block.{i}.{h}") for h in HALVES)
        with torch.device("meta"):
            block = Block(self.cfg)
        block.ln1, block.attn, block.ln2, block.mlp, block.drop = attention.ln1, attention.attn, mlp.ln2, mlp.mlp, \
            attention.drop
        return block


def _seed_name(name: str) -> str:
    """The name a layer's generator is seeded with: a half block draws from its block's stream."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) == 3 and parts[0] == "block" and parts[2] in HALVES else name


def init_gpt_layers(layers: Layers, n_layer: int, seed: int, cfg: GPTConfig | None = None) -> None:
    """Initialise GPT chain layers that have storage (``embed``, ``block.i``, ``head``: `GPTStages`'
    layers, or `gpt_chain` of a `GPT` built on the meta device and given storage), by `GPTStages`'
    scheme: each layer from a generator on its device seeded with ``layer_seed(seed, name)``; the tied
    token embedding from its own generator (``layer_seed(seed, "embed.wte.weight")``), once per copy
    (a stage holding both ``embed`` and ``head`` holds one parameter). The one implementation of the
    scheme: `GPTStages.build` and the trainer's meta-device models both call it.

    Half blocks (``block.i.a``, ``block.i.m``) get exactly the whole block's weights: both draw from the
    block's generator, and the MLP half first draws, into scratch, what the attention half draws (the
    attention's shapes from `cfg`, needed then)."""
    tie_seed = layer_seed(seed, GPTStages.TIES[0][0])
    drawn: set[int] = set()
    with torch.no_grad():
        for name, layer in layers:
            tied = layer.wte.weight if name == "embed" else layer.lm_head.weight if name == "head" else None
            device = next(layer.parameters()).device
            generator = torch.Generator(device=device).manual_seed(layer_seed(seed, _seed_name(name)))
            if isinstance(layer, MLPHalf):
                if cfg is None:
                    raise ValueError(f"{name}: initialising a block's MLP half needs the model's cfg")
                with torch.device("meta"):  # no initialiser runs, the global stream is untouched
                    scratch = Block(cfg)
                attention = AttentionHalf(scratch.ln1, scratch.attn, scratch.drop)
                allocate([attention], device)
                _init_layer(attention, generator, n_layer, set())
                del scratch, attention
            _init_layer(layer, generator, n_layer, skip={id(tied)} if tied is not None else set())
            if tied is not None and id(tied) not in drawn:
                nn.init.normal_(tied, 0.0, 0.02, torch.Generator(device=device).manual_seed(tie_seed))
                drawn.add(id(tied))


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
