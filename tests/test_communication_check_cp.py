"""The pre-launch communication check sees the context-parallel ops: ring attention's shifts,
Ulysses' all-to-alls and the loss's all-reduces on the cp group, in the order the kernels issue
them, and a rank whose program disagrees is caught before anything runs."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from partitioner.compile.build import capture_for_pipeline
from partitioner.cost.cost_model import cost_hooks
from partitioner.inputs.models import build_model
from passes.checks.communication_check import check_communication, check_lowering, rank_calls
from passes.ir.config import ParallelConfig
from passes.ir.errors import CommunicationMismatchError
from passes.lowering.lower import lower
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,dropout=0.0"


@functools.cache
def _graph():
    return capture_for_pipeline(build_model(GPT, device="meta"))


def _lowering(**knobs):
    config = ParallelConfig.for_global_batch(4, **knobs)
    return lower(_graph(), config, cost=cost_hooks(local_cluster(config.world_size)))


def _cp_calls(lowering, rank: int):
    return [c for c in rank_calls(lowering.rank_program(rank)).calls if c.channel == "cp"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_calls(cp):
    lowering = _lowering(cp=cp, cp_mode="ring")
    summary = check_lowering(lowering)
    assert summary.ranks == cp
    calls = _cp_calls(lowering, 0)
    shifts = [c for c in calls if c.op == "ring_shift"]
    # per layer: forward cp-1 K/V shifts; backward cp-1 K/V shifts and cp dK/dV shifts
    assert len(shifts) == 2 * ((cp - 1) + (cp - 1) + cp)
    kv = 2 * 4 * 4 * (16 // cp) * 8  # K and V of [micro-batch 4, 4 heads, seq/cp, head dim 8]
    assert {c.numel for c in shifts} == {kv}
    assert [c.op for c in calls if c.op != "ring_shift"] == ["all_reduce(sum)"] * 2  # loss sum, token count
    assert all(c.group == tuple(range(cp)) for c in calls)


def test_ulysses_calls_with_dp():
    lowering = _lowering(cp=2, cp_mode="ulysses", dp=2)
    check_lowering(lowering)
    for rank, group in ((0, (0, 1)), (3, (2, 3))):  # cp groups are consecutive ranks of the data axis
        calls = _cp_calls(lowering, rank)
        # per layer: q, k, v and the output forward, the same four backward
        assert sum(c.op == "all_to_all" for c in calls) == 2 * 8
        assert {c.group for c in calls} == {group}
    dp_calls = [c for c in rank_calls(lowering.rank_program(0)).calls if c.channel == "dp"]
    assert dp_calls and {c.group for c in dp_calls} == {(0, 1, 2, 3)}  # gradients average over dp x cp


def test_a_rank_with_other_cp_attention_is_caught():
    ring, ulysses = _lowering(cp=2, cp_mode="ring"), _lowering(cp=2, cp_mode="ulysses")
    programs = [ring.rank_program(0), ulysses.rank_program(1)]
    with pytest.raises(CommunicationMismatchError, match="cp|ring_shift|all_to_all"):
        check_communication(programs)
    # the same two programs agree when the modes do
    check_communication([ring.rank_program(0), ring.rank_program(1)])
    assert dataclasses.replace(programs[1].config, cp_mode="ring") == programs[0].config


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp_with_tp_exchanges_each_tp_rank_s_heads_over_its_own_cp_group(mode):
    lowering = _lowering(cp=2, cp_mode=mode, tp=2, sequence_parallel=True)
    summary = check_lowering(lowering)
    assert summary.ranks == 4
    # rank = cp_index * tp + tp_index: the cp group of tp rank t is {t, t + 2}
    for rank, group in ((0, (0, 2)), (1, (1, 3)), (2, (0, 2))):
        calls = _cp_calls(lowering, rank)
        assert {c.group for c in calls} == {group}
        tp_calls = [c for c in rank_calls(lowering.rank_program(rank)).calls if c.channel == "tp"]
        assert tp_calls and {c.group for c in tp_calls} == {(rank - rank % 2, rank - rank % 2 + 1)}
    calls = _cp_calls(lowering, 0)
    if mode == "ring":  # K/V of [micro-batch 4, 4 / tp heads, seq / cp, head dim 8]
        assert {c.numel for c in calls if c.op == "ring_shift"} == {2 * 4 * 2 * 8 * 8}
    else:  # q of [4, 2 heads, 8, 8] traded for [4, 1 head, 16, 8]: the tensor's elements
        assert {c.numel for c in calls if c.op == "all_to_all"} == {4 * 2 * 8 * 8}
