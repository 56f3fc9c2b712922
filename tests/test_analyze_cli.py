"""`partitioner analyze`: JSON keys, symbolic polynomials, scale, and errors a user can act on."""
import json
import resource
import time

import pytest
import sympy

from partitioner.compile.analysis import analyze
from partitioner.cli.main import main

SMALL_GPT = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32"
KEYS = ("param_count", "param_bytes", "grad_bytes", "optimizer_bytes", "fwd_flops", "bwd_flops",
        "activation_bytes", "peak_bytes")


def _run_json(capsys, *argv):
    assert main(["analyze", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys_are_integers_when_concrete(capsys):
    out = _run_json(capsys, "--model", SMALL_GPT, "--batch", "2", "--seq", "16")
    for key in KEYS:
        assert isinstance(out[key], int), key
    h, v, L, s = 64, 128, 2, 32  # params: tied embedding + positions + L blocks + final LN
    assert out["param_count"] == v * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
    assert out["grad_bytes"] == out["param_bytes"] == 4 * out["param_count"]
    assert out["optimizer_bytes"] >= 8 * out["param_count"]  # AdamW: exp_avg + exp_avg_sq


def test_symbolic_polynomials_match_concrete_runs(capsys):
    sym = _run_json(capsys, "--model", SMALL_GPT, "--batch", "B", "--seq", "S")
    assert isinstance(sym["fwd_flops"], str) and isinstance(sym["activation_bytes"], str)
    B, S = sympy.symbols("B S", positive=True, integer=True)
    fwd = sympy.sympify(sym["fwd_flops"], locals={"B": B, "S": S})
    act = sympy.sympify(sym["activation_bytes"], locals={"B": B, "S": S})
    assert fwd.free_symbols == {B, S} and act.free_symbols == {B, S}
    for b, s in ((2, 16), (3, 32)):
        concrete = _run_json(capsys, "--model", SMALL_GPT, "--batch", str(b), "--seq", str(s))
        assert fwd.subs({B: b, S: s}) == concrete["fwd_flops"]
        assert act.subs({B: b, S: s}) == concrete["activation_bytes"]


def test_human_table_and_per_layer(capsys, tmp_path):
    assert main(["analyze", "--model", SMALL_GPT, "--batch", "2", "--per-layer", "--dump-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "saved activations" in text and "blocks.1" in text and "lm_head" in text
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.name.startswith("01_")) == [".dot", ".json", ".txt"]


@pytest.mark.parametrize("argv, expected", [
    (["--model", SMALL_GPT, "--dtype", "fp8"], "unknown dtype 'fp8'; choose one of fp32, bf16, fp16"),
    (["--model", SMALL_GPT, "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--model", "gpt:layers"], "malformed item 'layers'"),
    (["--model", "gptx:layers=2"], "unknown model 'gptx'"),
    (["--model", "mlp:layers=2", "--seq", "16"], "has no 'seq' dim"),
])
def test_bad_input_is_a_short_error(capsys, argv, expected):
    assert main(["analyze", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err and len(err.splitlines()) <= 3


def test_gpt3_175b_shape_without_allocating_weights(capsys):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.perf_counter()
    out = _run_json(capsys, "--model", "gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048", "--batch", "1")
    elapsed = time.perf_counter() - start
    print(f"GPT-3 175B analyze: {elapsed:.1f} s")  # target < 20 s; timed in bench/, not asserted here
    assert abs(out["param_count"] - 174.6e9) / 174.6e9 < 1e-3
    assert out["param_bytes"] == 4 * out["param_count"]
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
    assert grown_gib < 4, f"analysis allocated {grown_gib:.1f} GiB: weights must stay on the meta device"


def test_analyze_python_api_keeps_user_dim_names():
    result = analyze(SMALL_GPT, batch="B", seq=16)
    assert {str(s) for s in sympy.sympify(result.fwd_flops).free_symbols} == {"B"}
    assert result.dims["batch"] == "B" and result.dims["seq"] == 16
