"""The packages import one way (partitioner -> passes, runtime, ir_dumps; passes, runtime and
ir_dumps -> passes.ir; passes.ir -> nothing of the project), and inside ``passes`` and
``partitioner`` each stage imports only the stages below it: the import-linter contracts of
pyproject.toml, checked by running ``lint-imports`` on the source tree. No module of a package
imports, even lazily, a module that imports it back."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
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
    assert "6 kept, 0 broken" in run.stdout


def _copy_tree(to: Path) -> None:
    for pkg in ("partitioner", "passes", "runtime", "ir_dumps"):
        shutil.copytree(ROOT / pkg, to / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", to / "pyproject.toml")


def test_a_backward_import_breaks_the_contract(tmp_path):
    # the same tree with one import pointing up (the leaf importing the runtime) must fail
    _copy_tree(tmp_path)
    leaf = tmp_path / "passes" / "ir" / "cost.py"
    leaf.write_text(leaf.read_text() + "\nimport runtime.dist.comm  # noqa: E402,F401\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "passes.ir is the leaf" in run.stdout and "passes.ir.cost -> runtime.dist.comm" in run.stdout


def test_an_earlier_stage_importing_a_later_one_breaks_the_pipeline_contract(tmp_path):
    # inside passes/ the stages import only those before them: capture importing the lowering fails
    _copy_tree(tmp_path)
    early = tmp_path / "passes" / "capture" / "input_bounds.py"
    early.write_text(early.read_text() + "\nimport passes.lowering.lower  # noqa: E402,F401\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "passes reads as its pipeline" in run.stdout
    assert "passes.capture.input_bounds -> passes.lowering.lower" in run.stdout


def _import_graph(package: str) -> nx.DiGraph:
    """Module -> the modules of ``package`` it imports, at any depth of its code (a function's
    lazy import counts: it is still a dependency)."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


@pytest.mark.parametrize("package", ["partitioner", "passes", "runtime", "ir_dumps"])
def test_no_module_imports_one_that_imports_it_back(package):
    cycles = [sorted(c) for c in nx.strongly_connected_components(_import_graph(package)) if len(c) > 1]
    assert not cycles, f"modules of {package} that import each other in a circle: {cycles}"


def test_the_cycle_check_finds_a_circle():
    graph = _import_graph("partitioner")
    graph.add_edge("partitioner.cost.cluster", "partitioner.calibration.job_cluster")  # Cluster calibrating itself
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))
