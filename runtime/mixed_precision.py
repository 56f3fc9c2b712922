"""bf16 mixed precision for the stage programs, with fp32 master weights.

The scheme is autocast: the parameters stay fp32 (they are the master weights the optimizer,
ZeRO and the gradient buckets see), and every stage forward runs under
``torch.autocast(device_type, dtype=torch.bfloat16)``, which casts to bf16 per op for the ops
autocast lists (linear, matmul, mm, addmm, bmm, scaled_dot_product_attention, ...) and keeps
precision-sensitive ones in fp32. That works unchanged on our fx stage programs (they call the
same aten ops), needs no second copy of the weights, and the gradients reaching the fp32 leaves
are fp32 (autograd casts back through each cast op), so nothing changes after backward. bf16
keeps fp32's exponent range: no loss scaling. Backward runs outside autocast (as recommended):
it replays the dtypes of forward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from passes.ir.errors import ConfigError

MODES = {"bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """A mixed-precision scheme.

    * ``compute_dtype``: dtype autocast runs listed ops in (``torch.bfloat16``).
    * ``device_type``: ``"cpu"`` or ``"cuda"``: the device the stage programs run on.
    """

    compute_dtype: torch.dtype
    device_type: str

    def context(self) -> ContextManager:
        """A fresh autocast context for one forward."""
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)


def parse_mixed_precision(mode: str | None, device_type: str) -> MixedPrecision | None:
    """``None`` (fp32 throughout) or the scheme named ``mode`` (``"bf16"``) on ``device_type``."""
    if mode is None or mode in ("fp32", "none"):
        return None
    if mode not in MODES:
        raise ConfigError(f"mixed_precision: unknown mode {mode!r}; use None (fp32) or one of {sorted(MODES)}")
    return MixedPrecision(compute_dtype=MODES[mode], device_type=device_type)


def forward_context(scheme: MixedPrecision | None) -> Callable[[], ContextManager]:
    """The factory of contexts a :class:`runtime.stage_executor.StageExecutor` wraps forwards in."""
    return contextlib.nullcontext if scheme is None else scheme.context
