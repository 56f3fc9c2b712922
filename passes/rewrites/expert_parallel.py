"""Rewrite: spread each mixture-of-experts block's routed experts over an ep group.

A block captured in the dense form (every expert on every token, the unchosen ones weighted 0:
``out = sum_e combine[..., e] * expert_e(x)``, :mod:`partitioner.zoo.moe`) becomes, on every rank
of a group of ``degree`` ranks:

1. ``x_all = ep_dispatch(x)``: the block input of every token of the group (all-gather on the
   token dim, dim 0), and likewise the combine weights, of which ``ep_local`` keeps this rank's
   experts' columns (it reads the rank from the group);
2. this rank's ``experts / degree`` experts on ``x_all``, weighted and summed as before;
3. ``ep_combine`` of that partial sum: reduce-scatter on the token dim, so each rank gets the sum
   over all experts for its own tokens, exactly what one device computes.

The other experts' matmuls and parameters leave the program. The program is written with ep rank
0's experts in its slots; another ep rank holds experts ``r * experts / degree + j`` there
(:meth:`passes.ir.moe_ops.ExpertParallelPlan.renames`, applied when a rank's program is assembled).
Router, top-k, shared experts and the load-balancing loss stay on each rank's own tokens.

A block captured in the gathered form (Hugging Face's ``batched_mm`` experts: stacked
``[experts, ...]`` weights indexed by the top-k ids, one row per token and choice) becomes:

1. the rows (each token repeated per choice), their expert ids and their combine weights of the
   whole group, gathered on dim 0 (``ep_dispatch``);
2. ``ep_route`` makes each gathered id an index into this rank's rows of the stacked weights
   (which hold experts ``r * experts / degree ..`` only), and the combine weight of every row
   another rank's expert serves is multiplied by 0;
3. the weighted rows are reduce-scattered back (``ep_combine``): each row's one nonzero term
   comes from the rank owning its expert, so the sum is one device's row.

Every rank computes every gathered row (``degree`` times the rows of its own tokens) with its own
experts: exact and static in shape, at ``degree`` times the routed expert FLOPs, which the cost
model charges (a dispatch that sends each row to its expert's rank alone is not built).

Requires the :class:`passes.ir.meta.MoeLayers` of :mod:`passes.analysis.annotate_moe`; provides
``gm.meta[EXPERT_PARALLEL]``.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from passes.analysis.annotate_moe import aliases, backward_cone, op_of, tensor_shape, through_views
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import EXPERT_PARALLEL, MOE, MOE_LAYERS, MoeBlock
from passes.ir.module_attrs import install, remove
from passes.ir.moe_ops import ExpertParallelPlan, ExpertSlots

aten = torch.ops.aten
_ops = torch.ops.partitioner


def apply_expert_parallel(gm: fx.GraphModule, ctx: Any = None, *, degree: int, group: str) -> fx.GraphModule:
    """Rewrite every MoE block of ``gm`` (a stage program) for an ep group of ``degree`` ranks
    named ``group`` (module docstring). Raises :class:`ConfigError` for a model with no MoE block
    or experts that ``degree`` does not divide, :class:`PassError` for a block it cannot rewrite."""
    if not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"apply_expert_parallel: degree={degree!r}; give the ep degree, an integer >= 1")
    layers = gm.meta.get(MOE_LAYERS)
    check_expert_parallel(layers, degree)
    nodes = {n.name: n for n in gm.graph.nodes}
    slots = []
    for block in layers.blocks:
        if block.router not in nodes or nodes[block.router].op != "call_function":
            continue  # a block of another pipeline stage (its router's output may arrive here as an input)
        rewrite = _rewrite_block if block.form == "dense" else _rewrite_stacked
        slots.append(rewrite(gm, nodes, block, degree, group))
    gm.meta[EXPERT_PARALLEL] = ExpertParallelPlan(degree=degree, group=group, blocks=tuple(slots))
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def check_expert_parallel(layers, degree: int) -> None:
    """Raise :class:`ConfigError` unless every MoE block of ``layers`` (:class:`MoeLayers`) can be
    spread over ``degree`` ranks: a model with blocks, ``degree | experts``."""
    if layers is None or not layers.blocks:
        raise ConfigError(f"ep={degree} spreads the experts of mixture-of-experts blocks, and the model has none "
                          f"(no router -> top-k -> weighted experts found by annotate_moe); use ep=1")
    for b in layers.blocks:
        _check_block(b, degree)


def _check_block(b: MoeBlock, degree: int) -> None:
    if b.experts % degree:
        raise ConfigError(f"ep={degree} does not divide the {b.experts} experts of {b.layer}; use an ep dividing "
                          f"{b.experts}")


def _rewrite_block(gm: fx.GraphModule, nodes: dict[str, fx.Node], block: MoeBlock, degree: int,
                   group: str) -> ExpertSlots:
    graph = gm.graph
    router = nodes[block.router]
    x = through_views(router.args[0])
    experts = _experts(nodes, block)
    combines = [_combine(last) for last in experts]
    local = range(block.experts // degree)
    for e, (mul, weight) in enumerate(combines):
        if not _tokens_first(weight, x):
            raise PassError(f"apply_expert_parallel: expert {e}'s combine weight {weight.name} does not hold the "
                            f"tokens of {x.name} on dim 0; the ep rewrite gathers tokens on dim 0")

    # 1. dispatch: the group's tokens, and their combine weights, to this rank's experts
    with graph.inserting_after(x):
        x_all = graph.call_function(_ops.ep_dispatch.default, (x, 0, degree, group))
    for e in local:
        cone, _ = backward_cone(experts[e], {x})
        for n in cone:
            if n is not experts[e] and any(u not in cone for u in n.users):
                raise PassError(f"apply_expert_parallel: node {n.name} of expert {e} of {block.layer} is also read "
                                f"outside the expert; the ep rewrite moves whole experts")
            n.replace_input_with(x, x_all)
    # the combine weights of this rank's experts: its columns of [tokens, experts], read by rank
    # (slot j of every program weighs with column j of them)
    weights = [w for _, w in combines]
    source = _common_slice_source(weights)
    if source is None:
        raise PassError(f"apply_expert_parallel: the combine weights of {block.layer} are not slices of one "
                        f"[..., experts] tensor (combine[..., e:e+1]); the ep rewrite picks each rank's columns of it")
    with graph.inserting_after(source):
        source_all = graph.call_function(_ops.ep_dispatch.default, (source, 0, degree, group))
    with graph.inserting_after(source_all):
        columns = graph.call_function(_ops.ep_local.default, (source_all, degree, group))
    for e in local:
        weights[e].replace_input_with(source, columns)

    # 2. the other experts' terms leave the sum
    for e in range(block.experts):
        if e in local:
            continue
        mul = combines[e][0]
        for user in list(mul.users):
            if op_of(user) is not aten.add or len(user.args) != 2 or not all(isinstance(a, fx.Node) for a in user.args):
                raise PassError(f"apply_expert_parallel: expert {e}'s weighted output {mul.name} feeds {user.name} "
                                f"({user.target}), not a sum of the experts' terms")
            other = user.args[1] if user.args[0] is mul else user.args[0]
            user.replace_all_uses_with(other)
            graph.erase_node(user)
        _erase_dead(graph, mul)

    # 3. combine: the partial sum of this rank's experts, reduce-scattered to the tokens' owners
    end = _sum_end([combines[e][0] for e in local])
    with graph.inserting_after(end):
        y = graph.call_function(_ops.ep_combine.default, (end, 0, degree, group))
    end.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
    for e in range(block.experts):
        if e not in local:
            for name in block.expert_params[e]:
                remove(gm, name)
    return ExpertSlots(router=block.router, experts=block.experts, params=block.expert_params)


def _rewrite_stacked(gm: fx.GraphModule, nodes: dict[str, fx.Node], block: MoeBlock, degree: int,
                     group: str) -> ExpertSlots:
    """The gathered form (module docstring): this rank's rows of the stacked weights, on the
    group's rows, the other experts' rows weighted 0."""
    graph = gm.graph
    last = nodes.get(block.expert_nodes[-1]) if block.expert_nodes else None
    if last is None:
        raise PassError(f"apply_expert_parallel: the experts of {block.layer} are not in this program; a pipeline "
                        f"stage boundary inside an MoE block is not supported")
    mul, weight = _combine(last)
    other = mul.args[1] if mul.args[0] is weight else mul.args[0]
    x = through_views(nodes[block.router].args[0])
    inputs = aliases(x)
    # the stacked weights and the one id tensor that indexes them
    cone, _ = backward_cone(other, inputs)
    picks = [n for n in cone if op_of(n) is aten.index and n.args[0].op == "get_attr"
             and tensor_shape(n.args[0])[:1] == (block.experts,)]
    indices = {tuple(n.args[1]) for n in picks}
    if len(indices) != 1 or len(next(iter(indices))) != 1:
        raise PassError(f"apply_expert_parallel: the experts of {block.layer} are not stacked [experts, ...] "
                        f"weights indexed by one id tensor (W[ids]); the ep rewrite spreads their rows")
    (ids,), = indices
    rows = tensor_shape(ids)[:1]
    # the expert computation proper: from the block input's rows to the weighted output, cut at the ids
    stacked = sorted({p.args[0] for p in picks}, key=lambda n: n.name)
    body, _ = backward_cone(other, inputs | {ids, *stacked})
    entries = sorted({a for n in body for a in n.all_input_nodes if a in inputs}, key=lambda n: n.name)
    strays = sorted({a.name for n in body for a in n.all_input_nodes if a not in body and a not in inputs
                     and a is not ids and a.op != "get_attr" and tensor_shape(a)})
    if strays or any(u in body and u not in picks for u in ids.users):
        raise PassError(f"apply_expert_parallel: the experts of {block.layer} read {strays or ids.name} beside the "
                        f"block input's rows and the stacked weights; the ep rewrite gathers only those rows")
    for a in entries:
        if tensor_shape(a)[:1] != rows:
            raise PassError(f"apply_expert_parallel: {a.name} feeds the experts of {block.layer} without one row "
                            f"per (token, choice) on dim 0 (shape {tensor_shape(a)}, rows {rows}); the ep rewrite "
                            f"gathers the rows of the group")
    if tensor_shape(weight)[:1] != rows:
        raise PassError(f"apply_expert_parallel: the combine weight {weight.name} of {block.layer} has no row per "
                        f"(token, choice) on dim 0")

    # 1. dispatch: the group's rows, their ids and their combine weights
    for a in entries:
        with graph.inserting_after(a):
            gathered = graph.call_function(_ops.ep_dispatch.default, (a, 0, degree, group))
        for n in body:
            n.replace_input_with(a, gathered)
    with graph.inserting_after(ids):
        ids_all = graph.call_function(_ops.ep_dispatch.default, (ids, 0, degree, group))
    with graph.inserting_after(ids_all):
        route = graph.call_function(_ops.ep_route.default, (ids_all, block.experts, degree, group))
    with graph.inserting_after(route):
        local = graph.call_function(operator.getitem, (route, 0))
        owned = graph.call_function(operator.getitem, (route, 1))
    for p in picks:
        p.replace_input_with(ids, local)
    # 2. the rows another rank's expert serves weigh 0 here
    with graph.inserting_before(mul):
        weight_all = graph.call_function(_ops.ep_dispatch.default, (weight, 0, degree, group))
        shape = [-1] + [1] * (len(tensor_shape(weight)) - 1)
        mask = graph.call_function(aten.view.default, (owned, shape))
        masked = graph.call_function(aten.mul.Tensor, (weight_all, mask))
    mul.replace_input_with(weight, masked)
    # 3. combine: each row's sum over the group's ranks, back to its owner
    with graph.inserting_after(mul):
        y = graph.call_function(_ops.ep_combine.default, (mul, 0, degree, group))
    mul.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
    # this rank's rows of each stacked weight (ep rank 0's: the rank program swaps in its own)
    n = block.experts // degree
    for p in stacked:
        full = gm.get_parameter(p.target)
        remove(gm, p.target)
        install(gm, p.target, torch.nn.Parameter(full.detach()[:n].clone(), requires_grad=full.requires_grad))
    return ExpertSlots(router=block.router, experts=block.experts, stacked=tuple(str(p.target) for p in stacked))


def _experts(nodes: dict[str, fx.Node], block: MoeBlock) -> list[fx.Node]:
    """Each routed expert's last matmul (its output, before the combine weight)."""
    last: dict[int, fx.Node] = {}
    for name in block.expert_nodes:
        n = nodes.get(name)
        if n is None:
            raise PassError(f"apply_expert_parallel: expert node {name} of {block.layer} is not in this program; "
                            f"a pipeline stage boundary inside an MoE block is not supported")
        e = n.meta[MOE].expert
        last[e] = n  # expert_nodes are in graph order: the last one of each expert is its output
    missing = sorted(set(range(block.experts)) - set(last))
    if missing:
        raise PassError(f"apply_expert_parallel: experts {missing} of {block.layer} have no matmul in this program")
    return [last[e] for e in range(block.experts)]


