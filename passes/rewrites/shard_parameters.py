"""Transform: ZeRO-3. Every parameter of a stage program becomes a flat data-parallel shard,
gathered per block right before the block reads it (:mod:`passes.ir.zero3_ops`).

Requires: a stage program (after the tp rewrite and the checkpoint outlining, so that a
checkpointed region gathers its block's parameters itself and its recompute gathers again).
Provides: ``gm.meta[ZERO3_PLAN]`` (:class:`Zero3Plan`).

::

    before                                        after
    ------                                        -----
    %w = get_attr[blocks.0.fc.weight]  [64, 32]   %w = get_attr[blocks.0.fc.weight]  [1024]  (shard)
    %b = get_attr[blocks.0.fc.bias]    [64]       %b = get_attr[blocks.0.fc.bias]    [32]
                                                  %g = zero3_gather([%w, %b], [[64, 32], [64]], 2, "dp", 0, 1)
                                                  %w_full = getitem(%g, 0)
                                                  %b_full = getitem(%g, 1)
    %y = linear(%x, %w, %b)                       %y = linear(%x, %w_full, %b_full)

Parameters keep their names (checkpoints, tied-weight syncs and weight-decay groups still find
them) and their ``Parameter`` objects change: each is a 1-D tensor of
``ceil(numel / degree)`` elements. The program is the same for every dp rank; its shards hold
dp rank 0's values, and ``gm.zero3_sources`` (a plain attribute, not a buffer) keeps each
parameter's full tensor, from which the runtime takes its own rank's shard once
(:func:`passes.ir.zero3_ops.shard_of`) and drops the rest.

Which parameters gather together: those whose first reader in the graph belongs to the same
layer-chain block (``node.meta[BLOCK]``), one gather per (graph, block), placed before that
block's first reader. Sites are numbered in the order the forward runs them (a region's sites
where its checkpoint call is). A site is re-gathered in backward when it is inside a
checkpointed region (the recompute runs it) or when an op outside saved one of its tensors
(found by the shared fake forward run, :func:`passes.analysis.saved_tensors.observe_saved_tensors`).
"""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx, nn

from passes.ir.errors import PassError
from passes.ir.meta import BLOCK, SHAPE, ShapeMeta, TensorMeta
from passes.ir.zero3_ops import ZERO3_GATHER, GatherSite, ShardedParam, Zero3Plan, shard_numel, shard_of
from passes.ir.meta import ZERO3_PLAN
from passes.analysis.saved_tensors import observe_saved_tensors


def shard_parameters(gm: fx.GraphModule, ctx: Any = None, *, degree: int, group: str, stage: int,
                     reshard_after_forward: bool = True) -> fx.GraphModule:
    """Shard every parameter of ``gm`` over ``degree`` dp ranks and gather each block's
    parameters before its first reader; returns ``gm`` (edited in place).
    ``reshard_after_forward``: recorded in the plan for the runtime (``False``: a re-gathered
    site's parameters are kept from the forward gather to the reduce-scatter)."""
    if not isinstance(degree, int) or degree < 1:
        raise PassError(f"shard_parameters: degree must be a positive int (the dp degree), got {degree!r}")
    if ZERO3_PLAN in gm.meta:
        raise PassError("shard_parameters: the program is already sharded; apply it once")
    regions = {name: child for name, child in gm.named_children() if isinstance(child, fx.GraphModule)}
    params = _shard(gm, _top_level_names(gm, regions), degree)  # by id of the new shard Parameter
    names = {k: r.name for k, r in params.items()}

    # each gather node -> (its graph: "" or the region's name, its block, the names it gathers)
    gathers: dict[fx.Node, tuple[str, int, tuple[str, ...]]] = {}
    for graph_name, graph_module in [("", gm), *regions.items()]:
        for block, members in _groups(graph_module, names).items():
            node = _insert_gather(graph_module, members, params, degree, group, stage)
            gathers[node] = (graph_name, block, tuple(names[id(_attr(graph_module, m.target))] for m in members))

    # number the sites in forward order: the stage graph's nodes, a region's where it is called
    order: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node in gathers:
            order.append(node)
        elif node.op == "call_function" and node.target is torch.utils.checkpoint.checkpoint:
            sub = node.args[0]
            region = regions.get(sub.target) if isinstance(sub, fx.Node) and sub.op == "get_attr" else None
            if region is not None:
                order += [n for n in region.graph.nodes if n in gathers]
    for k, node in enumerate(order):
        node.update_arg(5, k)
    for graph_module in [*regions.values(), gm]:
        graph_module.graph.lint()
        graph_module.recompile()

    saved = _saved_gathers(gm, [n for n in order if gathers[n][0] == ""])
    sites = []
    for k, node in enumerate(order):
        graph_name, block, members = gathers[node]
        savers = saved.get(node, ())
        sites.append(GatherSite(stage=stage, site=k, graph=graph_name, block=block, params=members,
                                regather=bool(graph_name) or bool(savers), savers=savers))
    gm.meta[ZERO3_PLAN] = Zero3Plan(degree=degree, group=group, params=tuple(params.values()), sites=tuple(sites),
                                    reshard_after_forward=bool(reshard_after_forward))
    return gm


