"""The runtime's communication module on 3 gloo ranks: tensors broadcast in buckets arrive whole
and in place (mixed dtypes, a non-contiguous view, buckets smaller than a tensor), objects
broadcast, and a tensor off the group's device is refused before anything is sent."""
from __future__ import annotations

import pytest
import torch

from runtime.dist.launch import spawn


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    wide = torch.randn(6, 4, generator=g)
    return [torch.randn(5, 3, generator=g), torch.randint(0, 100, (7,), generator=g),
            torch.randn(2, 2, generator=g).double(), wide.t(), torch.randn(0, generator=g),
            torch.randn(300, generator=g)]


def _broadcast_rank(bucket_bytes: int):
    import torch.distributed as dist

    from runtime.dist import comm
    from runtime.dist.mesh import init_distributed

    init_distributed(timeout_s=60)
    rank = dist.get_rank()
    tensors = _tensors(rank)
    comm.broadcast_tensors(tensors, src=1, device=torch.device("cpu"), bucket_bytes=bucket_bytes)
    obj = comm.broadcast_object({"plan": "dp=3"} if rank == 0 else None, src=0)
    return tensors, obj  # the same objects: written in place


@pytest.mark.parametrize("bucket_bytes", [64, 2**20])
def test_broadcast_tensors_gives_every_rank_the_source_tensors(bucket_bytes):
    results = spawn(_broadcast_rank, 3, bucket_bytes, timeout_s=120)
    expected = _tensors(1)
    for rank, (tensors, obj) in enumerate(results):
        assert obj == {"plan": "dp=3"}
        for got, want in zip(tensors, expected, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), rank
    assert not torch.equal(_tensors(0)[0], expected[0])  # the ranks did start from different values


def test_a_cpu_tensor_on_an_nccl_group_is_refused_before_sending(monkeypatch):
    from runtime.dist import comm

    monkeypatch.setattr(comm, "backend_of", lambda group: "nccl")
    with pytest.raises(comm.CommError, match="a cpu tensor of shape \\(5, 3\\) on an NCCL group.*mesh.device"):
        comm.broadcast(torch.zeros(5, 3), src=0)


def _check_program_rank(digests: list[str]):
    import torch.distributed as dist

    from passes.checks.communication_check import LoweredRank, RankCalls, check_lowered_ranks
    from passes.ir.config import ParallelConfig
    from passes.ir.errors import CommunicationMismatchError
    from runtime.dist.mesh import Mesh

    config = ParallelConfig(dp=3, micro_batch_size=1, num_micro_batches=1)
    mesh = Mesh.for_config(config, timeout_s=60)
    rank = dist.get_rank()
    mine = LoweredRank(rank=rank, plan="p", programs=((0, 0),), digest=digests[rank], calls=RankCalls(rank, ()))
    try:
        check_lowered_ranks(mesh.exchange(mine), config=config)
    except CommunicationMismatchError as exc:
        return str(exc)
    return None


def test_ranks_that_lowered_different_programs_are_named_before_any_step():
    """Every process lowers its own rank's programs; the ranks exchange digests, and a rank whose
    program differs from its dp peers' stops every rank with the groups of ranks that agree."""
    assert spawn(_check_program_rank, 3, ["a1", "a1", "a1"], timeout_s=120) == [None] * 3
    errors = spawn(_check_program_rank, 3, ["a1", "b2", "a1"], timeout_s=120)
    assert all(e is not None and "ranks [0, 2] lowered a1" in e and "ranks [1] lowered b2" in e for e in errors)
