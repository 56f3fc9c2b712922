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

Under the ``dag`` policy the call also gets ``context_fn=SelectiveRecompute.CONTEXTS``: torch's
selective activation checkpointing, with a policy that keeps (``MUST_SAVE``) the outputs of the
ops of the region's nodes that ``node.meta[REMAT]`` marks cached (ops whose outputs alias an
input, in-place ops and random ops excepted) and recomputes every other op. The running node is
found from the region's generated code (its line), so the policy needs no state of its own and
survives copies of the module. Random ops always run again under the restored RNG state, so
dropout replays exactly; cached ops are not run again at all.

A region with several outputs returns a tuple, read back with ``getitem``. Parameter
``get_attr`` nodes left without users in the parent are removed. Each region's ``submodule``
is filled in the plan; its ``recompute_flops`` and ``bytes_saved`` stay as the policy computed.
Note that ``state_dict()`` then also lists each moved parameter under its submodule's name.
"""
from __future__ import annotations

import dataclasses
import enum
import operator
import re
import sys
import weakref
from typing import Any

import torch.utils.checkpoint
from torch import fx

from passes.ir.errors import PassError
from passes.policies.checkpoint_policy import region_io
from passes.ir.meta import CHECKPOINT, CHECKPOINT_PLAN, REMAT, CheckpointMeta, CheckpointRegion
from passes.analysis.saved_tensors import tensor_leaves
from passes.ir.graph_modules import graph_module


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
    sub = graph_module(gm, graph, class_name="CheckpointRegion")
    return sub, inputs, outputs


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str, region: CheckpointRegion, policy: str) -> None:
    sub, inputs, outputs = extract_region(gm, nodes)
    gm.add_submodule(name, sub)
    inside = set(nodes)
    tag = CheckpointMeta(region=region.index, recompute=True, policy=policy)
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        attr = graph.get_attr(name)
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if policy == "dag":
            kwargs["context_fn"] = SelectiveRecompute.CONTEXTS
        call = graph.call_function(torch.utils.checkpoint.checkpoint, (attr, *inputs), kwargs)
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


# ---------------------------------------------------------------------------------------------
# Selective recompute (the dag policy): which op outputs a region keeps.

class SelectiveRecompute(enum.Enum):
    """``SelectiveRecompute.CONTEXTS`` is the ``context_fn`` of a ``dag`` region's checkpoint call:
    calling it gives torch's selective checkpoint contexts under :func:`op_policy`. An enum
    member, because fx writes enum members into generated code by name (a function it cannot)."""

    CONTEXTS = "contexts"

    def __call__(self):
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(_sac_policy)


def op_policy(node: fx.Node | None, op: Any, args: tuple, out: Any) -> bool:
    """Whether the op ``op`` run by ``node`` keeps its output ``out`` for backward: ``node`` is
    cached (``node.meta[REMAT]``), the op writes nothing in place, draws no random numbers and
    its outputs are new storages (a view of an input would keep the input alive)."""
    meta = node.meta.get(REMAT) if node is not None else None
    if meta is None or not meta.cached:
        return False
    schema = getattr(op, "_schema", None)
    if schema is None or schema.is_mutable or torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return False
    inputs = {t.untyped_storage()._cdata for t in tensor_leaves(args)}
    outs = tensor_leaves(out)
    return bool(outs) and not any(t.untyped_storage()._cdata in inputs for t in outs)


def _sac_policy(ctx, op, *args, **kwargs):
    keep = op_policy(running_node(), op, args, ctx.op_output)
    return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if keep \
        else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


# module -> (its generated forward's code, line -> node), rebuilt when the code changes
_LINES: "weakref.WeakKeyDictionary[fx.GraphModule, tuple[Any, dict[int, fx.Node]]]" = weakref.WeakKeyDictionary()


def running_node() -> fx.Node | None:
    """The node of the innermost ``fx.GraphModule`` forward on the Python stack, from the line
    its generated code is at (``GraphModule._lineno_map``); None outside any."""
    frame = sys._getframe(1)
    while frame is not None:
        gm = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(gm, fx.GraphModule) and frame.f_code is type(gm).forward.__code__:
            code, lines = _LINES.get(gm, (None, {}))
            if code is not frame.f_code:  # first call, or the module was recompiled
                nodes = list(gm.graph.nodes)
                lines = {line: nodes[i] for line, i in (gm._lineno_map or {}).items() if i is not None}
                _LINES[gm] = (frame.f_code, lines)
            return lines.get(frame.f_lineno - gm._prologue_start)
        frame = frame.f_back
    return None
