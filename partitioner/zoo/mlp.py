"""A plain multi-layer perceptron: ``layers`` hidden Linear+GeLU layers and a Linear output,
trained with mean-squared error on float targets (``loss=mse``) or cross-entropy on class
labels (``loss=ce``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from passes.ir.errors import ModelSpecError
from partitioner.inputs.model_spec import ModelSpec
from partitioner.zoo.registry import register
from partitioner.inputs.spec_keys import COUNT, Key, SpecTable
from partitioner.zoo.gpt import init_weights
from passes.ir.meta import InputSpec


class MLP(nn.Module):
    def __init__(self, *, layers: int, hidden: int, in_features: int, out_features: int):
        super().__init__()
        widths = [in_features] + [hidden] * layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.out = nn.Linear(widths[-1], out_features)
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.out(x)


def mse_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def ce_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


@register("mlp", "multi-layer perceptron: layers, hidden, in_features, out_features, loss (mse|ce), batch",
          keys=SpecTable(keys={"layers": Key(kind="int", ge=0), "hidden": COUNT, "in_features": COUNT,
                               "out_features": COUNT, "loss": Key(kind="str", choices=("mse", "ce")), "batch": COUNT}))
def build_mlp(layers: int = 2, hidden: int = 256, in_features: int = 64, out_features: int = 10,
              loss: str = "mse", batch: int = 8) -> ModelSpec:
    module = MLP(layers=layers, hidden=hidden, in_features=in_features, out_features=out_features)
    x = InputSpec(name="x", shape=("batch", in_features), dtype=torch.float32)
    if loss == "mse":
        target = InputSpec(name="y", shape=("batch", out_features), dtype=torch.float32)
        fn = mse_loss
    elif loss == "ce":
        target = InputSpec(name="y", shape=("batch",), dtype=torch.long, high=out_features)
        fn = ce_loss
    else:
        raise ModelSpecError(f"mlp: loss={loss!r} is not supported; use loss=mse or loss=ce")
    return ModelSpec(name="mlp", module=module, inputs=(x, target), loss=fn, dims={"batch": batch})
