"""Transform of the capture facts: describe a program at concrete sizes from here on.

A rank program runs one micro-batch size, so its analysis is made at it: this pass sets the
``batch`` dim of ``gm.meta[CAPTURE]`` to ``batch`` (when it is symbolic) and makes every named
dim concrete (the others at their capture hints); a received input that sequence parallelism
takes as this tp rank's chunk gets the chunk's size. The graph itself is unchanged and still runs at any size; the analysis
passes after it (shapes, FLOPs, memory) give numbers for that micro-batch, several times faster
than symbolically.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx

from passes.ir.errors import PassError
from passes.ir.meta import CAPTURE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN


def specialize_dims(gm: fx.GraphModule, ctx: Any = None, *, batch: int) -> fx.GraphModule:
    """Make the capture concrete, ``batch`` samples per micro-batch; returns ``gm``."""
    info = gm.meta.get(CAPTURE)
    if info is None:
        raise PassError("specialize_dims: gm.meta has no 'capture'")
    if not isinstance(batch, int) or batch < 1:
        raise PassError(f"specialize_dims: batch must be an int >= 1, got {batch!r}")
    # a dim the capture already fixed stays as it is (the program's input contracts use it)
    dims = tuple((n, batch if n == "batch" and n in info.symbolic else v) for n, v in info.dims)
    info = dataclasses.replace(info, dims=dims, symbolic=())
    # inputs that sequence parallelism receives as this tp rank's chunk (tagged so by its rewrite)
    chunked = {n.name: n.meta[TENSOR_PARALLEL].shard_dim for n in gm.graph.nodes
               if n.op == "placeholder" and getattr(n.meta.get(TENSOR_PARALLEL), "role", None) == "sequence"}
    if chunked:
        info = _chunked_inputs(info, chunked, gm.meta[TENSOR_PARALLEL_PLAN].degree)
    gm.meta[CAPTURE] = info
    return gm


def _chunked_inputs(info, chunked: dict[str, int], degree: int):
    """``info`` whose inputs ``chunked`` (name -> dim) are this tp rank's sequence chunk: that
    dim at its concrete size over ``degree`` (sequence parallelism's boundary tensors)."""
    sizes = dict(info.dims)
    inputs = []
    for spec in info.inputs:
        if spec.name in chunked:
            d = chunked[spec.name]
            shape = list(spec.shape)
            shape[d] = (sizes[shape[d]] if isinstance(shape[d], str) else shape[d]) // degree
            spec = dataclasses.replace(spec, shape=tuple(shape))
        inputs.append(spec)
    return dataclasses.replace(info, inputs=tuple(inputs))
