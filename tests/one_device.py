"""The single-process reference every multi-rank parity test compares against."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn


def train_one_device(spec, batches: Iterable[Sequence[torch.Tensor]], *, adamw: dict,
                     autocast_bf16: bool = False) -> tuple[list[float], nn.Module]:
    """Plain AdamW training of ``spec.module`` on ``batches``: (per-step losses, trained module)."""
    module = spec.module
    optimizer = torch.optim.AdamW(module.parameters(), **adamw)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = spec.loss(module, *batch)
        loss.float().backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, module
