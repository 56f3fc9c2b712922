"""Smoke test of bench/remat_policies.py: one model at one budget prints its table row, and the
row's own numbers agree (the memory analysis's prediction of the lowered ``tensor`` program is
within 3% of what MemTracker measured for it). Never checks speed."""
from __future__ import annotations

import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is scripts, not a package

import remat_policies as bench  # noqa: E402


def test_one_row_of_the_table(capsys):
    bench.run_model("unet", [0.5])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| f |"))
    row = next(line for line in lines if line.startswith("| 0.5 |"))
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    predicted = float(cells["predicted"].rstrip("%"))
    assert abs(predicted) <= 3.0, row
    assert int(cells["step peak: tensor"].replace(",", "")) > 0
    assert re.fullmatch(r"[\d.]+", cells["ms: tensor"]) and float(cells["ms: tensor"]) > 0, row
