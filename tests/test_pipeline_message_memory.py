"""A pipeline stage's forward sends do not outlive their micro-batch: the runtime drops each one
when the micro-batch's output gradient comes back (the next stage had received it), and the memory
replay frees it there too. Measured on 2 gloo ranks against the replay, with full checkpointing
and 8 micro-batches, where a stage holds little besides its block inputs, so the messages of the
finished micro-batches, were they kept to the step's end, would be a large part of its peak.

The same spawn measures a zero-bubble plan without checkpointing: the first stage's backward is
split too (I runs down to the embedding's output, W holds the micro-batch's graph and its weight
gradients), so its peak is in W, where the replay puts it."""
from __future__ import annotations

import pytest

from partitioner.calibration.job_cluster import local_cluster
from partitioner.search.memory_check import replay_rank_memory
from runtime.dist.launch import spawn
from tests import runtime_cases
from tests.runtime_cases import Plan

pytestmark = pytest.mark.slow

MODEL = "gpt-msg"
SPEC = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=64,dropout=0.0"
PLANS = [Plan(MODEL, 1, 1, 2, "1f1b", 1, 8, 8, 0, "full", "none"),
         Plan(MODEL, 1, 1, 2, "gpipe", 1, 8, 8, 0, "full", "none")]
ZERO_BUBBLE = Plan(MODEL, 1, 1, 2, "zb1p", 1, 4, 4, 0, "none", "none")


@pytest.fixture(scope="module")
def measured():
    runtime_cases.MODELS.setdefault(MODEL, SPEC)
    return spawn(runtime_cases.measure_memory, 2, PLANS + [ZERO_BUBBLE], runtime_cases.payloads_for(PLANS), {MODEL: SPEC},
                 timeout_s=300)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_each_ranks_peak_is_the_replay_with_each_forward_send_dropped_at_its_backward(measured, plan):
    graph = runtime_cases.unpacked_graph(SPEC, runtime_cases.packed_graph(SPEC))[1]
    replayed = replay_rank_memory(graph, plan.config(), local_cluster(plan.size))
    for rank in range(plan.size):
        got = measured[rank][plan.id]["peak"]
        assert replayed[rank].peak_bytes == pytest.approx(got, rel=0.02), (rank, replayed[rank].where, got)


def test_a_zero_bubble_first_stage_splits_its_backward_and_peaks_where_the_replay_says(measured):
    graph = runtime_cases.unpacked_graph(SPEC, runtime_cases.packed_graph(SPEC))[1]
    replayed = replay_rank_memory(graph, ZERO_BUBBLE.config(), local_cluster(ZERO_BUBBLE.size))
    assert "W" in replayed[0].where  # the weight half of a first-stage backward
    for rank in range(ZERO_BUBBLE.size):
        got = measured[rank][ZERO_BUBBLE.id]["peak"]
        assert replayed[rank].peak_bytes == pytest.approx(got, rel=0.02), (rank, replayed[rank].where, got)
