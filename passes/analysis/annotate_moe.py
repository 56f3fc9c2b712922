"""Analysis: recognise mixture-of-experts blocks by the structure of the graph, not by module names.

Patterns matched, per ``topk`` node ``T``:

Router
    ``T``'s input, back through view-like ops (view, reshape, to, flatten, ...), is a ``softmax`` or
    ``sigmoid`` whose input, back through view-like ops, is a matmul-class node (linear, mm, matmul,
    bmm, addmm) with a parameter operand: the router. ``experts`` = the router's output width,
    ``top_k`` = ``T``'s ``k``. The router's input and its view-like aliases are the block input ``X``.
Combine and routed experts
    ``V``: every node forward of ``T``'s values (``T[0]``), in ``T``'s block of the layer chain. A
    *combine* is a ``mul`` with one operand in ``V`` and the other not, whose backward cone (cut at
    ``X``) reaches ``X`` and holds a matmul with a parameter: that cone is an expert MLP.

    * ``dense`` form: ``experts`` combines, each over its own expert's parameters (every expert on
      every token, unchosen ones weighted 0: the zoo ``moe`` spec);
    * ``gathered`` form: one combine whose cone indexes stacked ``[experts, ...]`` parameters by the
      top-k ids (Hugging Face's ``batched_mm`` experts: one row per token and choice).
Shared experts
    Matmuls with parameters in the same block whose cone reaches ``X`` and that are neither router,
    routed expert nor fed by ``T``, grouped into connected MLPs; a lone matmul of width 1 is a
    shared-expert gate (Qwen2-MoE), not an expert.
Load-balancing loss
    A ``mul`` of something fed by ``T``'s ids but not its values (``f_e``) and something fed by the
    router's probabilities but not by ``T`` (``P_e``); or a second ``topk`` over the same router's
    probabilities that weights no expert (Hugging Face recomputes the routing in
    ``load_balancing_loss_func``): it is listed as that block's aux-loss term. A ``topk`` over
    probabilities of no single router (logits concatenated over layers) is the graph's.

Writes ``gm.meta[MOE_LAYERS]`` (:class:`MoeLayers`; no blocks for a dense model) and
``node.meta[MOE]`` (:class:`MoeNodeMark`) on the router and expert matmuls. The mark's
``flop_scale`` is the one rule of FLOPs under routing, which ``annotate_flops`` applies: a routed
expert counts ``tokens * top_k / experts * imbalance`` tokens, not every token.
"""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import sympy
import torch
from torch import fx

from passes.ir.meta import BLOCK, EXPORT_VAL, MOE, MOE_LAYERS, SHAPE, MoeBlock, MoeLayers, MoeNodeMark

aten = torch.ops.aten
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.to, aten._to_copy, aten.clone,
          aten.contiguous, aten.unsqueeze, aten.squeeze, aten.alias, aten.type_as, aten.expand,
          aten.repeat_interleave, aten.detach}
_MATMUL = {aten.linear, aten.mm, aten.matmul, aten.bmm, aten.addmm, aten.baddbmm, aten.einsum}
_PROBS = {aten.softmax, aten._softmax, aten.sigmoid}
_INDEX = {aten.index, aten.index_select, aten.embedding}


def op_of(node: fx.Node) -> Any:
    """The op packet a call node runs (``aten.mul`` for ``aten.mul.Tensor``); None for other nodes."""
    return getattr(node.target, "overloadpacket", node.target) if node.op == "call_function" else None


def _is_matmul(node: fx.Node) -> bool:
    return op_of(node) in _MATMUL or "grouped_mm" in str(node.target)


def through_views(node: Any) -> Any:
    """The first node back from ``node`` through view-like ops (view, reshape, to, flatten, ...)."""
    while isinstance(node, fx.Node) and op_of(node) in _VIEWS and node.args:
        node = node.args[0]
    return node


def tensor_shape(node: fx.Node) -> tuple:
    """The shape of the tensor ``node`` makes: as captured, or as annotate_shapes wrote it (a graph
    rebuilt on another rank, :mod:`passes.ir.graph_transfer`, carries no export values); empty
    for a non-tensor."""
    val = node.meta.get(EXPORT_VAL)
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    meta = node.meta.get(SHAPE)
    return tuple(meta.tensors[0].shape) if meta is not None and len(meta.tensors) == 1 else ()


def aliases(x: fx.Node) -> set[fx.Node]:
    """``x`` and its view-like aliases (view, reshape, repeat per choice, ...): the block input's forms."""
    return _forward([x], lambda n: n is x or op_of(n) in _VIEWS)


def _forward(starts: list[fx.Node], keep) -> set[fx.Node]:
    out, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n in out or not keep(n):
            continue
        out.add(n)
        todo.extend(n.users)
    return out


