"""Rematerialization on a DAG: which activations backward finds saved on device, offloaded to host,
or recomputed, under a budget of saved bytes.

The model (:class:`RematProblem`, built from :func:`passes.analysis.graph_view.to_networkx`)
    *Nodes* are the forward's compute nodes that allocate activation storage (views and
    getitems allocate none: they read their base's storage). A node *owns* storages: its new
    outputs and the tensors its op makes inside itself for backward (dropout noise, layer-norm
    mean/rstd). A storage is *kept* when autograd saves it for backward (observed on a fake
    forward, so views count once). A node *reads* the activation storages of its inputs; graph
    inputs and parameters are always available and are not part of the problem.

    A decision gives every node one action: ``recompute`` (run it again in backward: FLOPs
    ``f_v``; it needs every storage it reads available), or else its storages that are needed
    (kept, or read by a recomputed node) stay on device (``save``) or go to host after forward
    and come back before backward (``offload``); ``none`` when nothing of it is needed.
    Recomputation is single (AOTAutograd-style): a recomputed node runs once in backward, before
    its first use, and its outputs serve every backward use and every later recompute; a
    recomputed node's outputs that backward keeps are the recomputed copies.

What the budget bounds, exactly
    ``bound="saved"`` (the default): ``saved_bytes`` = bytes on device, after the forward and
    before the backward starts, that backward reads: the needed storages of saved nodes plus
    ``fixed_bytes`` (graph inputs autograd keeps: token ids, targets). This is the
    saved-activation term of the step's peak (the same quantity as
    ``CheckpointPlan.saved_bytes_after`` and ``MemorySummary.activation_bytes + input_bytes``
    with nothing recomputed). With nothing recomputed it is also the most activation bytes any
    moment of backward holds; with recomputes it is not: a tensor recomputed for an early use in
    backward (a residual stream read by the last block) stays until its last use (the first
    block), so such decisions can hold more during backward than keeping everything.

    ``bound="peak"``: ``peak_bytes`` (:func:`backward_peak`) = the activation bytes on device at
    the fullest moment of backward, recomputes run on demand and memoised as
    :class:`passes.rewrites.tensor_remat.TensorRemat` runs them: the quantity that executor measures
    (within 1% on the ResNet-style CNN, the U-Net and BERT: the model counts everything a node's
    backward touches at once). It needs to know when backward unpacks each kept storage
    (``Storage.used_at``, from the savers the fake forward observes) and bounds save and
    recompute only (no offload). Not bounded by either: the buffers offloaded tensors come back
    into, forward transients, gradients, parameters and optimizer state (the liveness simulation
    of ``annotate_memory`` prices those).

Costs (:class:`RematCosts`)
    Added seconds = recompute FLOPs / ``device_flops_per_s`` + 2 x offloaded bytes /
    ``host_bytes_per_s`` (to host after forward and back for backward, not hidden behind compute:
    an upper bound on the exposed time). FLOPs are matmul-class only (``annotate_flops``), so
    recomputing elementwise ops is free in this model.

Solvers
    * :func:`solve_min_cut`: save versus recompute, as AOTAutograd's min-cut partitioner
      (``torch/_functorch/partitioners.py``) frames it: a flow graph where a node's *recompute*
      vertex hangs from the source by an edge of its FLOPs, each storage vertex hangs from its
      owner's by an edge of lambda x its bytes, kept storages feed the sink and readers depend
      on what they read by infinite edges. A minimum cut minimises FLOPs + lambda x saved bytes
      (the Lagrangian of the budget); lambda is moved over the breakpoints of that parametric
      cut (each new lambda where the two bracketing solutions cost the same) until the two
      hull vertices around the budget are found; then, among all minimum cuts at that lambda
      (the edge between them), one as close to the budget as a best-fit walk over the residual
      graph's components finds. Exact integers (fractions for lambda). Within budget always;
      optimal at hull vertices, possibly above the optimum between them (the Lagrangian gap).
    * :func:`solve_milp`: the joint save / recompute / offload choice as a MILP (a Checkmate
      formulation restricted to one forward and one recompute per node; HiGHS through
      ``scipy.optimize.milp``), minimising added seconds. With the peak bound it adds, per moment
      of backward, continuous columns for what has been recomputed by then and what is alive
      (:func:`_peak_rows`), and one bytes row per moment. Variables: ``r_v`` (recompute), and
      per storage ``d_s`` (on device) and ``h_s`` (on host), per node ``o_v`` (its storages go to
      host). Constraints: kept ``s``: ``r_owner + d_s + h_s >= 1``; ``v`` reads ``s``:
      ``r_v <= r_owner + d_s + h_s``; ``d_s + h_s + r_owner <= 1``; ``d_s <= 1 - o_owner``,
      ``h_s <= o_owner``; ``sum_s bytes_s d_s <= budget - fixed``; ``r_v = 0`` for nodes that
      cannot be recomputed (in-place writes).
    * :func:`solve_brute_force`: every action of every node; the reference for tiny graphs.
    * :func:`from_checkpoint_plan`: today's block-level checkpointing expressed as a decision.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterable, Iterator, Literal

import networkx as nx
import numpy as np

from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import CheckpointPlan

Action = Literal["save", "recompute", "offload", "none"]
Method = Literal["min-cut", "milp", "brute-force", "given"]
Bound = Literal["saved", "peak"]


@dataclass(frozen=True, kw_only=True)
class RematCosts:
    """Rates that turn the decision into seconds: recompute at ``device_flops_per_s`` (FLOP/s),
    offload over the host link at ``host_bytes_per_s`` (bytes/s each way; ``None``: no offload)."""

    device_flops_per_s: float
    host_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.device_flops_per_s > 0 or (self.host_bytes_per_s is not None and not self.host_bytes_per_s > 0):
            raise ConfigError(f"remat costs need positive rates, got device_flops_per_s={self.device_flops_per_s}, "
                              f"host_bytes_per_s={self.host_bytes_per_s}; pass FLOP/s and bytes/s (or None: no offload)")

    @property
    def offload(self) -> bool:
        return self.host_bytes_per_s is not None

    def recompute_s(self, flops: int) -> float:
        """Seconds to recompute ``flops`` FLOPs."""
        return flops / self.device_flops_per_s

    def offload_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` bytes to host and back (0 without a host link)."""
        return 2 * nbytes / self.host_bytes_per_s if self.host_bytes_per_s else 0.0


