"""Golden text dumps of a small symbolic GPT after every analysis pass.

On failure the message is a unified diff; if the change is intended, regenerate with
``python scripts/regen_golden.py`` and review the diff of tests/golden/ before committing.
"""
from pathlib import Path

import pytest

from ir_dumps.golden import REGEN_COMMAND, compare, golden_dir
from tests.golden_dumps import generate
from passes.lowering.pipelines import analysis_passes

GOLDEN = golden_dir(Path(__file__).resolve().parent.parent)


def test_golden_dumps_match(tmp_path):
    files = generate(tmp_path)
    expected_names = ["00_input.txt"] + [f"{i:02d}_{p.name}.txt" for i, p in enumerate(analysis_passes(), 1)]
    assert [f.name for f in files] == expected_names
    report = compare(GOLDEN, tmp_path)
    if report:
        pytest.fail(f"IR dumps differ from tests/golden/gpt (if intended, run `{REGEN_COMMAND}`):\n{report}",
                    pytrace=False)


def test_golden_dumps_show_symbolic_shapes():
    text = (GOLDEN / "01_annotate_shapes.txt").read_text()
    assert "float32[batch, seq, 64]" in text
    assert "0x" not in text


def test_compare_reports_missing_new_and_changed_files(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "01_a.txt").write_text("x\ny\n")
    (new / "01_a.txt").write_text("x\nz\n")
    (old / "02_gone.txt").write_text("")
    (new / "02_new.txt").write_text("")
    report = compare(old, new)
    assert "golden file 02_gone.txt is no longer produced" in report
    assert "new dump 02_new.txt has no golden file" in report
    assert "--- golden/01_a.txt\n+++ now/01_a.txt\n" in report and "-y\n+z\n" in report
    assert compare(old, old) == ""
