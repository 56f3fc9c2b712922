"""``shard_parameters`` (ZeRO-3) on small graphs: what the pass writes into a stage program, the
gather schedule it implies, and the communication check's view of it."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from partitioner.compile.build import capture_for_pipeline
from partitioner.cost.cost_model import cost_hooks
from partitioner.inputs.models import build_model
from passes.checks.communication_check import check_lowering, rank_calls
from passes.ir.config import ParallelConfig
from passes.ir.errors import CommunicationMismatchError, ConfigError
from passes.ir.zero3_ops import ZERO3_GATHER, GatherSchedule, GatherSite, shard_of, unshard
from passes.ir.meta import ZERO3_PLAN
from passes.lowering.lower import lower
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"


@pytest.fixture(scope="module")
def graph():
    return capture_for_pipeline(build_model(GPT))


def _lower(graph, **knobs):
    config = ParallelConfig.for_global_batch(8, **knobs)
    return lower(graph, config, cost=cost_hooks(local_cluster(config.world_size)))


def _gathers(gm):
    return [n for n in gm.graph.nodes if n.target is ZERO3_GATHER]


def test_every_parameter_is_a_flat_shard_read_only_by_its_blocks_gather(graph):
    low = _lower(graph, dp=2, zero_stage=3, num_micro_batches=2)
    gm = low.programs[(0, 0)]
    plan = gm.meta[ZERO3_PLAN]
    module = build_model(GPT).module
    full = dict(module.named_parameters(remove_duplicate=False))  # the tied weight under both names
    assert {r.name for r in plan.params} <= set(full)
    assert len(plan.params) == len(list(module.parameters()))
    for r in plan.params:
        p = gm.get_parameter(r.name)
        assert p.dim() == 1 and p.numel() == math.ceil(full[r.name].numel() / 2) == r.shard_numel
        assert r.shape == tuple(full[r.name].shape)
    # one gather per block: the embedding (with the tied LM head's first reader), two blocks, the head
    assert [s.block for s in plan.sites] == [0, 1, 2, 3]
    assert plan.sites[1].params == tuple(n for n in full if n.startswith("blocks.0."))
    assert set(plan.sites[0].params) == {"wpe.weight", "lm_head.weight"}
    assert [s.site for s in plan.sites] == [int(n.args[5]) for n in _gathers(gm)] == [0, 1, 2, 3]
    # no op but the gathers reads a shard
    shards = {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(gm.get_parameter(n.target), torch.nn.Parameter)}
    for node in shards:
        assert all(u.target is ZERO3_GATHER for u in node.users), node.name
    # the blocks' linears save their weights: every site is gathered again in backward
    assert all(s.regather for s in plan.sites)
    assert "linear" in plan.sites[1].savers and plan.sites[3].savers  # ln_f's layer norm saves its weight


def test_a_checkpointed_block_gathers_inside_its_region(graph):
    gm = _lower(graph, dp=2, zero_stage=3, checkpointing="full").programs[(0, 0)]
    plan = gm.meta[ZERO3_PLAN]
    regions = [s for s in plan.sites if s.graph]
    assert [s.block for s in regions] == [1, 2]
    for s in regions:
        assert s.regather and not s.savers  # the recompute gathers again
        assert len(_gathers(getattr(gm, s.graph))) == 1
    assert len(_gathers(gm)) == 2  # embedding and head stay in the stage graph


def test_shards_of_a_tensor_padded_unevenly_rebuild_it():
    t = torch.arange(10.0).reshape(2, 5)
    pieces = [shard_of(t, 3, r) for r in range(3)]
    assert [p.numel() for p in pieces] == [4, 4, 4] and pieces[2].tolist() == [8.0, 9.0, 0.0, 0.0]
    assert torch.equal(unshard(pieces, (2, 5)), t)


def _site(stage, site, regather=True):
    return GatherSite(stage=stage, site=site, graph="", block=site, params=("w",), regather=regather)


def test_gather_schedule_prefetches_ahead_and_never_twice():
    sched = GatherSchedule([_site(0, k, regather=k != 0) for k in range(4)], prefetch=1)
    assert [sched.forward((0, k)) for k in range(4)] == [[(0, 0), (0, 1)], [(0, 2)], [(0, 3)], []]
    # backward: 3, 2, 1 are gathered again (0 is not), each one ahead
    assert sched.backward((0, 3)) == [(0, 3), (0, 2)]
    assert sched.backward((0, 3)) == []  # held until its reduce-scatter
    sched.released((0, 3))
    assert sched.backward((0, 2)) == [(0, 1)]
    assert sched.backward((0, 1)) == []
    none = GatherSchedule([_site(0, k) for k in range(3)], prefetch=0)
    assert [none.forward((0, k)) for k in range(3)] == [[(0, 0)], [(0, 1)], [(0, 2)]]


def test_zero3_refuses_split_backward_and_activation_offload():
    with pytest.raises(ConfigError, match="zero_stage=3 gathers a block's parameters for one backward"):
        ParallelConfig(dp=2, pp=2, zero_stage=3, schedule="zb1p", num_micro_batches=2)
    with pytest.raises(ConfigError, match="offload='activations' is not supported"):
        ParallelConfig(dp=2, zero_stage=3, offload="activations")


def test_the_communication_check_counts_every_gather_and_reduce_scatter(graph):
    low = _lower(graph, dp=2, zero_stage=3, num_micro_batches=2)
    calls = rank_calls(low.rank_program(0)).calls
    dp = [c for c in calls if c.channel == "dp"]
    plan = low.programs[(0, 0)].meta[ZERO3_PLAN]
    sites = len(plan.sites)
    # one all-gather per site forward and one again backward, one reduce-scatter: per micro-batch
    assert sum(c.op == "all_gather" for c in dp) == 2 * 2 * sites
    assert sum(c.op == "reduce_scatter(sum)" for c in dp) == 2 * sites
    first = next(c for c in dp if c.op == "all_gather")
    assert first.numel == 2 * sum(plan.param(n).shard_numel for n in plan.sites[0].params)
    assert not any("dp bucket" in c.label for c in calls)  # no gradient buckets under ZeRO-3
    # prefetch changes the order, never the calls: in backward the next site's gather goes out
    # before the current site's reduce-scatter
    plain = [c for c in rank_calls(low.rank_program(0), zero3_prefetch=0).calls if c.channel == "dp"]
    assert sorted(map(str, plain)) == sorted(map(str, dp)) and plain != dp
    rs = next(k for k, c in enumerate(dp) if c.op == "reduce_scatter(sum)")
    assert dp[rs - 1].op == "all_gather" and f"site {sites - 2}" in dp[rs - 1].label
    rs0 = next(k for k, c in enumerate(plain) if c.op == "reduce_scatter(sum)")
    assert f"site {sites - 1}" in plain[rs0 - 1].label


def test_a_rank_that_gathers_a_site_again_where_its_peer_does_not_is_caught(graph):
    low = _lower(graph, dp=2, zero_stage=3, num_micro_batches=1)
    programs = [low.rank_program(r) for r in range(2)]
    other = copy_program_with_plan(programs[1], lambda plan: dataclasses.replace(
        plan, sites=tuple(dataclasses.replace(s, regather=False, savers=()) if s.site == 2 else s for s in plan.sites)))
    from passes.checks.communication_check import check_communication
    check_communication(programs)
    with pytest.raises(CommunicationMismatchError, match="zero3"):
        check_communication([programs[0], other])
    check_lowering(low)


def copy_program_with_plan(program, change):
    """``program`` whose stage programs carry ``change(plan)`` as their ZeRO-3 plan (copies)."""
    import copy
    modules = {}
    for s, gm in program.modules.items():
        gm = copy.copy(gm)
        gm.meta = dict(gm.meta)
        gm.meta[ZERO3_PLAN] = change(gm.meta[ZERO3_PLAN])
        modules[s] = gm
    return dataclasses.replace(program, modules=modules)


def test_hsdp_gathers_inside_the_shard_group_and_all_reduces_across_replicas(graph):
    low = _lower(graph, dp=4, zero_stage=3, hsdp_shard=2, num_micro_batches=1)
    plan = low.programs[(0, 0)].meta[ZERO3_PLAN]
    assert plan.degree == 2
    full = dict(build_model(GPT).module.named_parameters(remove_duplicate=False))
    assert all(r.shard_numel == math.ceil(full[r.name].numel() / 2) for r in plan.params)
    calls = rank_calls(low.rank_program(1)).calls  # dp index 1: shard group (0, 1), replicas (1, 3)
    dp = [c for c in calls if c.channel == "dp"]
    assert {c.group for c in dp if c.op in ("all_gather", "reduce_scatter(sum)")} == {(0, 1)}
    across = [c for c in dp if c.op == "all_reduce(sum)"]
    assert across and {c.group for c in across} == {(1, 3)}
    assert len(across) == sum(c.op == "reduce_scatter(sum)" for c in dp)  # one per reduce-scattered shard
    check_lowering(low)


def test_hsdp_needs_zero3_and_a_divisor_of_dp():
    with pytest.raises(ConfigError, match="hsdp_shard=2 is ZeRO-3's shard group and needs zero_stage=3"):
        ParallelConfig(dp=4, zero_stage=2, hsdp_shard=2)
    with pytest.raises(ConfigError, match="must be a divisor of dp=4 between 2 and dp-1"):
        ParallelConfig(dp=4, zero_stage=3, hsdp_shard=3)


def test_a_gather_of_another_models_shards_is_refused():
    from runtime.kernels.zero3 import ParamGatherer

    mine, other = torch.nn.Parameter(torch.arange(4.0)), torch.nn.Parameter(torch.zeros(4))
    g = ParamGatherer(None, 1, {(0, 0): (_site(0, 0), [mine], [(2, 2)])}, prefetch=0)
    assert torch.equal(g.gather(0, 0, [mine])[0], torch.arange(4.0).view(2, 2))
    with pytest.raises(ConfigError, match="two models in one process need different group names"):
        g.gather(0, 0, [other])


def test_kept_sites_are_gathered_once_per_forward_and_not_again_in_backward():
    # reshard_after_forward=False: 1, 2, 3 are re-gathered sites, held from their forward gather
    sched = GatherSchedule([_site(0, k, regather=k != 0) for k in range(4)], prefetch=1, keep=True)
    assert [sched.forward((0, k)) for k in range(4)] == [[(0, 0), (0, 1)], [(0, 2)], [(0, 3)], []]
    assert sched.held == {(0, 1), (0, 2), (0, 3)}
    # a second micro-batch's forward takes the held sites; only site 0 (not kept) is gathered again
    assert [sched.forward((0, k)) for k in range(4)] == [[(0, 0)], [], [], []]
    assert [sched.backward((0, k)) for k in (3, 2, 1)] == [[], [], []]  # the backward takes them
    for k in (3, 2, 1):
        sched.released((0, k))
    # once reduce-scattered, the next backward gathers again, as without keeping
    assert sched.backward((0, 3)) == [(0, 3), (0, 2)]


def test_keeping_the_gathered_parameters_halves_the_gathers(graph):
    plans = {keep: _lower(graph, dp=2, zero_stage=3, num_micro_batches=2, reshard_after_forward=not keep)
             for keep in (False, True)}
    gm = plans[True].programs[(0, 0)]
    plan = gm.meta[ZERO3_PLAN]
    assert not plan.reshard_after_forward and plans[False].programs[(0, 0)].meta[ZERO3_PLAN].reshard_after_forward
    from passes.lowering.lower import pipeline_texts
    assert any("reshard_after_forward=false" in t for t in pipeline_texts(plans[True]).values())
    sites = len(plan.sites)
    counts = {}
    for keep, low in plans.items():
        dp = [c for c in rank_calls(low.rank_program(0)).calls if c.channel == "dp"]
        counts[keep] = (sum(c.op == "all_gather" for c in dp), sum(c.op == "reduce_scatter(sum)" for c in dp))
        check_lowering(low)
    assert counts[False] == (2 * 2 * sites, 2 * sites)  # forward and backward, per micro-batch
    assert counts[True] == (2 * sites, 2 * sites)  # forward only: the backward takes the kept copy


def test_reshard_after_forward_false_needs_zero3():
    with pytest.raises(ConfigError, match="reshard_after_forward=false .* needs zero_stage=3"):
        ParallelConfig(dp=2, zero_stage=2, reshard_after_forward=False)
    with pytest.raises(ConfigError, match="reshard_after_forward must be true or false"):
        ParallelConfig(dp=2, zero_stage=3, reshard_after_forward="no")
