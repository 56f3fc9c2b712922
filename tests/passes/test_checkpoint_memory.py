"""Analysis of checkpointed graphs: ``annotate_memory``'s peak of one training step of the
rewritten graph against MemTracker measuring the real step on CPU, and ``annotate_flops``'s
count against the original graph plus the plan's recompute FLOPs.

Zoo GPT with batch 8, so that saved activations (not the model state) decide the peak.
"""
from __future__ import annotations

import copy
import functools

import pytest
import sympy
import torch
from torch import fx
from runtime.observe.measure import memtracker_step_peak

from partitioner.inputs.models import build_model
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_memory import annotate_memory
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_shapes import annotate_shapes
from passes.rewrites.apply_checkpoint import apply_checkpoint
from passes.capture.capture import capture_spec
from passes.policies.checkpoint_policy import checkpoint_policy
from passes.ir.meta import CHECKPOINT_PLAN, FLOP_SUMMARY, FLOPS, MEMORY_SUMMARY, dim_symbol

SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32,batch=8"
PEAK_TOLERANCE = 0.05


@functools.lru_cache(maxsize=None)
def _captured():
    spec = build_model(SPEC)
    gm = annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec))))
    return spec.example_inputs(), gm


def _budget(gm: fx.GraphModule) -> int:
    """Saved bytes of recomputing one block of two: the solver must pick exactly one."""
    full = checkpoint_policy(copy.deepcopy(gm), policy="full").meta[CHECKPOINT_PLAN]
    return int(full.saved_bytes_before - full.regions[0].bytes_saved)


@functools.lru_cache(maxsize=None)
def _checkpointed(policy: str) -> fx.GraphModule:
    _, gm = _captured()
    budget = _budget(gm) if policy == "solver" else None
    gm = apply_checkpoint(checkpoint_policy(copy.deepcopy(gm), policy=policy, budget_bytes=budget))
    # the rewrite leaves new nodes without facts: analyse the rewritten graph again
    return annotate_memory(annotate_flops(annotate_blocks(annotate_shapes(gm))))


def measured_peak(gm: fx.GraphModule, inputs) -> int:
    """MemTracker's peak (bytes) of one steady-state AdamW step of ``gm`` on CPU."""
    return memtracker_step_peak(gm, inputs)


@pytest.mark.parametrize("policy", ["full", "solver"])
def test_peak_matches_memtracker(policy):
    inputs, original = _captured()
    gm = _checkpointed(policy)
    plan = gm.meta[CHECKPOINT_PLAN]
    assert any(r.recompute for r in plan.regions)
    if policy == "solver":
        assert not all(r.recompute for r in plan.regions)
    s = gm.meta[MEMORY_SUMMARY]
    # what stays saved between forward and backward is what the policy predicted
    assert s.activation_bytes + s.input_bytes == plan.saved_bytes_after
    measured = measured_peak(gm, inputs)
    error = (int(s.peak_bytes) - measured) / measured
    print(f"{policy}: predicted peak {s.peak_bytes} bytes ({s.peak_phase} at {s.peak_node}), "
          f"MemTracker {measured} bytes, error {error:+.3%}")
    assert abs(error) <= PEAK_TOLERANCE
    # checkpointing must lower the peak the unchecked graph predicts, or the test proves nothing
    unchecked = annotate_memory(copy.deepcopy(original)).meta[MEMORY_SUMMARY]
    assert int(s.peak_bytes) < int(unchecked.peak_bytes)


@pytest.mark.parametrize("policy", ["full", "solver"])
def test_flops_add_one_recomputed_forward(policy):
    _, original = _captured()
    gm = _checkpointed(policy)
    plan = gm.meta[CHECKPOINT_PLAN]
    before, after = original.meta[FLOP_SUMMARY], gm.meta[FLOP_SUMMARY]
    assert after.fwd == before.fwd
    assert sympy.expand(after.bwd - before.bwd - plan.recompute_flops) == 0
    assert plan.recompute_flops != 0
    calls = [n for n in gm.graph.nodes if n.target is torch.utils.checkpoint.checkpoint]
    assert len(calls) == sum(r.recompute for r in plan.regions)
    for call, region in zip(calls, [r for r in plan.regions if r.recompute]):
        meta = call.meta[FLOPS]
        assert meta.kind == "checkpoint"
        assert meta.fwd == region.recompute_flops
        assert sympy.expand(meta.bwd - 3 * meta.fwd) == 0  # block backward = 2x forward, + recompute


def test_symbolic_checkpointed_flops():
    """Symbolic dims: the checkpoint node's FLOPs stay polynomials in batch and seq."""
    spec = build_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16")
    gm = annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec, symbolic=("batch", "seq")))))
    before = gm.meta[FLOP_SUMMARY]
    gm = annotate_flops(annotate_blocks(annotate_shapes(apply_checkpoint(checkpoint_policy(gm, policy="full")))))
    after, plan = gm.meta[FLOP_SUMMARY], gm.meta[CHECKPOINT_PLAN]
    assert after.fwd == before.fwd
    assert sympy.expand(after.bwd - before.bwd - plan.recompute_flops) == 0
    assert plan.recompute_flops.free_symbols == {dim_symbol("batch"), dim_symbol("seq")}
