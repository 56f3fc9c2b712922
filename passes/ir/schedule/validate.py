"""Checking and timing a whole pipeline schedule on CPU, without running a model.

Execution model (what :func:`validate` proves deadlock-free and :func:`simulate` times):

* each rank runs its list in order, one action at a time;
* a SEND posts its message and returns at once (the runtime must use ``isend``); with
  ``blocking_sends=True`` a SEND instead waits until the peer is at the matching RECV
  (rendezvous, like a large ``dist.send`` on gloo), and both complete together;
* a RECV waits until the matching SEND is posted (plus ``comm_time`` seconds in transit);
* forward ``sF i`` needs ``(s-1)F i`` when stage s-1 is on the same rank, else its ``RECV_F``;
  backward ``sB i`` needs ``sF i`` and ``(s+1)B i`` (same rank) or its ``RECV_B``; a split
  backward's input half ``sI i`` needs what ``sB i`` needs (``(s+1)I i`` stands for ``(s+1)B i``)
  and its weight half ``sW i`` needs ``sI i`` only;
* ALL_REDUCE and STEP are local to the rank (the data-parallel peers are not in the schedule).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from passes.ir.schedule.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    GRAD_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    Action,
    Kind,
    ScheduleError,
    format_grid,
)

Schedule = dict[int, list[Action]]

# A message is identified by direction, the stage that sends it, and the microbatch.
_Msg = tuple[str, int, int]


def _message(action: Action) -> _Msg:
    """The message a SEND/RECV action carries: ("F"|"B", sending stage, microbatch)."""
    s, i = action.stage, action.microbatch
    assert s is not None and i is not None
    if action.kind == Kind.SEND_F:
        return ("F", s, i)
    if action.kind == Kind.RECV_F:
        return ("F", s - 1, i)
    if action.kind == Kind.SEND_B:
        return ("B", s, i)
    return ("B", s + 1, i)  # RECV_B: the grad comes from the next stage


def stage_to_rank_of(schedule: Schedule) -> dict[int, int]:
    """The rank each stage's compute actions run on; raises if a stage appears on two ranks."""
    placement: dict[int, int] = {}
    for rank in sorted(schedule):
        for step, action in enumerate(schedule[rank]):
            if action.kind in COMPUTE_KINDS:
                assert action.stage is not None
                other = placement.setdefault(action.stage, rank)
                if other != rank:
                    raise ScheduleError(
                        f"stage {action.stage} computes on rank {other} and on rank {rank} (step {step}: "
                        f"{action}); a stage must live on one rank\n\n{format_grid(schedule, {rank: step}, 'here')}"
                    )
    return placement


# ---------------------------------------------------------------------------------------------
# Static checks: counts, order within a rank, and matching of sends with receives.


