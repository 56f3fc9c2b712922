"""``partitioner plan --dump-dir D``: the whole lowering, pass by pass, every rank program as text
and ONNX (valid under onnx.checker), the stage picture, plan.json and report.html; ``ir_dumps
explain`` on a tensor-parallel linear names its stage, its sharding and the cost behind it; and
the manifest's command writes the same tree again."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from ir_dumps.cli import main as ir_main
from ir_dumps.golden import text_files
from partitioner.cli.main import main

MODEL = "gpt:layers=4,hidden=128,heads=4,vocab=1000,seq=64"
ARGV = ["plan", "--model", MODEL, "--cluster", "dgx-a100-80gb", "--nodes", "1", "--global-batch", "16",
        "--fix", "dp=2,tp=2,pp=2,sequence_parallel=false"]  # Megatron f/g ops in every block


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "D"
    assert main([*ARGV, "--dump-dir", str(out)]) == 0
    return out


def test_plan_writes_the_whole_lowering(tree):
    manifest = json.loads((tree / "manifest.json").read_text())
    root = [e["name"] for e in manifest["passes"] if not e["dir"]]
    assert root == ["input", "annotate_shapes", "annotate_blocks", "annotate_moe", "annotate_flops",
                    "annotate_memory", "tag_tensor_parallel", "tag_pipeline_stages"]
    scopes = sorted({e["dir"] for e in manifest["passes"] if e["dir"]})
    assert scopes == ["stage0_tp0", "stage0_tp1", "stage1_tp0", "stage1_tp1"]
    assert manifest["config"]["tp"] == 2 and manifest["config"]["pp"] == 2 and manifest["config"]["dp"] == 2
    for scope in scopes:
        names = [e["name"] for e in manifest["passes"] if e["dir"] == scope]
        assert names[:3] == [f"{scope}/split", f"{scope}/apply_tensor_parallel", f"{scope}/specialize_dims"]
        program = (tree / scope / "program.txt").read_text()
        assert "partitioner.copy_to_tp" in program or "partitioner.reduce_from_tp" in program
        model = onnx.load(str(tree / scope / "program.onnx"))
        onnx.checker.check_model(model)
        props = {p.key: p.value for p in model.metadata_props}
        assert props["partitioner.tp_rank"] == scope[-1] and props["partitioner.tp_degree"] == "2"
        assert any(n.domain == "partitioner" for n in model.graph.node)
    stages = (tree / "stages.dot").read_text()
    assert "cluster_stage_0" in stages and "cluster_stage_1" in stages and "color=red" in stages
    assert (tree / "plan.json").is_file() and (tree / "report.html").is_file()
    assert manifest["pipelines"]["stage1_tp1"].startswith("apply_tensor_parallel{rank=1,group=tp,")


def test_show_and_diff_work_on_transform_passes(tree, capsys):
    assert ir_main(["show", str(tree), "--pass", "stage0_tp1/apply_tensor_parallel"]) == 0
    text = capsys.readouterr().out
    assert "stage0_tp1 pass 01 apply_tensor_parallel" in text and "partitioner.copy_to_tp" in text
    assert ir_main(["diff", str(tree / "stage0_tp0" / "00_split.json"),
                    str(tree / "stage0_tp0" / "01_apply_tensor_parallel.json")]) == 0
    assert "copy_to_tp" in capsys.readouterr().out


def test_explain_a_tp_sharded_linear(tree, capsys):
    assert ir_main(["explain", str(tree), "--node", "linear_3"]) == 0
    text = capsys.readouterr().out
    assert "module blocks.0.mlp.proj" in text
    assert "decided by pass tag_pipeline_stages" in text and "stage 0" in text
    assert "decided by pass tag_tensor_parallel" in text and "role=row" in text
    assert "parameter blocks.0.mlp.proj.weight: {'dim': 1" in text
    assert "cost: the search chose tp=2" in text and "tensor-parallel communication" in text
    assert "rank programs holding it: stage0_tp0, stage0_tp1" in text
    assert "(50% of the whole graph's at these dims)" in text  # each tp rank computes half


def test_the_manifest_command_writes_the_same_tree(tree, tmp_path):
    manifest = json.loads((tree / "manifest.json").read_text())
    args = shlex.split(manifest["reproduce"])
    assert args[:2] == ["partitioner", "lower"]
    args[args.index("--dump-dir") + 1] = str(tmp_path / "again")
    run = subprocess.run([sys.executable, "-m", "partitioner", *args[1:]], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    old, new = text_files(tree), text_files(tmp_path / "again")
    assert sorted(old) == sorted(new)
    assert all(old[k].read_bytes() == new[k].read_bytes() for k in old)
