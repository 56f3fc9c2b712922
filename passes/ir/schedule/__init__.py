"""Pipeline schedules as data: generators, lowering, validation and simulation.

A schedule is ``dict[rank, list[Action]]`` (see :mod:`passes.ir.schedule.actions` for the action
record and its text form ``2F0``, ``1B3``, ``2SEND_F0->3``). Building one is a chain of pure
list -> list functions::

    compute = one_f_one_b_compute(p, m)                  # F/B order per rank
    lowered = add_communication(compute, stage_placement(p))   # + SEND/RECV per cross-rank edge
    full    = add_grad_sync_and_step(lowered)            # + ALL_REDUCE, STEP per rank

``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zb1p`` and ``zbv`` return the full form
(the zero-bubble ones split each backward into I, the input gradient, and W, the weight gradients); :func:`compute_only`
strips it back. :func:`validate` checks all ranks together and :func:`simulate` times them.

Stage placement: with v chunks per rank, global stage ``c * p + r`` (chunk c, rank r) lives on
rank ``r``, i.e. stage s on rank ``s mod p`` (Narayanan et al. 2021, interleaved schedule).
"""
from passes.ir.schedule.actions import (COMPUTE_KINDS, Action, B, F, I, Kind, ScheduleError, W, format_grid,
                                        format_schedule, parse_action, parse_schedule)
from passes.ir.schedule.build import (Schedule, add_communication, build, compute, add_grad_sync_and_step, compute_only,
                                      gpipe, gpipe_compute, interleaved_1f1b, interleaved_1f1b_compute, lower, one_f_one_b,
                                      one_f_one_b_compute, stage_placement, zb1p, zb1p_compute, zbv, zbv_compute)
from passes.ir.schedule.validate import (SimResult, TimedAction, compute_done, compute_inputs, compute_makespan,
                                         peak_in_flight, simulate, stage_to_rank_of, validate)

__all__ = [
    "COMPUTE_KINDS", "Action", "Kind", "ScheduleError", "SimResult", "TimedAction", "F", "B", "I", "W", "Schedule",
    "parse_action", "format_schedule", "parse_schedule", "format_grid",
    "stage_placement", "gpipe_compute", "one_f_one_b_compute", "interleaved_1f1b_compute",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zb1p_compute", "zbv_compute", "zb1p", "zbv",
    "add_communication", "add_grad_sync_and_step", "lower", "compute", "compute_only", "build",
    "validate", "simulate", "compute_inputs", "compute_done", "compute_makespan", "peak_in_flight", "stage_to_rank_of",
]
