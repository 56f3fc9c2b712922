"""``checkpointing="tensor"``: the policy (``tensor_remat_policy``) and the transform
(``apply_tensor_remat``) on the ResNet-style CNN, the U-Net and Hugging Face BERT.

What it shows:

* the policy marks every node the whole-graph remat model decides, leaves the graph's nodes as
  they are, and its plan adds up: the recomputed names are the marked ones, their FLOPs are the
  plan's, its peak is within the budget and below recomputing nothing (default budget);
* at the backward peak block-level checkpointing's decision reaches (run per tensor, as the
  executor runs it), and at the bytes it keeps after forward where the policy reaches those, the
  policy recomputes no more FLOPs than block-level does; a tighter budget never recomputes fewer
  FLOPs;
* the lowered program runs its decision whenever it is called, also after ``copy.deepcopy`` and
  ``recompile``: one step is bit-identical to the plain graph (dropout replayed), its measured
  step peak is below the plain graph's and within 3% of ``annotate_memory``'s prediction;
* misuse is refused, and the stage pipeline of ``checkpointing="tensor"`` runs these two passes
  instead of the block-level ones.
"""
from __future__ import annotations

import copy
import functools

import pytest
import sympy
import torch

from passes.analysis.annotate_memory import annotate_memory
from passes.rewrites.apply_tensor_remat import apply_tensor_remat
from passes.policies.checkpoint_policy import checkpoint_policy
from passes.analysis.graph_view import to_networkx
from passes.ir.config import ParallelConfig
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import CAPTURE, CHECKPOINT_PLAN, FLOPS, MEMORY_SUMMARY, TENSOR_REMAT, TENSOR_REMAT_PLAN
from passes.solvers.remat_solver import (RematCosts, backward_peak, evaluate, from_checkpoint_plan, peak_budget,
                                         problem_from_view)
from passes.rewrites.tensor_remat import TensorRemat
from passes.policies.tensor_remat_policy import DEFAULT_BUDGET_FRACTION, tensor_remat_policy
from runtime.observe.measure import memtracker_step_peak
from tests.passes.test_checkpoint_dag import _budget, _captured, _step

PEAK_TOLERANCE = 0.03
COSTS = RematCosts(device_flops_per_s=1.0)  # FLOPs are the objective; any rate orders decisions alike
MODELS = ["resnet", "unet", "hf-bert"]
BLOCK_FRACTIONS = (0.1, 0.3, 0.5, 0.75, 0.9)


@functools.lru_cache(maxsize=None)
def _decided(name: str):
    """The policy at its default budget, on a copy (the captured graph is shared between tests)."""
    _, gm, _, _ = _captured(name)
    return tensor_remat_policy(copy.deepcopy(gm))


def _problem(gm):
    return problem_from_view(to_networkx(gm))


def _nodes(gm) -> list[tuple[str, str, str]]:
    return [(n.name, n.op, str(n.target)) for n in gm.graph.nodes]


def _fwd_flops(gm, names) -> int:
    """Forward FLOPs of the nodes named, read from ``annotate_flops``'s meta at the dims' hints
    (the count the remat model takes, recomputed here on its own)."""
    hints = gm.meta[CAPTURE].symbols()
    wanted = set(names)
    return sum(int(sympy.sympify(n.meta[FLOPS].fwd).subs(hints)) for n in gm.graph.nodes
               if n.name in wanted and FLOPS in n.meta)


