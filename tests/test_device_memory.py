"""The device memory a plan may use: the budget's arithmetic, the communicators it counts (the
mesh's own groups), and the search holding plans to it and the plan reporting it."""
import dataclasses

import pytest
import torch.distributed as dist

from partitioner.cost.cluster import Cluster, ClusterSpecError
from partitioner.cost.device_memory import (GPU_ALLOCATOR_SLACK, GPU_COMMUNICATOR_BYTES, GPU_RESERVED_BYTES,
                                            memory_budget)
from partitioner.search.profile import profile_model
from partitioner.search.search import search
from passes.ir.config import ParallelConfig
from passes.ir.errors import InfeasiblePlanError
from passes.ir.plan import Plan

GiB = 2**30


def test_a_gpu_budget_holds_back_context_communicators_and_slack():
    cluster = Cluster.preset("dgx-h100")
    budget = memory_budget(cluster, 3)
    assert budget.device_bytes == 80 * GiB
    assert budget.reserved_bytes == GPU_RESERVED_BYTES
    assert budget.communicator_bytes == 3 * GPU_COMMUNICATOR_BYTES
    expected = (80 * GiB - GPU_RESERVED_BYTES - 3 * GPU_COMMUNICATOR_BYTES) / (1 + GPU_ALLOCATOR_SLACK)
    assert budget.usable_bytes == pytest.approx(expected)
    assert memory_budget(cluster, 4).usable_bytes < budget.usable_bytes  # each communicator costs
    assert budget.headroom(budget.usable_bytes - 5) == pytest.approx(5)


def test_cpu_ranks_hold_nothing_back_and_a_cluster_file_overrides_the_defaults():
    cpu = Cluster.preset("local-cpu")
    assert memory_budget(cpu, 5).usable_bytes == cpu.device.memory_bytes
    h100 = Cluster.preset("dgx-h100")
    data = h100.to_dict()
    data["device"].update(reserved_bytes="1GiB", communicator_bytes="0B", allocator_slack=0.1)
    mine = Cluster.from_dict(data)
    assert memory_budget(mine, 7).usable_bytes == pytest.approx((80 - 1) * GiB / 1.1)
    assert Cluster.from_dict(mine.to_dict()) == mine  # the fields travel in the cluster file
    for field, value in (("allocator_slack", 1.5), ("allocator_slack", True), ("reserved_bytes", "-1GiB")):
        bad = h100.to_dict()
        bad["device"][field] = value
        with pytest.raises(ClusterSpecError, match=field):
            Cluster.from_dict(bad)


CONFIGS = [
    dict(dp=8), dict(dp=2, tp=2, pp=2), dict(dp=1, pp=4, schedule="interleaved", virtual_pp=2, num_micro_batches=4),
    dict(dp=2, pp=2, schedule="zbv", virtual_pp=2, num_micro_batches=4), dict(dp=4, cp=2, tp=2),
    dict(dp=8, zero_stage=3, hsdp_shard=4), dict(dp=4, ep=2), dict(dp=2, ep=2), dict(tp=4, pp=3, num_micro_batches=3),
]


@pytest.mark.parametrize("knobs", CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_communicators_are_the_groups_the_mesh_makes(knobs):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.dist.mesh import Mesh

    knobs = {"micro_batch_size": 1, "num_micro_batches": 2, **knobs}
    config = ParallelConfig(**knobs)
    joined = []
    for rank in range(config.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=config.world_size)
        try:
            joined.append(len(Mesh.for_config(config).joined))
        finally:
            dist.destroy_process_group()
    assert max(joined) == config.communicators, joined  # the budget is the fullest rank's


def _gpt_profile():
    return profile_model("gpt:layers=4,hidden=1024,heads=16,vocab=32000,seq=1024", dtype="bf16")


def test_the_search_keeps_plans_inside_the_budget_and_reports_it():
    profile = _gpt_profile()
    cluster = Cluster.preset("dgx-h100")
    roomy = search(profile, cluster, global_batch=64, fix={"dp": 8, "zero_stage": 0, "checkpointing": "none"})
    budget = roomy.predicted.memory_budget
    assert budget["communicators"] == roomy.config.communicators
    assert budget["usable_bytes"] == pytest.approx(memory_budget(cluster, roomy.config.communicators).usable_bytes)
    assert roomy.predicted.headroom_bytes == pytest.approx(budget["usable_bytes"] - roomy.predicted.peak_memory_bytes)
    assert "headroom" in roomy.summary()
    assert Plan.from_json(roomy.to_json()).predicted.memory_budget == budget

    # a device whose memory the plan's peak fills, and the same device with nothing held back:
    # only the second takes the plan, with what is held back exactly what it lacks
    peak = roomy.predicted.peak_memory_bytes
    full = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=int(peak) + 1))
    bare = dataclasses.replace(full, device=dataclasses.replace(full.device, reserved_bytes=0, communicator_bytes=0,
                                                                allocator_slack=0.0))
    fix = roomy.knobs()
    assert search(profile, bare, global_batch=64, fix=fix).predicted.peak_memory_bytes == pytest.approx(peak)
    with pytest.raises(InfeasiblePlanError, match="NCCL communicator"):
        search(profile, full, global_batch=64, fix=fix)