@dataclass(frozen=True, kw_only=True)
class Storage:
    """One activation storage of the problem: its owner (index into ``RematProblem.nodes``),
    bytes, whether autograd keeps it, and the nodes that read it (indices). For the peak bound:
    ``internal`` (made inside the owner's op for its backward, not an output: a recompute makes
    it only when backward keeps it) and ``used_at`` (positions, as ``RematProblem.positions``,
    of the nodes whose backward unpacks it; empty for a kept storage no backward unpacks: it
    stays until backward ends)."""

    name: str
    owner: int
    nbytes: int
    kept: bool
    readers: tuple[int, ...] = ()
    internal: bool = False
    used_at: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RematProblem:
    """The rematerialization problem of one forward (module docstring): ``nodes`` in forward
    order with their forward FLOPs and whether they can run again, ``storages`` with owners,
    bytes (at the dims' hints) and readers, ``fixed_bytes`` always kept on device, and
    ``positions``: each node's place in the whole forward (increasing; backward runs the nodes
    in the reverse order; empty: ``0..n-1``), the clock of ``Storage.used_at``."""

    nodes: tuple[str, ...]
    flops: tuple[int, ...]
    recomputable: tuple[bool, ...]
    storages: tuple[Storage, ...]
    fixed_bytes: int = 0
    positions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if self.positions and (len(self.positions) != n or any(a >= b for a, b in zip(self.positions,
                                                                                       self.positions[1:]))):
            raise ConfigError(f"remat problem: positions must give each of the {n} nodes an increasing place in "
                              f"the forward, got {self.positions[:8]}...")
        if len(self.flops) != n or len(self.recomputable) != n:
            raise ConfigError(f"remat problem: {n} nodes but {len(self.flops)} FLOP counts and "
                              f"{len(self.recomputable)} recomputable flags; give one of each per node")
        for s in self.storages:
            if not 0 <= s.owner < n or any(not 0 <= r < n or r == s.owner for r in s.readers):
                raise ConfigError(f"remat problem: storage {s.name!r} has owner {s.owner} or readers {s.readers} "
                                  f"outside the {n} nodes (or reads itself); indices are positions in nodes")
            if s.nbytes < 0:
                raise ConfigError(f"remat problem: storage {s.name!r} has {s.nbytes} bytes; bytes are >= 0")
        if min(self.flops, default=0) < 0:
            raise ConfigError("remat problem: FLOPs are >= 0")

    @property
    def position(self) -> tuple[int, ...]:
        """Each node's position in the forward (``positions``, or ``0..n-1``)."""
        return self.positions or tuple(range(len(self.nodes)))

    @property
    def base_bytes(self) -> int:
        """Bytes kept on device when nothing is recomputed or offloaded (``fixed_bytes`` included)."""
        return self.fixed_bytes + sum(s.nbytes for s in self.storages if s.kept)


@dataclass(frozen=True, kw_only=True)
class NodeDecision:
    """What one node does: its action, the bytes of its storages kept on device and moved to
    host, and the FLOPs it runs again in backward."""

    node: str
    action: Action
    saved_bytes: int = 0
    offload_bytes: int = 0
    recompute_flops: int = 0


@dataclass(frozen=True, kw_only=True)
class RematDecision:
    """A decision for every node and its totals: ``saved_bytes`` (device bytes backward reads,
    ``fixed_bytes`` included), ``peak_bytes`` (activation bytes on device at the fullest moment
    of backward when recomputes run on demand: :func:`backward_peak`; at least ``saved_bytes``),
    ``offload_bytes`` (bytes moved to host and back), ``recompute_flops``, ``added_s`` (seconds
    the decision adds to the step). ``bound``: which of ``saved_bytes`` and ``peak_bytes`` the
    budget bounds; ``feasible``: that one is at most ``budget_bytes``; ``optimal``: proven optimal
    for the budget (MILP and brute force when they finish; the min cut only when the budget does
    not bind); ``mip_gap``: the MILP's relative optimality gap when it returned (HiGHS's
    ``|primal - dual| / |primal|``: 0 when proven optimal, above 0 when its time limit cut it
    short, ``inf`` when it had no bound; None for a decision no MILP made)."""

    method: Method
    budget_bytes: int
    nodes: tuple[NodeDecision, ...]
    saved_bytes: int
    offload_bytes: int
    recompute_flops: int
    fixed_bytes: int
    added_s: float
    feasible: bool
    optimal: bool = False
    peak_bytes: int = 0
    bound: Bound = "saved"
    mip_gap: float | None = None

    def action(self, node: str) -> Action:
        """The action of the node named ``node``."""
        for d in self.nodes:
            if d.node == node:
                return d.action
        raise KeyError(f"node {node!r} is not part of the remat problem")

    def named(self, action: Action) -> tuple[str, ...]:
        """Names of the nodes whose action is ``action``, in forward order."""
        return tuple(d.node for d in self.nodes if d.action == action)


# ---------------------------------------------------------------------------------------------
# The problem from a graph view, and the exact cost of any decision.

def problem_from_view(G: nx.DiGraph) -> RematProblem:
    """The :class:`RematProblem` of a :func:`passes.analysis.graph_view.to_networkx` view: nodes that own
    activation storages, in forward (graph) order."""
    names = [n for n, d in G.nodes(data=True) if d["kind"] == "compute" and d["owns"]]
    index = {n: i for i, n in enumerate(names)}
    place = {n: k for k, n in enumerate(G.nodes)}  # the view keeps the graph's node order
    readers: dict[str, list[int]] = {}
    for n, d in G.nodes(data=True):
        if n in index:
            for s in d["reads"]:
                readers.setdefault(s, []).append(index[n])
    storages = []
    for n in names:
        for s in G.nodes[n]["owns"]:
            storages.append(Storage(name=s.name, owner=index[n], nbytes=s.nbytes, kept=s.kept,
                                    readers=tuple(r for r in readers.get(s.name, ()) if r != index[n]),
                                    internal=s.kind == "internal", used_at=tuple(place[k] for k in s.savers)))
    return RematProblem(nodes=tuple(names), flops=tuple(G.nodes[n]["flops"] for n in names),
                        recomputable=tuple(G.nodes[n]["recomputable"] for n in names), storages=tuple(storages),
                        fixed_bytes=G.graph.get("fixed_bytes", 0), positions=tuple(place[n] for n in names))


