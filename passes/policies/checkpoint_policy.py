"""Transform (tag half): decide which regions of a training graph recompute their forward in
backward, and write the decision as meta. :mod:`passes.rewrites.apply_checkpoint` carries it out.

Regions
    A *cut point* is an activation every forward path from the inputs to the loss passes through
    (a dominator of the loss, :mod:`passes.analysis.graph_view`); parameters, graph inputs, sizes and what
    is made from inputs or parameters alone (masks, positions) are available everywhere and do
    not count. The compute nodes between two cut points form a single-entry, single-exit segment.
    Segments whose nodes belong to the same repeated block (``node.meta[BLOCK]`` from
    ``annotate_blocks``: ``blocks.N``, ``model.layers.N``, ...) are merged into one region per
    block; a model without blocks uses its segments as regions. A skip connection keeps two
    activations live, so no cut point falls inside it.

Policies
    * ``none``: regions are found, nothing is recomputed.
    * ``full``: every block is recomputed (only its input is kept).
    * ``selective``: only the attention core of each attention module is recomputed (the nodes
      of the attention module itself around ``scaled_dot_product_attention``/softmax, not its
      projections), as Korthikanti et al. 2022.
    * ``solver``: the blocks to recompute are chosen by :func:`passes.solvers.checkpoint_solver.solve_chain`
      to fit ``budget_bytes`` of saved activations with the fewest recompute FLOPs.
    * ``dag``: per op output inside the regions (any DAG: skip connections stay inside a region),
      :func:`_solve_dag` chooses which regions are checkpointed and, in each, which
      nodes keep their outputs (``node.meta[REMAT]``) and which run again in backward, with the
      fewest recompute FLOPs under ``budget_bytes`` (default :func:`dag_default_budget`:
      halfway between block-level full checkpointing's saved bytes and none's); never more FLOPs
      than ``solver`` at the same budget. Carried out with selective activation checkpointing.

Bytes: the graph runs forward once on fake tensors under ``saved_tensors_hooks`` (the
observation ``annotate_memory`` makes), so each storage autograd keeps is known with its savers. After
checkpointing, a storage stays kept if a node outside the recomputed regions saves it, or if it
is the input of a recomputed region (``torch.utils.checkpoint`` keeps its inputs). FLOPs come
from ``node.meta[FLOPS]`` (``annotate_flops``). Writes ``node.meta[CHECKPOINT]`` on every node and
``gm.meta[CHECKPOINT_PLAN]``.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import sympy
import torch
from torch import fx

from passes.ir.config import CHECKPOINT_POLICIES, CHECKPOINTING
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import module_path
# annotate_memory's forward observation (storages, owners, savers); private there, shared here.
from passes.analysis.annotate_memory import observe_saved_tensors as _observe_saved
from passes.solvers.checkpoint_solver import ChainSegment, solve_chain
from passes.policies.pipeline_stages import assign_stages_by_chain
from passes.ir.meta import (BLOCK, CAPTURE, CHECKPOINT, CHECKPOINT_PLAN, DAG_CHECKPOINT_PLAN, FLOPS,
                            LAYER_CHAIN, PIPELINE_STAGE, REMAT, SHAPE, CheckpointMeta, CheckpointPlan,
                            CheckpointRegion, DagCheckpointPlan, RematNodeMeta)
from passes.analysis.graph_view import draws_random, forward_cut_points, to_networkx
from passes.solvers.remat_solver import RematCosts, RematProblem, Storage, solve_milp

aten = torch.ops.aten
POLICIES = tuple(p for p in dict.fromkeys(CHECKPOINT_POLICIES + CHECKPOINTING) if p != "tensor")  # tensor: its own pass
_ZERO = sympy.Integer(0)
_ATTENTION_ANCHORS = {aten.scaled_dot_product_attention.default, aten._softmax.default, aten.softmax.int}
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Region:
    """A contiguous run of compute nodes (in graph order) that can be recomputed as one unit."""

    name: str
    nodes: tuple[fx.Node, ...]

    def io(self) -> tuple[tuple[fx.Node, ...], tuple[fx.Node, ...]]:
        """(inputs, outputs): outside nodes it reads (parameters excluded), its nodes read outside."""
        return region_io(self.nodes)


def region_io(nodes: Sequence[fx.Node]) -> tuple[tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    """Inputs (non-parameter nodes outside ``nodes`` that they read, in first-use order) and
    outputs (nodes of ``nodes`` with a user outside) of a region."""
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr":
                inputs[a] = None
    outputs = tuple(n for n in nodes if any(u not in inside for u in n.users))
    return tuple(inputs), outputs


# ---------------------------------------------------------------------------------------------
# Region finding.

def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS]


def cut_points(gm: fx.GraphModule) -> list[fx.Node]:
    """Compute nodes every forward path from the inputs to the loss passes through, in graph
    order, never the last node: the dominators of the loss on the graph's trunk
    (:func:`passes.analysis.graph_view.forward_cut_points` on the structural view)."""
    names = set(forward_cut_points(to_networkx(gm, storages=False)))
    return [n for n in _compute_nodes(gm)[:-1] if n.name in names]


def segments(gm: fx.GraphModule, cuts: Iterable[fx.Node] | None = None) -> list[list[fx.Node]]:
    """The compute nodes split after every cut point (``cuts``, default :func:`cut_points`):
    single-entry, single-exit segments."""
    cuts = set(cut_points(gm) if cuts is None else cuts)
    out: list[list[fx.Node]] = [[]]
    for node in _compute_nodes(gm):
        out[-1].append(node)
        if node in cuts:
            out.append([])
    return [s for s in out if s]


def block_of(node: fx.Node) -> str | None:
    """The repeated block a node belongs to (``"blocks.2"``, from ``annotate_blocks``), or None."""
    meta = node.meta.get(BLOCK)
    return meta.name if meta is not None and meta.in_block else None


def block_regions(gm: fx.GraphModule, cuts: Iterable[fx.Node] | None = None) -> list[Region]:
    """One region per transformer block (its segments merged); a graph without blocks gets one
    region per segment ("segment.K"). Segments outside every block are in no region. ``cuts``:
    the cut points to split at (default :func:`cut_points`)."""
    segs = segments(gm, cuts)
    labels = []
    for seg in segs:
        blocks = list(dict.fromkeys(b for b in map(block_of, seg) if b is not None))
        labels.append("+".join(blocks) if blocks else None)
    if not any(labels):
        return [Region(f"segment.{k}", tuple(seg)) for k, seg in enumerate(segs)]
    regions: list[Region] = []
    prev = None
    for seg, label in zip(segs, labels):
        if label is not None and label == prev:
            regions[-1] = Region(label, regions[-1].nodes + tuple(seg))
        elif label is not None:
            regions.append(Region(label, tuple(seg)))
        prev = label
    return regions


def attention_regions(gm: fx.GraphModule) -> list[Region]:
    """The attention core of each attention op: the contiguous run of nodes of the attention
    module itself around it (its projections live in child modules and stay out)."""
    order = _compute_nodes(gm)
    regions: list[Region] = []
    taken: set[fx.Node] = set()
    for i, node in enumerate(order):
        if node.target not in _ATTENTION_ANCHORS or node in taken:
            continue
        path = module_path(node)
        lo = hi = i
        if path:
            while lo > 0 and module_path(order[lo - 1]) == path and order[lo - 1] not in taken:
                lo -= 1
            while hi + 1 < len(order) and module_path(order[hi + 1]) == path:
                hi += 1
        nodes = tuple(order[lo:hi + 1])
        taken.update(nodes)
        regions.append(Region(f"{path or node.name} (attention core)", nodes))
    return regions


# ---------------------------------------------------------------------------------------------
# Saved-activation model: which storages autograd keeps, from one run on fake tensors.

@dataclass
class _Saved:
    """Storages (numbered) saved for backward, who saves them, and the storages of each value."""

    size: dict[int, sympy.Expr]  # bytes of each saved storage (activations and graph inputs)
    savers: dict[int, set[fx.Node]]
    storages: dict[fx.Node, tuple[int, ...]]  # storages a node's tensors live on (not parameters)
    all_sizes: dict[int, sympy.Expr]  # bytes of every storage (a checkpoint input may be unsaved)
    # storages each node's own ops make (new outputs, internal saves): what it keeps when cached
    owned: dict[fx.Node, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def kept(self, recompute: Iterable[Region]) -> set[int]:
        """Storages kept after forward when ``recompute``'s regions are checkpointed: those a node
        outside them saves, and their inputs (``torch.utils.checkpoint`` keeps its inputs)."""
        regions = list(recompute)
        dropped = {n for r in regions for n in r.nodes}
        keys = {k for k, savers in self.savers.items() if savers - dropped}
        for r in regions:
            for node in r.io()[0]:
                keys.update(self.storages.get(node, ()))
        return keys

    def bytes(self, keys: Iterable[int]) -> sympy.Expr:
        keys = list(keys)
        return sympy.expand(sympy.Add(*[self.all_sizes[k] for k in keys])) if keys else _ZERO


def _saved_model(gm: fx.GraphModule) -> _Saved:
    """Number the storages autograd keeps, from ``annotate_memory``'s forward run on fake tensors.

    We reuse that observation (same storages, same eager-faithful dropout) rather than
    ``MemoryMeta``, which names a saved storage only by owner and size and so cannot tell a
    dropout's output from its noise tensor of the same size.

    The run is remembered by the graph's code, capture and parameter shapes: every plan lowered
    from one analysed graph tags a deep copy of it (other nodes, same names), and a fake run of
    the whole graph is most of a lowering's time.
    """
    key = _observation_key(gm)
    named = _OBSERVED.get(key) if key is not None else None
    if named is not None:
        _OBSERVED.move_to_end(key)
        return named.bind(gm)
    saved = _observe_saved_model(gm)
    if key is not None:
        _OBSERVED[key] = _NamedSaved.of(saved)
        while len(_OBSERVED) > _OBSERVED_GRAPHS:
            _OBSERVED.popitem(last=False)
    return saved


@dataclass(frozen=True)
class _NamedSaved:
    """A :class:`_Saved` with node names for nodes, so that it applies to a copy of its graph."""

    size: dict[int, sympy.Expr]
    savers: dict[int, frozenset[str]]
    storages: dict[str, tuple[int, ...]]
    all_sizes: dict[int, sympy.Expr]
    owned: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, saved: _Saved) -> "_NamedSaved":
        return cls(size=dict(saved.size), savers={k: frozenset(n.name for n in v) for k, v in saved.savers.items()},
                   storages={n.name: v for n, v in saved.storages.items()}, all_sizes=dict(saved.all_sizes),
                   owned={n.name: v for n, v in saved.owned.items()})

    def bind(self, gm: fx.GraphModule) -> _Saved:
        node = {n.name: n for n in gm.graph.nodes}
        return _Saved(size=dict(self.size), savers={k: {node[n] for n in v} for k, v in self.savers.items()},
                      storages={node[n]: v for n, v in self.storages.items()}, all_sizes=dict(self.all_sizes),
                      owned={node[n]: v for n, v in self.owned.items()})


_OBSERVED: "OrderedDict[tuple, _NamedSaved]" = OrderedDict()
_OBSERVED_GRAPHS = 8  # graphs remembered (a process lowers plans of one or a few models)


def _observation_key(gm: fx.GraphModule) -> tuple | None:
    """What the fake run depends on: the code (node names and ops), the capture (inputs, dims,
    device), the parameters' and buffers' shapes and dtypes, and the nodes that keep their
    outputs (``REMAT``). None for a graph with submodules (outlined regions): not remembered."""
    if any(n.op == "call_module" for n in gm.graph.nodes):
        return None
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in [*gm.named_parameters(), *gm.named_buffers()])
    cached = tuple(n.name for n in gm.graph.nodes if getattr(n.meta.get(REMAT), "cached", False))
    return gm.code, repr(gm.meta.get(CAPTURE)), tensors, cached


def _observe_saved_model(gm: fx.GraphModule) -> _Saved:
    run = _observe_saved(gm)
    ids = {st: i for i, st in enumerate(run.storages.values())}
    # a list in the run's order, not a set: the numbering and every dict built from it must be
    # the same on every rank (a set of storages iterates in address order, which is not), or the
    # solvers' ties break differently and ranks checkpoint different blocks
    kept = [st for st in run.storages.values() if st.kept and st.kind in ("activation", "internal", "input")]
    return _Saved(size={ids[st]: st.size for st in kept},
                  savers={ids[st]: set(st.savers) for st in kept},
                  storages={n: tuple(ids[st] for st in sts if st.kind in ("activation", "input"))
                            for n, sts in run.node_storages.items()},
                  all_sizes={ids[st]: st.size for st in run.storages.values()},
                  owned=_owned(run, ids))


def _owned(run, ids) -> dict[fx.Node, tuple[int, ...]]:
    out: dict[fx.Node, list[int]] = {}
    for st in run.storages.values():
        if st.owner is not None and st.kind in ("activation", "internal"):
            out.setdefault(st.owner, []).append(ids[st])
    return {n: tuple(k) for n, k in out.items()}


# ---------------------------------------------------------------------------------------------
# The pass.

def checkpoint_policy(gm: fx.GraphModule, ctx: Any = None, *, policy: str = "full",
                      budget_bytes: int | None = None, stage_starts: Sequence[int] = ()) -> fx.GraphModule:
    """Decide which regions to recompute; write :class:`CheckpointMeta` on every node and the
    :class:`CheckpointPlan` (FLOPs, bytes) under ``gm.meta[CHECKPOINT_PLAN]``; returns ``gm``.

    ``policy`` is one of :data:`POLICIES`; ``budget_bytes`` (bytes of saved activations after one
    forward, at the dims' hints) is required by ``solver``; ``dag`` uses it when given (else
    :func:`dag_default_budget`); the other policies ignore it. ``stage_starts`` (the layer-chain
    index where each pipeline stage after the first starts): with ``dag`` at its default budget,
    each stage's regions also meet that fraction of their own saved bytes
    (:func:`dag_stage_budgets`), so every stage saves its share and no stage keeps all its blocks
    while another recomputes all of its. Needs ``annotate_shapes``, ``annotate_blocks`` and
    ``annotate_flops`` to have run.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown checkpoint policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "solver" and budget_bytes is None:
        raise ConfigError("checkpoint policy 'solver' needs budget_bytes (bytes of saved activations)")
    for key, provider in ((SHAPE, "annotate_shapes"), (FLOPS, "annotate_flops")):
        missing = [n.name for n in _compute_nodes(gm) if key not in n.meta]
        if missing:
            raise PassError(f"checkpoint_policy: node {missing[0]!r} has no node.meta[{key!r}]; run {provider} "
                            f"first (annotate_shapes -> annotate_blocks -> annotate_flops -> checkpoint_policy)")
    if LAYER_CHAIN not in gm.meta:
        raise PassError("checkpoint_policy: gm.meta has no 'layer_chain'; run annotate_blocks first (regions are "
                        "the blocks it finds)")

    regions = attention_regions(gm) if policy == "selective" else block_regions(gm)
    saved = _saved_model(gm)
    hints = gm.meta[CAPTURE].symbols() if CAPTURE in gm.meta else {}
    flops = [sympy.expand(sympy.Add(*[n.meta[FLOPS].fwd for n in r.nodes])) for r in regions]

    cached: set[fx.Node] = set()
    dag: DagChoice | None = None
    stages: list[StageBudget] = []  # dag with pipeline stages: each stage's own bound
    if policy == "none":
        recompute = [False] * len(regions)
    elif policy in ("full", "selective"):
        recompute = [True] * len(regions)
    elif policy == "solver":
        recompute = _solve(regions, saved, flops, hints, budget_bytes)
    else:
        if budget_bytes is None:
            budget_bytes = dag_default_budget(regions, saved, hints)
            if stage_starts:
                stages = dag_stage_budgets(gm, regions, saved, hints, stage_starts)
        block = _solve(regions, saved, flops, hints, budget_bytes)
        dag = _solve_dag(regions, saved, hints, budget_bytes, block, stages=stages)
        recompute, cached = list(dag.checkpointed), set(dag.cached)
        # a region's recompute is its nodes that do not keep their outputs
        flops = [sympy.expand(sympy.Add(*[n.meta[FLOPS].fwd for n in r.nodes if n not in cached]))
                 for r in regions]

    chosen = [r for r, flag in zip(regions, recompute) if flag]

    def kept(regs: list[Region]) -> set[int]:
        keys = saved.kept(regs)
        inside = {n for r in regs for n in r.nodes}
        return keys | {k for n in cached & inside for k in saved.owned.get(n, ())}

    before = saved.bytes(saved.kept([]))
    after = saved.bytes(kept(chosen))
    entries = []
    for k, (region, flag) in enumerate(zip(regions, recompute)):
        others = [r for r in chosen if r is not region]
        without = saved.bytes(kept(others))
        with_it = saved.bytes(kept(others + [region]))
        inputs, outputs = region.io()
        entries.append(CheckpointRegion(
            index=k, name=region.name, nodes=tuple(n.name for n in region.nodes),
            inputs=tuple(n.name for n in inputs), outputs=tuple(n.name for n in outputs),
            recompute=flag, recompute_flops=flops[k], bytes_saved=sympy.expand(without - with_it)))

    region_of = {n: k for k, r in enumerate(regions) for n in r.nodes}
    for node in gm.graph.nodes:
        k = region_of.get(node)
        node.meta[CHECKPOINT] = CheckpointMeta(region=k, recompute=k is not None and recompute[k], policy=policy)
        if policy == "dag" and k is not None and recompute[k]:
            node.meta[REMAT] = RematNodeMeta(region=k, cached=node in cached)
        else:
            node.meta.pop(REMAT, None)
    gm.meta[CHECKPOINT_PLAN] = CheckpointPlan(
        policy=policy, regions=tuple(entries),
        recompute_flops=sympy.expand(sympy.Add(*[f for f, flag in zip(flops, recompute) if flag])),
        saved_bytes_before=before, saved_bytes_after=after,
        budget_bytes=budget_bytes if policy in ("solver", "dag") else None)
    if dag is not None:
        gm.meta[DAG_CHECKPOINT_PLAN] = DagCheckpointPlan(
            budget_bytes=budget_bytes, saved_bytes=dag.saved_bytes, recompute_flops=dag.recompute_flops,
            block_recompute_flops=dag.block_recompute_flops, block_saved_bytes=dag.block_saved_bytes,
            cached=tuple(n.name for n in gm.graph.nodes if n in cached), method=dag.method,
            stage_budget_bytes=tuple(st.budget_bytes for st in stages))
    else:
        gm.meta.pop(DAG_CHECKPOINT_PLAN, None)
    return gm


