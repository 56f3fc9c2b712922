"""Policy (decide half) of ``checkpointing="tensor"``: which op outputs of one program backward
finds recomputed on demand, one at a time, and which are kept from forward.

The program is read as the whole-graph remat model (:func:`passes.analysis.graph_view.to_networkx`, then
:func:`passes.solvers.remat_solver.problem_from_view`), and the decision is the MILP's under the *peak*
bound: the fewest recompute FLOPs (matmul-class) such that the activation bytes alive at every
moment of backward, recomputes run as :class:`passes.rewrites.tensor_remat.TensorRemat` runs them, stay
within ``budget_bytes``. It is written on the nodes (``node.meta[TENSOR_REMAT]``: save,
recompute or none) and summed up in ``gm.meta[TENSOR_REMAT_PLAN]``; the graph is not changed
(``passes.rewrites.apply_tensor_remat`` lowers it, the memory analysis replays it).

Decided per stage program, after ``specialize_dims``: on the shapes that run, with the stage's
own backward (each pipeline stage has its own timeline and its own budget). The default budget
is :data:`DEFAULT_BUDGET_FRACTION` of the way from the fewest bytes any decision saves to the
peak of recomputing nothing (:func:`passes.solvers.remat_solver.peak_budget`). When nothing fits the
budget the decision with the lowest peak is taken (``TensorRematPlan.feasible`` says so).
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import fx

from passes.analysis.graph_view import to_networkx
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import TENSOR_REMAT, TENSOR_REMAT_PLAN, TensorRematMeta, TensorRematPlan
from passes.solvers.remat_solver import (Action, RematCosts, RematDecision, RematProblem, peak_budget, plain_backward_peak,
                                         problem_from_view, solve_milp)

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


def actions_of(decision: RematDecision) -> dict[str, Action]:
    """Node name -> action of a :class:`passes.solvers.remat_solver.RematDecision`."""
    return {d.node: d.action for d in decision.nodes}


def mark_recomputed(gm: fx.GraphModule, decision: RematDecision) -> fx.GraphModule:
    """Write ``node.meta[TENSOR_REMAT]`` (the node's action) on every node ``decision`` decides, and
    clear it elsewhere, so that :class:`TensorRemat` runs the decision from the graph alone and the
    memory analysis replays the step as it runs; returns ``gm``."""
    actions = actions_of(decision)
    check_actions(actions, {n.name for n in gm.graph.nodes})  # before any mark changes
    for node in gm.graph.nodes:
        node.meta.pop(TENSOR_REMAT, None)
        action = actions.get(node.name)
        if action is not None:
            node.meta[TENSOR_REMAT] = TensorRematMeta(action=action)
    return gm


def check_actions(actions: Mapping[str, Action], names) -> None:
    """Refuse a decision that names a node outside the graph (``names``) or offloads one: the
    executor saves or recomputes only."""
    unknown = sorted(name for name in actions if name not in names)
    if unknown:
        raise PassError(f"tensor remat: the decision names {unknown[0]!r}, not a node of this graph; decide "
                        f"on this graph (passes.solvers.remat_solver.problem_from_view(to_networkx(gm)))")
    offloaded = sorted(name for name, a in actions.items() if a == "offload")
    if offloaded:
        raise PassError(f"tensor remat: node {offloaded[0]!r} is to be offloaded, which the executor does not "
                        f"do; solve without a host link (RematCosts(host_bytes_per_s=None))")


def marked_actions(gm: fx.GraphModule) -> dict[str, Action]:
    """Node name -> action of the decision written on ``gm`` (:func:`mark_recomputed`)."""
    return {n.name: n.meta[TENSOR_REMAT].action for n in gm.graph.nodes if TENSOR_REMAT in n.meta}
