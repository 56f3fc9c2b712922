"""A job's planner prices ``checkpointing="dag"`` only where it can win, and plans as if it had
priced it from the start."""
import dataclasses

import pytest

import partitioner.api.auto as auto
from partitioner.api.auto import choose_plan
from partitioner.compile.build import capture_training_step, run_analysis_passes
from partitioner.cost.cluster import Cluster
from partitioner.inputs.models import build_model
from partitioner.search.profile import DAG_NOT_ASKED, profile_graph, with_dag

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=64,dropout=0.0"
LAYOUT = {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 8, "offload": "none"}


@pytest.fixture(scope="module")
def captured():
    spec = build_model(SPEC)
    graph = run_analysis_passes(capture_training_step(spec, device="cpu"), memory_batch=1)
    return spec, graph


def _cluster(memory_bytes=None) -> Cluster:
    c = dataclasses.replace(Cluster.preset("local-cpu"), nodes=1, devices_per_node=4)
    if memory_bytes is not None:
        c = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=int(memory_bytes)))
    return c


def _plan(captured, cluster, fix, *, dag):
    spec, graph = captured
    profile = profile_graph(graph, name=spec.name, dag=dag)
    return choose_plan(spec, cluster, world_size=4, global_batch=32, fix=fix, profile=profile, graph=graph)


def _counting(monkeypatch):
    calls = []

    def counted(profile, graph):
        calls.append(1)
        return with_dag(profile, graph)

    monkeypatch.setattr(auto, "with_dag", counted)
    return calls


def test_a_profile_made_without_dag_says_so_and_prices_it_on_request(captured):
    spec, graph = captured
    lazy, eager = profile_graph(graph, name=spec.name, dag=False), profile_graph(graph, name=spec.name)
    assert not lazy.dag_asked and eager.dag_asked
    assert lazy.blocks[0].dag_refusal == DAG_NOT_ASKED and lazy.blocks[0].dag_activation_bytes is None
    assert with_dag(lazy, graph) == eager


def test_roomy_memory_plans_without_pricing_dag(captured, monkeypatch):
    calls = _counting(monkeypatch)
    lazy = _plan(captured, _cluster(), LAYOUT, dag=False)
    assert calls == []  # the whole model and batch fit many times over: dag cannot win
    eager = _plan(captured, _cluster(), LAYOUT, dag=True)
    # the same plan and numbers (the alternatives differ: only the full profile lists dag's, slower)
    assert lazy.config == eager.config and lazy.predicted == eager.predicted
    assert all(a.knobs["checkpointing"] != "dag" for a in lazy.alternatives)
    _plan(captured, _cluster(), {**LAYOUT, "checkpointing": "dag"}, dag=False)
    assert calls == [1]  # pinned: priced


def test_tight_memory_prices_dag_and_picks_what_the_full_profile_picks(captured, monkeypatch):
    # memory between dag's peak and none's: dag fits, none does not (the search weighs dag
    # against full and selective): the search sees a faster plan that does not fit
    peaks = {ckpt: _plan(captured, _cluster(), {**LAYOUT, "checkpointing": ckpt}, dag=True).predicted
             for ckpt in ("none", "dag")}
    assert peaks["dag"].peak_memory_bytes < peaks["none"].peak_memory_bytes
    tight = _cluster((peaks["dag"].peak_memory_bytes + peaks["none"].peak_memory_bytes) / 2)
    eager = _plan(captured, tight, LAYOUT, dag=True)
    assert eager.config.checkpointing != "none"
    assert any(a.knobs["checkpointing"] == "dag" for a in eager.alternatives) or eager.config.checkpointing == "dag"
    calls = _counting(monkeypatch)
    lazy = _plan(captured, tight, LAYOUT, dag=False)
    assert calls == [1]
    assert lazy.to_dict() == eager.to_dict()  # the same plan, numbers and alternatives
