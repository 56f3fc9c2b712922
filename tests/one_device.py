"""The single-process reference every multi-rank parity test compares against."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn


def train_one_device(spec, batches: Iterable[Sequence[torch.Tensor]], *, adamw: dict) -> tuple[list[float], nn.Module]:
    """Plain AdamW training of ``spec.module`` on ``batches``: (per-step losses, trained module)."""
    module = spec.module
    optimizer = torch.optim.AdamW(module.parameters(), **adamw)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = spec.loss(module, *batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, module


def train_one_device_16bit(spec, batches: Iterable[Sequence[torch.Tensor]], *, adamw: dict, dtype: torch.dtype,
                           loss_scale: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Textbook mixed precision (Micikevicius et al. 2018) in plain eager PyTorch: ``spec.module``
    cast to ``dtype``, AdamW on fp32 master copies, each master cast back after the step.
    ``loss_scale``: fp16's initial dynamic scale (halved and the step skipped on an inf/NaN
    gradient). Returns the per-step losses and the fp32 masters by parameter name."""
    module = spec.module.to(dtype)
    params = dict(module.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
    optimizer = torch.optim.AdamW(list(masters.values()), **adamw)
    scale = loss_scale or 1.0
    losses = []
    for batch in batches:
        batch = [t.to(dtype) if t.is_floating_point() else t for t in batch]
        module.zero_grad(set_to_none=True)
        loss = spec.loss(module, *batch)
        (loss.float() * scale).backward()
        grads = {n: p.grad.float() / scale for n, p in params.items() if p.grad is not None}
        losses.append(loss.item())
        if loss_scale is not None and not all(torch.isfinite(g).all() for g in grads.values()):
            scale /= 2  # skip this step
            continue
        for n, m in masters.items():
            m.grad = grads.get(n)
        optimizer.step()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
    return losses, {n: m.detach() for n, m in masters.items()}
