"""The global gradient norm of a parallel step, and clipping by it.

Every rank holds a share of the model's gradient: a pipeline stage its layers, a tp rank its
shards (and a copy of each replicated parameter), a dp replica a copy of everything (under
ZeRO-1/2 a disjoint chunk), a tied weight one copy per stage that reads it. Each rank sums the
squares of its gradients, each tensor weighted so that the weighted sums over the whole mesh
count every element of the model's gradient exactly once (the weights are the caller's; see
``ParallelModel``), and one all-reduce over the mesh gives the norm on every rank, in float64.
Clipping then scales every local gradient by the same factor, as
``torch.nn.utils.clip_grad_norm_`` does on one device.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from runtime.dist import comm


def global_grad_norm(terms: Sequence[tuple[torch.Tensor, float]], group: dist.ProcessGroup | None,
                     device: torch.device) -> float:
    """sqrt(sum over the mesh of w * ||g||^2) for this rank's ``(g, w)`` terms (collective over
    ``group``; every rank gets the same float; inf/NaN when any gradient holds one)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    if terms:
        grads = [g for g, _ in terms]
        norms = torch._foreach_norm(grads, 2.0)  # one kernel per dtype and device, as clip_grad_norm_
        weights = torch.tensor([w for _, w in terms], dtype=torch.float64, device=device)
        total = (torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]) ** 2 * weights).sum()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        comm.all_reduce(total, group)
    value = float(total)
    return math.sqrt(value) if value >= 0 else float("nan")


@torch.no_grad()
def scale_grads(grads: Sequence[torch.Tensor | None], factor: float) -> None:
    """Multiply every gradient in place by ``factor``."""
    present = [g for g in grads if g is not None]
    if present:
        torch._foreach_mul_(present, factor)
