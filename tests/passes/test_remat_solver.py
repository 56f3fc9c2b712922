"""remat_solver: the MILP is exact (brute force on tiny random DAGs, the chain DP on random chains),
the parametric min cut stays within budget and near the MILP's optimum on real graphs, the cost
model is annotate_memory's bytes, and block-level checkpointing is never better than the DAG policy."""
from __future__ import annotations

import copy
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.errors import ConfigError, PassError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_memory import annotate_memory
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_spec
from passes.policies.checkpoint_policy import checkpoint_policy
from passes.solvers.checkpoint_solver import ChainSegment, solve_chain
from passes.analysis.graph_view import to_networkx
from passes.ir.meta import CHECKPOINT_PLAN, MEMORY_SUMMARY
from passes.solvers.remat_solver import (RematCosts, RematProblem, Storage, backward_peak, evaluate, from_checkpoint_plan,
                                         problem_from_view, solve_brute_force, solve_milp, solve_min_cut)

GPU = RematCosts(device_flops_per_s=1e12)  # no host link: save or recompute
MODELS = {
    "resnet": "resnet:blocks=2-2,widths=8-16,image=16",
    "unet": "unet:depth=2,width=8,image=16",
    "bert": "bert:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.1",
}


def _random_problem(rng: random.Random, n: int) -> RematProblem:
    """A random DAG of ``n`` nodes at positions 0, 2, 4, ... (odd positions are nodes outside the
    problem: views): each owns one or two storages (an output and maybe an internal), reads
    outputs of up to three earlier nodes; some outputs kept (unpacked by the owner's backward or
    some readers'), some nodes fixed."""
    storages, outputs = [], []
    readers: dict[int, list[int]] = {}
    for v in range(n):
        for u in rng.sample(range(v), min(v, rng.randint(0, 3))):
            readers.setdefault(outputs[u], []).append(v)
        outputs.append(len(storages))
        storages.append(dict(name=f"{v}:0", owner=v, nbytes=rng.randint(1, 100), kept=rng.random() < 0.6))
        if rng.random() < 0.3:
            storages.append(dict(name=f"{v}:1", owner=v, nbytes=rng.randint(1, 50), kept=True, internal=True,
                                 used_at=(2 * v,)))
    for j, s in enumerate(storages):
        if s["kept"] and "used_at" not in s:
            can = [s["owner"], *readers.get(j, ())]
            s["used_at"] = tuple(sorted(2 * u for u in rng.sample(can, rng.randint(1, len(can)))))
    return RematProblem(nodes=tuple(f"v{i}" for i in range(n)),
                        flops=tuple(rng.choice([0, rng.randint(1, 1000)]) for _ in range(n)),
                        recomputable=tuple(rng.random() < 0.85 for _ in range(n)),
                        storages=tuple(Storage(**s, readers=tuple(readers.get(j, ()))) for j, s in enumerate(storages)),
                        fixed_bytes=rng.randint(0, 20), positions=tuple(2 * i for i in range(n)))


