"""Schedule generators and lowering: pure ``list -> list`` functions over :class:`Action` lists
(see the package docstring)."""
from __future__ import annotations

from collections.abc import Callable

from passes.ir.schedule.actions import (
    COMPUTE_KINDS,
    GRAD_KINDS,
    Action,
    B,
    F,
    I,
    Kind,
    ScheduleError,
    W,
)


Schedule = dict[int, list[Action]]


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for name, value in (("pipeline degree p", p), ("microbatches m", m), ("chunks per rank v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, got {value!r}")


def stage_placement(p: int, v: int = 1, *, shape: str = "loop") -> dict[int, int]:
    """Global stage -> rank for p ranks with v chunks each.

    ``shape="loop"`` (GPipe, 1F1B, interleaved): stage ``c * p + r`` is on rank ``r``.
    ``shape="v"`` (ZBV, two chunks): rank ``r`` holds stages ``r`` and ``2p - 1 - r``, so the
    first and the last stage share rank 0 and the turn of the V (stages p-1, p) is in memory.
    """
    _check_sizes(p, 1, v)
    if shape == "v":
        if v != 2:
            raise ScheduleError(f"the V placement has exactly 2 chunks per rank, got v={v}")
        return {**{r: r for r in range(p)}, **{2 * p - 1 - r: r for r in range(p)}}
    if shape != "loop":
        raise ScheduleError(f"no stage placement {shape!r}; use 'loop' or 'v'")
    return {c * p + r: r for c in range(v) for r in range(p)}


# ---------------------------------------------------------------------------------------------
# Compute orders (F/B only).


def gpipe_compute(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards."""
    _check_sizes(p, m)
    return {r: [F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)}


def _warmup_then_1f1b(
    n_ops: int,
    warmup: int,
    forward: Callable[[int], Action],
    backward: Callable[[int], Action],
) -> list[Action]:
    """``warmup`` forwards, then alternate one forward / one backward, then the remaining backwards.

    ``forward(k)`` / ``backward(k)`` give the k-th forward / backward of the rank (k < n_ops).
    """
    actions = [forward(k) for k in range(warmup)]
    for k in range(n_ops - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(n_ops - warmup, n_ops)]
    return actions


def one_f_one_b_compute(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r warms up with ``min(p - r - 1, m)``
    forwards, then alternates forward/backward, then drains the backwards; at most ``p - r``
    microbatches are in flight on rank r."""
    _check_sizes(p, m)
    return {
        r: _warmup_then_1f1b(m, min(p - r - 1, m), lambda k, r=r: F(r, k), lambda k, r=r: B(r, k))
        for r in range(p)
    }


def interleaved_1f1b_compute(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v chunks per rank, stage c*p + r on rank r.

    A rank's forwards run in groups of p microbatches per chunk (chunk 0 for microbatches 0..p-1,
    then chunk 1 for the same microbatches, ..., then chunk 0 for microbatches p..2p-1); backwards
    run the same way with the chunks in reverse. Warmup is Megatron's
    ``2 (p - r - 1) + (v - 1) p`` forwards (capped at v m). Needs ``m % p == 0`` when v > 1; with
    v == 1 it is exactly :func:`one_f_one_b_compute`.
    """
    _check_sizes(p, m, v)
    if v == 1:
        return one_f_one_b_compute(p, m)
    if m % p != 0:
        lower_m, upper_m = (m // p) * p, (m // p + 1) * p
        options = f"{lower_m} or {upper_m}" if lower_m else f"{upper_m}"
        raise ScheduleError(
            f"interleaved 1F1B needs the number of microbatches to be a multiple of the pipeline degree: "
            f"m={m} is not divisible by p={p} (v={v}); use m={options}, or v=1 (plain 1F1B)"
        )

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def rank_ops(r: int) -> list[Action]:
        n_ops = v * m
        warmup = min(2 * (p - r - 1) + (v - 1) * p, n_ops)
        return _warmup_then_1f1b(
            n_ops,
            warmup,
            lambda k: F(((k // p) % v) * p + r, microbatch(k)),
            lambda k: B((v - 1 - (k // p) % v) * p + r, microbatch(k)),
        )

    return {r: rank_ops(r) for r in range(p)}


def zb1p_compute(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split
    into the input gradient (I, what the previous stage waits for) and the weight gradients (W),
    and rank r running its W ``r`` micro-batches late, so the W passes fill the cool-down bubble.

    Rank r warms up with ``min(p - r, m)`` forwards, then for each micro-batch k: ``I k``, then
    ``W (k - r)`` once k >= r, then the next forward; the deferred W passes close the list. Rank r
    holds at most p micro-batches between F and W (1F1B's rank 0 holds p): the same peak as 1F1B.
    The order is ``torch.distributed.pipelining``'s ``ScheduleInterleavedZeroBubble`` with one
    stage per rank.
    """
    _check_sizes(p, m)

    def rank_ops(r: int) -> list[Action]:
        warmup = min(p - r, m)
        actions = [F(r, k) for k in range(warmup)]
        for k in range(m):
            actions.append(I(r, k))
            if k >= r:
                actions.append(W(r, k - r))
            if warmup + k < m:
                actions.append(F(r, warmup + k))
        actions += [W(r, k) for k in range(max(m - r, 0), m)]
        return actions

    return {r: rank_ops(r) for r in range(p)}


def zbv_compute(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2023): two chunks per rank in the V placement (rank r holds stages r and
    2p - 1 - r, see :func:`stage_placement`), backward split into I and W.

    Per rank: ``2 (p - r) - 1`` chunk-0 forwards; r pairs (chunk-1 forward, chunk-0 forward);
    p - r triples (chunk-1 F, I, W); then the steady state (chunk-0 F while any is left, chunk-0
    I and W, chunk-1 F, I, W) until every forward ran; the cool-down runs r pairs of I (chunk 0,
    chunk 1), then p - r pairs (chunk-0 I, the oldest deferred chunk-0 W), then the deferred W
    passes, chunk 1 first. The phases need ``2p - 1`` micro-batches; with fewer, the lists are
    built for ``2p - 1`` and the actions of micro-batches that do not exist are dropped, as
    ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` does.
    """
    _check_sizes(p, m)
    n = max(m, 2 * p - 1)

    def rank_ops(r: int) -> list[Action]:
        c0, c1 = r, 2 * p - 1 - r
        count = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        out: list[Action] = []

        def emit(make, stage: int, key: str) -> None:
            out.append(make(stage, count[key]))
            count[key] += 1

        for _ in range(2 * (p - r) - 1):
            emit(F, c0, "f0")
        for _ in range(r):
            emit(F, c1, "f1")
            emit(F, c0, "f0")
        for _ in range(p - r):
            emit(F, c1, "f1")
            out += [I(c1, count["b1"]), W(c1, count["b1"])]
            count["b1"] += 1
        while count["f1"] < count["f0"] or count["f0"] < n:
            if count["f0"] < n:
                emit(F, c0, "f0")
            out += [I(c0, count["b0"]), W(c0, count["b0"])]
            count["b0"] += 1
            emit(F, c1, "f1")
            out += [I(c1, count["b1"]), W(c1, count["b1"])]
            count["b1"] += 1
        w0, w1 = count["b0"], count["b1"]
        for _ in range(r):
            emit(I, c0, "b0")
            emit(I, c1, "b1")
        for _ in range(p - r):
            emit(I, c0, "b0")
            out.append(W(c0, w0))
            w0 += 1
        out += [W(c1, k) for k in range(w1, count["b1"])]
        out += [W(c0, k) for k in range(w0, count["b0"])]
        return [a for a in out if a.microbatch < m]

    return {r: rank_ops(r) for r in range(p)}


# ---------------------------------------------------------------------------------------------
# Lowering (pure list -> list functions).


def add_communication(compute: Schedule, stage_to_rank: dict[int, int]) -> Schedule:
    """Insert a RECV right before and a SEND right after each compute action whose neighbouring
    stage lives on another rank (forward: from stage s-1, to s+1; backward and the input half of
    a split backward: from s+1, to s-1; the weight half W exchanges nothing).

    Input lists must hold compute actions only. Returns new lists; the input is not changed.
    """
    n_stages = len(stage_to_rank)
    if sorted(stage_to_rank) != list(range(n_stages)):
        raise ScheduleError(f"stage_to_rank must map stages 0..{n_stages - 1}, got stages {sorted(stage_to_rank)}")
    lowered: Schedule = {}
    for rank, actions in compute.items():
        out: list[Action] = []
        for step, a in enumerate(actions):
            if a.kind not in COMPUTE_KINDS:
                raise ScheduleError(f"add_communication takes compute actions only; rank {rank} step {step} is {a} "
                                    f"(use compute_only() first)")
            s, i = a.stage, a.microbatch
            assert s is not None and i is not None
            if stage_to_rank.get(s) != rank:
                raise ScheduleError(f"rank {rank} step {step} computes {a}, but stage_to_rank puts stage {s} on "
                                    f"rank {stage_to_rank.get(s)}")
            if a.kind == Kind.BACKWARD_WEIGHT:
                out.append(a)
                continue
            fwd = a.kind == Kind.FORWARD
            assert fwd or a.kind in GRAD_KINDS
            src, dst = (s - 1, s + 1) if fwd else (s + 1, s - 1)
            if 0 <= src < n_stages and stage_to_rank[src] != rank:
                out.append(Action(Kind.RECV_F if fwd else Kind.RECV_B, s, i, stage_to_rank[src]))
            out.append(a)
            if 0 <= dst < n_stages and stage_to_rank[dst] != rank:
                out.append(Action(Kind.SEND_F if fwd else Kind.SEND_B, s, i, stage_to_rank[dst]))
        lowered[rank] = out
    return lowered


def add_grad_sync_and_step(schedule: Schedule) -> Schedule:
    """Append ALL_REDUCE (data-parallel grad sync) and STEP (optimizer) to every rank's list."""
    return {r: list(actions) + [Action(Kind.ALL_REDUCE), Action(Kind.OPTIMIZER_STEP)] for r, actions in schedule.items()}


def lower(compute: Schedule, stage_to_rank: dict[int, int]) -> Schedule:
    """``add_grad_sync_and_step(add_communication(compute, stage_to_rank))``."""
    return add_grad_sync_and_step(add_communication(compute, stage_to_rank))


def compute_only(schedule: Schedule) -> Schedule:
    """Keep only the forward/backward actions: the inverse of :func:`lower`."""
    return {r: [a for a in actions if a.kind in COMPUTE_KINDS] for r, actions in schedule.items()}


# ---------------------------------------------------------------------------------------------
# Full schedules.


def gpipe(p: int, m: int) -> Schedule:
    """GPipe for p ranks and m microbatches, lowered (SEND/RECV, ALL_REDUCE, STEP)."""
    return lower(gpipe_compute(p, m), stage_placement(p))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B for p ranks and m microbatches, lowered (SEND/RECV, ALL_REDUCE, STEP)."""
    return lower(one_f_one_b_compute(p, m), stage_placement(p))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B for p ranks, m microbatches (m % p == 0 when v > 1), v chunks per rank; lowered."""
    return lower(interleaved_1f1b_compute(p, m, v), stage_placement(p, v))


def zb1p(p: int, m: int) -> Schedule:
    """ZB-H1 for p ranks and m microbatches, lowered (SEND/RECV, ALL_REDUCE, STEP)."""
    return lower(zb1p_compute(p, m), stage_placement(p))


def zbv(p: int, m: int) -> Schedule:
    """ZB-V for p ranks (two chunks each, V placement) and m microbatches, lowered."""
    return lower(zbv_compute(p, m), stage_placement(p, 2, shape="v"))


def compute(schedule: str, p: int, m: int, v: int = 1) -> Schedule:
    """The compute order (F, B, or I and W) of the schedule named ``schedule`` with ``v`` chunks
    per rank: what :func:`build` lowers, for readers of the order alone (the cost model)."""
    if schedule == "gpipe" and v == 1:
        return gpipe_compute(p, m)
    if schedule == "1f1b" and v == 1:
        return one_f_one_b_compute(p, m)
    if schedule == "interleaved":
        return interleaved_1f1b_compute(p, m, v)
    if schedule == "zb1p" and v == 1:
        return zb1p_compute(p, m)
    if schedule == "zbv" and v == 2:
        return zbv_compute(p, m)
    raise ScheduleError(f"no schedule {schedule!r} with {v} chunks per rank; use gpipe, 1f1b or zb1p with one "
                        f"chunk, zbv with two, interleaved with any")


def build(schedule: str, p: int, m: int, v: int = 1, *, check: bool = True) -> Schedule:
    """The full schedule named ``schedule`` (``gpipe``, ``1f1b``, ``interleaved``, ``zb1p`` or
    ``zbv``), checked to complete as the runtime posts it on NCCL
    (:func:`passes.ir.schedule.validate.check_batches`, which also validates it). ``check=False``
    skips that check (quadratic in the actions): for the cost model, which only reads the lists;
    what runs is built with it."""
    from passes.ir.schedule.validate import check_batches, stream_for

    order = compute(schedule, p, m, v)
    full = lower(order, stage_placement(p, v, shape="v" if schedule == "zbv" else "loop"))
    if check:
        check_batches(full, stream=stream_for(schedule))
    return full
