"""The search offers what the lowering runs, and the profile solves only what the user asked for.

* ``checkpointing="tensor"`` is priced by a per-tensor remat MILP over the whole captured graph,
  whose time grows with the depth (a 30-layer model spent minutes there): the profile of a
  captured graph or a ModelSpec runs it only when ``tensor`` is pinned (``choose_plan`` asks),
  the search offers ``tensor`` only when priced, and a pinned ``tensor`` still plans and lowers.
* Sequence parallelism cuts a named ``seq`` dim: a ViT-style model (image input, no ``seq``)
  is never offered it (the lowering's rule, one predicate), and a pinned
  ``sequence_parallel=true`` is refused with our ConfigError before any capture.
"""
from __future__ import annotations

import pytest

import partitioner.search.profile as profile_mod
from partitioner.api.auto import choose_plan
from partitioner.inputs.models import build_model
from partitioner.search.profile import TENSOR_NOT_ASKED, profile_graph
from partitioner.search.search import candidates, search
from passes.ir.errors import ConfigError
from passes.rewrites.sequence_parallel import sequence_parallel_refusal
from partitioner.calibration.job_cluster import local_cluster
from tests.user_models import captured, vit_spec

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, WORLD = 8, 4


@pytest.fixture
def milp_calls(monkeypatch):
    """Counts the profile's calls of the tensor remat policy (its whole-graph MILP)."""
    calls = []
    real = profile_mod.decide_tensor_remat

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_mod, "decide_tensor_remat", counted)
    return calls


@pytest.fixture(scope="module")
def gpt():
    spec = build_model(GPT)
    return spec, captured(spec)


def test_profile_runs_no_tensor_milp_unless_pinned(gpt, milp_calls):
    spec, graph = gpt
    profile = profile_graph(graph, name=spec.name)
    assert profile.blocks[0].tensor_activation_bytes is None and profile.blocks[0].tensor_refusal == TENSOR_NOT_ASKED
    assert not profile.tensor_remat_asked
    assert "tensor" not in {c.checkpointing for c in candidates(profile, local_cluster(WORLD), GLOBAL_BATCH)}
    chosen = choose_plan(spec, local_cluster(WORLD), world_size=WORLD, global_batch=GLOBAL_BATCH,
                         profile=profile, graph=graph)
    assert chosen.config.checkpointing != "tensor"
    choose_plan(spec, local_cluster(WORLD), world_size=WORLD, global_batch=GLOBAL_BATCH,
                fix="dp=4,checkpointing=full")  # profiles the ModelSpec itself
    assert milp_calls == []


def test_a_pinned_tensor_still_plans_and_lowers(gpt, milp_calls):
    spec, graph = gpt
    profile = profile_graph(graph, name=spec.name)  # as auto_parallelize profiles: nothing pinned yet
    chosen = choose_plan(spec, local_cluster(WORLD), world_size=WORLD, global_batch=GLOBAL_BATCH,
                         fix="dp=4,checkpointing=tensor", profile=profile, graph=graph)
    assert chosen.config.checkpointing == "tensor"
    assert chosen.predicted.memory_model == "replay"  # its rank programs were lowered and replayed
    assert len(milp_calls) == 1 and milp_calls[0]["time_limit_s"] == profile_mod.TENSOR_TIME_LIMIT_S
    priced = profile_graph(graph, name=spec.name, tensor_remat=True)
    assert priced.tensor_remat_asked and priced.blocks[0].tensor_activation_bytes is not None
    assert priced.blocks[0].tensor_mip_gap is not None and priced.blocks[0].tensor_mip_gap <= 1e-6  # solved
    assert "tensor" in {c.checkpointing for c in candidates(priced, local_cluster(WORLD), GLOBAL_BATCH)}


def test_a_pinned_tensor_on_a_profile_made_without_it_names_the_way_out(gpt):
    spec, graph = gpt
    profile = profile_graph(graph, name=spec.name)
    with pytest.raises(ConfigError, match=r"checkpointing='tensor' is pinned but this profile was made without "
                                          r"pricing it.*tensor_remat=True.*with_tensor_remat"):
        search(profile, local_cluster(WORLD), global_batch=GLOBAL_BATCH, fix={"checkpointing": "tensor"})


# ---------------------------------------------------------------------------------------------
# A ViT-style model: image input, no named sequence dim.


@pytest.fixture(scope="module")
def vit():
    spec = vit_spec()
    return spec, captured(spec)


def test_a_model_without_a_seq_dim_is_not_offered_sequence_parallelism_and_lowers(vit):
    spec, graph = vit
    profile = profile_graph(graph, name=spec.name)
    assert profile.seq == 0 and profile.sequence_parallel_refusal(2) == sequence_parallel_refusal(None, 2)
    cands = candidates(profile, local_cluster(WORLD), GLOBAL_BATCH, fix={"tp": 2, "pp": 2})
    assert cands and not any(c.sequence_parallel for c in cands)
    chosen = choose_plan(spec, local_cluster(WORLD), world_size=WORLD, global_batch=GLOBAL_BATCH,
                         fix="tp=2,pp=2", profile=profile, graph=graph)
    assert (chosen.config.tp, chosen.config.pp, chosen.config.sequence_parallel) == (2, 2, False)
    assert chosen.predicted.memory_model == "replay"  # every rank program was lowered and replayed


def test_a_pinned_sequence_parallel_without_a_seq_dim_is_refused_before_any_work(vit, monkeypatch):
    spec, graph = vit

    def no_work(*args, **kwargs):
        raise AssertionError("profiled or captured before refusing the pinned knobs")

    monkeypatch.setattr("partitioner.api.auto.profile_spec", no_work)
    with pytest.raises(ConfigError, match=r"choose_plan: fix: sequence_parallel=true is pinned, but sequence "
                                          r"parallelism needs a named sequence dim 'seq'.*sequence_parallel=false"):
        choose_plan(spec, local_cluster(WORLD), world_size=WORLD, global_batch=GLOBAL_BATCH,
                    fix="tp=2,pp=2,sequence_parallel=true")
    # from a profile (the search's own check), the same rule and words
    profile = profile_graph(graph, name=spec.name)
    with pytest.raises(ConfigError, match=r"no candidate plan .*needs a named sequence dim 'seq'"):
        candidates(profile, local_cluster(WORLD), GLOBAL_BATCH, fix={"sequence_parallel": True})


def test_the_front_doors_price_a_pinned_tensor_and_refuse_a_pinned_sp_before_capture(vit, monkeypatch):
    import partitioner
    from partitioner.api.auto import auto_parallelize

    spec = build_model(GPT)
    chosen = partitioner.plan(spec, local_cluster(WORLD), training=partitioner.Training(global_batch=GLOBAL_BATCH),
                              fix="dp=4,checkpointing=tensor")
    assert chosen.config.checkpointing == "tensor"

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before refusing the pinned knobs")

    monkeypatch.setattr("partitioner.api.auto.capture_training_step", no_capture)
    with pytest.raises(ConfigError, match=r"auto_parallelize: fix: sequence_parallel=true is pinned, but sequence "
                                          r"parallelism needs a named sequence dim 'seq'"):
        auto_parallelize(vit[0], training=partitioner.Training(global_batch=GLOBAL_BATCH),
                         fix="tp=2,pp=2,sequence_parallel=true")