def _combine(last: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(the ``mul`` that weighs expert output ``last``, its weight operand)."""
    node = last
    while True:
        muls = [u for u in node.users if op_of(u) is aten.mul]
        if len(muls) == 1:
            mul = muls[0]
            weight = mul.args[1] if mul.args[0] is node else mul.args[0]
            if isinstance(weight, fx.Node):
                return mul, weight
        views = [u for u in node.users if through_views(u) is node and u is not node]
        if len(node.users) != 1 or not views:
            raise PassError(f"apply_expert_parallel: the output {last.name} of an expert is not weighted by one "
                            f"combine weight (a mul); the ep rewrite needs the dense form sum_e w_e * expert_e(x)")
        node = views[0]


def _tokens_first(a: fx.Node, b: fx.Node) -> bool:
    sa, sb = tensor_shape(a), tensor_shape(b)
    return bool(sa) and bool(sb) and str(sa[0]) == str(sb[0])


def _common_slice_source(weights: list[fx.Node]) -> fx.Node | None:
    """The one tensor every combine weight slices along its last dim (``combine[..., e:e+1]``), if so."""
    sources = set()
    for w in weights:
        if op_of(w) is not aten.slice or not isinstance(w.args[0], fx.Node):
            return None
        dim = w.args[1] if len(w.args) > 1 else 0
        rank = len(tensor_shape(w.args[0]))
        if not rank or dim not in (-1, rank - 1):
            return None
        sources.add(w.args[0])
    return sources.pop() if len(sources) == 1 else None


def _sum_end(terms: list[fx.Node]) -> fx.Node:
    """The node that sums ``terms`` (the chain of adds over them), or the one term."""
    chain = set(terms)
    grew = True
    while grew:
        grew = False
        for n in list(chain):
            for u in n.users:
                if u not in chain and op_of(u) is aten.add and all(a in chain for a in u.args):
                    chain.add(u)
                    grew = True
    ends = [n for n in chain if not any(u in chain for u in n.users)]
    if len(ends) != 1:
        raise PassError(f"apply_expert_parallel: the experts' weighted outputs {[t.name for t in terms]} are not "
                        f"summed into one tensor")
    return ends[0]


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and every input left without users (what fed only it)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op in ("placeholder", "output"):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(inputs)