def evaluate(problem: RematProblem, recompute: Iterable[str], offload: Iterable[str] = (), *, budget_bytes: int,
             costs: RematCosts, method: Method = "given", optimal: bool = False,
             bound: Bound = "saved") -> RematDecision:
    """The exact cost of recomputing the nodes named in ``recompute`` and offloading the needed
    storages of those in ``offload`` (every other needed storage stays on device); ``bound``:
    whether ``budget_bytes`` bounds the saved bytes or the backward peak."""
    index = {n: i for i, n in enumerate(problem.nodes)}
    unknown = [n for n in [*recompute, *offload] if n not in index]
    if unknown:
        raise ConfigError(f"remat decision names {unknown[0]!r}, which is not a node of the problem")
    r = [False] * len(problem.nodes)
    for n in recompute:
        if not problem.recomputable[index[n]]:
            raise ConfigError(f"node {n!r} cannot be recomputed (an in-place op writes its storage, or it is not a "
                              f"call); save or offload it")
        r[index[n]] = True
    host = {index[n] for n in offload}
    if host and not costs.offload:
        raise ConfigError("remat decision offloads nodes but the costs have no host link; set host_bytes_per_s")
    return _decision(problem, r, host, budget_bytes=budget_bytes, costs=costs, method=method, optimal=optimal,
                     bound=bound)


@dataclass(frozen=True)
class _Timeline:
    """When backward needs what, per node of a problem (positions as ``RematProblem.position``;
    backward visits them from the highest down)."""

    pos: tuple[int, ...]
    owned: tuple[tuple[int, ...], ...]  # storage indices of each node
    reads: tuple[tuple[tuple[int, int], ...], ...]  # per node: (storage of it, a node that reads it)
    remade: tuple[tuple[int, ...], ...]  # storages a recompute of the node makes: outputs and kept internals
    first_unpack: tuple[int | None, ...]  # latest position unpacking a kept storage of the node
    last_unpack: tuple[float, ...]  # per storage: earliest position unpacking it (-1: held to the end; inf: never)


def _timeline(problem: RematProblem) -> _Timeline:
    n = len(problem.nodes)
    owned: list[list[int]] = [[] for _ in range(n)]
    reads: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    remade: list[list[int]] = [[] for _ in range(n)]
    first: list[int | None] = [None] * n
    last: list[float] = []
    for j, s in enumerate(problem.storages):
        owned[s.owner].append(j)
        reads[s.owner].extend((j, w) for w in s.readers)
        if not s.internal or s.kept:
            remade[s.owner].append(j)
        if s.kept and s.used_at:
            first[s.owner] = max(first[s.owner] if first[s.owner] is not None else -1, max(s.used_at))
        last.append((min(s.used_at) if s.used_at else -1) if s.kept else math.inf)
    return _Timeline(pos=problem.position, owned=tuple(map(tuple, owned)), reads=tuple(map(tuple, reads)),
                     remade=tuple(map(tuple, remade)), first_unpack=tuple(first), last_unpack=tuple(last))


@dataclass(frozen=True)
class RecomputeSchedule:
    """When backward recomputes and lets go of what, under a recompute decision run on demand and
    memoised (:class:`passes.rewrites.tensor_remat.TensorRemat`). Positions as ``RematProblem.position``
    (backward runs from the highest down); -1: kept until backward ends.

    ``recompute_at``: each recomputed node backward needs -> the position whose backward
    recomputes it (the latest that unpacks one of its kept storages or recomputes a reader);
    ``free_after``: that node -> the position after whose backward all it made is dropped (its
    last such use); ``made``: that node -> the storages (indices) its recompute makes (outputs,
    and internals backward keeps); ``storage_free_after``: each storage (index) of a node not
    recomputed that backward needs -> the position after whose backward it is dropped (its last
    unpack, or the last recompute reading it)."""

    recompute_at: dict[int, int]
    free_after: dict[int, float]
    made: dict[int, tuple[int, ...]]
    storage_free_after: dict[int, float]


def recompute_schedule(problem: RematProblem, recompute: list[bool]) -> RecomputeSchedule:
    """The :class:`RecomputeSchedule` of recomputing the nodes flagged in ``recompute``."""
    tl = _timeline(problem)
    at: dict[int, int] = {}
    for v in reversed(range(len(problem.nodes))):  # readers come after what they read
        if recompute[v]:
            when = [tl.first_unpack[v]] if tl.first_unpack[v] is not None else []
            when += [at[w] for _, w in tl.reads[v] if w in at]
            if when:
                at[v] = max(when)
    free = {v: min([tl.last_unpack[j] for j in tl.owned[v]] + [at[w] for _, w in tl.reads[v] if w in at])
            for v in at}
    held = {}
    for j, s in enumerate(problem.storages):
        if not recompute[s.owner]:
            end = min([tl.last_unpack[j]] + [at[w] for w in s.readers if w in at])
            if end != math.inf:
                held[j] = end
    return RecomputeSchedule(recompute_at=at, free_after=free, made={v: tl.remade[v] for v in at},
                             storage_free_after=held)


def backward_peak(problem: RematProblem, recompute: list[bool]) -> int:
    """Activation bytes on device (``fixed_bytes`` included) at the fullest moment of backward, when
    recomputes run on demand and are memoised (:func:`recompute_schedule`): a recomputed node's
    outputs and kept internals from its recompute to its last use; a needed storage of a node not
    recomputed from forward to its last use. A moment is one node's backward, with everything
    recomputed for it and everything it is the last use of. Offloaded storages count as on device
    here: they are back before backward. Without recomputes or offload this is ``saved_bytes``."""
    sched = recompute_schedule(problem, recompute)
    spans = [(sched.free_after[v], start, sum(problem.storages[j].nbytes for j in sched.made[v]))
             for v, start in sched.recompute_at.items()]
    spans += [(end, math.inf, problem.storages[j].nbytes) for j, end in sched.storage_free_after.items()]
    return problem.fixed_bytes + max((sum(b for lo, hi, b in spans if lo <= q <= hi) for q, _, _ in spans),
                                     default=0)


