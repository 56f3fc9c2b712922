"""The per-tensor remat executor (``passes.rewrites.tensor_remat``) carries out decisions of the
whole-graph remat model (``passes.solvers.remat_solver``: the MILP optimum and the min cut) on the
ResNet-style CNN, the U-Net and Hugging Face BERT (with and without dropout): one training step
gives bit-identical losses and gradients to the plain graph, what forward leaves for backward is
exactly the decision's ``saved_bytes`` (under the budget), and batch-norm statistics are updated
once."""
from __future__ import annotations

import copy

import pytest
import torch

from passes.analysis.graph_view import to_networkx
from passes.ir.errors import PassError
from passes.solvers.remat_solver import RematCosts, problem_from_view, solve_milp, solve_min_cut
from passes.analysis.annotate_memory import annotate_memory
from passes.ir.meta import MEMORY_SUMMARY
from passes.policies.tensor_remat_policy import actions_of, mark_recomputed
from passes.rewrites.tensor_remat import TensorRemat
from tests.passes.test_checkpoint_dag import PEAK_TOLERANCE, _budget, _captured, _step
from tests.passes.test_checkpoint_memory import measured_peak

COSTS = RematCosts(device_flops_per_s=1.0)
SOLVERS = {"milp": solve_milp, "min-cut": solve_min_cut}


def _remat_step(remat: TensorRemat, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch.manual_seed(0)  # as _step: the same dropout masks
    loss = remat(*inputs)
    saved = remat.saved_bytes()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in remat.gm.named_parameters() if p.grad is not None}
    for p in remat.gm.parameters():
        p.grad = None
    return loss.detach(), grads, saved


@pytest.mark.parametrize("name", ["resnet", "unet", "hf-bert", "hf-bert-dropout"])
@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_a_decision_runs_exactly_and_leaves_the_bytes_it_counted(name, solver, fraction):
    inputs, gm, full, none = _captured(name)
    budget = _budget(name, fraction)
    decision = SOLVERS[solver](problem_from_view(to_networkx(gm)), budget, costs=COSTS)
    assert decision.feasible and decision.named("recompute")
    loss0, grads0 = _step(gm, inputs)
    remat = TensorRemat(gm, actions_of(decision))
    loss1, grads1, saved = _remat_step(remat, inputs)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and grads0
    for key in grads0:
        assert torch.equal(grads0[key], grads1[key]), key
    assert remat.tokens > 0
    assert saved == decision.saved_bytes <= budget < none  # recomputed tensors really left
    print(f"{name} {solver} budget {budget}: recompute {decision.recompute_flops} FLOPs, saved {saved} bytes "
          f"(none {none}), {remat.tokens} saved tensors recomputed")


def test_nothing_recomputed_keeps_what_plain_autograd_keeps():
    inputs, gm, _, none = _captured("unet")
    remat = TensorRemat(gm, {})
    _, _, saved = _remat_step(remat, inputs)
    assert remat.tokens == 0 and saved == none


def test_batch_norm_statistics_are_updated_once():
    inputs, gm, _, _ = _captured("resnet")
    decision = solve_milp(problem_from_view(to_networkx(gm)), _budget("resnet", 0.1), costs=COSTS)
    recomputed_norms = [n for n in decision.named("recompute") if "batch_norm" in n]
    assert recomputed_norms  # else this proves nothing
    plain, remat = copy.deepcopy(gm), copy.deepcopy(gm)
    _step(plain, inputs)
    _remat_step(TensorRemat(remat, actions_of(decision)), inputs)
    buffers = dict(remat.named_buffers())
    for key, value in plain.named_buffers():
        assert torch.equal(value, buffers[key]), key


def test_bad_decisions_are_refused_before_running():
    _, gm, _, _ = _captured("resnet")
    with pytest.raises(PassError, match="not a node of this graph"):
        TensorRemat(gm, {"no_such_node": "recompute"})
    first = next(n.name for n in gm.graph.nodes if n.op == "call_function")
    with pytest.raises(PassError, match="offload"):
        TensorRemat(gm, {first: "offload"})
    # a recomputed node whose input is neither saved nor recomputed
    reader = next(n for n in gm.graph.nodes if n.op == "call_function" and any(
        a.op == "call_function" for a in n.all_input_nodes))
    source = next(a for a in reader.all_input_nodes if a.op == "call_function")
    with pytest.raises(PassError, match="must save or recompute"):
        TensorRemat(gm, {reader.name: "recompute", source.name: "none"})


@pytest.mark.parametrize("name,fraction", [("resnet", 0.25), ("resnet", 0.5), ("unet", 0.1), ("unet", 0.25),
                                           ("hf-bert", 0.25), ("hf-bert-dropout", 0.3)])
