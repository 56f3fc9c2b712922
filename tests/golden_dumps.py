"""The golden dumps: a small zoo GPT through the analysis pipeline, and through the lowering of
one plan (tp=2 x pp=2, every block recomputed), as text files.

``tests/golden/gpt/NN_<pass>.txt`` and ``tests/golden/gpt_transforms/**`` are the expected dumps
(compared by :func:`ir_dumps.golden.compare`); ``python scripts/regen_golden.py`` rewrites them.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from passes.ir.config import ParallelConfig
from partitioner.inputs.models import build_model
from passes.capture.capture import capture_spec
from ir_dumps.writer import DumpWriter
from partitioner.compile.build import run_analysis_passes
from ir_dumps.writer import write_program
from partitioner.compile.build import lower_plan
from partitioner.cost.cluster import Cluster

GOLDEN_SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16"
GOLDEN_SYMBOLIC = ("batch", "seq")
TRANSFORM_CONFIG = ParallelConfig(tp=2, pp=2, checkpointing="full", micro_batch_size=2, num_micro_batches=2)
"""The plan of the transform goldens: (tp, pp) = (2, 2), every block recomputed."""


def _graph():

    return capture_spec(build_model(GOLDEN_SPEC, device="meta"), symbolic=GOLDEN_SYMBOLIC)


def _copy_text(src: Path, out_dir: Path, keep) -> list[Path]:
    files = []
    for path in sorted(src.rglob("*.txt")):
        rel = path.relative_to(src)
        if not keep(rel):
            continue
        dst = out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst)
        files.append(dst)
    return files


def generate(out_dir: Path) -> list[Path]:
    """Write the text dump of every analysis pass of the golden model into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_analysis_passes(_graph(), writer=DumpWriter(tmp))
        return _copy_text(Path(tmp), out_dir, lambda rel: True)


def generate_transforms(out_dir: Path, *, dump_dir: Path | None = None) -> list[Path]:
    """Write the text dumps of the lowering of :data:`TRANSFORM_CONFIG` into ``out_dir``: the
    whole-graph tag passes (numbered after the analysis passes, which are :func:`generate`'s) and,
    per (stage, tp rank), every pass and the finished ``program.txt``. ``dump_dir`` keeps the
    whole tree (all kinds and the manifest) there instead of in a temporary directory."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(dump_dir) if dump_dir is not None else Path(tmp)
        writer = DumpWriter(root)
        gm = run_analysis_passes(_graph(), writer=writer)
        first = len(writer.entries)
        lowering = lower_plan(gm, TRANSFORM_CONFIG, cluster=Cluster.preset("local-cpu"), writer=writer, check=False)
        for (s, t), module in sorted(lowering.programs.items()):
            write_program(module, root, f"stage{s}_tp{t}")
        return _copy_text(root, out_dir, lambda rel: len(rel.parts) > 1 or int(rel.name.split("_", 1)[0]) >= first)
