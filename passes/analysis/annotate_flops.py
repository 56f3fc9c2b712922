"""Analysis: forward and backward FLOPs of every node, symbolic in the named dims.

Counts what ``torch.utils.flop_counter.FlopCounterMode`` counts when the same training step runs
on the ``meta`` device: matmul-class work only (matmul, linear, mm/addmm/bmm/baddbmm, einsum,
convolution, attention), one multiply-add = 2 FLOPs. Bias additions, elementwise ops,
normalizations, softmax, reductions and bias gradients (a sum over the batch) count 0, as there.
Each formula reads the operands' ``node.meta[SHAPE]`` (written by
:func:`passes.analysis.annotate_shapes.annotate_shapes`), so results are sympy polynomials in the named
dims (``batch``, ``seq``) or ``sympy.Integer`` when concrete.

Backward counts one gradient product per operand that requires grad (``TensorMeta.requires_grad``
of the operand): a linear whose input is a graph input (no grad) costs 1x its forward in backward
(weight grad only), else 2x. Where FlopCounterMode's meta-device count differs from the textbook
number, we follow FlopCounterMode and say so at the formula:

* ``scaled_dot_product_attention``: on ``meta`` it runs the math path (two bmm), so the backward
  is per operand (2x forward when q, k, v all need grad); causal masks are not discounted. The
  fused CUDA kernels' backward counts a recomputed Q K^T on top (3 Q K^T + 2 A V units).
* convolution weight gradient: FlopCounterMode's ``convolution_backward`` formula uses the full
  input channel count, so for ``groups > 1`` the weight gradient counts ``groups`` x forward.
* products with a vector right operand (``dot``, ``mv``, and N-D @ vector, which torch folds into
  ``mv``) and einsums without a summed index (Hadamard, outer products) count 0: FlopCounterMode
  has no formula for ``mv``/``dot``/``mul``.

MoE experts (``node.meta[MOE]``, written by ``annotate_moe`` when it ran before): a routed
expert's matmul counts the tokens it receives under routing, its captured count times the mark's
``flop_scale`` (the dense capture form runs every expert on every token: ``top_k / experts`` of
that, times the block's imbalance factor). The summary then also holds the captured counts.

Checkpointed regions (``apply_checkpoint``'s ``checkpoint(%submodule, *inputs)`` calls, kind
``"checkpoint"``): forward = the region's forward FLOPs, backward = the region's backward plus the
forward of the nodes that run again: every node of the region, except under the ``dag`` policy the
nodes ``node.meta[REMAT]`` marks cached (their op outputs are kept, so the replay does not run them).
The region's nodes are counted inside the submodule (their ``node.meta[FLOPS]`` is written there),
from the ``SHAPE`` facts they carried when ``apply_checkpoint`` moved them.
"""
from __future__ import annotations

import string
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.utils.checkpoint
from torch import fx

from passes.ir.errors import AnalysisError
from passes.ir.meta import FLOP_SUMMARY, FLOPS, MOE, REMAT, SHAPE, FlopMeta, FlopSummary, ShapeMeta, TensorMeta

aten = torch.ops.aten
_ZERO = sympy.Integer(0)
_NONE = FlopMeta(fwd=_ZERO, bwd=_ZERO, kind="none")


