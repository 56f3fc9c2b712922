"""Transform of the capture facts: describe a program at concrete sizes from here on.

A rank program runs one micro-batch size, so its analysis is made at it: this pass sets the
``batch`` dim of ``gm.meta[CAPTURE]`` to ``batch`` (when it is symbolic) and makes every named
dim concrete (the others at their capture hints). The graph itself is unchanged and still runs at any size; the analysis
passes after it (shapes, FLOPs, memory) give numbers for that micro-batch, several times faster
than symbolically.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx

from passes.ir.errors import PassError
from passes.ir.meta import CAPTURE


def specialize_dims(gm: fx.GraphModule, ctx: Any = None, *, batch: int) -> fx.GraphModule:
    """Make the capture concrete, ``batch`` samples per micro-batch; returns ``gm``."""
    info = gm.meta.get(CAPTURE)
    if info is None:
        raise PassError("specialize_dims: gm.meta has no 'capture'")
    if not isinstance(batch, int) or batch < 1:
        raise PassError(f"specialize_dims: batch must be an int >= 1, got {batch!r}")
    # a dim the capture already fixed stays as it is (the program's input contracts use it)
    dims = tuple((n, batch if n == "batch" and n in info.symbolic else v) for n, v in info.dims)
    gm.meta[CAPTURE] = dataclasses.replace(info, dims=dims, symbolic=())
    return gm
