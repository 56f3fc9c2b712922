"""Golden text dumps: compare a directory of text dumps with the expected one, readably.

The goldens themselves (a small zoo GPT through the analysis pipeline, and through the lowering of
one plan) are made by :mod:`tests.golden_dumps`; ``tests/test_golden_dumps.py`` and
``tests/test_transform_golden.py`` regenerate them into a temporary directory and compare;
``python scripts/regen_golden.py`` rewrites them after an intended change.
"""
from __future__ import annotations

import difflib
from pathlib import Path

REGEN_COMMAND = "python scripts/regen_golden.py"


def golden_dir(repo_root: Path) -> Path:
    return Path(repo_root) / "tests" / "golden" / "gpt"


def transform_golden_dir(repo_root: Path) -> Path:
    return Path(repo_root) / "tests" / "golden" / "gpt_transforms"


def text_files(root: Path) -> dict[str, Path]:
    """Every ``.txt`` below ``root`` by its path relative to it (``stage0_tp0/01_x.txt``)."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*.txt"))}


def compare(expected_dir: Path, actual_dir: Path) -> str:
    """A readable report of every difference between two golden directories ("" if none)."""
    expected, actual = text_files(expected_dir), text_files(actual_dir)
    parts = []
    for name in sorted(expected.keys() - actual.keys()):
        parts.append(f"golden file {name} is no longer produced (a pass was removed or renamed)")
    for name in sorted(actual.keys() - expected.keys()):
        parts.append(f"new dump {name} has no golden file")
    for name in sorted(expected.keys() & actual.keys()):
        old = expected[name].read_text(encoding="utf-8").splitlines(keepends=True)
        new = actual[name].read_text(encoding="utf-8").splitlines(keepends=True)
        if old != new:
            parts.append("".join(difflib.unified_diff(old, new, fromfile=f"golden/{name}", tofile=f"now/{name}")))
    return "\n".join(parts)
