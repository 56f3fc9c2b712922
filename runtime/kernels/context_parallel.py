"""Real kernels of the context-parallel ops (:mod:`passes.ir.cp_ops`): ring attention and Ulysses.

The cp group is looked up by name in :mod:`runtime.kernels.collectives`' registry. That module's
handles have no point-to-point or all-to-all, so this one adds the two exchanges it needs on top
of each kind of handle:

* ``shift``: every rank sends one tensor to rank+1 and receives rank-1's (the ring step). On a
  :class:`DistGroup` one ``batch_isend_irecv`` per step through :func:`runtime.dist.comm.post_p2p`
  (receive and send posted together, peers as global ranks), so it runs on gloo and NCCL alike;
* ``all_to_all``: part ``j`` of this rank to rank ``j``, part ``j`` received from rank ``j``
  (``all_to_all_single`` on the group's device, waited with the group's timeout).

Simulated groups (threads of one process) exchange through their shared slots and barrier; a
trace group (ONNX export) returns tensors of the right shapes from this rank's data.

Ring attention is computed in float32 (scores, running max via log-sum-exp, outputs and the
dk/dv that travel in backward) and cast back at the end. The next K/V block is posted before the
current one is computed, so communication overlaps compute; the only waits in the loop are on
the received buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from passes.ir.cp_ops import (
    check_heads,
    check_layout,
    chunk_ids,
    default_scale,
    rank_order_index,
    true_order_index,
    true_positions,
)
from passes.ir.errors import ConfigError
from passes.ir.ops import qualname
from runtime.dist import comm
from runtime.kernels.collectives import DistGroup, SimulatedGroup, TraceGroup, get_group


def _register(name: str):
    def deco(fn):
        torch.library.register_kernel(qualname(name), None, fn)
        return fn
    return deco


# --- exchanges --------------------------------------------------------------------------------------
def _cp_group(group: str, degree: int):
    """The cp group registered as ``group`` (its ``rank`` is this rank's place on the ring)."""
    g = get_group(group)
    if g.size != degree:
        raise ConfigError(f"context-parallel op built for cp={degree} runs on group {group!r} of {g.size} ranks; "
                          f"register this rank's cp group (cp={degree} ranks) under {group!r}")
    return g


@dataclass(frozen=True)
class _Pending:
    """A posted ring step: wait for it, then read ``out``."""

    works: tuple
    group: object
    out: Tensor

    def wait(self) -> Tensor:
        for w in self.works:
            comm.wait(w, self.group)
        return self.out


def _shift(g, t: Tensor, tag: int = 0) -> _Pending:
    """Post: send ``t`` to rank+1, receive rank-1's tensor of the same shape."""
    t = t.contiguous()
    if isinstance(g, DistGroup):
        pg = g.group if g.group is not None else dist.group.WORLD
        nxt = dist.get_global_rank(pg, (g.rank + 1) % g.size)
        prv = dist.get_global_rank(pg, (g.rank - 1) % g.size)
        out = torch.empty_like(t)
        works = comm.post_p2p([comm.P2P("recv", out, prv, tag=tag, group=g.group),
                                comm.P2P("send", t, nxt, tag=tag, group=g.group)])
        return _Pending(tuple(works), g.group, out)
    if isinstance(g, SimulatedGroup):
        c = g.comm
        c.slots[g.rank] = t
        c.barrier.wait()
        out = c.slots[(g.rank - 1) % g.size].clone()
        c.barrier.wait()
        return _Pending((), None, out)
    if isinstance(g, TraceGroup):
        return _Pending((), None, t.clone())
    raise ConfigError(f"context parallelism cannot run on a group handle of type {type(g).__name__}")


def _all_to_all(g, x: Tensor) -> Tensor:
    """``out[j]`` = rank j's ``x[this rank]`` (``x``: ``[size, ...]``)."""
    x = x.contiguous()
    if isinstance(g, DistGroup):
        comm.check_device(x, g.group, "all_to_all")
        out = torch.empty_like(x)
        comm.wait(dist.all_to_all_single(out, x, group=g.group, async_op=True), g.group)
        return out
    if isinstance(g, SimulatedGroup):
        c = g.comm
        c.slots[g.rank] = x
        c.barrier.wait()
        out = torch.stack([c.slots[j][g.rank].clone() for j in range(g.size)])
        c.barrier.wait()
        return out
    if isinstance(g, TraceGroup):
        return x.clone()
    raise ConfigError(f"context parallelism cannot run on a group handle of type {type(g).__name__}")


# --- ring attention -----------------------------------------------------------------------------------
def _pair(qa: int, kb: int, causal: bool) -> str | None:
    """How query chunk ``qa`` sees key chunk ``kb``: "full", "diag" (causal inside) or None (skipped)."""
    if not causal or qa > kb:
        return "full"
    return "diag" if qa == kb else None


def _scores(q: Tensor, k: Tensor, scale: float, kind: str) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind == "diag":
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _expand_heads(t: Tensor, rep: int) -> Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _check_ring(q: Tensor, k: Tensor, v: Tensor, degree: int, group: str):
    """(group or None at cp=1, this rank, chunk length, query heads per kv head)."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ConfigError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: kv heads "
                          f"must divide query heads and k, v have one shape")
    c = check_layout(q.shape[2] * degree, degree, "ring attention's sequence length")
    g = _cp_group(group, degree) if degree > 1 else None
    return g, (g.rank if g is not None else 0), c, q.shape[1] // k.shape[1]


@_register("ring_attention")
def _ring_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, degree: int,
                    group: str) -> tuple[Tensor, Tensor]:
    g, rank, c, rep = _check_ring(q, k, v, degree, group)
    scale = default_scale(q.shape[-1], scale)
    qs = q.float().split(c, dim=2)
    q_ids = chunk_ids(rank, degree)
    out: list[Tensor | None] = [None, None]
    lse: list[Tensor | None] = [None, None]
    kv = torch.stack([k, v])  # one message per ring step
    for step in range(degree):
        pending = _shift(g, kv) if step < degree - 1 else None  # next block in flight while this one computes
        kv_ids = chunk_ids((rank - step) % degree, degree)
        kf = _expand_heads(kv[0].float(), rep).split(c, dim=2)
        vf = _expand_heads(kv[1].float(), rep).split(c, dim=2)
        for a in range(2):
            for b in range(2):
                kind = _pair(q_ids[a], kv_ids[b], causal)
                if kind is None:
                    continue
                s = _scores(qs[a], kf[b], scale, kind)
                l_blk = torch.logsumexp(s, dim=-1)
                o_blk = torch.matmul(torch.exp(s - l_blk[..., None]), vf[b])
                if out[a] is None:
                    out[a], lse[a] = o_blk, l_blk
                else:
                    new = torch.logaddexp(lse[a], l_blk)
                    out[a] = out[a] * torch.exp(lse[a] - new)[..., None] + o_blk * torch.exp(l_blk - new)[..., None]
                    lse[a] = new
        if pending is not None:
            kv = pending.wait()
    # In q's layout (as the fake kernel and SDPA give it): the model's transpose back to
    # [B, S, H, D] is then a view, not a copy that the next linear saves beside this output.
    res = torch.empty_like(q)
    res[:, :, :c].copy_(out[0])
    res[:, :, c:].copy_(out[1])
    return res, torch.cat(lse, dim=2)


@_register("ring_attention_backward")
def _ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             causal: bool, scale: float | None, degree: int,
                             group: str) -> tuple[Tensor, Tensor, Tensor]:
    g, rank, c, rep = _check_ring(q, k, v, degree, group)
    scale = default_scale(q.shape[-1], scale)
    b_, hkv, s_, d_ = k.shape
    qs = q.float().split(c, dim=2)
    dos = grad_out.float().split(c, dim=2)
    lses = lse.split(c, dim=2)
    deltas = (grad_out.float() * out.float()).sum(-1).split(c, dim=2)  # D_i = rowsum(dO * O)
    dq = [torch.zeros_like(qs[0]), torch.zeros_like(qs[1])]
    q_ids = chunk_ids(rank, degree)
    kv = torch.stack([k, v])
    dkv = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)  # grads of the block held
    for step in range(degree):
        pending = _shift(g, kv) if step < degree - 1 else None
        kv_ids = chunk_ids((rank - step) % degree, degree)
        kf = _expand_heads(kv[0].float(), rep).split(c, dim=2)
        vf = _expand_heads(kv[1].float(), rep).split(c, dim=2)
        dk_full = [torch.zeros_like(kf[0]), torch.zeros_like(kf[1])]
        dv_full = [torch.zeros_like(vf[0]), torch.zeros_like(vf[1])]
        for a in range(2):
            for b in range(2):
                kind = _pair(q_ids[a], kv_ids[b], causal)
                if kind is None:
                    continue
                p = torch.exp(_scores(qs[a], kf[b], scale, kind) - lses[a][..., None])
                dv_full[b] += torch.matmul(p.transpose(-1, -2), dos[a])
                ds = p * (torch.matmul(dos[a], vf[b].transpose(-1, -2)) - deltas[a][..., None])
                dq[a] += torch.matmul(ds, kf[b]) * scale
                dk_full[b] += torch.matmul(ds.transpose(-1, -2), qs[a]) * scale
        dk = torch.cat(dk_full, dim=2)
        dv = torch.cat(dv_full, dim=2)
        if rep > 1:  # query heads sharing a kv head add their gradients
            dk = dk.view(b_, hkv, rep, s_, d_).sum(2)
            dv = dv.view(b_, hkv, rep, s_, d_).sum(2)
        dkv = dkv + torch.stack([dk, dv])
        if pending is not None:
            kv = pending.wait()
        # The block's gradients follow it round the ring; after the last step they reach its owner.
        dkv = _shift(g, dkv, tag=1).wait() if g is not None else dkv
    return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# --- Ulysses ---------------------------------------------------------------------------------------
@_register("seq_to_heads")
def _seq_to_heads(x: Tensor, degree: int, group: str) -> Tensor:
    b, h, s, d = x.shape
    check_heads(h, degree, "heads")
    if degree == 1:
        return x.clone()
    c = check_layout(s * degree, degree)
    g = _cp_group(group, degree)
    parts = x.reshape(b, degree, h // degree, s, d).transpose(0, 1)  # [cp, B, H/cp, S_local, D]
    got = _all_to_all(g, parts)  # got[j]: rank j's shard of this rank's heads
    gathered = got.permute(1, 2, 0, 3, 4).reshape(b, h // degree, degree * s, d)  # rank order
    return gathered.index_select(2, true_order_index(degree, c, x.device))


@_register("heads_to_seq")
def _heads_to_seq(x: Tensor, degree: int, group: str) -> Tensor:
    b, hl, s, d = x.shape
    if degree == 1:
        return x.clone()
    c = check_layout(s, degree)
    g = _cp_group(group, degree)
    ranked = x.index_select(2, rank_order_index(degree, c, x.device))  # rank j's shard at slot j
    parts = ranked.reshape(b, hl, degree, s // degree, d).permute(2, 0, 1, 3, 4)  # [cp, B, H/cp, S_local, D]
    got = _all_to_all(g, parts)  # got[j]: head group j of this rank's shard
    return got.transpose(0, 1).reshape(b, degree * hl, s // degree, d)


@_register("reduce_from_cp")
def _reduce_from_cp(x: Tensor, degree: int, group: str) -> Tensor:
    if degree == 1:
        return x.clone()
    return _cp_group(group, degree).all_reduce(x.contiguous(), "sum")


@_register("load_balanced_positions")
def _load_balanced_positions(index: Tensor, degree: int, group: str) -> Tensor:
    rank = _cp_group(group, degree).rank if degree > 1 else 0
    return true_positions(index, rank, degree)
