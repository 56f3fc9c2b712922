"""The single-process reference every multi-rank parity test compares against: plain eager
PyTorch, the optimizer built over torch's own parameter groups of the module
(:func:`runtime.optim.optimizers.module_param_groups`: no weight decay on norms, biases, embeddings)."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from runtime.optim.optimizers import as_factory, module_param_groups


def train_one_device(spec, batches: Iterable[Sequence[torch.Tensor]], *, adamw: dict | None = None,
                     optimizer: Callable | None = None, lr_scheduler: Callable | None = None,
                     clip_grad_norm: float | None = None, norms: list | None = None,
                     lrs: list | None = None) -> tuple[list[float], nn.Module]:
    """Plain training of ``spec.module`` on ``batches``: (per-step losses, trained module).
    ``adamw``: AdamW's keyword arguments, or ``optimizer``: a factory of param groups;
    ``lr_scheduler``: a factory stepped after each step; ``clip_grad_norm``: torch's
    ``clip_grad_norm_`` before each step. ``norms``/``lrs``: lists to append each step's
    gradient norm (before clipping) and learning rate to."""
    module = spec.module
    opt = (optimizer or as_factory(adamw))(module_param_groups(module))
    scheduler = lr_scheduler(opt) if lr_scheduler is not None else None
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = spec.loss(module, *batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad_norm or float("inf"))
        if norms is not None:
            norms.append(float(norm))
        if lrs is not None:
            lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        if scheduler is not None:
            scheduler.step()
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
    by_id = {id(p): masters[n] for n, p in params.items()}
    groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in module_param_groups(module)]
    optimizer = torch.optim.AdamW(groups, **adamw)
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