def _at_hints(expr: sympy.Expr, hints: dict) -> int:
    return int(sympy.sympify(expr).subs(hints))


def _solve(regions: list[Region], saved: _Saved, flops: list[sympy.Expr], hints: dict,
           budget: int) -> list[bool]:
    """The solver's choice. The chain model is additive; where regions interact (a storage two
    regions save, an input one region keeps that another frees) the exact count can differ, so
    the budget is tightened by any excess and the chain solved again."""
    base_keys = saved.kept([])
    base = _at_hints(saved.bytes(base_keys), hints)
    chain = []
    for r, f in zip(regions, flops):
        nodes = set(r.nodes)
        freed = [k for k, s in saved.savers.items() if s <= nodes]
        # The checkpoint keeps its inputs: those nobody else keeps once the region stops saving
        # them (not kept at all, or kept only by the region's own nodes) cost it their bytes.
        boundary = {k for n in r.io()[0] for k in saved.storages.get(n, ())
                    if k not in base_keys or k in freed}
        chain.append(ChainSegment(flops=_at_hints(f, hints), saved_bytes=_at_hints(saved.bytes(freed), hints),
                                  boundary_bytes=_at_hints(saved.bytes(boundary), hints)))
    target = budget
    for _ in range(4 * len(regions) + 8):
        sol = solve_chain(chain, target, base)
        if not sol.feasible:
            break
        exact = _at_hints(saved.bytes(saved.kept([r for r, x in zip(regions, sol.recompute) if x])), hints)
        if exact <= budget:
            return list(sol.recompute)
        # Tighten by the excess, and below this solution's own chain estimate: each round then
        # gets a different (smaller) choice, so the loop cannot stall on one choice.
        target = min(target - (exact - budget), sol.kept_bytes - 1)
    every = _at_hints(saved.bytes(saved.kept(regions)), hints)
    if every <= budget:  # the chain model mispredicts interactions; recomputing everything fits
        return [True] * len(regions)
    raise PassError(f"checkpoint_policy: no choice of the {len(regions)} regions keeps at most {budget} bytes of "
                    f"saved activations (nothing recomputed: {base} bytes; every region recomputed: {every} bytes); "
                    f"raise budget_bytes, lower the micro-batch size, or split the model over more pipeline stages")


