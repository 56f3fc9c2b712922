"""Analysis: the shape and dtype of every tensor each node produces, symbolic in the named dims.

Runs the graph once on fake tensors (no weights allocated) and writes ``node.meta[SHAPE]``. The
pass reads only ``gm.meta[CAPTURE]``, so it works on any graph a later transform produces.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from passes.fake_execution import FakeContext, FakeInterpreter, capture_info, fake_attrs, fake_context, fake_inputs
from passes.meta import SHAPE, ShapeMeta, TensorMeta


def annotate_shapes(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Write :class:`ShapeMeta` under ``node.meta[SHAPE]`` for every node; returns ``gm``."""
    info = capture_info(gm)
    fake = fake_context(info)
    attrs = fake_attrs(fake, gm, info.device, requires_grad=True)
    results: dict[fx.Node, Any] = {}
    with fake.mode:
        FakeInterpreter(gm, attrs, on_node=lambda n, v: results.__setitem__(n, v)).run(*fake_inputs(fake, info))
    for node, value in results.items():
        node.meta[SHAPE] = shape_meta(fake, value)
    return gm


def shape_meta(fake: FakeContext, value: Any) -> ShapeMeta:
    """Describe a node's result: its tensors in flattened order, or a size value."""
    if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
        return ShapeMeta(value=fake.to_sympy(value))
    tensors = tuple(
        TensorMeta(shape=fake.shape(t), dtype=t.dtype, requires_grad=t.requires_grad)
        for t in tree_leaves(value) if isinstance(t, torch.Tensor)
    )
    return ShapeMeta(tensors=tensors)