def test_the_backward_peak_is_what_the_peak_bound_predicted(name, fraction):
    """Under the peak bound, the activation bytes alive at any unpack or recompute of the real
    backward (measured by storage) are at most the decision's ``peak_bytes``, within 1% of it,
    and within the budget; the decision saves what it counted."""
    inputs, gm, _, none = _captured(name)
    budget = _budget(name, fraction)
    decision = solve_milp(problem_from_view(to_networkx(gm)), budget, costs=COSTS, bound="peak")
    assert decision.feasible and decision.optimal and decision.named("recompute")
    remat = TensorRemat(gm, actions_of(decision), trace_memory=True)
    loss1, grads1, saved = _remat_step(remat, inputs)
    loss0, grads0 = _step(gm, inputs)
    assert torch.equal(loss0, loss1) and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    measured = remat.backward_peak_bytes
    assert saved == decision.saved_bytes
    assert 0.99 * decision.peak_bytes <= measured <= decision.peak_bytes <= budget < none
    print(f"{name} budget {budget}: predicted backward peak {decision.peak_bytes}, measured {measured} bytes, "
          f"recompute {decision.recompute_flops} FLOPs")


class _Executed(torch.nn.Module):
    """A graph run through the executor, as a module MemTracker can follow."""

    def __init__(self, gm, decision):
        super().__init__()
        self.gm = gm
        self.remat = TensorRemat(gm, actions_of(decision))

    def forward(self, *inputs):
        return self.remat(*inputs)


@pytest.mark.parametrize("name", ["resnet", "unet", "hf-bert", "hf-bert-dropout"])
def test_the_memory_analysis_predicts_the_step_peak_of_the_executor(name):
    """``annotate_memory`` on a graph marked with a decision (``mark_recomputed``) replays the
    executor's step: its peak is within 3% of MemTracker's measured peak of one AdamW step run
    through the executor (every recomputed value is dropped after its last use, nothing lingers
    to the end of backward), and what it keeps after forward is the decision's saved bytes."""
    inputs, gm, _, none = _captured(name)
    decision = solve_milp(problem_from_view(to_networkx(gm)), _budget(name, 0.25), costs=COSTS, bound="peak")
    assert decision.feasible and decision.named("recompute")
    summary = annotate_memory(mark_recomputed(copy.deepcopy(gm), decision)).meta[MEMORY_SUMMARY]
    assert int(summary.activation_bytes + summary.input_bytes) == decision.saved_bytes
    plain = annotate_memory(copy.deepcopy(gm)).meta[MEMORY_SUMMARY]
    measured = measured_peak(_Executed(copy.deepcopy(gm), decision), inputs)
    predicted = int(summary.peak_bytes)
    error = (predicted - measured) / measured
    print(f"{name}: predicted step peak {predicted} bytes ({summary.peak_phase} at {summary.peak_node}), "
          f"MemTracker {measured}, error {error:+.2%}; without recompute {int(plain.peak_bytes)}")
    assert abs(error) <= PEAK_TOLERANCE
    assert predicted < int(plain.peak_bytes)  # the decision lowers the step's peak, as measured


@pytest.mark.parametrize("name", ["resnet", "hf-bert-dropout"])
def test_forwards_in_flight_keep_their_own_recomputes(name):
    """Two forwards (micro-batches) before either backward, the second's backward first: each
    backward recomputes from its own forward's values and RNG state, so the accumulated gradients
    are bit-identical to the plain graph's, and each forward's recomputed values are gone after
    its backward."""
    inputs, gm, _, _ = _captured(name)
    decision = solve_milp(problem_from_view(to_networkx(gm)), _budget(name, 0.25), costs=COSTS, bound="peak")
    assert decision.named("recompute")
    second = tuple(x.flip(0) if x.is_floating_point() else x for x in inputs)

    def accumulate(run, module):
        torch.manual_seed(0)
        first_loss, second_loss = run(*inputs), run(*second)  # dropout draws differ between the two
        second_loss.backward()
        first_loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        return torch.stack([first_loss.detach(), second_loss.detach()]), grads

    plain = copy.deepcopy(gm)
    losses0, grads0 = accumulate(plain, plain)
    remat = TensorRemat(copy.deepcopy(gm), actions_of(decision))
    steps = []
    original = remat.__class__.__call__

    def recording(*args):
        out = original(remat, *args)
        steps.append(remat.last)
        return out

    losses1, grads1 = accumulate(recording, remat.gm)
    assert torch.equal(losses0, losses1) and grads0.keys() == grads1.keys()
    for key in grads0:
        assert torch.equal(grads0[key], grads1[key]), key
    assert len(steps) == 2 and steps[0] is not steps[1] and all(s.tokens for s in steps)
    assert all(not s.memo and not s.held for s in steps)
