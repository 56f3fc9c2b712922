"""Write the dumps of a pipeline run: ``NN_<pass>.{txt,json,dot}`` per pass and ``manifest.json``.

``00_input.*`` is the graph as the pipeline received it, ``01_<first pass>.*`` the graph after the
first pass, and so on. Per-pass files hold no timings, so they are byte-identical from run to run;
timings live only in the manifest::

    {"format": "partitioner-ir-manifest/1", "model": "gpt:...",
     "passes": [{"index": 0, "name": "input", "nodes": 91, "seconds": 0.0,
                 "files": {"txt": "00_input.txt", "json": "00_input.json", "dot": "00_input.dot"}}, ...],
     "total_seconds": 1.23}
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from ir_dumps.dot import graph_dot
from ir_dumps.json_dump import dumps, graph_json
from ir_dumps.text import graph_text

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "partitioner-ir-manifest/1"
INPUT_NAME = "input"
KINDS = ("txt", "json", "dot")


@dataclass(frozen=True, kw_only=True)
class DumpEntry:
    """One pass in the manifest: its position, name, node count, wall time (seconds), files."""

    index: int
    name: str
    nodes: int
    seconds: float
    files: tuple[tuple[str, str], ...]  # (kind, file name) for kind in KINDS

    def file(self, kind: str) -> str:
        return dict(self.files)[kind]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "nodes": self.nodes,
                "seconds": round(self.seconds, 6), "files": dict(self.files)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DumpEntry":
        return cls(index=int(data["index"]), name=str(data["name"]), nodes=int(data["nodes"]),
                   seconds=float(data["seconds"]), files=tuple(sorted(data["files"].items())))


def stem(index: int, pass_name: str) -> str:
    """``01_annotate_shapes``: file-name-safe, sorted in pipeline order."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", pass_name)
    return f"{index:02d}_{safe}"


def write_graph_dumps(gm: fx.GraphModule, dump_dir: Path, *, index: int, pass_name: str,
                      seconds: float = 0.0) -> DumpEntry:
    """Write the three dumps of ``gm`` after pass number ``index``; returns the manifest entry."""
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    base = stem(index, pass_name)
    title = f"pass {index:02d} {pass_name}"
    contents = {
        "txt": graph_text(gm, title=title),
        "json": dumps(graph_json(gm, pass_name=pass_name, index=index)),
        "dot": graph_dot(gm, title=title),
    }
    files = []
    for kind in KINDS:
        name = f"{base}.{kind}"
        (dump_dir / name).write_text(contents[kind], encoding="utf-8")
        files.append((kind, name))
    return DumpEntry(index=index, name=pass_name, nodes=len(gm.graph.nodes), seconds=seconds,
                     files=tuple(sorted(files)))


def write_manifest(dump_dir: Path, entries: list[DumpEntry], *, model: str = "") -> Path:
    """Write ``manifest.json`` listing ``entries`` in order; returns its path."""
    path = Path(dump_dir) / MANIFEST
    data = {
        "format": MANIFEST_FORMAT,
        "model": model,
        "passes": [e.to_json() for e in entries],
        "total_seconds": round(sum(e.seconds for e in entries), 6),
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


_DUMP_FILE = re.compile(r"^\d{2,}_[A-Za-z0-9_.-]+\.(txt|json|dot)$")


def clear_dumps(dump_dir: Path) -> None:
    """Remove dumps of an earlier run (only ``NN_*.{txt,json,dot}`` and the manifest) so that a
    shorter pipeline does not leave stale files behind."""
    dump_dir = Path(dump_dir)
    if not dump_dir.is_dir():
        return
    for path in dump_dir.iterdir():
        if path.is_file() and (path.name == MANIFEST or _DUMP_FILE.match(path.name)):
            path.unlink()
