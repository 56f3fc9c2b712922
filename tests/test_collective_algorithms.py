"""All-reduce picks NCCL's ring or tree by message size, group size and link."""
import math

import pytest

from partitioner.cost.cluster import Cluster, Link
from partitioner.cost.cost_model import (
    TREE_BANDWIDTH_FACTOR,
    all_reduce_algorithm,
    all_reduce_time,
    group_link,
    ring_all_reduce_time,
    tree_all_reduce_time,
    tree_ring_switch_bytes,
)

IB = Link(kind="infiniband", bandwidth_bytes_per_s=25e9, latency_s=5e-6)
NVLINK = Link(kind="nvswitch", bandwidth_bytes_per_s=300e9, latency_s=3e-6)


@pytest.mark.parametrize("n", [4, 8, 64, 1024])
def test_tree_below_the_switch_point_ring_above(n):
    switch = tree_ring_switch_bytes(n, IB)
    assert switch > 0
    assert tree_all_reduce_time(switch, n, IB) == pytest.approx(ring_all_reduce_time(switch, n, IB))
    assert all_reduce_algorithm(switch / 2, n, IB) == "tree"
    assert all_reduce_algorithm(switch * 2, n, IB) == "ring"
    assert all_reduce_time(switch / 2, n, IB) == tree_all_reduce_time(switch / 2, n, IB)
    assert all_reduce_time(switch * 2, n, IB) == ring_all_reduce_time(switch * 2, n, IB)


def test_switch_point_formula_and_growth_with_world_size():
    n = 64
    latency = 2 * 5e-6 * ((n - 1) - math.log2(n))
    per_byte = (2 / TREE_BANDWIDTH_FACTOR - 2 * (n - 1) / n) / 25e9
    assert tree_ring_switch_bytes(n, IB) == pytest.approx(latency / per_byte)
    # the ring's latency grows as n, the tree's as log n: the tree wins larger messages on more ranks
    points = [tree_ring_switch_bytes(n, IB) for n in (4, 16, 64, 256)]
    assert points == sorted(points)


def test_latency_terms():
    assert tree_all_reduce_time(0, 64, IB) == pytest.approx(2 * 6 * 5e-6)
    assert ring_all_reduce_time(0, 64, IB) == pytest.approx(2 * 63 * 5e-6)
    assert tree_all_reduce_time(1e9, 1, IB) == 0.0 == all_reduce_time(1e9, 1, IB)


def test_ring_inside_a_node_and_for_two_ranks():
    # inside a node NCCL's tree is a chain: the ring, whatever the size
    assert all_reduce_algorithm(8, 8, NVLINK) == "ring" and tree_ring_switch_bytes(8, NVLINK) == 0.0
    assert all_reduce_time(8, 8, NVLINK) == ring_all_reduce_time(8, 8, NVLINK)
    # two ranks: same latency, the ring moves half the bytes
    assert all_reduce_algorithm(8, 2, IB) == "ring" and tree_ring_switch_bytes(2, IB) == 0.0


def test_groups_across_nodes_use_the_tree_for_small_messages():
    cluster = Cluster.preset("dgx-a100-80gb", nodes=16)
    dp = group_link(cluster, size=16, stride=8)  # one GPU per node
    tp = group_link(cluster, size=8)
    assert dp.kind == "infiniband" and tp.kind == "nvswitch"
    assert all_reduce_algorithm(4, 16, dp) == "tree"      # a loss scalar
    assert all_reduce_algorithm(2**30, 16, dp) == "ring"  # a stage's gradients
    assert all_reduce_algorithm(4, 8, tp) == "ring"