# ---------------------------------------------------------------------------------------------
# The dag policy: which regions run under selective checkpointing, and which of their nodes keep
# their outputs.
#
# Under torch's selective activation checkpointing a checkpointed region keeps its inputs and the
# outputs of the ops of its *cached* nodes; in backward its forward is replayed from those, every
# other node running again. So the bytes kept after forward are the vanilla checkpoint's
# (``_Saved.kept``) plus the storages the cached nodes own, and the recompute FLOPs are those of
# the region's other nodes. Caching a node without FLOPs saves nothing (FLOPs are matmul-class),
# and random nodes must run again so the replay draws the same numbers: the candidates are the
# nodes with FLOPs that draw none. Which regions are checkpointed and which candidates are
# cached is one MILP (:func:`_solve_dag`), exact at any region count; block-level checkpointing's
# choice (nothing cached) is a point of it and wins ties, so the result never costs more FLOPs.
# :func:`_solve_dag_by_subsets` solves the same problem by enumerating the sets of regions (few
# regions only): the cross-check.

DAG_DEFAULT_BUDGET_FRACTION = 0.5
"""Default ``dag`` budget: this fraction of the way from block-level full checkpointing's saved
bytes to those of no checkpointing."""
_ENUMERATE_REGIONS = 8  # the cross-check enumerates at most 2**8 sets of regions


