"""The batches a captured graph takes, beyond its inputs' shapes: :class:`InputBounds`.

Read from the graph ``torch.export`` made, right after capture (its fake values carry the
shape environment):

* **named dims' ranges**: export's range constraints on each symbolic dim (e.g. Hugging Face
  BERT slices a position buffer, so ``seq <= max positions``), and the rows of every embedding
  table indexed by ``arange(dim)`` (learned positions: ``seq <= wpe.weight.shape[0]``), which
  export does not guard because an index is a value, not a shape; a dim the capture fixed to
  one size takes only that size;
* **integer inputs' values**: ids that index an embedding table lie in ``[0, rows)``; labels of a
  cross-entropy / NLL loss in ``[0, classes)`` or the loss's ``ignore_index``.

A batch outside these would fail deep inside the graph (an ``IndexError`` in an embedding, a
device assert on CUDA); :mod:`runtime.exec.batch_check` refuses it at the door instead.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from passes.ir.meta import EXPORT_VAL, DimBound, InputBounds, InputSpec, ValueBound

EXPORT_DIM_FLOOR = 2
"""Capture declares every symbolic dim with ``Dim(min=2)`` (export specializes 0 and 1): a lower
bound of 2 is ours, not the model's, and is not enforced."""

_PASS_THROUGH = frozenset({
    "view", "_unsafe_view", "reshape", "flatten", "unsqueeze", "squeeze", "expand", "slice", "select",
    "contiguous", "clone", "_to_copy", "to", "alias", "detach", "permute", "transpose", "t",
    "constant_pad_nd", "pad", "lift_fresh_copy",
})
"""Ops that move or copy values without changing them: an index reached through them is still
the input's (or the arange's) value. ``pad`` adds only its fill value (a loss's ignore_index)."""

_LOSSES = {"cross_entropy_loss": 4, "nll_loss": 4, "nll_loss_forward": 4, "nll_loss2d": 4,
           "nll_loss2d_forward": 4, "nll_loss_nd": 4}
"""Losses over class labels -> position of their ``ignore_index`` argument."""
_IGNORE_INDEX = -100  # torch's default ignore_index


