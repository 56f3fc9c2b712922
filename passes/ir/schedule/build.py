"""Schedule generators and lowering: pure ``list -> list`` functions over :class:`Action` lists
(see the package docstring)."""
from __future__ import annotations

from collections.abc import Callable

from passes.ir.schedule.actions import (
    COMPUTE_KINDS,
    Action,
    B,
    F,
    Kind,
    ScheduleError,
)


Schedule = dict[int, list[Action]]


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for name, value in (("pipeline degree p", p), ("microbatches m", m), ("chunks per rank v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, got {value!r}")


def stage_placement(p: int, v: int = 1) -> dict[int, int]:
    """Global stage -> rank for p ranks with v chunks each: stage ``c * p + r`` is on rank ``r``."""
    _check_sizes(p, 1, v)
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


# ---------------------------------------------------------------------------------------------
# Lowering (pure list -> list functions).


def add_communication(compute: Schedule, stage_to_rank: dict[int, int]) -> Schedule:
    """Insert a RECV right before and a SEND right after each compute action whose neighbouring
    stage lives on another rank (forward: from stage s-1, to s+1; backward: from s+1, to s-1).

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
            fwd = a.kind == Kind.FORWARD
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


def build(schedule: str, p: int, m: int, v: int = 1) -> Schedule:
    """The full schedule named ``schedule`` (``gpipe``, ``1f1b`` or ``interleaved``), checked to
    complete as the runtime posts it on NCCL (:func:`passes.ir.schedule.validate.check_batches`,
    which also validates it)."""
    from passes.ir.schedule.validate import check_batches

    if schedule == "gpipe" and v == 1:
        full = gpipe(p, m)
    elif schedule == "1f1b" and v == 1:
        full = one_f_one_b(p, m)
    elif schedule == "interleaved":
        full = interleaved_1f1b(p, m, v)
    else:
        raise ScheduleError(f"no schedule {schedule!r} with {v} chunks per rank; use gpipe or 1f1b with one chunk, "
                            f"interleaved with any")
    check_batches(full)
    return full
