"""Real kernels of the tensor-parallel ops (:mod:`passes.ir.ops`) and the tp group registry.

A custom op cannot take a ``ProcessGroup`` argument, so every op takes a group *name*, looked
up in a small registry (:func:`register_group`). A name maps to a handle that knows its rank:

* :class:`DistGroup`: a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU), whose
  collectives go through :mod:`runtime.dist.comm` (the mesh's timeout applies);
* :class:`SimulatedGroup`: one of ``n`` threads of one process running the tp rank programs in
  lockstep, all-reducing through shared memory and a barrier (tests without process spawning).

The ops' schemas, fake kernels and autograd formulas are in :mod:`passes.ir.ops`; this module
registers the kernels that run on real tensors (any device: ``register_kernel(..., None)``).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dist import comm

from passes.ir.errors import ConfigError
from passes.ir.ops import REDUCE_OPS, qualname


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
    """A ``torch.distributed`` process group (``None``: the default group), through :mod:`runtime.dist.comm`."""

    group: object = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        out = t.clone()
        comm.all_reduce(out, self.group, op=op)
        return out

    def all_gather(self, t: Tensor, dim: int) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        comm.all_gather(parts, t, self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        parts = [c.contiguous() for c in t.chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[0])
        comm.reduce_scatter(out, parts, self.group)
        return out


@dataclass(frozen=True)
class TraceGroup:
    """Rank ``rank`` of ``size`` as seen by a program traced on its own (ONNX export): every
    collective returns a tensor of the right shape from this rank's data alone (the values are
    not what a run would compute; only the graph and its shapes are recorded)."""

    rank: int
    size: int

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        return t.clone()

    def all_gather(self, t: Tensor, dim: int) -> Tensor:
        return torch.cat([t] * self.size, dim=dim)

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        return t.chunk(self.size, dim=dim)[self.rank].clone(memory_format=torch.contiguous_format)


_GROUPS: dict[str, SimulatedGroup | DistGroup | TraceGroup] = {}


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
                          f"call runtime.kernels.collectives.register_group({name!r}, ...) on this rank first") from None


@contextlib.contextmanager
def trace_groups(name: str, rank: int, size: int) -> Iterator[None]:
    """Group ``name`` as a :class:`TraceGroup` while the context is open (the registration it
    replaces, if any, comes back after): what tracing a rank program for ONNX runs in."""
    before = _GROUPS.get(name)
    register_group(name, TraceGroup(rank, size))
    try:
        yield
    finally:
        if before is None:
            unregister_group(name)
        else:
            register_group(name, before)


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


# --- kernels ------------------------------------------------------------------------------------
def _register(name: str):
    def deco(fn):
        torch.library.register_kernel(qualname(name), None, fn)
        return fn
    return deco


@_register("all_reduce")
def _all_reduce(x: Tensor, group: str, op: str = "sum") -> Tensor:
    if op not in REDUCE_OPS:
        raise ConfigError(f"all_reduce op {op!r} is not supported; use one of {REDUCE_OPS}")
    return get_group(group).all_reduce(x.contiguous(), op)


@_register("copy_to_tp")
def _copy_to_tp(x: Tensor, group: str) -> Tensor:
    return x.clone()  # a custom op may not return an alias of its input


@_register("reduce_from_tp")
def _reduce_from_tp(x: Tensor, group: str) -> Tensor:
    return get_group(group).all_reduce(x.contiguous(), "sum")


@_register("vocab_parallel_cross_entropy")
def _vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int,
                                  group: str) -> tuple[Tensor, Tensor]:
    g = get_group(group)
    # One [N, V/tp] buffer, made once and worked in place until it is the softmax: the logits are
    # the largest activation of a language model (with fp32 logits nothing else of their size is
    # alive in here; the memory replay, like LiveBytes, sees this op's outputs only).
    x = logits.float() - g.all_reduce(logits.max(dim=1).values.float(), "max")[:, None]  # stable
    local = target - vocab_start
    mine = (local >= 0) & (local < logits.shape[1])
    picked = x.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    target_logit = g.all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), "sum")
    x.exp_()
    sum_exp = g.all_reduce(x.sum(dim=1), "sum")
    loss = torch.where(target == ignore_index, torch.zeros_like(target_logit), sum_exp.log() - target_logit)
    softmax = x.div_(sum_exp[:, None])
    return loss.to(logits.dtype), softmax.to(logits.dtype)


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


@_register("reduce_scatter_seq")
def _reduce_scatter_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    return _seq_group(x, dim, tp, group, local=False).reduce_scatter(x.contiguous(), dim)


@_register("all_gather_seq")
def _all_gather_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    return _seq_group(x, dim, tp, group, local=True).all_gather(x.contiguous(), dim)


@_register("scatter_to_seq")
def _scatter_to_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    g = _seq_group(x, dim, tp, group, local=False)
    return x.chunk(tp, dim=dim)[g.rank].clone(memory_format=torch.contiguous_format)  # never an alias of x


@_register("gather_from_seq")
def _gather_from_seq(x: Tensor, dim: int, tp: int, group: str) -> Tensor:
    return _seq_group(x, dim, tp, group, local=True).all_gather(x.contiguous(), dim)


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
