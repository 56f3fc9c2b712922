"""A stage's backward in two halves: the input gradient now, the weight gradients later.

Zero-bubble schedules (``zb1p``, ``zbv``: :mod:`passes.ir.schedule.build`) run the part of a
backward the previous stage waits for (I: the gradient of the stage's received inputs) as soon
as its output gradient arrives, and the rest (W: the parameters' gradients) when the rank would
otherwise idle. Both halves run on the autograd graph the forward recorded:

* **I** finds the *mixing* nodes of the graph: nodes on a path from the outputs to a target (a
  received input, or an entry point of the stage's data, see below) with an edge that leads only
  to parameters (a matmul's weight side, a layer norm's weight and bias). It captures the gradient
  flowing into each of them (a pre-hook) while one ``torch.autograd.grad`` computes the targets'
  gradients; the engine runs only the activation side of each node (its output mask leaves the
  weight side out), so I costs what the input gradient costs.
* **W**, per mixing node, runs that node once more from its captured gradient to its weight-side
  edges only (``GradientEdge`` inputs: the engine stops there, so no activation gradient is
  computed twice and none is counted twice), then one ``torch.autograd.backward`` from all those
  edges into the parameters, which accumulates ``.grad`` and fires their post-accumulate hooks
  (data-parallel buckets, ZeRO) as a full backward does.

Entry points: a stage whose inputs carry no gradient (the first stage: token ids) has no target,
so its whole backward would land in W. The lowering marks where the parameters first meet the
data (``partitioner::split_point`` after an embedding lookup, :mod:`passes.rewrites.split_backward`); the
marker's node is a target of I, and W starts there.

A weight-side edge two mixing nodes share (one parameter tensor read directly by two ops of one
stage) would let W's walk from the later node reach it through the activation side; the lowering
gives each use its own view (:mod:`passes.rewrites.split_backward`), and :func:`backward_input` refuses a
graph where two mixing nodes still share one.

Checkpointed regions recompute in I and again in W (W's calls run in one
``torch.utils.checkpoint.GraphExecGroup``, so once for all of them, in the order W walks its
mixing nodes: the engine's order, the same on every rank, so the collectives a replayed region
issues meet the same region's on the other tp / cp ranks); offloaded activations are reloaded
for each half. The graph (every saved tensor) is kept from F until W.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from passes.ir.errors import PartitionerError
from passes.ir.ops import SPLIT_POINT_AUTOGRAD_NAME


@dataclass
class PendingWeights:
    """What W needs of one (stage, micro-batch): per mixing node its captured output gradients
    and weight-side edges; the gradients at the entry points; or, without any target, the whole
    backward (``outputs`` and ``grads``)."""

    mixing: list[tuple[Node, tuple[torch.Tensor | None, ...], list[GradientEdge]]] = field(default_factory=list)
    entries: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)


def _accumulate_grad_node(t: torch.Tensor) -> Node:
    # A leaf's AccumulateGrad node is made lazily: a view brings it into being.
    node = t.view_as(t).grad_fn
    assert node is not None
    return node.next_functions[0][0]


def _closure(roots: Sequence[Node], leaves: set[Node]) -> tuple[dict[Node, tuple], list[Node]]:
    """One walk of the graph below ``roots``: the nodes from which a target is reachable along
    ``next_functions`` (targets included), each with its ``next_functions``; and the split-point
    markers found, which are targets too (the walk stops at every target: below a marker is the
    embedding, W's). ``leaves``: the other targets (the AccumulateGrad nodes of received inputs)."""
    reach: dict[Node, bool] = {}
    nexts: dict[Node, tuple] = {}
    entries: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            reach[node] = any(reach.get(c, False) for c, _ in nexts[node] if c is not None)
            continue
        if node in reach:
            continue
        if node in leaves or SPLIT_POINT_AUTOGRAD_NAME in node.name():
            reach[node] = True
            if node not in leaves:
                entries.append(node)
            continue
        reach[node] = False  # visiting: a DAG, so no cycle comes back here
        nexts[node] = node.next_functions
        stack.append((node, True))
        stack.extend((c, False) for c, _ in nexts[node] if c is not None and c not in reach)
    return {n: nexts.get(n, ()) for n, r in reach.items() if r}, entries


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]) -> PendingWeights:
    """Run I: set ``inputs[k].grad`` (received tensors that require grad) from the output
    gradients, and return what W needs. ``grads[k]`` is None for a scalar loss."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    leaves = [t for t in inputs if t.requires_grad]
    leaf_nodes = {_accumulate_grad_node(t) for t in leaves}
    closure, markers = _closure(roots, leaf_nodes)
    entries = [GradientEdge(node, 0) for node in markers]
    targets = leaf_nodes | set(markers)
    if not targets:
        return PendingWeights(outputs=list(outputs), grads=list(grads))
    mixing: list[tuple[Node, list[GradientEdge]]] = []
    owner: dict[tuple[int, int], Node] = {}
    # In the order the engine runs them (latest forward op first), the same on every rank: W
    # walks them in this order and the first walk into a checkpointed region replays its
    # forward, whose tp / cp collectives must meet the same region's on the other ranks (a set's
    # order, by address, pairs one rank's region with another's: same sizes, wrong sums).
    for node in sorted(closure.keys() - targets, key=lambda n: n._sequence_nr(), reverse=True):
        weight_side = [GradientEdge(c, nr) for c, nr in closure[node] if c is not None and c not in closure]
        if not weight_side:
            continue
        for edge in weight_side:
            key = (id(edge.node), edge.output_nr)
            if key in owner:
                raise PartitionerError(
                    f"split backward: {owner[key].name()} and {node.name()} both read {edge.node.name()} directly; "
                    f"the lowering gives every use of a parameter its own view under a split-backward schedule "
                    f"(passes.rewrites.split_backward). Run this plan with schedule=1f1b, or report the model")
            owner[key] = node
        mixing.append((node, weight_side))
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [node.register_prehook(lambda g, node=node: captured.__setitem__(node, tuple(g)))
               for node, _ in mixing]
    try:
        got = torch.autograd.grad(list(outputs), leaves + entries, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(leaves, got[:len(leaves)]):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g
    pending = PendingWeights()
    pending.entries = [(e, g) for e, g in zip(entries, got[len(leaves):]) if g is not None]
    pending.mixing = [(node, captured[node], side) for node, side in mixing
                      if node in captured and any(g is not None for g in captured[node])]
    return pending


def backward_weight(pending: PendingWeights, order: WeightOrder | None = None) -> None:
    """Run W: accumulate the parameters' gradients of one (stage, micro-batch). ``order``: the
    order their post-accumulate hooks must fire in (gradient buckets launch from them); without
    it, the engine's."""
    if pending.outputs:  # no target: the whole backward is W
        torch.autograd.backward(pending.outputs, pending.grads)
        return
    edges: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    with _one_recompute():
        for node, captured, weight_side in pending.mixing:
            roots = [(GradientEdge(node, k), g) for k, g in enumerate(captured) if g is not None]
            got = torch.autograd.grad([e for e, _ in roots], weight_side, [g for _, g in roots],
                                      retain_graph=True, allow_unused=True)
            for edge, g in zip(weight_side, got):
                if g is not None:
                    edges.append(edge)
                    grads.append(g)
        for edge, g in pending.entries:
            edges.append(edge)
            grads.append(g)
        if not edges:
            return
        if order is None:
            torch.autograd.backward(edges, grads)
            return
        # One backward from every edge would accumulate in the engine's order: the parameters a
        # mixing node reads directly (AccumulateGrad roots, all of the same priority) first, among
        # themselves in the order of its heap. So the parameters go in ``order``'s, one call per
        # gradient bucket: a bucket launches when its last member accumulates, at its call's end.
        calls: list[tuple[object, list[tuple[GradientEdge, torch.Tensor]]]] = []
        for params, pairs in sorted(_by_parameters(edges, grads), key=lambda pp: min(order.key(p) for p in pp[0])):
            buckets = {order.bucket(p) for p in params}
            bucket = buckets.pop() if len(buckets) == 1 else object()  # a group over two buckets: alone
            if calls and calls[-1][0] == bucket:
                calls[-1][1].extend(pairs)
            else:
                calls.append((bucket, list(pairs)))
        for _, pairs in calls:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])


