"""Pipeline schedules as data: text form, generators, validation, simulation against published formulas."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.errors import PartitionerError
from passes.ir.schedule import (
    Action,
    Kind,
    ScheduleError,
    add_communication,
    compute_only,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    one_f_one_b_compute,
    parse_action,
    parse_schedule,
    peak_in_flight,
    simulate,
    stage_placement,
    validate,
)
from passes.ir.schedule.actions import COMM_KINDS as COMM


def _all_schedules(p: int, m: int, v: int):
    yield "gpipe", gpipe(p, m), 1
    yield "1f1b", one_f_one_b(p, m), 1
    if m % p == 0:
        yield "interleaved", interleaved_1f1b(p, m, v), v


# --- text form ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, action", [
    ("2F0", Action(Kind.FORWARD, 2, 0)),
    ("1B3", Action(Kind.BACKWARD, 1, 3)),
    ("2SEND_F0->3", Action(Kind.SEND_F, 2, 0, 3)),
    ("3RECV_F0<-2", Action(Kind.RECV_F, 3, 0, 2)),
    ("1SEND_B12->0", Action(Kind.SEND_B, 1, 12, 0)),
    ("0RECV_B3<-1", Action(Kind.RECV_B, 0, 3, 1)),
    ("ALL_REDUCE", Action(Kind.ALL_REDUCE)),
    ("STEP", Action(Kind.OPTIMIZER_STEP)),
])
def test_action_text_round_trip(text, action):
    assert parse_action(text) == action
    assert str(action) == text


@pytest.mark.parametrize("bad", ["", "F0", "2X0", "2F", "2SEND_F0", "2SEND_F0<-1", "2F0->1", "STEP3", "1RECV_B0->2"])
def test_parse_action_rejects_malformed_text(bad):
    with pytest.raises(ScheduleError, match="expected STAGE KIND MICROBATCH"):
        parse_action(bad)


def test_action_fields_are_checked():
    with pytest.raises(ScheduleError, match="needs a peer"):
        Action(Kind.SEND_F, 0, 0)
    with pytest.raises(ScheduleError, match="whole rank"):
        Action(Kind.ALL_REDUCE, stage=0)
    with pytest.raises(ScheduleError, match="microbatch >= 0"):
        Action(Kind.FORWARD, 0, -1)
    assert issubclass(ScheduleError, PartitionerError)


def test_schedule_text_round_trip_and_errors():
    schedule = interleaved_1f1b(2, 4, 2)
    text = format_schedule(schedule)
    assert text.splitlines()[0].startswith("rank 0: 0F0 0SEND_F0->1 ")
    assert parse_schedule(text) == schedule
    assert parse_schedule("# comment\n\nrank 1: 1F0 1B0\nrank 0:\n") == {1: [parse_action("1F0"), parse_action("1B0")], 0: []}
    with pytest.raises(ScheduleError, match="line 2: rank 0 is listed twice"):
        parse_schedule("rank 0: 0F0\nrank 0: 0B0\n")
    with pytest.raises(ScheduleError, match="line 1: expected 'rank R:"):
        parse_schedule("0F0 0B0\n")


# --- generators -----------------------------------------------------------------------------


@pytest.mark.parametrize("p, m, v", [(p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 4, 6, 8) for v in (1, 2, 3)])
def test_generators_validate_and_run_each_microbatch_once(p, m, v):
    for name, schedule, chunks in _all_schedules(p, m, v):
        validate(schedule)
        n_stages = p * chunks
        placement = stage_placement(p, chunks)
        for kind in (Kind.FORWARD, Kind.BACKWARD):
            done = sorted((a.stage, a.microbatch) for acts in schedule.values() for a in acts if a.kind == kind)
            assert done == sorted(itertools.product(range(n_stages), range(m))), (name, kind)
        for rank, actions in schedule.items():
            assert actions[-2:] == [Action(Kind.ALL_REDUCE), Action(Kind.OPTIMIZER_STEP)], (name, rank)
            assert all(placement[a.stage] == rank for a in actions if a.stage is not None)
        # One message per cross-rank edge per microbatch and direction: interleaving sends v times more.
        sends = sum(a.kind in (Kind.SEND_F, Kind.SEND_B) for acts in schedule.values() for a in acts)
        assert sends == 2 * m * (n_stages - 1) if p > 1 else sends == 0


def test_one_f_one_b_order_on_four_ranks():
    compute = one_f_one_b_compute(4, 6)
    # rank 0 warms up with p - 1 = 3 forwards, the last rank alternates from the start
    assert " ".join(map(str, compute[0][:6])) == "0F0 0F1 0F2 0F3 0B0 0F4"
    assert " ".join(map(str, compute[3][:4])) == "3F0 3B0 3F1 3B1"


def test_interleaved_rejects_m_not_divisible_by_p():
    with pytest.raises(ScheduleError, match=r"m=6 is not divisible by p=4 \(v=2\); use m=4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match="use m=4,"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ScheduleError, match="chunks per rank v must be an int >= 1"):
        interleaved_1f1b(2, 2, 0)
    # v == 1 is plain 1F1B and has no divisibility constraint
    assert interleaved_1f1b(4, 6, 1) == one_f_one_b(4, 6)


def test_lowering_is_a_pure_invertible_function():
    compute = one_f_one_b_compute(3, 4)
    before = format_schedule(compute)
    lowered = lower(compute, stage_placement(3))
    assert format_schedule(compute) == before  # input untouched
    assert compute_only(lowered) == compute
    with pytest.raises(ScheduleError, match="compute actions only"):
        add_communication(lowered, stage_placement(3))
    with pytest.raises(ScheduleError, match="stage_to_rank puts stage 1 on rank 0"):
        add_communication(compute, {0: 0, 1: 0, 2: 2})


# --- in-flight activations ------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_peak_in_flight_one_f_one_b_and_gpipe(p, m):
    assert [peak_in_flight(one_f_one_b(p, m), r) for r in range(p)] == [min(p - r, m) for r in range(p)]
    assert [peak_in_flight(gpipe(p, m), r) for r in range(p)] == [m] * p


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3)])
def test_peak_in_flight_interleaved_matches_korthikanti(p, m, v):
    # Korthikanti et al. 2022: the first stage of the interleaved schedule holds
    # p * (1 + (p - 1) / (p v)) microbatches of full-stage activations; each chunk holds 1/v of them.
    chunks = peak_in_flight(interleaved_1f1b(p, m, v), 0)
    assert chunks / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


# --- simulation -----------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(1, 3), (2, 4), (4, 4), (4, 8), (3, 7), (4, 2)])
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (1.0, 1.0), (0.003, 0.005)])
def test_gpipe_and_1f1b_makespan_and_bubble(p, m, tf, tb):
    for make in (gpipe, one_f_one_b):
        result = simulate(make(p, m), tf, tb)
        assert result.makespan == pytest.approx((m + p - 1) * (tf + tb))
        assert result.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (4, 16, 4), (3, 6, 2)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    # Narayanan et al. 2021: with v chunks (each tf/v, tb/v) the bubble time is (p - 1)(tf + tb) / v.
    tf, tb = 1.0, 2.0
    result = simulate(interleaved_1f1b(p, m, v), tf / v, tb / v)
    ideal = m * (tf + tb)
    assert result.makespan - ideal == pytest.approx((p - 1) * (tf + tb) / v)
    assert result.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
    plain = simulate(one_f_one_b(p, m), tf, tb)
    assert (plain.makespan - ideal) / (result.makespan - ideal) == pytest.approx(v)


def test_simulation_timeline_and_communication_time():
    p, m, tf, tb, c = 3, 4, 1.0, 2.0, 0.25
    result = simulate(gpipe(p, m), tf, tb, comm_time=c, grad_sync_time=0.5, step_time=0.1)
    # GPipe's critical path crosses p - 1 links forward and p - 1 back, then sync and step.
    assert result.makespan == pytest.approx((m + p - 1) * (tf + tb) + 2 * (p - 1) * c + 0.5 + 0.1)
    for rank, timeline in result.timelines.items():
        assert [t.action for t in timeline] == gpipe(p, m)[rank]
        assert all(t.start <= t.end for t in timeline)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(timeline, timeline[1:]))
    # a receive ends exactly when its message arrives: send post + comm_time
    first_recv = result.timelines[1][0]
    assert str(first_recv.action) == "1RECV_F0<-0" and first_recv.end == pytest.approx(tf + c)
    # per-stage times: the slowest stage sets the pace of the steady state
    slow = simulate(one_f_one_b(2, 6), {0: 1.0, 1: 3.0}, {0: 1.0, 1: 3.0})
    assert slow.makespan >= 6 * 6.0
    assert slow.bubble_fraction(1) < slow.bubble_fraction(0)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb1p", "zbv"])
def test_the_dataflow_makespan_is_the_simulators_at_zero_message_time(name):
    """compute_makespan (what the cost model times zero-bubble schedules with) against simulate of
    the lowered lists, over pipeline depths, micro-batch counts around the phase changes and
    weight-half shares."""
    from passes.ir.schedule import build, compute_makespan
    checked = 0
    for p in range(2, 9):
        v = 2 if name in ("interleaved", "zbv") else 1
        for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p} - {0}):
            if name == "interleaved" and m % p:
                continue
            full = build(name, p, m, v, check=False)
            for share in (0.25, 0.5, 0.7):
                f, b = 1.0 / v, 2.0 / v
                expected = simulate(full, f, b, weight_time=b * share, check=False).makespan
                assert compute_makespan(compute_only(full), f, b, b * share) == pytest.approx(expected, rel=1e-12), \
                    (name, p, m, share)
                checked += 1
    assert checked > 50


def test_the_dataflow_makespan_refuses_lists_that_cannot_complete():
    from passes.ir.schedule import compute_makespan
    compute = compute_only(one_f_one_b(2, 2))
    compute[1] = list(reversed(compute[1]))  # a backward before its forward
    with pytest.raises(ScheduleError, match="cannot complete"):
        compute_makespan(compute, 1.0, 2.0, 1.0)


# --- broken schedules -----------------------------------------------------------------------


def test_dropped_recv_reports_mismatch_with_grid():
    schedule = one_f_one_b(2, 3)
    schedule[1] = [a for a in schedule[1] if str(a) != "1RECV_F1<-0"]
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    assert "0SEND_F1->1 has no matching 1RECV_F1<-0 on rank 1" in message
    assert "1F1 has no 1RECV_F1<-0 on rank 1" in message
    assert "| rank 0" in message and "| rank 1" in message and "[1F1]" in message


def test_swapped_actions_deadlock_with_grid():
    schedule = one_f_one_b(2, 3)
    # rank 0 waits for the first gradient before sending the first activation: a cycle.
    recv = parse_action("0RECV_B0<-1")
    schedule[0].remove(recv)
    schedule[0].insert(0, recv)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    assert "deadlocks" in message
    assert "rank 0 stuck at step 0 on 0RECV_B0<-1: waits for 1SEND_B0->0 on rank 1" in message
    assert "rank 1 stuck at step 0 on 1RECV_F0<-0: waits for 0SEND_F0->1 on rank 0" in message
    grid_rows = [line for line in message.splitlines() if line.startswith("step ")]
    assert grid_rows[0].startswith("step 0  | [0RECV_B0<-1] | [1RECV_F0<-0]") and grid_rows[0].endswith("<- stuck")


def test_backward_before_forward_and_misplaced_stage():
    schedule = gpipe(2, 2)
    i, j = schedule[0].index(parse_action("0F1")), schedule[0].index(parse_action("0B1"))
    schedule[0][i], schedule[0][j] = schedule[0][j], schedule[0][i]
    with pytest.raises(ScheduleError, match=r"0B1 comes before its forward 0F1"):
        validate(schedule)
    two_homes = {0: [parse_action("0F0"), parse_action("0B0")], 1: [parse_action("0F1"), parse_action("0B1")]}
    with pytest.raises(ScheduleError, match="stage 0 computes on rank 0 and on rank 1"):
        validate(two_homes)


def test_step_before_grad_sync_is_rejected():
    schedule = one_f_one_b(2, 2)
    schedule[1][-2:] = schedule[1][-2:][::-1]
    with pytest.raises(ScheduleError, match="rank 1 step .*: STEP before ALL_REDUCE"):
        validate(schedule)


def test_rendezvous_sends_deadlock_naive_1f1b():
    # With blocking (rendezvous) sends, 1F1B lowered one send at a time deadlocks: rank 0 sends
    # activation 1 while rank 1 sends gradient 0. The runtime must post sends (isend) or batch
    # a send with the opposite receive.
    schedule = one_f_one_b(2, 3)
    validate(schedule)
    with pytest.raises(ScheduleError, match="(?s)rendezvous sends.*rank 0 stuck at step 3 on 0SEND_F1->1"):
        validate(schedule, blocking_sends=True)
    validate(gpipe(2, 3), blocking_sends=True)  # GPipe has no crossing messages


# --- property test --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 4), k=st.integers(1, 3), v=st.integers(1, 3), extra=st.integers(0, 3),
       tf=st.sampled_from([0.5, 1.0, 2.0]), tb=st.sampled_from([0.5, 1.0, 2.0, 3.0]))
def test_property_random_sizes(p, k, v, extra, tf, tb):
    m_any = k * p + extra  # gpipe / 1f1b take any m; interleaved needs a multiple of p
    for make in (gpipe, one_f_one_b):
        schedule = make(p, m_any)
        result = simulate(schedule, tf, tb)
        assert result.makespan == pytest.approx((m_any + p - 1) * (tf + tb))
        assert parse_schedule(format_schedule(schedule)) == schedule
    m = k * p
    schedule = interleaved_1f1b(p, m, v)
    validate(schedule)
    assert parse_schedule(format_schedule(schedule)) == schedule
    assert lower(compute_only(schedule), stage_placement(p, v)) == schedule
    result = simulate(schedule, tf / v, tb / v)
    assert result.makespan == pytest.approx((m + (p - 1) / v) * (tf + tb))
    peaks = [peak_in_flight(schedule, r) for r in range(p)]
    assert max(peaks) == peaks[0] <= v * m


# --- batched point-to-point, as NCCL runs it --------------------------------------------------
@pytest.mark.parametrize("name,p,m,v", [(n, p, m, v) for p in (2, 3, 4) for m in (1, 2, 4, 8)
                                        for n, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
                                        if n != "interleaved" or m % p == 0])
def test_every_schedule_completes_with_batched_rendezvous_p2p(name, p, m, v):
    from passes.ir.schedule import build
    from passes.ir.schedule.validate import check_batches, comm_batches

    schedule = build(name, p, m, v)
    check_batches(schedule)
    runs = [run for r in schedule for _, run in comm_batches(schedule[r])]
    assert runs and all(a.kind in COMM for run in runs for a in run)


def test_one_stream_for_both_directions_would_deadlock_interleaved():
    # the reason the runtime posts messages to lower ranks on a second group: on one stream per
    # rank pair, interleaved 1F1B on 2 ranks waits in a cycle (rank 0's send of a backward
    # gradient queues behind its own batch that needs rank 1's later one, and back)
    from passes.ir.schedule import build
    from passes.ir.schedule.validate import check_batches

    schedule = build("interleaved", 2, 4, 2)
    with pytest.raises(ScheduleError, match="deadlocks with batched point-to-point"):
        check_batches(schedule, stream=lambda rank, a: "one")
    check_batches(schedule)


def test_messages_posted_in_another_order_than_received_are_refused():
    from passes.ir.schedule.validate import check_message_order

    schedule = one_f_one_b(2, 2)
    sends = [i for i, a in enumerate(schedule[0]) if a.kind == Kind.SEND_F]
    i, j = sends[:2]
    schedule[0][i], schedule[0][j] = schedule[0][j], schedule[0][i]
    with pytest.raises(ScheduleError, match="rank 0 sends rank 1 its messages in another order"):
        check_message_order(schedule)


# --------------------------------------------------------------------------------------------
# Zero-bubble schedules: the backward split into I (input gradient) and W (weight gradients).

ZB_CASES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def test_split_backward_actions_round_trip_through_text():
    from passes.ir.schedule import format_schedule, parse_schedule, zb1p

    schedule = zb1p(2, 3)
    assert "0I0" in format_schedule(schedule) and "1W2" in format_schedule(schedule)
    assert parse_schedule(format_schedule(schedule)) == schedule


@pytest.mark.parametrize("name, v", [("zb1p", 1), ("zbv", 2)])
@pytest.mark.parametrize("p, m", ZB_CASES)
def test_zero_bubble_schedules_complete_and_split_every_backward(name, v, p, m):
    from passes.ir.schedule import build
    from passes.ir.schedule.actions import Kind

    schedule = build(name, p, m, v)  # validated and checked under NCCL batching
    for rank, actions in schedule.items():
        kinds = [a.kind for a in actions]
        assert Kind.BACKWARD not in kinds
        halves = {(a.kind, a.stage, a.microbatch) for a in actions if a.kind in (Kind.BACKWARD_INPUT,
                                                                                   Kind.BACKWARD_WEIGHT)}
        stages = {a.stage for a in actions if a.kind == Kind.FORWARD}
        assert len(stages) == v
        assert halves == {(k, s, i) for k in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) for s in stages
                          for i in range(m)}


@pytest.mark.parametrize("p, m", [(p, m) for p, m in ZB_CASES if m >= p])
def test_zb1p_bubble_is_p_minus_1_times_f_plus_i_minus_w(p, m):
    """Qi et al. 2023: ZB-H1's bubble is (p-1)(F + I - W); with F = I = W that is a third of 1F1B's
    (p-1)(F + B). Balanced stages, no communication."""
    from passes.ir.schedule import one_f_one_b, simulate, zb1p

    f, i, w = 1.0, 1.0, 1.0
    zb = simulate(zb1p(p, m), f, i + w, weight_time=w)
    base = simulate(one_f_one_b(p, m), f, i + w)
    assert zb.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
    assert base.makespan == pytest.approx((m + p - 1) * (f + i + w))


@pytest.mark.parametrize("p, m", [(p, m) for p, m in ZB_CASES if m >= p])
def test_zb1p_holds_at_most_p_micro_batches_on_every_rank(p, m):
    """ZB-H1 keeps 1F1B's peak (p on rank 0) on every rank: W frees a micro-batch's graph."""
    from passes.ir.schedule import peak_in_flight, zb1p

    assert [peak_in_flight(zb1p(p, m), r) for r in range(p)] == [p] * p


def test_zbv_places_the_first_and_last_stage_on_rank_0():
    from passes.ir.schedule import stage_placement

    assert stage_placement(3, 2, shape="v") == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16)])
def test_zbv_bubble_below_zb1p_below_1f1b(p, m):
    from passes.ir.schedule import build, simulate

    def bubble(name, v):
        return simulate(build(name, p, m, v), 1.0 / v, 2.0 / v).bubble_fraction()

    assert bubble("zbv", 2) < bubble("zb1p", 1) < bubble("1f1b", 1)


def test_validation_catches_broken_split_backwards():
    from passes.ir.schedule import ScheduleError, validate, zb1p
    from passes.ir.schedule.actions import Kind, B

    good = zb1p(2, 2)
    # W before its I
    broken = dict(good)
    acts = list(broken[1])
    wi = next(k for k, a in enumerate(acts) if a.kind == Kind.BACKWARD_WEIGHT)
    ii = next(k for k, a in enumerate(acts) if a.kind == Kind.BACKWARD_INPUT and a.microbatch == acts[wi].microbatch)
    acts[wi], acts[ii] = acts[ii], acts[wi]
    broken[1] = acts
    with pytest.raises(ScheduleError, match="before its input half"):
        validate(broken)
    # a W missing
    missing = dict(good)
    missing[0] = [a for a in good[0] if not (a.kind == Kind.BACKWARD_WEIGHT and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="missing \\[1\\]"):
        validate(missing)
    # a full B mixed into a split stage
    mixed = dict(good)
    mixed[0] = [B(0, 1) if a.kind == Kind.BACKWARD_WEIGHT and a.microbatch == 1 else a for a in good[0]]
    with pytest.raises(ScheduleError, match="both full backwards"):
        validate(mixed)
