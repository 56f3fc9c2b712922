"""Activation offload (offload_policy tags, apply_offload rewrites, runtime.kernels.offload runs) and
optimizer-state offload (runtime.optim.optimizer_offload)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import sympy
import torch

from partitioner.cost.cost_model import cost_hooks
from partitioner.cost.cluster import Cluster, Link
from partitioner.errors import ConfigError, PassError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_memory import annotate_memory
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_shapes import annotate_shapes
from passes.rewrites.apply_offload import apply_offload
from passes.capture.capture import capture_spec
from passes.ir.meta import MEMORY, MEMORY_SUMMARY, OFFLOAD, OFFLOAD_PLAN
from passes.policies.offload_policy import offload_policy
from passes.ir import offload_ops as offload_graph
from runtime.kernels import offload as offload_ops
from runtime.optim.optimizer_offload import HostOffloadedOptimizer

SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16"


@pytest.fixture(scope="module")
def annotated():
    gm = capture_spec(build_model(SPEC, device="cpu"))
    for p in (annotate_shapes, annotate_blocks, annotate_flops, annotate_memory):
        gm = p(gm)
    return gm


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)]


def _step(gm, inputs):
    torch.manual_seed(1234)  # same dropout masks in every run
    for p in gm.parameters():
        p.grad = None
    loss = gm(*inputs)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in gm.named_parameters()}


LOCAL = cost_hooks(Cluster.preset("local-cpu"))


def _cluster(bandwidth: float, latency: float = 0.0, memory: int | None = None) -> Cluster:
    base = Cluster.preset("local-cpu")
    device = base.device if memory is None else dataclasses.replace(base.device, memory_bytes=memory)
    return dataclasses.replace(base, device=device, host_to_device=Link(
        kind="pcie", bandwidth_bytes_per_s=bandwidth, latency_s=latency))


def _assert_exact(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def test_backward_prefetches_the_reload_it_needs_next(annotated, inputs, monkeypatch):
    """With prefetch on (what CUDA does; on CPU only for this test), the first unpack of a host
    copy starts the reload of the one made before it in forward: most reloads are started ahead
    of their unpack, each storage is still reloaded exactly once, and the step stays exact."""
    ref = copy.deepcopy(annotated)
    gm = apply_offload(offload_policy(copy.deepcopy(annotated), cost=LOCAL, selection="all"))
    expected = _step(ref, inputs)
    starts = []
    real_start = offload_ops._HostStorage._start_reload

    def start(self):
        starts.append((id(self), self._reloaded is None))
        real_start(self)

    monkeypatch.setattr(offload_ops._HostStorage, "_start_reload", start)
    for prefetch in (False, True):
        monkeypatch.setattr(offload_ops, "PREFETCH_ON_CPU", prefetch)
        starts.clear()
        offload_ops.reset_offload_counters()
        torch.manual_seed(1234)
        gm.zero_grad(set_to_none=True)
        loss = gm(*inputs)
        loss.backward()
        counters = offload_ops.offload_counters()
        assert counters.reloaded_storages == counters.offloaded_storages > 2
        if prefetch:  # most reloads start ahead of their unpack (a chain breaks where regions restart)
            assert counters.prefetched_storages >= counters.reloaded_storages // 2 > 0
        else:
            assert counters.prefetched_storages == 0
        _assert_exact(expected, (loss.detach(), {k: p.grad.clone() for k, p in gm.named_parameters()}))
        assert len(starts) == counters.reloaded_storages and all(fresh for _, fresh in starts)  # once each


def test_offload_all_is_exact_and_moves_the_predicted_bytes(annotated, inputs):
    ref = copy.deepcopy(annotated)
    gm = offload_policy(copy.deepcopy(annotated), cost=LOCAL, selection="all")
    plan = gm.meta[OFFLOAD_PLAN]
    predicted = int(plan.activation_bytes)
    assert predicted > 0 and len(plan.nodes) > 10
    gm = apply_offload(gm)
    assert gm.meta[OFFLOAD_PLAN].regions == offload_graph.check_offload_regions(gm) > 0
    expected = _step(ref, inputs)

    offload_ops.reset_offload_counters()
    torch.manual_seed(1234)
    loss = gm(*inputs)
    counters = offload_ops.offload_counters()
    # after forward, every offloaded device storage is gone: only the host copies hold the data
    assert counters.offloaded_bytes == predicted
    assert counters.sources and all(ref_.expired() for ref_ in counters.sources)
    assert counters.reloaded_bytes == 0
    loss.backward()
    assert counters.reloaded_bytes == predicted
    assert counters.reloaded_storages == counters.offloaded_storages == len(counters.sources)
    assert counters.kept_tensors > 0  # weights saved inside the regions stayed on the device
    _assert_exact(expected, (loss.detach(), {k: p.grad.clone() for k, p in gm.named_parameters()}))

    # survives deepcopy + recompile + dead-code elimination, still exact and still offloading
    again = copy.deepcopy(gm)
    again.graph.eliminate_dead_code()
    again.recompile()
    assert offload_graph.check_offload_regions(again) == gm.meta[OFFLOAD_PLAN].regions
    offload_ops.reset_offload_counters()
    _assert_exact(expected, _step(again, inputs))
    assert offload_ops.offload_counters().offloaded_bytes == predicted


def test_ops_show_by_name_in_code_and_graph(annotated):
    gm = offload_policy(copy.deepcopy(annotated), cost=LOCAL, selection="all")
    gm = apply_offload(gm)
    assert "torch.ops.partitioner.offload_begin.default(" in gm.code
    assert "torch.ops.partitioner.offload_end.default(" in gm.code
    begins = [n for n in gm.graph.nodes if n.target is offload_graph.OFFLOAD_BEGIN]
    assert len(begins) == gm.meta[OFFLOAD_PLAN].regions
    # each begin brackets exactly one saver of an offloaded owner, named in that owner's meta
    savers = {s for n in gm.graph.nodes if OFFLOAD in n.meta and n.meta[OFFLOAD].offload
              for s in n.meta[OFFLOAD].savers}
    assert {b.next.name for b in begins} == savers
    with pytest.raises(PassError, match="already has offload ops"):
        apply_offload(gm)


def test_policy_bytes_match_annotate_memory_and_transfer_formula(annotated):
    bw, lat = 1e9, 2e-6
    gm = offload_policy(copy.deepcopy(annotated), cost=cost_hooks(_cluster(bw, lat)), selection="none")
    owners = [n for n in gm.graph.nodes if OFFLOAD in n.meta]
    assert owners and not gm.meta[OFFLOAD_PLAN].nodes
    for n in owners:
        meta = n.meta[OFFLOAD]
        assert not meta.offload and meta.reason == "selection 'none'"
        assert sympy.simplify(meta.bytes - n.meta[MEMORY].kept_bytes) == 0, n.name
        storages = round((meta.transfer_s / 2 - int(meta.bytes) / bw) / lat)  # latency once per storage
        assert storages >= 1
        assert meta.transfer_s == pytest.approx(2 * (int(meta.bytes) / bw + storages * lat))
    # kept activation bytes of all owners = annotate_memory's activation bytes
    total = sum(int(n.meta[OFFLOAD].bytes) for n in owners)
    assert total == int(gm.meta[MEMORY_SUMMARY].activation_bytes)


def test_policy_picks_nothing_on_a_slow_link_and_every_hideable_on_a_fast_one(annotated):
    slow = offload_policy(copy.deepcopy(annotated), cost=cost_hooks(_cluster(1.0, 1e-3)))
    assert slow.meta[OFFLOAD_PLAN].nodes == () and int(slow.meta[OFFLOAD_PLAN].activation_bytes) == 0

    fast = offload_policy(copy.deepcopy(annotated), cost=cost_hooks(_cluster(1e18)))
    metas = {n.name: n.meta[OFFLOAD] for n in fast.graph.nodes if OFFLOAD in n.meta}
    hideable = {k for k, m in metas.items() if m.transfer_s <= m.hidden_behind_s}
    assert set(fast.meta[OFFLOAD_PLAN].nodes) == hideable
    # the loss's own saved tensors have no compute left to hide behind
    assert 0 < len(hideable) < len(metas)
    assert all(metas[k].hidden_behind_s == 0 for k in set(metas) - hideable)


def test_policy_target_stops_largest_first(annotated):
    full = offload_policy(copy.deepcopy(annotated), cost=cost_hooks(_cluster(1e18)))
    metas = {n.name: n.meta[OFFLOAD] for n in full.graph.nodes if OFFLOAD in n.meta}
    target = int(full.meta[OFFLOAD_PLAN].activation_bytes) // 3
    gm = offload_policy(copy.deepcopy(annotated), cost=cost_hooks(_cluster(1e18)), target_bytes=target)
    chosen = gm.meta[OFFLOAD_PLAN].nodes
    sizes = sorted((int(metas[k].bytes) for k in chosen), reverse=True)
    assert sum(sizes) >= target > sum(sizes[:-1])
    rest = [int(m.bytes) for k, m in metas.items() if k not in chosen and m.transfer_s <= m.hidden_behind_s]
    assert max(rest) <= min(sizes)  # largest first
    with pytest.raises(ConfigError, match="target_bytes"):
        offload_policy(copy.deepcopy(annotated), cost=LOCAL, target_bytes=-1)
    with pytest.raises(ConfigError, match="unknown offload selection"):
        offload_policy(copy.deepcopy(annotated), cost=LOCAL, selection="some")


def test_optimizer_offload_decision(annotated):
    summary = annotated.meta[MEMORY_SUMMARY]
    fits = offload_policy(copy.deepcopy(annotated), cost=LOCAL, selection="none").meta[OFFLOAD_PLAN]
    assert not fits.optimizer_on_host and fits.optimizer_bytes_moved == 0
    tight = offload_policy(copy.deepcopy(annotated), selection="none",
                           cost=cost_hooks(_cluster(1e10, memory=int(summary.peak_bytes) - 1))).meta[OFFLOAD_PLAN]
    assert tight.optimizer_on_host and "device memory" in tight.optimizer_reason
    assert tight.optimizer_bytes_moved == summary.grad_bytes + summary.param_bytes
    assert tight.optimizer_state_bytes == summary.optimizer_bytes + 4 * summary.param_count


def test_apply_needs_the_policy_and_end_needs_begin(annotated):
    with pytest.raises(PassError, match="offload_policy first"):
        apply_offload(copy.deepcopy(annotated))
    with pytest.raises(PassError, match="without a matching offload_begin"):
        torch.ops.partitioner.offload_end(12345)


def test_host_adamw_matches_device_adamw_over_three_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    device_opt = torch.optim.AdamW(model.parameters(), **kwargs)
    # one group, as the device optimizer has: the factory merges the decay / no-decay groups
    host_opt = HostOffloadedOptimizer(twin.parameters(), factory=lambda groups: torch.optim.AdamW(
        [{"params": [p for g in groups for p in g["params"]]}, {"params": []}], **kwargs))
    assert all(m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for m, p in zip(host_opt.masters, twin.parameters()))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in range(3):
        x = torch.randn(8, 16)
        for m, opt in ((model, device_opt), (twin, host_opt)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(a, b), (step, name)
    assert host_opt.bytes_to_host == host_opt.bytes_to_device == 3 * param_bytes
    assert host_opt.state_bytes == 3 * param_bytes + 4 * len(host_opt.masters)  # masters, 2 moments, steps


def test_offload_after_full_checkpointing_moves_the_region_inputs_and_stays_exact(annotated, inputs):
    from passes.rewrites.apply_checkpoint import apply_checkpoint
    from passes.policies.checkpoint_policy import checkpoint_policy

    expected = _step(copy.deepcopy(annotated), inputs)
    gm = apply_checkpoint(checkpoint_policy(copy.deepcopy(annotated), policy="full"))
    gm = annotate_flops(annotate_blocks(annotate_shapes(gm)))  # the region calls need their facts
    calls = [n for n in gm.graph.nodes if n.target is torch.utils.checkpoint.checkpoint]
    assert len(calls) == 2  # one region per block
    gm = apply_offload(offload_policy(gm, cost=LOCAL, selection="all"))
    # each region's call is bracketed: what it keeps for its recompute is its input
    order = list(gm.graph.nodes)
    for call in calls:
        begin = order[order.index(call) - 1]
        assert begin.target is offload_graph.OFFLOAD_BEGIN and begin.args[0] == [call.args[1]]
    offload_ops.reset_offload_counters()
    torch.manual_seed(1234)
    loss = gm(*inputs)
    moved = offload_ops.offload_counters()
    hidden = 2 * 16 * 64 * 4  # [batch, seq, hidden] fp32: the block inputs
    assert [moved.by_region[begin.args[3]] for begin in order if begin.target is offload_graph.OFFLOAD_BEGIN
            and order[order.index(begin) + 1] in calls] == [hidden, hidden]
    loss.backward()
    assert moved.reloaded_bytes == moved.offloaded_bytes
    _assert_exact(expected, (loss.detach(), {k: p.grad.clone() for k, p in gm.named_parameters()}))


def _saves(gm) -> dict[tuple[str, str], list]:
    """(module, node) -> what the node saves for its backward, on the device or the host."""
    return {(name, n.name): sorted((s.owner, str(s.nbytes)) for s in (*n.meta[MEMORY].saved, *n.meta[MEMORY].offloaded))
            for name, sub in gm.named_modules() if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes if MEMORY in n.meta}


def test_what_offload_moves_to_the_host_is_still_recorded_as_saved_for_backward(annotated):
    """A checkpointed region recomputes up to its last node that saves: the communication check reads
    that from each node's saved tensors, wherever the offload decision keeps them."""
    from passes.rewrites.apply_checkpoint import apply_checkpoint
    from passes.policies.checkpoint_policy import checkpoint_policy

    ckpt = apply_checkpoint(checkpoint_policy(copy.deepcopy(annotated), policy="full"))
    ckpt = annotate_flops(annotate_blocks(annotate_shapes(ckpt)))
    before = _saves(annotate_memory(copy.deepcopy(ckpt)))
    gm = annotate_memory(apply_offload(offload_policy(ckpt, cost=LOCAL, selection="all")))
    region_nodes = [(name, n) for name, sub in gm.named_modules() if name and isinstance(sub, torch.fx.GraphModule)
                    for n in sub.graph.nodes if MEMORY in n.meta]
    assert any(n.meta[MEMORY].offloaded for _, n in region_nodes)  # the regions' saves went to the host
    after = _saves(gm)
    assert {k: v for k, v in after.items() if k in before} == before and any(before.values())
