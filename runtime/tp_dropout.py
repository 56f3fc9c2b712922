"""Dropout on a tensor-parallel shard that draws the mask single-device training would draw.

A dropout inside a tensor-parallel region (attention probabilities sharded by heads) sees only
this rank's slice of the tensor. Drawing a mask for the slice alone would give every tp rank
the same mask pattern (their random streams are equal, as they must be for the replicated
regions) and would move the stream differently from one device. Megatron gives the sharded
regions their own per-rank stream instead; we keep single-device semantics exactly:

``partitioner.sharded_dropout(x, p, dim, rank, degree, sections)`` draws the mask of the FULL
tensor (``x``'s shape with ``dim`` at its global size: ``sections`` summed, or ``degree`` times
the local size) from the default generator, the way ``aten.dropout`` does on CPU
(``empty.bernoulli_(1 - p)``, then ``/ (1 - p)``), and keeps this rank's slice of every section.
So every tp rank consumes the stream as one device would; every later random op (the replicated
regions' dropouts) stays identical across tp ranks and equal to one device; and activation
checkpointing, which restores the default generator before recomputing, redraws the same mask.
The price is drawing ``degree`` times the local mask (a transient full-size tensor).

Output: ``(y, mask)`` with ``mask`` the kept slice as ``bool`` (saved for backward, 1 byte per
element as ``native_dropout`` saves); backward is ``grad · mask / (1 - p)``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _rank_slice(full: Tensor, dim: int, rank: int, degree: int, sections: list[int]) -> Tensor:
    pieces, offset = [], 0
    for size in sections or [full.shape[dim]]:
        chunk = size // degree
        pieces.append(full.narrow(dim, offset + rank * chunk, chunk))
        offset += size
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


@torch.library.custom_op("partitioner::sharded_dropout", mutates_args=())
def sharded_dropout(x: Tensor, p: float, dim: int, rank: int, degree: int,
                    sections: list[int]) -> tuple[Tensor, Tensor]:
    """Dropout (probability ``p``) of tp rank ``rank``'s shard ``x`` along ``dim`` with the mask
    one device draws for the whole tensor (see the module docstring)."""
    shape = list(x.shape)
    shape[dim] = sum(sections) if sections else shape[dim] * degree
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    kept = _rank_slice(noise, dim, rank, degree, sections)
    if p == 1:  # aten.dropout gives zeros without dividing by 0
        return x * 0.0, kept.bool()
    return x * kept.div(1 - p), kept.bool()


@sharded_dropout.register_fake
def _(x, p, dim, rank, degree, sections):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _setup(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.save_for_backward(output[1])


def _backward(ctx, grad, _grad_mask):
    (mask,) = ctx.saved_tensors
    scale = 0.0 if ctx.p == 1 else 1 - ctx.p
    noise = mask.to(grad.dtype) if scale == 0.0 else mask.to(grad.dtype).div(scale)
    return (grad * noise if scale else grad * 0.0), None, None, None, None, None


sharded_dropout.register_autograd(_backward, setup_context=_setup)
