"""The layout of the data-parallel gradient buckets: which parameters travel in which flat message.

One pure function of the parameters' sizes and dtypes, called by the runtime when it builds its
buckets (:class:`runtime.optim.grad_sync.BucketedGradSync`) and by the pre-launch check of the
communication program (:mod:`passes.checks.communication_check`), so the check sizes exactly the
messages that run.

The rule (as DDP): parameters are taken in reverse order (the order backward makes their
gradients), cut into buckets of at most ``bucket_bytes`` with one dtype each, the first one at
most :data:`FIRST_BUCKET_BYTES` (communication starts early in backward); "late" parameters
(tied copies, sequence-parallel partial gradients: their sums must be complete first) go in
trailing buckets of their own, with no small first bucket. A sharded bucket (ZeRO) is padded to
a multiple of the group size, since a reduce-scatter needs equal chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence

import torch
from torch import nn

from passes.ir.errors import ConfigError

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bytes of gradients per bucket (DDP's default)."""
FIRST_BUCKET_BYTES = 2**20
"""Bytes of the first bucket (the last layers' gradients, ready first)."""


@dataclass(frozen=True, slots=True)
class GradSlot:
    """One parameter as the bucket layout sees it: its element count and dtype, and whether it
    goes in a trailing ("late") bucket."""

    numel: int
    dtype: torch.dtype
    late: bool = False


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket: ``members`` (indices into the slots given, in the bucket's order), ``numel``
    (elements of its flat message, padded when sharded), ``dtype`` (its parameters') and
    ``late`` (launched after the tied sum)."""

    members: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    late: bool


def group_by_bytes(slots: Sequence[GradSlot], order: Sequence[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                   first_small: bool = True) -> list[list[int]]:
    """The indices ``order`` (into ``slots``) cut into runs of at most ``bucket_bytes`` bytes
    (the first at most :data:`FIRST_BUCKET_BYTES` when ``first_small``), one dtype per run; a
    parameter larger than the cap gets a run of its own."""
    groups: list[list[int]] = []
    filled = 0
    for i in order:
        slot = slots[i]
        nbytes = slot.numel * slot.dtype.itemsize
        cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if len(groups) == 1 and first_small else bucket_bytes
        if not groups or filled + nbytes > cap or slot.dtype != slots[groups[-1][0]].dtype:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += nbytes
    return groups


def bucket_layout(slots: Sequence[GradSlot], *, size: int, shard: bool,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[BucketSpec, ...]:
    """The buckets of parameters ``slots`` (in the runtime's parameter order) for a dp group of
    ``size`` ranks: the early ones, then the late ones (see the module docstring). ``shard``:
    ZeRO's reduce-scatter modes (numel padded to a multiple of ``size``)."""
    early = [i for i in reversed(range(len(slots))) if not slots[i].late]
    tail = [i for i in reversed(range(len(slots))) if slots[i].late]
    out = []
    for order, late in ((early, False), (tail, True)):
        for members in group_by_bytes(slots, order, bucket_bytes, first_small=not late):
            n = sum(slots[i].numel for i in members)
            out.append(BucketSpec(members=tuple(members), numel=-(-n // size) * size if shard else n,
                                  dtype=slots[members[0]].dtype, late=late))
    return tuple(out)


def unique_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of ``modules``, each once, in a deterministic order (what the
    gradient buckets are laid out over)."""
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


# ---------------------------------------------------------------------------------------------
# When each bucket's collective starts and when it is waited: one state machine, driven by the
# runtime (runtime.optim.grad_sync.BucketedGradSync, on real gradients), the communication check
# (passes.checks.communication_check, on the schedule's actions) and the memory replay
# (partitioner.search.replay, on the memory pass's gradient events).

SyncMode = Literal["all_reduce", "reduce_scatter", "reduce_scatter_each"]
"""How a bucket is reduced: all-reduce (no ZeRO), one reduce-scatter per step (ZeRO-1), or a
reduce-scatter after every backward that completes it, summed into a sharded accumulator (ZeRO-2)."""
MODE_OF_ZERO_STAGE: dict[int, SyncMode] = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter_each"}
MAX_IN_FLIGHT = 2
"""ZeRO-2: buckets whose reduce-scatter may be in flight at once (each holds its full flat copy)."""


@dataclass(frozen=True, slots=True)
class Launch:
    """Start bucket ``bucket``'s collective: its ``round``-th this step (ZeRO-2 has one per
    backward); ``launch`` numbers the step's launches from 0; ``from_hook``: a gradient hook
    (overlapped with backward) rather than ``finish`` started it."""

    bucket: int
    round: int
    launch: int
    from_hook: bool


@dataclass(frozen=True, slots=True)
class Retire:
    """Wait launch number ``launch`` (of bucket ``bucket``) and sum its chunk into the bucket's
    accumulator (ZeRO-2's in-flight reduce-scatters; the other modes wait in ``finish``)."""

    bucket: int
    launch: int


class BucketMachine:
    """The launch and retire rule of the data-parallel gradient buckets of one rank.

    ``buckets``: the layout (:func:`bucket_layout`; members index the parameters). ``expected``:
    gradient accumulations of each member per step (all-reduce and ZeRO-1 launch a bucket once
    every member has had all of them; a member missing there never launches its bucket from a
    hook). ``hooked``: gradients are watched during backward (overlap; ZeRO-2 always is), else
    every bucket starts in :meth:`finish_early`. ``overlap``: ZeRO-2 may keep launches in flight
    (at most :data:`MAX_IN_FLIGHT`; the oldest is retired after a new one starts, and a bucket's
    last launch when its next round begins); without it each is retired as soon as it starts.
    Late buckets (tied copies, sequence-parallel partial gradients) start only in
    :meth:`finish_late`, after their sums.
    """

    def __init__(self, buckets: Sequence[BucketSpec], mode: SyncMode, *, expected: Mapping[int, int] | None = None,
                 hooked: bool = True, overlap: bool = True):
        self.buckets, self.mode = tuple(buckets), mode
        self.each_backward = mode == "reduce_scatter_each"
        self.expected = dict(expected or {})
        self.hooked = hooked or self.each_backward
        self.overlap = overlap
        self.bucket_of = {m: k for k, b in enumerate(self.buckets) for m in b.members}
        self.reset()

    def reset(self) -> None:
        """A new step: nothing accumulated, launched or in flight."""
        self.seen: dict[int, int] = {}
        self.round: list[set[int]] = [set() for _ in self.buckets]
        self.launches = [0] * len(self.buckets)
        self.in_flight: list[Launch] = []
        self._count = 0

    def sent(self, k: int) -> bool:
        """All-reduce and ZeRO-1: bucket ``k``'s one collective of the step has started."""
        return self.launches[k] > 0

    def accumulated(self, member: int) -> list[Launch | Retire]:
        """Member ``member`` got one gradient accumulation (its post-accumulate hook): what starts
        and what is waited now, in order."""
        k = self.bucket_of.get(member)
        if k is None or not self.hooked or self.buckets[k].late:
            return []
        out: list[Launch | Retire] = []
        if self.each_backward:
            if not self.round[k]:  # a new round: the bucket's last launch has had a whole backward
                out += [self._retire(f) for f in [f for f in self.in_flight if f.bucket == k]]
            self.round[k].add(member)
            if len(self.round[k]) == len(self.buckets[k].members):
                out += self._launch(k, from_hook=True)
            return out
        expected = self.expected.get(member)
        if not expected:
            return out
        seen = self.seen[member] = self.seen.get(member, 0) + 1
        if self.sent(k):
            raise ConfigError(f"grad_sync: a parameter got gradient accumulation {seen} after its bucket was sent "
                              f"({expected} expected per step); the backward count given to the gradient "
                              f"buckets is wrong: pass overlap_grad_sync=False to work around")
        if all(self.seen.get(i, 0) >= self.expected.get(i, 0) > 0 for i in self.buckets[k].members):
            out += self._launch(k, from_hook=True)
        return out

    def finish_early(self) -> list[Launch | Retire]:
        """End of backward: start every early bucket backward did not (ZeRO-2: every one with
        gradients accumulated since its last launch, or never launched this step)."""
        out: list[Launch | Retire] = []
        for k, b in enumerate(self.buckets):
            unsent = (self.launches[k] == 0 or bool(self.round[k])) if self.each_backward else not self.sent(k)
            if not b.late and unsent:
                out += self._launch(k, from_hook=False)
        return out

    def finish_late(self) -> list[Launch | Retire]:
        """After the late sums: start the late buckets, then retire everything in flight."""
        out: list[Launch | Retire] = []
        for k, b in enumerate(self.buckets):
            if b.late:
                out += self._launch(k, from_hook=False)
        out += [self._retire(f) for f in list(self.in_flight)]
        return out

    def _launch(self, k: int, *, from_hook: bool) -> list[Launch | Retire]:
        self.launches[k] += 1
        self.round[k] = set()
        launch = Launch(k, self.launches[k], self._count, from_hook)
        self._count += 1
        out: list[Launch | Retire] = [launch]
        if not self.each_backward:
            return out
        while len(self.in_flight) >= MAX_IN_FLIGHT:  # the oldest is waited for after this one started
            out.append(self._retire(self.in_flight[0]))
        self.in_flight.append(launch)
        if not self.overlap:
            out.append(self._retire(launch))
        return out

    def _retire(self, launch: Launch) -> Retire:
        self.in_flight.remove(launch)
        return Retire(launch.bucket, launch.launch)
