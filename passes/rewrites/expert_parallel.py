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

Requires the :class:`passes.ir.meta.MoeLayers` of :mod:`passes.analysis.annotate_moe`; provides
``gm.meta[EXPERT_PARALLEL]``. A block captured in the gathered form (Hugging Face's stacked
expert weights indexed by the top-k ids) is refused: its experts are one parameter, not ``E``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes.analysis.annotate_moe import backward_cone, op_of, tensor_shape, through_views
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import EXPERT_PARALLEL, MOE, MOE_LAYERS, MoeBlock
from passes.ir.module_attrs import remove
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
        if block.router not in nodes:
            continue  # a block of another pipeline stage
        slots.append(_rewrite_block(gm, nodes, block, degree, group))
    gm.meta[EXPERT_PARALLEL] = ExpertParallelPlan(degree=degree, group=group, blocks=tuple(slots))
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def check_expert_parallel(layers, degree: int) -> None:
    """Raise :class:`ConfigError` unless every MoE block of ``layers`` (:class:`MoeLayers`) can be
    spread over ``degree`` ranks: a model with blocks, in the dense form, ``degree | experts``."""
    if layers is None or not layers.blocks:
        raise ConfigError(f"ep={degree} spreads the experts of mixture-of-experts blocks, and the model has none "
                          f"(no router -> top-k -> weighted experts found by annotate_moe); use ep=1")
    for b in layers.blocks:
        _check_block(b, degree)


def _check_block(b: MoeBlock, degree: int) -> None:
    if b.form != "dense":
        raise ConfigError(f"ep={degree}: the MoE block of {b.layer} holds its experts as stacked [experts, ...] "
                          f"weights indexed by the chosen ids ({b.form} form), which expert parallelism does not "
                          f"spread yet; use ep=1 for this model")
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

