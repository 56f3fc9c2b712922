"""Per-collective α-β fits: measured by the job's own ranks on its real groups (intra-node, and
across nodes when the job spans several), written to the cluster file, priced by the cost model
from one place (``Link.for_collective``); a link without them prices as before.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.calibration.calibrate import JOB_RECIPE, TINY_RECIPE, job_comm_groups, job_measurements
from partitioner.calibration.detect import JobShape
from partitioner.calibration.cache import local_cache_file
from partitioner.calibration.measure import (
    _time_per_call, device_synchronizer, fit_alpha_beta, gloo_measurement, measure_matmul, QUICK,
)
from partitioner.cost.cluster import Cluster, CollectiveFit, Link
from partitioner.cost.cost_model import (
    all_gather_time, all_reduce_time, all_to_all_time, group_link, reduce_scatter_time,
)
from passes.ir.errors import ClusterSpecError, ConfigError
from passes.ir.launcher_env import is_launcher_var
from runtime.dist.launch import spawn

RING = {"all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time, "all_to_all": all_to_all_time}
SIZES = (4096, 65536, 2**20, 2**24)


# ---- the fits, on synthetic samples -------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(RING))
@pytest.mark.parametrize("n", [2, 4])
def test_fit_alpha_beta_recovers_a_known_collective(op, n):
    link = Link(kind="loopback", bandwidth_bytes_per_s=1.5e9, latency_s=40e-6)
    times = [RING[op](b, n, link) for b in SIZES]
    fit = fit_alpha_beta(list(zip(SIZES, times)), op, n)
    assert (fit.op, fit.world_size) == (op, n)
    assert fit.latency_s == pytest.approx(40e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1.5e9, rel=1e-6)
    assert fit.predict_seconds(SIZES[-1]) == pytest.approx(times[-1], rel=1e-9)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        fit_alpha_beta(list(zip(SIZES, times)), op, 1)


def test_a_group_measurement_becomes_a_link_with_its_collective_fits():
    """The slowest rank's time per size; the all-reduce is the link's own α-β, the others its fits."""
    fast, slow = Link(kind="loopback", bandwidth_bytes_per_s=2e9, latency_s=20e-6), \
        Link(kind="loopback", bandwidth_bytes_per_s=5e8, latency_s=80e-6)

    def rank(link: Link, first: bool) -> dict:
        out = {"all_reduce": [(b, all_reduce_time(b, 2, link)) for b in SIZES]}
        out |= {op: [(b, f(b, 2, link)) for b in SIZES] for op, f in RING.items()}
        out["send_recv"] = [(b, 20e-6 + b / 2e9) for b in SIZES] if first else []
        return out

    m = gloo_measurement([rank(fast, True), rank(slow, False)])
    link = m.link("loopback")
    assert link.bandwidth_bytes_per_s == pytest.approx(5e8) and link.latency_s == pytest.approx(80e-6)
    assert [f.op for f in link.collectives] == ["all_gather", "reduce_scatter", "all_to_all"]
    assert all(f.bandwidth_bytes_per_s == pytest.approx(5e8) for f in link.collectives)
    assert len(m.collectives) == 3 * len(SIZES)


# ---- the cost model reads them from the link ----------------------------------------------------


def _fitted(link: Link) -> Link:
    return replace(link, collectives=(
        CollectiveFit(op="all_gather", bandwidth_bytes_per_s=1e9, latency_s=100e-6),
        CollectiveFit(op="all_to_all", bandwidth_bytes_per_s=4e9, latency_s=10e-6)))


def test_the_cost_model_prices_a_collective_with_its_fit_and_the_rest_as_before():
    base = Link(kind="loopback", bandwidth_bytes_per_s=2e9, latency_s=50e-6)
    link = _fitted(base)
    nbytes, n = 2**22, 4
    assert all_gather_time(nbytes, n, link) == pytest.approx(3 / 4 * nbytes / 1e9 + 3 * 100e-6)
    assert all_to_all_time(nbytes, n, link) == pytest.approx(3 / 4 * nbytes / 4e9 + 3 * 10e-6)
    # no reduce-scatter fit: the link's own α-β, as for a link without fits
    assert reduce_scatter_time(nbytes, n, link) == reduce_scatter_time(nbytes, n, base)
    assert all_reduce_time(nbytes, n, link) == all_reduce_time(nbytes, n, base)
    assert base.for_collective("all_gather") is base
    scaled = link.with_latency_scale(3.0)
    assert scaled.latency_s == pytest.approx(150e-6)
    assert scaled.for_collective("all_gather").latency_s == pytest.approx(300e-6)


def test_clusters_without_fits_price_and_serialise_exactly_as_before():
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2)
    assert "collectives" not in cluster.to_dict()["intra_node"]
    for ranks in ((0, 1, 2, 3), (0, 8), tuple(range(16))):
        link = group_link(cluster, ranks)
        assert link.collectives == ()
        for f in RING.values():
            assert f(2**20, len(ranks), link) == pytest.approx(
                (len(ranks) - 1) / len(ranks) * 2**20 / link.bandwidth_bytes_per_s + (len(ranks) - 1) * link.latency_s)


def test_fits_round_trip_through_a_cluster_file_and_cross_nodes_shared_like_the_link(tmp_path):
    base = Cluster.preset("dgx-a100-80gb", nodes=2)
    cluster = replace(base, intra_node=_fitted(base.intra_node), inter_node=_fitted(base.inter_node))
    again = Cluster.from_file(cluster.to_file(tmp_path / "c.yaml"))
    assert again == cluster
    across = group_link(cluster, (0, 8))  # one GPU per node: 1/8 of the node's NICs, as the link
    plain = group_link(base, (0, 8))
    ag = across.for_collective("all_gather")
    assert ag.bandwidth_bytes_per_s == pytest.approx(cluster.inter_node.count * 1e9 / 8)
    assert ag.latency_s == pytest.approx(100e-6)
    rs = across.for_collective("reduce_scatter")  # no fit: the shared link's own α-β, as without fits
    assert (rs.bandwidth_bytes_per_s, rs.latency_s) == (plain.bandwidth_bytes_per_s, plain.latency_s)
    with pytest.raises(ClusterSpecError, match="unknown collective 'broadcast'"):
        Link.from_dict({"kind": "pcie", "bandwidth_bytes_per_s": 1e9, "latency_s": 0,
                        "collectives": {"broadcast": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0}}})


# ---- which groups a job times -------------------------------------------------------------------


def test_a_job_of_two_nodes_times_node_zero_inside_and_one_rank_per_node_across():
    groups = job_comm_groups(JobShape(world_size=8, local_world_size=4, nodes=2))
    assert (groups.intra, groups.inter) == ((0, 1, 2, 3), (0, 4))
    one = job_comm_groups(JobShape(world_size=4, local_world_size=4, nodes=1))
    assert (one.intra, one.inter) == ((0, 1, 2, 3), ())
    solo = job_comm_groups(JobShape(world_size=3, local_world_size=1, nodes=3))
    assert (solo.intra, solo.inter) == ((), (0, 1, 2))

    def timed(latency: float, first: bool) -> dict:
        ops = ("all_reduce", *RING)
        out = {op: [(b, latency + b / 1e9) for b in SIZES] for op in ops}
        return out | {"send_recv": [(b, latency + b / 1e9) for b in SIZES] if first else []}

    # ranks 0, 1 time the node (fast); ranks 0 and 2 time the cross-node group (slow)
    per_rank = [{"intra": timed(1e-5, True), "inter": timed(1e-3, True)}, {"intra": timed(1e-5, False), "inter": None},
                {"intra": None, "inter": timed(1e-3, False)}, {"intra": None, "inter": None}]
    intra, inter = job_measurements(job_comm_groups(JobShape(world_size=4, local_world_size=2, nodes=2)), per_rank)
    assert intra.all_reduce_fit.latency_s < 1e-4 < inter.all_reduce_fit.latency_s


def test_two_nodes_are_cached_apart_from_one():
    assert local_cache_file(4, 2) != local_cache_file(4)
    assert local_cache_file(4, 2).name.startswith("local-w4-n2-") and local_cache_file(4).name.startswith("local-w4-t")


# ---- devices ------------------------------------------------------------------------------------


def test_timing_synchronises_the_device_around_every_sample():
    events = []
    _time_per_call(lambda: events.append("op"), QUICK, lambda: events.append("sync"))
    timed = "".join("s" if e == "sync" else "o" for e in events)
    assert timed.startswith("osos") and timed.endswith("s") and "oo" in timed  # warm-up, first, then loops
    assert timed.count("s") == 2 + 2 * QUICK.repeats
    assert measure_matmul(("fp32",), (16,), effort=QUICK, device="cpu")[0].seconds > 0
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            device_synchronizer("cuda")


# ---- inside a job: 4 gloo ranks as two nodes of two ---------------------------------------------


def _two_node_rank(path: str) -> dict:
    """One rank of a 4-rank job that torchrun would describe as 2 nodes of 2 (LOCAL_WORLD_SIZE=2)."""
    from partitioner.calibration.calibrate import calibrate_in_job
    from runtime.dist.mesh import init_distributed

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    init_distributed(timeout_s=60)
    recipe = replace(JOB_RECIPE, effort=TINY_RECIPE.effort, matmul_sizes=(32, 64), memcpy_bytes=2**20,
                     reference_steps=0)
    return calibrate_in_job(Path(path), recipe).cluster.to_dict()


def test_a_job_of_two_fake_nodes_times_its_collectives_and_puts_the_cross_node_fit_in_inter_node(tmp_path):
    path = tmp_path / "cal.yaml"
    cluster, *others = spawn(_two_node_rank, 4, str(path), timeout_s=120)
    assert all(o == cluster for o in others)  # every rank plans with rank 0's numbers
    written = Cluster.from_file(path)
    assert written.to_dict() == cluster
    data = json.loads(path.with_name(path.name + ".calibration.json").read_text())
    assert data["nodes"] == 2
    # inside a node: node 0's two ranks; the all-reduce is the link's, the others its fits
    assert data["all_reduce_fit"]["world_size"] == 2 and data["all_reduce"][0]["world_size"] == 2
    assert set(data["collective_fits"]) == {"all_gather", "reduce_scatter", "all_to_all"}
    assert {s["op"] for s in data["collectives"]} == {"all_gather", "reduce_scatter", "all_to_all"}
    intra, inter = written.intra_node, written.inter_node
    assert intra.latency_s == pytest.approx(data["all_reduce_fit"]["latency_s"])
    for fit in intra.collectives:
        assert fit.bandwidth_bytes_per_s == pytest.approx(data["collective_fits"][fit.op]["bandwidth_bytes_per_s"])
    # across nodes: the group of ranks 0 and 2, fitted separately, in the inter-node link
    across = data["inter_node"]
    assert across["all_reduce_fit"]["world_size"] == 2 and across["send_recv"]
    assert inter.kind == "ethernet"
    assert inter.latency_s == pytest.approx(across["all_reduce_fit"]["latency_s"])
    assert inter.bandwidth_bytes_per_s == pytest.approx(across["all_reduce_fit"]["bandwidth_bytes_per_s"])
    assert {f.op: f.latency_s for f in inter.collectives} == pytest.approx(
        {op: f["latency_s"] for op, f in across["collective_fits"].items()})


def test_the_gpu_calibration_script_runs_its_path_on_the_cpu():
    """scripts/gpu_calibrate.py (run by scripts/device_check.sh on a GPU) with --device cpu: the
    same measurements, fits and collective calls, on gloo."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not is_launcher_var(k)} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "scripts/gpu_calibrate.py", "--device", "cpu", "--sizes", "32,64"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("matmul fp32: best", "matmul bf16: best", "memcpy:", "all_to_all", "gpu_calibrate: done"):
        assert line in done.stdout, done.stdout
