"""Every plan the search returns lowers: drawn models (the zoo GPT and Llama, Hugging Face GPT-2, a
user's ViT-style model without a sequence dim) x drawn partial ``fix`` (a few knobs pinned to values
some candidate of some model takes), on 4 CPU ranks. The search either refuses the fix with one of
our errors, or returns a plan whose every rank program the one lowering makes and whose
communication checks out (:func:`partitioner.compile.build.lower_plan` over all ranks).
Before this held, the search offered sequence parallelism to a model the lowering refused it for."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from partitioner.calibration.job_cluster import local_cluster
from partitioner.compile.build import lower_plan
from partitioner.inputs.models import build_model
from partitioner.search.profile import profile_graph
from partitioner.search.search import candidates, search
from passes.ir.config import KNOBS
from passes.ir.errors import PartitionerError
from tests.user_models import captured, vit_spec

pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH = 4, 8
MODELS = {
    "gpt": "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,dropout=0.0",
    "llama": "llama:layers=2,hidden=32,heads=4,kv_heads=2,vocab=64,seq=16",
    "hf-gpt2": ("hf-gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,resid_pdrop=0.0,"
                "embd_pdrop=0.0,attn_pdrop=0.0,seq=8"),
    "vit": None,  # tests/user_models.py's ViT: image input, no named sequence dim
}


@functools.cache
def _model(name: str):
    """(analysed capture, its profile) of ``name``, made once."""
    spec = vit_spec() if MODELS[name] is None else build_model(MODELS[name])
    graph = captured(spec)
    return graph, profile_graph(graph, name=spec.name)


@functools.cache
def _knob_values() -> dict[str, tuple]:
    """Every value some candidate of some model takes, per knob: what a user might pin."""
    seen: dict[str, set] = {k: set() for k in KNOBS}
    for name in MODELS:
        for c in candidates(_model(name)[1], local_cluster(WORLD), GLOBAL_BATCH):
            for k, v in c.knobs().items():
                seen[k].add(v)
    return {k: tuple(sorted(v, key=repr)) for k, v in seen.items()}


@st.composite
def _case(draw):
    name = draw(st.sampled_from(sorted(MODELS)))
    values = _knob_values()
    pinned = draw(st.lists(st.sampled_from([k for k in KNOBS if values[k]]), max_size=3, unique=True))
    return name, {k: draw(st.sampled_from(values[k])) for k in pinned}


@settings(max_examples=24, database=None, derandomize=True, phases=[Phase.explicit, Phase.generate], deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_case())
@example(("vit", {"tp": 2, "pp": 2}))  # where the search offered sequence parallelism the lowering refused
@example(("vit", {"sequence_parallel": True}))  # refused: the model has no sequence dim
def test_every_plan_the_search_returns_lowers(case):
    name, fix = case
    graph, profile = _model(name)
    cluster = local_cluster(WORLD)
    try:
        chosen = search(profile, cluster, global_batch=GLOBAL_BATCH, fix=fix)
    except PartitionerError:
        return  # refused with our error, naming the rule (a raw exception fails the test)
    lowering = lower_plan(graph, chosen.config, cluster=cluster)  # every program, communication checked
    assert len(lowering.programs) == chosen.config.n_stages * chosen.config.tp
    for knob, value in fix.items():
        assert chosen.config.knobs()[knob] == value
