"""A job makes the whole-graph part of its lowering once: the mesh's first rank runs the
context-parallel rewrite, the tensor-parallel tags and the checkpoint policy, and every other rank
takes what it sent (:func:`partitioner.compile.build.share_whole_graph_prefix`) instead of running
them again. Checked on two gloo ranks: which passes each rank's lowering ran, that both ranks lower
the same programs from it (the digests the build compares before the first step), and one step's
loss against one device.

Likewise each stage program once per data axis: its first rank lowers and the others take the
programs (:func:`partitioner.compile.build.share_stage_programs`), each with its own tensors, equal
to those it would have made itself."""
from __future__ import annotations

import pytest

from partitioner.calibration.job_cluster import local_cluster
from runtime.dist.launch import spawn
from tests import runtime_cases
from tests.runtime_cases import Plan, payloads_for

pytestmark = pytest.mark.slow

PREFIX = {"context_parallel", "tag_tensor_parallel", "checkpoint_policy"}
PLANS = [
    Plan("gpt-cp", 1, 1, 1, "1f1b", 1, 1, 2, 0, "none", "none", cp=2, cp_mode="ring"),
    Plan("gpt-cp", 1, 2, 1, "1f1b", 1, 1, 2, 0, "full", "none"),
    Plan("gpt-cp", 2, 1, 1, "1f1b", 1, 1, 4, 0, "none", "none"),  # no costly whole-graph pass: nothing to share
]


def _recording_passes(payloads):
    """On a rank: (spec, the analysed graph, the list every pass the lowering runs from now on is
    appended to, by name), after the world group is up."""
    from passes.lowering import manager as manager_module
    from runtime.dist.mesh import init_distributed

    init_distributed(timeout_s=120)
    spec, graph = runtime_cases.unpacked_graph(runtime_cases.MODELS["gpt-cp"], payloads["gpt-cp"])
    ran: list[str] = []
    run = manager_module.PassManager.run

    def recording(self, gm, ctx=None):
        ran.extend(p.name for p in self.passes)
        return run(self, gm, ctx)

    manager_module.PassManager.run = recording
    return spec, graph, ran


def _lower_each(plans: list[Plan], payloads) -> dict:
    from partitioner.compile.build import build_parallel_model, share_whole_graph_prefix
    from partitioner.cost.cost_model import cost_hooks
    from runtime.dist.mesh import Mesh

    spec, graph, ran = _recording_passes(payloads)
    out = {}
    for plan in plans:
        mesh = Mesh.for_config(plan.config(), timeout_s=runtime_cases.TIMEOUT_S)
        cluster = local_cluster(mesh.size)
        ran.clear()
        shared = share_whole_graph_prefix(graph, plan.config(), mesh, cost=cost_hooks(cluster))
        in_share = sorted(set(ran) & PREFIX)
        ran.clear()
        pm = build_parallel_model(graph, plan.config(), mesh, optimizer=runtime_cases.ADAMW, cluster=cluster)
        loss = pm.train_step(runtime_cases.batches(spec, plan.global_batch)[0])
        out[plan.id] = {"shared": shared, "in_share": in_share, "in_build": sorted(set(ran) & PREFIX),
                        "loss": loss}
    return out


@pytest.fixture(scope="module")
def lowered():
    return spawn(_lower_each, 2, PLANS, payloads_for(PLANS), timeout_s=300)


@pytest.mark.parametrize("plan", PLANS[:2], ids=lambda p: p.id)
def test_the_first_rank_makes_the_whole_graph_part_and_the_other_takes_it(lowered, plan):
    first, other = (r[plan.id] for r in lowered)
    assert (first["shared"], other["shared"]) == ("made", "taken")
    assert first["in_share"] and not other["in_share"]  # only the first rank ran the prefix passes
    # and neither ran them again when the build lowered its programs (the build shares again: a memo hit)
    assert first["in_build"] == other["in_build"] == []


def test_a_plan_without_a_costly_whole_graph_part_shares_nothing(lowered):
    plan = PLANS[2]
    assert [r[plan.id]["shared"] for r in lowered] == ["none", "none"]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_the_shared_lowering_trains_like_one_device(lowered, plan):
    losses, *_ = runtime_cases.reference("gpt-cp", plan.global_batch)
    for r in lowered:
        assert r[plan.id]["loss"] == pytest.approx(losses[0], rel=1e-5)


def test_when_the_first_rank_cannot_make_it_every_rank_lowers_alone(monkeypatch):
    """The first rank's failure is not a hang: it sends nothing (and says the plan has a prefix),
    so every rank lowers alone and meets the error in its own lowering."""
    import types

    import partitioner.compile.build as build
    from passes.ir.errors import PassError

    sent = []

    def broadcast(obj, src, group):
        sent.append(obj)
        return obj

    def fails(*args, **kwargs):
        raise PassError("context_parallel: cannot cut this sequence")

    monkeypatch.setattr(build.comm, "broadcast_object", broadcast)
    monkeypatch.setattr(build, "whole_graph_prefix", fails)
    first = types.SimpleNamespace(active=True, size=2, rank=0, first=0, group=None)
    assert build.share_whole_graph_prefix(None, None, first, cost=None) == "alone"
    assert sent == [(None, True)]


