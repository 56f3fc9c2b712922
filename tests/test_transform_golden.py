"""Golden text dumps of the small symbolic GPT after every transform pass of the plan
(tp, pp) = (2, 2) with full checkpointing, and of the stage-0/1 programs of tp rank 0.

On failure the message is a unified diff; if the change is intended, regenerate with
``python scripts/regen_golden.py`` and review the diff of tests/golden/ before committing.
"""
import json
from pathlib import Path

import pytest

from ir_dumps.golden import REGEN_COMMAND, TRANSFORM_OPTIONS, compare, generate_transforms, transform_golden_dir
from passes.manager import default_analysis_pipeline, transform_pipeline

GOLDEN = transform_golden_dir(Path(__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out, full = tmp_path_factory.mktemp("golden"), tmp_path_factory.mktemp("full")
    return generate_transforms(out, dump_dir=full), out, full


def _expected_names() -> list[str]:
    first = len(default_analysis_pipeline()) + 1
    passes = [p.name for p in transform_pipeline(**TRANSFORM_OPTIONS)]
    names = [f"{i:02d}_{name}.txt" for i, name in enumerate(passes, first)]
    last = first + len(passes)
    return names + [f"{last + s:02d}_stage{s}_tp0.txt" for s in range(TRANSFORM_OPTIONS["pp"])]


def test_transform_dumps_match_golden(dumps):
    files, out, _ = dumps
    assert [f.name for f in files] == _expected_names()
    report = compare(GOLDEN, out)
    if report:
        pytest.fail(f"transform IR dumps differ from tests/golden/gpt_transforms (if intended, run "
                    f"`{REGEN_COMMAND}`):\n{report}", pytrace=False)


def test_passes_are_tags_then_rewrites_then_analysis():
    names = [p.name for p in transform_pipeline(**TRANSFORM_OPTIONS)]
    assert names == ["tag_tensor_parallel", "checkpoint_policy", "tag_pipeline_stages", "apply_checkpoint",
                     "reanalyze"]


def test_manifest_numbers_analysis_and_transforms_as_one_run(dumps):
    _, _, full = dumps
    manifest = json.loads((full / "manifest.json").read_text())
    names = [e["name"] for e in manifest["passes"]]
    assert [e["index"] for e in manifest["passes"]] == list(range(len(names)))
    assert names[:4] == ["input", "annotate_shapes", "annotate_flops", "annotate_memory"]
    assert names[4:] == [n.split("_", 1)[1].removesuffix(".txt") for n in _expected_names()]
    for entry in manifest["passes"]:
        for kind in ("txt", "json", "dot"):
            assert (full / entry["files"][kind]).is_file()


def test_dumps_show_each_transform():
    text = {p.name.split("_", 1)[1].removesuffix(".txt"): p.read_text() for p in GOLDEN.glob("*.txt")}
    assert "tensor_parallel role=column" in text["tag_tensor_parallel"]
    assert "checkpoint region=0 recompute=True policy=full" in text["checkpoint_policy"]
    assert "pipeline_stage=1" in text["tag_pipeline_stages"]
    code = [line for line in text["apply_checkpoint"].splitlines() if line.startswith("%")]
    assert sum("torch.utils.checkpoint.checkpoint(" in line for line in code) == 2
    assert not any("scaled_dot_product_attention" in line for line in code)  # the blocks moved out
    assert "kind=checkpoint" in text["reanalyze"]  # the re-analysis counts the recompute
    for s in (0, 1):
        stage = text[f"stage{s}_tp0"]
        assert "torch.utils.checkpoint.checkpoint(" in stage  # one block per stage, recomputed
        assert "reduce_from_tp" in stage or "copy_to_tp" in stage or "vocab_parallel" in stage
    assert "0x" not in "".join(text.values())