def plain_backward_peak(problem: RematProblem) -> int:
    """Bytes: :func:`backward_peak` when nothing is recomputed (the graph as it runs without any
    checkpointing)."""
    return backward_peak(problem, [False] * len(problem.nodes))


def _needed(problem: RematProblem, r: list[bool]) -> list[int]:
    """Bytes each node must keep (device or host): its storages kept by autograd or read by a
    recomputed node, for nodes not recomputed."""
    need = [0] * len(problem.nodes)
    for s in problem.storages:
        if not r[s.owner] and (s.kept or any(r[k] for k in s.readers)):
            need[s.owner] += s.nbytes
    return need


def _decision(problem: RematProblem, r: list[bool], host: set[int], *, budget_bytes: int, costs: RematCosts,
              method: Method, optimal: bool, bound: Bound = "saved", mip_gap: float | None = None) -> RematDecision:
    need = _needed(problem, r)
    nodes = []
    for i, name in enumerate(problem.nodes):
        if r[i]:
            nodes.append(NodeDecision(node=name, action="recompute", recompute_flops=problem.flops[i]))
        elif need[i] and i in host:
            nodes.append(NodeDecision(node=name, action="offload", offload_bytes=need[i]))
        elif need[i]:
            nodes.append(NodeDecision(node=name, action="save", saved_bytes=need[i]))
        else:
            nodes.append(NodeDecision(node=name, action="none"))
    saved = problem.fixed_bytes + sum(d.saved_bytes for d in nodes)
    off = sum(d.offload_bytes for d in nodes)
    flops = sum(d.recompute_flops for d in nodes)
    peak = backward_peak(problem, r)
    return RematDecision(method=method, budget_bytes=budget_bytes, nodes=tuple(nodes), saved_bytes=saved,
                         offload_bytes=off, recompute_flops=flops, fixed_bytes=problem.fixed_bytes,
                         added_s=costs.recompute_s(flops) + costs.offload_s(off),
                         feasible=(peak if bound == "peak" else saved) <= budget_bytes, optimal=optimal,
                         peak_bytes=peak, bound=bound, mip_gap=mip_gap)


# ---------------------------------------------------------------------------------------------
# Min cut (save versus recompute).

_SRC, _SNK = ("source",), ("sink",)


def _flow_graph(problem: RematProblem, lam: Fraction) -> nx.DiGraph:
    """The flow graph whose minimum cuts minimise FLOPs + ``lam`` x saved bytes (capacities
    scaled by ``lam``'s denominator to stay integers; an edge without capacity is infinite)."""
    p, q = lam.numerator, lam.denominator
    F = nx.DiGraph()
    F.add_nodes_from((_SRC, _SNK))
    for i, f in enumerate(problem.flops):
        if not problem.recomputable[i]:
            F.add_edge(_SRC, ("n", i))  # infinite: never recomputed
        elif f:
            F.add_edge(_SRC, ("n", i), capacity=f * q)
        else:
            F.add_node(("n", i))
    for j, s in enumerate(problem.storages):
        F.add_edge(("n", s.owner), ("s", j), capacity=s.nbytes * p)
        if s.kept:
            F.add_edge(("s", j), _SNK)
        for k in s.readers:
            F.add_edge(("s", j), ("n", k))
    return F


def _flags(problem: RematProblem, source_side) -> list[bool]:
    """Recompute flags of a cut: a node is recomputed when its vertex is on the sink side."""
    return [("n", i) not in source_side for i in range(len(problem.nodes))]


def _cut(problem: RematProblem, lam: Fraction) -> list[bool]:
    """The recompute flags minimising FLOPs + ``lam`` x saved bytes (one minimum s-t cut)."""
    _, (source_side, _) = nx.minimum_cut(_flow_graph(problem, lam), _SRC, _SNK, flow_func=_FLOW)
    return _flags(problem, source_side)


def _on_edge(problem: RematProblem, lam: Fraction, budget_bytes: int) -> list[bool] | None:
    """Among the minimum cuts at ``lam`` (all cost the same FLOPs + ``lam`` x bytes), one with as
    many bytes as fit ``budget_bytes``, hence as few FLOPs: the minimum cuts are the source sets
    closed under residual arcs (Picard and Queyranne 1980); start from the smallest (most
    recomputed) and add, one at a time, the strongly connected component of the residual graph
    (all its successors already in) that keeps the most bytes still within budget. None when
    even the smallest does not fit."""
    R = _FLOW(_flow_graph(problem, lam), _SRC, _SNK)
    residual = nx.DiGraph()
    residual.add_nodes_from(R)
    residual.add_edges_from((u, v) for u, v, d in R.edges(data=True) if d["capacity"] - d["flow"] > 0)
    source = nx.descendants(residual, _SRC) | {_SRC}
    sink = nx.ancestors(residual, _SNK) | {_SNK}
    middle = residual.subgraph(set(residual) - source - sink)

    def kept(side) -> int:
        return problem.fixed_bytes + sum(_needed(problem, _flags(problem, side)))

    if kept(source) > budget_bytes:
        return None
    dag = nx.condensation(middle)
    side = set(source)
    taken: set[int] = set()
    while True:  # best fit: the addable component that keeps the most bytes within budget
        best = None
        for c in dag:
            if c not in taken and all(s in taken for s in dag.successors(c)):  # keeps the set closed
                size = kept(side | dag.nodes[c]["members"])
                if size <= budget_bytes and (best is None or size > best[0]):
                    best = (size, c)
        if best is None:
            return _flags(problem, side)
        side |= dag.nodes[best[1]]["members"]
        taken.add(best[1])


_FLOW = nx.algorithms.flow.boykov_kolmogorov


