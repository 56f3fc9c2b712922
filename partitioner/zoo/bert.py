"""BERT-style encoder: token + position + token-type embeddings, post-LN blocks (residual add, then
LayerNorm) with bidirectional attention and a 4h GeLU MLP, dropout, and a masked-LM head
(dense, GeLU, LayerNorm, decoder tied to the token embedding) with cross-entropy over the vocab.

The MLM loss here scores every position (no masking of inputs): the graph, FLOPs and memory of
a training step are the same as with a 15% mask, which only changes which labels count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.inputs.model_spec import ModelSpec

from partitioner.zoo.registry import register
from partitioner.zoo.gpt import DECODER_KEYS, init_weights
from passes.ir.meta import InputSpec

TOKEN_TYPES = 2  # segment A / segment B, as in BERT pre-training


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q = self.query(x).view(b, s, self.heads, d).transpose(1, 2)
        k = self.key(x).view(b, s, self.heads, d).transpose(1, 2)
        v = self.value(x).view(b, s, self.heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.attn = SelfAttention(hidden, heads, dropout)
        self.attn_drop = nn.Dropout(dropout)
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-12)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)
        self.mlp_drop = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn_drop(self.attn(x)))  # post-LN: normalise after the residual add
        return self.ln_2(x + self.mlp_drop(self.proj(F.gelu(self.fc(x)))))


class MLMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x))))


class Bert(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, vocab: int, seq: int, dropout: float):
        super().__init__()
        self.word_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq, hidden)
        self.type_emb = nn.Embedding(TOKEN_TYPES, hidden)
        self.emb_ln = nn.LayerNorm(hidden, eps=1e-12)
        self.emb_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.head = MLMHead(hidden, vocab)
        self.head.decoder.weight = self.word_emb.weight  # tied, as in BERT
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.emb_drop(self.emb_ln(self.word_emb(idx) + self.pos_emb(pos) + self.type_emb(token_types)))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlm_loss(model: nn.Module, idx: torch.Tensor, token_types: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the vocab logits at every position against ``labels``."""
    logits = model(idx, token_types)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


@register("bert", "BERT encoder with MLM head: layers, hidden, heads, vocab, seq (max positions), dropout, batch",
          keys=DECODER_KEYS)
def build_bert(layers: int = 2, hidden: int = 128, heads: int = 4, vocab: int = 1000, seq: int = 64,
               dropout: float = 0.1, batch: int = 2) -> ModelSpec:
    module = Bert(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, dropout=dropout)
    inputs = (
        InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=vocab),
        InputSpec(name="token_types", shape=("batch", "seq"), dtype=torch.long, high=TOKEN_TYPES),
        InputSpec(name="labels", shape=("batch", "seq"), dtype=torch.long, high=vocab),
    )
    return ModelSpec(name="bert", module=module, inputs=inputs, loss=mlm_loss, dims={"batch": batch, "seq": seq})
