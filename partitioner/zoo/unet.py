"""A U-Net-style CNN (Ronneberger et al. 2015) for per-pixel classification, with long skips.

The encoder is ``depth`` down blocks (2x2 max pool, then two conv3x3-BN-ReLU, doubling the
channels), the decoder ``depth`` up blocks (a 2x2 stride-2 transposed conv halving the channels,
concatenation with the encoder feature of the same resolution, then two conv3x3-BN-ReLU); a
conv3x3 stem before and a 1x1 conv head after. All down and up blocks sit in one ``blocks``
list, so the layer chain (``annotate_blocks``) holds them in order; the skips make every
encoder output live until its decoder block reads it, so no cut point falls inside the U.

BatchNorm runs in training mode, so the captured step also updates its running-stat buffers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from passes.ir.errors import ModelSpecError
from passes.ir.meta import InputSpec
from partitioner.inputs.model_spec import ModelSpec
from partitioner.zoo.registry import register
from partitioner.inputs.spec_keys import COUNT, SpecTable


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = _double_conv(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = _double_conv(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, *, depth: int, width: int, channels: int, classes: int):
        super().__init__()
        self.depth = depth
        self.stem = _double_conv(channels, width)
        widths = [width * 2 ** i for i in range(depth + 1)]
        self.blocks = nn.ModuleList([Down(widths[i], widths[i + 1]) for i in range(depth)]
                                    + [Up(widths[i + 1], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.stem(x)]
        for down in self.blocks[:self.depth]:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.blocks[self.depth:]:
            x = up(x, skips.pop())
        return self.head(x)


def segment_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-pixel cross-entropy of the class logits against ``labels`` (batch, image, image)."""
    return F.cross_entropy(model(images), labels)


@register("unet", "U-Net-style CNN with long skips: depth (down/up blocks), width (stem channels), image, "
                  "channels, classes, batch",
          keys=SpecTable(keys={"depth": COUNT, "width": COUNT, "image": COUNT, "channels": COUNT, "classes": COUNT,
                               "batch": COUNT}))
def build_unet(depth: int = 2, width: int = 8, image: int = 16, channels: int = 3, classes: int = 3,
               batch: int = 2) -> ModelSpec:
    if image % 2 ** depth:
        raise ModelSpecError(f"unet: image={image} must be divisible by 2**depth = {2 ** depth} (each down block "
                             f"halves it); use image={2 ** depth * max(1, image // 2 ** depth)} or a smaller depth")
    module = UNet(depth=depth, width=width, channels=channels, classes=classes)
    inputs = (
        InputSpec(name="images", shape=("batch", channels, image, image), dtype=torch.float32),
        InputSpec(name="labels", shape=("batch", image, image), dtype=torch.long, high=classes),
    )
    return ModelSpec(name="unet", module=module, inputs=inputs, loss=segment_loss, dims={"batch": batch})