def backward_cone(node: fx.Node, stop: set[fx.Node], cut: set[fx.Node] = frozenset()) -> tuple[set[fx.Node], bool]:
    """Backward cone of ``node`` cut at ``stop`` and ``cut``; whether it reached ``stop``."""
    seen, reached, todo = set(), False, [node]
    while todo:
        n = todo.pop()
        if n in seen or n in cut:
            continue
        if n in stop:
            reached = True
            continue
        seen.add(n)
        if n.op not in ("placeholder", "get_attr"):
            todo.extend(n.all_input_nodes)
    return seen, reached


def _params(cone: set[fx.Node]) -> list[fx.Node]:
    return sorted((n for n in cone if n.op == "get_attr"), key=lambda n: str(n.target))


def _contraction(mm: fx.Node) -> int:
    """The contracted size of a matmul-class node: its first operand's last dim."""
    shape = tensor_shape(mm.args[0]) if isinstance(mm.args[0], fx.Node) else ()
    return int(shape[-1]) if shape else 0


def _last_matmul(cone: set[fx.Node], order: dict[fx.Node, int]) -> fx.Node:
    return max((n for n in cone if _is_matmul(n)), key=order.__getitem__)


def _scores(node: Any) -> Any:
    """What ``topk`` chooses by, back to the router's probabilities: through view-like ops, a
    per-expert bias added for the choice only (DeepSeek-V3's ``e_score_correction_bias``,
    LFM2-MoE's ``expert_bias``) and a group-limited mask (DeepSeek-V3's ``masked_fill``)."""
    node = through_views(node)
    while isinstance(node, fx.Node) and node.op == "call_function":
        if op_of(node) is aten.masked_fill:
            node = through_views(node.args[0])
        elif op_of(node) is aten.add and len(node.all_input_nodes) == 2:
            rest = [a for a in node.all_input_nodes if through_views(a).op != "get_attr"]
            if len(rest) != 1:
                break
            node = through_views(rest[0])
        else:
            break
    return node