@dataclass(frozen=True)
class DagChoice:
    """The dag policy's choice: regions checkpointed, nodes cached, and totals at the hints."""

    checkpointed: tuple[bool, ...]
    cached: frozenset
    recompute_flops: int
    saved_bytes: int
    block_recompute_flops: int
    block_saved_bytes: int
    method: str


def dag_default_budget(regions: list[Region], saved: _Saved, hints: dict) -> int:
    """Bytes (at the hints): :data:`DAG_DEFAULT_BUDGET_FRACTION` of the way from the saved bytes
    of checkpointing every region to those of checkpointing none."""
    full = _at_hints(saved.bytes(saved.kept(regions)), hints)
    none = _at_hints(saved.bytes(saved.kept([])), hints)
    return int(full + DAG_DEFAULT_BUDGET_FRACTION * (none - full))


@dataclass(frozen=True)
class StageBudget:
    """One pipeline stage's bound in the dag MILP: bytes (at the hints) of ``keys``, the storages
    its regions' decisions keep or drop."""

    stage: int
    keys: tuple[int, ...]
    budget_bytes: int


def dag_stage_budgets(gm: fx.GraphModule, regions: list[Region], saved: _Saved, hints: dict,
                      starts: Sequence[int]) -> list[StageBudget]:
    """Per pipeline stage (``starts``: layer-chain index where each stage after the first
    starts): the storages its regions save, own or take as inputs, and
    :data:`DAG_DEFAULT_BUDGET_FRACTION` of the way from their bytes with every region
    checkpointed to those with none. A storage at a stage boundary (the last block's output,
    the next block's input) counts for both stages: each holds its own copy in a pipeline."""
    stage_of = assign_stages_by_chain(gm, starts).stage_of
    region_stage = [stage_of[r.nodes[0].name] for r in regions]
    region_of = {n: i for i, r in enumerate(regions) for n in r.nodes}
    keys_of: dict[int, set[int]] = {st: set() for st in region_stage}
    for k, savers in saved.savers.items():
        for node in savers:
            if node in region_of:
                keys_of[region_stage[region_of[node]]].add(k)
    for i, r in enumerate(regions):
        for node in r.nodes:
            keys_of[region_stage[i]].update(saved.owned.get(node, ()))
        for node in r.io()[0]:
            keys_of[region_stage[i]].update(saved.storages.get(node, ()))
    full, none = saved.kept(regions), saved.kept([])
    out = []
    for st in sorted(keys_of):
        keys = keys_of[st]
        lo, hi = _at_hints(saved.bytes(keys & full), hints), _at_hints(saved.bytes(keys & none), hints)
        out.append(StageBudget(stage=st, keys=tuple(sorted(keys)), budget_bytes=int(lo + DAG_DEFAULT_BUDGET_FRACTION * (hi - lo))))
    return out


