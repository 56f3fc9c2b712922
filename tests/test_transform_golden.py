"""Golden text dumps of the small symbolic GPT through the lowering of the plan (tp, pp) = (2, 2)
with full checkpointing: the whole-graph tag passes, then every pass of each (stage, tp rank)
program and the finished program.

On failure the message is a unified diff; if the change is intended, regenerate with
``python scripts/regen_golden.py`` and review the diff of tests/golden/ before committing.
"""
import json
from pathlib import Path

import pytest

from ir_dumps.golden import REGEN_COMMAND, compare, transform_golden_dir
from tests.golden_dumps import TRANSFORM_CONFIG, generate_transforms
from passes.lowering.pipelines import analysis_passes, stage_passes, whole_graph_passes

GOLDEN = transform_golden_dir(Path(__file__).resolve().parent.parent)
C = TRANSFORM_CONFIG


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out, full = tmp_path_factory.mktemp("golden"), tmp_path_factory.mktemp("full")
    return generate_transforms(out, dump_dir=full), out, full


def _expected_names() -> list[str]:
    first = len(analysis_passes()) + 1
    passes = [p.name for p in whole_graph_passes(C, cost=None, starts=(2,))]
    names = [f"{i:02d}_{name}.txt" for i, name in enumerate(passes, first)]
    for s in range(C.pp):
        for t in range(C.tp):
            stage = [p.name for p in stage_passes(C, stage=s, tp_rank=t, tp_group="tp", cost=None)]
            names += [f"stage{s}_tp{t}/{i:02d}_{n}.txt" for i, n in enumerate(["split", *stage])]
            names.append(f"stage{s}_tp{t}/program.txt")
    return names


def test_transform_dumps_match_golden(dumps):
    files, out, _ = dumps
    assert [f.relative_to(out).as_posix() for f in files] == sorted(_expected_names())
    report = compare(GOLDEN, out)
    if report:
        pytest.fail(f"lowering IR dumps differ from tests/golden/gpt_transforms (if intended, run "
                    f"`{REGEN_COMMAND}`):\n{report}", pytrace=False)


def test_passes_are_tags_then_per_program_rewrites_then_analysis():
    assert [p.name for p in whole_graph_passes(C, cost=None, starts=(2,))] == [
        "tag_tensor_parallel", "checkpoint_policy", "tag_pipeline_stages"]
    assert [p.name for p in stage_passes(C, stage=0, tp_rank=1, tp_group="tp", cost=None)] == [
        "apply_tensor_parallel", "specialize_dims", "restrict_checkpoint_plan", "apply_checkpoint",
        "annotate_shapes", "annotate_flops", "annotate_memory"]


def test_manifest_numbers_each_directory_and_records_the_pipelines(dumps):
    _, _, full = dumps
    manifest = json.loads((full / "manifest.json").read_text())
    root = [e for e in manifest["passes"] if not e["dir"]]
    assert [e["index"] for e in root] == list(range(len(root)))
    assert [e["name"] for e in root][:7] == ["input", "annotate_shapes", "annotate_blocks", "annotate_moe",
                                              "annotate_flops", "annotate_memory", "tag_tensor_parallel"]
    scope = [e for e in manifest["passes"] if e["dir"] == "stage1_tp1"]
    assert [e["index"] for e in scope] == list(range(len(scope))) and scope[0]["name"] == "stage1_tp1/split"
    assert manifest["pipelines"]["stage1_tp1"].startswith("apply_tensor_parallel{rank=1,group=tp,")
    assert manifest["pipelines"]["whole_graph"] == "tag_tensor_parallel{degree=2},checkpoint_policy{policy=full}," \
                                                   "tag_pipeline_stages{starts=[2]}"
    for entry in manifest["passes"]:
        for kind in ("txt", "json", "dot"):
            assert (full / entry["files"][kind]).is_file()


def test_dumps_show_each_transform():
    text = {p.relative_to(GOLDEN).as_posix(): p.read_text() for p in GOLDEN.rglob("*.txt")}
    assert "tensor_parallel role=column" in text["06_tag_tensor_parallel.txt"]
    assert "checkpoint region=0 recompute=True policy=full" in text["07_checkpoint_policy.txt"]
    assert "pipeline_stage=1" in text["08_tag_pipeline_stages.txt"]
    for s in (0, 1):
        code = [line for line in text[f"stage{s}_tp0/04_apply_checkpoint.txt"].splitlines() if line.startswith("%")]
        assert sum("torch.utils.checkpoint.checkpoint(" in line for line in code) == 1  # one block per stage
        assert not any("scaled_dot_product_attention" in line for line in code)  # the block moved out
        program = text[f"stage{s}_tp0/program.txt"]
        assert "kind=checkpoint" in program  # the re-analysis counts the recompute
        assert "reduce_from_tp" in program or "copy_to_tp" in program or "vocab_parallel" in program
        assert "float32[2, 16, 64]" in program or "float32[2, 16, 32]" in program  # at the micro-batch
    assert "0x" not in "".join(text.values())
