"""Rematerialization on DAGs: block-level checkpointing, the ``dag`` policy, the ``tensor`` policy
and the whole-graph remat model's decision under the saved-bytes bound, side by side at the same
budgets, with the step peaks MemTracker measures.

    python bench/remat_policies.py [--models resnet,unet,hf-bert,hf-bert-dropout] [--fractions 0.1,0.25,0.3,0.5,0.75]

For each model and budget (a fraction of the way from full block checkpointing's saved bytes
to none's), the columns are:

* recompute FLOPs of block-level checkpointing (``solver`` policy), of the ``dag`` policy, of
  the whole-graph MILP under the saved-bytes bound (``passes.solvers.remat_solver.solve_milp``) and of
  the ``tensor`` policy (``passes.policies.tensor_remat_policy``: that MILP under the peak bound); for the
  last two also the activation bytes at the fullest moment of backward (``backward_peak``) and,
  for ``tensor``, the seconds its pass takes;
* the step peak (bytes) MemTracker measures for one step on CPU: without checkpointing, under
  the ``dag`` policy (torch's selective checkpointing), and of the program lowered under
  ``tensor`` (``passes.rewrites.apply_tensor_remat``: its forward runs the per-tensor executor); and the
  memory analysis's predicted step peak of that program against its measurement;
* the fastest of 7 forward + backward passes (ms) under ``dag`` and of the ``tensor`` program
  (without checkpointing: in the heading). ``tensor`` runs its forward node by node in Python
  (``fx.Interpreter``), which small models feel.

When no decision fits a budget under the peak bound, the MILP returns the lowest peak any
decision reaches (marked ``*``). Prints a markdown table per model; asserts nothing.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner.errors import PassError  # noqa: E402
from partitioner.inputs.models import build_model  # noqa: E402
from passes.analysis.annotate_blocks import annotate_blocks  # noqa: E402
from passes.analysis.annotate_flops import annotate_flops  # noqa: E402
from passes.analysis.annotate_memory import annotate_memory  # noqa: E402
from passes.analysis.annotate_shapes import annotate_shapes  # noqa: E402
from passes.rewrites.apply_checkpoint import apply_checkpoint  # noqa: E402
from passes.capture.capture import capture_spec  # noqa: E402
from passes.policies.checkpoint_policy import checkpoint_policy  # noqa: E402
from passes.analysis.graph_view import to_networkx  # noqa: E402
from passes.rewrites.apply_tensor_remat import apply_tensor_remat  # noqa: E402
from passes.ir.meta import CHECKPOINT_PLAN, DAG_CHECKPOINT_PLAN, MEMORY_SUMMARY, TENSOR_REMAT_PLAN  # noqa: E402
from passes.solvers.remat_solver import RematCosts, from_checkpoint_plan, problem_from_view, solve_milp  # noqa: E402
from passes.policies.tensor_remat_policy import tensor_remat_policy  # noqa: E402
from runtime.observe.measure import memtracker_step_peak  # noqa: E402

MODELS = {
    "resnet": "resnet:blocks=1-1,widths=8-16,image=16,classes=10,batch=8",
    "unet": "unet:batch=4",
    "hf-bert": "hf-bert:batch=4,attention_probs_dropout_prob=0.0",
    "hf-bert-dropout": "hf-bert:batch=4",
}
COSTS = RematCosts(device_flops_per_s=1.0)  # FLOPs are the objective


def _step_ms(module, inputs, repeats: int = 7) -> float:
    """The fastest of ``repeats`` forward + backward passes of ``module`` (milliseconds): what
    recomputing, and running the forward node by node, cost in time on this machine."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        module(*inputs).backward()
        best = min(best, time.perf_counter() - start)
        for p in module.parameters():
            p.grad = None
    return 1e3 * best


def _analysed(gm):
    return annotate_flops(annotate_blocks(annotate_shapes(gm)))


def run_model(name: str, fractions: list[float]) -> None:
    spec = build_model(MODELS[name])
    inputs = spec.example_inputs()
    gm = _analysed(capture_spec(spec))
    full = checkpoint_policy(copy.deepcopy(gm), policy="full").meta[CHECKPOINT_PLAN]
    lo, hi = int(full.saved_bytes_after), int(full.saved_bytes_before)
    problem = problem_from_view(to_networkx(gm))
    none_peak = memtracker_step_peak(copy.deepcopy(gm), inputs)
    none_ms = _step_ms(copy.deepcopy(gm), inputs)
    print(f"\n### {name} (`{MODELS[name]}`): saved bytes {lo:,} (full) .. {hi:,} (none); "
          f"step peak without checkpointing {none_peak:,} bytes; forward + backward {none_ms:.1f} ms\n")
    print("| f | budget | block FLOPs | dag FLOPs | MILP saved-bound FLOPs (bwd peak) | tensor FLOPs "
          "(bwd peak, pass s) | step peak: dag | step peak: tensor | predicted | tensor/dag FLOPs | "
          "tensor/dag peak | ms: dag | ms: tensor |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in fractions:
        budget = int(lo + f * (hi - lo))
        try:
            plan = checkpoint_policy(copy.deepcopy(gm), policy="solver", budget_bytes=budget).meta[CHECKPOINT_PLAN]
            block = f"{from_checkpoint_plan(problem, plan, budget_bytes=budget, costs=COSTS).recompute_flops:,}"
        except PassError:
            block = "unreachable"
        dag_gm = apply_checkpoint(checkpoint_policy(copy.deepcopy(gm), policy="dag", budget_bytes=budget))
        dag = dag_gm.meta[DAG_CHECKPOINT_PLAN]
        dag_peak = memtracker_step_peak(copy.deepcopy(dag_gm), inputs)
        saved = solve_milp(problem, budget, costs=COSTS)
        start = time.perf_counter()
        lowered = apply_tensor_remat(tensor_remat_policy(copy.deepcopy(gm), budget_bytes=budget))
        solve_s = time.perf_counter() - start
        peak = lowered.meta[TENSOR_REMAT_PLAN]
        predicted = int(annotate_memory(copy.deepcopy(lowered)).meta[MEMORY_SUMMARY].peak_bytes)
        measured = memtracker_step_peak(lowered, inputs)
        mark = "" if peak.feasible else "*"
        flops_ratio = f"{peak.recompute_flops / dag.recompute_flops:.2f}" if dag.recompute_flops else "-"
        print(f"| {f} | {budget:,} | {block} | {dag.recompute_flops:,} | {saved.recompute_flops:,} "
              f"({saved.peak_bytes:,}) | {peak.recompute_flops:,}{mark} ({peak.peak_bytes:,}, {solve_s:.2f}) | "
              f"{dag_peak:,} | {measured:,} | {(predicted - measured) / measured:+.2%} | {flops_ratio} | "
              f"{measured / dag_peak:.2f} | {_step_ms(dag_gm, inputs):.1f} | {_step_ms(lowered, inputs):.1f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fractions", default="0.1,0.25,0.3,0.5,0.75")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.models.split(","):
        run_model(name, [float(x) for x in args.fractions.split(",")])


if __name__ == "__main__":
    main()
