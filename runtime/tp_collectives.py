"""Autograd-aware tensor-parallel collectives, registered as ``torch.library`` custom ops so
they appear by name in the IR (``partitioner.copy_to_tp``, ``partitioner.reduce_from_tp``, ...).

A custom op cannot take a ``ProcessGroup`` argument, so every op takes a group *name*, looked
up in a small registry (:func:`register_group`). A name maps to a handle that knows its rank:

* :class:`DistGroup`: a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU);
* :class:`SimulatedGroup`: one of ``n`` threads of one process running the tp rank programs in
  lockstep, all-reducing through shared memory and a barrier (tests without process spawning).

Megatron's pair of region boundaries (Shoeybi et al. 2019, f and g):

====================  ===================  ===================
op                    forward              backward
====================  ===================  ===================
``copy_to_tp``        identity             all-reduce (sum)
``reduce_from_tp``    all-reduce (sum)     identity
====================  ===================  ===================

Sequence parallelism (Korthikanti et al. 2022) adds four ops over a sequence dim ``dim`` of a
tensor split in ``tp`` equal contiguous chunks (rank ``r`` holds chunk ``r``):

========================  ============================  ============================
op                        forward                       backward
========================  ============================  ============================
``reduce_scatter_seq``    reduce-scatter (sum) on dim   all-gather on dim
``all_gather_seq``        all-gather on dim             reduce-scatter (sum) on dim
``scatter_to_seq``        keep this rank's chunk        all-gather on dim
``gather_from_seq``       all-gather on dim             keep this rank's chunk
========================  ============================  ============================

(``reduce_scatter_seq`` replaces ``reduce_from_tp`` after a row-parallel linear, ``all_gather_seq``
replaces ``copy_to_tp`` before a column-parallel one; the other two enter / leave a
sequence-parallel region from / to a replicated one.) Their fake kernels give the local sizes
(``seq // tp``) so shape passes run on the rewritten graphs.

plus ``vocab_parallel_cross_entropy``: per-token cross-entropy over vocabulary-sharded logits
with three all-reduces (max, sum of exp, target logit) and a local backward (softmax - one-hot).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from partitioner.errors import ConfigError

_OPS = ("sum", "max")


# --- group registry -----------------------------------------------------------------------------
class _Comm:
    """Shared state of one simulated group: a slot per rank and a barrier."""

    def __init__(self, size: int, timeout_s: float):
        self.size = size
        self.slots: list[Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)


@dataclass(frozen=True)
class SimulatedGroup:
    """Rank ``rank`` of an in-process group of ``size`` threads (see :func:`simulated_groups`)."""

    comm: _Comm = field(repr=False)
    rank: int
    size: int

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        c = self.comm
        c.slots[self.rank] = t
        c.barrier.wait()  # every rank has deposited
        # Every rank reduces in rank order, so all ranks get bit-identical results.
        out = c.slots[0].clone()
        for other in c.slots[1:]:
            out = out + other if op == "sum" else torch.maximum(out, other)
        c.barrier.wait()  # every rank has read before any slot is overwritten
        return out

    def all_gather(self, t: Tensor, dim: int) -> Tensor:
        c = self.comm
        c.slots[self.rank] = t
        c.barrier.wait()
        out = torch.cat([s.clone() for s in c.slots], dim=dim)
        c.barrier.wait()
        return out

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        # Sum in rank order (as all_reduce does), then keep this rank's chunk: bit-identical to
        # the corresponding chunk of an all-reduce.
        return self.all_reduce(t, "sum").chunk(self.size, dim=dim)[self.rank].clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class DistGroup:
    """A ``torch.distributed`` process group (``None``: the default group)."""

    group: object = None

    @property
    def rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size(self.group)

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        import torch.distributed as dist
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return out

    def all_gather(self, t: Tensor, dim: int) -> Tensor:
        import torch.distributed as dist
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        import torch.distributed as dist
        parts = [c.contiguous() for c in t.chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=self.group)
        return out


_GROUPS: dict[str, SimulatedGroup | DistGroup] = {}


def register_group(name: str, group: SimulatedGroup | DistGroup) -> None:
    """Make ``group`` reachable from the ops under ``name`` (replaces an earlier one)."""
    _GROUPS[name] = group


def unregister_group(name: str) -> None:
    _GROUPS.pop(name, None)


def get_group(name: str) -> SimulatedGroup | DistGroup:
    try:
        return _GROUPS[name]
    except KeyError:
        raise ConfigError(f"no tensor-parallel group named {name!r} is registered (known: {sorted(_GROUPS)}); "
                          f"call runtime.tp_collectives.register_group({name!r}, ...) on this rank first") from None


def simulated_groups(prefix: str, size: int, *, timeout_s: float = 60.0) -> list[str]:
    """Register ``size`` simulated ranks as ``f"{prefix}/rank{r}"`` and return their names.

    Run rank ``r``'s program in its own thread with group name ``names[r]``; a rank that never
    arrives at a collective makes the others fail after ``timeout_s`` seconds instead of hanging.
    """
    comm = _Comm(size, timeout_s)
    names = []
    for r in range(size):
        name = f"{prefix}/rank{r}"
        register_group(name, SimulatedGroup(comm, r, size))
        names.append(name)
    return names


# --- ops ----------------------------------------------------------------------------------------
@torch.library.custom_op("partitioner::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str, op: str = "sum") -> Tensor:
    """All-reduce (``op``: "sum" or "max") across the tp group; no autograd (used inside others)."""
    if op not in _OPS:
        raise ConfigError(f"all_reduce op {op!r} is not supported; use one of {_OPS}")
    return get_group(group).all_reduce(x.contiguous(), op)


@all_reduce.register_fake
def _(x, group, op="sum"):
    return torch.empty_like(x)


@torch.library.custom_op("partitioner::copy_to_tp", mutates_args=())
def copy_to_tp(x: Tensor, group: str) -> Tensor:
    """Enter a tp region: identity forward, all-reduce (sum) of the gradient backward."""
    return x.clone()  # a custom op may not return an alias of its input


@copy_to_tp.register_fake
def _(x, group):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output):
    ctx.group = inputs[1]


def _copy_backward(ctx, grad):
    return all_reduce(grad, ctx.group, "sum"), None


copy_to_tp.register_autograd(_copy_backward, setup_context=_copy_setup)


@torch.library.custom_op("partitioner::reduce_from_tp", mutates_args=())
def reduce_from_tp(x: Tensor, group: str) -> Tensor:
    """Leave a tp region: all-reduce (sum) forward, identity backward."""
    return get_group(group).all_reduce(x.contiguous(), "sum")


@reduce_from_tp.register_fake
def _(x, group):
    return torch.empty_like(x)


def _reduce_backward(ctx, grad):
    return grad, None


reduce_from_tp.register_autograd(_reduce_backward, setup_context=_copy_setup)


@torch.library.custom_op("partitioner::vocab_parallel_cross_entropy", mutates_args=())
def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int,
                                 group: str) -> tuple[Tensor, Tensor]:
    """Per-token cross-entropy of ``logits`` ``[N, V/tp]`` (this rank's vocabulary slice, starting
    at ``vocab_start``) against global ``target`` ids ``[N]``; tokens equal to ``ignore_index`` get 0.

    Returns ``(loss [N], softmax [N, V/tp])``; the softmax is kept for backward only.
    """
    g = get_group(group)
    x = logits.float()
    x = x - g.all_reduce(x.max(dim=1).values, "max")[:, None]  # stable: subtract the global max
    exp = x.exp()
    sum_exp = g.all_reduce(exp.sum(dim=1), "sum")
    local = target - vocab_start
    mine = (local >= 0) & (local < logits.shape[1])
    picked = x.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    target_logit = g.all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), "sum")
    loss = torch.where(target == ignore_index, torch.zeros_like(target_logit), sum_exp.log() - target_logit)
    softmax = exp / sum_exp[:, None]
    return loss.to(logits.dtype), softmax.to(logits.dtype)


@vocab_parallel_cross_entropy.register_fake
def _(logits, target, vocab_start, ignore_index, group):
    return logits.new_empty(logits.shape[:1]), torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    _, target, vocab_start, ignore_index, _ = inputs
    ctx.save_for_backward(output[1], target)
    ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index


def _ce_backward(ctx, grad_loss, grad_softmax):
    softmax, target = ctx.saved_tensors
    local = target - ctx.vocab_start
    mine = (local >= 0) & (local < softmax.shape[1])
    grad = softmax.clone()
    rows = torch.nonzero(mine)[:, 0]
    grad[rows, local[rows]] -= 1.0
    scale = torch.where(target == ctx.ignore_index, torch.zeros_like(grad_loss), grad_loss)
    return grad * scale[:, None], None, None, None, None


vocab_parallel_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)


# --- sequence parallelism -------------------------------------------------------------------------
def _seq_group(x: Tensor, dim: int, tp: int, group: str, *, local: bool):
    """The group, after checking it has ``tp`` ranks and that ``x`` splits evenly along ``dim``."""
    g = get_group(group)
    if g.size != tp:
        raise ConfigError(f"sequence-parallel op built for tp={tp} runs on group {group!r} of {g.size} ranks")
    if not local and x.shape[dim] % tp:
        raise ConfigError(f"sequence parallelism: sequence length {x.shape[dim]} (dim {dim} of shape "
                          f"{tuple(x.shape)}) is not divisible by tp={tp}; pad the sequence to a multiple of "
                          f"{tp} or turn sequence_parallel off")
    return g


def _chunk(x: Tensor, dim: int, tp: int, rank: int) -> Tensor:
    return x.chunk(tp, dim=dim)[rank].clone(memory_format=torch.contiguous_format)  # never an alias of x


@torch.library.custom_op("partitioner::reduce_scatter_seq", mutates_args=())
def reduce_scatter_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    """Leave a tp region into a sequence-parallel one: sum partial results over the tp group and
    keep this rank's chunk of ``dim``; backward all-gathers the gradient."""
    return _seq_group(x, dim, tp, group, local=False).reduce_scatter(x.contiguous(), dim)


