"""Differences between two graph dumps: nodes added and removed, code and meta changed.

Nodes are matched by name (fx names are unique in a graph and stable across analysis passes).
A change is ``+`` (a meta key or field appeared), ``-`` (disappeared) or ``~`` (value changed),
addressed by a dotted path such as ``flops.fwd`` or ``args``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ir_dumps.reader import GraphDump, NodeDump


@dataclass(frozen=True, kw_only=True)
class Change:
    kind: str  # "+", "-" or "~"
    path: str
    old: Any = None
    new: Any = None

    def text(self) -> str:
        if self.kind == "+":
            return f"+ {self.path}: {_short(self.new)}"
        if self.kind == "-":
            return f"- {self.path}: {_short(self.old)}"
        return f"~ {self.path}: {_short(self.old)} -> {_short(self.new)}"


@dataclass(frozen=True, kw_only=True)
class NodeChange:
    name: str
    changes: tuple[Change, ...]


@dataclass(frozen=True, kw_only=True)
class GraphDiff:
    """What changed from dump ``a`` to dump ``b``."""

    a: str
    b: str
    nodes_a: int
    nodes_b: int
    graph: tuple[Change, ...]
    added: tuple[NodeDump, ...]
    removed: tuple[NodeDump, ...]
    changed: tuple[NodeChange, ...]

    @property
    def empty(self) -> bool:
        return not (self.graph or self.added or self.removed or self.changed)


def diff_dumps(a: GraphDump, b: GraphDump) -> GraphDiff:
    """Compare two dumps node by node (by name) and their graph facts."""
    na, nb = a.by_name(), b.by_name()
    changed = []
    for node in b.nodes:
        if node.name in na:
            changes = _node_changes(na[node.name], node)
            if changes:
                changed.append(NodeChange(name=node.name, changes=changes))
    return GraphDiff(
        a=_label(a), b=_label(b), nodes_a=len(a.nodes), nodes_b=len(b.nodes),
        graph=tuple(_dict_changes(a.graph, b.graph, "")),
        added=tuple(n for n in b.nodes if n.name not in na),
        removed=tuple(n for n in a.nodes if n.name not in nb),
        changed=tuple(changed),
    )


def render(d: GraphDiff) -> str:
    """The diff as readable text (ends with a newline)."""
    lines = [f"--- {d.a}", f"+++ {d.b}",
             f"nodes: {d.nodes_a} -> {d.nodes_b} ({len(d.added)} added, {len(d.removed)} removed, "
             f"{len(d.changed)} changed)"]
    if d.empty:
        lines.append("no differences")
        return "\n".join(lines) + "\n"
    if d.graph:
        lines.append("graph:")
        lines.extend(f"  {c.text()}" for c in d.graph)
    if d.added:
        lines.append("added nodes:")
        lines.extend(f"  + %{n.name} = {n.op} {n.target}({', '.join(map(_short, n.args))})" for n in d.added)
    if d.removed:
        lines.append("removed nodes:")
        lines.extend(f"  - %{n.name} = {n.op} {n.target}({', '.join(map(_short, n.args))})" for n in d.removed)
    if d.changed:
        lines.append("changed nodes:")
        for nc in d.changed:
            lines.append(f"  %{nc.name}:")
            lines.extend(f"    {c.text()}" for c in nc.changes)
    return "\n".join(lines) + "\n"


def _node_changes(a: NodeDump, b: NodeDump) -> tuple[Change, ...]:
    out = []
    for field in ("op", "target", "args", "kwargs", "users", "module"):
        old, new = getattr(a, field), getattr(b, field)
        if _norm(old) != _norm(new):
            out.append(Change(kind="~", path=field, old=old, new=new))
    out.extend(_dict_changes(a.meta, b.meta, ""))
    return tuple(out)


def _dict_changes(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[Change]:
    """Key-level changes; for a key present on both sides whose values are dicts, field-level."""
    out = []
    for key in list(a) + [k for k in b if k not in a]:
        path = f"{prefix}{key}"
        if key not in b:
            out.append(Change(kind="-", path=path, old=a[key]))
        elif key not in a:
            out.append(Change(kind="+", path=path, new=b[key]))
        elif isinstance(a[key], dict) and isinstance(b[key], dict):
            out.extend(_dict_changes(a[key], b[key], path + "."))
        elif _norm(a[key]) != _norm(b[key]):
            out.append(Change(kind="~", path=path, old=a[key], new=b[key]))
    return out


def _norm(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _short(value: Any, limit: int = 160) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, dict):
        text = " ".join(f"{k}={_short(v, limit)}" for k, v in value.items())
    else:
        text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _label(d: GraphDump) -> str:
    where = str(d.path) if d.path is not None else "<memory>"
    return f"{where} (pass {d.index:02d} {d.pass_name})"
