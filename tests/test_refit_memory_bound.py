"""The refit fits the rate of the graph's memory-bound nodes (``Device.memory_bound_bytes_per_s``)
within ``refit.MEMORY_BOUND_BOUNDS`` of the measured memcpy rate, with the peak anchored to the
matmul microbenchmark.

Synthetic reference runs of 2 CPU ranks, made by the planner on a known cluster: the measured
peak is the truth, per-op overhead 15 us, and the elementwise, norm and softmax nodes stream at a
quarter of the memcpy rate (what one thread's GELU, layer norm and softmax reach on this machine
against a multi-threaded DRAM copy), which makes them most of each stage's compute; 5% noise per
rank."""
from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest

from partitioner.calibration.reference_runs import REFERENCE_MODEL, reference_plans
from partitioner.calibration.refit import MEMORY_BOUND_BOUNDS, RunData, memory_bound_scale_bounds, refit
from partitioner.cost.cluster import Cluster, PeakFlops
from partitioner.cost.cost_model import memory_bound_rate
from partitioner.search.profile import profile_model
from partitioner.search.replay import predict_step_time

MATMUL_FLOPS = 160e9  # what the microbenchmark measured (fp32, one thread per rank)
MEMCPY = 1e9  # the memcpy's read+write rate: low, so that the memory-bound nodes dominate
OVERHEAD_S = 15e-6
NOISE = 0.05


@pytest.fixture(scope="module")
def measured_cluster() -> Cluster:
    """What the microbenchmarks give the refit: the measured peak and memcpy, no overheads yet."""
    c = Cluster.preset("local-cpu")
    return dataclasses.replace(c, devices_per_node=2, compute_slots_per_node=2, device=dataclasses.replace(
        c.device, peak_flops=PeakFlops(fp32=MATMUL_FLOPS, bf16=MATMUL_FLOPS), memory_bandwidth_bytes_per_s=MEMCPY))


@pytest.fixture(scope="module")
def profile():
    return profile_model(REFERENCE_MODEL, dtype="fp32")


def _truth(base: Cluster, scale: float) -> Cluster:
    return dataclasses.replace(base, device=dataclasses.replace(
        base.device, kernel_overhead_s=OVERHEAD_S, memory_bound_bytes_per_s=scale * MEMCPY))


def _runs(profile, truth: Cluster, seed: int = 0) -> list[RunData]:
    """The reference plans for 2 ranks as measured on ``truth``: each rank's compute per
    micro-batch the planner's stage time times log-normal noise, the rest of the step as planned."""
    rng = random.Random(seed)
    runs = []
    for p in reference_plans(2):
        plan = predict_step_time(profile, truth, p.knobs(), global_batch=p.global_batch)
        t, ranks = plan.predicted.terms, plan.world_size
        per_stage = ranks // plan.pp
        compute = tuple(plan.stages[r // per_stage].time_s * math.exp(rng.gauss(0, NOISE)) for r in range(ranks))
        runs.append(RunData(plan=plan, compute_per_mb_s=compute, optimizer_s=(t["optimizer"],) * ranks,
                            step_s=(t["total"],) * ranks,
                            p2p_s=(t["pp_comm"] + t["bubble"],) * ranks if plan.pp > 1 else (0.0,) * ranks,
                            other_s=(t["framework"],) * ranks, collective_s=(t["dp_comm"] + t["tied_comm"],) * ranks))
    return runs


def _memory_bound_share(profile, truth: Cluster) -> float:
    """Share of the data-parallel plan's stage time that its memory-bound nodes take on ``truth``."""
    p = reference_plans(2)[0]
    at = predict_step_time(profile, truth, p.knobs(), global_batch=p.global_batch).stages[0].time_s
    fast = dataclasses.replace(truth, device=dataclasses.replace(truth.device, memory_bound_bytes_per_s=1e18))
    return 1 - predict_step_time(profile, fast, p.knobs(), global_batch=p.global_batch).stages[0].time_s / at


@pytest.mark.parametrize("seed", [0, 1])
def test_the_refit_recovers_the_memory_bound_rate(profile, measured_cluster, seed):
    truth = _truth(measured_cluster, 0.25)
    assert _memory_bound_share(profile, truth) > 0.5  # the memory-bound nodes dominate the compute
    runs = _runs(profile, truth, seed)
    result = refit(runs, measured_cluster, matmul_flops_per_s=MATMUL_FLOPS)
    dev = result.cluster.device
    assert result.memory_bound_scale == pytest.approx(0.25, rel=0.15)
    assert memory_bound_rate(dev) == pytest.approx(result.memory_bound_scale * MEMCPY)
    assert dev.memory_bandwidth_bytes_per_s == MEMCPY  # the measurement itself is kept
    assert 0.8 * MATMUL_FLOPS < dev.peak_flops.fp32 < 1.25 * MATMUL_FLOPS
    assert 0.5 * OVERHEAD_S < result.kernel_overhead_s < 1.5 * OVERHEAD_S
    assert result.step_log_error < 0.03
    # the fitted rate is written to the cluster file
    assert Cluster.from_dict(result.cluster.to_dict()).device.memory_bound_bytes_per_s == dev.memory_bound_bytes_per_s


def test_the_memory_bound_rate_stays_within_its_bounds(profile, measured_cluster):
    # the runs' elementwise nodes 40x slower than the memcpy: the rate stops at the bound (1/16)
    runs = _runs(profile, _truth(measured_cluster, 1 / 40))
    result = refit(runs, measured_cluster, matmul_flops_per_s=MATMUL_FLOPS)
    assert result.memory_bound_scale == pytest.approx(MEMORY_BOUND_BOUNDS[0], rel=1e-6)
    # the bounds are of the measured memcpy, not of a rate a refit already moved
    refitted = _truth(measured_cluster, 0.25)
    lo, hi = memory_bound_scale_bounds(refitted)
    assert (lo, hi) == pytest.approx((MEMORY_BOUND_BOUNDS[0] / 0.25, MEMORY_BOUND_BOUNDS[1] / 0.25))
    assert memory_bound_scale_bounds(measured_cluster) == pytest.approx(MEMORY_BOUND_BOUNDS)


def test_presets_keep_the_memory_bandwidth_for_their_memory_bound_nodes():
    for name in Cluster.presets():
        dev = Cluster.preset(name).device
        assert dev.memory_bound_bytes_per_s == 0.0 and dev.efficiency is None
        assert memory_bound_rate(dev) == dev.memory_bandwidth_bytes_per_s