def _top_level_names(gm: fx.GraphModule, regions: dict[str, fx.GraphModule]) -> dict[int, str]:
    """Each parameter object's name in the stage program (not its re-listing in a region)."""
    names: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        if name.split(".", 1)[0] not in regions:
            names.setdefault(id(p), name)
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            raise PassError(f"shard_parameters: parameter {name!r} is held by a checkpointed region only; the "
                            f"stage program must hold every parameter under its own name")
    return names


def _shard(gm: fx.GraphModule, names: dict[int, str], degree: int) -> dict[int, ShardedParam]:
    """Replace every parameter (in the stage module and the regions that re-list it) by its
    rank-0 shard; keep the full tensors in ``gm.zero3_sources``. Returns the record of each
    parameter by the id of its new (shard) ``Parameter``."""
    new: dict[int, nn.Parameter] = {}
    records: dict[int, ShardedParam] = {}
    sources: dict[str, torch.Tensor] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in new:
            continue
        canonical = names[id(p)]
        new[id(p)] = nn.Parameter(shard_of(p, degree, 0), requires_grad=p.requires_grad)
        sources[canonical] = p.detach()
        records[id(new[id(p)])] = ShardedParam(name=canonical, shape=tuple(p.shape), numel=p.numel(),
                                               shard_numel=shard_numel(p.numel(), degree), dtype=p.dtype)
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        module.register_parameter(leaf, new[id(p)])
    gm.zero3_sources = sources
    return records


def _groups(gm: fx.GraphModule, names: dict[int, str]) -> dict[int, list[fx.Node]]:
    """The parameter ``get_attr`` nodes of ``gm`` that have readers, by the layer-chain block of
    their first reader, blocks in the order of their first reader."""
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    out: dict[int, list[fx.Node]] = {}
    firsts: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        value = _attr(gm, node.target)
        if not isinstance(value, nn.Parameter) or id(value) not in names:
            continue
        first = min(node.users, key=position.__getitem__)
        meta = first.meta.get(BLOCK)
        block = meta.index if meta is not None else 0
        out.setdefault(block, []).append(node)
        firsts[block] = min(firsts.get(block, len(position)), position[first])
    return {b: out[b] for b in sorted(out, key=firsts.__getitem__)}


def _attr(gm: fx.GraphModule, target: str):
    owner, _, leaf = target.rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, leaf)
    except AttributeError:
        return None


def _insert_gather(gm: fx.GraphModule, members: list[fx.Node], params: dict[int, ShardedParam], degree: int,
                   group: str, stage: int) -> fx.Node:
    """One gather of ``members`` before their first reader; every reader reads the gathered tensor."""
    graph = gm.graph
    position = {n: k for k, n in enumerate(graph.nodes)}
    first = min((u for m in members for u in m.users), key=position.__getitem__)
    records = [params[id(_attr(gm, m.target))] for m in members]
    users = {m: list(m.users) for m in members}
    for m in members:
        if position[m] > position[first]:
            first.prepend(m)  # a get_attr has no inputs: it can move up to the gather
    with graph.inserting_before(first):
        gather = graph.call_function(ZERO3_GATHER, (list(members), [list(r.shape) for r in records], degree, group,
                                                    stage, -1))
        outs = [graph.call_function(operator.getitem, (gather, k)) for k in range(len(members))]
    # shape meta of the new nodes (the re-analysis does not reach inside checkpointed regions)
    full = [TensorMeta(shape=tuple(sympy.Integer(d) for d in r.shape), dtype=r.dtype, requires_grad=True)
            for r in records]
    gather.meta[SHAPE] = ShapeMeta(tensors=tuple(full))
    for m, out, meta, r in zip(members, outs, full, records):
        out.meta[SHAPE] = ShapeMeta(tensors=(meta,))
        m.meta[SHAPE] = ShapeMeta(tensors=(TensorMeta(shape=(sympy.Integer(r.shard_numel),), dtype=r.dtype,
                                                      requires_grad=True),))
        for user in users[m]:
            user.replace_input_with(m, out)
    if BLOCK in first.meta:  # the gather and its outputs belong to the block they feed
        for node in (gather, *outs):
            node.meta[BLOCK] = first.meta[BLOCK]
    return gather


def _saved_gathers(gm: fx.GraphModule, gathers: list[fx.Node]) -> dict[fx.Node, tuple[str, ...]]:
    """For each stage-graph gather some of whose tensors autograd saves for backward: the nodes
    that save them, in graph order."""
    if not gathers:
        return {}
    run = observe_saved_tensors(gm)
    wanted = set(gathers)
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    out: dict[fx.Node, set[fx.Node]] = {}
    for st in run.storages.values():
        owner = run.outer(st.owner) if st.owner is not None else None
        if owner in wanted and st.kept:
            out.setdefault(owner, set()).update(run.outer(v) for v in st.savers)
    return {g: tuple(n.name for n in sorted(v, key=position.__getitem__)) for g, v in out.items()}
