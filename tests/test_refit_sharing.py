"""The refit on ranks that share a node's cores (``Cluster.compute_slots_per_node``): measured
compute of ranks computing together is slower than one rank alone, and the planner prices that
in its own ``contention`` term, so the refit fits the rate of one rank alone.

The runs are made by the planner itself on a known cluster (per-op overhead 20 us, 2 compute
slots for 4 ranks): each rank's compute and optimizer seconds stretched by what sharing costs
that plan (all-rank data parallelism 2x, a pipeline whose ranks mostly wait nothing), its step
the planner's step. A refit from a cluster with the overhead unknown recovers it and predicts
every run's step; the same refit blind to the sharing does not."""
from __future__ import annotations

import dataclasses
import math

import pytest

from partitioner.cost.cluster import Cluster
from partitioner.search.replay import predict_step_time
from partitioner.search.profile import profile_model
from partitioner.calibration.reference_runs import REFERENCE_MODEL
from partitioner.calibration.refit import RunData, refit, sharing_slowdown

OVERHEAD_S = 20e-6
PLANS = (  # (knobs, global batch): data parallel at two sizes, pipelines, both together
    (dict(dp=4, micro_batch_size=4, num_micro_batches=1), 16),
    (dict(dp=4, micro_batch_size=16, num_micro_batches=1), 64),
    (dict(dp=2, pp=2, micro_batch_size=2, num_micro_batches=4), 16),
    (dict(pp=4, micro_batch_size=8, num_micro_batches=2), 16),
    (dict(dp=2, pp=2, micro_batch_size=8, num_micro_batches=1, schedule="gpipe"), 16),
)


def _knobs(**kw) -> dict:
    return {**dict(dp=1, tp=1, pp=1, virtual_pp=1, schedule="1f1b", zero_stage=0, sequence_parallel=False,
                   checkpointing="none", offload="none"), **kw}


@pytest.fixture(scope="module")
def truth() -> Cluster:
    c = Cluster.preset("local-cpu")
    return dataclasses.replace(c, devices_per_node=4, compute_slots_per_node=2,
                               device=dataclasses.replace(c.device, kernel_overhead_s=OVERHEAD_S))


def _measured(profile, cluster: Cluster, knobs: dict, gb: int) -> RunData:
    """What 4 ranks sharing 2 slots would measure if the planner were exact."""
    plan = predict_step_time(profile, cluster, _knobs(**knobs), global_batch=gb)
    t = plan.predicted.terms
    waited = t["dp_comm"] + t["tied_comm"] + t["framework"]
    span = t["total"] - t["contention"] - waited  # what the ranks spread their compute over, alone
    stretch = (span + t["contention"]) / span
    ranks = plan.world_size
    per_stage = ranks // plan.pp
    return RunData(plan=plan,
                   compute_per_mb_s=tuple(plan.stages[r // per_stage].time_s * stretch for r in range(ranks)),
                   optimizer_s=(t["optimizer"] * stretch,) * ranks, step_s=(t["total"],) * ranks,
                   p2p_s=((t["pp_comm"] + t["bubble"]),) * ranks if plan.pp > 1 else (0.0,) * ranks,
                   other_s=(t["framework"],) * ranks, collective_s=(t["dp_comm"] + t["tied_comm"],) * ranks)


def test_sharing_slowdown_is_what_the_planner_stretched(truth):
    profile = profile_model(REFERENCE_MODEL, dtype="fp32")
    runs = [_measured(profile, truth, k, gb) for k, gb in PLANS]
    slow = [sharing_slowdown(r, truth) for r in runs]
    assert slow[0] > 1.8 and slow[1] > 1.8  # data parallel: 4 ranks computing on 2 slots
    assert slow[3] == 1.0  # 4 stages, 2 micro-batches: at most 2 ranks busy at once
    assert sharing_slowdown(runs[0], dataclasses.replace(truth, compute_slots_per_node=None)) == 1.0
    assert sharing_slowdown(runs[0], dataclasses.replace(truth, compute_slots_per_node=4)) == 1.0


def test_the_refit_fits_one_rank_alone_and_predicts_every_shared_run(truth):
    profile = profile_model(REFERENCE_MODEL, dtype="fp32")
    runs = [_measured(profile, truth, k, gb) for k, gb in PLANS]
    start = dataclasses.replace(truth, device=dataclasses.replace(truth.device, kernel_overhead_s=0.0))

    def step_errors(cluster: Cluster) -> list[float]:
        return [abs(math.log(predict_step_time(profile, cluster, _knobs(**k), global_batch=gb).predicted.step_time_s
                             / run.step_s[0])) for (k, gb), run in zip(PLANS, runs)]

    aware = refit(runs, start)
    assert aware.kernel_overhead_s == pytest.approx(OVERHEAD_S, rel=0.05)
    assert aware.flops_scale == pytest.approx(1.0, rel=0.05)
    assert max(step_errors(aware.cluster)) < 0.05
    # blind to the sharing, the refit charges data parallelism's shared cores to every operator
    blind = refit(runs, dataclasses.replace(start, compute_slots_per_node=None))
    assert blind.kernel_overhead_s > 1.2 * OVERHEAD_S or blind.flops_scale < 0.8
    assert max(step_errors(dataclasses.replace(blind.cluster, compute_slots_per_node=None))) > 0.15
