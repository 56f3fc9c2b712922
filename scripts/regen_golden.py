"""Rewrite the golden IR dumps in tests/golden/gpt/ (run after an intended change to a pass or a dump format).

Run from the repository root: python scripts/regen_golden.py
"""
from pathlib import Path

from ir_dumps.golden import GOLDEN_SPEC, generate, golden_dir

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    out = golden_dir(ROOT)
    for old in out.glob("*.txt"):  # drop dumps of passes that no longer exist
        old.unlink()
    files = generate(out)
    print(f"{GOLDEN_SPEC}: wrote {len(files)} golden dumps to {out.relative_to(ROOT)}")
    for f in files:
        print(f"  {f.name}")


if __name__ == "__main__":
    main()