def _static_problems(schedule: Schedule, placement: dict[int, int]) -> list[tuple[int, int, str]]:
    """Every (rank, step, description) problem found without executing the schedule."""
    problems: list[tuple[int, int, str]] = []
    n_stages = len(placement)
    if sorted(placement) != list(range(n_stages)):
        problems.append((min(schedule), 0, f"stages must be 0..{n_stages - 1}, found {sorted(placement)}"))
        return problems

    # position[(rank, kind, stage, microbatch)] = step; duplicates are problems.
    position: dict[tuple[int, Kind, int | None, int | None], int] = {}
    microbatches: dict[tuple[Kind, int], set[int]] = {}
    for rank, actions in schedule.items():
        for step, a in enumerate(actions):
            key = (rank, a.kind, a.stage, a.microbatch)
            if key in position:
                problems.append((rank, step, f"{a} appears twice on rank {rank} (first at step {position[key]})"))
                continue
            position[key] = step
            if a.kind in COMPUTE_KINDS:
                assert a.stage is not None and a.microbatch is not None
                microbatches.setdefault((a.kind, a.stage), set()).add(a.microbatch)
            elif a.stage is not None and a.stage >= n_stages:
                problems.append((rank, step, f"{a} names stage {a.stage}, but only stages 0..{n_stages - 1} compute"))
            elif a.stage is not None and placement[a.stage] != rank:
                problems.append((rank, step, f"{a} runs on rank {rank}, but stage {a.stage} lives on rank {placement[a.stage]}"))

    # Every stage runs F and B (or I and W) once for the same microbatches 0..m-1 (those of
    # stage 0's forward).
    expected = microbatches.get((Kind.FORWARD, 0), set())
    m = len(expected)
    if expected != set(range(m)):
        problems.append((placement[0], 0, f"stage 0 forwards microbatches {sorted(expected)}; expected 0..{m - 1}"))
    for s in range(n_stages):
        split = bool(microbatches.get((Kind.BACKWARD_INPUT, s)) or microbatches.get((Kind.BACKWARD_WEIGHT, s)))
        if split and microbatches.get((Kind.BACKWARD, s)):
            problems.append((placement[s], 0, f"stage {s} runs both full backwards (B) and split ones (I/W); "
                             f"give each stage one kind"))
        kinds = (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) if split else (Kind.FORWARD, Kind.BACKWARD)
        for kind in kinds:
            got = microbatches.get((kind, s), set())
            if got != expected:
                missing, extra = sorted(expected - got), sorted(got - expected)
                problems.append((placement[s], 0, f"stage {s} runs {kind.value} for microbatches {sorted(got)}: "
                                 f"missing {missing}, unexpected {extra}"))

    def pos(rank: int, kind: Kind, s: int | None, i: int | None) -> int | None:
        return position.get((rank, kind, s, i))

    # Order and communication around every compute action.
    for rank, actions in schedule.items():
        for step, a in enumerate(actions):
            s, i = a.stage, a.microbatch
            if a.kind in GRAD_KINDS:
                f = pos(rank, Kind.FORWARD, s, i)
                if f is not None and f > step:
                    problems.append((rank, step, f"{a} comes before its forward {s}F{i} (step {f})"))
            if a.kind == Kind.BACKWARD_WEIGHT:
                b = pos(rank, Kind.BACKWARD_INPUT, s, i)
                if b is not None and b > step:
                    problems.append((rank, step, f"{a} comes before its input half {s}I{i} (step {b})"))
            if a.kind in COMPUTE_KINDS and a.kind != Kind.BACKWARD_WEIGHT:
                assert s is not None
                # The neighbour this compute action takes its input from.
                src = s - 1 if a.kind == Kind.FORWARD else s + 1
                if 0 <= src < n_stages and placement[src] != rank:
                    recv_kind = Kind.RECV_F if a.kind == Kind.FORWARD else Kind.RECV_B
                    r = pos(rank, recv_kind, s, i)
                    want = Action(recv_kind, s, i, placement[src])
                    if r is None:
                        problems.append((rank, step, f"{a} has no {want} on rank {rank}; stage {src} lives on "
                                         f"rank {placement[src]} (add_communication inserts it)"))
                    elif r > step:
                        problems.append((rank, step, f"{a} comes before its receive {want} (step {r})"))
                dst = s + 1 if a.kind == Kind.FORWARD else s - 1
                if 0 <= dst < n_stages and placement[dst] != rank:
                    send_kind = Kind.SEND_F if a.kind == Kind.FORWARD else Kind.SEND_B
                    if pos(rank, send_kind, s, i) is None:
                        want = Action(send_kind, s, i, placement[dst])
                        problems.append((rank, step, f"{a} has no {want} after it; stage {dst} on rank "
                                         f"{placement[dst]} waits for it"))
            if a.kind in SEND_KINDS:
                compute = Kind.FORWARD if a.kind == Kind.SEND_F else Kind.BACKWARD
                c = pos(rank, compute, s, i)
                if c is None and a.kind == Kind.SEND_B:
                    compute = Kind.BACKWARD_INPUT
                    c = pos(rank, compute, s, i)
                if c is not None and c > step:
                    problems.append((rank, step, f"{a} sends before {s}{compute.value}{i} (step {c}) computes it"))
            if a.kind == Kind.ALL_REDUCE:
                late = [str(b) for b in actions[step + 1:] if b.kind in COMPUTE_KINDS and b.kind != Kind.FORWARD]
                if late:
                    problems.append((rank, step, f"ALL_REDUCE before backward {', '.join(late[:3])}: the grads are not complete"))
            if a.kind == Kind.OPTIMIZER_STEP:
                late = [str(b) for b in actions[step + 1:]
                        if b.kind == Kind.ALL_REDUCE or (b.kind in COMPUTE_KINDS and b.kind != Kind.FORWARD)]
                if late:
                    problems.append((rank, step, f"STEP before {', '.join(late[:3])}: the step would use partial grads"))

    # Sends and receives pair up one to one, with consistent peers.
    sends: dict[_Msg, tuple[int, int, Action]] = {}
    recvs: dict[_Msg, tuple[int, int, Action]] = {}
    for rank, actions in schedule.items():
        for step, a in enumerate(actions):
            if a.kind in SEND_KINDS or a.kind in RECV_KINDS:
                table = sends if a.kind in SEND_KINDS else recvs
                table.setdefault(_message(a), (rank, step, a))
    for msg, (rank, step, a) in sends.items():
        direction, src, i = msg
        dst = src + 1 if direction == "F" else src - 1
        if not 0 <= dst < n_stages:
            problems.append((rank, step, f"{a} sends past the end of the pipeline (no stage {dst})"))
            continue
        if placement[dst] == rank:
            problems.append((rank, step, f"{a}: stage {dst} is on the same rank; drop the send"))
        if a.peer != placement[dst]:
            problems.append((rank, step, f"{a} goes to rank {a.peer}, but stage {dst} lives on rank {placement[dst]}"))
        if msg not in recvs:
            want = Action(Kind.RECV_F if direction == "F" else Kind.RECV_B, dst, i, rank)
            problems.append((rank, step, f"{a} has no matching {want} on rank {placement[dst]}"))
    for msg, (rank, step, a) in recvs.items():
        direction, src, i = msg
        if not 0 <= src < n_stages:
            problems.append((rank, step, f"{a} receives from beyond the pipeline (no stage {src})"))
            continue
        if a.peer != placement[src]:
            problems.append((rank, step, f"{a} expects rank {a.peer}, but stage {src} lives on rank {placement[src]}"))
        if msg not in sends:
            want = Action(Kind.SEND_F if direction == "F" else Kind.SEND_B, src, i, rank)
            problems.append((rank, step, f"{a} has no matching {want} on rank {placement[src]}"))
    return problems