@torch.library.custom_op("partitioner::all_gather_seq", mutates_args=())
def all_gather_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    """Enter a tp region from a sequence-parallel one: all-gather the chunks of ``dim``; backward
    reduce-scatters the (partial, per-rank) gradient."""
    return _seq_group(x, dim, tp, group, local=True).all_gather(x.contiguous(), dim)


@torch.library.custom_op("partitioner::scatter_to_seq", mutates_args=())
def scatter_to_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    """A replicated tensor into a sequence-parallel region: this rank's chunk of ``dim`` (no
    communication); backward all-gathers the gradient, so the replicated side sees it whole."""
    g = _seq_group(x, dim, tp, group, local=False)
    return _chunk(x, dim, tp, g.rank)


@torch.library.custom_op("partitioner::gather_from_seq", mutates_args=())
def gather_from_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    """Leave a sequence-parallel region into a replicated one: all-gather ``dim``; backward keeps
    this rank's chunk of the (replicated, identical) gradient."""
    return _seq_group(x, dim, tp, group, local=True).all_gather(x.contiguous(), dim)


def _seq_fake(scale_up: bool):
    def fake(x, dim, tp, group):
        shape = list(x.shape)
        shape[dim] = shape[dim] * tp if scale_up else shape[dim] // tp
        return x.new_empty(shape)
    return fake


