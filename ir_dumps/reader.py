"""Read dumps back: a dump directory (manifest + per-pass JSON) or a single ``.json`` dump.

Values stay as the JSON holds them (sympy expressions as strings); :func:`sympy_value` parses
one back when arithmetic is needed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy

from passes.ir.errors import PartitionerError
from ir_dumps.json_dump import FORMAT
from ir_dumps.writer import MANIFEST, MANIFEST_FORMAT, DumpEntry
from passes.ir.meta import dim_symbol


class DumpError(PartitionerError):
    """A dump directory or file is missing or malformed; the message says which and what to do."""

@dataclass(frozen=True, kw_only=True)
class NodeDump:
    """One node of a JSON dump (see :mod:`ir_dumps.json_dump` for the fields)."""
    name: str
    op: str
    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    users: tuple[str, ...]
    module: str
    meta: dict[str, dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class GraphDump:
    """One JSON dump: the graph after pass number ``index``."""
    pass_name: str
    index: int
    graph: dict[str, Any]
    nodes: tuple[NodeDump, ...]
    path: Path | None = None

    def node(self, name: str) -> NodeDump | None:
        return next((n for n in self.nodes if n.name == name), None)

    def by_name(self) -> dict[str, NodeDump]:
        return {n.name: n for n in self.nodes}


@dataclass(frozen=True, kw_only=True)
class DumpDir:
    """A dump directory: the manifest's entries, in pipeline order."""
    path: Path
    model: str
    entries: tuple[DumpEntry, ...]
    total_seconds: float
    manifest: dict[str, Any] | None = None

    def entry(self, pass_name: str) -> DumpEntry:
        """The entry of a pass by name (``annotate_flops``, ``stage0_tp1/apply_tensor_parallel``),
        number (``2``, ``stage0_tp1/3``) or file stem (``02_annotate_flops``, ``stage0_tp1/03_...``)."""
        for e in self.entries:
            prefix = f"{e.dir}/" if e.dir else ""
            forms = (e.name, f"{prefix}{e.index}", f"{prefix}{e.index:02d}", prefix + Path(e.file("json")).stem)
            if pass_name in forms:
                return e
        known = ", ".join(e.name for e in self.entries)
        raise DumpError(f"no pass {pass_name!r} in {self.path}; passes there: {known}")

    def scopes(self) -> list[str]:
        """The stage program directories of the dump (``stage0_tp0``, ...), in run order."""
        return list(dict.fromkeys(e.dir for e in self.entries if e.dir))

    def load(self, entry: DumpEntry) -> GraphDump:
        return load_json_dump(self.path / entry.file("json"))

    def text(self, entry: DumpEntry) -> str:
        path = self.path / entry.file("txt")
        if not path.is_file():
            raise DumpError(f"text dump {path} is missing; re-run the pipeline with a dump directory")
        return path.read_text(encoding="utf-8")


def load_dump_dir(path: Path | str) -> DumpDir:
    """Read ``manifest.json`` of a dump directory. Raises :class:`DumpError`."""
    path = Path(path)
    if not path.exists():
        raise DumpError(f"dump directory {path} does not exist; run the pipeline with dump_dir={str(path)!r} "
                        f"(or partitioner ... --dump-dir) first")
    if not path.is_dir():
        raise DumpError(f"{path} is not a directory; give the directory that holds manifest.json")
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise DumpError(f"{path} has no {MANIFEST}; is it a dump directory written by the pass manager?")
    data = _read_json(manifest)
    if data.get("format") not in (MANIFEST_FORMAT, _FORMAT_V1):
        raise DumpError(f"{manifest} has format {data.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    entries = tuple(DumpEntry.from_json(e) for e in data.get("passes", []))
    return DumpDir(path=path, model=str(data.get("model", "")), entries=entries,
                   total_seconds=float(data.get("total_seconds", 0.0)), manifest=data)


_FORMAT_V1 = "partitioner-ir-manifest/1"  # one directory, no pipelines (still readable)


def load_json_dump(path: Path | str) -> GraphDump:
    """Read one ``NN_<pass>.json`` dump. Raises :class:`DumpError`."""
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"JSON dump {path} does not exist")
    data = _read_json(path)
    if data.get("format") != FORMAT:
        raise DumpError(f"{path} has format {data.get('format')!r}, expected {FORMAT!r}; "
                        f"is it a graph dump (not the manifest)?")
    nodes = tuple(
        NodeDump(name=n["name"], op=n["op"], target=n["target"], args=tuple(n["args"]),
                 kwargs=dict(n.get("kwargs", {})), users=tuple(n["users"]), module=n.get("module", ""),
                 meta=dict(n.get("meta", {})))
        for n in data["nodes"]
    )
    return GraphDump(pass_name=data["pass"], index=int(data.get("index", 0)), graph=dict(data.get("graph", {})),
                     nodes=nodes, path=path)


def sympy_value(value: Any) -> sympy.Expr:
    """A dumped size back as sympy (named dims become positive integer symbols)."""
    if isinstance(value, (int, float)):
        return sympy.sympify(value)
    expr = sympy.sympify(value)
    return expr.xreplace({s: dim_symbol(s.name) for s in expr.free_symbols})


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DumpError(f"{path} is not valid JSON ({exc}); re-run the pipeline to rewrite it") from exc
    if not isinstance(data, dict):
        raise DumpError(f"{path} does not hold a JSON object")
    return data
