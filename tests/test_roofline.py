"""The per-node roofline: non-matmul nodes (norms, softmax, elementwise, dropout) cost bytes at the
device's memory bandwidth, matmul-class nodes the larger of their compute and memory times."""
import dataclasses

import pytest

from partitioner.compile.analysis import DTYPES, analyze
from partitioner.cost.cluster import Cluster
from partitioner.cost.cost_model import memory_bound_time, roofline_time
from partitioner.inputs.models import build_model
from partitioner.search.plan_cost import PlanContext
from partitioner.search.profile import _moved_bytes, profile_model
from passes.ir.meta import SHAPE

SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16"


@pytest.fixture(scope="module")
def profile():
    return profile_model(SPEC, dtype="bf16")


@pytest.fixture(scope="module")
def graph():
    model = build_model(SPEC, device="meta", dtype=DTYPES["bf16"])
    return analyze(model, batch=1, seq=None, dtype="bf16", optimizer="adamw").graph


def _nodes(gm, name: str):
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_layer_norm_and_softmax_like_nodes_move_their_inputs_and_outputs(graph):
    ln = _nodes(graph, "layer_norm")[0]
    nbytes = 16 * 64 * 2  # one [1, 16, 64] bf16 tensor
    assert _moved_bytes(ln, None) == (2 * nbytes, 2 * 64 * 2)  # x in, y out; weight and bias as parameters
    add = _nodes(graph, "aten.add.Tensor")[-1]  # the residual add: two inputs, one output
    assert _moved_bytes(add, None)[0] == 3 * nbytes
    view = _nodes(graph, "aten.view")[0]  # a view launches no kernel
    assert _moved_bytes(view, None) == (0, 0)
    emb = _nodes(graph, "aten.embedding")[0]  # a gather reads the rows it writes, not the table
    out = sum(int(t.nbytes) for t in emb.meta[SHAPE].tensors)
    assert _moved_bytes(emb, None)[0] == 2 * out + 16 * 8  # rows + output + int64 indices


def test_block_profile_carries_memory_bound_bytes(profile):
    block = profile.blocks[0]
    nbytes = 16 * 64 * 2
    # [.., h] nodes: 2 layer norms (in, out), 2 dropouts (in, out), 2 residual adds (2 in, 1 out)
    assert block.replicated_memory_bound_bytes == 2 * 2 * nbytes + 2 * 2 * nbytes + 2 * 3 * nbytes
    assert block.memory_bound_bytes == 2 * 4 * nbytes  # the GeLU on [1, 16, 4h]: in and out
    assert len(block.kernels) == block.matmuls == 5  # qkv, sdpa, proj, fc, proj
    assert sum(k.fwd_flops for k in block.kernels) == block.fwd_flops
    assert [k.attention for k in block.kernels] == [False, True, False, False, False]
    assert block.score_memory_bound_bytes == 0  # fused attention keeps no [s, s] scores


def test_memory_bound_nodes_cost_bytes_over_bandwidth(profile):
    cluster = Cluster.preset("dgx-a100-80gb")
    ctx = PlanContext(profile, cluster, global_batch=8, optimizer="adamw")
    block = profile.blocks[0]
    free = dataclasses.replace(block, memory_bound_bytes=0, replicated_memory_bound_bytes=0)
    for tp, sp in ((1, False), (2, False), (2, True)):
        b = 4
        with_mem, without = ctx._layer_cost(block, tp, b, sp, "none"), ctx._layer_cost(free, tp, b, sp, "none")
        moved = (block.memory_bound_bytes / tp + block.replicated_memory_bound_bytes / (tp if sp else 1)) * b
        assert moved > 0
        assert with_mem.fwd - without.fwd == pytest.approx(memory_bound_time(moved, cluster.device))
        assert with_mem.bwd - without.bwd == pytest.approx(2 * memory_bound_time(moved, cluster.device))
        # full checkpointing reruns the forward, norms and elementwise ops included
        full = ctx._layer_cost(block, tp, b, sp, "full")
        assert full.recompute - full.tp_comm / 2 == pytest.approx(with_mem.fwd)


def test_a_matmul_is_timed_by_the_larger_of_compute_and_bytes(profile):
    cluster = Cluster.preset("dgx-a100-80gb")
    ctx = PlanContext(profile, cluster, global_batch=8, optimizer="adamw")
    dev = cluster.device
    # a skinny matmul (one token through a 1 GB weight): memory bound
    assert ctx._kernel_time(2e9, 1e5, 1e9) == memory_bound_time(1e9 + 1e5, dev)
    # a large square one: compute bound, at the efficiency curve's rate
    big = ctx._kernel_time(1e13, 1e8, 1e8)
    assert big == roofline_time(1e13, 2e8, dev, "bf16", overhead=False) > memory_bound_time(2e8, dev)
    # the block's kernels on the roofline sum to its matmul time
    block = profile.blocks[0]
    fwd, bwd = ctx._matmul_times(block, 1, 2)
    assert fwd == pytest.approx(sum(ctx._kernel_time(k.fwd_flops * 2, k.bytes * 2, k.weight_bytes)
                                    for k in block.kernels))
    assert bwd == pytest.approx(sum(2 * ctx._kernel_time(k.bwd_flops, k.bytes * 2, k.weight_bytes)
                                    for k in block.kernels))
