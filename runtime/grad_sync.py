"""Gradient synchronisation and the optimizer step of one rank.

* :class:`TiedSync`: a weight read on several stages (the tied embedding / LM head) has one copy
  per stage; the gradients of the copies are summed (locally for copies on this rank, then an
  all-reduce over the pipeline's first and last ranks when they are the holders, as for a GPT,
  else over the whole pipeline group with zeros from non-holders) and written back to every
  copy, so identical copies with identical optimizer states stay identical.
* :func:`all_reduce_buckets`: data-parallel gradient average in flat buckets of about
  ``bucket_bytes`` (fewer, larger messages). It runs after the whole backward of the step (no
  overlap with backward yet: a backward hook per bucket would add that).
* :class:`ZeroAdamW`: ZeRO stage 1: every dp rank keeps the AdamW state of one contiguous shard
  of the flattened parameters, steps it, and all-gathers the updated shards. AdamW is elementwise,
  so this gives the same parameters as an unsharded AdamW. Gradients are still all-reduced in full
  (a reduce-scatter would halve that traffic; not done yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 2**20


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of ``modules``, each once, in a deterministic order."""
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def fill_missing_grads(params: Sequence[nn.Parameter]) -> None:
    """Zero gradients for parameters backward did not reach, so every rank sends the same buckets."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def all_reduce_buckets(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int, *,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Average ``p.grad`` over the ``size`` ranks of ``group`` in flat buckets; returns the bucket count.

    Every rank of the group must pass the same parameter shapes in the same order.
    """
    if size == 1:
        return 0
    buckets: list[list[nn.Parameter]] = [[]]
    filled = 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if buckets[-1] and (filled + nbytes > bucket_bytes or p.grad.dtype != buckets[-1][0].grad.dtype):
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += nbytes
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
    return len(buckets)


@dataclass
class TiedCopies:
    """The copies of one tied weight on this rank and the group to sum their gradients over
    (``None`` when every copy is on this rank). A rank of the group holding no copy (a middle
    stage, when the group is the whole pipeline) contributes zeros of ``shape``/``dtype``."""

    name: str
    copies: list[nn.Parameter]
    group: dist.ProcessGroup | None
    shape: tuple[int, ...]
    dtype: torch.dtype


class TiedSync:
    """Sum the gradients of every tied weight's copies across stages (see the module docstring)."""

    def __init__(self, tied: Sequence[TiedCopies], device: torch.device | str = "cpu"):
        self.tied = list(tied)
        self.device = device

    def __call__(self) -> None:
        for t in self.tied:
            total = torch.zeros(t.shape, dtype=t.dtype, device=self.device)
            for p in t.copies:
                total += p.grad
            if t.group is not None:
                dist.all_reduce(total, group=t.group)
            for p in t.copies:
                p.grad.copy_(total)


class ZeroAdamW:
    """AdamW whose state is sharded over the dp group (ZeRO-1); same results as ``torch.optim.AdamW``.

    Call :meth:`step` after the gradients are averaged over dp (every rank holds full gradients).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, rank: int, size: int,
                 **adamw_kwargs):
        self.params = list(params)
        self.group, self.rank, self.size = group, rank, size
        total = sum(p.numel() for p in self.params)
        self.shard_numel = -(-total // size)  # padded: every shard the same length for all_gather
        self.padded = self.shard_numel * size
        flat = self._flatten([p.detach() for p in self.params])
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(flat[lo:lo + self.shard_numel].clone())
        self.optimizer = torch.optim.AdamW([self.shard], **adamw_kwargs)

    def _flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.padded - flat.numel()))

    @torch.no_grad()
    def step(self) -> None:
        lo = self.rank * self.shard_numel
        self.shard.grad = self._flatten([p.grad for p in self.params])[lo:lo + self.shard_numel].clone()
        self.optimizer.step()
        if self.size > 1:
            shards = [torch.empty_like(self.shard) for _ in range(self.size)]
            dist.all_gather(shards, self.shard.detach(), group=self.group)
            flat = torch.cat(shards)
        else:
            flat = self.shard.detach()
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (exp_avg and exp_avg_sq of its shard)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
