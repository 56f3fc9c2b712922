"""How the planner prices the collectives at a step's end (partitioner/search/plan_cost.py).

* One collective per gradient bucket: the planner's count (``plan_cost.gradient_buckets``) is
  the number of data-parallel reductions and ZeRO all-gathers the runtime issues, as the
  pre-launch check derives them from the lowered rank programs (tied copies and sequence-parallel
  norms in late buckets of their own, large stages in several).
* ``Cluster.sync_latency_scale`` prices those collectives, the tied-weight sync and the loss
  all-reduce, and nothing else: the tensor-parallel collectives keep the link's α.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import pytest

from partitioner.compile.build import capture_for_pipeline, lower_plan
from partitioner.cost.cluster import Cluster
from partitioner.inputs.models import build_model
from partitioner.search.plan_cost import PlanContext, evaluate, gradient_buckets, step_end_calls
from partitioner.search.profile import profile_model
from passes.checks.communication_check import rank_calls
from passes.ir.config import ParallelConfig

WIDE_GPT = "gpt:layers=2,hidden=256,heads=2,vocab=512,seq=8,dropout=0.0"  # a block is 3 MiB: two buckets
GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
LLAMA = "llama:layers=2,hidden=32,heads=2,kv_heads=1,vocab=64,seq=8"
GLOBAL_BATCH = 8


@functools.cache
def _profile(spec: str):
    return profile_model(spec, dtype="fp32")


def _cluster(world: int, **fields) -> Cluster:
    return dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=world, **fields)


def _config(**knobs) -> ParallelConfig:
    return ParallelConfig.for_global_batch(GLOBAL_BATCH, **{"schedule": "1f1b", "num_micro_batches": 2, **knobs})


@pytest.mark.parametrize("spec, knobs, buckets", [
    (WIDE_GPT, dict(dp=2, pp=2, zero_stage=1), 3),  # 1 MiB first, the rest, the tied copy
    (LLAMA, dict(dp=2, pp=2, zero_stage=1), 1),  # untied: one bucket per stage
    (GPT, dict(dp=2, tp=2, sequence_parallel=True, zero_stage=1), 2),  # the norms' partial gradients
    (WIDE_GPT, dict(dp=4, zero_stage=0), 2),  # one stage: the tied weight is one parameter
])
def test_planner_counts_the_gradient_buckets_the_runtime_issues(spec, knobs, buckets):
    config = _config(**knobs)
    cluster = _cluster(config.world_size)
    lowering = lower_plan(capture_for_pipeline(build_model(spec)), config, cluster=cluster, check=False)
    ctx = PlanContext(_profile(spec), cluster, GLOBAL_BATCH, "adamw")
    stages = evaluate(ctx, config, limit=None).stages
    reduce = "reduce_scatter(sum)" if config.zero_stage else "all_reduce(sum)"
    for rank in range(config.world_size):
        calls = collections.Counter(c.op for c in rank_calls(lowering.rank_program(rank)).calls
                                    if c.channel == "dp" and not c.is_p2p)
        stage = stages[rank // (config.dp_cp * config.tp)]
        counted = gradient_buckets(ctx, config, stage.layers, stage.param_bytes)
        assert counted == calls[reduce] == buckets, (rank, calls)
        assert calls["all_gather"] == (counted if config.zero_stage else 0)


def _terms(spec: str, cluster: Cluster, **knobs) -> dict[str, float]:
    config = _config(**knobs)
    return dataclasses.asdict(evaluate(PlanContext(_profile(spec), cluster, GLOBAL_BATCH, "adamw"), config,
                                       limit=None).terms)


def test_sync_latency_prices_the_step_end_collectives_only():
    """Raising the step-end α by 1 s (``sync_latency_scale``) adds, per collective, its hops: a 2-rank reduce-scatter
    or all-gather 1, a 2-rank all-reduce 2 (ring), the 4-rank loss all-reduce 2·⌈log2 4⌉ (tree).
    The tensor-parallel collectives do not move."""
    world = 4
    base = _cluster(world)
    alpha = base.intra_node.latency_s
    slow = dataclasses.replace(base, sync_latency_scale=(alpha + 1.0) / alpha)
    assert _terms(GPT, dataclasses.replace(base, sync_latency_scale=1.0), dp=2, pp=2, zero_stage=1) == \
        pytest.approx(_terms(GPT, base, dp=2, pp=2, zero_stage=1))  # None: x1
    for spec, buckets, tied in ((GPT, 2, True), (LLAMA, 1, False)):
        a, b = _terms(spec, base, dp=2, pp=2, zero_stage=1), _terms(spec, slow, dp=2, pp=2, zero_stage=1)
        # each bucket: one reduce-scatter and one all-gather over the dp pair, nothing hidden on CPU ranks
        assert b["dp_comm"] - a["dp_comm"] == pytest.approx(2 * buckets)
        assert b.get("tied_comm", 0.0) - a.get("tied_comm", 0.0) == pytest.approx(2.0 if tied else 0.0)
        assert b["framework"] - a["framework"] == pytest.approx(2 * 4.0)  # the grad norm's and the loss's
    a, b = _terms(GPT, base, dp=2, tp=2, zero_stage=0), _terms(GPT, slow, dp=2, tp=2, zero_stage=0)
    assert b["tp_comm"] == pytest.approx(a["tp_comm"]) and a["tp_comm"] > 0
    assert b["dp_comm"] - a["dp_comm"] == pytest.approx(2.0)  # one bucket, a 2-rank all-reduce
    a, b = _terms(GPT, base, dp=4, zero_stage=3), _terms(GPT, slow, dp=4, zero_stage=3)
    assert b["dp_comm"] - a["dp_comm"] > 1.0  # ZeRO-3's per-layer gathers are data-parallel collectives too


def _step_end_kind(label: str) -> str | None:
    """The kind (``plan_cost.step_end_calls``' key) of a call the runtime issues after the last backward."""
    if label.startswith("dp bucket"):
        return "dp bucket updated chunks" if label.endswith("updated chunks") else "dp bucket"
    for kind in ("tied weight", "sequence-parallel grads", "fp16 overflow flag", "global gradient norm"):
        if label.startswith(kind):
            return kind
    return "loss" if label == "loss of the step" else None


@pytest.mark.parametrize("spec, knobs", [
    (WIDE_GPT, dict(dp=2, pp=2, zero_stage=1)),  # buckets, updated chunks, the tied sum
    (GPT, dict(dp=2, tp=2, sequence_parallel=True, zero_stage=1)),  # the norms' partial gradients
    (WIDE_GPT, dict(dp=4, zero_stage=0)),
    (LLAMA, dict(pp=2)),  # untied: the scalars only
    (GPT, dict(dp=4, zero_stage=3)),  # ZeRO-3 reduces in backward
])
def test_step_end_calls_are_the_calls_the_runtime_issues_at_the_step_end(spec, knobs):
    """``plan_cost.step_end_calls`` (what ``Cluster.step_end_wait_s`` is paid for) against the
    calls the pre-launch check derives: per rank, the same kinds, as many times; a wait of 1 s
    adds one second per call to the step of a one-stage plan."""
    config = _config(**knobs)
    cluster = _cluster(config.world_size)
    lowering = lower_plan(capture_for_pipeline(build_model(spec)), config, cluster=cluster, check=False)
    ctx = PlanContext(_profile(spec), cluster, GLOBAL_BATCH, "adamw")
    stages = evaluate(ctx, config, limit=None).stages
    for rank in range(config.world_size):
        issued = collections.Counter(k for c in rank_calls(lowering.rank_program(rank)).calls
                                     if (k := _step_end_kind(c.label)) is not None)
        stage = stages[rank // (config.dp_cp * config.tp)]
        assert step_end_calls(ctx, config, stage.layers, stage.param_bytes) == dict(issued), rank
    if config.pp == 1:
        waited = PlanContext(_profile(spec), dataclasses.replace(cluster, step_end_wait_s=1.0), GLOBAL_BATCH, "adamw")
        extra = evaluate(waited, config, limit=None).step_time - evaluate(ctx, config, limit=None).step_time
        assert extra == pytest.approx(sum(step_end_calls(ctx, config, stages[0].layers, stages[0].param_bytes).values()))
