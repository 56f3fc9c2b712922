"""Analysis: the shape and dtype of every tensor each node produces, symbolic in the named dims.

Runs the graph once on fake tensors (no weights allocated) and writes ``node.meta[SHAPE]``. The
pass reads only ``gm.meta[CAPTURE]``, so it works on any graph a later transform produces.

Symbolic shapes cost: a fake run with every named dim a ``SymInt`` is several times slower than
one at the dims' hints. A freshly captured graph already carries them, computed by
``torch.export`` (``node.meta["val"]``), so there the pass runs at the hints (which gives what
export does not record: which tensors require grad) and takes the symbolic shapes from export,
after checking that they agree with the run at every node; any other graph (a rewritten stage
program) gets the fake forward run that the memory pass observes too
(:func:`passes.analysis.saved_tensors.fake_forward_run`, made once while the graph is unchanged),
checkpointed regions' nodes included.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from passes.capture.fake_execution import FakeContext, FakeInterpreter, capture_info, fake_attrs, fake_context, fake_inputs
from passes.analysis.saved_tensors import fake_forward_run
from passes.ir.meta import EXPORT_VAL, SHAPE, CaptureInfo, ShapeMeta, TensorMeta, dim_symbol


def annotate_shapes(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Write :class:`ShapeMeta` under ``node.meta[SHAPE]`` for every node; returns ``gm``."""
    info = capture_info(gm)
    if info.symbolic:
        metas = _from_export(gm, info)
        if metas is not None:
            for node, meta in metas.items():
                node.meta[SHAPE] = meta
            return gm
    # the forward run annotate_memory and the policies observe next, made once (saved_tensors);
    # it runs each checkpointed region node by node, so the regions' nodes get their shapes too
    run = fake_forward_run(gm)
    for node, value in run.values.items():
        node.meta[SHAPE] = shape_meta(run.fake, value)
    return gm


def _run(gm: fx.GraphModule, info: CaptureInfo) -> tuple[FakeContext, dict[fx.Node, Any]]:
    fake = fake_context(info)
    attrs = fake_attrs(fake, gm, info.device, requires_grad=True)
    results: dict[fx.Node, Any] = {}
    with fake.mode:
        FakeInterpreter(gm, attrs, on_node=lambda n, v: results.__setitem__(n, v), symbolic=fake.symbolic).run(*fake_inputs(fake, info))
    return fake, results


def shape_meta(fake: FakeContext, value: Any) -> ShapeMeta:
    """Describe a node's result: its tensors in flattened order, or a size value."""
    if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
        return ShapeMeta(value=fake.to_sympy(value))
    tensors = tuple(
        TensorMeta(shape=fake.shape(t), dtype=t.dtype, requires_grad=t.requires_grad)
        for t in tree_leaves(value) if isinstance(t, torch.Tensor)
    )
    return ShapeMeta(tensors=tensors)


def _from_export(gm: fx.GraphModule, info: CaptureInfo) -> dict[fx.Node, ShapeMeta] | None:
    """Every node's ShapeMeta from export's symbolic values and a run at the hints, or None when
    the graph has no export values to take (or they disagree with the run)."""
    rename = _export_symbols(gm, info)
    if rename is None:
        return None
    if any(n.op == "call_function" and EXPORT_VAL not in n.meta for n in gm.graph.nodes):
        return None  # a rewrite added nodes export never saw: run symbolically (without a wasted run first)
    hints = {dim_symbol(n): v for n, v in info.dims}
    fake, results = _run(gm, dataclasses.replace(info, symbolic=()))
    out: dict[fx.Node, ShapeMeta] = {}
    for node, value in results.items():
        concrete = shape_meta(fake, value)
        val = node.meta.get(EXPORT_VAL)
        if node.op == "output":  # what the graph returns: its results' shapes
            args = [a for a in tree_leaves(node.args) if isinstance(a, fx.Node)]
            out[node] = ShapeMeta(tensors=tuple(t for a in args for t in out[a].tensors))
            if len(out[node].tensors) != len(concrete.tensors):
                return None
            continue
        if val is None:
            if concrete.tensors or concrete.value is not None:
                return None  # a value export did not record: run symbolically
            out[node] = concrete
            continue
        if concrete.value is not None:
            expr = _expr(val, rename)
            if expr is None or expr.xreplace(hints) != concrete.value:
                return None
            out[node] = ShapeMeta(value=expr)
            continue
        tensors = [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]
        if len(tensors) != len(concrete.tensors):
            return None
        metas = []
        for t, c in zip(tensors, concrete.tensors):
            shape = tuple(_expr(d, rename) for d in t.shape)
            if any(d is None for d in shape) or t.dtype != c.dtype or len(shape) != len(c.shape) \
                    or any(d.xreplace(hints) != h for d, h in zip(shape, c.shape)):
                return None
            metas.append(TensorMeta(shape=shape, dtype=c.dtype, requires_grad=c.requires_grad))
        out[node] = ShapeMeta(tensors=tuple(metas))
    return out


def _export_symbols(gm: fx.GraphModule, info: CaptureInfo) -> dict[sympy.Symbol, sympy.Symbol] | None:
    """Export's shape symbols -> our dim symbols, read off the placeholders' values."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(info.inputs):
        return None
    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    for node, spec in zip(placeholders, info.inputs):
        val = node.meta.get(EXPORT_VAL)
        if not isinstance(val, torch.Tensor) or len(val.shape) != len(spec.shape):
            return None
        for d, name in zip(val.shape, spec.shape):
            if isinstance(d, torch.SymInt) and isinstance(name, str) and name in info.symbolic:
                expr = d.node.expr
                if not isinstance(expr, sympy.Symbol) or rename.get(expr, dim_symbol(name)) != dim_symbol(name):
                    return None
                rename[expr] = dim_symbol(name)
    return rename or None


def _expr(value: Any, rename: dict[sympy.Symbol, sympy.Symbol]) -> sympy.Expr | None:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr.xreplace(rename)
        return sympy.expand(expr) if expr.free_symbols <= set(rename.values()) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return sympy.Integer(value)
    return None
