"""Regions (cut points, blocks, attention cores) and the checkpoint policies' plans."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from partitioner.errors import ConfigError, PassError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_memory import annotate_memory
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_spec
from passes.policies.checkpoint_policy import (attention_regions, block_of, block_regions, checkpoint_policy, cut_points,
                                               segments)
from passes.ir.meta import CHECKPOINT, CHECKPOINT_PLAN, FLOPS, MEMORY_SUMMARY, CheckpointMeta

L, B, S, H, V = 3, 2, 16, 64, 128
SPEC = f"gpt:layers={L},hidden={H},heads=4,vocab={V},seq={S},batch={B}"


@pytest.fixture(scope="module")
def gpt() -> fx.GraphModule:
    gm = capture_spec(build_model(SPEC, device="meta"))
    return annotate_memory(annotate_flops(annotate_blocks(annotate_shapes(gm))))


def _names(nodes):
    return [n.name for n in nodes]


# ---------------------------------------------------------------------------------------------
# Hand-built graphs.

class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        a = torch.relu(self.fc1(x))
        c = torch.relu(self.fc2(a))
        d = c + a  # skip: `a` stays live across fc2 and relu_1
        return self.fc3(d)


def test_chain_mlp_cuts_after_every_node():
    gm = fx.symbolic_trace(_Chain())
    assert _names(cut_points(gm)) == ["fc1", "relu", "fc2", "relu_1"]  # never after the last node
    assert [_names(s) for s in segments(gm)] == [["fc1"], ["relu"], ["fc2"], ["relu_1"], ["fc3"]]
    assert [r.name for r in block_regions(gm)] == [f"segment.{k}" for k in range(5)]


def test_skip_connection_has_no_cut_inside():
    gm = fx.symbolic_trace(_Skip())
    assert _names(cut_points(gm)) == ["fc1", "relu", "add"]
    segs = [_names(s) for s in segments(gm)]
    assert segs == [["fc1"], ["relu"], ["fc2", "relu_1", "add"], ["fc3"]]
    inputs, outputs = block_regions(gm)[2].io()
    assert _names(inputs) == ["relu"] and _names(outputs) == ["add"]  # single entry, single exit


# ---------------------------------------------------------------------------------------------
# The zoo GPT.

def test_gpt_blocks_are_regions(gpt):
    regions = block_regions(gpt)
    assert [r.name for r in regions] == [f"blocks.{i}" for i in range(L)]
    order = {n: i for i, n in enumerate(gpt.graph.nodes)}
    for r in regions:
        idx = [order[n] for n in r.nodes]
        assert idx == list(range(idx[0], idx[0] + len(idx)))  # contiguous
        assert {block_of(n) for n in r.nodes} == {r.name}
        inputs, outputs = r.io()
        assert len(inputs) == 1 and len(outputs) == 1
    # block i's output is block i+1's input: the residual stream
    assert [r.io()[0][0] for r in regions[1:]] == [r.io()[1][0] for r in regions[:-1]]
    assert len({len(r.nodes) for r in regions}) == 1


def test_attention_core_excludes_projections(gpt):
    regions = attention_regions(gpt)
    assert [r.name for r in regions] == [f"blocks.{i}.attn (attention core)" for i in range(L)]
    for r in regions:
        targets = [n.target for n in r.nodes]
        assert targets.count(torch.ops.aten.scaled_dot_product_attention.default) == 1
        assert torch.ops.aten.linear.default not in targets
        inputs, outputs = r.io()
        assert [n.target for n in inputs] == [torch.ops.aten.linear.default]  # the fused qkv projection
        assert all(u.target is torch.ops.aten.linear.default for u in outputs[0].users)  # out projection


def test_full_plan_flops_and_bytes(gpt):
    gm = checkpoint_policy(copy.deepcopy(gpt), policy="full")
    plan = gm.meta[CHECKPOINT_PLAN]
    # Per block forward: 24*B*s*h^2 (linears) + 4*B*s^2*h (attention), Narayanan et al. 2021
    per_block = 24 * B * S * H**2 + 4 * B * S**2 * H
    assert [r.recompute_flops for r in plan.regions] == [per_block] * L
    assert plan.recompute_flops == L * per_block
    summary = gpt.meta[MEMORY_SUMMARY]
    assert plan.saved_bytes_before == summary.activation_bytes + summary.input_bytes
    assert plan.saved_bytes_after < plan.saved_bytes_before / 5
    assert all(r.recompute and r.bytes_saved > 0 for r in plan.regions)
    print(f"full: saved {plan.saved_bytes_before} -> {plan.saved_bytes_after} bytes, "
          f"+{plan.recompute_flops} recompute FLOPs")
    for node in gm.graph.nodes:
        meta = node.meta[CHECKPOINT]
        assert isinstance(meta, CheckpointMeta) and meta.policy == "full"
        in_region = block_of(node) is not None and node.op == "call_function"
        assert (meta.region is not None) == in_region and meta.recompute == in_region


def test_none_and_selective(gpt):
    none = checkpoint_policy(copy.deepcopy(gpt), policy="none").meta[CHECKPOINT_PLAN]
    assert none.saved_bytes_after == none.saved_bytes_before and none.recompute_flops == 0
    assert len(none.regions) == L and not any(r.recompute for r in none.regions)
    sel = checkpoint_policy(copy.deepcopy(gpt), policy="selective").meta[CHECKPOINT_PLAN]
    # Recompute is only attention: 4*B*s^2*h per block
    assert sel.recompute_flops == L * 4 * B * S**2 * H
    assert sel.saved_bytes_after < sel.saved_bytes_before
    print(f"selective: saved {sel.saved_bytes_before} -> {sel.saved_bytes_after} bytes")


def test_solver_meets_budget_with_fewest_blocks(gpt):
    full = checkpoint_policy(copy.deepcopy(gpt), policy="full").meta[CHECKPOINT_PLAN]
    per_block = full.regions[0].bytes_saved
    for k in range(L + 1):
        budget = int(full.saved_bytes_before - k * per_block)  # exactly k blocks' worth
        plan = checkpoint_policy(copy.deepcopy(gpt), policy="solver", budget_bytes=budget).meta[CHECKPOINT_PLAN]
        assert sum(r.recompute for r in plan.regions) == k
        assert plan.saved_bytes_after <= budget and plan.budget_bytes == budget
        assert plan.recompute_flops == k * full.regions[0].recompute_flops
    with pytest.raises(PassError, match="raise budget_bytes"):
        checkpoint_policy(copy.deepcopy(gpt), policy="solver", budget_bytes=int(full.saved_bytes_after) - 1)


def test_errors(gpt):
    with pytest.raises(ConfigError, match="choose one of"):
        checkpoint_policy(copy.deepcopy(gpt), policy="sqrt")
    with pytest.raises(ConfigError, match="budget_bytes"):
        checkpoint_policy(copy.deepcopy(gpt), policy="solver")
    gm = copy.deepcopy(gpt)
    for n in gm.graph.nodes:
        n.meta.pop(FLOPS, None)
    with pytest.raises(PassError, match="annotate_flops"):
        checkpoint_policy(gm, policy="full")


def test_symbolic_dims():
    gm = capture_spec(build_model("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8", device="meta"),
                      symbolic=("batch", "seq"))
    annotate_flops(annotate_blocks(annotate_shapes(gm)))
    plan = checkpoint_policy(gm, policy="full").meta[CHECKPOINT_PLAN]
    assert [r.name for r in plan.regions] == ["blocks.0", "blocks.1"]  # sizes do not block cut points
    batch, seq = (s for s in sorted(plan.saved_bytes_after.free_symbols, key=str))
    assert {str(batch), str(seq)} == {"batch", "seq"}
    assert plan.recompute_flops.free_symbols == {batch, seq}


def test_a_copy_of_an_observed_graph_reuses_its_run_and_decides_alike(gpt, monkeypatch):
    """The saved-tensor observation is remembered by graph (every plan tags a deep copy of one
    analysed graph): the copy's decision is the one a fresh observation gives, on its own
    nodes; a graph with other parameter shapes is observed again."""
    from passes.policies import checkpoint_policy as policy

    runs = []
    observe = policy._observe_saved
    monkeypatch.setattr(policy, "_observe_saved", lambda g: runs.append(g) or observe(g))
    monkeypatch.setattr(policy, "_OBSERVED", type(policy._OBSERVED)())
    first = checkpoint_policy(copy.deepcopy(gpt), policy="dag")
    second = checkpoint_policy(copy.deepcopy(gpt), policy="dag")
    assert len(runs) == 1
    assert second.meta[CHECKPOINT_PLAN] == first.meta[CHECKPOINT_PLAN]
    assert set(policy._saved_model(second).storages) <= set(second.graph.nodes)

    wider = build_model(SPEC.replace(f"hidden={H}", f"hidden={2 * H}"), device="meta")
    other = annotate_memory(annotate_flops(annotate_blocks(annotate_shapes(capture_spec(wider)))))
    runs.clear()
    checkpoint_policy(other, policy="full")
    assert len(runs) == 1