def annotate_flops(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Write :class:`FlopMeta` (FLOPs) under ``node.meta[FLOPS]`` for every node and the graph's
    :class:`FlopSummary` (FLOPs of one forward and one backward) under ``gm.meta[FLOP_SUMMARY]``.

    Only matmul-class work counts (see the module docstring): elementwise ops, bias additions
    and bias gradients are 0. Requires ``node.meta[SHAPE]`` on every node; raises
    :class:`AnalysisError` naming the node otherwise. Returns ``gm``.
    """
    gm.meta[FLOP_SUMMARY] = _annotate(gm)
    return gm


def _annotate(gm: fx.GraphModule, *, region: bool = False) -> FlopSummary:
    """Write ``node.meta[FLOPS]`` on every node of ``gm``; returns their sum. A checkpointed
    ``region``'s output node (made by ``apply_checkpoint``, never analysed) needs no shape."""
    fwd_terms, bwd_terms = [], []
    scaled = False  # some MoE expert counted under routing (node.meta[MOE].flop_scale)
    dense_fwd, dense_bwd = [], []
    for node in gm.graph.nodes:
        if not (region and node.op == "output"):
            _shape(node, node)  # every node must have been through annotate_shapes
        meta = _NONE
        sub = checkpoint_submodule(gm, node)
        if sub is not None:
            meta = _checkpoint(sub, node)
        elif node.op == "call_function":
            formula = FORMULAS.get(getattr(node.target, "overloadpacket", node.target))
            if formula is not None:
                meta = _apply(formula, node)
        if meta is not _NONE:
            dense_fwd.append(meta.fwd)
            dense_bwd.append(meta.bwd)
        mark = node.meta.get(MOE)
        if mark is not None and meta is not _NONE and mark.flop_scale != 1:
            meta = _routed(meta, mark.flop_scale)
            scaled = True
        node.meta[FLOPS] = meta
        if meta is not _NONE:
            fwd_terms.append(meta.fwd)
            bwd_terms.append(meta.bwd)
    summary = FlopSummary(fwd=sympy.expand(sympy.Add(*fwd_terms)), bwd=sympy.expand(sympy.Add(*bwd_terms)))
    if scaled:
        summary = FlopSummary(fwd=summary.fwd, bwd=summary.bwd, captured_fwd=sympy.expand(sympy.Add(*dense_fwd)),
                              captured_bwd=sympy.expand(sympy.Add(*dense_bwd)))
    return summary


def _routed(meta: FlopMeta, scale: sympy.Expr) -> FlopMeta:
    """An MoE expert's FLOPs at the tokens it receives under routing: the captured count times
    ``MoeNodeMark.flop_scale`` (``top_k / experts * imbalance`` for the dense capture form, in which
    every expert runs on every token; written by ``annotate_moe``)."""
    return FlopMeta(fwd=sympy.expand(meta.fwd * scale), bwd=sympy.expand(meta.bwd * scale), kind=meta.kind)


def checkpoint_submodule(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The region ``node`` runs through ``torch.utils.checkpoint.checkpoint`` (the GraphModule
    of its first argument, a ``get_attr``), or None when ``node`` is not such a call."""
    if node.op != "call_function" or node.target is not torch.utils.checkpoint.checkpoint:
        return None
    attr = node.args[0] if node.args else None
    if not isinstance(attr, fx.Node) or attr.op != "get_attr":
        return None
    sub = gm
    for part in attr.target.split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, fx.GraphModule) else None


def _checkpoint(sub: fx.GraphModule, node: fx.Node) -> FlopMeta:
    """A checkpointed region: its forward once, and in backward its backward plus a recompute."""
    missing = [n.name for n in sub.graph.nodes if n.op != "output" and SHAPE not in n.meta]
    if missing:
        raise AnalysisError(f"annotate_flops: node {missing[0]!r} inside the checkpointed region of {node.name!r} "
                            f"has no node.meta[{SHAPE!r}]; run annotate_shapes before apply_checkpoint (it "
                            f"moves the nodes with their meta)")
    summary = _annotate(sub, region=True)
    return FlopMeta(fwd=summary.fwd, bwd=sympy.expand(summary.bwd + recompute_flops(sub)), kind="checkpoint")


def recompute_flops(sub: fx.GraphModule) -> sympy.Expr:
    """Forward FLOPs a checkpointed region's replay runs in backward: those of its nodes that do
    not keep their op outputs (``node.meta[REMAT].cached``, the ``dag`` policy's choice). Needs
    ``node.meta[FLOPS]`` on the region's nodes (written by ``annotate_flops``)."""
    return sympy.expand(sympy.Add(*[n.meta[FLOPS].fwd for n in sub.graph.nodes
                                    if FLOPS in n.meta and not _cached(n)]))


def _cached(node: fx.Node) -> bool:
    meta = node.meta.get(REMAT)
    return meta is not None and meta.cached


# ---------------------------------------------------------------------------------------------
# Formulas. Each takes the node's bound arguments and returns (fwd, bwd) in FLOPs; the output
# tensor of the node is ``args["$out"]``. Operands are TensorMeta; ``_grad`` is 1 if an
# operand requires grad, else 0.

Args = dict[str, Any]


def _mm(a: TensorMeta, b: TensorMeta) -> tuple[sympy.Expr, sympy.Expr]:
    """``a @ b`` with torch.matmul semantics (broadcast batch dims), 1-D operands as torch runs them."""
    if len(b.shape) == 1:
        return _ZERO, _ZERO  # dot, mv, or N-D @ vector folded to mv: FlopCounterMode counts 0
    a_shape = a.shape if len(a.shape) > 1 else (1,) + a.shape  # vector @ M runs as a 1-row mm
    batch = _broadcast(a_shape[:-2], b.shape[:-2])
    fwd = 2 * _prod(batch) * a_shape[-2] * a_shape[-1] * b.shape[-1]
    return fwd, fwd * (_grad(a) + _grad(b))


def _linear(args: Args):
    x, w = args["input"], args["weight"]
    fwd = 2 * _prod(x.shape[:-1]) * x.shape[-1] * w.shape[0]
    return fwd, fwd * (_grad(x) + _grad(w))


def _matmul(args: Args):
    return _mm(args["self"], args["other"])


def _mat2(args: Args):  # mm, addmm, bmm, baddbmm: bias-like ``self`` is not counted
    first = args["mat1"] if "mat1" in args else args.get("batch1", args["self"])
    second = args.get("mat2", args.get("batch2"))
    return _mm(first, second)


def _conv(args: Args):
    """FlopCounterMode's ``conv_flop_count``: 2 * N * prod(spatial) * prod(kernel) * w[0] * w[1],
    spatial being the output's (or the input's, for a transposed conv).

    Backward: grad input = forward; grad weight = forward * groups (FlopCounterMode counts the
    weight gradient with the full input channel count; see module docstring).
    """
    x, w, out = args["input"], args["weight"], args["$out"]
    transposed = bool(args.get("transposed", False))
    groups = sympy.sympify(args.get("groups", 1))
    spatial = len(w.shape) - 2
    batched = len(x.shape) == spatial + 2  # conv2d also takes an unbatched (C, H, W) input
    n = x.shape[0] if batched else 1
    conv_shape = (x if transposed else out).shape[-spatial:]
    fwd = 2 * n * _prod(conv_shape) * _prod(w.shape[2:]) * w.shape[0] * w.shape[1]
    return fwd, fwd * _grad(x) + fwd * groups * _grad(w)


def _conv_transpose(args: Args):
    return _conv({**args, "transposed": True})


def _sdpa(args: Args):
    """Q K^T and A V as the math path runs them (GQA repeats K, V up to the query heads).

    ``B * Hq`` is taken from the output (``[..., Sq, Dv]``), so differing key/value heads and
    extra batch dims need no case of their own. Causal masks are counted in full.
    """
    q, k, v, out = args["query"], args["key"], args["value"], args["$out"]
    mask = args.get("attn_mask")
    bh, sq, dq = _prod(out.shape[:-2]), q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    qk = 2 * bh * sq * sk * dq
    av = 2 * bh * sq * sk * dv
    scores_grad = max(_grad(q), _grad(k), _grad(mask))  # dA is computed once if anything needs it
    return qk + av, qk * (_grad(q) + _grad(k)) + av * (scores_grad + _grad(v))


def _einsum(args: Args):
    """Operands contracted left to right, each pair as one bmm (torch's order without opt_einsum);
    a pair with no summed index is a broadcast multiply (0 FLOPs)."""
    equation, ops = args["equation"].replace(" ", ""), list(args["tensors"])
    lhs, arrow, out_sub = equation.partition("->")
    subs = lhs.split(",")
    free = iter(c for c in string.ascii_letters if c not in equation)
    ell: list[str] = []
    sizes: dict[str, sympy.Expr] = {}
    expanded = []
    for sub, t in zip(subs, ops):
        if "..." in sub:
            n_ell = len(t.shape) - (len(sub) - 3)
            while len(ell) < n_ell:
                ell.insert(0, next(free))
            sub = sub.replace("...", "".join(ell[len(ell) - n_ell:]))
        for c, size in zip(sub, t.shape):
            if sizes.get(c, 1) == 1:
                sizes[c] = size
        expanded.append(sub)
    if arrow:
        out_sub = out_sub.replace("...", "".join(ell))
    else:
        out_sub = "".join(ell) + "".join(sorted(c for c in sizes if lhs.count(c) == 1 and c not in ell))

    fwd = bwd = _ZERO
    left, left_grad = expanded[0], _grad(ops[0])
    for i in range(1, len(expanded)):
        right, right_grad = expanded[i], _grad(ops[i])
        later = set(out_sub).union(*expanded[i + 1:])
        keep_left = {c for c in left if c in right or c in later}
        keep_right = {c for c in right if c in left or c in later}
        summed = (keep_left & keep_right) - later
        if summed:
            flops = 2 * _prod([sizes[c] for c in keep_left | keep_right])
            fwd += flops
            bwd += flops * (left_grad + right_grad)
        left, left_grad = "".join(sorted((keep_left | keep_right) - summed)), max(left_grad, right_grad)
    return fwd, bwd


FORMULAS: dict[Any, tuple[str, Callable[[Args], tuple[sympy.Expr, sympy.Expr]]]] = {
    aten.linear: ("matmul", _linear),
    aten.matmul: ("matmul", _matmul),
    aten.mm: ("matmul", _mat2),
    aten.addmm: ("matmul", _mat2),
    aten.bmm: ("matmul", _mat2),
    aten.baddbmm: ("matmul", _mat2),
    aten.einsum: ("matmul", _einsum),
    aten.conv1d: ("conv", _conv),
    aten.conv2d: ("conv", _conv),
    aten.conv3d: ("conv", _conv),
    aten.convolution: ("conv", _conv),
    aten._convolution: ("conv", _conv),
    aten.conv_transpose1d: ("conv", _conv_transpose),
    aten.conv_transpose2d: ("conv", _conv_transpose),
    aten.conv_transpose3d: ("conv", _conv_transpose),
    aten.scaled_dot_product_attention: ("attention", _sdpa),
}
"""Op overload packet -> (kind, formula). Ops not listed count 0 FLOPs with kind "none"."""


# ---------------------------------------------------------------------------------------------
def _apply(entry, node: fx.Node) -> FlopMeta:
    kind, formula = entry
    out = _shape(node, node)
    fwd, bwd = formula({**_bind(node), "$out": out.tensors[0] if out.tensors else None})
    if not (out.tensors and out.tensors[0].requires_grad):
        bwd = _ZERO  # no gradient reaches this node (no_grad region or constant operands)
    return FlopMeta(fwd=sympy.expand(fwd), bwd=sympy.expand(bwd), kind=kind)


def _bind(node: fx.Node) -> Args:
    """Schema argument name -> value, with tensor operands as TensorMeta and sizes as sympy."""
    schema = node.target._schema
    bound: Args = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            continue
        bound[arg.name] = _resolve(node, value)
    return bound


def _resolve(node: fx.Node, value: Any) -> Any:
    if isinstance(value, fx.Node):
        meta = _shape(node, value)
        return meta.tensors[0] if meta.tensors else meta.value
    if isinstance(value, (list, tuple)):
        return [_resolve(node, v) for v in value]
    return value


def _shape(node: fx.Node, of: fx.Node) -> ShapeMeta:
    meta = of.meta.get(SHAPE)
    if meta is None:
        where = "" if of is node else f" (an operand of {node.name!r})"
        raise AnalysisError(f"annotate_flops: node {of.name!r}{where} has no node.meta[{SHAPE!r}]; "
                            f"run passes.analysis.annotate_shapes.annotate_shapes(gm) first")
    return meta


def _grad(t: Any) -> int:
    return 1 if isinstance(t, TensorMeta) and t.requires_grad else 0


def _prod(sizes: Sequence[Any]) -> sympy.Expr:
    return sympy.Mul(*sizes) if len(sizes) else sympy.Integer(1)


def _broadcast(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    """Broadcast two batch shapes (a size-1 dim takes the other's size)."""
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + list(a)
    b = [1] * (n - len(b)) + list(b)
    return [y if x == 1 else x for x, y in zip(a, b)]
