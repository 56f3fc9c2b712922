"""Llama-style decoder: RMSNorm, rotary position embedding (RoPE), grouped-query attention
(``kv_heads`` key/value heads shared by ``heads / kv_heads`` query heads each), a SwiGLU MLP, no
biases, and an untied LM head.

RoPE's cos/sin tables are computed in ``forward`` from ``torch.arange`` over the actual sequence
length, so export keeps ``seq`` symbolic and the model holds no buffers (nothing to materialise
after building on ``meta``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.inputs.model_spec import ModelSpec

from partitioner.zoo.registry import register
from partitioner.inputs.spec_keys import COUNT, Divisible, EvenQuotient, Key, SpecTable
from partitioner.zoo.gpt import init_weights, lm_loss
from passes.ir.meta import InputSpec


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` in plain ops (one graph node per step, no fused kernel)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int | torch.SymInt, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``(seq, head_dim)`` for the half-split (GPT-NeoX/Llama) rotation."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, heads, seq, head_dim)`` by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, hidden // heads, theta
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(s, self.head_dim, self.theta, x.device, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        # Expand + reshape rather than SDPA's enable_gqa so every backend and counter sees plain ops.
        rep = self.heads // self.kv_heads
        if rep == 1:
            return t
        b, kvh, s, d = t.shape
        return t[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, theta: float):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads, theta)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
                 intermediate: int, theta: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, intermediate, theta) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)  # untied, as in Llama 2/3
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def swiglu_intermediate(hidden: int, multiple_of: int = 32) -> int:
    """Llama's MLP width: 2/3 of 4*hidden (same parameters as a 4h GeLU MLP), rounded up."""
    raw = int(8 * hidden / 3)
    return multiple_of * ((raw + multiple_of - 1) // multiple_of)


@register("llama", "Llama decoder (RMSNorm, RoPE, GQA, SwiGLU): layers, hidden, heads, kv_heads, vocab, "
                   "seq, intermediate (default ~8/3*hidden), theta, batch",
          keys=SpecTable(
              keys={"layers": COUNT, "hidden": COUNT, "heads": COUNT, "kv_heads": COUNT, "vocab": COUNT, "seq": COUNT,
                    "intermediate": Key(kind="int", ge=0), "theta": Key(kind="float", gt=0), "batch": COUNT},
              rules=(Divisible("hidden", "heads"),
                     EvenQuotient("hidden", "heads", what="head dim", why="for RoPE (it rotates pairs)"),
                     Divisible("heads", "kv_heads", says="a multiple of"))))
def build_llama(layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2, vocab: int = 1000,
                seq: int = 64, intermediate: int = 0, theta: float = 10000.0, batch: int = 2) -> ModelSpec:
    module = Llama(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                   intermediate=intermediate or swiglu_intermediate(hidden), theta=theta)
    inputs = (
        InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=vocab),
        InputSpec(name="targets", shape=("batch", "seq"), dtype=torch.long, high=vocab),
    )
    return ModelSpec(name="llama", module=module, inputs=inputs, loss=lm_loss, dims={"batch": batch, "seq": seq})
