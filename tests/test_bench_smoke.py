"""Smoke test of bench/runtime_vs_torch.py: its smallest configuration, one step per side of every
pair in one spawn of 4 gloo ranks. Checks correctness only (both sides, and single-process eager
training, give the same first-step loss), never speed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is scripts, not a package; spawned ranks inherit sys.path

import runtime_vs_torch as bench  # noqa: E402

from partitioner.inputs.models import build_model  # noqa: E402

CONFIG = bench.BenchConfig(**{**bench.CONFIGS["smoke"].__dict__, "warmup": 0, "steps": 1})


@pytest.fixture(scope="module")
def results():
    return {r.pair: r for r in bench.run(CONFIG, bench.PAIRS, timeout_s=240)}


@pytest.fixture(scope="module")
def eager_loss():
    """The first step's loss of plain single-process training (before any update)."""
    spec = build_model(CONFIG.spec)
    batch = spec.example_inputs({"batch": CONFIG.global_batch}, seed=100)
    return spec.loss(spec.module, *batch).item()


@pytest.mark.slow
@pytest.mark.parametrize("pair", bench.PAIRS)
def test_both_sides_give_the_eager_loss(results, eager_loss, pair):
    r = results[pair]
    assert len(r.torch_losses) == 1 and len(r.torch_s) == 1
    assert r.torch_losses[0] == pytest.approx(eager_loss, rel=1e-5)
    if r.skipped:  # our tp side until ParallelModel takes tp
        assert pair == "tp" and not bench.tp_available(), r.skipped
        return
    assert len(r.ours_losses) == 1 and len(r.ours_s) == 1
    assert r.ours_losses[0] == pytest.approx(r.torch_losses[0], rel=1e-5)
    assert r.max_rel_loss_diff < 1e-5


def test_table_has_a_row_per_pair(results):
    table = bench.format_table(list(results.values()))
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == list(bench.PAIRS)
