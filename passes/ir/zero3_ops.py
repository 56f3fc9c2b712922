"""ZeRO-3 ops: a block's parameters gathered from their data-parallel shards, and their gradients
reduce-scattered back into the shards.

Under ``zero_stage=3`` every parameter of a stage program is a flat *shard*: the parameter
flattened, padded with zeros to a multiple of the dp degree ``d``, cut in ``d`` equal pieces;
dp rank ``r`` holds piece ``r`` (:func:`shard_numel`, :func:`shard_of`).
:mod:`passes.rewrites.shard_parameters` inserts, before the first reader of a block's parameters in each
graph (the stage's graph, or a checkpointed region's)::

    %g  = partitioner.zero3_gather([%w_shard, %b_shard], [[64, 32], [64]], 2, "dp", 0, 3)
    %w  = getitem(%g, 0)                     # the full [64, 32] weight, read by the block's ops
    %b  = getitem(%g, 1)

=====================  ==========================================  ===============================
op                     forward                                     backward
=====================  ==========================================  ===============================
``zero3_gather``       all-gather of each shard over the dp group  ``zero3_reduce_scatter`` of
                       (full tensors of ``shapes``)                the gradients into the shards
``zero3_reduce_scatter``  sum over dp of each gradient's piece,    (not differentiable)
                       divided by ``d`` (the dp average); the
                       site's backward is over
=====================  ==========================================  ===============================

Arguments: the dp degree, the group by *name* (as the tp ops, resolved by the runtime), the stage and the
*site* (the gather's position in the stage's forward order), by which the runtime prefetches the
next site's gather and re-gathers a site's parameters in backward (:mod:`runtime.kernels.zero3`).
The fake kernels here give output shapes; the real kernels live in the runtime.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from passes.ir.errors import ConfigError
from passes.ir.ops import _LIB, qualname

_LIB.define("zero3_gather(Tensor[] shards, SymInt[][] shapes, int degree, str group, int stage, int site) -> Tensor[]")
_LIB.define("zero3_reduce_scatter(Tensor[] grads, int degree, str group, int stage, int site) -> Tensor[]")

ZERO3_GATHER = torch.ops.partitioner.zero3_gather.default

ZERO3_PREFETCH = 1
"""Gather sites issued ahead of the one running, by default (``zero3_prefetch``): what the
runtime does, the communication check replays and the planner and the memory replay assume."""


def shard_numel(numel: int, degree: int) -> int:
    """Elements of one dp rank's shard of a parameter of ``numel`` elements (padded up)."""
    return max(1, math.ceil(numel / degree))


def shard_of(full: Tensor, degree: int, rank: int) -> Tensor:
    """Rank ``rank``'s shard of ``full``: the flattened tensor padded with zeros to
    ``degree * shard_numel`` elements, piece ``rank`` (a new tensor)."""
    n = shard_numel(full.numel(), degree)
    flat = full.detach().reshape(-1)
    padded = torch.zeros(n * degree, dtype=full.dtype, device=full.device)
    padded[:flat.numel()] = flat
    return padded[rank * n:(rank + 1) * n].clone()


def unshard(pieces: list[Tensor], shape: tuple[int, ...]) -> Tensor:
    """The full tensor of ``shape`` from every rank's shard, in dp rank order (a new tensor)."""
    numel = math.prod(shape)
    return torch.cat([p.reshape(-1) for p in pieces])[:numel].reshape(shape).clone()


@torch.library.register_fake(qualname("zero3_gather"), lib=_LIB)
def _(shards, shapes, degree, group, stage, site):
    return [s.new_empty(shape) for s, shape in zip(shards, shapes)]


@torch.library.register_fake(qualname("zero3_reduce_scatter"), lib=_LIB)
def _(grads, degree, group, stage, site):
    return [g.new_empty(shard_numel(g.numel(), degree)) for g in grads]


def _gather_setup(ctx, inputs, output):
    shards, shapes, degree, group, stage, site = inputs
    ctx.degree, ctx.group, ctx.stage, ctx.site = degree, group, stage, site
    ctx.meta = [(tuple(shape), s.dtype, s.device) for s, shape in zip(shards, shapes)]


def _gather_backward(ctx, grads):
    # a parameter the step never reached still takes part (every dp rank issues the same calls)
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, ctx.meta)]
    shards = torch.ops.partitioner.zero3_reduce_scatter(full, ctx.degree, ctx.group, ctx.stage, ctx.site)
    return shards, None, None, None, None, None


torch.library.register_autograd(qualname("zero3_gather"), _gather_backward, setup_context=_gather_setup, lib=_LIB)


# --- the plan record ------------------------------------------------------------------------------
# ``gm.meta[ZERO3_PLAN]`` (defined with every key in passes.ir.meta): the Zero3Plan below


