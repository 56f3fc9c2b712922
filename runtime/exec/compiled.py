"""Compiled stage programs: what a plan with ``compile=true`` runs in place of each stage's fx module.

Each stage program is compiled with ``torch.compile`` (inductor) the first time it runs, one
compiled graph per input shape (``dynamic=False``: a rank's micro-batch is fixed, so shapes are
specialised as a training step sees them; an evaluation batch of another size compiles again).
Two choices keep a compiled plan training like the uncompiled one:

* ``fallback_random``: random ops (dropout) draw from torch's generator as eager does, not from
  inductor's own, so a compiled rank draws the same masks as its uncompiled twin and one device;
* the module keeps its parameters: the compiled callable runs the same ``nn.Parameter`` objects,
  so gradient buckets, ZeRO shards and the optimizer see the tensors they were built on.

The collectives inside a program (tensor-parallel, ZeRO-3 gathers) are custom ops with fake
implementations; the compiled graph calls them as opaque kernels in program order.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}
"""Inductor settings of every compiled stage program (see the module docstring)."""


def compile_stage(module: fx.GraphModule) -> Callable[..., Any]:
    """The callable that runs ``module`` compiled (lazily, at its first call)."""
    return torch.compile(module, backend="inductor", dynamic=False, options=dict(INDUCTOR_OPTIONS))
