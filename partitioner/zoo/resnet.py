"""A ResNet-style CNN (He et al. 2016, CIFAR layout): a conv3x3-BN-ReLU stem, stages of basic
residual blocks (two conv3x3-BN with an identity or 1x1-conv shortcut), each stage after the
first halving the resolution with stride 2, global average pooling, and a linear classifier.

BatchNorm runs in training mode, so the captured step also updates its running-stat buffers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from passes.ir.errors import ModelSpecError
from partitioner.inputs.model_spec import ModelSpec
from partitioner.zoo.registry import register
from passes.ir.meta import InputSpec
from partitioner.inputs.spec_keys import COUNT, Key, SpecTable


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, *, blocks: list[int], widths: list[int], classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        stages = []
        c_in = widths[0]
        for i, (n, c) in enumerate(zip(blocks, widths)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(*(BasicBlock(c_in if j == 0 else c, c, stride if j == 0 else 1)
                                          for j in range(n))))
            c_in = c
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(widths[-1], classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.fc(x.mean(dim=(2, 3)))  # global average pool


def classify_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(images), labels)


def _int_list(value: int | str, key: str) -> list[int]:
    """``16`` or ``"16-32-64"`` (dashes: a spec's items are already split on commas)."""
    try:
        out = [value] if isinstance(value, int) else [int(v) for v in str(value).split("-")]
    except ValueError:
        raise ModelSpecError(f"resnet: {key}={value!r} must be an int or dash-separated ints, e.g. {key}=2-2-2") from None
    if not out or min(out) < 1:
        raise ModelSpecError(f"resnet: {key}={value!r} must hold positive ints")
    return out


@register("resnet", "ResNet-style CNN: blocks (per stage, e.g. 2-2-2), widths (e.g. 16-32-64), image, classes, batch",
          keys=SpecTable(keys={"blocks": Key(kind="ints", ge=1), "widths": Key(kind="ints", ge=1), "image": COUNT,
                               "classes": COUNT, "batch": COUNT}))
def build_resnet(blocks: int | str = "2-2", widths: int | str = "16-32", image: int = 32, classes: int = 10,
                 batch: int = 2) -> ModelSpec:
    block_list, width_list = _int_list(blocks, "blocks"), _int_list(widths, "widths")
    if len(width_list) == 1:
        width_list = [width_list[0] * 2 ** i for i in range(len(block_list))]  # double per stage
    if len(block_list) == 1:
        block_list = block_list * len(width_list)
    if len(block_list) != len(width_list):
        raise ModelSpecError(f"resnet: blocks={blocks!r} and widths={widths!r} must name the same number of "
                             f"stages ({len(block_list)} != {len(width_list)})")
    module = ResNet(blocks=block_list, widths=width_list, classes=classes)
    inputs = (
        InputSpec(name="images", shape=("batch", 3, image, image), dtype=torch.float32),
        InputSpec(name="labels", shape=("batch",), dtype=torch.long, high=classes),
    )
    return ModelSpec(name="resnet", module=module, inputs=inputs, loss=classify_loss, dims={"batch": batch})