@pytest.mark.parametrize("name", MODELS)
def test_default_budget_decision_is_marked_and_adds_up(name):
    _, original, _, _ = _captured(name)
    gm = _decided(name)
    plan = gm.meta[TENSOR_REMAT_PLAN]
    problem = _problem(original)

    # meta only: the same nodes, the same code
    assert _nodes(gm) == _nodes(original)
    assert "_run_tensor_remat" not in gm.code

    # every node the model decides carries its action, and no other node does
    marks = {n.name: n.meta[TENSOR_REMAT].action for n in gm.graph.nodes if TENSOR_REMAT in n.meta}
    assert set(marks) == set(problem.nodes)
    assert set(marks.values()) <= {"save", "recompute", "none"}
    recomputed = tuple(n.name for n in gm.graph.nodes if marks.get(n.name) == "recompute")
    assert plan.recomputed == recomputed and recomputed

    # the budget is the documented default and binds: recomputing nothing would exceed it
    assert plan.budget_bytes == peak_budget(problem, DEFAULT_BUDGET_FRACTION)
    assert plan.none_peak_bytes == backward_peak(problem, [False] * len(problem.nodes))
    assert plan.peak_bytes <= plan.budget_bytes < plan.none_peak_bytes
    assert plan.feasible

    # the plan's totals are those of the marks, recounted from scratch
    flags = [n in set(recomputed) for n in problem.nodes]
    assert plan.peak_bytes == backward_peak(problem, flags)
    assert plan.recompute_flops == _fwd_flops(original, recomputed)
    again = evaluate(problem, recomputed, budget_bytes=plan.budget_bytes, costs=COSTS, bound="peak")
    assert {d.node: d.action for d in again.nodes} == marks  # save/none follow from the recomputes
    print(f"\n{name}: budget {plan.budget_bytes}, peak {plan.peak_bytes} (none {plan.none_peak_bytes}), "
          f"{len(recomputed)} recomputed, {plan.recompute_flops} FLOPs")


@pytest.mark.parametrize("name", MODELS)
def test_never_worse_than_block_level_at_its_peak(name):
    """Block-level checkpointing (the ``solver`` policy) at budgets between full checkpointing's
    saved bytes and none's, taken as a per-tensor decision: at the backward peak it reaches, the
    per-tensor policy recomputes at most its FLOPs and stays within that peak. (That peak is the
    executor's: a region recomputed for its first use in backward is alive whole, so it can lie
    above recomputing nothing; and FLOPs count matmul-class work only, so recomputing elementwise
    and normalisation ops is free. The ``tensor F`` column can therefore be all zeros.)

    Column ``at kept``: the policy bounded by the bytes block-level keeps after forward, a
    stricter budget (block-level's backward peaks above it); where the policy reaches it, it
    recomputes at most block-level's FLOPs there too. Skipped where every region is recomputed: that floor can lie below every per-tensor peak (on ResNet and BERT it does), and
    proving so takes over a minute on BERT.
    Prints (fraction, budget, block FLOPs, block peak, tensor FLOPs, tensor peak, at kept)."""
    _, gm, _, _ = _captured(name)
    problem = _problem(gm)
    rows = []
    for fraction in BLOCK_FRACTIONS:
        budget = _budget(name, fraction)
        try:
            block_plan = checkpoint_policy(copy.deepcopy(gm), policy="solver",
                                           budget_bytes=budget).meta[CHECKPOINT_PLAN]
        except PassError:  # block-level cannot reach this budget: nothing to compare against
            continue
        block = from_checkpoint_plan(problem, block_plan, budget_bytes=budget, costs=COSTS)
        assert block.recompute_flops == int(block_plan.recompute_flops)  # the same decision, in either model
        peak = block.peak_bytes
        assert peak == backward_peak(problem, [n in set(block.named("recompute")) for n in problem.nodes])
        tensor = tensor_remat_policy(copy.deepcopy(gm), budget_bytes=peak).meta[TENSOR_REMAT_PLAN]
        assert tensor.feasible  # block-level's own decision fits, so some decision does
        assert tensor.peak_bytes <= peak
        assert tensor.recompute_flops <= block.recompute_flops

        at_kept = "-"
        if not all(r.recompute for r in block_plan.regions):
            kept = int(block_plan.saved_bytes_after)
            strict = tensor_remat_policy(copy.deepcopy(gm), budget_bytes=kept).meta[TENSOR_REMAT_PLAN]
            if strict.feasible:
                assert strict.peak_bytes <= kept
                assert strict.recompute_flops <= block.recompute_flops  # at the same bytes, fewer FLOPs
                at_kept = str(strict.recompute_flops)
            else:
                at_kept = "infeasible"
        rows.append((fraction, budget, block.recompute_flops, peak, tensor.recompute_flops, tensor.peak_bytes,
                     at_kept))
    assert rows  # else nothing was compared
    print(f"\n{name} (none peak {backward_peak(problem, [False] * len(problem.nodes))})\n"
          f"{'frac':>5} {'budget':>9} {'block F':>10} {'block peak':>10} {'tensor F':>10} {'t. peak':>9} "
          f"{'at kept':>10}")
    for row in rows:
        print(f"{row[0]:>5} {row[1]:>9} {row[2]:>10} {row[3]:>10} {row[4]:>10} {row[5]:>9} {row[6]:>10}")


