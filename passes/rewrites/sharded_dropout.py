"""Rewrite: dropout on tensor- or sequence-parallel shards draws the single-device mask.

Part of ``apply_tensor_parallel`` (after the tp and sequence-parallel rewrites, which tag every
node that runs on a shard with ``TPMeta.role`` ``"sharded"`` or ``"sequence"`` and its
``shard_dim``). Patterns (``r`` this tp rank, ``tp`` the degree, ``d`` the shard dim)::

    dropout(x_shard, p, True)
        -> getitem(partitioner.sharded_dropout(x_shard, p, d, r, tp, sections), 0)
    scaled_dot_product_attention(q, k, v, mask, p > 0)      (heads sharded)
        -> softmax((q·√s)(kᵀ·√s) + mask) -> sharded_dropout(., p, d, r, tp) -> · v

The attention is spelled out as ATen's math path on CPU spells it (scale both operands by
√scale, ``_safe_softmax``'s zeros for rows masked whole, dropout of the probabilities, so the loss equals one device's bit for
bit there); SDPA without dropout, and every op outside a shard, is left alone. See
:mod:`runtime.kernels.dropout` for why the full mask is drawn.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx

import passes.ir.ops  # noqa: F401  (defines torch.ops.partitioner.sharded_dropout)
from passes.ir.errors import PassError
from passes.ir.meta import TENSOR_PARALLEL, ShapeMeta, TPMeta

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


def rewrite_sharded_dropout(graph: fx.Graph, *, rank: int, degree: int, shapes: dict[str, ShapeMeta | None]) -> int:
    """Rewrite every dropout (and SDPA with dropout) that runs on a shard in ``graph``; returns
    how many. ``shapes``: ``node.meta[SHAPE]`` by node name from before the tp rewrite (the
    attention's head dim and its mask's dtype)."""
    count = 0
    for node in list(graph.nodes):
        meta: TPMeta | None = node.meta.get(TENSOR_PARALLEL)
        if node.op != "call_function" or meta is None or meta.role not in ("sharded", "sequence"):
            continue
        if meta.shard_dim is None:
            continue
        if node.target is aten.dropout.default and _p(node.args[1]) and node.args[2]:
            _replace_dropout(graph, node, node.args[0], node.args[1], meta, rank, degree)
            count += 1
        elif node.target is _SDPA and _p(_sdpa_arg(node, 4, "dropout_p", 0.0)):
            _spell_out_attention(graph, node, meta, rank, degree, shapes)
            count += 1
    return count


def _p(p) -> bool:
    if isinstance(p, fx.Node):
        raise PassError("sharded dropout: the dropout probability is computed in the graph; give a constant")
    return float(p) > 0.0


def _sdpa_arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _replace_dropout(graph, node, x, p, meta, rank, degree) -> None:
    with graph.inserting_before(node):
        pair = graph.call_function(torch.ops.partitioner.sharded_dropout.default,
                                   (x, float(p), meta.shard_dim, rank, degree, list(meta.sections)))
        out = graph.call_function(operator.getitem, (pair, 0))
    for n in (pair, out):
        n.meta[TENSOR_PARALLEL] = meta
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _tensor_meta(shapes, node: fx.Node, what: str):
    meta = shapes.get(node.name)
    if meta is None or len(meta.tensors) != 1:
        raise PassError(f"sharded dropout: no shape recorded for {what} {node.name}; run annotate_shapes first")
    return meta.tensor


def _spell_out_attention(graph, node, meta, rank, degree, shapes) -> None:
    q, k, v = node.args[:3]
    mask = _sdpa_arg(node, 3, "attn_mask", None)
    p = _sdpa_arg(node, 4, "dropout_p", 0.0)
    causal = _sdpa_arg(node, 5, "is_causal", False)
    scale = node.kwargs.get("scale")
    if node.kwargs.get("enable_gqa"):
        raise PassError(f"sharded dropout: {node.name} is attention with enable_gqa and dropout; "
                        f"repeat the kv heads in the model or use attention dropout 0")
    if scale is None:
        scale = 1.0 / math.sqrt(int(_tensor_meta(shapes, q, "the attention query").shape[-1]))
    root = math.sqrt(abs(scale))
    g = graph
    with g.inserting_before(node):
        qs = g.call_function(aten.mul.Tensor, (q, -root if scale < 0 else root))
        kt = g.call_function(aten.transpose.int, (k, -2, -1))
        ks = g.call_function(aten.mul.Tensor, (kt, root))
        attn = g.call_function(aten.matmul.default, (qs, ks))
        if causal:
            ones = g.call_function(aten.ones_like.default, (attn,), {"dtype": torch.bool})
            keep = g.call_function(aten.tril.default, (ones,))
            attn = g.call_function(aten.masked_fill.Scalar,
                                   (attn, g.call_function(aten.logical_not.default, (keep,)), float("-inf")))
        if mask is not None:  # bool: True keeps; float: added (the math path turns bools into -inf/0)
            if _tensor_meta(shapes, mask, "the attention mask").dtype == torch.bool:
                drop = g.call_function(aten.logical_not.default, (mask,))
                attn = g.call_function(aten.masked_fill.Scalar, (attn, drop, float("-inf")))
            else:
                attn = g.call_function(aten.add.Tensor, (attn, mask))
        # _safe_softmax as ATen spells it (0, not NaN, for a row masked whole), in ops ONNX knows
        soft = g.call_function(aten.softmax.int, (attn, -1))
        masked = g.call_function(aten.eq.Scalar, (attn, float("-inf")))
        dead = g.call_function(aten.all.dim, (masked, -1, True))
        probs = g.call_function(aten.where.ScalarSelf, (dead, 0.0, soft))
        pair = g.call_function(torch.ops.partitioner.sharded_dropout.default,
                               (probs, float(p), meta.shard_dim, rank, degree, list(meta.sections)))
        dropped = g.call_function(operator.getitem, (pair, 0))
        out = g.call_function(aten.matmul.default, (dropped, v))
    for n in (attn, probs, pair, dropped, out):
        n.meta[TENSOR_PARALLEL] = meta
    node.replace_all_uses_with(out)
    graph.erase_node(node)