@dataclass(frozen=True, kw_only=True)
class ShardedParam:
    """One parameter held as dp shards: its name in the stage program (the original name), the
    full shape on this tp rank, its elements, the elements of each shard and its dtype."""

    name: str
    shape: tuple[int, ...]
    numel: int
    shard_numel: int
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class GatherSite:
    """One ``zero3_gather`` node: its position ``site`` in the stage's forward order, the graph
    it is in (``""``: the stage's; else a checkpointed region's submodule), the layer-chain index
    of the block whose parameters it gathers, their names, and whether the backward gathers them
    again (``regather``: the region is recomputed, or ops outside one saved them)."""

    stage: int
    site: int
    graph: str
    block: int
    params: tuple[str, ...]
    regather: bool
    savers: tuple[str, ...] = ()
    """Nodes of the stage's graph that save one of its tensors for backward (whose backward
    gathers the site again); empty for a site inside a region (its recompute does)."""


@dataclass(frozen=True, kw_only=True)
class Zero3Plan:
    """What :mod:`passes.rewrites.shard_parameters` did to one stage program."""

    degree: int
    group: str
    params: tuple[ShardedParam, ...]
    sites: tuple[GatherSite, ...]
    reshard_after_forward: bool = True
    """``ParallelConfig.reshard_after_forward``: ``False`` keeps a re-gathered site's parameters
    from its forward gather to its reduce-scatter (:class:`GatherSchedule`)."""

    def param(self, name: str) -> ShardedParam:
        """The record of parameter ``name`` (a dict lookup: a 96-layer stage has thousands)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"zero3: the stage program shards no parameter {name!r} (it shards "
                              f"{len(self.params)}); lower the plan again") from None

    @functools.cached_property
    def _by_name(self) -> dict[str, ShardedParam]:
        return {p.name: p for p in self.params}


def keeps_gathered(plans) -> bool:
    """Whether the stage programs ``plans`` (:class:`Zero3Plan` of one rank) keep their gathered
    parameters through backward (``reshard_after_forward=False``); they must agree."""
    values = {p.reshard_after_forward for p in plans}
    if len(values) > 1:
        raise ConfigError("zero3: this rank's stage programs disagree on reshard_after_forward; lower every stage "
                          "from the same config")
    return values == {False}


class GatherSchedule:
    """Which gathers a rank issues, and when: the rule :mod:`runtime.kernels.zero3` follows and
    :mod:`passes.checks.communication_check` and the memory replay replay. Keys are ``(stage, site)``.

    * :meth:`forward` (a forward gather of ``key``): ``key`` unless it was prefetched or is held,
      then the next ``prefetch`` sites of the stage's forward order neither held nor in flight;
      with ``keep`` (``reshard_after_forward=False``) a re-gathered site is held from its forward
      gather on, so later micro-batches' forwards and the backward take it without a gather;
    * :meth:`backward` (the first backward use of ``key``: an unpack of a saved tensor, or a
      region's recompute): nothing while ``key`` is held from an earlier use (until its
      gradients are reduce-scattered, :meth:`released`), else ``key`` unless prefetched, then
      the next ``prefetch`` sites of the stage's backward order neither held nor in flight.
    """

    def __init__(self, sites, prefetch: int, *, keep: bool = False):
        by_stage: dict[int, list[GatherSite]] = {}
        for site in sites:
            by_stage.setdefault(site.stage, []).append(site)
        self.prefetch = prefetch
        self.kept = {(s.stage, s.site) for s in sites if keep and s.regather}  # held from their forward gather
        self.forward_order = {s: [x.site for x in sorted(v, key=lambda x: x.site)] for s, v in by_stage.items()}
        self.backward_order = {s: [x.site for x in sorted(v, key=lambda x: -x.site) if x.regather]
                               for s, v in by_stage.items()}
        self.pending: set[tuple[int, int]] = set()
        self.held: set[tuple[int, int]] = set()

    def _ahead(self, key: tuple[int, int], order: dict[int, list[int]], skip: set) -> list[tuple[int, int]]:
        stage, site = key
        sites = order.get(stage, [])
        if site not in sites or not self.prefetch:
            return []
        k = sites.index(site)
        out = []
        for nxt in sites[k + 1:k + 1 + self.prefetch]:
            nkey = (stage, nxt)
            if nkey not in self.pending and nkey not in skip:
                self.pending.add(nkey)
                out.append(nkey)
        return out

    def forward(self, key: tuple[int, int]) -> list[tuple[int, int]]:
        if key in self.held:  # kept since an earlier micro-batch's forward, not yet reduce-scattered
            return self._ahead(key, self.forward_order, self.held)
        issue = [] if key in self.pending else [key]
        self.pending.discard(key)
        if key in self.kept:
            self.held.add(key)
        return issue + self._ahead(key, self.forward_order, self.held)

    def backward(self, key: tuple[int, int]) -> list[tuple[int, int]]:
        if key in self.held:
            return []
        issue = [] if key in self.pending else [key]
        self.pending.discard(key)
        self.held.add(key)
        return issue + self._ahead(key, self.backward_order, self.held)

    def released(self, key: tuple[int, int]) -> None:
        self.held.discard(key)

    def reset(self) -> None:
        self.pending.clear()
        self.held.clear()
