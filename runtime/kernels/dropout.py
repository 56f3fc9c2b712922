"""Real kernel of ``partitioner::sharded_dropout`` (schema, fake kernel and autograd in
:mod:`passes.ir.ops`): dropout on a tensor-parallel shard with the mask one device draws.

A dropout inside a tensor-parallel region (attention probabilities sharded by heads) sees only
this rank's slice of the tensor. Drawing a mask for the slice alone would give every tp rank
the same mask pattern (their random streams are equal, as they must be for the replicated
regions) and would move the stream differently from one device. Megatron gives the sharded
regions their own per-rank stream instead; we keep single-device semantics exactly: the kernel
draws the mask of the FULL tensor (``x``'s shape with ``dim`` at its global size: ``sections``
summed, or ``degree`` times the local size) from the default generator, the way ``aten.dropout``
does on CPU (``empty.bernoulli_(1 - p)``, then ``/ (1 - p)``), and keeps this rank's slice of
every section. So every tp rank consumes the stream as one device would; every later random op
(the replicated regions' dropouts) stays identical across tp ranks and equal to one device; and
activation checkpointing, which restores the default generator before recomputing, redraws the
same mask. The price is drawing ``degree`` times the local mask (a transient full-size tensor).

Output: ``(y, mask)`` with ``mask`` the kept slice as ``bool`` (saved for backward, 1 byte per
element as ``native_dropout`` saves).
"""
from __future__ import annotations

import torch
from torch import Tensor

from passes.ir.ops import qualname, rank_slice


@torch.library.register_kernel(qualname("sharded_dropout"), None)
def _sharded_dropout(x: Tensor, p: float, dim: int, rank: int, degree: int,
                     sections: list[int]) -> tuple[Tensor, Tensor]:
    shape = list(x.shape)
    shape[dim] = sum(sections) if sections else shape[dim] * degree
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    kept = rank_slice(noise, dim, rank, degree, sections)
    if p == 1:  # aten.dropout gives zeros without dividing by 0
        return x * 0.0, kept.bool()
    return x * kept.div(1 - p), kept.bool()
