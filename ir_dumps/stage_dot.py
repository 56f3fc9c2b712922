"""Graphviz DOT of a whole graph coloured by pipeline stage, with the other decisions marked.

* fill colour: ``node.meta["pipeline_stage"]`` (one colour per stage, white when untagged);
* one cluster per stage, so a stage reads as a box;
* red bold edges: a value crossing a stage boundary (a send/recv), labelled ``s -> t``;
* dashed border: a node recomputed in backward (``node.meta["checkpoint"].recompute``), with
  its checkpoint region in the label;
* double border (``peripheries=2``) and ``tp:<role>`` in the label: tensor-parallel nodes
  (``node.meta["tensor_parallel"]``);
* ``offload`` in the label and a dotted outline: ``node.meta["offload"]``.

Text is deterministic (graph order, no ids). :func:`write_stage_dot` also writes an SVG when
Graphviz's ``dot`` is installed; the DOT text is always written.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from torch import fx

from ir_dumps.encode import target_text
from passes.ir.launcher_env import scrubbed_env
from passes.ir.meta import CHECKPOINT, PIPELINE_STAGE, TENSOR_PARALLEL

OFFLOAD = "offload"  # written by the offload pass (being written); shown generically when present
STAGE_COLOURS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
                 "#9edae5", "#d9d9d9")


def stage_colour(stage: int) -> str:
    """Fill colour of pipeline stage ``stage`` (cycles after 10 stages)."""
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def stage_dot(gm: fx.GraphModule, *, title: str = "stages") -> str:
    """DOT text of ``gm`` with nodes grouped and coloured by stage (ends with a newline)."""
    nodes = list(gm.graph.nodes)
    by_stage: dict[int | None, list[fx.Node]] = {}
    for n in nodes:
        by_stage.setdefault(_stage(n), []).append(n)
    lines = ["digraph stages {", f"  label={_q(title)};", "  labelloc=t;", "  rankdir=TB;",
             '  node [shape=box, style=filled, fillcolor=white, fontname="monospace", fontsize=10];']
    for stage in sorted(s for s in by_stage if s is not None):
        lines.append(f"  subgraph cluster_stage_{stage} {{")
        lines.append(f"    label={_q(f'stage {stage}')}; style=rounded; color={_q(stage_colour(stage))};")
        lines.extend("    " + _node_stmt(n) for n in by_stage[stage])
        lines.append("  }")
    lines.extend("  " + _node_stmt(n) for n in by_stage.get(None, []))
    for n in nodes:
        for src in n.all_input_nodes:
            a, b = _stage(src), _stage(n)
            if a is not None and b is not None and a != b and src.op not in ("get_attr", "placeholder"):
                lines.append(f"  {_q(src.name)} -> {_q(n.name)} [color=red, penwidth=2, "
                             f"label={_q(f'{a} -> {b}')}, fontcolor=red, class=cross_stage];")
            else:
                lines.append(f"  {_q(src.name)} -> {_q(n.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_stage_dot(gm: fx.GraphModule, path: str | Path, *, title: str = "stages") -> tuple[Path, Path | None]:
    """Write ``path`` (``.dot``) and, when Graphviz ``dot`` is on PATH, the ``.svg`` beside it.

    Returns (dot path, svg path or None).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stage_dot(gm, title=title), encoding="utf-8")
    exe = shutil.which("dot")
    if exe is None:
        return path, None
    svg = path.with_suffix(".svg")
    subprocess.run([exe, "-Tsvg", str(path), "-o", str(svg)], check=True, timeout=120, env=scrubbed_env())
    return path, svg


def _stage(node: fx.Node) -> int | None:
    value = node.meta.get(PIPELINE_STAGE)
    return value if isinstance(value, int) else None


def _node_stmt(node: fx.Node) -> str:
    label = [node.name, node.op if node.op in ("placeholder", "get_attr", "output") else target_text(node)]
    styles = ["filled"]
    attrs = []
    ck = node.meta.get(CHECKPOINT)
    if ck is not None and getattr(ck, "recompute", False):
        styles.append("dashed")
        label.append(f"recompute (region {getattr(ck, 'region', '?')})")
    tp = node.meta.get(TENSOR_PARALLEL)
    if tp is not None:
        attrs.append("peripheries=2")
        role = getattr(tp, "role", None) or "sharded"
        dim = getattr(tp, "shard_dim", None)
        label.append(f"tp:{role}" + (f" dim {dim}" if dim is not None else ""))
    off = node.meta.get(OFFLOAD)
    if off is not None and off is not False:
        styles.append("dotted")
        where = getattr(off, "kind", None) or getattr(off, "target", None) or "host"
        label.append(f"offload:{where}")
    stage = _stage(node)
    fill = stage_colour(stage) if stage is not None else "white"
    extra = "".join(f", {a}" for a in attrs)
    return f'{_q(node.name)} [label={_q(chr(10).join(label))}, fillcolor={_q(fill)}, style={_q(",".join(styles))}{extra}];'


def _q(text: str) -> str:
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