def _seq_setup(ctx, inputs, output):
    ctx.dim, ctx.tp, ctx.group = inputs[1], inputs[2], inputs[3]


def _bwd_all_gather(ctx, grad):
    return all_gather_seq(grad, ctx.dim, ctx.tp, ctx.group), None, None, None


def _bwd_reduce_scatter(ctx, grad):
    return reduce_scatter_seq(grad, ctx.dim, ctx.tp, ctx.group), None, None, None


def _bwd_chunk(ctx, grad):
    return _chunk(grad, ctx.dim, ctx.tp, get_group(ctx.group).rank), None, None, None


for _op, _up, _bwd in ((reduce_scatter_seq, False, _bwd_all_gather), (all_gather_seq, True, _bwd_reduce_scatter),
                       (scatter_to_seq, False, _bwd_all_gather), (gather_from_seq, True, _bwd_chunk)):
    _op.register_fake(_seq_fake(_up))
    _op.register_autograd(_bwd, setup_context=_seq_setup)


def all_reduce_grads(params, group: str) -> int:
    """Sum ``p.grad`` of ``params`` over the tp group ``group`` in one flat buffer (replicated
    parameters read in sequence-parallel regions, whose gradients are per-sequence-chunk
    partials); returns the bytes reduced. Every tp rank must pass the same shapes in the same order."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = get_group(group).all_reduce(flat, "sum")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def run_simulated(fns, *, timeout_s: float = 120.0) -> list:
    """Run ``fns[r]()`` for every simulated rank ``r`` in its own thread; returns their results.

    The first exception of any rank is re-raised here (the others then time out at their next
    collective rather than hang). Autograd runs CPU backward on the calling thread, so each
    rank's forward *and* backward run in its thread, reaching the collectives in the same order.
    """
    results: list = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def work(r):
        try:
            results[r] = fns[r]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[r] = exc
            for g in list(_GROUPS.values()):  # wake the other ranks instead of letting them wait
                if isinstance(g, SimulatedGroup):
                    g.comm.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated tp ranks did not finish within {timeout_s} s")
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