def solve_min_cut(problem: RematProblem, budget_bytes: int, *, costs: RematCosts) -> RematDecision:
    """The fewest recompute FLOPs keeping at most ``budget_bytes`` saved (no offload), by a
    parametric minimum cut (module docstring). When no decision fits, the one keeping the fewest
    bytes (``feasible=False``)."""
    total_bytes = sum(s.nbytes for s in problem.storages)
    total_flops = sum(problem.flops)

    def solve(lam: Fraction) -> RematDecision:
        return _decision(problem, _cut(problem, lam), set(), budget_bytes=budget_bytes, costs=costs,
                         method="min-cut", optimal=False)

    # lam below 1/total_bytes: fewest FLOPs first (FLOPs are integers), then fewest bytes.
    lo = solve(Fraction(1, total_bytes + 1))
    if lo.feasible:
        return dataclasses.replace(lo, optimal=True)  # the fewest FLOPs of all fit: optimal
    # lam above total_flops: fewest bytes first, then fewest FLOPs.
    hi = solve(Fraction(total_flops + 1))
    if not hi.feasible:
        return hi
    while True:
        lam = Fraction(hi.recompute_flops - lo.recompute_flops, lo.saved_bytes - hi.saved_bytes)
        mid = solve(lam)
        if mid.recompute_flops + lam * mid.saved_bytes >= lo.recompute_flops + lam * lo.saved_bytes:
            # No hull vertex between lo and hi; other minimum cuts at lam lie on the edge between.
            r = _on_edge(problem, lam, budget_bytes)
            edge = _decision(problem, r, set(), budget_bytes=budget_bytes, costs=costs, method="min-cut",
                             optimal=False) if r is not None else hi
            return edge if edge.recompute_flops < hi.recompute_flops else hi
        if mid.feasible:
            hi = mid
        else:
            lo = mid


def _fewest_bytes(problem: RematProblem, budget_bytes: int, costs: RematCosts, method: Method) -> RematDecision:
    """The decision keeping the fewest bytes on device without offload (then the fewest FLOPs):
    what the solvers return, marked infeasible, when nothing fits the budget."""
    r = _cut(problem, Fraction(sum(problem.flops) + 1))
    return _decision(problem, r, set(), budget_bytes=budget_bytes, costs=costs, method=method, optimal=False)


