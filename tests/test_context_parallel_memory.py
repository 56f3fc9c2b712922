"""Context parallelism divides activation memory along the sequence, and the planner's replay
(:func:`partitioner.search.memory_check.replay_rank_memory`, what a plan's predicted peak is) says so
exactly: per rank, the replayed peak is within 5% of the measured peak (live tensor storages,
:class:`runtime.observe.measure.LiveBytes`) at cp = 1, 2 and 4 (ring and Ulysses), at tp=2, and at
tp=2 x cp=2 (ring; Ulysses with sequence parallelism), and the activation
part of the peak (peak minus model state) at cp=4 is about a quarter of cp=1's, measured and
replayed."""
from __future__ import annotations

import time

import pytest
import torch

from partitioner.search.memory_check import replay_rank_memory
from runtime.dist.launch import spawn
from tests import runtime_cases
from tests.runtime_cases import Plan
from partitioner.calibration.job_cluster import local_cluster

pytestmark = pytest.mark.slow

# attention-dominated: a long sequence for the width (the scores are [batch, heads, seq, seq])
MODEL = "gpt-long", "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=256,dropout=0.0"
WORLD, BATCH = 4, 2
TOLERANCE = 0.05


def _plan(cp: int, mode: str = "ring", tp: int = 1, sp: bool = False) -> Plan:
    return Plan(MODEL[0], 1, tp, 1, "1f1b", 1, 1, BATCH, 0, "none", "none", cp=cp, cp_mode=mode, sp=sp)


# cp alone, and cp with tp (each rank's attention on its heads; with sequence parallelism)
PLANS = [_plan(1), _plan(2), _plan(4), _plan(4, "ulysses"), _plan(1, tp=2), _plan(2, tp=2),
         _plan(2, "ulysses", tp=2, sp=True)]


def _with_model() -> None:
    runtime_cases.MODELS.setdefault(*MODEL)


def _measure(plans, payloads):
    """On each rank: per plan, the peak live bytes of steps 0-2 and the model state after them."""
    import runtime.observe.measure as measure
    from partitioner.compile.build import build_parallel_model
    from runtime.dist.mesh import Mesh, init_distributed

    _with_model()
    init_distributed(timeout_s=600)
    spec, graph = runtime_cases.unpacked_graph(runtime_cases.MODELS[MODEL[0]], payloads[MODEL[0]])
    meshes = {(p.cp, p.tp): Mesh.for_config(p.config(), timeout_s=runtime_cases.TIMEOUT_S) for p in plans}
    out = {}
    for plan in plans:
        mesh = meshes[plan.cp, plan.tp]
        torch.distributed.barrier()
        if not mesh.active:
            continue
        pm = build_parallel_model(graph, plan.config(), mesh, optimizer=runtime_cases.ADAMW, cluster=local_cluster(mesh.size))
        timer = measure.StepTimer(pm, track_memory=True)
        peak = 0
        for k in range(3):
            batch = spec.example_inputs({"batch": BATCH}, seed=300 + k)
            m = timer.measure(k, lambda: pm.train_step(batch))
            peak = max(peak, m.peak_memory_bytes or 0)
        out[plan.id] = peak
    return out


@pytest.fixture(scope="module")
def measured():
    _with_model()
    start = time.perf_counter()
    results = spawn(_measure, WORLD, PLANS, runtime_cases.payloads_for(PLANS), timeout_s=600)
    print(f"\nspawn of {WORLD} ranks, {len(PLANS)} plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def replayed():
    _with_model()
    _, graph = runtime_cases.unpacked_graph(MODEL[1], runtime_cases.packed_graph(MODEL[1]))
    return {p.id: replay_rank_memory(graph, p.config(), local_cluster(p.size)) for p in PLANS}


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_replayed_peak_matches_each_rank_measured(measured, replayed, plan):
    for rank in range(plan.size):
        got, predicted = measured[rank][plan.id], replayed[plan.id][rank].peak_bytes
        print(f"{plan.id} rank {rank}: replay {predicted}, measured {got} ({(predicted - got) / got:+.2%})")
        assert predicted == pytest.approx(got, rel=TOLERANCE), (plan.id, rank)


def test_activation_memory_at_cp4_is_a_quarter(measured, replayed):
    one, four = PLANS[0], PLANS[2]
    assert (one.cp, one.tp, four.cp, four.tp, four.cp_mode) == (1, 1, 4, 1, "ring")
    state = replayed[one.id][0].state_bytes + replayed[one.id][0].param_bytes  # the same at every cp
    assert state == replayed[four.id][0].state_bytes + replayed[four.id][0].param_bytes
    ratios = {}
    for what, peak in (("measured", lambda p: measured[0][p.id]), ("replayed", lambda p: replayed[p.id][0].peak_bytes)):
        ratios[what] = (peak(four) - state) / (peak(one) - state)
        print(f"{what}: activation part at cp=4 / cp=1 = {ratios[what]:.3f} (peaks {peak(four)} / {peak(one)}, "
              f"model state {state})")
    for ratio in ratios.values():
        assert 0.2 < ratio < 0.35
