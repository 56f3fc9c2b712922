"""Optimizer-state offload: an optimizer (AdamW by default) whose state and step live in host
memory (ZeRO-Offload style).

Per parameter the host keeps an fp32 master copy and AdamW's ``exp_avg``/``exp_avg_sq`` (and
``step``); the device keeps only the parameter (fp32, or 16-bit under a bf16/fp16 plan) and,
after backward, its gradient. One step:

1. copy each gradient to host (as fp32);
2. run the run's optimizer (fused AdamW by default) on the host masters — the same
   implementation a device optimizer on CPU runs, so on a CPU "device" the result is
   bit-identical to the optimizer stepping on the device;
3. copy the masters back into the device parameters (cast to their dtype).

On CUDA the host buffers are pinned and the copies ``non_blocking``, with one synchronization
before the host step reads the gradients and none after (the copies back are ordered on the
compute stream). On CPU the copies are real copies into separate storages, so the path runs.
``bytes_to_host``/``bytes_to_device`` count what crossed the link. It is
:class:`runtime.optim.mixed_precision.MasterWeightOptimizer` with its masters on the host.
"""
from __future__ import annotations

from typing import Iterable

import torch

from runtime.optim.mixed_precision import MasterWeightOptimizer
from runtime.optim.optimizers import OptimizerFactory


class HostOffloadedOptimizer(MasterWeightOptimizer):
    """An optimizer with its fp32 masters, state and update on the host; the device parameters
    are updated in place. ``factory``/``no_decay`` as for :class:`MasterWeightOptimizer`."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, factory: OptimizerFactory | None = None,
                 no_decay=None):
        super().__init__(params, factory=factory, no_decay=no_decay, on_host=True)
