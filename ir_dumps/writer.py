"""Write the dumps of pipeline runs: ``NN_<pass>.{txt,json,dot}`` per pass and ``manifest.json``.

A :class:`DumpWriter` is the pass manager's instrument (:class:`passes.lowering.manager.Instrument`):
give one to every manager of a lowering and the whole tree comes out in run order::

    00_input.*                 the captured graph
    01_annotate_shapes.* ...   analysis, then the whole-graph tag passes, one number each
    stage0_tp0/00_split.*      a stage program as the split made it
    stage0_tp0/01_...          the passes that made that rank's program, then its re-analysis
    manifest.json              every dump in order, the pipelines' text, and what else the caller adds

``writer.scope("stage0_tp0")`` is the instrument of one stage program's pipeline (its own
numbering, in its own directory). Per-pass files hold no timings, so they are byte-identical
from run to run; timings live only in the manifest::

    {"format": "partitioner-ir-manifest/2", "model": "gpt:...",
     "pipelines": {"analysis": "annotate_shapes,...", "stage0_tp0": "apply_tensor_parallel{...},..."},
     "passes": [{"index": 0, "name": "input", "dir": "", "nodes": 91, "seconds": 0.0,
                 "files": {"txt": "00_input.txt", ...}}, ...],
     "total_seconds": 1.23}

Entries of a scope are named ``<scope>/<pass>`` and their files are paths below the root.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from ir_dumps.dot import graph_dot
from ir_dumps.json_dump import dumps, graph_json
from ir_dumps.text import graph_text

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "partitioner-ir-manifest/2"
INPUT_NAME = "input"
SPLIT_NAME = "split"
KINDS = ("txt", "json", "dot")
_SCOPE = re.compile(r"^stage\d+_tp\d+$")


@dataclass(frozen=True, kw_only=True)
class DumpEntry:
    """One dump in the manifest: its position in its directory, name, node count, wall time
    (seconds), files (paths relative to the dump root) and directory (``""``: the root)."""

    index: int
    name: str
    nodes: int
    seconds: float
    files: tuple[tuple[str, str], ...]  # (kind, file path) for kind in KINDS
    dir: str = ""

    def file(self, kind: str) -> str:
        return dict(self.files)[kind]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "dir": self.dir, "nodes": self.nodes,
                "seconds": round(self.seconds, 6), "files": dict(self.files)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DumpEntry":
        return cls(index=int(data["index"]), name=str(data["name"]), nodes=int(data["nodes"]),
                   seconds=float(data["seconds"]), files=tuple(sorted(data["files"].items())),
                   dir=str(data.get("dir", "")))


def stem(index: int, pass_name: str) -> str:
    """``01_annotate_shapes``: file-name-safe, sorted in pipeline order."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", pass_name)
    return f"{index:02d}_{safe}"


def write_graph_dumps(gm: fx.GraphModule, dump_dir: Path, *, index: int, pass_name: str,
                      seconds: float = 0.0, root: Path | None = None, title: str | None = None) -> DumpEntry:
    """Write the three dumps of ``gm`` after pass number ``index`` into ``dump_dir``; returns the
    manifest entry (file paths relative to ``root``, default ``dump_dir``)."""
    dump_dir = Path(dump_dir)
    root = Path(root) if root is not None else dump_dir
    dump_dir.mkdir(parents=True, exist_ok=True)
    base = stem(index, pass_name)
    scope = dump_dir.relative_to(root).as_posix() if dump_dir != root else ""
    title = title or (f"{scope} pass {index:02d} {pass_name}" if scope else f"pass {index:02d} {pass_name}")
    contents = {
        "txt": graph_text(gm, title=title),
        "json": dumps(graph_json(gm, pass_name=pass_name, index=index)),
        "dot": graph_dot(gm, title=title),
    }
    files = []
    for kind in KINDS:
        name = f"{base}.{kind}"
        (dump_dir / name).write_text(contents[kind], encoding="utf-8")
        files.append((kind, f"{scope}/{name}" if scope else name))
    return DumpEntry(index=index, name=f"{scope}/{pass_name}" if scope else pass_name, nodes=len(gm.graph.nodes),
                     seconds=seconds, files=tuple(sorted(files)), dir=scope)


