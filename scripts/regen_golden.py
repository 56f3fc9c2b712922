"""Rewrite the golden IR dumps in tests/golden/gpt/ (analysis passes) and
tests/golden/gpt_transforms/ (the lowering of one plan: tag passes, then every pass of each rank
program); run after an intended change to a pass or a dump format, then review the diff of
tests/golden/.

Run from the repository root: python scripts/regen_golden.py
"""
import shutil
from pathlib import Path

from ir_dumps.golden import golden_dir, transform_golden_dir
from tests.golden_dumps import GOLDEN_SPEC, TRANSFORM_CONFIG, generate, generate_transforms

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    for what, out, make in (("analysis", golden_dir(ROOT), generate),
                            (f"lowering {TRANSFORM_CONFIG.text()}", transform_golden_dir(ROOT), generate_transforms)):
        if out.exists():  # drop dumps of passes that no longer exist
            shutil.rmtree(out)
        files = make(out)
        print(f"{GOLDEN_SPEC} {what}: wrote {len(files)} golden dumps to {out.relative_to(ROOT)}")
        for f in files:
            print(f"  {f.relative_to(out)}")


if __name__ == "__main__":
    main()