def input_bounds(gm: fx.GraphModule, inputs: Sequence[InputSpec], *, dims: dict[str, int],
                 symbolic: Sequence[str]) -> InputBounds:
    """The :class:`InputBounds` of a freshly captured graph whose placeholders are ``inputs``
    (in order, with export's fake values in ``meta["val"]``); ``dims``: each named dim's example
    size, ``symbolic``: the dims kept symbolic (the others were fixed to their example)."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    specs = {i.name: i for i in inputs}
    dim_bounds: dict[str, DimBound] = {}

    def tighten(bound: DimBound) -> None:
        old = dim_bounds.get(bound.name)
        if old is None:
            dim_bounds[bound.name] = bound
            return
        low = max(old.low, bound.low)
        highs = [b for b in (old, bound) if b.high is not None]
        tight = min(highs, key=lambda b: b.high) if highs else old
        reason = "; ".join(dict.fromkeys(r for r in (old.reason, bound.reason) if r))
        dim_bounds[bound.name] = DimBound(name=bound.name, low=low, high=tight.high, reason=reason)

    for name in sorted({d for i in inputs for d in i.dim_names()}):
        if name not in symbolic:
            tighten(DimBound(name=name, low=dims[name], high=dims[name],
                             reason=f"the graph was captured with {name}={dims[name]} fixed"))
    for spec in inputs:
        node = placeholders.get(spec.name)
        if node is not None:
            for axis, d in enumerate(spec.shape):
                if isinstance(d, str) and d in symbolic:
                    bound = _export_range(node, axis, d)
                    if bound is not None:
                        tighten(bound)

    values: dict[str, list[ValueBound]] = {}
    for node in gm.graph.nodes:
        op = _op_name(node)
        if op == "embedding" and len(node.args) >= 2:
            rows = _rows(gm, node.args[0])
            if rows is None:
                continue
            table = _table_name(node.args[0])
            source = _source(node.args[1])
            if source is not None and source.op == "placeholder" and source.name in specs:
                values.setdefault(source.name, []).append(ValueBound(
                    name=source.name, high=rows, reason=f"it indexes the embedding {table} of {rows} rows"))
            else:
                arange, offset = _arange_source(node.args[1])
                bound = _position_bound(arange, offset, rows, table, specs) if arange is not None else None
                if bound is not None:
                    tighten(bound)
        elif op in _LOSSES and len(node.args) >= 2:
            source = _source(node.args[1])
            classes = _classes(node.args[0])
            if source is None or source.op != "placeholder" or source.name not in specs or classes is None:
                continue
            pos = _LOSSES[op]
            ignore = node.args[pos] if len(node.args) > pos else node.kwargs.get("ignore_index", _IGNORE_INDEX)
            values.setdefault(source.name, []).append(ValueBound(
                name=source.name, high=classes, allowed=(int(ignore),),
                reason=f"they are class labels of a loss over {classes} classes (or its ignore_index {int(ignore)})"))

    merged = []
    for name, bounds in values.items():
        tight = min(bounds, key=lambda b: b.high)
        allowed = set(bounds[0].allowed)
        for b in bounds[1:]:
            allowed &= set(b.allowed)  # a value one consumer ignores may break another (an embedding)
        merged.append(ValueBound(name=name, low=0, high=tight.high, allowed=tuple(sorted(allowed)),
                                 reason=tight.reason))
    order = {i.name: k for k, i in enumerate(inputs)}
    return InputBounds(dims=tuple(dim_bounds[n] for n in sorted(dim_bounds)),
                       values=tuple(sorted(merged, key=lambda b: order[b.name])))


def _op_name(node) -> str:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return ""
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else getattr(node.target, "__name__", "")


def _source(node):
    """The node whose values ``node`` carries through :data:`_PASS_THROUGH` ops."""
    while isinstance(node, fx.Node) and _op_name(node) in _PASS_THROUGH and node.args:
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _arange_source(node) -> tuple[fx.Node | None, int]:
    """The ``arange`` an index comes from through pass-through ops and additions of constants
    (``arange(n) + past_length``, Hugging Face's position ids), and the constant added."""
    offset = 0
    while isinstance(node, fx.Node):
        op = _op_name(node)
        if op == "arange":
            return node, offset
        if op == "add" and len(node.args) == 2 and isinstance(node.args[1], int):
            offset += node.args[1]
        elif op not in _PASS_THROUGH or not node.args:
            break
        node = node.args[0]
    return None, 0


def _export_range(node: fx.Node, axis: int, name: str) -> DimBound | None:
    """Export's range of ``node``'s size along ``axis`` (None when it has no bound of its own)."""
    val = node.meta.get(EXPORT_VAL)
    if not isinstance(val, torch.Tensor) or axis >= val.dim():
        return None
    size = val.shape[axis]
    if not isinstance(size, torch.SymInt):
        return None
    shape_env = size.node.shape_env
    vr = shape_env.var_to_range.get(size.node.expr) if shape_env is not None else None
    if vr is None:
        return None
    # export's infinity (int_oo) is no sympy Integer: an unbounded side
    low = int(vr.lower) if vr.lower.is_Integer and int(vr.lower) > EXPORT_DIM_FLOOR else 1
    high = int(vr.upper) if vr.upper.is_Integer else None
    if low == 1 and high is None:
        return None
    return DimBound(name=name, low=low, high=high, reason="a torch.export guard of the model")


def _position_bound(arange: fx.Node, offset: int, rows: int, table: str,
                    specs: dict[str, InputSpec]) -> DimBound | None:
    """``dim <= rows - start`` for an embedding indexed by ``arange([start,] size(input, axis))
    + offset``."""
    args = list(arange.args)
    start, end = (0, args[0]) if len(args) == 1 else (args[0], args[1])
    if isinstance(start, int):
        start += offset
    if not isinstance(start, int) or not isinstance(end, fx.Node) or _op_name(end) != "sym_size":
        return None
    source, axis = end.args[0], end.args[1] if len(end.args) > 1 else None
    if not isinstance(source, fx.Node) or source.op != "placeholder" or source.name not in specs:
        return None
    shape = specs[source.name].shape
    if not isinstance(axis, int) or not -len(shape) <= axis < len(shape) or not isinstance(shape[axis], str):
        return None
    name = shape[axis]
    return DimBound(name=name, high=rows - start, reason=f"positions index the embedding {table} of {rows} rows")


def _rows(gm: fx.GraphModule, weight) -> int | None:
    val = weight.meta.get(EXPORT_VAL) if isinstance(weight, fx.Node) else None
    if val is None and isinstance(weight, fx.Node) and weight.op == "get_attr":
        try:
            val = gm.get_parameter(weight.target)
        except AttributeError:
            try:
                val = gm.get_buffer(weight.target)
            except AttributeError:
                val = None
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or isinstance(val.shape[0], torch.SymInt):
        return None
    return int(val.shape[0])


def _table_name(weight) -> str:
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        return str(weight.target)
    return getattr(weight, "name", "table")


def _classes(logits) -> int | None:
    val = logits.meta.get(EXPORT_VAL) if isinstance(logits, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    size = val.shape[1] if val.dim() >= 2 else val.shape[0]
    return None if isinstance(size, torch.SymInt) else int(size)
