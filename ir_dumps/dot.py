"""Graphviz DOT dump of a graph (plain text; render with ``dot -Tsvg file.dot`` if Graphviz is around).

Each node is a box labelled name / target / shape; edges go from producer to consumer. Nodes are
grouped in one cluster per top-level module (``blocks.0``, ``wte``, ...; a ``ModuleList`` index
counts as part of the top level), parameters in the cluster of the module that owns them.
Output order follows graph order, so the text is deterministic.
"""
from __future__ import annotations

from torch import fx

from ir_dumps.encode import node_module, target_text
from ir_dumps.text import shape_text
from passes.ir.meta import SHAPE, ShapeMeta

_FILL = {"placeholder": "lightblue", "get_attr": "lightyellow", "output": "lightgrey"}


def graph_dot(gm: fx.GraphModule, *, title: str) -> str:
    """The DOT text of ``gm`` (ends with a newline)."""
    nodes = list(gm.graph.nodes)
    clusters: dict[str, list[fx.Node]] = {}
    loose: list[fx.Node] = []
    for n in nodes:
        group = top_level_module(n)
        (clusters.setdefault(group, []) if group else loose).append(n)

    lines = ["digraph G {", f"  label={_quote(title)};", "  labelloc=t;", "  rankdir=TB;",
             '  node [shape=box, style=filled, fillcolor=white, fontname="monospace", fontsize=10];']
    for i, (group, members) in enumerate(clusters.items()):
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f"    label={_quote(group)};")
        lines.extend("    " + _node_stmt(n) for n in members)
        lines.append("  }")
    lines.extend("  " + _node_stmt(n) for n in loose)
    for n in nodes:
        for src in n.all_input_nodes:
            lines.append(f"  {_quote(src.name)} -> {_quote(n.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def top_level_module(node: fx.Node) -> str:
    """``blocks.0`` for ``blocks.0.attn.qkv``; parameters use their own dotted target."""
    path = node.target.rsplit(".", 1)[0] if node.op == "get_attr" and "." in node.target else node_module(node)
    if node.op == "get_attr" and "." not in node.target:
        path = ""
    parts = path.split(".") if path else []
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0] if parts else ""


def _node_stmt(node: fx.Node) -> str:
    label = [node.name, node.op if node.op in ("placeholder", "get_attr", "output") else target_text(node)]
    shape = node.meta.get(SHAPE)
    if isinstance(shape, ShapeMeta):
        label.append(shape_text(shape))
    fill = _FILL.get(node.op, "white")
    return f"{_quote(node.name)} [label={_quote(chr(10).join(label))}, fillcolor={fill}];"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
