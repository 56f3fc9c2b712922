"""Transform: prepare a stage program for a split backward (zero-bubble schedules ``zb1p``, ``zbv``).

The runtime splits each backward into an input half (I) and a weight half (W) on the autograd
graph (:mod:`runtime.exec.split_backward`). Two things it cannot see there are made explicit here:

* **Where the data enters.** A stage whose inputs carry no gradient (the first stage reads token
  ids) has no input gradient to compute, so I would do nothing and W everything. The first node
  on each path where a parameter meets the data (``embedding(table, ids)``) gets a
  ``partitioner::split_point`` after it; its autograd node is a target of I, so I runs the
  activation gradients down to it and W the weight gradients from it::

      before                                   after
      %emb = embedding(%wte, %input_ids)       %emb = embedding(%wte, %input_ids)
      %h = add(%emb, %pos)                     %split_point = split_point(%emb)
                                               %h = add(%split_point, %pos)

* **One autograd node per parameter use.** W walks from each op that reads a parameter to that
  parameter; if two ops read the same tensor directly (a parameter read twice, in one graph or in
  a checkpointed region and its parent), the later op's walk would reach it through the activation
  side too. Each such use gets its own ``aten.alias`` (a view: no copy, no memory), placed right
  after the parameter's node so offload brackets stay adjacent.

Values and gradients are unchanged (the marker is an identity, an alias is a view).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes.ir.meta import SHAPE
from passes.ir.ops import ops
from passes.ir.parameter_nodes import parameter_of, parameter_only

_ALIAS = torch.ops.aten.alias.default
_LINEAR = torch.ops.aten.linear.default


def split_backward(gm: fx.GraphModule, ctx: Any = None, *, grad_inputs: tuple[str, ...] = ()) -> fx.GraphModule:
    """Insert split points after the data's entry nodes and give every shared parameter use its
    own alias, in ``gm`` and its checkpointed regions; edits in place and returns ``gm``.
    ``grad_inputs``: names of the placeholders that carry a gradient (received activations)."""
    graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    trainable = {id(p) for p in gm.parameters() if p.requires_grad}
    uses: dict[int, int] = {}
    for g in graphs:
        for node in g.graph.nodes:
            p = parameter_of(g, node)
            if p is not None and id(p) in trainable:
                uses[id(p)] = uses.get(id(p), 0) + len(node.users)
    for g in graphs:
        _alias_shared(g, {k for k, n in uses.items() if n > 1}, trainable)
    _mark_entries(gm, trainable, set(grad_inputs))
    for g in graphs:
        g.graph.lint()
        g.recompile()
    return gm


def _alias_shared(g: fx.GraphModule, shared: set[int], trainable: set[int]) -> None:
    """Every user of a shared parameter, and of a parameter-only node read by several ops, reads
    its own alias."""
    param_only = parameter_only(g, trainable)
    for node in list(g.graph.nodes):
        p = parameter_of(g, node)
        many = (p is not None and id(p) in shared) or (node.op == "call_function" and param_only.get(node)
                                                        and len(node.users) > 1)
        if not many:
            continue
        anchor = node
        for user in list(node.users):
            with g.graph.inserting_after(anchor):
                alias = g.graph.call_function(_ALIAS, (node,))
            alias.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
            user.replace_input_with(node, alias)
            anchor = alias


def _mark_entries(gm: fx.GraphModule, trainable: set[int], grad_inputs: set[str]) -> None:
    param_only = parameter_only(gm, trainable)
    data: dict[fx.Node, bool] = {}
    grad_on_data: dict[fx.Node, bool] = {}  # a gradient flows along the data path through it
    entries = []
    for node in gm.graph.nodes:
        ins = node.all_input_nodes
        if node.op == "placeholder":
            data[node] = True
            grad_on_data[node] = node.name in grad_inputs or str(node.target) in grad_inputs
            continue
        data[node] = any(data.get(a, False) for a in ins) and not param_only.get(node, False)
        grad_on_data[node] = any(grad_on_data.get(a, False) for a in ins)
        if (node.op == "call_function" and data[node] and not grad_on_data[node]
                and any(param_only.get(a, False) for a in ins) and _is_float_tensor(node)):
            entries.append(node)
            grad_on_data[node] = True
    for node in entries:
        with gm.graph.inserting_after(node):
            marker = gm.graph.call_function(ops.split_point.default, (node,))
        marker.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", SHAPE)})
        node.replace_all_uses_with(marker, delete_user_cb=lambda user: user is not marker)


def _is_float_tensor(node: fx.Node) -> bool:
    # a stage program's nodes carry the analysis' shapes (export's "val" only in a fresh capture)
    shape = node.meta.get(SHAPE)
    if shape is not None:
        return bool(shape.tensors) and shape.tensors[0].dtype.is_floating_point
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def held_gradient_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes whose output gradient a split backward holds from I to W, per micro-batch: every
    node that reads a parameter and the data (what I captures at each mixing node,
    :mod:`runtime.exec.split_backward`), in ``gm`` and its checkpointed regions."""
    out = []
    for g in (m for m in gm.modules() if isinstance(m, fx.GraphModule)):
        trainable = {id(p) for p in g.parameters() if p.requires_grad}
        param_only = parameter_only(g, trainable)
        for node in g.graph.nodes:
            if node.op != "call_function" or param_only.get(node, False) or node.target == _ALIAS:
                continue
            ins = node.all_input_nodes
            reads_param = any(param_only.get(a, False) or (a.op == "call_function" and a.target == _ALIAS)
                              for a in ins)
            shape = node.meta.get(SHAPE)
            if reads_param and shape is not None and shape.tensors:
                out.append(node)
    return out


