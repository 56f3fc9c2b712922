"""Context-parallel (cp) attention ops: schemas, fake kernels, autograd, and the sequence layout.

Context parallelism cuts the *sequence* of every activation over ``degree`` ranks; only attention
needs the other ranks' tokens. Every op takes its cp group by *name* (a custom op cannot take a
``ProcessGroup``), resolved by the runtime's group registry
(:func:`runtime.kernels.collectives.register_group`); the real kernels are
:mod:`runtime.kernels.context_parallel`. No op takes the cp rank: the kernels read it from the
group, so every cp rank runs the same program (as every dp rank does).

**Layout** (load-balanced for causal attention, as Megatron-Core CP): the sequence of length ``S``
is cut into ``2 * degree`` equal chunks and rank ``r`` holds chunks ``r`` and ``2*degree-1-r``, in
that order (:func:`load_balanced_chunks`); every rank then has the same causal work.

=====================================  =======================================  ==============================
op                                     forward                                  backward
=====================================  =======================================  ==============================
``ring_attention(q,k,v,causal,scale,   attention of this rank's queries over    ``ring_attention_backward``:
degree,group) -> (out, lse)``          all keys: K/V travel the ring (send to   dq local, dk/dv accumulate and
                                       rank+1, receive from rank-1), blocks     travel the ring back to their
                                       merged by online softmax                 owner
``seq_to_heads(x,degree,group)``       all-to-all: [B,H,S/cp,D] sequence shard  ``heads_to_seq``
                                       -> [B,H/cp,S,D] head shard, true order
``heads_to_seq(x,degree,group)``       the inverse                              ``seq_to_heads``
``reduce_from_cp(x,degree,group)``     all-reduce (sum)                         ``degree`` x the gradient
``load_balanced_positions(i,degree,    local index -> true sequence position    (not differentiable)
group)``
=====================================  =======================================  ==============================

``ring_attention``: q ``[B, H, S_local, D]``, k/v ``[B, H_kv, S_local, D]`` with ``H_kv`` dividing
``H`` (grouped-query attention: query head ``h`` reads kv head ``h // (H / H_kv)``); ``scale``
None means ``1/sqrt(D)``. Causal masking is decided per (query chunk, key chunk) pair: a later
query chunk sees an earlier key chunk whole, a diagonal pair is masked inside, a pair whose keys
all come after its queries is skipped. ``lse`` (float32 ``[B, H, S_local]``, the log-sum-exp of
each query's scores) is saved for backward and gets no gradient.

Ulysses (Jacobs et al. 2023): ``seq_to_heads`` on q, k, v, plain SDPA over the whole sequence with
``H/cp`` heads, ``heads_to_seq`` on its output. Heads (and kv heads) must divide by ``degree``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from passes.ir.errors import ConfigError
from passes.ir.ops import _LIB, qualname

from passes.ir.config import CP_MODES, ContextParallelMode as CPMode  # noqa: F401  (re-exported)

# ``gm.meta[CONTEXT_PARALLEL]`` (defined with every key in passes.ir.meta): the ContextParallelPlan below

SCHEMAS = {
    "ring_attention":
        "(Tensor q, Tensor k, Tensor v, bool causal, float? scale, int degree, str group) -> (Tensor, Tensor)",
    "ring_attention_backward":
        "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float? scale, "
        "int degree, str group) -> (Tensor, Tensor, Tensor)",
    "seq_to_heads": "(Tensor x, int degree, str group) -> Tensor",
    "heads_to_seq": "(Tensor x, int degree, str group) -> Tensor",
    "reduce_from_cp": "(Tensor x, int degree, str group) -> Tensor",
    "load_balanced_positions": "(Tensor index, int degree, str group) -> Tensor",
}
"""Op name -> schema (without the name), as ``torch.library.define`` takes it."""

CP_OPS = ("ring_attention", "ring_attention_backward", "seq_to_heads", "heads_to_seq", "reduce_from_cp")
"""The ops that communicate over a cp group."""
CP_GROUP_OPS = CP_OPS + ("load_balanced_positions",)
"""The ops that read their cp group (the last argument) at run time."""

for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)

ops = torch.ops.partitioner


@dataclass(frozen=True, kw_only=True)
class ContextParallelPlan:
    """What :func:`passes.rewrites.context_parallel.apply_context_parallel` did to a graph: ``gm.meta[CONTEXT_PARALLEL]``.

    The runtime feeds each input named in ``sharded_inputs`` as this rank's shard
    (:func:`shard_sequence` along the given dim), *averages* parameter gradients over the cp group
    (each rank's are ``degree`` x its tokens' share: Megatron's convention, so that cp ranks
    average with the dp ranks) and reads the loss as is (already the global mean).
    """

    mode: CPMode
    degree: int
    group: str  # name of the cp group in the runtime's registry
    seq_dim: str  # the named dim that is cut
    seq_len: int  # the captured (global) sequence length hint
    sharded_inputs: tuple[tuple[str, int], ...]  # (placeholder name, tensor dim holding the sequence)
    attention: int  # scaled_dot_product_attention nodes rewritten
    positions: int  # position tables (arange / buffer slices) mapped to true positions
    losses: int  # mean cross-entropy losses made global


# --- layout -------------------------------------------------------------------------------------
def check_layout(seq_len: int, degree: int, what: str = "sequence length") -> int:
    """The chunk length ``seq_len / (2 * degree)``; ConfigError when it does not divide."""
    if degree < 1:
        raise ConfigError(f"context parallelism: degree must be >= 1, got {degree}")
    if seq_len % (2 * degree):
        raise ConfigError(f"context parallelism: {what} {seq_len} is not divisible by 2*cp={2 * degree} (the "
                          f"load-balanced layout cuts it in 2*cp chunks); pad the sequence to a multiple of "
                          f"{2 * degree} or use a smaller cp")
    return seq_len // (2 * degree)


def chunk_ids(rank: int, degree: int) -> tuple[int, int]:
    """The two chunks (of ``2 * degree``) rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * degree - 1 - rank


