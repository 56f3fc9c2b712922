"""Transform (apply half): bracket every node that saves an offloaded activation with the
offload ops of :mod:`passes.ir.offload_ops`, as ``offload_policy`` decided.

For each owner with ``node.meta[OFFLOAD].offload`` and each of its savers ``N``::

    before                                      after
    ------                                      -----
    %linear = linear(%layer_norm, %w, %b)       offload_begin([%layer_norm], [%w, %b], False, 4)
                                                %linear = linear(%layer_norm, %w, %b)
                                                offload_end(4)

``offload_begin``'s arguments say which of ``N``'s saved tensors move to host: those on the
storages of the first list (inputs of ``N`` viewing a chosen owner's storage), none of the
second (every other tensor input: weights, unchosen activations), and — third argument — the
storages ``N`` makes itself when ``N`` is a chosen owner (its output, a dropout mask, layer-norm
statistics). The last argument numbers the region. ``N`` itself is unchanged, so values and
gradients are exactly those of the original graph. The graph is edited in place; regions are
counted in ``gm.meta[OFFLOAD_PLAN].regions``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from passes.ir.errors import PassError
from passes.analysis.annotate_memory import observe_saved_tensors as _observe_saved
from passes.ir.meta import OFFLOAD, OFFLOAD_PLAN
from passes.ir.offload_ops import OFFLOAD_BEGIN, OFFLOAD_END, check_offload_regions


def apply_offload(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Insert ``offload_begin``/``offload_end`` around every saver of an offloaded owner's
    storages; returns ``gm`` (edited in place)."""
    plan = gm.meta.get(OFFLOAD_PLAN)
    if plan is None:
        raise PassError("apply_offload: gm.meta['offload_plan'] is missing; run offload_policy first")
    if any(n.target in (OFFLOAD_BEGIN, OFFLOAD_END) for n in gm.graph.nodes):
        raise PassError("apply_offload: the graph already has offload ops; apply it once, to the policy's graph")
    chosen = {n for n in gm.graph.nodes if n.meta.get(OFFLOAD) is not None and n.meta[OFFLOAD].offload}
    run = _observe_saved(gm)

    # saver -> (input nodes to offload, whether its own storages go too)
    plan_by_saver: dict[fx.Node, tuple[dict[fx.Node, None], bool]] = {}
    for st in run.storages.values():
        owner = run.outer(st.owner) if st.owner is not None else None
        if owner not in chosen or not st.kept or st.kind not in ("activation", "internal"):
            continue
        for saver in dict.fromkeys(run.outer(v) for v in st.savers):
            inputs, internals = plan_by_saver.get(saver, ({}, False))
            if owner is saver:
                internals = True
            else:
                via = [a for a in saver.all_input_nodes if st in run.node_storages.get(a, ())]
                if not via:
                    raise PassError(f"apply_offload: {saver.name!r} saves a storage of {st.owner.name!r} that none "
                                    f"of its inputs holds; run offload_policy again on this graph")
                inputs[via[0]] = None
            plan_by_saver[saver] = (inputs, internals)

    graph = gm.graph
    region = 0
    for saver in [n for n in graph.nodes if n in plan_by_saver]:
        offload, internals = plan_by_saver[saver]
        keep = [a for a in saver.all_input_nodes
                if a not in offload and isinstance(run.values.get(a), torch.Tensor)]
        with graph.inserting_before(saver):
            graph.call_function(OFFLOAD_BEGIN, (list(offload), keep, internals, region))
        with graph.inserting_after(saver):
            graph.call_function(OFFLOAD_END, (region,))
        region += 1
    graph.lint()
    gm.recompile()
    check_offload_regions(gm)
    gm.meta[OFFLOAD_PLAN] = dataclasses.replace(plan, regions=region)
    return gm
