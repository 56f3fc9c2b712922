"""Plan: typed fields, validation, exact JSON round-trip."""
import json

import pytest

from partitioner.cost.cluster import Cluster
from partitioner.errors import ConfigError
from passes.ir.plan import Plan
from partitioner.search.profile import profile_model
from partitioner.search.search import search


@pytest.fixture(scope="module")
def chosen() -> Plan:
    profile = profile_model("gpt:layers=4,hidden=64,heads=4,vocab=256,seq=32", dtype="bf16")
    return search(profile, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch=32,
                fix={"pp": 2, "schedule": "interleaved", "virtual_pp": 2})


def test_json_round_trip_is_exact(chosen):
    text = chosen.to_json()
    back = Plan.from_json(text)
    assert back == chosen
    assert back.to_json() == text
    assert isinstance(back.stages[0].layers[0], tuple)  # tuples again, not JSON lists
    data = json.loads(text)
    assert set(data["predicted"]["terms"]) >= {"compute", "bubble", "dp_comm", "total"}
    assert set(data["stages"][0]["memory"]) == {"parameters", "gradients", "optimizer", "activations", "buffers"}


def test_plan_fields_are_consistent(chosen):
    assert chosen.dp * chosen.tp * chosen.pp == 16
    assert chosen.dp * chosen.micro_batch_size * chosen.num_micro_batches == 32
    assert len(chosen.stages) == chosen.pp
    assert all(len(s.layers) == chosen.virtual_pp for s in chosen.stages)
    covered = sorted(r for s in chosen.stages for r in s.layers)
    assert covered[0][0] == 0 and covered[-1][1] == 4 + 2  # embedding .. head, no gaps
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for s in chosen.stages:
        assert s.peak_memory_bytes == pytest.approx(sum(s.memory.values()))
    assert chosen.predicted.peak_memory_bytes == max(s.peak_memory_bytes for s in chosen.stages)
    assert chosen.predicted.terms["total"] == pytest.approx(chosen.predicted.step_time_s)


def test_plan_rejects_inconsistent_batch(chosen):
    def with_config(**changes):
        data = chosen.to_dict()
        return data | {"config": data["config"] | changes}

    with pytest.raises(ConfigError, match="global_batch"):
        Plan.from_dict(with_config(num_micro_batches=chosen.num_micro_batches + chosen.pp))
    with pytest.raises(ConfigError, match="schedule"):
        Plan.from_dict(with_config(schedule="zigzag"))