def _within_stage_budgets(keys: set[int], stages: Sequence[StageBudget], saved: _Saved, hints: dict) -> bool:
    return all(_at_hints(saved.bytes(keys & set(st.keys)), hints) <= st.budget_bytes for st in stages)


def _dag_candidates(regions: list[Region], hints: dict) -> tuple[dict[fx.Node, int], list[list[fx.Node]]]:
    """FLOPs of every region node at the hints, and each region's nodes that may keep their
    outputs (FLOPs to save, no random numbers to replay)."""
    node_flops = {n: _at_hints(n.meta[FLOPS].fwd, hints) for r in regions for n in r.nodes}
    return node_flops, [[n for n in r.nodes if node_flops[n] > 0 and not draws_random(n)] for r in regions]


def _dag_choice(regions: list[Region], saved: _Saved, hints: dict, block: list[bool], best: tuple[int, ...],
                chosen: frozenset, method: str, stages: Sequence[StageBudget] = ()) -> DagChoice:
    """The choice ``best`` (checkpointed region indices) caching ``chosen``, with its exact totals;
    plain block-level checkpointing instead when that costs no more (FLOPs, then bytes) and
    meets every stage's budget."""
    node_flops, _ = _dag_candidates(regions, hints)
    regs = [regions[i] for i in best]
    keys = saved.kept(regs) | {k for n in chosen for k in saved.owned.get(n, ())}
    flops = sum(node_flops[n] for r in regs for n in r.nodes if n not in chosen)
    nbytes = _at_hints(saved.bytes(keys), hints)
    block_subset = tuple(i for i, x in enumerate(block) if x)
    block_flops = sum(node_flops[n] for i in block_subset for n in regions[i].nodes)
    block_bytes = _at_hints(saved.bytes(saved.kept([regions[i] for i in block_subset])), hints)
    block_fits = _within_stage_budgets(saved.kept([regions[i] for i in block_subset]), stages, saved, hints)
    if block_fits and (block_flops, block_bytes) <= (flops, nbytes):  # ties go to plain block-level checkpointing
        best, flops, nbytes, chosen = block_subset, block_flops, block_bytes, frozenset()
    return DagChoice(checkpointed=tuple(i in best for i in range(len(regions))), cached=chosen,
                     recompute_flops=flops, saved_bytes=nbytes, block_recompute_flops=block_flops,
                     block_saved_bytes=block_bytes, method=method)


