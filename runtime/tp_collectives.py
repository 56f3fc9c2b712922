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