def peak_budget(problem: RematProblem, fraction: float) -> int:
    """Bytes: ``fraction`` of the way from the fewest bytes any decision saves after forward (the
    min cut's, a floor under every peak) to the peak of recomputing nothing (``fraction=1``)."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"remat budget fraction must be in [0, 1], got {fraction}")
    lo = _fewest_bytes(problem, 0, RematCosts(device_flops_per_s=1.0), "min-cut").saved_bytes
    hi = plain_backward_peak(problem)
    return int(lo + fraction * (hi - lo))


# ---------------------------------------------------------------------------------------------
# MILP (save / recompute / offload).

MILP_MIN_SLICE = 0.01
"""Share of ``time_limit_s`` each MILP solve gets at least, even when the earlier solves of one
call used up the limit (a zero limit returns HiGHS's empty answer, not a decision)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _MilpFound:
    """What one MILP solve returned."""

    recompute: list[bool]
    """Per node of the problem: recomputed in backward."""
    host: frozenset[int]
    """Nodes whose storages go to host."""
    optimal: bool
    """HiGHS proved it optimal (zero gap) within its time limit."""
    mip_gap: float
    """HiGHS's relative gap between the solution and its best bound (0: optimal; inf: no bound)."""


def solve_milp(problem: RematProblem, budget_bytes: int, *, costs: RematCosts, bound: Bound = "saved",
               time_limit_s: float = 60.0) -> RematDecision:
    """The decision with the fewest added seconds keeping at most ``budget_bytes`` on device,
    recomputing, saving or offloading (offload only when ``costs`` has a host link), by the MILP
    of the module docstring (HiGHS, zero optimality gap asked). ``time_limit_s``: seconds for the
    whole call, its fallback solves included (each solve at least :data:`MILP_MIN_SLICE` of it);
    past it the best decision found is returned with ``optimal=False`` and its ``mip_gap``.
    ``bound``: ``"saved"`` bounds the bytes saved after forward; ``"peak"`` the activation bytes
    at every moment of backward (:func:`backward_peak`; save or recompute only). When no decision
    fits (``feasible=False``): with the saved bound, the min-cut decision keeping the fewest
    bytes; with the peak bound, the fewest FLOPs at the lowest peak any decision reaches. When the
    limit passes before HiGHS has any solution (``mip_gap`` inf, :func:`_unsolved`): the saved
    bound's fewest-bytes decision, or under the peak bound nothing recomputed. When nothing
    recomputed or offloaded fits, that decision is returned as optimal without a solve."""
    if bound == "peak" and costs.offload:
        raise ConfigError("remat MILP: the peak bound prices save and recompute only; solve it without a host "
                          "link (RematCosts(host_bytes_per_s=None)) or bound the saved bytes")
    if not time_limit_s > 0:
        raise ConfigError(f"remat MILP: time_limit_s must be > 0 seconds, got {time_limit_s}")
    # Nothing recomputed or offloaded adds no seconds, the least any decision adds (every cost is
    # >= 0): when it fits, it is the optimum without a solve (a roomy budget, the usual case when
    # a planner prices a stage; HiGHS took 10 s to prove it on a 6,700-column problem).
    keep_all = _decision(problem, [False] * len(problem.nodes), set(), budget_bytes=budget_bytes, costs=costs,
                         method="milp", optimal=True, bound=bound, mip_gap=0.0)
    if keep_all.feasible:
        return keep_all
    deadline = time.perf_counter() + time_limit_s

    def left() -> float:  # seconds a solve may take: what the call has left, at least a slice
        return max(deadline - time.perf_counter(), MILP_MIN_SLICE * time_limit_s)

    try:
        found = _solve_milp(problem, budget_bytes, costs, bound, left)
    except _OutOfTime:  # the limit is spent: no fallback solves (each would rebuild the rows)
        return _unsolved(problem, budget_bytes, costs, bound)
    if found is not None:
        return _decision(problem, found.recompute, set(found.host), budget_bytes=budget_bytes, costs=costs,
                         method="milp", optimal=found.optimal, bound=bound, mip_gap=found.mip_gap)
    if bound == "saved":  # proven infeasible: the min cut's fewest bytes (no MILP decision, no gap)
        return _fewest_bytes(problem, budget_bytes, costs, "milp")
    try:  # proven infeasible: the lowest peak any decision reaches, then the fewest FLOPs there
        lowest = _solve_milp(problem, None, costs, bound, left)
        floor = backward_peak(problem, lowest.recompute) if lowest is not None else problem.base_bytes
        found = _solve_milp(problem, floor, costs, bound, left) or lowest
    except _OutOfTime:
        return _unsolved(problem, budget_bytes, costs, bound)
    r = found.recompute if found is not None else [False] * len(problem.nodes)
    return _decision(problem, r, set(), budget_bytes=budget_bytes, costs=costs, method="milp", optimal=False,
                     bound=bound, mip_gap=found.mip_gap if found is not None else math.inf)


class _OutOfTime(Exception):
    """HiGHS reached its time limit without any solution (not a proof that none exists)."""


def _unsolved(problem: RematProblem, budget_bytes: int, costs: RematCosts, bound: Bound) -> RematDecision:
    """What :func:`solve_milp` returns when its time ran out before any solution (``mip_gap``
    inf): with the saved bound the min-cut decision keeping the fewest bytes, as when nothing
    fits; with the peak bound nothing recomputed (the peak of no recompute, no FLOPs added)."""
    if bound == "saved":
        return dataclasses.replace(_fewest_bytes(problem, budget_bytes, costs, "milp"), mip_gap=math.inf)
    return _decision(problem, [False] * len(problem.nodes), set(), budget_bytes=budget_bytes, costs=costs,
                     method="milp", optimal=False, bound=bound, mip_gap=math.inf)


_SOLVED: dict[bytes, object] = {}
"""HiGHS's answers to the last :data:`_SOLVED_ENTRIES` problems proven optimal or infeasible, by
:func:`_problem_key` (the most recently used last): the ranks of a job that share a process, the
plans of one model and the planner's replays solve the same problem again, seconds each."""
_SOLVED_ENTRIES = 64


def milp(c, *, integrality, bounds, constraints, options):
    """``scipy.optimize.milp`` (HiGHS), imported when a problem is first solved: a process that
    solves none does not load scipy. A problem this process proved before (the same arrays and
    gap asked; the time limit aside) gets that answer again, the one HiGHS, which is
    deterministic, reaches given the time; answers cut short by a limit are not kept."""
    key = _problem_key(c, integrality, bounds, constraints, options)
    known = _SOLVED.pop(key, None)
    if known is None:
        from scipy.optimize import milp as highs

        with _native_stdout_silenced():
            known = highs(c, integrality=integrality, bounds=bounds, constraints=constraints, options=options)
        if known.status not in (0, 2):  # 0: optimal, 2: infeasible; else a limit stopped it
            return known
    _SOLVED[key] = known
    while len(_SOLVED) > _SOLVED_ENTRIES:
        _SOLVED.pop(next(iter(_SOLVED)))
    return known


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """File descriptor 1 on /dev/null: HiGHS 1.12 prints a debug line on the process's stdout
    from one of its heuristics (``HighsMipSolverData::transformNewIntegerFeasibleSolution``),
    which would land in the middle of a command's ``--json`` output. Process-wide: what another
    thread writes on stdout during a solve is lost too (solves run while planning and lowering,
    before a job prints anything of its own)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no file descriptor 1 to silence
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
        finally:
            os.close(null)
        yield
    finally:
        _flush_c_stdio()  # what the C library still buffers goes to /dev/null too
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to flush here
        pass


def _problem_key(c, integrality, bounds, constraints, options) -> bytes:
    """A digest of everything a MILP's answer depends on: objective, integrality, bounds, rows
    (a ``scipy.sparse`` matrix) and the options but the time limit."""
    h = hashlib.sha256()
    a = constraints.A.tocsr()
    for part in (c, integrality, bounds.lb, bounds.ub, constraints.lb, constraints.ub, a.data, a.indices, a.indptr,
                 np.asarray(a.shape)):
        arr = np.ascontiguousarray(part)
        h.update(str(arr.dtype).encode() + b":" + str(arr.shape).encode())
        h.update(arr.tobytes())
    h.update(repr(sorted((k, v) for k, v in options.items() if k != "time_limit")).encode())
    return h.digest()


def _solve_milp(problem: RematProblem, budget_bytes: int | None, costs: RematCosts, bound: Bound,
                left: Callable[[], float]) -> _MilpFound | None:
    """The MILP's answer within ``left()`` seconds (asked once the rows are built: building them
    takes seconds on a whole deep graph), or None when infeasible; raises
    :class:`_OutOfTime` when the limit passed without a solution. ``budget_bytes=None`` (peak
    bound only): minimise the peak instead of the added seconds."""
    n, m = len(problem.nodes), len(problem.storages)
    off = costs.offload
    cols = _Columns()
    r0, d0 = cols.add(n), cols.add(m)
    h0, o0 = (cols.add(m), cols.add(n)) if off else (0, 0)
    ints = cols.width
    rows = _Rows()
    for j, s in enumerate(problem.storages):
        have = {r0 + s.owner: 1.0, d0 + j: 1.0, **({h0 + j: 1.0} if off else {})}
        if s.kept:
            rows.add(have, 1.0, np.inf)
        for k in s.readers:
            rows.add({r0 + k: 1.0, **{col: -v for col, v in have.items()}}, -np.inf, 0.0)
        rows.add(have, -np.inf, 1.0)
        if off:
            rows.add({d0 + j: 1.0, o0 + s.owner: 1.0}, -np.inf, 1.0)
            rows.add({h0 + j: 1.0, o0 + s.owner: -1.0}, -np.inf, 0.0)
    big = max((s.nbytes for s in problem.storages), default=1) or 1
    room = None if budget_bytes is None else budget_bytes - problem.fixed_bytes
    if room is not None and room < 0:
        return None
    peak_col = cols.add(1) if room is None else None  # the peak / big, minimised
    if bound == "peak":
        _peak_rows(problem, cols, rows, r0, d0, room, big, peak_col)
    else:
        rows.add({d0 + j: s.nbytes / big for j, s in enumerate(problem.storages)}, -np.inf, room / big)

    width = cols.width
    c = np.zeros(width)
    if peak_col is not None:
        c[peak_col] = 1.0
    else:
        c[r0:r0 + n] = [costs.recompute_s(f) for f in problem.flops]
        if off:
            c[h0:h0 + m] = [costs.offload_s(s.nbytes) for s in problem.storages]
        c /= float(np.max(np.abs(c))) or 1.0
    upper = np.ones(width)
    upper[r0:r0 + n] = [1.0 if ok else 0.0 for ok in may_recompute(problem, bound)]
    for col in cols.zero:
        upper[col] = 0.0
    if peak_col is not None:
        upper[peak_col] = np.inf
    integrality = np.zeros(width)
    integrality[:ints] = 1
    from scipy.optimize import Bounds, LinearConstraint  # scipy only where a MILP is solved

    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(width), upper),
               constraints=LinearConstraint(rows.matrix(width), rows.lb, rows.ub),
               options={"mip_rel_gap": 0.0, "time_limit": left()})
    if res.x is None:
        if res.status == 1:  # time (or iteration) limit, nothing found: unknown, not infeasible
            raise _OutOfTime()
        return None
    x = np.round(res.x[:ints]).astype(bool)
    optimal = bool(res.status == 0)
    gap = getattr(res, "mip_gap", None)
    gap = float(gap) if gap is not None else (0.0 if optimal else math.inf)
    return _MilpFound(recompute=_prune(problem, list(x[r0:r0 + n])),
                      host=frozenset(i for i in range(n) if off and x[o0 + i]), optimal=optimal, mip_gap=gap)


class _Columns:
    """Variable columns of a MILP, handed out in blocks; ``zero`` lists columns fixed at 0."""

    def __init__(self) -> None:
        self.width = 0
        self.zero: list[int] = []

    def add(self, k: int) -> int:
        self.width += k
        return self.width - k


class _Rows:
    """Sparse constraint rows ``lb <= sum(coef x) <= ub``."""

    def __init__(self) -> None:
        # coordinates kept flat as rows are added: a whole-graph peak bound has millions of them
        self.ii: list[int] = []
        self.jj: list[int] = []
        self.vv: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, coefs: dict[int, float], low: float, high: float) -> None:
        self.ii.extend([len(self.lb)] * len(coefs))
        self.jj.extend(coefs.keys())
        self.vv.extend(coefs.values())
        self.lb.append(low)
        self.ub.append(high)

    def matrix(self, width: int):
        """The rows as a ``scipy.sparse.csr_matrix`` of ``width`` columns."""
        from scipy import sparse

        return sparse.csr_matrix((np.asarray(self.vv, dtype=float), (np.asarray(self.ii), np.asarray(self.jj))),
                                 shape=(len(self.lb), width))


def _peak_rows(problem: RematProblem, cols: _Columns, rows: _Rows, r0: int, d0: int, room: int | None, big: int,
               peak_col: int | None) -> None:
    """The peak bound as linear rows (:func:`backward_peak`'s rule). At each moment ``q`` of
    backward where a storage is unpacked (recomputes happen only there and what they make goes
    only after one, so the bytes on device change nowhere else), continuous columns:
    ``z[v,q]``: ``v`` has been recomputed by ``q`` (its recompute position is at or above ``q``);
    ``y[v,q]``: what ``v``'s recompute made is on device at ``q``; ``a[j,q]``: storage ``j`` of a
    node not recomputed is on device at ``q`` only because a recompute still to come reads it.
    ``z`` is pinned to the truth from both sides (a recompute happens when, and only when, an
    unpack or a recomputed reader needs it), so ``y`` and ``a`` only need lower bounds; each
    moment's bytes are at most ``room`` (or, with ``room=None``, at most ``peak_col`` x ``big``).
    ``z[v, .]`` never rises from one moment to the next (backward runs from the highest moment
    down, and a recompute stays done): rows that every integer solution meets already, which
    tighten the relaxation (the profile's two GPT-2 blocks: 12.5 s of HiGHS before, 2.9 s after)."""
    tl = _timeline(problem)
    moments = sorted({u for s in problem.storages for u in s.used_at} | {-1})  # -1: backward's end
    after = dict(zip(moments, moments[1:]))
    # A node with no unpack at or after its position is never needed: never recomputed in backward.
    free = [v for v, ok in enumerate(may_recompute(problem, "peak")) if ok and moments[-1] >= tl.pos[v]]
    z, y = {}, {}
    for v in free:
        qs = moments[bisect.bisect_left(moments, tl.pos[v]):]
        base_z, base_y = cols.add(len(qs)), cols.add(len(qs))
        for k, q in enumerate(qs):
            z[v, q], y[v, q] = base_z + k, base_y + k
            if k:  # recomputed by a later moment q means recomputed by every earlier one
                rows.add({z[v, q]: 1.0, z[v, qs[k - 1]]: -1.0}, -np.inf, 0.0)

    def zcol(w: int, q: int) -> int:  # z[w, q]; below w's position, whether w is needed at all
        return z[w, moments[bisect.bisect_left(moments, max(q, tl.pos[w]))]]

    def later_read(w: int, q: int) -> dict[int, float]:  # -(r_w - z[w, after q]): w's recompute is at or below q
        coefs = {r0 + w: -1.0}
        if q in after:
            coefs[z[w, after[q]]] = 1.0
        return coefs

    needable = set(free)
    for v in free:
        F = tl.first_unpack[v]
        readers = [(j, w) for j, w in tl.reads[v] if w in needable]
        kept_end = min((tl.last_unpack[j] for j in tl.owned[v]), default=math.inf)
        for q in (q for q in moments if q >= tl.pos[v]):
            rows.add({z[v, q]: 1.0, r0 + v: -1.0}, -np.inf, 0.0)  # only a recomputed node is
            if F is not None and q <= F:
                rows.add({z[v, q]: 1.0, r0 + v: -1.0}, 0.0, np.inf)  # an unpack at or above q needs it
            else:  # it is needed at or above q only by a reader recomputed by then
                ups: dict[int, float] = {z[v, q]: 1.0}
                for _, w in readers:
                    ups[zcol(w, q)] = ups.get(zcol(w, q), 0.0) - 1.0
                if len(ups) == 1:
                    cols.zero.append(z[v, q])
                else:
                    rows.add(ups, -np.inf, 0.0)
            for j, w in readers:  # a reader recomputed by q needs v's storage: recomputed, or saved
                rows.add({z[v, q]: 1.0, zcol(w, q): -1.0, d0 + j: 1.0}, 0.0, np.inf)
            if q >= kept_end:
                rows.add({y[v, q]: 1.0, z[v, q]: -1.0}, 0.0, np.inf)  # an unpack at or below q uses it
            else:
                for _, w in readers:
                    if q >= tl.pos[w]:  # y >= z + r_w - z[w, after q] - 1: a recompute of w at or below q reads it
                        rows.add({y[v, q]: 1.0, z[v, q]: -1.0, **later_read(w, q)}, -1.0, np.inf)

    held: dict[tuple[int, int], int] = {}
    for j, s in enumerate(problem.storages):
        for w in (w for w in s.readers if w in needable):
            for q in (q for q in moments if tl.pos[w] <= q < tl.last_unpack[j]):
                if (j, q) not in held:
                    held[j, q] = cols.add(1)
                # a[j,q] >= d_j + r_w - z[w, after q] - 1
                rows.add({held[j, q]: 1.0, d0 + j: -1.0, **later_read(w, q)}, -1.0, np.inf)
    for q in moments:
        coefs: dict[int, float] = {}
        for j, s in enumerate(problem.storages):
            if s.kept and tl.last_unpack[j] <= q:
                coefs[d0 + j] = s.nbytes / big
            if (j, q) in held:
                coefs[held[j, q]] = s.nbytes / big
        for v in free:
            remade = sum(problem.storages[j].nbytes for j in tl.remade[v])
            if (v, q) in y and remade:
                coefs[y[v, q]] = remade / big
        if peak_col is not None:
            rows.add({**coefs, peak_col: -1.0}, -np.inf, 0.0)
        elif coefs:
            rows.add(coefs, -np.inf, room / big)


def may_recompute(problem: RematProblem, bound: Bound) -> list[bool]:
    """Which nodes a decision under ``bound`` may recompute: the recomputable ones, and under the
    peak bound not those keeping a storage no backward unpacks (a dead branch: the executor's
    token would never be unpacked, yet would hold the recompute's inputs to the end, a state the
    peak model has not)."""
    ok = list(problem.recomputable)
    if bound == "peak":
        for s in problem.storages:
            if s.kept and not s.used_at:
                ok[s.owner] = False
    return ok


def _prune(problem: RematProblem, r: list[bool]) -> list[bool]:
    """``r`` without recomputes nothing needs (no kept storage, no recomputed reader): a solver
    may mark them when they cost no FLOPs; they would run never but hold their sources."""
    r = list(r)
    tl = _timeline(problem)
    for v in reversed(range(len(problem.nodes))):
        if r[v] and not any(problem.storages[j].kept for j in tl.owned[v]) and not any(r[w] for _, w in tl.reads[v]):
            r[v] = False
    return r


# ---------------------------------------------------------------------------------------------
# Brute force (the reference on tiny problems) and today's block-level policy.

BRUTE_FORCE_MAX_NODES = 12


def solve_brute_force(problem: RematProblem, budget_bytes: int, *, costs: RematCosts,
                      bound: Bound = "saved") -> RematDecision:
    """The optimum by trying every recompute set and, for each, every choice of nodes to
    offload (at most :data:`BRUTE_FORCE_MAX_NODES` nodes: 3**n decisions). Ties go to the
    decision found first (fewer recomputes, then fewer offloads). ``bound="peak"``: the budget
    bounds :func:`backward_peak` (save or recompute only)."""
    if bound == "peak" and costs.offload:
        raise ConfigError("brute force: the peak bound prices save and recompute only; pass costs without a host link")
    n = len(problem.nodes)
    if n > BRUTE_FORCE_MAX_NODES:
        raise ConfigError(f"brute force over {n} nodes is 3**{n} decisions; use solve_milp (at most "
                          f"{BRUTE_FORCE_MAX_NODES} nodes here)")
    free = [i for i, ok in enumerate(may_recompute(problem, bound)) if ok]
    best: tuple[float, list[bool], set[int]] | None = None
    for k in range(len(free) + 1):
        for chosen in itertools.combinations(free, k):
            r = [False] * n
            for i in chosen:
                r[i] = True
            need = _needed(problem, r)
            base = problem.fixed_bytes + sum(need) if bound == "saved" else backward_peak(problem, r)
            cost_r = costs.recompute_s(sum(problem.flops[i] for i in chosen))
            movable = [i for i in range(n) if need[i]] if costs.offload else []
            for size in range(len(movable) + 1):
                for host in itertools.combinations(movable, size):
                    moved = sum(need[i] for i in host)
                    if base - moved > budget_bytes:
                        continue
                    cost = cost_r + costs.offload_s(moved)
                    if best is None or cost < best[0]:
                        best = (cost, r, set(host))
    if best is None:
        return dataclasses.replace(_fewest_bytes(problem, budget_bytes, costs, "brute-force"), bound=bound,
                                   feasible=False)
    return _decision(problem, best[1], best[2], budget_bytes=budget_bytes, costs=costs, method="brute-force",
                     optimal=True, bound=bound)


def from_checkpoint_plan(problem: RematProblem, plan: CheckpointPlan, *, budget_bytes: int,
                         costs: RematCosts) -> RematDecision:
    """Block-level checkpointing (``checkpoint_policy``'s plan) as a decision: every node of a
    recomputed region is recomputed, everything else saved as needed, costed by this model."""
    names = set(problem.nodes)
    chosen = [n for region in plan.regions if region.recompute for n in region.nodes if n in names]
    index = {n: i for i, n in enumerate(problem.nodes)}
    fixed = [n for n in chosen if not problem.recomputable[index[n]]]
    if fixed:
        raise PassError(f"from_checkpoint_plan: region node {fixed[0]!r} cannot be recomputed in this model "
                        f"(an in-place op writes its storage)")
    return evaluate(problem, chosen, budget_bytes=budget_bytes, costs=costs)


def overhead_percent(decision: RematDecision, step_flops: int) -> float:
    """Recompute FLOPs as a percentage of ``step_flops`` (one forward and backward)."""
    return 100.0 * decision.recompute_flops / step_flops if step_flops else math.nan
