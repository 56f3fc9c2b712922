"""bench/published_runs.py's table of published runs, checked against what each source prints:
the step time derived from the published FLOP/s or tokens/s must give back the source's own MFU
(or iteration time), so a figure copied wrong or a FLOP count unlike the source's fails here.
(The planner's predictions for these runs take minutes: bench/README.md.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is scripts, not a package

import published_runs as bench  # noqa: E402

RUNS = {r.label: r for r in bench.published_runs()}


def _mfu(run) -> float:
    return run.model_flops / (run.gpus * run.peak * run.step_s)


@pytest.mark.parametrize("label, mfu", [
    ("Llama 3 70B ckpt=full", 0.517), ("Llama 2 13B ckpt=none", 0.611), ("Llama 2 70B ckpt=full", 0.505),  # torchtitan
    ("Llama 3 405B dp64", 0.43), ("Llama 3 405B dp128", 0.41),  # Llama 3 Table 4 (two digits)
    ("GPT 175B selective +SP", 0.514), ("GPT 1T selective +SP", 0.563),  # Korthikanti / Megatron-LM README
])
def test_the_published_mfu_comes_back_from_the_step_time(label, mfu):
    assert _mfu(RUNS[label]) == pytest.approx(mfu, abs=0.006)


@pytest.mark.parametrize("dp, iteration_s, tflops", [(8, 60.1, 126), (10, 50.2, 121), (12, 44.4, 113)])
def test_mt_nlg_iteration_times_match_its_flop_rates(dp, iteration_s, tflops):
    run = RUNS[f"GPT 530B dp{dp}"]
    assert run.step_s == iteration_s and run.gpus == 280 * dp
    # MT-NLG counts FLOPs with the recompute forward, as Narayanan et al.'s eq. 3
    assert bench.narayanan_flops(1920, 105, 20480) / (run.gpus * tflops * 1e12) == pytest.approx(iteration_s, rel=0.006)


def test_every_source_pins_a_full_data_tensor_pipeline_layout():
    assert len({r.source for r in RUNS.values()}) == 5
    for run in RUNS.values():
        fix = run.fix
        assert fix["dp"] * fix.get("tp", 1) * fix.get("pp", 1) == run.gpus, run.label
        assert run.global_batch % fix["dp"] == 0, run.label