@dataclass(frozen=True)
class WeightOrder:
    """The order W accumulates parameters in: ``key(param)`` ascending (the runtime gives reverse
    parameter order, the buckets' fill order, which the communication check predicts), and
    ``bucket(param)``, the gradient bucket it launches with (None: none)."""

    position: Mapping[int, int]  # id(param) -> sort key
    buckets: Mapping[int, object]  # id(param) -> its bucket

    def key(self, p: torch.Tensor) -> int:
        return self.position.get(id(p), 0)

    def bucket(self, p: torch.Tensor) -> object:
        return self.buckets.get(id(p))


def _by_parameters(edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor]
                   ) -> list[tuple[list[torch.Tensor], list[tuple[GradientEdge, torch.Tensor]]]]:
    """The edges grouped so that no parameter is reached from two groups (it must accumulate
    once per backward: the buckets count accumulations), with the parameters each group reaches."""
    below: list[set[Node]] = []
    for edge in edges:
        seen: set[Node] = set()
        stack = [edge.node]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            stack.extend(c for c, _ in node.next_functions if c is not None)
        below.append({n for n in seen if hasattr(n, "variable")})  # AccumulateGrad nodes
    groups: list[tuple[set[Node], list[int]]] = []
    for k, leaves in enumerate(below):
        joined = [g for g in groups if g[0] & leaves]
        merged = (set(leaves).union(*(g[0] for g in joined)), [i for g in joined for i in g[1]] + [k])
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return [([n.variable for n in leaves], [(edges[i], grads[i]) for i in sorted(members)])
            for leaves, members in groups]


def _one_recompute():
    # Checkpointed regions recompute once per graph task; one group makes W's calls share it.
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    return group() if group is not None else contextlib.nullcontext()
