"""A GPT-style decoder-only language model, used by the examples, tests and benchmarks.

Pre-norm transformer blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), learned position embeddings, and an output projection tied to the token embedding (the
same `nn.Parameter` is used twice, which is what makes it a good test of shared-parameter handling).
Attention goes through `scaled_dot_product_attention`, which picks a fused kernel on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor.loss import parallel_loss

__all__ = ["GPTConfig", "GPT", "GPT_PRESETS"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model.

    Attributes:
        vocab_size: number of token ids.
        block_size: longest sequence (number of position embeddings).
        n_layer: transformer blocks.
        n_head: attention heads per block (`n_embd` must divide evenly).
        n_embd: width of the residual stream.
        dropout: dropout probability (0 for benchmarks and exact parity tests).
    """

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


GPT_PRESETS = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    The number of heads is read from the `qkv` projection's output width (``3 * heads * head_dim``,
    `head_dim` fixed by the config), so the same code runs whole and split by heads under tensor
    parallelism, where `qkv` yields only this rank's heads and `proj` takes their outputs. The
    sequence length is read from there too: under sequence parallelism `x` holds a part of the
    sequence and `qkv` gathers the rest.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 * width): width = n_embd whole, n_embd / tensor size when split
        B, T, width = qkv.shape
        width //= 3
        q, k, v = qkv.split(width, dim=2)
        # (B, T, width) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, width // self.head_dim, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, width))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """`forward(idx)` returns logits (B, T, vocab); `forward(idx, targets)` returns the mean loss.

    Under tensor parallelism (`distributed_training.tensor.gpt_plan`) the logits are this rank's
    vocabulary columns (B, T, vocab / T) and the loss is the vocabulary-parallel cross-entropy.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)
        # Residual projections scaled down with depth (GPT-2's initialisation).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        vocab_parallel = parallel_loss(self.lm_head)
        if vocab_parallel is not None:
            # A vocabulary-parallel head (tensor parallelism): the logits are this rank's columns;
            # the loss never gathers them (it computes in at least fp32 itself).
            return vocab_parallel(logits, targets)
        # The softmax in at least fp32, whatever the compute dtype.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
