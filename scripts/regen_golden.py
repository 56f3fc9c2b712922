"""Rewrite the golden IR dumps in tests/golden/gpt/ (analysis passes) and
tests/golden/gpt_transforms/ (transform passes and stage programs); run after an intended change
to a pass or a dump format, then review the diff of tests/golden/.

Run from the repository root: python scripts/regen_golden.py
"""
from pathlib import Path

from ir_dumps.golden import (GOLDEN_SPEC, TRANSFORM_OPTIONS, generate, generate_transforms, golden_dir,
                             transform_golden_dir)

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    for what, out, make in (("analysis", golden_dir(ROOT), generate),
                            (f"transforms {TRANSFORM_OPTIONS}", transform_golden_dir(ROOT), generate_transforms)):
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.txt"):  # drop dumps of passes that no longer exist
            old.unlink()
        files = make(out)
        print(f"{GOLDEN_SPEC} {what}: wrote {len(files)} golden dumps to {out.relative_to(ROOT)}")
        for f in files:
            print(f"  {f.name}")


if __name__ == "__main__":
    main()