def held_gradient_meta(gm: fx.GraphModule) -> list:
    """The TensorMetas of the gradients a split backward holds from I to W, per micro-batch
    (:func:`held_gradient_nodes`' first outputs)."""
    return [node.meta[SHAPE].tensors[0] for node in held_gradient_nodes(gm)]


def weight_half_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes of ``gm``'s own graph whose autograd nodes a split backward keeps from I
    to W: those that read a parameter and the data, the split points, and every node they read
    from, transitively (W walks down from them). A checkpointed region's call counts when a node
    inside reads a parameter. What only the loss side reads (the cross entropy's saved
    log-softmax on a last stage) is released by I, once the stage lets go of its outputs."""
    held = {id(n) for n in held_gradient_nodes(gm)}
    regions = {name for name, m in gm.named_modules() if name and isinstance(m, fx.GraphModule)
               and any(id(n) in held for n in m.graph.nodes)}
    roots = [n for n in gm.graph.nodes
             if id(n) in held or (n.op == "call_function" and n.target == ops.split_point.default)
             or (n.op == "call_module" and n.target in regions)]
    out: set[str] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.name in out:
            continue
        out.add(node.name)
        stack.extend(node.all_input_nodes)
    return out


def copied_weight_gradients(gm: fx.GraphModule) -> set[str]:
    """Qualified names (in ``gm``) of the parameters whose weight-half gradient ``.grad`` copies
    on a step's first accumulation: those an op of :func:`held_gradient_nodes` reads directly.
    W hands that gradient to the parameter's AccumulateGrad while still holding it, so it cannot
    be taken over; a gradient that comes through another node first (the ``t`` before a matmul,
    an ``alias``; ``aten.linear``'s weight, which autograd reads through its ``t``) is a new
    tensor, which ``.grad`` becomes without a copy."""
    names = {id(p): n for n, p in gm.named_parameters()}
    out: set[str] = set()
    for node in held_gradient_nodes(gm):
        if any(u.op == "call_function" and u.target == ops.split_point.default for u in node.users):
            continue  # below a split point W runs an ordinary backward from the marker's gradient
        g = node.graph.owning_module
        for k, a in enumerate(node.args):
            if not isinstance(a, fx.Node) or (node.target == _LINEAR and k == 1):
                continue
            p = parameter_of(g, a)
            if p is not None and id(p) in names:
                out.add(names[id(p)])
    return out
