"""ZeRO-3 with and without prefetch, side by side: step time and the exposed communication.

One spawn of ``--dp`` gloo ranks trains the same GPT under ``zero_stage=3`` twice, with
``zero3_prefetch=1`` (the next block's gather issued before the current block computes) and with
``zero3_prefetch=0`` (every gather issued when its block needs it); the two models take turns
step by step so machine load hits them alike. Per step, rank 0 reports:

* step seconds (after a barrier);
* exposed communication: the seconds the step's compute waited for parameter gathers
  (``ParamGatherer.wait_s``; with prefetch a gather that finished during the block before it
  costs nothing here) — the reduce-scatters of the gradients run synchronously in backward in
  both runs and are not in this number.

A third model keeps the gathered parameters from forward to backward
(``reshard_after_forward=False``, prefetch 1): half the gathers.

Also printed: a plain ``torch.nn.parallel.DistributedDataParallel`` step of the same model and
batches (the PyTorch baseline without sharding), for scale.

Run: ``python bench/zero3_prefetch.py [--dp 4] [--steps 6]``. Prints a table; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.dist.launch import spawn
from partitioner.calibration.job_cluster import local_cluster

MODEL = "gpt:layers=8,hidden=256,heads=4,vocab=512,seq=64,dropout=0.0"


def _rank(dp: int, steps: int, warmup: int, batch: int) -> dict:
    from partitioner.compile.build import build_parallel_model, capture_for_pipeline
    from partitioner.inputs.models import build_model
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_s=600)
    spec = build_model(MODEL)
    graph = capture_for_pipeline(spec)
    mesh = Mesh(dp, 1, 1, timeout_s=300)
    config = ParallelConfig.for_global_batch(batch, dp=dp, zero_stage=3, num_micro_batches=2)
    # two models in one process: each its own group names (the ops look their groups up by name)
    models = {f"prefetch={k}": build_parallel_model(graph, config, mesh, optimizer={"lr": 1e-3}, zero3_prefetch=k,
                                                    tp_group=f"tp{k}", cluster=local_cluster(mesh.size)) for k in (1, 0)}
    # the gathered parameters kept from forward to backward: one gather per site and micro-batch
    models["prefetch=1 keep"] = build_parallel_model(graph, config.replace(reshard_after_forward=False), mesh,
                                                     optimizer={"lr": 1e-3}, tp_group="tpkeep", cluster=local_cluster(mesh.size))
    ddp = torch.nn.parallel.DistributedDataParallel(build_model(MODEL).module)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rows = batch // dp
    out = {name: {"step_s": [], "wait_s": [], "loss": [], "gathers": []} for name in [*models, "ddp"]}
    for k in range(warmup + steps):
        b = spec.example_inputs({"batch": batch}, seed=k)
        for name, pm in models.items():
            torch.distributed.barrier()
            before, issued, start = pm.zero3.wait_s, pm.zero3.issued, time.perf_counter()
            loss = pm.train_step(b)
            if k >= warmup:
                out[name]["step_s"].append(time.perf_counter() - start)
                out[name]["wait_s"].append(pm.zero3.wait_s - before)
                out[name]["gathers"].append(pm.zero3.issued - issued)
                out[name]["loss"].append(loss)
        torch.distributed.barrier()
        start = time.perf_counter()
        mine = [t[torch.distributed.get_rank() * rows:(torch.distributed.get_rank() + 1) * rows] for t in b]
        opt.zero_grad()
        spec.loss(ddp, *mine).backward()
        opt.step()
        if k >= warmup:
            out["ddp"]["step_s"].append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    start = time.perf_counter()
    r = spawn(_rank, args.dp, args.dp, args.steps, args.warmup, args.batch, timeout_s=1800)[0]
    print(f"{MODEL}, dp={args.dp} ZeRO-3, global batch {args.batch}, 2 micro-batches, "
          f"{args.steps} timed steps after {args.warmup} ({time.perf_counter() - start:.0f} s in all)\n")
    print("| run | median s/step | median exposed gather s/step | exposed / step | gathers/step |")
    print("|---|---:|---:|---:|---:|")
    for name, v in r.items():
        step = statistics.median(v["step_s"])
        wait = statistics.median(v["wait_s"]) if v["wait_s"] else float("nan")
        gathers = f"{statistics.median(v['gathers']):.0f}" if v["gathers"] else ""
        print(f"| {name} | {step:.4f} | {wait:.4f} | {wait / step:.2f} | {gathers} |")
    a, b, keep = r["prefetch=1"], r["prefetch=0"], r["prefetch=1 keep"]
    print(f"\nexposed gathers with / without prefetch: "
          f"{statistics.median(a['wait_s']) / statistics.median(b['wait_s']):.2f}; "
          f"step time with / without: {statistics.median(a['step_s']) / statistics.median(b['step_s']):.2f}; "
          f"losses equal: {a['loss'] == b['loss']}")
    print(f"kept for backward / freed after forward (both prefetch=1): exposed gathers "
          f"{statistics.median(keep['wait_s']) / statistics.median(a['wait_s']):.2f}, step time "
          f"{statistics.median(keep['step_s']) / statistics.median(a['step_s']):.2f}; losses equal: "
          f"{keep['loss'] == a['loss']}")


if __name__ == "__main__":
    main()