def _budgets(problem: RematProblem, k: int = 5) -> list[int]:
    """``k`` budgets evenly between the fewest bytes any decision keeps and keeping everything."""
    least = solve_min_cut(problem, -1, costs=GPU).saved_bytes
    return [least + (problem.base_bytes - least) * i // (k + 1) for i in range(1, k + 1)]


# ---------------------------------------------------------------------------------------------
# Exactness on tiny DAGs.

@pytest.mark.parametrize("seed", range(30))
def test_milp_matches_brute_force_on_tiny_dags(seed):
    rng = random.Random(seed)
    problem = _random_problem(rng, rng.randint(3, 9))
    costs = GPU if seed % 3 == 0 else RematCosts(device_flops_per_s=1e12, host_bytes_per_s=rng.choice([1e12, 1e13, 1e14]))
    least = solve_min_cut(problem, -1, costs=costs).saved_bytes
    budget = rng.randint(least, problem.base_bytes)
    exact = solve_brute_force(problem, budget, costs=costs)
    found = solve_milp(problem, budget, costs=costs)
    assert exact.feasible and found.feasible and found.optimal
    assert found.added_s == pytest.approx(exact.added_s, rel=1e-9, abs=1e-18)
    # The reported totals are the exact cost of the reported actions.
    again = evaluate(problem, found.named("recompute"), found.named("offload"), budget_bytes=budget, costs=costs)
    assert (again.saved_bytes, again.offload_bytes, again.recompute_flops) == (
        found.saved_bytes, found.offload_bytes, found.recompute_flops)
    assert found.saved_bytes == sum(d.saved_bytes for d in found.nodes) + problem.fixed_bytes <= budget
    # The min cut (no offload) is a valid decision within budget, never better than the optimum.
    cut = solve_min_cut(problem, budget, costs=GPU)
    assert cut.feasible and not cut.named("offload")
    assert cut.recompute_flops >= solve_brute_force(problem, budget, costs=GPU).recompute_flops


def _peaks(problem: RematProblem) -> dict[int, int]:
    """Fewest FLOPs at each backward peak any recompute set reaches (by trying every set)."""
    free = [i for i in range(len(problem.nodes)) if problem.recomputable[i]]
    best: dict[int, int] = {}
    for k in range(len(free) + 1):
        for chosen in itertools.combinations(free, k):
            r = [i in chosen for i in range(len(problem.nodes))]
            peak, flops = backward_peak(problem, r), sum(problem.flops[i] for i in chosen)
            best[peak] = min(best.get(peak, flops), flops)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_peak_bound_milp_matches_brute_force_on_tiny_dags(seed):
    rng = random.Random(seed)
    problem = _random_problem(rng, rng.randint(3, 9))
    peaks = _peaks(problem)
    for budget in rng.sample(sorted(peaks), min(4, len(peaks))):
        fewest = min(f for p, f in peaks.items() if p <= budget)
        exact = solve_brute_force(problem, budget, costs=GPU, bound="peak")
        found = solve_milp(problem, budget, costs=GPU, bound="peak")
        assert exact.feasible and found.feasible and found.optimal and found.bound == "peak"
        assert exact.recompute_flops == found.recompute_flops == fewest
        assert found.peak_bytes <= budget and found.peak_bytes >= found.saved_bytes
        again = evaluate(problem, found.named("recompute"), budget_bytes=budget, costs=GPU, bound="peak")
        assert again.peak_bytes == found.peak_bytes
    # Below the lowest peak: infeasible, and the decision reaching the lowest peak, fewest FLOPs there.
    lowest = min(peaks)
    d = solve_milp(problem, lowest - 1, costs=GPU, bound="peak")
    assert not d.feasible and d.peak_bytes == lowest and d.recompute_flops == peaks[lowest]


def test_without_recomputes_the_peak_is_what_forward_saves():
    for seed in range(10):
        problem = _random_problem(random.Random(seed), 8)
        d = evaluate(problem, [], budget_bytes=0, costs=GPU)
        assert d.peak_bytes == d.saved_bytes == problem.base_bytes


def test_the_peak_bound_refuses_offload():
    problem = _random_problem(random.Random(3), 5)
    with pytest.raises(ConfigError, match="peak bound"):
        solve_milp(problem, 100, costs=RematCosts(device_flops_per_s=1e12, host_bytes_per_s=1e9), bound="peak")


def test_budget_below_the_fewest_bytes_is_infeasible():
    problem = _random_problem(random.Random(7), 6)
    least = solve_min_cut(problem, -1, costs=GPU)
    for solver in (solve_min_cut, solve_milp, solve_brute_force):
        d = solver(problem, least.saved_bytes - 1, costs=GPU)
        assert not d.feasible and not d.optimal and d.saved_bytes == least.saved_bytes


def test_fast_host_link_offloads_instead_of_recomputing():
    # a -> b -> c, every output kept; recomputing b costs 1e9 FLOPs (1 ms at 1e12 FLOP/s).
    problem = RematProblem(nodes=("a", "b", "c"), flops=(10 ** 9, 10 ** 9, 10 ** 9), recomputable=(True,) * 3,
                           storages=(Storage(name="a:0", owner=0, nbytes=1000, kept=True, readers=(1,)),
                                     Storage(name="b:0", owner=1, nbytes=1000, kept=True, readers=(2,)),
                                     Storage(name="c:0", owner=2, nbytes=1000, kept=True)))
    fast = solve_milp(problem, 2000, costs=RematCosts(device_flops_per_s=1e12, host_bytes_per_s=1e9))  # 2 us
    slow = solve_milp(problem, 2000, costs=RematCosts(device_flops_per_s=1e12, host_bytes_per_s=1e3))  # 2 s
    assert fast.named("offload") and not fast.named("recompute") and fast.offload_bytes == 1000
    assert slow.named("recompute") and not slow.named("offload") and slow.recompute_flops == 10 ** 9
    assert fast.added_s == pytest.approx(2e-6) and slow.added_s == pytest.approx(1e-3)


def test_nodes_that_cannot_be_recomputed_are_kept():
    problem = RematProblem(nodes=("a", "b"), flops=(0, 0), recomputable=(False, True),
                           storages=(Storage(name="a:0", owner=0, nbytes=100, kept=True, readers=(1,)),
                                     Storage(name="b:0", owner=1, nbytes=100, kept=True)))
    for solver in (solve_min_cut, solve_milp, solve_brute_force):
        d = solver(problem, 100, costs=GPU)
        assert d.action("a") == "save" and d.action("b") == "recompute", solver.__name__
    with pytest.raises(ConfigError, match="cannot be recomputed"):
        evaluate(problem, ["a"], budget_bytes=0, costs=GPU)


# ---------------------------------------------------------------------------------------------
# The chain DP of checkpoint_solver is the special case of a chain.

@st.composite
def _chains(draw):
    n = draw(st.integers(1, 10))
    segs = [(draw(st.integers(0, 10 ** 6)), draw(st.integers(1, 5000)), draw(st.integers(0, 5000)))
            for _ in range(n)]
    return segs, draw(st.floats(0, 1))


def _chain_problem(segs) -> RematProblem:
    """Segment i = one recomputable node u_i (FLOPs f_i, output a_i bytes kept for backward),
    entered from a fixed boundary node w_i (output b_i bytes, read only by u_i): recomputing u_i
    drops a_i and keeps b_i, as a checkpoint keeps its input."""
    nodes, flops, fixed, storages = [], [], [], []
    for i, (f, a, b) in enumerate(segs):
        w, u = len(nodes), len(nodes) + 1
        nodes += [f"w{i}", f"u{i}"]
        flops += [0, f]
        fixed += [False, True]
        storages += [Storage(name=f"w{i}:0", owner=w, nbytes=b, kept=False, readers=(u,)),
                     Storage(name=f"u{i}:0", owner=u, nbytes=a, kept=True,
                             readers=(u + 1,) if i + 1 < len(segs) else ())]
    return RematProblem(nodes=tuple(nodes), flops=tuple(flops), recomputable=tuple(fixed), storages=tuple(storages))


@settings(max_examples=60, deadline=None)
@given(_chains())
def test_milp_and_min_cut_agree_with_the_chain_dp(chain):
    segs, t = chain
    problem = _chain_problem(segs)
    segments = [ChainSegment(flops=f, saved_bytes=a, boundary_bytes=b) for f, a, b in segs]
    least = sum(min(a, b) for _, a, b in segs)
    budget = least + int(t * (problem.base_bytes - least))
    dp = solve_chain(segments, budget)
    assert dp.feasible
    milp = solve_milp(problem, budget, costs=GPU)
    assert milp.feasible and milp.recompute_flops == dp.recompute_flops
    cut = solve_min_cut(problem, budget, costs=GPU)
    assert cut.feasible and cut.recompute_flops >= dp.recompute_flops
    if budget in (least, problem.base_bytes):  # hull vertices: the min cut is exact there
        assert cut.recompute_flops == dp.recompute_flops


# ---------------------------------------------------------------------------------------------
# Real graphs.

@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    gm = capture_spec(build_model(MODELS[request.param], device="meta"))
    gm = annotate_memory(annotate_flops(annotate_blocks(annotate_shapes(gm))))
    return request.param, gm, problem_from_view(to_networkx(gm))


def test_nothing_recomputed_keeps_annotate_memorys_bytes(model):
    _, gm, problem = model
    memory = gm.meta[MEMORY_SUMMARY]
    d = evaluate(problem, [], budget_bytes=problem.base_bytes, costs=GPU)
    assert d.saved_bytes == problem.base_bytes == int(memory.activation_bytes + memory.input_bytes)
    assert d.feasible and d.recompute_flops == 0 and not d.named("recompute")


def test_min_cut_fits_the_budget_within_one_percent_of_the_milp(model):
    name, _, problem = model
    for budget in _budgets(problem):
        cut = solve_min_cut(problem, budget, costs=GPU)
        best = solve_milp(problem, budget, costs=GPU)
        assert best.optimal and best.feasible
        assert cut.feasible and cut.saved_bytes <= budget, (name, budget)
        assert best.recompute_flops <= cut.recompute_flops <= 1.01 * best.recompute_flops, (name, budget)


def test_block_level_checkpointing_is_never_better_than_the_dag_policy(model):
    name, gm, problem = model
    compared = 0
    for budget in _budgets(problem):
        try:
            plan = checkpoint_policy(copy.deepcopy(gm), policy="solver", budget_bytes=budget).meta[CHECKPOINT_PLAN]
        except PassError:
            continue  # the blocks cannot reach this budget at all
        blocks = from_checkpoint_plan(problem, plan, budget_bytes=budget, costs=GPU)
        assert blocks.feasible, (name, budget, blocks.saved_bytes)  # the block plan's bytes fit in this model too
        dag = solve_milp(problem, budget, costs=GPU)
        assert dag.recompute_flops <= blocks.recompute_flops and dag.added_s <= blocks.added_s, (name, budget)
        compared += 1
    assert compared >= 2, name


def test_bounding_the_saved_bytes_does_not_bound_the_backward_peak(model):
    """What the peak bound is for: with only the bytes saved after forward bounded, tensors
    recomputed for an early use in backward and kept to a late one push the peak over budget."""
    name, _, problem = model
    over = compared = 0
    for k, budget in enumerate(_budgets(problem)):
        saved = solve_milp(problem, budget, costs=GPU)
        assert saved.feasible and saved.saved_bytes <= budget
        over += saved.peak_bytes > budget
        if k < 2:  # the tightest budgets lie below every peak; proving so takes a minute a model
            continue
        peak = solve_milp(problem, budget, costs=GPU, bound="peak")
        if peak.feasible:
            assert peak.peak_bytes <= budget and peak.recompute_flops >= saved.recompute_flops, (name, budget)
            compared += 1
    assert over and compared, name


def test_the_peak_bound_keeps_what_no_backward_unpacks():
    """A node whose kept storage no backward unpacks (a dead branch) is not recomputed under the
    peak bound, though recomputing it would free its bytes in this model: the executor's token
    would never be unpacked and would hold the recompute's input until the step ends."""
    problem = RematProblem(nodes=("a", "b"), flops=(0, 0), recomputable=(True, True), positions=(0, 1),
                           storages=(Storage(name="a:0", owner=0, nbytes=100, kept=True, readers=(1,), used_at=(0,)),
                                     Storage(name="b:0", owner=1, nbytes=100, kept=True)))
    assert solve_milp(problem, 150, costs=GPU).action("b") == "recompute"  # the saved bound would
    assert not solve_brute_force(problem, 150, costs=GPU, bound="peak").feasible
    d = solve_milp(problem, 150, costs=GPU, bound="peak")
    assert not d.feasible and d.action("b") == "save" and d.peak_bytes == 200


def test_every_milp_solve_has_a_time_limit_and_the_decision_its_gap(monkeypatch):
    import passes.solvers.remat_solver as solver

    limits = []

    def recorded(*args, options, **kwargs):
        limits.append(options["time_limit"])
        return real(*args, options=options, **kwargs)

    real = solver.milp
    monkeypatch.setattr(solver, "milp", recorded)
    problem = _random_problem(random.Random(5), 8)
    lowest = min(_peaks(problem))
    # below the lowest peak: the first solve is infeasible and two more run, all within the call's limit
    d = solve_milp(problem, lowest - 1, costs=GPU, bound="peak", time_limit_s=5.0)
    assert len(limits) == 3 and all(0 < t <= 5.0 for t in limits)
    assert d.method == "milp" and d.mip_gap is not None and d.mip_gap >= 0
    found = solve_milp(problem, max(_peaks(problem)), costs=GPU, bound="peak", time_limit_s=5.0)
    assert found.optimal and found.mip_gap == pytest.approx(0.0, abs=1e-9)
    assert solve_min_cut(problem, lowest, costs=GPU).mip_gap is None  # no MILP made it
    with pytest.raises(ConfigError, match="time_limit_s must be > 0 seconds"):
        solve_milp(problem, lowest, costs=GPU, time_limit_s=0)


def test_out_of_time_without_a_solution_recomputes_nothing_and_says_so(monkeypatch):
    import passes.solvers.remat_solver as solver
    from scipy.optimize import OptimizeResult

    calls = []

    def out_of_time(*args, **kwargs):  # HiGHS at its time limit before any solution
        calls.append(kwargs["options"]["time_limit"])
        return OptimizeResult(x=None, status=1, success=False, mip_gap=None)

    monkeypatch.setattr(solver, "milp", out_of_time)
    problem = _random_problem(random.Random(5), 8)
    d = solve_milp(problem, min(_peaks(problem)), costs=GPU, bound="peak", time_limit_s=5.0)
    assert len(calls) == 1  # no fallback solves once the time is spent
    assert d.named("recompute") == () and d.recompute_flops == 0 and not d.optimal and d.mip_gap == float("inf")
    keep_all = solve_min_cut(problem, 10 ** 12, costs=GPU)  # every storage saved
    assert keep_all.named("recompute") == ()
    saved = solve_milp(problem, keep_all.saved_bytes - 1, costs=GPU, time_limit_s=5.0)
    assert saved.mip_gap == float("inf") and not saved.optimal
    assert len(calls) == 2


@pytest.mark.parametrize("bound", ["saved", "peak"])
def test_a_budget_that_holds_everything_is_answered_without_a_solve(monkeypatch, bound):
    # nothing recomputed adds no seconds: where it fits it is the optimum, and no MILP is built
    import passes.solvers.remat_solver as solver

    def unexpected(*args, **kwargs):
        raise AssertionError("a MILP was solved")

    problem = _random_problem(random.Random(5), 8)
    keep_all = solve_min_cut(problem, 10 ** 12, costs=GPU)
    budget = keep_all.peak_bytes if bound == "peak" else keep_all.saved_bytes
    monkeypatch.setattr(solver, "milp", unexpected)
    d = solve_milp(problem, budget, costs=GPU, bound=bound)
    assert d.feasible and d.optimal and d.mip_gap == 0.0 and d.method == "milp"
    assert d.named("recompute") == () and d.recompute_flops == 0 and d.added_s == 0.0
    monkeypatch.undo()
    tighter = solve_milp(problem, budget - 1, costs=GPU, bound=bound)  # one byte less: a solve, and something recomputed
    assert tighter.recompute_flops > 0 or tighter.offload_bytes > 0 or not tighter.feasible


def test_a_problem_proven_once_is_answered_again_without_solving(monkeypatch):
    import scipy.optimize
    from scipy.optimize import OptimizeResult

    import passes.solvers.remat_solver as solver

    calls = []
    real = scipy.optimize.milp

    def counted(*args, **kwargs):
        calls.append(kwargs["options"]["time_limit"])
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", counted)
    monkeypatch.setattr(solver, "_SOLVED", {})
    problem = _random_problem(random.Random(5), 8)
    lowest, second = sorted(p for p in _peaks(problem) if p < backward_peak(problem, [False] * len(problem.nodes)))[:2]
    first = solve_milp(problem, lowest, costs=GPU, bound="peak")
    assert len(calls) == 1 and first.optimal
    assert solve_milp(problem, lowest, costs=GPU, bound="peak", time_limit_s=7.0) == first  # another limit, same problem
    assert len(calls) == 1
    solve_milp(problem, second, costs=GPU, bound="peak")  # another budget: another problem
    assert len(calls) == 2

    def out_of_time(*args, **kwargs):  # an answer cut short by the limit is not kept
        calls.append(kwargs["options"]["time_limit"])
        return OptimizeResult(x=None, status=1, success=False, mip_gap=None)

    monkeypatch.setattr(scipy.optimize, "milp", out_of_time)
    monkeypatch.setattr(solver, "_SOLVED", {})
    for _ in range(2):
        assert solve_milp(problem, lowest, costs=GPU, bound="peak").mip_gap == float("inf")
    assert len(calls) == 4


def test_what_the_solver_prints_on_stdout_does_not_reach_it(capfd):
    # HiGHS prints a debug line on file descriptor 1 from one of its heuristics; a command's
    # --json output is on stdout
    import ctypes
    import os

    import passes.solvers.remat_solver as solver

    print("before", flush=True)
    with solver._native_stdout_silenced():
        os.write(1, b"native write\n")
        ctypes.CDLL(None).printf(b"buffered C write\n")
    print("after", flush=True)
    ctypes.CDLL(None).fflush(None)  # what C still buffered would come out now
    assert capfd.readouterr().out == "before\nafter\n"
