"""Megatron/nanoGPT-style GPT decoder: token + position embeddings, pre-LN blocks with fused QKV
attention and a 4h GeLU MLP, dropout, and an LM head tied to the token embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.inputs.model_spec import ModelSpec

from partitioner.zoo.registry import register
from partitioner.inputs.spec_keys import COUNT, DROPOUT, Divisible, SpecTable
from passes.ir.meta import InputSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, vocab: int, seq: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def init_weights(module: nn.Module) -> None:
    # GPT-2 initialisation: N(0, 0.02) weights, zero biases (on meta this allocates nothing).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; targets are the already-shifted labels."""
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


DECODER_KEYS = SpecTable(
    keys={"layers": COUNT, "hidden": COUNT, "heads": COUNT, "vocab": COUNT, "seq": COUNT, "dropout": DROPOUT,
          "batch": COUNT},
    rules=(Divisible("hidden", "heads"),), limits={"seq": "seq"})
"""The keys of the GPT decoder (and the BERT encoder, which takes the same)."""


@register("gpt", "GPT decoder: layers, hidden, heads, vocab, seq (max positions), dropout, batch", keys=DECODER_KEYS)
def build_gpt(layers: int = 2, hidden: int = 128, heads: int = 4, vocab: int = 1000, seq: int = 64,
              dropout: float = 0.1, batch: int = 2) -> ModelSpec:
    module = GPT(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, dropout=dropout)
    inputs = (
        InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=vocab),
        InputSpec(name="targets", shape=("batch", "seq"), dtype=torch.long, high=vocab),
    )
    return ModelSpec(name="gpt", module=module, inputs=inputs, loss=lm_loss, dims={"batch": batch, "seq": seq})