def _solve_dag(regions: list[Region], saved: _Saved, hints: dict, budget: int, block: list[bool],
               time_limit_s: float = 60.0, *, stages: Sequence[StageBudget] = ()) -> DagChoice:
    """The fewest recompute FLOPs (then the fewest saved bytes) under ``budget``, over every set of
    checkpointed regions and every choice of cached nodes in them, as one MILP (HiGHS through
    ``scipy.optimize.milp``, zero optimality gap).

    Columns: ``c_r`` (region r checkpointed), ``a_n`` (candidate n cached; ``a_n <= c_r`` of its
    region) and ``y_k`` (storage k kept after forward, continuous in [0, 1]: it is pushed down to
    the largest of its lower bounds). ``y_k >= 1 - c_r`` for each region saving k (1 when a node
    outside every region saves it); ``y_k >= c_r`` for k a storage of an input of region r (the
    checkpoint keeps its inputs); ``y_k >= a_n`` for k owned by a cached n; ``sum bytes_k y_k <=
    budget``, and the same over each of ``stages``' storages under its own budget. Objective:
    ``sum_r F_r c_r - sum_n f_n a_n`` (F_r: the region's FLOPs); a second
    solve at that optimum minimises the bytes. This is the exact problem that enumerating every
    set of regions (:func:`_solve_dag_by_subsets`) solves, at any region count.
    """
    node_flops, candidates = _dag_candidates(regions, hints)
    region_of = {n: i for i, r in enumerate(regions) for n in r.nodes}
    cands = [n for c in candidates for n in c]
    keys = sorted(set(saved.savers) | {k for n in cands for k in saved.owned.get(n, ())}
                  | {k for r in regions for node in r.io()[0] for k in saved.storages.get(node, ())})
    nr, na, ny = len(regions), len(cands), len(keys)
    R, A, Y = 0, nr, nr + na
    col_y = {k: Y + j for j, k in enumerate(keys)}
    width = nr + na + ny
    low = np.zeros(width)
    rows, lb, ub = [], [], []

    def row(coefs: dict[int, float], lo: float, hi: float) -> None:
        rows.append(coefs)
        lb.append(lo)
        ub.append(hi)

    for j, n in enumerate(cands):
        row({A + j: 1.0, R + region_of[n]: -1.0}, -np.inf, 0.0)
        for k in saved.owned.get(n, ()):
            row({col_y[k]: 1.0, A + j: -1.0}, 0.0, np.inf)
    for k in sorted(saved.savers):  # rows in a fixed order: HiGHS breaks ties by it
        regions_saving = {region_of.get(s) for s in saved.savers[k]}
        if None in regions_saving:
            low[col_y[k]] = 1.0
        for r in sorted(regions_saving - {None}):
            row({col_y[k]: 1.0, R + r: 1.0}, 1.0, np.inf)
    for i, r in enumerate(regions):
        for node in r.io()[0]:
            for k in saved.storages.get(node, ()):
                row({col_y[k]: 1.0, R + i: -1.0}, 0.0, np.inf)
    size = {k: _at_hints(saved.all_sizes[k], hints) for k in keys}
    big = float(max(size.values(), default=1) or 1)
    row({col_y[k]: size[k] / big for k in keys if size[k]}, -np.inf, budget / big)
    for st in stages:
        row({col_y[k]: size[k] / big for k in st.keys if k in col_y and size[k]}, -np.inf, st.budget_bytes / big)
    region_flops = [sum(node_flops[n] for n in r.nodes) for r in regions]
    cost = np.zeros(width)
    cost[R:R + nr] = region_flops
    cost[A:A + na] = [-node_flops[n] for n in cands]
    integrality = np.zeros(width)
    integrality[:nr + na] = 1
    from scipy import sparse  # scipy only where a MILP is solved
    from scipy.optimize import Bounds, LinearConstraint, milp

    bounds = Bounds(low, np.ones(width))
    options = {"mip_rel_gap": 0.0, "time_limit": time_limit_s}

    def solve(objective, extra=None):
        rs, lo, hi = list(rows), list(lb), list(ub)
        if extra is not None:
            rs.append(extra[0]), lo.append(extra[1]), hi.append(extra[2])
        entries = [(i, col, v) for i, coefs in enumerate(rs) for col, v in coefs.items()]
        ii, jj, vv = zip(*entries)
        matrix = sparse.csr_matrix((vv, (ii, jj)), shape=(len(rs), width))
        scale = float(np.max(np.abs(objective))) or 1.0
        return milp(objective / scale, integrality=integrality, bounds=bounds,
                    constraints=LinearConstraint(matrix, lo, hi), options=options)

    fewest = solve(cost)
    if fewest.x is None:  # block-level checkpointing fits (the caller checked): only a time-out lands here
        return _dag_choice(regions, saved, hints, block, (), frozenset(), "block", stages)
    x = np.round(fewest.x)
    optimum = float(cost @ x)
    by_bytes = np.zeros(width)
    by_bytes[Y:] = [size[k] for k in keys]
    smallest = solve(by_bytes, ({i: v for i, v in enumerate(cost) if v}, -np.inf, optimum + 0.5))
    if smallest.x is not None:
        x = np.round(smallest.x)
    best = tuple(i for i in range(nr) if x[R + i])
    chosen = frozenset(n for j, n in enumerate(cands) if x[A + j])
    choice = _dag_choice(regions, saved, hints, block, best, chosen,
                         "milp" if fewest.status == 0 else "milp (time limit)", stages)
    if choice.saved_bytes > budget:  # the byte row's float tolerance let a few bytes through
        return _solve_dag(regions, saved, hints, budget - (choice.saved_bytes - budget), block, time_limit_s,
                          stages=stages)
    return choice


