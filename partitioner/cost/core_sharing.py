"""A step's compute when a node has fewer compute slots than ranks (CPU ranks sharing cores).

Processor sharing: while ``k`` ranks of a node compute at once on its ``slots`` cores, each runs
at ``min(1, slots / k)`` of its own rate, and a rank waiting for a message or a collective takes
no core. A pipeline's ranks do not all compute at once (the fill and drain leave some idle, and
those give their cores to the others), but where they do, the critical path itself slows: on 4
ranks of 2 cores, a pipeline whose middle phase keeps every rank busy runs that phase at half
speed. :func:`shared_makespan` simulates each rank's action list (the lowering's compute order)
with those rates; the planner charges the difference to the same simulation on free cores as
``StepTimeTerms.contention``.

Times are seconds; a rank's durations are what it takes alone.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from passes.ir.errors import ConfigError
from passes.ir.schedule import Kind, compute_done, compute_inputs

_TOLERANCE = 1e-12
"""Seconds of remaining work counted as done (floating-point rests of the rate products)."""


@dataclass(frozen=True, kw_only=True)
class RankWork:
    """What one pipeline rank computes per step, each alone on a core (seconds).

    ``forward``, ``backward``: one micro-batch through one of its model chunks (a split
    backward's input half is ``backward − weight``); ``weight``: the weight half W of a split
    backward; ``tail``: work after its last action (the optimizer step); ``ranks``: how many
    ranks of each node run this pipeline rank's program at the same time (its dp × cp × tp ranks,
    node index to count)."""
    forward: float
    backward: float
    weight: float = 0.0
    tail: float = 0.0
    ranks: Mapping[int, int]

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "weight", "tail"):
            if getattr(self, name) < 0:
                raise ConfigError(f"RankWork.{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.weight > self.backward:
            raise ConfigError(f"RankWork.weight ({self.weight} s) cannot exceed the backward ({self.backward} s)")


def shared_makespan(compute: Mapping[int, Sequence], work: Mapping[int, RankWork], slots: float | None) -> float:
    """Seconds until every pipeline rank has run its compute list and its tail, ranks of a node
    sharing ``slots`` cores (``None``: a core for every rank).

    ``compute``: the schedule's compute order (pipeline rank to its actions, each with ``kind``,
    ``stage``, ``microbatch``). An action starts when its rank is free and its inputs are computed
    (a forward after the previous stage's forward of its micro-batch, a backward or its input half
    after its own forward and the next stage's backward, a weight half after its input half),
    messages taking no time (:func:`passes.ir.schedule.compute_inputs`, the rule
    :func:`passes.ir.schedule.compute_makespan` times). Between
    events every computing rank progresses at ``min(1, slots / k)`` on each node it has ranks on
    (``k``: the ranks computing there), the slowest of its nodes. Raises :class:`ConfigError`
    when the lists cannot complete."""
    if slots is not None and slots <= 0:
        raise ConfigError(f"compute slots must be > 0, got {slots}")
    acts = {r: [(a.kind, a.stage, a.microbatch) for a in compute[r]] for r in compute}
    last_stage = max((s for lst in acts.values() for _, s, _ in lst), default=-1)

    def duration(w: RankWork, kind: Kind) -> float:
        return {Kind.FORWARD: w.forward, Kind.BACKWARD: w.backward,
                Kind.BACKWARD_INPUT: w.backward - w.weight, Kind.BACKWARD_WEIGHT: w.weight}[kind]

    done: set[tuple] = set()  # compute_done keys of finished actions
    pc = dict.fromkeys(acts, 0)  # next action of each rank; len(list): its tail, len + 1: finished
    running: dict[int, list] = {}  # rank -> [compute_done key or None, remaining seconds]
    now = 0.0
    while True:
        for r, lst in acts.items():
            if r in running or pc[r] > len(lst):
                continue
            if pc[r] == len(lst):
                running[r] = [None, work[r].tail]
            elif all(key in done for key in compute_inputs(*lst[pc[r]], last_stage)):
                running[r] = [compute_done(*lst[pc[r]]), duration(work[r], lst[pc[r]][0])]
        if not running:
            break
        load: dict[int, int] = {}
        for r in running:
            for node, n in work[r].ranks.items():
                load[node] = load.get(node, 0) + n
        rate = {r: 1.0 if slots is None else min(
            [1.0] + [slots / load[node] for node, n in work[r].ranks.items() if n > 0]) for r in running}
        step = min(rem / rate[r] for r, (_, rem) in running.items())
        now += step
        for r in list(running):
            entry = running[r]
            entry[1] -= rate[r] * step
            if entry[1] <= _TOLERANCE * max(1.0, now):
                del running[r]
                if entry[0] is not None:
                    done.add(entry[0])
                pc[r] += 1
    stuck = {r: pc[r] for r, lst in acts.items() if pc[r] <= len(lst)}
    if stuck:
        raise ConfigError(f"shared_makespan: the compute lists cannot complete; ranks stuck at steps {stuck}")
    return now


def rank_counts(pp: int, ranks_per_stage: int, devices_per_node: int) -> list[dict[int, int]]:
    """For each pipeline rank, how many of its ``ranks_per_stage`` ranks lie on each node (ranks
    node-major, pipeline rank outermost in the mesh, as the runtime's mesh lays them out)."""
    if pp < 1 or ranks_per_stage < 1 or devices_per_node < 1:
        raise ConfigError(f"rank_counts needs positive sizes, got pp={pp}, ranks_per_stage={ranks_per_stage}, "
                          f"devices_per_node={devices_per_node}")
    out: list[dict[int, int]] = []
    for stage in range(pp):
        counts: dict[int, int] = {}
        for rank in range(stage * ranks_per_stage, (stage + 1) * ranks_per_stage):
            node = rank // devices_per_node
            counts[node] = counts.get(node, 0) + 1
        out.append(counts)
    return out