_DUMP_FILE = re.compile(r"^\d{2,}_[A-Za-z0-9_.-]+\.(txt|json|dot)$")


def clear_dumps(dump_dir: Path) -> None:
    """Remove the dumps of an earlier run (``NN_*.{txt,json,dot}``, the manifest, and stage program
    directories ``stage<s>_tp<r>/``) so that a shorter pipeline leaves no stale files behind."""
    dump_dir = Path(dump_dir)
    if not dump_dir.is_dir():
        return
    for path in dump_dir.iterdir():
        if path.is_file() and (path.name == MANIFEST or _DUMP_FILE.match(path.name)):
            path.unlink()
        elif path.is_dir() and _SCOPE.match(path.name):
            shutil.rmtree(path)


class DumpWriter:
    """Writes the dumps of every pipeline run into one tree (see the module docstring).

    ``model``: recorded in the manifest. The writer is itself the instrument of the root
    directory (analysis and whole-graph passes, numbered on from run to run);
    :meth:`scope` gives the instrument of a stage program's directory.
    """

    def __init__(self, root: str | Path, *, model: str = "", clear: bool = True):
        self.root = Path(root)
        self.model = model
        self.entries: list[DumpEntry] = []
        self.pipelines: dict[str, str] = {}
        self.extra: dict[str, Any] = {}
        if clear:
            clear_dumps(self.root)
        self._next = 0

    # the Instrument protocol, for the root directory
    def on_input(self, gm: fx.GraphModule) -> None:
        if self._next == 0:
            self._write(gm, INPUT_NAME, 0.0)

    def on_pass(self, p: Any, gm: fx.GraphModule, seconds: float) -> None:
        self._write(gm, p.name, seconds)

    def _write(self, gm: fx.GraphModule, name: str, seconds: float) -> None:
        self.entries.append(write_graph_dumps(gm, self.root, index=self._next, pass_name=name, seconds=seconds))
        self._next += 1
        self.write_manifest()

    def scope(self, name: str) -> "_Scope":
        """The instrument of the pipeline that makes stage program ``name`` (``stage1_tp0``)."""
        if not _SCOPE.match(name):
            raise ValueError(f"dump scope {name!r} is not stage<s>_tp<r>")
        return _Scope(self, name)

    def record_pipeline(self, name: str, text: str) -> None:
        """Record a pipeline's text (:meth:`passes.lowering.manager.PassManager.text`) in the manifest."""
        self.pipelines[name] = text
        self.write_manifest()

    def write_manifest(self) -> Path:
        """Write ``manifest.json`` (every entry so far, the pipelines, the extras); returns its path."""
        path = self.root / MANIFEST
        self.root.mkdir(parents=True, exist_ok=True)
        data = {
            "format": MANIFEST_FORMAT,
            "model": self.model,
            **self.extra,
            "pipelines": self.pipelines,
            "passes": [e.to_json() for e in self.entries],
            "total_seconds": round(sum(e.seconds for e in self.entries), 6),
        }
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return path


class _Scope:
    """The instrument of one stage program's directory."""

    def __init__(self, writer: DumpWriter, name: str):
        self.writer, self.name = writer, name
        self.dir = writer.root / name
        self._next = 0

    def on_input(self, gm: fx.GraphModule) -> None:
        if self._next == 0:
            self._write(gm, SPLIT_NAME, 0.0)

    def on_pass(self, p: Any, gm: fx.GraphModule, seconds: float) -> None:
        self._write(gm, p.name, seconds)

    def _write(self, gm: fx.GraphModule, name: str, seconds: float) -> None:
        self.writer.entries.append(write_graph_dumps(gm, self.dir, index=self._next, pass_name=name,
                                                     seconds=seconds, root=self.writer.root))
        self._next += 1
        self.writer.write_manifest()


def program_text(gm: fx.GraphModule, scope: str) -> str:
    """The text dump of a finished rank program (what ``<scope>/program.txt`` holds)."""
    return graph_text(gm, title=f"{scope} program")


def write_program(gm: fx.GraphModule, root: str | Path, scope: str) -> Path:
    """Write ``<root>/<scope>/program.txt``: the text of the program the runtime runs."""
    path = Path(root) / scope / "program.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(program_text(gm, scope), encoding="utf-8")
    return path