def _solve_dag_by_subsets(regions: list[Region], saved: _Saved, hints: dict, budget: int,
                          block: list[bool]) -> DagChoice:
    """The reference for :func:`_solve_dag` on few regions: every set of checkpointed regions, for
    each the cached nodes by :func:`passes.solvers.remat_solver.solve_milp` (one kept storage per
    candidate: keep it or recompute its owner); the best set by (FLOPs, bytes)."""
    if len(regions) > _ENUMERATE_REGIONS:
        raise ConfigError(f"every subset of {len(regions)} regions is 2**{len(regions)} MILPs; at most "
                          f"{_ENUMERATE_REGIONS} regions here (_solve_dag solves any count)")
    node_flops, candidates = _dag_candidates(regions, hints)
    results = {}
    for mask in range(1 << len(regions)):
        subset = tuple(i for i in range(len(regions)) if mask >> i & 1)
        base_keys = saved.kept([regions[i] for i in subset])
        fixed = _at_hints(saved.bytes(base_keys), hints)
        if fixed > budget:
            continue
        nodes = [n for i in subset for n in candidates[i]]
        total = sum(node_flops[n] for i in subset for n in regions[i].nodes)
        chosen = frozenset()
        if nodes:
            extra = [[k for k in saved.owned.get(n, ()) if k not in base_keys] for n in nodes]
            problem = RematProblem(
                nodes=tuple(n.name for n in nodes), flops=tuple(node_flops[n] for n in nodes),
                recomputable=(True,) * len(nodes), fixed_bytes=fixed,
                storages=tuple(Storage(name=n.name, owner=j, kept=True, nbytes=_at_hints(saved.bytes(keys), hints))
                               for j, (n, keys) in enumerate(zip(nodes, extra))))
            decision = solve_milp(problem, budget, costs=RematCosts(device_flops_per_s=1.0))
            if not decision.feasible:
                continue
            chosen = frozenset(n for n in nodes if decision.action(n.name) == "save")
        keys = base_keys | {k for n in chosen for k in saved.owned.get(n, ())}
        results[subset] = (total - sum(node_flops[n] for n in chosen), _at_hints(saved.bytes(keys), hints), chosen)
    best = min(results, key=lambda s: results[s][:2])
    return _dag_choice(regions, saved, hints, block, best, results[best][2], "milp per subset")


