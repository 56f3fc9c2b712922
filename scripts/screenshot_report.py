"""Render a report.html in headless Chromium, fail on console errors, save a PNG.

    python scripts/screenshot_report.py                       # plan zoo gpt on local_cluster(4), pp=4
    python scripts/screenshot_report.py --html DIR/report.html --out docs/report.png

Needs the Debian ``chromium`` package (``apt-get install -y chromium``). Chromium runs with no
network, no first-run, no sandbox (we run as root in a container) and a throwaway profile.
Exit status: 0 on success, 1 when Chromium reports a console error or writes no PNG.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from partitioner.calibration.job_cluster import local_cluster

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_ERROR = re.compile(r"Uncaught|ERROR:CONSOLE|Failed to load resource", re.IGNORECASE)


def chromium() -> str:
    """Path of the Chromium binary; exits with a hint when missing."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("screenshot_report: no chromium on PATH; install it with `apt-get update && apt-get install -y chromium`")


def screenshot(html: Path, out: Path, *, width: int = 1400, height: int = 1800) -> list[str]:
    """Save a ``width`` x ``height`` PNG of ``html`` to ``out``; returns console error lines."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
               f"--screenshot={out.resolve()}", f"--window-size={width},{height}", html.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    errors = [line for line in (proc.stderr + proc.stdout).splitlines() if CONSOLE_ERROR.search(line)]
    if proc.returncode != 0:
        errors.append(f"chromium exited with {proc.returncode}: {proc.stderr[-2000:]}")
    if not out.is_file():
        errors.append(f"chromium wrote no {out}")
    return errors


def make_report(path: Path) -> Path:
    """Plan a small zoo GPT on 4 local ranks with pp=4 (so the timeline shows a bubble) and
    write its report with made-up-free inputs: the plan's own prediction only."""
    sys.path.insert(0, str(ROOT))
    from partitioner import Training
    from partitioner.api.planning import plan

    dump = path.parent
    plan("gpt:layers=8,hidden=256,heads=8,vocab=1024,seq=128", local_cluster(4), training=Training(global_batch=16),
         fix="pp=4,schedule=1f1b,num_micro_batches=8", dump_dir=dump)
    return dump / "report.html"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, help="report to render (default: plan one into a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "report.png")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        html = args.html or make_report(Path(tmp) / "report.html")
        errors = screenshot(html, args.out, width=args.width, height=args.height)
    for line in errors:
        print(f"screenshot_report: {line}", file=sys.stderr)
    if errors:
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