# ---------------------------------------------------------------------------------------------
# Execution: one engine for the deadlock check and the timing simulation.


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One executed action: start and end in seconds since the schedule began."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True, slots=True)
class SimResult:
    """What :func:`simulate` measured.

    timelines: per rank, the executed actions in order with start/end times (seconds).
    makespan: time (seconds) when the last rank finishes.
    """

    timelines: dict[int, tuple[TimedAction, ...]]
    makespan: float

    def busy_time(self, rank: int) -> float:
        """Seconds rank ``rank`` spends in forward and backward compute."""
        return sum(t.end - t.start for t in self.timelines[rank] if t.action.kind in COMPUTE_KINDS)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle share of the makespan: ``1 - compute / makespan`` for one rank, or averaged over ranks."""
        ranks = [rank] if rank is not None else sorted(self.timelines)
        if self.makespan == 0:
            return 0.0
        return sum(1.0 - self.busy_time(r) / self.makespan for r in ranks) / len(ranks)


Duration = Callable[[Action], float]


def _execute(
    schedule: Schedule,
    placement: dict[int, int],
    duration: Duration,
    comm_time: float,
    blocking_sends: bool,
) -> tuple[dict[int, list[TimedAction]], dict[int, int]]:
    """Run every rank's list under the module's execution model.

    Returns the per-rank timelines and, for ranks that could not finish, the step they are stuck
    at (empty when the schedule completes). Times depend only on dependencies, not on the order in
    which ranks are visited, so the result is deterministic.
    """
    ranks = sorted(schedule)
    pc = {r: 0 for r in ranks}          # next step per rank
    free = {r: 0.0 for r in ranks}      # time each rank is next idle
    # (F|B|W, stage, mb) -> end time; an I is recorded as B (its input gradient is what B's is).
    done: dict[tuple[Kind, int, int], float] = {}
    received: dict[tuple[int, _Msg], float] = {}   # (rank, message) -> end time of its RECV
    posted: dict[_Msg, float] = {}                 # message -> time its SEND was posted
    timelines: dict[int, list[TimedAction]] = {r: [] for r in ranks}
    n_stages = len(placement)

    def input_ready(rank: int, a: Action) -> float | None:
        """Time the inputs of compute/send action ``a`` are available on ``rank``, or None."""
        s, i = a.stage, a.microbatch
        assert s is not None and i is not None
        if a.kind in SEND_KINDS:
            return done.get((Kind.FORWARD if a.kind == Kind.SEND_F else Kind.BACKWARD, s, i))
        if a.kind == Kind.BACKWARD_WEIGHT:
            return done.get((Kind.BACKWARD, s, i))
        kind = Kind.FORWARD if a.kind == Kind.FORWARD else Kind.BACKWARD
        deps: list[float | None] = []
        if kind == Kind.BACKWARD:
            deps.append(done.get((Kind.FORWARD, s, i)))
        src = s - 1 if kind == Kind.FORWARD else s + 1
        if 0 <= src < n_stages:
            if placement[src] == rank:
                deps.append(done.get((kind, src, i)))
            else:
                direction = "F" if kind == Kind.FORWARD else "B"
                deps.append(received.get((rank, (direction, src, i))))
        if any(d is None for d in deps):
            return None
        return max([0.0] + deps)  # type: ignore[arg-type]

    def run(rank: int, a: Action, start: float, end: float) -> None:
        timelines[rank].append(TimedAction(start, end, a))
        free[rank] = end
        pc[rank] += 1
        if a.kind in COMPUTE_KINDS:
            kind = Kind.BACKWARD if a.kind == Kind.BACKWARD_INPUT else a.kind
            done[(kind, a.stage, a.microbatch)] = end  # type: ignore[index]
        elif a.kind in SEND_KINDS:
            posted[_message(a)] = start
        elif a.kind in RECV_KINDS:
            received[(rank, _message(a))] = end

    def try_step(rank: int) -> bool:
        a = schedule[rank][pc[rank]]
        if a.kind in (Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP):
            run(rank, a, free[rank], free[rank] + duration(a))
            return True
        if a.kind in RECV_KINDS:
            if blocking_sends:
                return False  # completed together with its SEND, from the sender's side
            sent = posted.get(_message(a))
            if sent is None:
                return False
            run(rank, a, free[rank], max(free[rank], sent + comm_time))
            return True
        ready = input_ready(rank, a)
        if ready is None:
            return False
        start = max(free[rank], ready)
        if a.kind in COMPUTE_KINDS:
            run(rank, a, start, start + duration(a))
            return True
        # SEND
        if not blocking_sends:
            run(rank, a, start, start)
            return True
        peer = a.peer
        assert peer is not None
        if peer not in schedule or pc[peer] >= len(schedule[peer]):
            return False
        b = schedule[peer][pc[peer]]
        if b.kind not in RECV_KINDS or _message(b) != _message(a):
            return False
        start = max(start, free[peer])
        run(rank, a, start, start + comm_time)
        run(peer, b, start, start + comm_time)
        return True

    _run_until_stuck(ranks, schedule, pc, try_step)
    stuck = {r: pc[r] for r in ranks if pc[r] < len(schedule[r])}
    return timelines, stuck


def _run_until_stuck(ranks, schedule: Schedule, pc: dict[int, int], step: Callable[[int], bool],
                     background: Callable[[], bool] = lambda: False) -> None:
    """Advance every rank's program counter with ``step`` (and ``background`` work, such as
    streams) until nothing moves any more."""
    progress = True
    while progress:
        progress = False
        for rank in ranks:
            while pc[rank] < len(schedule[rank]) and step(rank):
                progress = True
        progress = background() or progress


def _waiting_for(schedule: Schedule, placement: dict[int, int], rank: int, step: int, blocking_sends: bool) -> str:
    """Why ``rank`` cannot run its action at ``step``, in words."""
    a = schedule[rank][step]
    if a.kind in RECV_KINDS:
        direction, src, i = _message(a)
        kind = "SEND_F" if direction == "F" else "SEND_B"
        return f"waits for {src}{kind}{i}->{rank} on rank {a.peer}"
    if a.kind in SEND_KINDS:
        if blocking_sends:
            direction, src, i = _message(a)
            dst = src + 1 if direction == "F" else src - 1
            kind = "RECV_F" if direction == "F" else "RECV_B"
            return f"waits (rendezvous) for rank {a.peer} to reach {dst}{kind}{i}<-{rank}"
        compute = "F" if a.kind == Kind.SEND_F else "B"
        return f"waits for {a.stage}{compute}{a.microbatch}"
    s, i = a.stage, a.microbatch
    assert s is not None
    if a.kind == Kind.BACKWARD_WEIGHT:
        return f"waits for {s}I{i}"
    src = s - 1 if a.kind == Kind.FORWARD else s + 1
    needs = [f"{s}F{i}"] if a.kind in GRAD_KINDS else []
    if 0 <= src < len(placement):
        needs.append(f"{src}{a.kind.value}{i}" if placement[src] == rank else f"its receive from stage {src}")
    return "waits for " + " and ".join(needs)


def validate(schedule: Schedule, *, blocking_sends: bool = False) -> None:
    """Check a lowered schedule (compute + SEND/RECV for every cross-rank edge) for all ranks together.

    Raises :class:`ScheduleError` listing every static problem (counts, order, unmatched send or
    receive), or, if there is none, the deadlock found by executing the schedule, each with a
    step x rank grid marking where ranks are stuck. ``blocking_sends`` checks rendezvous sends
    (see the module docstring) instead of posted ones.
    """
    if not schedule:
        raise ScheduleError("empty schedule: give at least one rank")
    placement = stage_to_rank_of(schedule)
    if not placement:
        raise ScheduleError("schedule has no forward or backward action on any rank")
    problems = _static_problems(schedule, placement)
    if problems:
        marks: dict[int, int] = {}
        for rank, step, _ in problems:
            marks.setdefault(rank, step)
        listed = "\n".join(f"  - rank {r} step {s}: {msg}" for r, s, msg in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ScheduleError(
            f"invalid schedule, {len(problems)} problem(s):\n{listed}{more}\n\n"
            f"first problem per rank marked [..]:\n{format_grid(schedule, marks, 'problem')}"
        )
    _, stuck = _execute(schedule, placement, lambda a: 1.0, 0.0, blocking_sends)
    if stuck:
        reasons = "\n".join(
            f"  - rank {r} stuck at step {s} on {schedule[r][s]}: "
            f"{_waiting_for(schedule, placement, r, s, blocking_sends)}"
            for r, s in sorted(stuck.items())
        )
        mode = "rendezvous sends" if blocking_sends else "posted (non-blocking) sends"
        raise ScheduleError(
            f"schedule deadlocks with {mode}; {len(stuck)} rank(s) cannot finish:\n{reasons}\n\n"
            f"{format_grid(schedule, stuck, 'stuck')}"
        )


PerStage = float | Mapping[int, float]


def _per_stage(value: PerStage, name: str) -> Callable[[int], float]:
    if isinstance(value, Mapping):
        def lookup(stage: int) -> float:
            if stage not in value:
                raise ScheduleError(f"{name} has no time for stage {stage}; give a float or a time for every stage")
            return float(value[stage])
        return lookup
    return lambda stage: float(value)


def simulate(
    schedule: Schedule,
    fwd_time: PerStage,
    bwd_time: PerStage,
    comm_time: float = 0.0,
    *,
    grad_sync_time: float = 0.0,
    step_time: float = 0.0,
    blocking_sends: bool = False,
    weight_time: PerStage | None = None,
    check: bool = True,
) -> SimResult:
    """Time a schedule: validate it (``check=False`` skips that, as ``build(..., check=False)``
    does: for a caller that built it from a checked generator), then run every rank's list with
    the given durations.

    fwd_time / bwd_time: seconds of one stage's forward / backward on one microbatch, one float
        for all stages or a mapping stage -> seconds.
    comm_time: seconds a message spends in transit between ranks (SEND costs the sender nothing
        with posted sends; a RECV ends when the message arrives).
    grad_sync_time / step_time: seconds of ALL_REDUCE / STEP on each rank.
    weight_time: seconds of the weight half (W) of a split backward, per stage; its input half (I)
        takes ``bwd_time - weight_time``. Default: half the backward each.
    """
    if check:
        validate(schedule, blocking_sends=blocking_sends)
    placement = stage_to_rank_of(schedule)
    fwd, bwd = _per_stage(fwd_time, "fwd_time"), _per_stage(bwd_time, "bwd_time")
    wgt = _per_stage(weight_time, "weight_time") if weight_time is not None else (lambda stage: bwd(stage) / 2)

    def duration(a: Action) -> float:
        if a.kind == Kind.FORWARD:
            return fwd(a.stage)  # type: ignore[arg-type]
        if a.kind == Kind.BACKWARD:
            return bwd(a.stage)  # type: ignore[arg-type]
        if a.kind == Kind.BACKWARD_INPUT:
            return bwd(a.stage) - wgt(a.stage)  # type: ignore[arg-type]
        if a.kind == Kind.BACKWARD_WEIGHT:
            return wgt(a.stage)  # type: ignore[arg-type]
        return grad_sync_time if a.kind == Kind.ALL_REDUCE else step_time

    timelines, stuck = _execute(schedule, placement, duration, comm_time, blocking_sends)
    if stuck:
        raise ScheduleError(f"simulate: the schedule deadlocks ({len(stuck)} ranks stuck); validate it first")
    makespan = max((t[-1].end for t in timelines.values() if t), default=0.0)
    return SimResult({r: tuple(t) for r, t in timelines.items()}, makespan)


_FORWARD, _BACKWARD, _WEIGHT = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT  # read per action: bound once


def compute_inputs(kind: Kind, stage: int, microbatch: int, last_stage: int) -> tuple[tuple, ...]:
    """The compute results an action of a schedule's compute order waits for, as
    :func:`compute_done` keys: a forward the previous stage's forward of its micro-batch, a
    backward (or its input half I) its own forward and the next stage's backward, a weight half W
    its I. The one rule :func:`compute_makespan` and the cost model's shared-core simulation
    (``partitioner.cost.core_sharing``) both time."""
    if kind is _FORWARD:
        return ((_FORWARD, stage - 1, microbatch),) if stage > 0 else ()
    if kind is _WEIGHT:
        return ((_BACKWARD, stage, microbatch),)
    if stage < last_stage:
        return (_FORWARD, stage, microbatch), (_BACKWARD, stage + 1, microbatch)
    return ((_FORWARD, stage, microbatch),)


def compute_done(kind: Kind, stage: int, microbatch: int) -> tuple | None:
    """The key under which an action's result is waited for (:func:`compute_inputs`): an input
    half I counts as its backward; a weight half W is waited for by nothing (``None``)."""
    if kind is _WEIGHT:
        return None
    return (_FORWARD if kind is _FORWARD else _BACKWARD, stage, microbatch)


def compute_makespan(compute: Schedule, fwd_time: float, bwd_time: float, weight_time: float) -> float:
    """The makespan :func:`simulate` gives the lowered form of ``compute`` (compute actions only,
    the same time on every stage) with messages that take no time: each rank runs its list in
    order, an action starts when its rank is free and its input is computed (a forward after the
    previous stage's forward of its micro-batch, a backward (or its input half I) after its own
    forward and the next stage's backward, a weight half W after its I). The lowering's RECV sits
    right before its consumer and a posted SEND right after its producer, so they wait for exactly
    these inputs. A dataflow pass over tuples instead of the simulator's actions and messages: the
    cost model times hundreds of zero-bubble schedules per search. Raises :class:`ScheduleError`
    for lists that cannot complete."""
    last_stage = max((a.stage for r in compute for a in compute[r]), default=-1)
    duration = {Kind.FORWARD: fwd_time, Kind.BACKWARD: bwd_time, Kind.BACKWARD_INPUT: bwd_time - weight_time,
                Kind.BACKWARD_WEIGHT: weight_time}
    # each action once: what it waits for, the key it finishes under, its seconds
    lists = {r: [(compute_inputs(a.kind, a.stage, a.microbatch, last_stage), compute_done(a.kind, a.stage, a.microbatch),
                  duration[a.kind]) for a in compute[r]] for r in compute}
    done: dict[tuple, float] = {}  # compute_done key -> end
    free = dict.fromkeys(lists, 0.0)
    pc = dict.fromkeys(lists, 0)
    moved = True
    while moved:
        moved = False
        for r, acts in lists.items():
            k, t = pc[r], free[r]
            while k < len(acts):
                inputs, key, seconds = acts[k]
                start = t
                for needed in inputs:
                    end = done.get(needed)
                    if end is None:
                        break
                    if end > start:
                        start = end
                else:
                    t = start + seconds
                    if key is not None:
                        done[key] = t
                    k += 1
                    continue
                break
            if k != pc[r]:
                pc[r], free[r], moved = k, t, True
    stuck = {r: k for r, k in pc.items() if k < len(lists[r])}
    if stuck:
        raise ScheduleError(f"compute_makespan: the lists cannot complete; ranks stuck at steps {stuck}")
    return max(free.values(), default=0.0)


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """Most (stage, microbatch) activation sets rank ``rank`` holds at once: forward ran, backward
    (or, split, its weight half W, which still reads the saved inputs of the weight ops) not yet.

    For one stage per rank this is the number of microbatches in flight (1F1B: stage i of p holds
    p - i; GPipe: m; ZB-H1: p on every rank). With v chunks per rank each set is one chunk's
    activations (1/v of a rank's).
    """
    live: set[tuple[int | None, int | None]] = set()
    peak = 0
    for a in schedule[rank]:
        if a.kind == Kind.FORWARD:
            live.add((a.stage, a.microbatch))
            peak = max(peak, len(live))
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            live.discard((a.stage, a.microbatch))
    return peak


# ---------------------------------------------------------------------------------------------
# Batched point-to-point on one stream per rank (NCCL): what the runtime posts.


def message_stream(rank: int, a: Action) -> str:
    """The stream a SEND/RECV of ``rank`` travels on: ``"up"`` between a rank and a higher peer
    in the send's direction (sends to a higher rank, receives from a lower one), ``"down"`` the
    other way. The runtime posts the two on two process groups (two NCCL communicators), so a
    message never waits behind one going the other way."""
    to_higher = a.peer > rank if a.kind in SEND_KINDS else a.peer < rank  # type: ignore[operator]
    return "up" if to_higher else "down"


def message_stream_by_kind(rank: int, a: Action) -> str:
    """:func:`message_stream` split once more by what the message carries: ``"F-up"``,
    ``"F-down"``, ``"B-up"``, ``"B-down"`` (four communicators). The V placement needs it: rank 0
    sends rank 1 both stage 0's activations and stage 2p-1's gradients, and rank 1 takes them in
    another order than rank 0 makes them; NCCL pairs the messages of one communicator in order."""
    kind = "F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    return f"{kind}-{message_stream(rank, a)}"


def stream_count(schedule: str) -> int:
    """How many communicators per pipeline rank pair schedule ``schedule`` uses (2, or 4 for ZBV)."""
    return 4 if schedule == "zbv" else 2


def stream_for(schedule: str) -> Callable[[int, Action], str]:
    """The stream function the runtime uses for schedule ``schedule`` (ZBV: by kind)."""
    return message_stream_by_kind if schedule == "zbv" else message_stream


def comm_batches(actions: list[Action]) -> list[tuple[int, list[Action]]]:
    """The runs one rank posts: each run of consecutive SEND/RECV actions, with the step of its
    first action (the runtime posts a run together, before the next compute or sync action)."""
    out: list[tuple[int, list[Action]]] = []
    run: list[Action] = []
    start = 0
    for step, a in enumerate(actions):
        if a.kind in COMM_KINDS:
            if not run:
                start = step
            run.append(a)
        elif run:
            out.append((start, run))
            run = []
    if run:
        out.append((start, run))
    return out


def check_message_order(schedule: Schedule, *, stream: Callable[[int, Action], str] | None = None) -> None:
    """Check that between every ordered pair of ranks, on each stream, the sends (in the sender's
    list order) and the receives (in the receiver's) carry the same messages in the same order:
    NCCL pairs the messages of one communicator between two ranks in posting order, with no tags.
    ``stream``: which stream a message travels on (default: one per ordered pair)."""
    placement = stage_to_rank_of(schedule)
    stream = stream or (lambda rank, a: "")
    sent: dict[tuple[int, int, str], list[_Msg]] = {}
    got: dict[tuple[int, int, str], list[_Msg]] = {}
    for rank, actions in schedule.items():
        for a in actions:
            if a.kind in SEND_KINDS:
                sent.setdefault((rank, a.peer, stream(rank, a)), []).append(_message(a))  # type: ignore[arg-type]
            elif a.kind in RECV_KINDS:
                got.setdefault((a.peer, rank, stream(rank, a)), []).append(_message(a))  # type: ignore[arg-type]
    for pair in sorted(set(sent) | set(got)):
        a, b = sent.get(pair, []), got.get(pair, [])
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            on = f" on stream {pair[2]}" if pair[2] else ""
            raise ScheduleError(f"rank {pair[0]} sends rank {pair[1]} its messages{on} in another order than rank "
                                f"{pair[1]} receives them (first difference at message {k}: sent "
                                f"{a[k] if k < len(a) else None}, received {b[k] if k < len(b) else None}); NCCL "
                                f"matches them in posting order (stages on ranks: {placement})")


def check_batches(schedule: Schedule, *, stream: Callable[[int, Action], str] | None = None) -> None:
    """Check that ``schedule`` completes under NCCL's grouped point-to-point, as the runtime posts
    it: each run of consecutive SEND/RECV actions (:func:`comm_batches`) is posted at once, one
    batch per stream (:func:`message_stream`); each (rank, stream) runs its batches in order; a
    batch's messages become active when it reaches the head, a send and its receive complete
    once both are active (rendezvous), and the next batch starts when all of the head's
    messages completed. Compute goes on meanwhile and waits only for the receive it reads (sync
    and step wait for all of the rank's messages). Also checks :func:`check_message_order`.
    Raises :class:`ScheduleError` with the ranks' stuck steps marked on the grid. ``stream``:
    which stream a message of a rank travels on (default :func:`message_stream`)."""
    validate(schedule)
    stream = stream or message_stream
    check_message_order(schedule, stream=stream)
    placement = stage_to_rank_of(schedule)
    ranks = sorted(schedule)
    runs = {r: dict(comm_batches(schedule[r])) for r in ranks}  # rank -> first step -> run
    streams: dict[tuple[int, str], list[list[Action]]] = {}  # (rank, stream) -> posted batches
    completed: dict[tuple[int, str], int] = {}
    pc = {r: 0 for r in ranks}
    finished: set[tuple[int, _Msg]] = set()  # (rank, message) of completed sends and receives
    done: set[tuple[Kind, int, int]] = set()
    n_stages = len(placement)

    def host_step(rank: int) -> bool:
        a = schedule[rank][pc[rank]]
        if a.kind in COMM_KINDS:  # the whole run is posted at once, a batch per stream
            run = runs[rank][pc[rank]]
            for name in dict.fromkeys(stream(rank, b) for b in run):
                batch = [b for b in run if stream(rank, b) == name]
                if batch:
                    streams.setdefault((rank, name), []).append(batch)
                    completed.setdefault((rank, name), 0)
            pc[rank] += len(run)
            return True
        if a.kind in (Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP):
            if any(completed[k] < len(v) for k, v in streams.items() if k[0] == rank):
                return False  # the runtime waits for its sends first
            pc[rank] += 1
            return True
        s, i = a.stage, a.microbatch
        if a.kind == Kind.BACKWARD_WEIGHT:
            if (Kind.BACKWARD, s, i) not in done:
                return False
            pc[rank] += 1
            return True
        kind = Kind.FORWARD if a.kind == Kind.FORWARD else Kind.BACKWARD  # an I stands for its B
        src = s - 1 if kind == Kind.FORWARD else s + 1
        if kind == Kind.BACKWARD and (Kind.FORWARD, s, i) not in done:
            return False
        if 0 <= src < n_stages:
            if placement[src] == rank:
                if (kind, src, i) not in done:
                    return False
            elif (rank, ("F" if kind == Kind.FORWARD else "B", src, i)) not in finished:
                return False
        done.add((kind, s, i))
        pc[rank] += 1
        return True

    def stream_step() -> bool:
        head = {k: v[completed[k]] for k, v in streams.items() if completed[k] < len(v)}
        moved = False
        for (r, name), batch in head.items():
            for a in batch:
                if a.kind not in SEND_KINDS or (r, _message(a)) in finished:
                    continue
                peer_head = head.get((a.peer, name), [])
                if any(b.kind in RECV_KINDS and _message(b) == _message(a) for b in peer_head):
                    finished.update({(r, _message(a)), (a.peer, _message(a))})
                    moved = True
        for (r, name), batch in head.items():
            if all((r, _message(a)) in finished for a in batch):
                completed[(r, name)] += 1
                moved = True
        return moved

    _run_until_stuck(ranks, schedule, pc, host_step, stream_step)
    stuck = {r: pc[r] for r in ranks if pc[r] < len(schedule[r])
             or any(completed[k] < len(v) for k, v in streams.items() if k[0] == r)}
    if stuck:
        lines = "\n".join(f"  - rank {r}: host at step {min(pc[r], len(schedule[r]) - 1)}, streams at batch " + ", ".join(
            f"{k[1]} {completed[k]}/{len(v)}" for k, v in sorted(streams.items()) if k[0] == r) for r in sorted(stuck))
        marks = {r: min(pc[r], len(schedule[r]) - 1) for r in stuck}
        raise ScheduleError(f"schedule deadlocks with batched point-to-point (NCCL rendezvous, a stream per "
                            f"direction):\n{lines}\n\n{format_grid(schedule, marks, 'stuck')}")
