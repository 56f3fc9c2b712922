"""``ir-dumps`` / ``python -m ir_dumps``: look at the dumps a pipeline run wrote.

::

    ir-dumps show DIR                 table of passes: node counts, wall time
    ir-dumps show DIR --pass P        the text dump after pass P (name, number or file stem)
    ir-dumps show DIR --node N        node N's code and annotations after every pass
    ir-dumps diff A B                 nodes added/removed and meta changed; A and B are two
                                      .json dumps or two dump directories (passes paired by name)
    ir-dumps diff DIR_A DIR_B --pass P   only pass P of both directories
    ir-dumps explain DIR --node N     why node N is where it is: stage, sharding, recompute,
                                      offload, with the cost terms that decided each

Exit status: 0 on success (also when a diff finds differences), 2 on a usage error such as a
missing directory, pass or node.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Sequence

from ir_dumps.diff import diff_dumps, render
from ir_dumps.reader import DumpDir, DumpError, load_dump_dir, load_json_dump


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "show":
            text = _show(args)
        elif args.command == "explain":
            from ir_dumps.explain import explain_node

            text = explain_node(args.dir, args.node)
        else:
            text = _diff(args)
    except DumpError as exc:
        print(f"ir-dumps: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ir-dumps", description="Inspect IR dumps written by the pass manager.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="list passes, or show one pass or one node")
    show.add_argument("dir", help="dump directory (holds manifest.json)")
    which = show.add_mutually_exclusive_group()
    which.add_argument("--pass", dest="pass_name", help="show the text dump after this pass (name or number)")
    which.add_argument("--node", help="show this node's annotations after every pass")
    diff = sub.add_parser("diff", help="nodes added/removed and meta changed between two dumps")
    diff.add_argument("a", help="a .json dump or a dump directory")
    diff.add_argument("b", help="a .json dump or a dump directory")
    diff.add_argument("--pass", dest="pass_name", help="with directories: compare only this pass")
    explain = sub.add_parser("explain", help="why a node is on its stage, sharded, recomputed, offloaded")
    explain.add_argument("dir", help="dump directory (holds manifest.json; plan.json there is read too)")
    explain.add_argument("--node", required=True, help="node name, e.g. linear_3 or %linear_3")
    return parser


# ----------------------------------------------------------------------------------------- show
def _show(args: argparse.Namespace) -> str:
    dump = load_dump_dir(args.dir)
    if args.pass_name is not None:
        return dump.text(dump.entry(args.pass_name))
    if args.node is not None:
        return _show_node(dump, args.node)
    return _table(dump)


def _table(dump: DumpDir) -> str:
    rows = [("#", "pass", "nodes", "time (ms)", "dump")]
    rows += [(f"{e.index:02d}", e.name, str(e.nodes), f"{e.seconds * 1e3:.1f}", e.file("txt")) for e in dump.entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {0, 2, 3}
    lines = [f"model: {dump.model or '?'}   dir: {dump.path}"]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.append(f"total: {dump.total_seconds * 1e3:.1f} ms over {len(dump.entries)} dumps")
    return "\n".join(lines) + "\n"


def _show_node(dump: DumpDir, name: str) -> str:
    name = name.removeprefix("%")
    lines = [f"node %{name} in {dump.path}"]
    seen = False
    previous = None
    all_names: list[str] = []
    for entry in dump.entries:
        graph = dump.load(entry)
        node = graph.node(name)
        lines.append(f"== {entry.index:02d} {entry.name}")
        if node is None:
            all_names.extend(n.name for n in graph.nodes)
            lines.append("   (not in this graph)")
            continue
        seen = True
        lines.append(f"   {_code_line(dump, entry, name)}")
        if previous is not None and previous == node.meta:
            lines.append("   meta unchanged")
        else:
            for key, fields in node.meta.items():
                lines.append(f"   {key}:")
                for field, value in (fields.items() if isinstance(fields, dict) else [("", fields)]):
                    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
                    lines.append(f"     {field} = {text}")
        previous = node.meta
    if not seen:
        close = difflib.get_close_matches(name, sorted(set(all_names)), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `ir-dumps show DIR --pass P` lists a pass's nodes"
        raise DumpError(f"no node {name!r} in any dump of {dump.path}{hint}")
    return "\n".join(lines) + "\n"


def _code_line(dump: DumpDir, entry, name: str) -> str:
    """The node's line in the text dump (code plus annotations)."""
    prefix = f"%{name} = "
    for line in dump.text(entry).splitlines():
        if line.startswith(prefix) or (name == "output" and line.startswith("return ")):
            return line
    return prefix + "?"


# ----------------------------------------------------------------------------------------- diff
def _diff(args: argparse.Namespace) -> str:
    a, b = Path(args.a), Path(args.b)
    for p in (a, b):
        if not p.exists():
            raise DumpError(f"{p} does not exist; give two .json dumps or two dump directories")
    if a.is_dir() != b.is_dir():
        raise DumpError(f"cannot compare {'directory' if a.is_dir() else 'file'} {a} with "
                        f"{'directory' if b.is_dir() else 'file'} {b}; give two .json dumps or two dump directories")
    if not a.is_dir():
        if args.pass_name is not None:
            raise DumpError("--pass only applies to dump directories")
        return render(diff_dumps(load_json_dump(a), load_json_dump(b)))
    da, db = load_dump_dir(a), load_dump_dir(b)
    if args.pass_name is not None:
        return render(diff_dumps(da.load(da.entry(args.pass_name)), db.load(db.entry(args.pass_name))))
    names_b = {e.name: e for e in db.entries}
    parts = []
    for entry in da.entries:
        if entry.name in names_b:
            parts.append(render(diff_dumps(da.load(entry), db.load(names_b[entry.name]))))
        else:
            parts.append(f"pass {entry.name!r} only in {a}\n")
    names_a = {e.name for e in da.entries}
    parts.extend(f"pass {e.name!r} only in {b}\n" for e in db.entries if e.name not in names_a)
    return "\n".join(parts)