def test_a_tighter_budget_never_recomputes_less():
    _, gm, _, _ = _captured("unet")
    # feasible budgets (below about 0.35 nothing reaches the budget on this U-Net, and proving so is slow)
    plans = [tensor_remat_policy(copy.deepcopy(gm), fraction=f).meta[TENSOR_REMAT_PLAN] for f in (0.4, 0.5, 0.6)]
    budgets = [p.budget_bytes for p in plans]
    flops = [p.recompute_flops for p in plans]
    print(f"\nunet budgets {budgets}: recompute FLOPs {flops}, peaks {[p.peak_bytes for p in plans]}")
    assert budgets == sorted(budgets) and len(set(budgets)) == 3
    assert all(p.feasible and p.optimal and p.peak_bytes <= p.budget_bytes for p in plans)
    assert flops == sorted(flops, reverse=True)
    assert flops[0] > flops[-1]  # the budgets span a real trade-off, else monotonicity says nothing


@pytest.fixture
def executor_runs(monkeypatch):
    """Every forward run by the executor, as the number of saved tensors it turned into recomputes."""
    runs = []
    original = TensorRemat.__call__

    def spy(self, *args):
        out = original(self, *args)
        runs.append(self.tokens)
        return out

    monkeypatch.setattr(TensorRemat, "__call__", spy)
    return runs


def _assert_runs_exactly(reference, lowered, inputs, runs) -> None:
    """``lowered`` runs its decision through the executor (which recomputes something) and one
    step of it is bit-identical to ``reference`` (the plain graph's step: loss, gradients)."""
    assert "_run_tensor_remat" in lowered.code
    loss0, grads0 = reference
    before = len(runs)
    loss1, grads1 = _step(lowered, inputs)
    assert len(runs) == before + 1 and runs[-1] > 0
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and grads0
    for key in grads0:
        assert torch.equal(grads0[key], grads1[key]), key


@pytest.mark.parametrize("name", ["hf-bert-dropout", "resnet"])
def test_the_lowered_program_runs_its_decision(name, executor_runs):
    inputs, gm, _, _ = _captured(name)
    decided = tensor_remat_policy(copy.deepcopy(gm))
    marked = _nodes(decided)
    lowered = apply_tensor_remat(decided)
    assert lowered is decided and _nodes(lowered) == marked  # only the code changes
    reference = _step(gm, inputs)
    _assert_runs_exactly(reference, lowered, inputs, executor_runs)

    # the code generator belongs to the graph: it survives a copy and a recompile
    copied = copy.deepcopy(lowered)
    _assert_runs_exactly(reference, copied, inputs, executor_runs)
    copied.recompile()
    _assert_runs_exactly(reference, copied, inputs, executor_runs)

    # memory: the optimizer steps change the parameters, so each measurement gets its own copy
    predicted = int(annotate_memory(copy.deepcopy(lowered)).meta[MEMORY_SUMMARY].peak_bytes)
    measured = memtracker_step_peak(copy.deepcopy(lowered), inputs)
    plain = memtracker_step_peak(copy.deepcopy(gm), inputs)
    error = (predicted - measured) / measured
    print(f"\n{name}: lowered step peak {measured} bytes (predicted {predicted}, {error:+.2%}), plain {plain}")
    assert measured < plain
    assert abs(error) <= PEAK_TOLERANCE


def test_misuse_is_refused():
    _, gm, _, _ = _captured("resnet")
    with pytest.raises(PassError, match="tensor_remat_policy"):
        apply_tensor_remat(copy.deepcopy(gm))
    with pytest.raises(ConfigError, match="budget"):
        tensor_remat_policy(copy.deepcopy(gm), budget_bytes=-1)


def test_the_stage_pipeline_runs_the_tensor_passes():
    from passes.lowering.pipelines import stage_passes

    names = [p.name for p in stage_passes(ParallelConfig(checkpointing="tensor"), stage=0, tp_rank=0,
                                          tp_group="tp", cost=None)]
    assert "tensor_remat_policy" in names and "apply_tensor_remat" in names
    assert names.index("tensor_remat_policy") < names.index("apply_tensor_remat")
    assert not {"checkpoint_policy", "apply_checkpoint"} & set(names)