# ---------------------------------------------------------------------------------------------
# Per stage: the whole graph's decision, restricted to one stage's program.

def restrict_checkpoint_plan(gm: fx.GraphModule, ctx: Any = None, *, stage: int) -> fx.GraphModule:
    """Keep the recomputed regions of ``gm.meta[CHECKPOINT_PLAN]`` (decided on the whole graph)
    that lie on pipeline stage ``stage`` — ``gm`` is that stage's program — each widened to the
    nodes a later rewrite (tensor parallelism) inserted between its first and last node, and to
    inserted nodes right after it that only read it (``reduce_from_tp`` + bias after a
    row-parallel linear closing the region). Regions are blocks and stages are cut between
    blocks, so no region spans two stages. Returns ``gm`` with the restricted plan."""
    plan = gm.meta[CHECKPOINT_PLAN]
    order = _compute_nodes(gm)
    index = {n.name: i for i, n in enumerate(order)}
    original = {n.name for n in gm.graph.nodes if n.meta.get(PIPELINE_STAGE) is not None}
    regions = []
    for region in plan.regions:
        names = [n for n in region.nodes if n in index and n in original]
        if not names or not region.recompute:
            continue
        lo, hi = min(index[n] for n in names), max(index[n] for n in names)
        keep = set(names)
        nodes = [n.name for n in order[lo:hi + 1] if n.name in keep or n.name not in original]
        inside = set(nodes)
        for n in order[hi + 1:]:
            if n.name in original or not all(a.name in inside or a.op == "get_attr" for a in n.all_input_nodes):
                break
            nodes.append(n.name)
            inside.add(n.name)
        regions.append(dataclasses.replace(region, nodes=tuple(nodes)))
    gm.meta[CHECKPOINT_PLAN] = dataclasses.replace(plan, regions=tuple(regions))
    return gm
