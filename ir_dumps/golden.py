"""Golden text dumps: a small zoo GPT through the default analysis pipeline, one file per pass.

``tests/golden/gpt/NN_<pass>.txt`` are the expected dumps; ``tests/test_golden_dumps.py``
regenerates them into a temporary directory and compares; ``python scripts/regen_golden.py``
rewrites them after an intended change.
"""
from __future__ import annotations

import difflib
import shutil
import tempfile
from pathlib import Path

GOLDEN_SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16"
GOLDEN_SYMBOLIC = ("batch", "seq")
REGEN_COMMAND = "python scripts/regen_golden.py"


def golden_dir(repo_root: Path) -> Path:
    return Path(repo_root) / "tests" / "golden" / "gpt"


def generate(out_dir: Path) -> list[Path]:
    """Write the text dump of every pass of the golden model into ``out_dir``; returns the files."""
    from partitioner.model_spec import build_model
    from passes.capture import capture_spec
    from passes.manager import default_analysis_pipeline

    spec = build_model(GOLDEN_SPEC, device="meta")
    gm = capture_spec(spec, symbolic=GOLDEN_SYMBOLIC)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        default_analysis_pipeline(dump_dir=tmp).run(gm)
        files = []
        for src in sorted(Path(tmp).glob("*.txt")):
            dst = out_dir / src.name
            shutil.copyfile(src, dst)
            files.append(dst)
    return files


def compare(expected_dir: Path, actual_dir: Path) -> str:
    """A readable report of every difference between two golden directories ("" if none)."""
    expected = {p.name: p for p in Path(expected_dir).glob("*.txt")}
    actual = {p.name: p for p in Path(actual_dir).glob("*.txt")}
    parts = []
    for name in sorted(expected.keys() - actual.keys()):
        parts.append(f"golden file {name} is no longer produced (a pass was removed or renamed)")
    for name in sorted(actual.keys() - expected.keys()):
        parts.append(f"new dump {name} has no golden file")
    for name in sorted(expected.keys() & actual.keys()):
        old = expected[name].read_text(encoding="utf-8").splitlines(keepends=True)
        new = actual[name].read_text(encoding="utf-8").splitlines(keepends=True)
        if old != new:
            parts.append("".join(difflib.unified_diff(old, new, fromfile=f"golden/{name}", tofile=f"now/{name}")))
    return "\n".join(parts)


# --------------------------------------------------------------------------------- transforms
TRANSFORM_OPTIONS = {"checkpointing": "full", "tp": 2, "pp": 2}
"""The plan of the transform goldens: (tp, pp) = (2, 2), every block recomputed."""


def transform_golden_dir(repo_root: Path) -> Path:
    return Path(repo_root) / "tests" / "golden" / "gpt_transforms"


def generate_transforms(out_dir: Path, *, dump_dir: Path | None = None) -> list[Path]:
    """Write the text dumps of the golden model after every transform pass of
    :data:`TRANSFORM_OPTIONS` (numbered after the analysis passes) and of the stage-0/1 programs
    of tp rank 0 into ``out_dir``; returns the files. The analysis dumps are left out: they are
    the goldens of :func:`generate`. ``dump_dir`` keeps the whole run's dumps (all kinds and the
    manifest) there instead of in a temporary directory."""
    from partitioner.model_spec import build_model
    from passes.capture import capture_spec
    from passes.manager import default_analysis_pipeline, run_transforms

    spec = build_model(GOLDEN_SPEC, device="meta")
    gm = capture_spec(spec, symbolic=GOLDEN_SYMBOLIC)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    first = len(default_analysis_pipeline()) + 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = dump_dir if dump_dir is not None else tmp
        run_transforms(gm, dump_dir=tmp, **TRANSFORM_OPTIONS)
        files = []
        for src in sorted(Path(tmp).glob("*.txt")):
            if int(src.name.split("_", 1)[0]) < first:
                continue
            dst = out_dir / src.name
            shutil.copyfile(src, dst)
            files.append(dst)
    return files
