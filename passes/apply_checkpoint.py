"""Transform (apply half): rewrite the regions ``checkpoint_policy`` marked for recompute.

For each region with ``recompute=True`` in ``gm.meta[CHECKPOINT_PLAN]``::

    before                                   after
    ------                                   -----
    %ln   = layer_norm(%x, ..., %w, %b)      %checkpoint_blocks_0 = get_attr[checkpoint_blocks_0]
    ...   (the region's nodes)               %ckpt = checkpoint(%checkpoint_blocks_0, %x,
    %out  = add(%x1, %d)                                        use_reentrant=False)
    %next = layer_norm(%out, ...)            %next = layer_norm(%ckpt, ...)

The region's nodes move into an ``fx.GraphModule`` submodule (its inputs become placeholders;
its parameters are ``get_attr`` nodes on the same ``Parameter`` objects, so gradients land on
the model's parameters and ``gm.parameters()`` lists each once). The parent calls it through
``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``, whose default
``preserve_rng_state=True`` replays dropout's random numbers exactly in the recompute. The
graph is edited in place and never re-traced (re-tracing drops the checkpoint call), and
``torch.fx.wrap`` is not used on checkpoint (it breaks later ``symbolic_trace`` calls).

A region with several outputs returns a tuple, read back with ``getitem``. Parameter
``get_attr`` nodes left without users in the parent are removed. Each region's ``submodule``
is filled in the plan; its ``recompute_flops`` and ``bytes_saved`` stay as the policy computed.
Note that ``state_dict()`` then also lists each moved parameter under its submodule's name.
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch.utils.checkpoint
from torch import fx

from passes.ir.errors import PassError
from passes.checkpoint_policy import region_io
from passes.ir.meta import CHECKPOINT, CHECKPOINT_PLAN, CheckpointMeta, CheckpointRegion


def apply_checkpoint(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Move every region the plan recomputes into a submodule called through
    ``torch.utils.checkpoint.checkpoint``; returns ``gm`` (edited in place)."""
    plan = gm.meta.get(CHECKPOINT_PLAN)
    if plan is None:
        raise PassError("apply_checkpoint: gm.meta['checkpoint_plan'] is missing; run checkpoint_policy first")
    by_name = {n.name: n for n in gm.graph.nodes}
    regions = []
    for region in plan.regions:
        if not region.recompute:
            regions.append(region)
            continue
        missing = [n for n in region.nodes if n not in by_name]
        if missing:
            raise PassError(f"apply_checkpoint: region {region.name!r} names node {missing[0]!r} that is not in "
                            f"the graph; run checkpoint_policy again on this graph")
        name = _free_name(gm, "checkpoint_" + re.sub(r"\W+", "_", region.name).strip("_"))
        _outline(gm, [by_name[n] for n in region.nodes], name, region, plan.policy)
        regions.append(dataclasses.replace(region, submodule=name))
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)  # parameters now read only inside a submodule
    gm.graph.lint()
    gm.recompile()
    gm.meta[CHECKPOINT_PLAN] = dataclasses.replace(plan, regions=tuple(regions))
    return gm


def extract_region(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[fx.GraphModule, tuple[fx.Node, ...],
                                                                       tuple[fx.Node, ...]]:
    """A GraphModule computing ``nodes`` from their inputs, and (inputs, outputs) in ``gm``."""
    inputs, outputs = region_io(nodes)
    if not outputs:
        raise PassError(f"apply_checkpoint: region starting at {nodes[0].name!r} has no output used outside it")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for inp in inputs:
        env[inp] = graph.placeholder(inp.name)
        env[inp].meta = dict(inp.meta)
    for node in nodes:
        for src in node.all_input_nodes:
            if src.op == "get_attr" and src not in env:
                env[src] = graph.get_attr(src.target)
                env[src].meta = dict(src.meta)
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    # GraphModule(root, graph) sets each get_attr target on the new module to root's own object,
    # so the submodule shares the model's Parameters.
    sub = fx.GraphModule(gm, graph, class_name="CheckpointRegion")
    return sub, inputs, outputs


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str, region: CheckpointRegion, policy: str) -> None:
    sub, inputs, outputs = extract_region(gm, nodes)
    gm.add_submodule(name, sub)
    inside = set(nodes)
    tag = CheckpointMeta(region=region.index, recompute=True, policy=policy)
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        attr = graph.get_attr(name)
        call = graph.call_function(torch.utils.checkpoint.checkpoint, (attr, *inputs), {"use_reentrant": False})
        call.meta[CHECKPOINT] = tag
        if len(outputs) == 1:
            results = [call]
        else:
            results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
        for out, res in zip(outputs, results):
            # the replacement carries the value's facts (shape, export val) for later passes
            res.meta.update({k: v for k, v in out.meta.items() if k != CHECKPOINT})
            res.meta[CHECKPOINT] = tag
            out.replace_all_uses_with(res, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        graph.erase_node(node)


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name
