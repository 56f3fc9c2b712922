"""A pipeline stage's forward sends do not outlive their micro-batch: the runtime drops each one
when the micro-batch's output gradient comes back (the next stage had received it), and the memory
replay frees it there too. Measured on 2 gloo ranks against the replay, with full checkpointing
and 8 micro-batches, where a stage holds little besides its block inputs, so the messages of the
finished micro-batches, were they kept to the step's end, would be a large part of its peak.

The same spawn measures zero-bubble plans without checkpointing, of a GPT and of a Llama whose
vocabulary makes the loss's saved log-softmax a large tensor. What the replay must hold as the
runtime does: the first stage's backward is split too (I runs down to the embedding's output); I
releases what only the loss side saved once the stage lets go of its output; W holds the
micro-batch's graph and its weight gradients, and a first accumulation takes over a gradient that
came through another node (the ``t`` of a linear) instead of copying it."""
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
LLAMA, LLAMA_SPEC = "llama-zb", "llama:layers=4,hidden=64,heads=4,kv_heads=2,vocab=2048,seq=64"
ZERO_BUBBLE = [Plan(MODEL, 1, 1, 2, "zb1p", 1, 4, 4, 0, "none", "none"),
               Plan(LLAMA, 1, 1, 2, "zb1p", 1, 4, 4, 0, "none", "none")]
SPECS = {MODEL: SPEC, LLAMA: LLAMA_SPEC}


@pytest.fixture(scope="module")
def measured():
    for key, spec in SPECS.items():
        runtime_cases.MODELS.setdefault(key, spec)
    plans = PLANS + ZERO_BUBBLE
    return spawn(runtime_cases.measure_memory, 2, plans, runtime_cases.payloads_for(plans), SPECS, timeout_s=300)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_each_ranks_peak_is_the_replay_with_each_forward_send_dropped_at_its_backward(measured, plan):
    graph = runtime_cases.unpacked_graph(SPEC, runtime_cases.packed_graph(SPEC))[1]
    replayed = replay_rank_memory(graph, plan.config(), local_cluster(plan.size))
    for rank in range(plan.size):
        got = measured[rank][plan.id]["peak"]
        assert replayed[rank].peak_bytes == pytest.approx(got, rel=0.02), (rank, replayed[rank].where, got)


@pytest.mark.parametrize("plan", ZERO_BUBBLE, ids=lambda p: p.id)
def test_a_zero_bubble_plans_peaks_are_the_replay(measured, plan):
    spec = SPECS[plan.model]
    graph = runtime_cases.unpacked_graph(spec, runtime_cases.packed_graph(spec))[1]
    replayed = replay_rank_memory(graph, plan.config(), local_cluster(plan.size))
    for rank in range(plan.size):
        assert "W" in replayed[rank].where  # the weight half of a backward
        got = measured[rank][plan.id]["peak"]
        assert replayed[rank].peak_bytes == pytest.approx(got, rel=0.02), (rank, replayed[rank].where, got)