STAGE_PASSES = {"specialize_dims", "restrict_checkpoint_plan", "apply_checkpoint", "shard_parameters",
                "annotate_memory"}
SHARED = [
    Plan("gpt-cp", 2, 1, 1, "1f1b", 1, 2, 8, 3, "full", "none"),  # ZeRO-3 shards, checkpointed regions
    Plan("gpt-cp", 1, 1, 1, "1f1b", 1, 1, 2, 0, "selective", "none", cp=2, cp_mode="ring"),  # the data axis of cp
    Plan("gpt-cp", 2, 1, 1, "1f1b", 1, 1, 4, 1, "tensor", "none"),
]


def _share_programs(plans: list[Plan], payloads) -> dict:
    import torch

    from partitioner.compile.build import build_parallel_model, share_stage_programs
    from partitioner.cost.cost_model import cost_hooks
    from passes.lowering.lower import lower, programs_of
    from runtime.dist.mesh import Mesh

    spec, graph, ran = _recording_passes(payloads)
    out = {}
    for plan in plans:
        config = plan.config()
        mesh = Mesh.for_config(config, timeout_s=runtime_cases.TIMEOUT_S)
        cost = cost_hooks(local_cluster(mesh.size))

        def alone():
            return lower(graph, config, cost=cost, programs=programs_of(config, mesh.rank))

        ran.clear()
        lowering, how = share_stage_programs(graph, config, mesh, alone, cost=cost)
        stage_passes = sorted(set(ran) & STAGE_PASSES)
        mine = alone()  # what this rank makes itself
        same, whole_graphs = True, True
        for key, program in lowering.programs.items():
            theirs = dict(mine.programs[key].named_parameters())
            for name, t in program.named_parameters():
                same &= t.shape == theirs[name].shape and torch.equal(t, theirs[name])
            for name, t in getattr(program, "zero3_sources", {}).items():
                same &= torch.equal(t, mine.programs[key].zero3_sources[name])
            # the tensors that are the whole graph's where it lowers alone are its whole graph's here
            whole_graphs &= _of_whole_graph(program, lowering.graph) == _of_whole_graph(mine.programs[key], mine.graph)
        _, declined = share_stage_programs(graph, config, mesh, alone, cost=cost, share=mesh.rank != 0)
        pm = build_parallel_model(graph, config, mesh, optimizer=runtime_cases.ADAMW, cluster=local_cluster(mesh.size))
        loss = pm.train_step(runtime_cases.batches(spec, plan.global_batch)[0])
        out[plan.id] = {"how": how, "stage_passes": stage_passes, "digest": lowering.digest(),
                        "alone_digest": mine.digest(), "same": bool(same), "whole_graph": bool(whole_graphs),
                        "declined": declined, "loss": loss}
    return out


def _of_whole_graph(program, whole) -> list[str]:
    own = {id(t) for t in [*whole.parameters(), *whole.buffers()]}
    return [n for n, t in [*program.named_parameters(), *program.named_buffers()] if id(t) in own]


@pytest.fixture(scope="module")
def shared_programs():
    return spawn(_share_programs, 2, SHARED, payloads_for(SHARED), timeout_s=300)


@pytest.mark.parametrize("plan", SHARED, ids=lambda p: p.id)
def test_the_first_data_axis_rank_lowers_the_programs_and_the_other_takes_them(shared_programs, plan):
    first, other = (r[plan.id] for r in shared_programs)
    assert (first["how"], other["how"]) == ("made", "taken")
    assert first["stage_passes"] and not other["stage_passes"]  # the taker ran no stage pass
    assert first["digest"] == other["digest"] == other["alone_digest"]
    assert other["same"]  # the parameters (and ZeRO-3's full tensors) it would have made itself
    assert other["whole_graph"]  # its own whole graph's tensors where it would have used them
    # a first rank that does not share (one that dumps) sends nothing: both lower alone
    assert (first["declined"], other["declined"]) == ("alone", "alone")
    losses, *_ = runtime_cases.reference("gpt-cp", plan.global_batch)
    for r in shared_programs:
        assert r[plan.id]["loss"] == pytest.approx(losses[0], rel=1e-5)


def test_when_the_first_data_axis_rank_cannot_lower_it_sends_nothing_and_raises(monkeypatch):
    """No hang: the others get nothing and lower alone (and meet the same error)."""
    import types

    import partitioner.compile.build as build
    from passes.ir.errors import PassError

    sent = []
    monkeypatch.setattr(build.comm, "broadcast_object", lambda obj, src, group: sent.append(obj) or obj)

    def fails():
        raise PassError("apply_checkpoint: no region")

    first = types.SimpleNamespace(active=True, dp=2, rank=0, first=0, dp_ranks=(0, 1), dp_group=None)
    with pytest.raises(PassError, match="no region"):
        build.share_stage_programs(None, None, first, fails, cost=None)
    assert sent == [None]
    other = types.SimpleNamespace(active=True, dp=2, rank=1, first=0, dp_ranks=(0, 1), dp_group=None)
    assert build.share_stage_programs(None, None, other, lambda: "lowered alone", cost=None) == ("lowered alone",
                                                                                               "alone")
