"""Pipeline schedule actions as data: the action record, its compact text form, and a text grid.

A *schedule* is ``dict[rank, list[Action]]``: the ordered program each pipeline rank runs.
Text form of one action (the same spirit as torch.distributed.pipelining)::

    2F0            stage 2, forward, microbatch 0
    1B3            stage 1, backward (full: input and weight grads), microbatch 3
    1I3            stage 1, backward of the input gradient only, microbatch 3 (zero-bubble split)
    1W3            stage 1, backward of the weight gradients only, microbatch 3 (after 1I3)
    2SEND_F0->3    stage 2 sends its forward output of microbatch 0 to rank 3
    3RECV_F0<-2    stage 3 receives its forward input of microbatch 0 from rank 2
    1SEND_B3->0    stage 1 sends the grad of its input, microbatch 3, to rank 0
    0RECV_B3<-1    stage 0 receives the grad of its output, microbatch 3, from rank 1
    ALL_REDUCE     data-parallel gradient sync of every stage on this rank
    STEP           optimizer step

A whole schedule is one line per rank: ``rank 0: 0F0 0SEND_F0->1 ...``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum

from passes.ir.errors import PartitionerError


class ScheduleError(PartitionerError):
    """A pipeline schedule is malformed, inconsistent between ranks, or deadlocks.

    The message names the problem, the rank and step where it shows, and (for whole schedules) a
    step x rank grid of the actions.
    """


class Kind(str, Enum):
    """What an action does; the value is its text form."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALL_REDUCE = "ALL_REDUCE"
    OPTIMIZER_STEP = "STEP"


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
# The backward that produces the input gradient the previous stage waits for (receives RECV_B,
# sends SEND_B): the full backward, or the input half of a split one.
GRAD_KINDS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})
COMM_KINDS = SEND_KINDS | RECV_KINDS
RANK_KINDS = frozenset({Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP})  # no stage, no microbatch


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's pipeline program.

    kind: what to do.
    stage: global stage index (None for ALL_REDUCE and STEP). For SEND/RECV it is the stage on
        *this* rank: ``2SEND_F0`` is stage 2 sending, its matching receive is ``3RECV_F0``.
    microbatch: microbatch index (None for ALL_REDUCE and STEP).
    peer: the other rank of a SEND/RECV (None otherwise).
    """

    kind: Kind
    stage: int | None = None
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"Action kind must be a Kind, got {self.kind!r}")
        if self.kind in RANK_KINDS:
            if (self.stage, self.microbatch, self.peer) != (None, None, None):
                raise ScheduleError(
                    f"{self.kind.value} applies to the whole rank: give no stage, microbatch or peer "
                    f"(got stage={self.stage}, microbatch={self.microbatch}, peer={self.peer})"
                )
            return
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ScheduleError(f"{self.kind.value} needs a {name} >= 0, got {value!r}")
        if self.kind in COMM_KINDS:
            if not isinstance(self.peer, int) or self.peer < 0:
                raise ScheduleError(f"{self.kind.value} needs a peer rank >= 0, got {self.peer!r}")
        elif self.peer is not None:
            raise ScheduleError(f"compute action {self.kind.value} takes no peer, got peer={self.peer}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        if self.kind in RANK_KINDS:
            return self.kind.value
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.kind in SEND_KINDS:
            text += f"->{self.peer}"
        elif self.kind in RECV_KINDS:
            text += f"<-{self.peer}"
        return text


# Longer alternatives first so that "SEND_F" is not read as a stray "F".
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:(->|<-)(\d+))?")
_ACTION_FORM = ("STAGE KIND MICROBATCH [->PEER | <-PEER], e.g. 2F0, 1B3, 1I3, 1W3, 2SEND_F0->3, 3RECV_F0<-2, "
                "ALL_REDUCE, STEP")


@functools.lru_cache(maxsize=1 << 16)  # actions are immutable: a schedule's lists share them
def F(stage: int, microbatch: int) -> Action:
    """Forward of ``stage`` on ``microbatch``."""
    return Action(Kind.FORWARD, stage, microbatch)


@functools.lru_cache(maxsize=1 << 16)  # actions are immutable: a schedule's lists share them
def B(stage: int, microbatch: int) -> Action:
    """Full backward (input and weight grads) of ``stage`` on ``microbatch``."""
    return Action(Kind.BACKWARD, stage, microbatch)


@functools.lru_cache(maxsize=1 << 16)  # actions are immutable: a schedule's lists share them
def I(stage: int, microbatch: int) -> Action:
    """Input-gradient half of the backward of ``stage`` on ``microbatch``."""
    return Action(Kind.BACKWARD_INPUT, stage, microbatch)


@functools.lru_cache(maxsize=1 << 16)  # actions are immutable: a schedule's lists share them
def W(stage: int, microbatch: int) -> Action:
    """Weight-gradient half of the backward of ``stage`` on ``microbatch`` (after its I)."""
    return Action(Kind.BACKWARD_WEIGHT, stage, microbatch)


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``; raises :class:`ScheduleError` naming the expected form."""
    text = text.strip()
    for kind in RANK_KINDS:
        if text == kind.value:
            return Action(kind)
    match = _ACTION_RE.fullmatch(text)
    if match is None:
        raise ScheduleError(f"cannot parse action {text!r}; expected {_ACTION_FORM}")
    stage, kind_text, microbatch, arrow, peer = match.groups()
    kind = Kind(kind_text)
    expected_arrow = "->" if kind in SEND_KINDS else "<-" if kind in RECV_KINDS else None
    if arrow != expected_arrow:
        want = f"'{expected_arrow}PEER'" if expected_arrow else "no peer"
        raise ScheduleError(f"cannot parse action {text!r}: {kind.value} takes {want}; expected {_ACTION_FORM}")
    return Action(kind, int(stage), int(microbatch), int(peer) if peer is not None else None)


