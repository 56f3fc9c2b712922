"""`partitioner dry-run` at full scale: GPT-3 175B on 192 DGX-A100 nodes (1,536 GPUs) and a
Llama-3-70B shape on 8 DGX-H100 nodes (64 GPUs), each with the planner's own plan and one
pinned tp x pp x dp layout.

Each case runs the CLI in a child process (as a user would), timed, with its peak resident
memory (``resource.getrusage(RUSAGE_CHILDREN)``: the largest child's, kilobytes on Linux), and
prints the dry run's own report (one line per distinct rank program; each one's peak against
the plan's, with the difference; the largest tensors at the peak of any rank more than 5% off),
then a summary: wall seconds, max RSS, distinct rank programs, the worst memory difference and
whether the report says OK.

Run: python bench/dry_run_scale.py [CASE ...]   (default: every case; --list names them)
What each case cost on the development machine (2 cores) is in bench/README.md: from 2 minutes
(175B, the planner's plan: one distinct rank program) to about an hour of CPU (the pinned 70B
plan: 32 programs of 32 micro-batches, 1-2 minutes each).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time

GPT3 = "gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"
LLAMA3_70B = ("llama:layers=80,hidden=8192,heads=64,kv_heads=8,intermediate=28672,vocab=128256,seq=8192,"
              "theta=500000")

CASES = {
    # name: (model, cluster, nodes, global batch, --fix or None)
    "gpt3-175b-planner": (GPT3, "dgx-a100-80gb", 192, 1536, None),
    # Megatron-LM's published layout (Narayanan et al. 2021): micro-batches, virtual stages,
    # schedule, ZeRO and sequence parallelism as the planner picks them under it
    "gpt3-175b-tp8-pp12-dp16": (GPT3, "dgx-a100-80gb", 192, 1536, "tp=8,pp=12,dp=16"),
    "llama3-70b-planner": (LLAMA3_70B, "dgx-h100", 8, 64, None),
    "llama3-70b-tp8-pp4-dp2": (LLAMA3_70B, "dgx-h100", 8, 64, "tp=8,pp=4,dp=2"),
}

_ROW = re.compile(r"^\s+(\d+)\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([+-][\d.]+)%$")


def run_case(name: str) -> dict:
    model, cluster, nodes, batch, fix = CASES[name]
    cmd = [sys.executable, "-m", "partitioner", "dry-run", "--model", model, "--cluster", cluster,
           "--nodes", str(nodes), "--global-batch", str(batch)] + (["--fix", fix] if fix else [])
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # the largest child so far
    print(done.stdout, flush=True)
    if done.returncode:  # the progress bar and warnings go to stderr: its end says why the run stopped
        print(f"exit status {done.returncode}; the end of its stderr:\n" + done.stderr[-3000:], flush=True)
    header = next((line for line in done.stdout.splitlines() if line.startswith("dry run of ")), "")
    distinct = re.search(r"(\d+) distinct rank programs", header)
    rows = [m.groups() for m in map(_ROW.match, done.stdout.splitlines()) if m]
    worst = max(rows, key=lambda r: abs(float(r[3])), default=None)
    return {"name": name, "wall_s": wall, "max_rss_gib": rss_gib, "exit": done.returncode,
            "distinct": int(distinct.group(1)) if distinct else None, "ranks": len(rows),
            "worst": f"rank {worst[0]}: {worst[1]} MiB vs {worst[2]} MiB ({worst[3]}%)" if worst else "-",
            "ok": done.stdout.rstrip().endswith("OK")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: every case)")
    parser.add_argument("--list", action="store_true", help="name the cases and exit")
    args = parser.parse_args()
    if args.list:
        for name, (model, cluster, nodes, batch, fix) in CASES.items():
            print(f"{name}: {model} on {cluster} x {nodes}, global batch {batch}, fix {fix or '(planner)'}")
        return
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose of {', '.join(CASES)}")
    results = [run_case(name) for name in (args.cases or CASES)]
    print(f"{'case':<26} {'wall':>8} {'max RSS':>8} {'programs':>8}  {'report':<7} worst memory difference")
    for r in results:
        print(f"{r['name']:<26} {r['wall_s']:>7.0f}s {r['max_rss_gib']:>6.2f}GiB {r['distinct'] or '-':>8}  "
              f"{'OK' if r['ok'] else 'FAILED':<7} {r['worst']}")


if __name__ == "__main__":
    main()
