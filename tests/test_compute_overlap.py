"""What a collective hidden behind compute costs that compute on a GPU (``StepTimeTerms.overlap``)."""
import dataclasses

import pytest

from partitioner.cost.cluster import GPU_COMM_COMPUTE_SHARE, Cluster
from partitioner.search.plan_cost import overlapped
from partitioner.search.profile import profile_model
from partitioner.search.search import search


def test_a_hidden_collective_slows_the_compute_by_its_share():
    # hidden: the compute loses share x comm, nothing is exposed
    assert overlapped(2.0, 10.0, 0.15) == pytest.approx((0.0, 0.3))
    # far longer than the compute: the slowed compute still ends first, the collective is exposed
    assert overlapped(10.0, 2.0, 0.15) == pytest.approx((8.0, 0.0))
    # just longer: the slowed compute outlasts it by compute + share x comm - comm
    assert overlapped(2.1, 2.0, 0.15) == pytest.approx((0.1, 2.0 + 0.15 * 2.1 - 2.1))
    assert overlapped(2.0, 10.0, 0.0) == (0.0, 0.0)  # nothing shared, nothing lost
    assert overlapped(3.0, 0.0, 0.15) == (3.0, 0.0)  # nothing to hide behind (a host rank)


def _plan(cluster, fix):
    profile = profile_model("gpt:layers=4,hidden=1024,heads=16,vocab=32000,seq=1024", dtype="bf16")
    return search(profile, cluster, global_batch=64, fix=fix)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_the_term_charges_the_hidden_collectives_on_gpus_only(zero):
    fix = {"dp": 8, "tp": 1, "pp": 1, "zero_stage": zero, "micro_batch_size": 2, "num_micro_batches": 4,
           "checkpointing": "none", "offload": "none"}
    h100 = Cluster.preset("dgx-h100")
    terms = _plan(h100, fix).predicted.terms
    assert terms["overlap"] > 0
    alone = dataclasses.replace(h100, device=dataclasses.replace(h100.device, comm_compute_share=0.0))
    free = _plan(alone, fix).predicted.terms
    assert free["overlap"] == 0.0
    assert terms["total"] - free["total"] == pytest.approx(terms["overlap"])  # nothing else moves
    doubled = dataclasses.replace(h100, device=dataclasses.replace(h100.device,
                                                                   comm_compute_share=2 * GPU_COMM_COMPUTE_SHARE))
    # the collectives are hidden at this size: the term is linear in the share
    assert _plan(doubled, fix).predicted.terms["overlap"] == pytest.approx(2 * terms["overlap"])
    cpu = Cluster.preset("local-cpu")
    assert _plan(cpu, {**fix, "dp": cpu.world_size, "micro_batch_size": 64 // (4 * cpu.world_size)}) \
        .predicted.terms["overlap"] == 0.0
