"""Readable text dump of a graph: a header with graph facts, then one line of code per node.

::

    # pass 02 annotate_flops
    # capture: model=gpt:... inputs=[...] ...
    # flop_summary: fwd=... bwd=...
    %linear = aten.linear.default(%layer_norm, %w, %b) :: float32[batch, seq, 192]  | flops fwd=.. bwd=..  | module=blocks.0.attn.qkv
    return %loss

Every annotation comes from a project fact in ``node.meta`` (see :mod:`ir_dumps.encode`): the
shape fact prints after ``::``, the others as ``| label field=value ...`` showing the fields
that differ from their default; a fact whose fields are all zero or default (a view's FLOPs) is
left out of the text (the JSON dump still has it). No addresses or ids, so two runs give the same bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
from torch import fx

from ir_dumps.encode import arg_text, dtype_text, dumped_fields, facts, node_module, scalar_text, sympy_text, target_text
from passes.ir.meta import SHAPE, ShapeMeta

# Short labels for well-known keys; other keys print under their own name.
_LABELS = {"memory": "mem"}


def graph_text(gm: fx.GraphModule, *, title: str) -> str:
    """The whole text dump of ``gm`` (ends with a newline)."""
    nodes = list(gm.graph.nodes)
    lines = [f"# {title}"]
    for key, fact in facts(gm.meta):
        if dataclasses.is_dataclass(fact):
            lines.append(f"# {key}: {fact_fields_text(fact, all_fields=True)}")
        else:  # a plain value, such as a stage module's pipeline stage
            lines.append(f"# {key}={scalar_text(fact)}")
    lines.append(f"# nodes: {len(nodes)}")
    lines.append("")
    lines.extend(node_line(n) for n in nodes)
    return "\n".join(lines) + "\n"


def node_line(node: fx.Node) -> str:
    """One node as code with its annotations."""
    parts = [node_code(node)]
    annotations = []
    for key, fact in facts(node.meta):
        if key == SHAPE and isinstance(fact, ShapeMeta):
            parts.append(f":: {shape_text(fact)}")
        elif not dataclasses.is_dataclass(fact):  # a plain value such as the pipeline stage
            annotations.append(f"| {_LABELS.get(key, key)}={scalar_text(fact)}")
        elif not _is_trivial(fact):
            body = fact_fields_text(fact)
            label = _LABELS.get(key, key)
            annotations.append(f"| {label} {body}" if body else f"| {label}")
    module = node_module(node)
    if module:
        annotations.append(f"| module={module}")
    line = " ".join(parts)
    return "  ".join([line, *annotations]) if annotations else line


def node_code(node: fx.Node) -> str:
    """``%name = target(args)`` in the style of fx's own graph printout."""
    args = [arg_text(a) for a in node.args] + [f"{k}={arg_text(v)}" for k, v in node.kwargs.items()]
    call = f"({', '.join(args)})"
    if node.op == "output":
        return "return " + ", ".join(arg_text(a) for a in node.args)
    if node.op == "placeholder":
        return f"%{node.name} = placeholder[{node.target}]"
    if node.op == "get_attr":
        return f"%{node.name} = get_attr[{node.target}]"
    if node.op == "call_module":
        return f"%{node.name} = call_module[{node.target}]{call}"
    if node.op == "call_method":
        return f"%{node.name} = {node.target}{call}"
    return f"%{node.name} = {target_text(node)}{call}"


def shape_text(shape: ShapeMeta) -> str:
    """``float32[batch, seq, 64]``; several outputs in parentheses; a size value as ``= expr``."""
    if shape.value is not None:
        return f"= {shape.value}"
    tensors = [f"{dtype_text(t.dtype)}[{', '.join(sympy_text(d) for d in t.shape)}]" for t in shape.tensors]
    if len(tensors) == 1:
        return tensors[0]
    return "(" + ", ".join(tensors) + ")"


def fact_fields_text(fact: Any, *, all_fields: bool = False) -> str:
    """``field=value ...`` for a fact's fields (only non-default ones unless ``all_fields``).

    A ``_bytes`` suffix is dropped from field names to keep lines short (values are in bytes).
    """
    out = []
    for f in dumped_fields(fact):
        value = getattr(fact, f.name)
        if not all_fields and _is_default(f, value):
            continue
        out.append(f"{f.name.removesuffix('_bytes')}={scalar_text(value)}")
    return " ".join(out)


def _is_trivial(fact: Any) -> bool:
    """True when every field of ``fact`` is zero, empty or its default."""
    for f in dataclasses.fields(fact):
        value = getattr(fact, f.name)
        if _is_default(f, value):
            continue
        if isinstance(value, (int, float, sympy.Basic)) and not isinstance(value, bool) and value == 0:
            continue
        return False
    return True


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - an uncomparable value is simply shown
        return False
