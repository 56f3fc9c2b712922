"""Our schedules against ``torch.distributed.pipelining``'s: the same compute order per rank, and
each passes the other's deadlock simulation.

torch builds a schedule's ``pipeline_order`` (rank -> actions) when it is constructed; stand-in
stages with the attributes it reads (index, count, group size and rank) are enough, so no process
group is needed. The cases are the (pipeline degree, micro-batches, stages per rank) that torch's
own schedule tests draw from, within what each schedule accepts (torch's 1F1B wants at least as
many micro-batches as stages; interleaved 1F1B wants them a multiple of the degree).

One difference, explained: torch's ``Schedule1F1B.pipeline_order`` of the last rank numbers its
forwards from 1 (it lists ``F{m}``, a micro-batch that does not exist, and no ``F0``); its runtime
does not execute from that table. Shifted back by one, it is ours.

Zero-bubble: our ZB-H1 (``zb1p``) is torch's ``ScheduleInterleavedZeroBubble`` with one stage
per rank, and our ZB-V is its ``ScheduleZBVZeroBubble`` (stages r and 2p-1-r on rank r), action
for action, including the I (input gradient) and W (weight gradient) halves of each backward.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from passes.ir.schedule.actions import B, F, I, Kind, W
from passes.ir.schedule.build import (
    add_communication, gpipe_compute, interleaved_1f1b_compute, one_f_one_b_compute, stage_placement, zb1p_compute,
    zbv_compute,
)
from passes.ir.schedule.validate import check_batches, message_stream_by_kind, validate

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

SINGLE = [(p, m) for p, m in itertools.product((2, 4, 8), (2, 4, 8, 16)) if m >= p]
INTERLEAVED = [(p, v, m) for p, v, m in itertools.product((2, 4), (2, 4), (4, 8, 16)) if m % p == 0]
# torch's ZB-V builds its phases for at least 2p - 1 micro-batches and drops the rest; its tests
# use m >= 2p (the schedule's guarantee of a full steady state)
ZBV = [(p, m) for p, m in itertools.product((2, 4, 8), (2, 4, 8, 16)) if m >= 2 * p]
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
_OURS = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I", Kind.BACKWARD_WEIGHT: "W"}
_MAKE = {"F": F, "B": B, "I": I, "W": W}


def _stages(p: int, v: int, rank: int, shape: str = "loop") -> list[SimpleNamespace]:
    n = p * v
    index = [rank + k * p for k in range(v)] if shape == "loop" else [rank, 2 * p - 1 - rank]
    return [SimpleNamespace(stage_index=i, num_stages=n, group_size=p, group_rank=rank, is_first=i == 0,
                            is_last=i == n - 1, stage_index_to_group_rank=None, submod=torch.nn.Identity())
            for i in index]


def _torch_order(cls, p: int, v: int, m: int, shape: str = "loop") -> dict[int, list[tuple[int, str, int]]]:
    """(stage, "F"/"B"/"I"/"W", micro-batch) of each rank's compute actions in torch's ``pipeline_order``."""
    out = {}
    for rank in range(p):
        stages = _stages(p, v, rank, shape)
        one = v == 1 and cls in (schedules.ScheduleGPipe, schedules.Schedule1F1B)
        schedule = cls(stages[0] if one else stages, m)
        out[rank] = [(a.stage_index, _KINDS[a.computation_type.name], a.microbatch_index)
                     for a in schedule.pipeline_order[rank] if a is not None and a.computation_type.name in _KINDS]
    return out


def _our_order(schedule) -> dict[int, list[tuple[int, str, int]]]:
    return {r: [(a.stage, _OURS[a.kind], a.microbatch) for a in actions] for r, actions in schedule.items()}


def _as_torch(schedule) -> dict:
    """Our compute lists as torch ``_Action`` lists."""
    ct = schedules._ComputationType
    kinds = {Kind.FORWARD: ct.FORWARD, Kind.BACKWARD: ct.FULL_BACKWARD, Kind.BACKWARD_INPUT: ct.BACKWARD_INPUT,
             Kind.BACKWARD_WEIGHT: ct.BACKWARD_WEIGHT}
    return {r: [schedules._Action(a.stage, kinds[a.kind], a.microbatch) for a in actions]
            for r, actions in schedule.items()}


def _last_rank_1f1b_fixed(order: dict, p: int) -> dict:
    """torch's 1F1B table with the last rank's forwards numbered from 0 (see the module docstring)."""
    fixed = dict(order)
    fixed[p - 1] = [(s, k, i - 1 if k == "F" else i) for s, k, i in order[p - 1]]
    return fixed


@pytest.mark.parametrize("p, m", SINGLE)
def test_gpipe_is_torchs_gpipe(p, m):
    assert _our_order(gpipe_compute(p, m)) == _torch_order(schedules.ScheduleGPipe, p, 1, m)


@pytest.mark.parametrize("p, m", SINGLE)
def test_1f1b_is_torchs_1f1b(p, m):
    theirs = _torch_order(schedules.Schedule1F1B, p, 1, m)
    ours = _our_order(one_f_one_b_compute(p, m))
    assert {r: ours[r] for r in range(p - 1)} == {r: theirs[r] for r in range(p - 1)}
    # the one difference: torch's last rank lists F1..Fm (see the module docstring)
    assert [i for _, k, i in theirs[p - 1] if k == "F"] == list(range(1, m + 1))
    assert ours == _last_rank_1f1b_fixed(theirs, p)


@pytest.mark.parametrize("p, v, m", INTERLEAVED)
def test_interleaved_1f1b_is_torchs_interleaved_1f1b(p, v, m):
    assert _our_order(interleaved_1f1b_compute(p, m, v)) == _torch_order(schedules.ScheduleInterleaved1F1B, p, v, m)


@pytest.mark.parametrize("p, m", SINGLE)
def test_zb1p_is_torchs_zero_bubble_with_one_stage_per_rank(p, m):
    assert _our_order(zb1p_compute(p, m)) == _torch_order(schedules.ScheduleInterleavedZeroBubble, p, 1, m)


@pytest.mark.parametrize("p, m", ZBV)
def test_zbv_is_torchs_zbv(p, m):
    assert _our_order(zbv_compute(p, m)) == _torch_order(schedules.ScheduleZBVZeroBubble, p, 2, m, "v")


def _cases():
    for p, m in SINGLE:
        yield "gpipe", p, 1, m, schedules.ScheduleGPipe, gpipe_compute(p, m)
        yield "1f1b", p, 1, m, schedules.Schedule1F1B, one_f_one_b_compute(p, m)
        yield "zb1p", p, 1, m, schedules.ScheduleInterleavedZeroBubble, zb1p_compute(p, m)
    for p, v, m in INTERLEAVED:
        yield "interleaved", p, v, m, schedules.ScheduleInterleaved1F1B, interleaved_1f1b_compute(p, m, v)
    for p, m in ZBV:
        yield "zbv", p, 2, m, schedules.ScheduleZBVZeroBubble, zbv_compute(p, m)


@pytest.mark.parametrize("name, p, v, m, cls, ours", list(_cases()),
                         ids=[f"{c[0]}-p{c[1]}-v{c[2]}-m{c[3]}" for c in _cases()])
def test_each_passes_the_others_deadlock_simulation(name, p, v, m, cls, ours):
    n = p * v
    shape = "v" if name == "zbv" else "loop"
    placement = stage_placement(p, v, shape=shape)
    # ours through torch's simulator: torch's own send/recv insertion, then its dry run
    as_torch = _as_torch(ours)
    with_comms = schedules._add_send_recv(as_torch, stage_to_rank=placement.__getitem__, num_stages=n)
    schedules._simulate_comms_compute(with_comms, stage_to_rank=placement.__getitem__, num_stages=n)  # raises on deadlock
    # torch's through ours: our communication lowering, then our validation (static + executed)
    # and, for the zero-bubble ones, our NCCL batching check with the streams the runtime uses
    theirs = _torch_order(cls, p, v, m, shape)
    if name == "1f1b":
        theirs = _last_rank_1f1b_fixed(theirs, p)
    compute = {r: [_MAKE[k](s, i) for s, k, i in acts] for r, acts in theirs.items()}
    lowered = add_communication(compute, placement)
    validate(lowered)
    if name == "zbv":
        check_batches(lowered, stream=message_stream_by_kind)


def test_both_simulators_catch_a_deadlock():
    """The cross-check can fail: rank 0 running a backward before its forward deadlocks in both."""
    broken = one_f_one_b_compute(2, 4)
    broken[0] = [broken[0][4]] + broken[0][:4] + broken[0][5:]  # 0B? first: it waits for rank 1 forever
    assert broken[0][0].kind == Kind.BACKWARD
    as_torch = _as_torch(broken)
    with pytest.raises(Exception):
        schedules._simulate_comms_compute(schedules._add_send_recv(as_torch, stage_to_rank=lambda s: s % 2,
                                                                   num_stages=2),
                                          stage_to_rank=lambda s: s % 2, num_stages=2)
    from passes.ir.schedule.actions import ScheduleError
    with pytest.raises(ScheduleError):
        validate(add_communication(broken, stage_placement(2, 1)))
