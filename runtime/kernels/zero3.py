"""Real kernels of the ZeRO-3 ops (:mod:`passes.ir.zero3_ops`) and what frees and re-gathers the
full parameters around them.

One :class:`ParamGatherer` per rank and model, registered under the program's ZeRO-3 group name
(the ops look it up by name, as the tp ops look up their group):

* **forward**: ``zero3_gather`` at site ``s`` waits the gather of ``s`` if it was prefetched
  (else gathers now), then issues the gathers of the next ``prefetch`` sites of the stage's
  forward order as asynchronous work (on NCCL: the communicator's stream, overlapping compute);
* **between forward and backward**: :meth:`ParamGatherer.hooks` are saved-tensor hooks the step
  runs under: a tensor autograd saves that lives on a gathered parameter's storage is packed as
  a :class:`_Regather` token (site, view geometry) instead, so the full parameter is freed after
  its last forward reader (the graph drops its values at their last use);
* **backward**: the first unpack of a site's token (or a checkpointed region's recompute,
  which runs ``zero3_gather`` inside backward) gathers the site again, or takes the prefetched
  gather, and holds it until the site's gradients are reduce-scattered (its backward is over);
  then the next ``prefetch`` sites of the stage's backward order are issued;
* ``reshard_after_forward=False`` (``keep``): a re-gathered site is held from its forward gather
  on instead, so the saved tensors' tokens and the recompute take it without gathering again,
  and so do later micro-batches' forwards until its reduce-scatter;
* ``zero3_reduce_scatter`` (the gather's backward) reduce-scatters each full gradient over the
  shard group, in fp32, (HSDP) all-reduces the shard across the replica groups, divides by dp
  (the dp average) and returns this rank's shard of it.

Every dp rank issues the same gathers in the same order (same program, same prefetch rule), so
the group's collectives match; the rule is :class:`passes.ir.zero3_ops.GatherSchedule`, which
:mod:`passes.checks.communication_check` replays to check the order before the first step.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from passes.ir.errors import ConfigError
from passes.ir.ops import qualname
from passes.ir.zero3_ops import ZERO3_PREFETCH, GatherSchedule, GatherSite, shard_numel
from runtime.dist import comm

_GATHERERS: dict[str, "ParamGatherer"] = {}


def register_gatherer(name: str, gatherer: "ParamGatherer") -> None:
    """Make ``gatherer`` the one the ZeRO-3 ops of group ``name`` use in this process."""
    _GATHERERS[name] = gatherer


def gatherer(name: str) -> "ParamGatherer":
    try:
        return _GATHERERS[name]
    except KeyError:
        raise ConfigError(f"zero3: no ZeRO-3 group {name!r} is registered in this process; run the program "
                          f"through runtime.exec.parallel_model.ParallelModel, which registers it") from None


@dataclass
class _Pending:
    """One site's gather in flight: its work handle, the ``[degree, S]`` buffer it fills (row r:
    dp rank r's shards back to back) and the parameters' full shapes."""

    work: object
    buf: Tensor
    shapes: Sequence[tuple[int, ...]]
    group: object
    issued_at: float = 0.0
    """``perf_counter`` seconds at which it was issued."""
    ahead: bool = False
    """Issued ahead of its use (prefetched), not by the gather that waits for it."""

    def wait(self) -> list[Tensor]:
        """The full parameters (copied out of the buffer, each its own storage)."""
        comm.wait(self.work, self.group)
        self.work = None
        outs, offset = [], 0
        for shape in self.shapes:
            numel = math.prod(shape)
            n = shard_numel(numel, self.buf.shape[0])
            outs.append(self.buf[:, offset:offset + n].reshape(-1)[:numel].clone().view(shape))
            offset += n
        return outs


@dataclass(frozen=True, kw_only=True)
class CollectiveSpan:
    """One ZeRO-3 collective of a step as it ran on this rank (``perf_counter`` seconds): a
    site's all-gather from its issue (prefetched: earlier) through the wait compute made for it
    to its end, or its reduce-scatter (synchronous: issued when waited)."""

    kind: Literal["gather", "reduce_scatter"]
    stage: int
    site: int
    issued_s: float
    waited_s: float
    done_s: float
    prefetched: bool = False
    """A gather issued ahead of the site that waits for it (by the site before it)."""


@dataclass(frozen=True)
class _Regather:
    """A saved tensor on a gathered parameter: which one, and how the saver viewed it."""

    key: tuple[int, int]
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Gathered:
    """The storage of one gathered parameter, as the pack hook recognises it."""

    ref: StorageWeakRef
    key: tuple[int, int]
    index: int


class ParamGatherer:
    """The ZeRO-3 gathers of one rank (see the module docstring); the decisions of when to gather
    are :class:`passes.ir.zero3_ops.GatherSchedule`'s.

    ``sites``: every site of this rank's stages, by ``(stage, site)``, with the shard
    ``Parameter`` objects it gathers (in the site's order) and their full shapes. ``prefetch``:
    sites gathered ahead (0: none). ``keep``: ``reshard_after_forward=False`` (a re-gathered
    site is held from its forward gather to its reduce-scatter). ``group``/``degree``: the shard group; HSDP:
    ``replica_group`` over the ``replicas`` ranks holding the same shard, across which the
    reduce-scattered gradients are all-reduced.
    """

    def __init__(self, group, degree: int,
                 sites: Mapping[tuple[int, int], tuple[GatherSite, Sequence[torch.nn.Parameter], Sequence[tuple[int, ...]]]],
                 *, prefetch: int = ZERO3_PREFETCH, replica_group=None, replicas: int = 1, keep: bool = False):
        self.group, self.degree, self.sites = group, degree, dict(sites)
        self.index = dist.get_rank(group) if degree > 1 else 0  # this rank's row of a gather
        self.replica_group, self.replicas = replica_group, replicas  # HSDP: the groups holding the same shard
        self.schedule = GatherSchedule([site for site, _, _ in self.sites.values()], prefetch, keep=keep)
        self.pending: dict[tuple[int, int], _Pending] = {}
        # backward: gathered again (keep: since the forward gather), until reduce-scattered
        self.held: dict[tuple[int, int], list[Tensor]] = {}
        self.gathered: dict[StorageWeakRef, _Gathered] = {}
        self.issued = 0  # site gathers issued since construction
        self.wait_s = 0.0  # seconds compute waited for gathers (the exposed part of their time)
        self.spans: list[CollectiveSpan] | None = None  # a step timer's record of the collectives, when set

    # --- gathers ------------------------------------------------------------------------------
    def _issue(self, key: tuple[int, int], ahead: bool = True) -> _Pending:
        _, shards, shapes = self.sites[key]
        self.issued += 1
        # one collective per site: this rank's shards back to back, gathered into one row per rank.
        # The input is this rank's own row of the output: no buffer of its own, whose free would
        # wait for the backend's worker thread to drop the finished collective (a peak that
        # changed run to run).
        total = sum(s.numel() for s in shards)
        buf = torch.empty(self.degree, total, dtype=shards[0].dtype, device=shards[0].device)
        mine = buf[self.index]
        torch.cat([s.detach().reshape(-1) for s in shards], out=mine)
        work = None
        if self.degree > 1:
            work = comm.all_gather(list(buf.unbind(0)), mine, self.group, async_op=True)
        return _Pending(work, buf, shapes, self.group, time.perf_counter(), ahead)

    def _run(self, key: tuple[int, int], issue: list[tuple[int, int]]) -> list[Tensor]:
        for k in issue:
            self.pending[k] = self._issue(k, ahead=k != key)
        pending = self.pending.pop(key)
        start = time.perf_counter()
        out = pending.wait()
        end = time.perf_counter()
        self.wait_s += end - start
        self.record(CollectiveSpan(kind="gather", stage=key[0], site=key[1], issued_s=pending.issued_at,
                                   waited_s=start, done_s=end, prefetched=pending.ahead))
        return out

    def record(self, span: "CollectiveSpan") -> None:
        """Keep ``span`` when a step timer asked for them (:attr:`spans` is a list)."""
        if self.spans is not None:
            self.spans.append(span)

    def _check(self, key: tuple[int, int]) -> None:
        if key not in self.sites:
            raise ConfigError(f"zero3: stage {key[0]} has no gather site {key[1]} on this rank; lower the program and "
                              f"build the ParallelModel from the same plan")

    def gather(self, stage: int, site: int, shards: Sequence[Tensor] = ()) -> list[Tensor]:
        """The ``zero3_gather`` kernel: the site's full parameters (inside backward, a
        checkpointed region's recompute, which gathers as backward does). ``shards``: the op's
        own inputs, which must be the shards this gatherer was built over."""
        key = (stage, site)
        self._check(key)
        mine = self.sites[key][1]
        if shards and (len(shards) != len(mine) or not _same_memory(shards[0], mine[0])):
            raise ConfigError("zero3: a program gathered shards that are not those of the model registered under "
                              "its ZeRO-3 group; two models in one process need different group names: build "
                              "them with different tp_group= (build_parallel_model / lower)")
        if torch._C._current_autograd_node() is not None:
            # new tensor objects on the held storages: autograd sets each output's grad_fn
            return [t.detach() for t in self._for_backward(key)]
        kept = self.held.get(key)  # reshard_after_forward=False: an earlier micro-batch's forward gathered it
        issue = self.schedule.forward(key)
        if kept is not None:
            for k in issue:
                self.pending[k] = self._issue(k)
            outs = [t.detach() for t in kept]
        else:
            outs = self._run(key, issue)
            if key in self.schedule.held:  # kept from here to the site's reduce-scatter
                self.held[key] = [t.detach() for t in outs]
        for k, t in enumerate(outs):
            ref = StorageWeakRef(t.untyped_storage())
            self.gathered[ref] = _Gathered(ref, key, k)
        return outs

    def _for_backward(self, key: tuple[int, int]) -> list[Tensor]:
        issue = self.schedule.backward(key)
        if key not in self.held:
            self.held[key] = self._run(key, issue)
        else:
            for k in issue:
                self.pending[k] = self._issue(k)
        return self.held[key]

    def released(self, stage: int, site: int) -> None:
        """The site's gradients were reduce-scattered: its backward is over."""
        self.schedule.released((stage, site))
        self.held.pop((stage, site), None)

    # --- saved-tensor hooks ---------------------------------------------------------------------
    def pack(self, t: Tensor):
        ref = StorageWeakRef(t.untyped_storage())
        entry = self.gathered.get(ref)
        if entry is None:
            return t
        if entry.ref.expired():  # a new storage at a dead one's address
            del self.gathered[ref]
            return t
        return _Regather(entry.key, entry.index, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, packed):
        if not isinstance(packed, _Regather):
            return packed
        full = self._for_backward(packed.key)[packed.index]
        return full.as_strided(packed.size, packed.stride, packed.offset)

    def hooks(self):
        """The saved-tensor hooks a training step runs under."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def reset(self) -> None:
        """End of a step: wait what is still in flight; drop what is held (the shards change next)."""
        for p in self.pending.values():
            p.wait()
        self.pending.clear()
        self.held.clear()
        self.gathered.clear()
        self.schedule.reset()


def reduce_scatter(grads: Sequence[Tensor], degree: int, group_name: str, stage: int, site: int) -> list[Tensor]:
    """The ``zero3_reduce_scatter`` kernel: each gradient's dp average, this rank's shard of it."""
    g = gatherer(group_name)
    g.released(stage, site)
    start = time.perf_counter()
    sizes = [shard_numel(grad.numel(), degree) for grad in grads]
    # one collective per site: row r holds every gradient's piece r (zero-padded), in fp32
    flat = torch.zeros(degree, sum(sizes), dtype=torch.float32, device=grads[0].device)
    offset = 0
    for grad, n in zip(grads, sizes):
        padded = torch.zeros(degree * n, dtype=torch.float32, device=grad.device)
        padded[:grad.numel()] = grad.reshape(-1)
        flat[:, offset:offset + n] = padded.view(degree, n)
        offset += n
    if degree > 1:
        shard = torch.empty(flat.shape[1], dtype=torch.float32, device=flat.device)
        comm.reduce_scatter(shard, list(flat.unbind(0)), g.group)
    else:
        shard = flat[0]
    if g.replicas > 1:  # HSDP: the other shard groups' sums of the same shards
        comm.all_reduce(shard, g.replica_group)
    shard /= degree * g.replicas
    out = [piece.to(grad.dtype) for piece, grad in zip(shard.split(sizes), grads)]
    end = time.perf_counter()
    g.record(CollectiveSpan(kind="reduce_scatter", stage=stage, site=site, issued_s=start, waited_s=start, done_s=end))
    return out


def gather_kernel(shards, shapes, degree, group, stage, site):
    """The ``zero3_gather`` kernel (see :meth:`ParamGatherer.gather`)."""
    return gatherer(group).gather(stage, site, shards)


def reduce_scatter_kernel(grads, degree, group, stage, site):
    """The ``zero3_reduce_scatter`` kernel (see :func:`reduce_scatter`)."""
    return reduce_scatter(grads, degree, group, stage, site)


torch.library.register_kernel(qualname("zero3_gather"), None)(gather_kernel)
torch.library.register_kernel(qualname("zero3_reduce_scatter"), None)(reduce_scatter_kernel)

MEASURED_KERNELS = {
    torch.ops.partitioner.zero3_gather.default: gather_kernel,
    torch.ops.partitioner.zero3_reduce_scatter.default: reduce_scatter_kernel,
}
"""The ZeRO-3 kernels by op, for :class:`runtime.observe.measure.LiveBytes`: a dispatch mode is off inside a
custom op's kernel, and these allocate there what a device's allocator would count (prefetched
gathers, the reduce-scatter's fp32 buffers), so the mode runs them itself to see it."""


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same storage at the same offset: by storage, not address,
    so that it holds for fake tensors too (a dry run's, whose addresses are all 0)."""
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage()) and \
        a.storage_offset() == b.storage_offset()
