"""The packages import one way (partitioner -> passes, runtime, ir_dumps; passes, runtime and
ir_dumps -> passes.ir; passes.ir -> nothing of the project): the import-linter contracts of
pyproject.toml, checked by running ``lint-imports`` on the source tree."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed; pip install -e '.[test]' installs import-linter")
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": str(Path(sys.executable).parent)})


def test_import_contracts_are_kept():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 kept, 0 broken" in run.stdout


def test_a_backward_import_breaks_the_contract(tmp_path):
    # the same tree with one import pointing up (the leaf importing the runtime) must fail
    for pkg in ("partitioner", "passes", "runtime", "ir_dumps"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    leaf = tmp_path / "passes" / "ir" / "cost.py"
    leaf.write_text(leaf.read_text() + "\nimport runtime.comm  # noqa: E402,F401\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "passes.ir is the leaf" in run.stdout and "passes.ir.cost -> runtime.comm" in run.stdout
