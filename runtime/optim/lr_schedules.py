"""Learning-rate schedules: any ``torch.optim.lr_scheduler``, made by a factory from the torch
optimizer that steps (on every rank the same groups, :mod:`runtime.optim.optimizers`), stepped once
per optimizer step that was taken (a skipped fp16 or non-finite step does not advance it).

:func:`warmup_cosine` is the named preset: linear warm-up from ``lr * start_ratio`` towards
``lr`` over ``warmup_steps`` (step k of them at ``(k + 1) / (warmup_steps + 1)``, as torchtitan
warms up: no step at lr 0, none twice at the peak), then a half cosine from ``lr`` at step
``warmup_steps`` down to ``lr * min_ratio`` at ``total_steps`` (held there after), as GPT-3,
Llama and most of the field train.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from passes.ir.errors import ConfigError

SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1,
                         start_ratio: float = 0.0) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return start_ratio + (1.0 - start_ratio) * (step + 1) / (warmup_steps + 1)
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(warmup_steps: int, total_steps: int, *, min_ratio: float = 0.1,
                  start_ratio: float = 0.0) -> SchedulerFactory:
    """A factory of the warm-up + cosine schedule (a ``LambdaLR``, one lambda for every group)."""
    if warmup_steps < 0 or total_steps <= 0 or warmup_steps > total_steps:
        raise ConfigError(f"warmup_cosine: warmup_steps={warmup_steps}, total_steps={total_steps}; need "
                          f"0 <= warmup_steps <= total_steps and total_steps > 0")
    if not 0.0 <= min_ratio <= 1.0 or not 0.0 <= start_ratio <= 1.0:
        raise ConfigError(f"warmup_cosine: min_ratio={min_ratio}, start_ratio={start_ratio}; both lie in [0, 1]")

    def factor(step: int) -> float:
        return warmup_cosine_factor(step, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio,
                                    start_ratio=start_ratio)

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
