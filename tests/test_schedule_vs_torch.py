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
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from passes.ir.schedule.actions import B, F, Kind
from passes.ir.schedule.build import (
    add_communication, gpipe_compute, interleaved_1f1b_compute, one_f_one_b_compute, stage_placement,
)
from passes.ir.schedule.validate import validate

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

SINGLE = [(p, m) for p, m in itertools.product((2, 4, 8), (2, 4, 8, 16)) if m >= p]
INTERLEAVED = [(p, v, m) for p, v, m in itertools.product((2, 4), (2, 4), (4, 8, 16)) if m % p == 0]
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B"}


def _stages(p: int, v: int, rank: int) -> list[SimpleNamespace]:
    n = p * v
    return [SimpleNamespace(stage_index=rank + k * p, num_stages=n, group_size=p, group_rank=rank,
                            is_first=rank + k * p == 0, is_last=rank + k * p == n - 1, stage_index_to_group_rank=None)
            for k in range(v)]


def _torch_order(cls, p: int, v: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """(stage, "F"/"B", micro-batch) of each rank's compute actions in torch's ``pipeline_order``."""
    out = {}
    for rank in range(p):
        stages = _stages(p, v, rank)
        schedule = cls(stages if v > 1 else stages[0], m)
        out[rank] = [(a.stage_index, _KINDS[a.computation_type.name], a.microbatch_index)
                     for a in schedule.pipeline_order[rank] if a is not None and a.computation_type.name in _KINDS]
    return out


def _our_order(schedule) -> dict[int, list[tuple[int, str, int]]]:
    return {r: [(a.stage, "F" if a.kind == Kind.FORWARD else "B", a.microbatch) for a in actions]
            for r, actions in schedule.items()}


def _as_torch(schedule) -> dict:
    """Our compute lists as torch ``_Action`` lists."""
    kinds = {Kind.FORWARD: schedules._ComputationType.FORWARD, Kind.BACKWARD: schedules._ComputationType.FULL_BACKWARD}
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


def _cases():
    for p, m in SINGLE:
        yield "gpipe", p, 1, m, schedules.ScheduleGPipe, gpipe_compute(p, m)
        yield "1f1b", p, 1, m, schedules.Schedule1F1B, one_f_one_b_compute(p, m)
    for p, v, m in INTERLEAVED:
        yield "interleaved", p, v, m, schedules.ScheduleInterleaved1F1B, interleaved_1f1b_compute(p, m, v)


@pytest.mark.parametrize("name, p, v, m, cls, ours", list(_cases()),
                         ids=[f"{c[0]}-p{c[1]}-v{c[2]}-m{c[3]}" for c in _cases()])
def test_each_passes_the_others_deadlock_simulation(name, p, v, m, cls, ours):
    n = p * v
    # ours through torch's simulator: torch's own send/recv insertion, then its dry run
    as_torch = _as_torch(ours)
    with_comms = schedules._add_send_recv(as_torch, stage_to_rank=lambda s: s % p, num_stages=n)
    schedules._simulate_comms_compute(with_comms, stage_to_rank=lambda s: s % p, num_stages=n)  # raises on deadlock
    # torch's through ours: our communication lowering, then our validation (static + executed)
    theirs = _torch_order(cls, p, v, m)
    if name == "1f1b":
        theirs = _last_rank_1f1b_fixed(theirs, p)
    compute = {r: [F(s, i) if k == "F" else B(s, i) for s, k, i in acts] for r, acts in theirs.items()}
    validate(add_communication(compute, stage_placement(p, v)))


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
