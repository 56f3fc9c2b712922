"""Policy (decide half) of ``checkpointing="tensor"``: which op outputs of one program backward
finds recomputed on demand, one at a time, and which are kept from forward.

The program is read as the whole-graph remat model (:func:`passes.graph_view.to_networkx`, then
:func:`passes.remat_solver.problem_from_view`), and the decision is the MILP's under the *peak*
bound: the fewest recompute FLOPs (matmul-class) such that the activation bytes alive at every
moment of backward, recomputes run as :class:`passes.tensor_remat.TensorRemat` runs them, stay
within ``budget_bytes``. It is written on the nodes (``node.meta[TENSOR_REMAT]``: save,
recompute or none) and summed up in ``gm.meta[TENSOR_REMAT_PLAN]``; the graph is not changed
(``passes.apply_tensor_remat`` lowers it, the memory analysis replays it).

Decided per stage program, after ``specialize_dims``: on the shapes that run, with the stage's
own backward (each pipeline stage has its own timeline and its own budget). The default budget
is :data:`DEFAULT_BUDGET_FRACTION` of the way from the fewest bytes any decision saves to the
peak of recomputing nothing (:func:`passes.remat_solver.peak_budget`). When nothing fits the
budget the decision with the lowest peak is taken (``TensorRematPlan.feasible`` says so).
"""
from __future__ import annotations

from typing import Any

from torch import fx

from passes.graph_view import to_networkx
from passes.ir.errors import ConfigError
from passes.ir.meta import TENSOR_REMAT_PLAN, TensorRematPlan
from passes.remat_solver import (RematCosts, RematDecision, RematProblem, peak_budget, plain_backward_peak,
                                 problem_from_view, solve_milp)
from passes.tensor_remat import mark_recomputed

DEFAULT_BUDGET_FRACTION = 0.5
"""Default budget: this fraction of the way from the fewest saved bytes to the peak of recomputing
nothing (the same midpoint the ``dag`` policy takes between its two ends)."""

# FLOPs are the objective (no host link: save or recompute only), so any positive rate will do.
_FLOPS_ONLY = RematCosts(device_flops_per_s=1.0)


def tensor_remat_policy(gm: fx.GraphModule, ctx: Any = None, *, budget_bytes: int | None = None,
                        fraction: float = DEFAULT_BUDGET_FRACTION, time_limit_s: float = 60.0) -> fx.GraphModule:
    """Decide and mark ``gm``'s per-tensor recomputes under ``budget_bytes`` (bytes of activations
    alive at any moment of backward; default: ``fraction`` of the way, see the module docstring);
    returns ``gm`` (meta only). Needs ``annotate_shapes`` and ``annotate_flops``; ``time_limit_s``
    bounds the MILP (seconds; past it the best decision found is taken, ``optimal=False``)."""
    problem = problem_from_view(to_networkx(gm))
    decision = decide(problem, budget_bytes=budget_bytes, fraction=fraction, time_limit_s=time_limit_s)
    budget = decision.budget_bytes
    mark_recomputed(gm, decision)
    gm.meta[TENSOR_REMAT_PLAN] = TensorRematPlan(
        budget_bytes=budget, peak_bytes=decision.peak_bytes,
        none_peak_bytes=plain_backward_peak(problem),
        recompute_flops=decision.recompute_flops, recomputed=decision.named("recompute"),
        feasible=decision.feasible, optimal=decision.optimal)
    return gm


def decide(problem: RematProblem, *, budget_bytes: int | None = None, fraction: float = DEFAULT_BUDGET_FRACTION,
           time_limit_s: float = 60.0) -> RematDecision:
    """The policy's decision on a remat problem (what :func:`tensor_remat_policy` marks; the
    planner's profile prices the same): the MILP under the peak bound at ``budget_bytes``, or at
    ``fraction`` of the way (module docstring) when it is None. ``time_limit_s``: seconds for all
    of its solves; the decision's ``mip_gap`` says how far from optimal the limit left it (0:
    proven optimal; inf: no solution in time, nothing recomputed)."""
    if budget_bytes is not None and budget_bytes < 0:
        raise ConfigError(f"tensor_remat_policy: budget_bytes must be >= 0, got {budget_bytes}")
    budget = budget_bytes if budget_bytes is not None else peak_budget(problem, fraction)
    return solve_milp(problem, budget, costs=_FLOPS_ONLY, bound="peak", time_limit_s=time_limit_s)
