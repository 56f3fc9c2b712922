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
from typing import Iterable, Sequence

import torch
from torch import nn

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
