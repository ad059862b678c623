"""Models for the tensor-parallel plan tests, each with the plan a user would write for it.

* `Llama`: a Llama-style stack (token embedding, RMSNorm, attention with separate q/k/v/o
  projections, grouped key/value heads and rotary position embedding, SwiGLU MLP, untied output
  head); `llama_plan()`.
* `token_mlp()`: an `nn.Sequential` of Linear-ReLU-Linear-LayerNorm-Linear-ReLU-Linear over tokens;
  `MLP_PLAN`, a user's plan over its indices.
* `HFGPT2`: the layout of Hugging Face's GPT-2 (`transformer.wte/wpe/h/ln_f`, `lm_head` tied to
  `wte`), with a stand-in for its `Conv1D` (weight stored [in, out]) and its attention's fused
  ``c_attn``; `hf_gpt2_plan()` and `hf_gpt2_localize`, the plan of docs/tensor_parallel.md (without
  sequence parallelism: like GPT2Model, `forward` views ln_f's output at the whole sequence length).

Their attention modules take the local number of heads from their projections (Llama) or from the
attributes the documented lines set (GPT-2), so the same code runs whole and split by heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# -- Llama ------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (B, heads, T, head_dim) by position along T (halves rotated)."""
    T, D = x.shape[-2], x.shape[-1]
    freqs = base ** (-torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D)
    angles = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * freqs[None, :]  # (T, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.q = nn.Linear(dim, n_head * self.head_dim, bias=False)
        self.k = nn.Linear(dim, n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(dim, n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(n_head * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # local heads only when split
        B, T, width = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (k, v))
        q, k = rotary(q), rotary(k)
        group = q.size(1) // k.size(1)  # query heads per key/value head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, width))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = LlamaAttention(dim, n_head, n_kv_head)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """`forward(idx)` -> logits (B, T, vocab), or this rank's vocabulary columns when split."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layer: int = 2, n_head: int = 8, n_kv_head: int = 4,
                 hidden: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.drop = nn.Identity()  # where the sequence-parallel region starts
        self.layers = nn.ModuleList(LlamaBlock(dim, n_head, n_kv_head, hidden) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def llama_plan() -> dict:
    return {
        "embed": "vocab",
        "drop": "sequence_split",
        "layers.*.attn_norm": "sequence",
        "layers.*.attn.[qkv]": "colwise",
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp_norm": "sequence",
        "layers.*.mlp.gate": "colwise",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
        "norm": "sequence",
        "output": "vocab",
    }


# -- an MLP over tokens, with a user's plan -----------------------------------------------------------

def token_mlp(d: int = 16, hidden: int = 32) -> nn.Sequential:
    """(B, T, d) -> (B, T, d); the leading Identity is where a sequence-parallel region can start."""
    return nn.Sequential(nn.Identity(), nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d), nn.LayerNorm(d),
                         nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))


MLP_PLAN = {"0": "sequence_split", "[15]": "colwise", "[37]": "rowwise", "4": "sequence"}


# -- Hugging Face GPT-2's layout -----------------------------------------------------------------------

class Conv1D(nn.Module):
    """Hugging Face's Conv1D: a linear layer with its weight stored [in, out] (`nf` = out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2Attention(nn.Module):
    """GPT-2's attention: the fused ``c_attn`` split at `split_size`, heads from `num_heads`."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.split_size = embed_dim
        self.c_attn = Conv1D(3 * embed_dim, embed_dim)
        self.c_proj = Conv1D(embed_dim, embed_dim)
        self.resid_dropout = nn.Dropout(0.0)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.size()[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)

    def _merge_heads(self, t: torch.Tensor) -> torch.Tensor:
        t = t.permute(0, 2, 1, 3).contiguous()
        return t.view(t.size()[:-2] + (self.num_heads * self.head_dim,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split_heads(t) for t in self.c_attn(x).split(self.split_size, dim=2))
        y = self._merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.resid_dropout(self.c_proj(y))


class GPT2MLP(nn.Module):
    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * embed_dim, embed_dim)
        self.c_proj = Conv1D(embed_dim, 4 * embed_dim)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.attn = GPT2Attention(embed_dim, num_heads)
        self.ln_2 = nn.LayerNorm(embed_dim)
        self.mlp = GPT2MLP(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class HFGPT2(nn.Module):
    """`forward(idx)` -> logits; `lm_head.weight is transformer.wte.weight`."""

    def __init__(self, vocab: int = 64, positions: int = 16, embed_dim: int = 32, n_layer: int = 2,
                 num_heads: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, embed_dim), wpe=nn.Embedding(positions, embed_dim), drop=nn.Dropout(0.0),
            h=nn.ModuleList(GPT2Block(embed_dim, num_heads) for _ in range(n_layer)), ln_f=nn.LayerNorm(embed_dim)))
        self.lm_head = nn.Linear(embed_dim, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in t.h:
            x = block(x)
        # As GPT2Model does: the output of ln_f viewed at the whole input's sequence length, which under
        # sequence parallelism (this rank's part of it there) regroups the rows instead of failing.
        x = t.ln_f(x).view((-1,) + idx.shape[1:] + (x.size(-1),))
        return self.lm_head(x)


def hf_gpt2_plan() -> dict:
    """The plan of docs/tensor_parallel.md for Hugging Face's GPT2LMHeadModel: tensor parallelism only
    (GPT2Model's reshape after ln_f rules out sequence parallelism, see `HFGPT2.forward`)."""
    return {
        "transformer.wte": "vocab",
        "transformer.h.*.attn.c_attn": ("colwise", 3),
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab",
    }


def hf_gpt2_localize(model: nn.Module, tensor_size: int) -> None:
    """The documented lines after `apply_plan`: each attention computes with its local heads."""
    for block in model.transformer.h:
        block.attn.num_heads //= tensor_size
        block.attn.split_size //= tensor_size
        block.attn.embed_dim //= tensor_size
