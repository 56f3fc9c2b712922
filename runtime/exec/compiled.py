"""Compiled stage programs: what a plan with ``compile=true`` runs in place of each stage's fx module.

Each stage program is compiled with ``torch.compile`` (inductor) the first time it runs, one
compiled graph per input shape (``dynamic=False``: a rank's micro-batch is fixed, so shapes are
specialised as a training step sees them; an evaluation batch of another size compiles again).
Two choices keep a compiled plan training like the uncompiled one:

* ``fallback_random``: random ops (dropout) draw from torch's generator as eager does, not from
  inductor's own, so a compiled rank draws the same masks as its uncompiled twin and one device;
* the module keeps its parameters: the compiled callable runs the same ``nn.Parameter`` objects,
  so gradient buckets, ZeRO shards and the optimizer see the tensors they were built on.

The collectives inside a program (tensor-parallel, ZeRO-3 gathers) are custom ops with fake
implementations; the compiled graph calls them as opaque kernels in program order.

**Split-backward schedules** (``zb1p``, ``zbv``) run a stage's backward in two halves, found on
the autograd graph op by op (:mod:`runtime.exec.split_backward`): the input half runs the
activation side of every op that reads a parameter, the weight half the parameter side later. A
whole stage compiled is one autograd node, which cannot be run apart, so there
:func:`compile_segments` compiles the *weight-free segments* instead: each run of consecutive
ops that reads no parameter (attention, activations, dropout, residual adds, the loss) becomes
one compiled graph, and the ops that read a parameter (linears, norms, embeddings, and whatever
derives a tensor from a parameter) stay eager, each its own autograd node, where the split finds
them. The segments hold no parameter; their backward is all input half.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx, nn

from passes.ir.ops import ops
from passes.ir.parameter_nodes import parameter_only

INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}
"""Inductor settings of every compiled stage program (see the module docstring)."""

SEGMENT_PREFIX = "compiled_segment_"
"""Name of each compiled weight-free segment in a segmented stage program (a submodule)."""

# Ops that only reshape or read sizes: a segment of these alone is not worth a compiled graph.
_NO_COMPUTE = {operator.getitem, torch.ops.aten.sym_size.int, torch.ops.aten.view.default,
               torch.ops.aten.reshape.default, torch.ops.aten.transpose.int, torch.ops.aten.t.default,
               torch.ops.aten.permute.default, torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
               torch.ops.aten.squeeze.dim, torch.ops.aten.flatten.using_ints, torch.ops.aten.split.Tensor,
               torch.ops.aten.slice.Tensor, torch.ops.aten.select.int}


def compile_stage(module: fx.GraphModule) -> Callable[..., Any]:
    """The callable that runs ``module`` compiled (lazily, at its first call)."""
    return torch.compile(module, backend="inductor", dynamic=False, options=dict(INDUCTOR_OPTIONS))


def compile_segments(module: fx.GraphModule) -> Callable[..., Any]:
    """The callable that runs ``module`` with its weight-free segments compiled (see the module
    docstring), made at its first call from the module as it is then (ZeRO-3 and the
    runtime's other set-up have changed it by then)."""
    made: list[fx.GraphModule] = []

    def run(*args: Any) -> Any:
        if not made:
            made.append(segmented(module, compile_segment=lambda gm: torch.compile(
                gm, backend="inductor", dynamic=False, options=dict(INDUCTOR_OPTIONS))))
        return made[0](*args)

    return run


def weight_free_segments(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Runs of consecutive ops of ``gm``'s graph (in its order) that read no parameter, each with
    at least one op that computes (not only views and sizes).

    Out of every run: the parameter side (:func:`passes.ir.parameter_nodes.parameter_only`: a
    parameter's views, casts, aliases, ZeRO-3 gathers), the ops that read it (where the split
    backward finds the weight side), calls of submodules (checkpointed regions), the split-point
    markers and size reads (their ints stay eager). ``get_attr`` nodes depend on nothing and do
    not end a run. A run of consecutive nodes is convex (no path leaves it and comes back), so
    each can be one call."""
    param_only = parameter_only(gm)
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if (node.op == "call_function" and not param_only[node]
                and not any(param_only.get(i, False) for i in node.all_input_nodes)
                and node.target not in (ops.split_point.default, torch.ops.aten.sym_size.int)):
            current.append(node)
            continue
        runs.append(current)
        current = []
    runs.append(current)
    return [run for run in runs if any(n.target not in _NO_COMPUTE for n in run)]


def segmented(module: fx.GraphModule, *, compile_segment: Callable[[fx.GraphModule], nn.Module]) -> fx.GraphModule:
    """A copy of ``module`` whose :func:`weight_free_segments` are each one call of a submodule
    (``compiled_segment_<k>``: ``compile_segment`` of that segment's graph); it shares
    ``module``'s parameters, buffers and submodules."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(module.graph, env))
    out = fx.GraphModule(module, graph)
    # attribute reads first, so a segment's call (placed at its first op) sees every buffer it reads
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for n in [n for n in graph.nodes if n.op == "get_attr"]:
        anchor.append(n)
        anchor = n
    for k, run in enumerate(weight_free_segments(out)):
        members = set(run)
        inputs = list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in members))
        outputs = [n for n in run if any(u not in members for u in n.users)]
        sub = fx.Graph()
        inner: dict[fx.Node, fx.Node] = {i: sub.placeholder(f"in_{j}") for j, i in enumerate(inputs)}
        for n in run:
            inner[n] = sub.node_copy(n, lambda x: inner[x])
        sub.output(tuple(inner[n] for n in outputs))
        name = f"{SEGMENT_PREFIX}{k}"
        out.add_submodule(name, compile_segment(fx.GraphModule(nn.Module(), sub)))
        with out.graph.inserting_before(run[0]):
            call = out.graph.call_module(name, tuple(inputs))
            results = [out.graph.call_function(operator.getitem, (call, j)) for j in range(len(outputs))]
        for n, r in zip(outputs, results):
            n.replace_all_uses_with(r)
        for n in reversed(run):
            out.graph.erase_node(n)
    out.graph.lint()
    out.recompile()
    return out