def format_schedule(schedule: dict[int, list[Action]]) -> str:
    """One line per rank, ``rank R: A A A``, ranks in increasing order; see :func:`parse_schedule`."""
    lines = []
    for rank in sorted(schedule):
        actions = " ".join(str(a) for a in schedule[rank])
        lines.append(f"rank {rank}: {actions}".rstrip())
    return "\n".join(lines) + "\n"


_RANK_LINE_RE = re.compile(r"rank\s+(\d+)\s*:(.*)")


def parse_schedule(text: str) -> dict[int, list[Action]]:
    """Inverse of :func:`format_schedule`; blank lines and ``#`` comments are ignored."""
    schedule: dict[int, list[Action]] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _RANK_LINE_RE.fullmatch(line)
        if match is None:
            raise ScheduleError(f"line {lineno}: expected 'rank R: ACTION ACTION ...', got {line!r}")
        rank = int(match.group(1))
        if rank in schedule:
            raise ScheduleError(f"line {lineno}: rank {rank} is listed twice; give each rank one line")
        schedule[rank] = [parse_action(tok) for tok in match.group(2).split()]
    return schedule


def format_grid(
    schedule: dict[int, list[Action]],
    marks: dict[int, int] | None = None,
    note: str = "stuck",
) -> str:
    """A step (row) x rank (column) table of each rank's program; step = index in the rank's list.

    ``marks`` maps rank -> step to highlight (written ``[action]``), e.g. where a rank is stuck;
    a marked step past the end of a rank's list is shown as ``[end]``.
    """
    marks = marks or {}
    ranks = sorted(schedule)
    n_steps = max([len(schedule[r]) for r in ranks] + [s + 1 for s in marks.values()] + [1])

    def cell(rank: int, step: int) -> str:
        actions = schedule[rank]
        text = str(actions[step]) if step < len(actions) else ""
        if marks.get(rank) == step:
            text = f"[{text or 'end'}]"
        return text

    step_w = len(f"step {n_steps - 1}")
    columns = [[f"rank {r}"] + [cell(r, s) for s in range(n_steps)] for r in ranks]
    widths = [max(len(c) for c in col) for col in columns]
    rows = [" " * step_w + " | " + " | ".join(col[0].ljust(w) for col, w in zip(columns, widths))]
    for s in range(n_steps):
        label = f"step {s}".ljust(step_w)
        row = label + " | " + " | ".join(col[s + 1].ljust(w) for col, w in zip(columns, widths))
        if any(marks.get(r) == s for r in ranks):
            row += f"   <- {note}"
        rows.append(row.rstrip())
    return "\n".join(rows) + "\n"