def load_balanced_chunks(seq_len: int, degree: int, rank: int) -> Tensor:
    """The sequence indices (int64, ``[seq_len / degree]``) rank ``rank`` holds, in its local order."""
    c = check_layout(seq_len, degree)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, degree)])


def shard_sequence(full: Tensor, dim: int, rank: int, degree: int) -> Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (a copy), under the load-balanced layout."""
    index = load_balanced_chunks(full.shape[dim], degree, rank).to(full.device)
    return full.index_select(dim, index)


def unshard_sequence(shards: list[Tensor], dim: int) -> Tensor:
    """The full tensor back from every rank's shard (``shards[r]``: rank r's), in true order."""
    degree = len(shards)
    local = shards[0].shape[dim]
    if local % 2:
        raise ConfigError(f"unshard_sequence: a shard of length {local} along dim {dim} is not two equal chunks")
    c = local // 2
    chunks: list[Tensor | None] = [None] * (2 * degree)
    for r, s in enumerate(shards):
        first, second = chunk_ids(r, degree)
        chunks[first], chunks[second] = s.narrow(dim, 0, c), s.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def true_order_index(degree: int, chunk: int, device=None) -> Tensor:
    """Index (int64, ``[2*degree*chunk]``) that puts a sequence gathered in rank order (rank 0's
    shard, then rank 1's, ...) back in true order: ``true = gathered.index_select(dim, index)``."""
    slot = {}
    for r in range(degree):
        for half, cid in enumerate(chunk_ids(r, degree)):
            slot[cid] = 2 * r + half
    base = torch.arange(chunk, device=device)
    return torch.cat([slot[cid] * chunk + base for cid in range(2 * degree)])


def rank_order_index(degree: int, chunk: int, device=None) -> Tensor:
    """The inverse of :func:`true_order_index`: ``gathered = true.index_select(dim, index)``."""
    base = torch.arange(chunk, device=device)
    return torch.cat([cid * chunk + base for r in range(degree) for cid in chunk_ids(r, degree)])


def default_scale(head_dim: int, scale: float | None) -> float:
    """SDPA's softmax scale: ``scale``, or ``1/sqrt(head_dim)`` when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def check_heads(heads: int, degree: int, what: str, tp: int = 1) -> None:
    """ConfigError unless ``heads`` divides by ``tp * degree`` (Ulysses shards a tp rank's heads
    over the cp ranks)."""
    if heads % (tp * degree):
        on = f"tp*cp={tp * degree}" if tp > 1 else f"cp={degree}"
        raise ConfigError(f"Ulysses context parallelism: {what} {heads} is not divisible by {on} (each rank "
                          f"attends with its share of them); use a cp dividing {heads // math.gcd(heads, tp)} "
                          f"or mode='ring'")


# --- fake kernels ---------------------------------------------------------------------------------
@torch.library.register_fake(qualname("ring_attention"), lib=_LIB)
def _(q, k, v, causal, scale, degree, group):
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"ring_attention: query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    b, h, s, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake(qualname("ring_attention_backward"), lib=_LIB)
def _(grad_out, q, k, v, out, lse, causal, scale, degree, group):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake(qualname("seq_to_heads"), lib=_LIB)
def _(x, degree, group):
    b, h, s, d = x.shape
    check_heads(h, degree, "heads")
    return x.new_empty((b, h // degree, s * degree, d))


@torch.library.register_fake(qualname("heads_to_seq"), lib=_LIB)
def _(x, degree, group):
    b, h, s, d = x.shape
    return x.new_empty((b, h * degree, s // degree, d))


@torch.library.register_fake(qualname("reduce_from_cp"), lib=_LIB)
def _(x, degree, group):
    return torch.empty_like(x)


@torch.library.register_fake(qualname("load_balanced_positions"), lib=_LIB)
def _(index, degree, group):
    return torch.empty_like(index)


def true_positions(index: Tensor, rank: int, degree: int) -> Tensor:
    """Local index ``i`` (``0 <= i < 2c``) -> its true sequence position on cp rank ``rank``:
    chunk ``rank`` for ``i < c``, chunk ``2*degree-1-rank`` after (what ``load_balanced_positions``
    computes, its rank read from the group)."""
    c = index.shape[0] // 2
    first, second = chunk_ids(rank, degree)
    return torch.where(index < c, index + first * c, index - c + second * c)


# --- autograd --------------------------------------------------------------------------------------
def _ring_setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale, ctx.degree, ctx.group = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.set_materialize_grads(False)  # lse gets no gradient: no zeros of its size for it


def _ring_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ops.ring_attention_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.causal, ctx.scale,
                                             ctx.degree, ctx.group)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd(qualname("ring_attention"), _ring_backward, setup_context=_ring_setup, lib=_LIB)


def _group_setup(ctx, inputs, output):
    ctx.degree, ctx.group = inputs[1:]


torch.library.register_autograd(
    qualname("seq_to_heads"),
    lambda ctx, g: (ops.heads_to_seq(g.contiguous(), ctx.degree, ctx.group), None, None),
    setup_context=_group_setup, lib=_LIB)
torch.library.register_autograd(
    qualname("heads_to_seq"),
    lambda ctx, g: (ops.seq_to_heads(g.contiguous(), ctx.degree, ctx.group), None, None),
    setup_context=_group_setup, lib=_LIB)
# The loss is the global mean on every cp rank; its gradient is each rank's tokens' share, times
# ``degree`` so that the cp ranks *average* their gradients like dp replicas (Megatron's loss * cp).
torch.library.register_autograd(qualname("reduce_from_cp"), lambda ctx, g: (g * ctx.degree, None, None),
                                setup_context=_group_setup, lib=_LIB)
