"""The README's Python examples run as shown, and use only the front doors: names exported by
``partitioner`` (and by ``runtime`` for data, metrics, schedules and the mesh).

Each ```python block runs as its own script in an empty directory, the way a user pastes it: one
process, or a 2-rank ``torchrun`` where the text says "on every rank of a 2-rank job".
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import partitioner
import runtime

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[tuple[str, str]]:
    """(the paragraph before it, the code) of every ```python block of the README."""
    text = README.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[:m.start()].rstrip().rsplit("\n\n", 1)[-1]
        out.append((before, m.group(1)))
    return out


BLOCKS = _blocks()


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_examples_import_only_the_front_doors(index):
    exported = {"partitioner": set(partitioner.__all__), "runtime": set(runtime.__all__)}
    for node in ast.walk(ast.parse(BLOCKS[index][1])):
        if isinstance(node, ast.ImportFrom):
            assert node.module in exported, f"block {index} imports from {node.module}"
            missing = {a.name for a in node.names} - exported[node.module]
            assert not missing, f"block {index}: {sorted(missing)} not exported by {node.module}"
        elif isinstance(node, ast.Import):
            assert all(a.name in ("torch", "partitioner", "runtime") for a in node.names), ast.unparse(node)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs_as_shown(index, tmp_path):
    before, code = BLOCKS[index]
    script = tmp_path / "example.py"
    script.write_text(code)
    (tmp_path / "corpus.txt").write_text(README.read_text() * 4)  # what "corpus.txt" names
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(README.parent), env.get("PYTHONPATH", "")])
    ranks = re.search(r"every rank of a (\d+)-rank job", before)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks.group(1)]
                if ranks else [sys.executable])
    run = subprocess.run([*launcher, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"block {index}:\n{code}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