def _router(topk: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(router matmul, its parameter, probabilities node) of ``topk``, or None (module docstring)."""
    probs = _scores(topk.args[0])
    if not isinstance(probs, fx.Node) or op_of(probs) not in _PROBS:
        return None
    router = through_views(probs.args[0])
    if not isinstance(router, fx.Node) or not _is_matmul(router):
        return None
    # the weight itself, or cast first (DeepSeek-V3 routes in fp32)
    weights = [w for w in map(through_views, router.all_input_nodes) if w.op == "get_attr"]
    return (router, weights[0], probs) if weights else None


def _getitems(node: fx.Node, index: int) -> list[fx.Node]:
    return [u for u in node.users if u.target is operator.getitem and u.args[1] == index]


def annotate_moe(gm: fx.GraphModule, ctx: Any = None, *, imbalance: float = 1.0) -> fx.GraphModule:
    """Write :class:`MoeLayers` on ``gm`` and :class:`MoeNodeMark` on the MoE blocks' matmuls
    (module docstring). ``imbalance``: the busiest expert's load over the balanced one (>= 1)."""
    if imbalance < 1:
        raise ValueError(f"annotate_moe: imbalance={imbalance} < 1; it is the busiest expert's load over the "
                         f"balanced load (tokens * top_k / experts), so 1.0 or more")
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    scale_imb = sympy.Rational(str(imbalance))
    blocks, graph_aux, again = [], [], []
    for topk in (n for n in nodes if op_of(n) is aten.topk):
        if any(op_of(n) is aten.topk for n in _forward(_getitems(topk, 0), _in_block_of(topk))):
            continue  # its values choose for a later top-k of its layer (DeepSeek-V3's expert groups)
        found = _router(topk)
        if found is None:
            # a top-k over probabilities of no single router: an aux loss over concatenated logits
            probs = through_views(topk.args[0])
            if isinstance(probs, fx.Node) and op_of(probs) in _PROBS:
                graph_aux.append(topk.name)
            continue
        block = _block(gm, topk, *found, order=order, imbalance=imbalance, scale_imb=scale_imb)
        if block is not None:
            blocks.append(block)
        else:
            again.append((found[0].name, topk.name))
    # a second top-k over a block's router logits that weights no expert: the routing recomputed
    # for the load-balancing loss (HF load_balancing_loss_func, with output_router_logits)
    blocks = [replace(b, aux_loss=b.aux_loss + tuple(t for r, t in again if r == b.router)) for b in blocks]
    graph_aux += [t for r, t in again if r not in {b.router for b in blocks}]
    gm.meta[MOE_LAYERS] = MoeLayers(blocks=tuple(blocks), aux_loss=tuple(graph_aux))
    return gm


def _in_block_of(node: fx.Node):
    """Whether a node is in ``node``'s block of the layer chain (every node, without blocks)."""
    layer = node.meta[BLOCK].index if BLOCK in node.meta else None
    return (lambda n: True) if layer is None else (lambda n: BLOCK not in n.meta or n.meta[BLOCK].index == layer)


def _block(gm, topk, router, router_w, probs, *, order, imbalance, scale_imb) -> MoeBlock | None:
    same_layer = _in_block_of(router)
    n_experts, k = int(tensor_shape(router)[-1]), int(topk.args[1])
    base = through_views(router.args[0])
    inputs = aliases(base)
    ids = _forward(_getitems(topk, 1), same_layer)
    # the combine weights: top-k's values, or the probabilities gathered at its ids (when it
    # chose by biased scores: DeepSeek-V3, LFM2-MoE)
    gathered = [n for n in ids if op_of(n) is aten.gather and through_views(n.args[0]) is probs]
    values = _forward(_getitems(topk, 0) + gathered, same_layer)
    from_topk = values | ids

    combines = []  # (mul, expert cone)
    for mul in sorted(values, key=order.__getitem__):
        if op_of(mul) is not aten.mul:
            continue
        operands = [a for a in mul.args if isinstance(a, fx.Node)]
        other = [a for a in operands if a not in values]
        if len(operands) != 2 or len(other) != 1:
            continue
        cone, reached = backward_cone(other[0], inputs, cut={topk})  # the ids feed a gather: not the router's cone
        if reached and any(_is_matmul(n) for n in cone) and _params(cone):
            combines.append((mul, cone))
    if not combines:
        return None

    marks: dict[fx.Node, MoeNodeMark] = {router: MoeNodeMark(block=router.name, role="router")}
    if len(combines) == n_experts:
        form, expert_params, scale = "dense", [], sympy.Rational(k, n_experts) * scale_imb
        for e, (_, cone) in enumerate(combines):
            expert_params.append(tuple(str(p.target) for p in _params(cone)))
            for n in cone:
                if _is_matmul(n):
                    marks[n] = MoeNodeMark(block=router.name, role="expert", expert=e, flop_scale=scale)
    else:
        cone = set().union(*(c for _, c in combines))
        stacked = [p for p in _params(cone) if tensor_shape(p)[:1] == (n_experts,)
                   and any(op_of(u) in _INDEX or _is_matmul(u) for u in p.users)]
        if not stacked:
            return None
        form = "gathered"
        expert_params = [tuple(f"{p.target}[{e}]" for p in stacked) for e in range(n_experts)]
        for n in cone:
            if _is_matmul(n):
                marks[n] = MoeNodeMark(block=router.name, role="expert", flop_scale=scale_imb)
    routed = set().union(*(c for _, c in combines))
    expert_hidden = _contraction(_last_matmul(combines[0][1], order))

    # shared experts: other matmuls of this layer fed by X, not by the router's choice
    candidates = [n for n in gm.graph.nodes if _is_matmul(n) and same_layer(n) and n is not router
                  and n not in routed and n not in from_topk and _params(backward_cone(n, inputs)[0])
                  and backward_cone(n, inputs)[1]]
    groups: list[set[fx.Node]] = []
    for n in sorted(candidates, key=order.__getitem__):
        cone = backward_cone(n, inputs)[0]
        joined = [g for g in groups if g & cone]
        merged = set().union({n}, *joined) if joined else {n}
        groups = [g for g in groups if g not in joined] + [merged]
    shared = [g for g in groups if len(g) > 1 or int((tensor_shape(next(iter(g))) or (0,))[-1]) != 1]
    shared_params, shared_hidden = [], None
    for g in shared:
        cone = set().union(*(backward_cone(n, inputs)[0] for n in g))
        shared_params.append(tuple(str(p.target) for p in _params(cone)))
        shared_hidden = _contraction(max(g, key=order.__getitem__))
        for n in g:
            marks[n] = MoeNodeMark(block=router.name, role="shared")

    # load-balancing loss: f_e (from the ids, not the values) times P_e (from probs, not topk)
    from_probs = _forward([probs], lambda n: True)
    aux = []
    for mul in (n for n in ids if op_of(n) is aten.mul):
        a, b = (mul.args + (None, None))[:2]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            continue
        for f, p in ((a, b), (b, a)):
            if f in ids and f not in values and p in from_probs and p not in from_topk:
                aux.append(mul.name)
                break

    for n, mark in marks.items():
        n.meta[MOE] = mark
    return MoeBlock(router=router.name, router_weight=str(router_w.target), topk=topk.name,
                    layer=router.meta[BLOCK].name if BLOCK in router.meta else "model",
                    experts=n_experts, top_k=k, expert_hidden=expert_hidden, form=form,
                    expert_params=tuple(expert_params),
                    expert_nodes=tuple(n.name for n in sorted(marks, key=order.__getitem__) if marks[n].role == "expert"),
                    shared_experts=len(shared), shared_hidden=shared_hidden, shared_params=tuple(shared_params),
                    imbalance=imbalance, aux_loss=tuple(aux))
