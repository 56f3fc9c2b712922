"""`partitioner plan`: the documented JSON keys, --fix parsing, and the Python entry point."""
import json
import os
import subprocess
import sys

import pytest

import partitioner
from partitioner.cli.main import main
from partitioner.api.planning import parse_fix

MODEL = "gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=128"


def test_plan_json_has_documented_keys(capsys, tmp_path):
    argv = ["plan", "--model", MODEL, "--cluster", "dgx-a100-80gb", "--nodes", "1", "--global-batch", "16",
            "--json", "--dump-dir", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("model", "cluster", "global_batch", "config", "stages", "predicted", "alternatives"):
        assert key in out, key
    config = out["config"]
    for key in ("dp", "tp", "pp", "virtual_pp", "micro_batch_size", "num_micro_batches", "schedule", "zero_stage",
                "sequence_parallel", "checkpointing", "offload", "dtype", "stage_boundaries"):
        assert key in config, key
    for key in ("step_time_s", "tflops_per_device", "mfu", "peak_memory_bytes", "bubble_fraction"):
        assert key in out["predicted"], key
    assert config["dp"] * config["tp"] * config["pp"] == 8
    assert config["dp"] * config["micro_batch_size"] * config["num_micro_batches"] == 16
    assert json.loads((tmp_path / "plan.json").read_text()) == out


def test_plan_with_fix_and_table(capsys):
    assert main(["plan", "--model", MODEL, "--cluster", "dgx-a100-80gb", "--global-batch", "16",
                 "--fix", "tp=2,pp=2,schedule=1f1b"]) == 0
    text = capsys.readouterr().out
    knob_rows = {line.split()[0]: line.split()[-1] for line in text.splitlines() if line.strip()}
    assert knob_rows["tp"] == "2" and knob_rows["pp"] == "2" and knob_rows["schedule"] == "1f1b"
    assert "step time" in text and "stage" in text


def test_python_entry_point_matches_cli(capsys):
    chosen = partitioner.plan(MODEL, "dgx-a100-80gb", training=partitioner.Training(global_batch=16), fix={"tp": 2})
    assert chosen.tp == 2
    assert main(["plan", "--model", MODEL, "--cluster", "dgx-a100-80gb", "--global-batch", "16", "--fix", "tp=2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["step_time_s"] == chosen.predicted.step_time_s


@pytest.mark.parametrize("text, message", [
    ("tp=8,pp", "malformed --fix item 'pp'"),
    ("tq=8", "unknown knob 'tq'"),
    ("tp=eight", "tp takes an integer"),
    ("sequence_parallel=maybe", "use true or false"),
])
def test_fix_errors(text, message):
    with pytest.raises(partitioner.ConfigError, match=message):
        parse_fix(text)


def test_fix_types():
    assert parse_fix("tp=8,schedule=interleaved,sequence_parallel=true") == {
        "tp": 8, "schedule": "interleaved", "sequence_parallel": True}


def test_unknown_cluster_is_a_short_error(capsys):
    assert main(["plan", "--model", MODEL, "--cluster", "dgx-z9000", "--global-batch", "16"]) == 2
    assert "dgx-a100-80gb" in capsys.readouterr().err


def test_a_reader_that_stops_early_gets_no_error(tmp_path):
    """`partitioner plan ... | head -1`: the command stops quietly when its reader goes away."""
    env = {**os.environ, "PARTITIONER_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "partitioner", "plan", "--model", MODEL, "--cluster",
                             "dgx-a100-80gb", "--global-batch", "16"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().startswith(b"plan for")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "error" not in err and "Exception" not in err, err
