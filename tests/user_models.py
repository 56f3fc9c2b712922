"""Models as a user writes them, for tests that plan and lower what no zoo spec covers: a
ViT-style classifier (image input, no named sequence dim), and the analysed capture a job plans
from."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.compile.build import capture_training_step, run_analysis_passes
from partitioner.inputs.model_spec import ModelSpec
from passes.ir.meta import InputSpec


def captured(spec: ModelSpec):
    """The analysed capture a job plans from (as ``auto_parallelize`` makes it)."""
    return run_analysis_passes(capture_training_step(spec, device="cpu"), memory_batch=1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class _Block(nn.Module):
    """A pre-LN transformer encoder block (tensor parallelism shards its heads and MLP)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(hidden), _Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class _ViT(nn.Module):
    """Patch-embedding conv, encoder blocks, mean-pooled classifier head: its patch axis is not
    a named dim of any input."""

    def __init__(self, *, image: int = 16, patch: int = 4, hidden: int = 32, heads: int = 4, layers: int = 2,
                 classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, hidden))
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def _vit_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(images), labels)


def vit_spec() -> ModelSpec:
    torch.manual_seed(0)
    inputs = (InputSpec(name="images", shape=("batch", 3, 16, 16)),
              InputSpec(name="labels", shape=("batch",), dtype=torch.long, high=10))
    return ModelSpec(name="vit", module=_ViT(), inputs=inputs, loss=_vit_loss, dims={"batch": 2})
