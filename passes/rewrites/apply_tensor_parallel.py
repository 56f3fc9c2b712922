"""Rewrite: the program of ONE tensor-parallel rank, from ``tag_tensor_parallel``'s facts.

Reads ``node.meta[TENSOR_PARALLEL]`` and ``gm.meta[TENSOR_PARALLEL_PLAN]``; returns a new
GraphModule (the input is left as it was) whose sharded parameters are this rank's slices of
the originals, under the same names. Graph patterns inserted (ops of ``passes.ir.ops``)::

    column:  x -> partitioner.copy_to_tp(x, g) -> linear(., W[rank rows])          (f: id / all-reduce)
    row:     x_shard -> linear(., W[:, rank cols]) -> partitioner.reduce_from_tp(., g) -> + bias
    embed:   ids -> local = ids - start, masked to 0 outside [start, end) -> embedding(W[rank rows], local)
                 -> zero the masked rows -> partitioner.reduce_from_tp
    loss:    logits_shard, targets -> partitioner.vocab_parallel_cross_entropy -> mean over kept targets
    views:   sizes at the sharded dim (heads, kv heads, hidden, vocab) divided by the tp degree
    sequence_parallel=True: reduce_from_tp -> reduce_scatter_seq, copy_to_tp -> all_gather_seq and
             the norms/residuals between them on sequence chunks (passes/rewrites/sequence_parallel.py)

Fused q/k/v weights are sliced per section (each of q, k, v by heads). Dropout on a shard (tp or
sequence) draws the mask one device would draw and keeps this rank's slice
(:mod:`passes.rewrites.sharded_dropout`), so tp training with dropout equals one device's. Analysis meta (shapes, FLOPs, memory) of the copied nodes is
dropped: it described the unsharded graph; rerun the analysis passes on the rank program.
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import fx, nn

import passes.ir.ops  # noqa: F401  (defines torch.ops.partitioner.*)
from passes.ir.program import shard_tensor
from passes.ir.errors import PassError
from passes.ir.meta import (FLOP_SUMMARY, FLOPS, MEMORY, MEMORY_SUMMARY, SHAPE, STAGE_IO, TENSOR_PARALLEL,
                            TENSOR_PARALLEL_PLAN, TensorParallelPlan)
from passes.rewrites.sequence_parallel import apply_sequence_parallel, sequence_size
from passes.rewrites.sharded_dropout import rewrite_sharded_dropout
from passes.policies.tensor_parallel_patterns import _SPLITS, _VIEWS
from passes.ir.graph_modules import graph_module

aten = torch.ops.aten
tp_ops = torch.ops.partitioner
_STALE = (SHAPE, FLOPS, MEMORY)
_STALE_GRAPH = (FLOP_SUMMARY, MEMORY_SUMMARY, TENSOR_PARALLEL_PLAN)


def apply_tensor_parallel(gm: fx.GraphModule, ctx: Any = None, *, rank: int, group: str,
                          sequence_parallel: bool = False, seq_dim: str = "seq") -> fx.GraphModule:
    """The program of tp rank ``rank``, its collectives on the group registered as ``group``.

    ``gm`` must have been tagged by ``tag_tensor_parallel`` (which fixes the degree).
    ``sequence_parallel``: also run the regions between row- and column-parallel linears on this
    rank's chunk of the named dim ``seq_dim`` (see :mod:`passes.rewrites.sequence_parallel`; ConfigError
    when its size is not divisible by the degree); the returned plan then lists, in
    ``sequence_parallel_grads``, the replicated parameters whose gradients the runtime must sum
    over the tp group.
    """
    plan: TensorParallelPlan | None = gm.meta.get(TENSOR_PARALLEL_PLAN)
    if plan is None:
        raise PassError("apply_tensor_parallel needs gm.meta['tensor_parallel_plan']; run "
                        "passes.policies.tensor_parallel_patterns.tag_tensor_parallel(gm, degree=...) first")
    if not 0 <= rank < plan.degree:
        raise PassError(f"apply_tensor_parallel: rank={rank} outside 0..{plan.degree - 1} (tp degree {plan.degree})")
    tp = plan.degree
    seq = sequence_size(gm, tp, seq_dim) if sequence_parallel and tp > 1 else None
    graph = copy.deepcopy(gm.graph)
    shapes = {n.name: n.meta.get(SHAPE) for n in graph.nodes}  # global shapes, for sequence parallelism
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        for key in _STALE:
            node.meta.pop(key, None)
        if node.op == "get_attr":
            attrs[node.target] = _rank_attr(gm, node.target, plan, rank)
    rw = _Rewriter(graph, tp, rank, group, gm)
    for node in list(graph.nodes):
        rw.visit(node)
    sp_grads: tuple[str, ...] = ()
    if seq is not None:
        sp_grads = apply_sequence_parallel(graph, shapes, {n: p for n, p in attrs.items()
                                                           if isinstance(p, nn.Parameter)},
                                           tp=tp, group=group, seq=seq, io=gm.meta.get(STAGE_IO))
    rewrite_sharded_dropout(graph, rank=rank, degree=tp, shapes=shapes)
    graph.eliminate_dead_code()
    graph.lint()
    # A plain program, not export's: pickling then retraces with fx's default tracer (export's
    # module-stack tracer cannot be rebuilt), so a rank program can be shipped to its process.
    graph._tracer_cls, graph._tracer_extras = None, {}
    out = graph_module(attrs, graph, class_name=type(gm).__name__)
    # the graph's decisions travel on (the summaries described the unsharded graph and do not)
    out.meta.update({k: v for k, v in gm.meta.items() if k not in _STALE_GRAPH})
    out.meta[TENSOR_PARALLEL_PLAN] = TensorParallelPlan(degree=tp, params=plan.params, rank=rank,
                                                        sequence_parallel=seq is not None,
                                                        sequence_parallel_grads=sp_grads)
    return out


def _rank_attr(gm: fx.GraphModule, target: str, plan: TensorParallelPlan, rank: int):
    value = gm.get_parameter(target) if target in plan.params else _get_attr(gm, target)
    if target in plan.params:
        return nn.Parameter(shard_tensor(value, plan.params[target], rank, plan.degree),
                            requires_grad=value.requires_grad)
    return value  # buffers, constants and submodules are shared read-only


def _get_attr(gm: nn.Module, target: str):
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _orig_shape(gm: fx.GraphModule, name: str):
    node = next(n for n in gm.graph.nodes if n.name == name)
    return node.meta[SHAPE].tensor.shape


class _Rewriter:
    def __init__(self, graph: fx.Graph, tp: int, rank: int, group: str, src: fx.GraphModule):
        self.graph, self.tp, self.rank, self.group, self.src = graph, tp, rank, group, src
        self.copies: dict[fx.Node, fx.Node] = {}

    def visit(self, node: fx.Node) -> None:
        meta = node.meta.get(TENSOR_PARALLEL)
        if meta is None or node.op != "call_function":
            return
        role = meta.role
        if role in ("column", "vocab_head"):
            self._column(node)
        elif role == "row":
            self._row(node)
        elif role == "vocab_embedding":
            self._embedding(node)
        elif role == "vocab_loss":
            self._loss(node)
        elif role == "sharded" and meta.shard_dim is not None:
            self._sizes(node, meta.shard_dim)

    def _call(self, target, args, before: fx.Node | None = None, after: fx.Node | None = None) -> fx.Node:
        ctxm = self.graph.inserting_before(before) if before is not None else self.graph.inserting_after(after)
        with ctxm:
            return self.graph.call_function(target, args)

    def _column(self, node: fx.Node) -> None:
        idx = 1 if node.target is aten.addmm.default else 0
        x = node.args[idx]
        if x not in self.copies:
            self.copies[x] = self._call(tp_ops.copy_to_tp.default, (x, self.group), before=node)
        node.update_arg(idx, self.copies[x])

    def _row(self, node: fx.Node) -> None:
        if node.target is aten.addmm.default:
            bias, x, w = node.args[:3]
            if len(node.args) > 3 or node.kwargs:
                raise PassError(f"apply_tensor_parallel: addmm {node.name} with beta/alpha is not supported")
            node.target, node.args = aten.mm.default, (x, w)
        else:
            x, w = node.args[:2]
            bias = node.args[2] if len(node.args) > 2 else None
            node.args = (x, w)
        users = list(node.users)
        red = self._call(tp_ops.reduce_from_tp.default, (node, self.group), after=node)
        last = red
        if bias is not None:  # once, after the all-reduce (each rank adding it would count it tp times)
            last = self._call(aten.add.Tensor, (red, bias), after=red)
        for u in users:
            u.replace_input_with(node, last)

    def _sizes(self, node: fx.Node, dim: int) -> None:
        t = node.target
        if t in _VIEWS or t is aten.expand.default:
            sizes = list(node.args[1])
            s = sizes[dim]
            if isinstance(s, fx.Node):
                raise PassError(f"apply_tensor_parallel: {node.name} has a computed size at the sharded dim {dim}")
            if s != -1:
                sizes[dim] = s // self.tp
            node.update_arg(1, sizes)
        elif t in _SPLITS:
            nd = len(_orig_shape(self.src, node.args[0].name))
            split_dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
            if split_dim != dim:
                return  # split of another dim: sizes unchanged
            if t is aten.split.Tensor:
                node.update_arg(1, node.args[1] // self.tp)
            elif t is aten.split_with_sizes.default:
                node.update_arg(1, [s // self.tp for s in node.args[1]])

    def _embedding(self, node: fx.Node) -> None:
        w, idx = node.args[:2]
        rows = int(_orig_shape(self.src, w.name)[0])
        per = rows // self.tp
        start, end = self.rank * per, (self.rank + 1) * per
        lt = self._call(aten.lt.Scalar, (idx, start), before=node)
        ge = self._call(aten.ge.Scalar, (idx, end), before=node)
        outside = self._call(aten.bitwise_or.Tensor, (lt, ge), before=node)
        shifted = self._call(aten.sub.Tensor, (idx, start), before=node)
        local = self._call(aten.masked_fill.Scalar, (shifted, outside, 0), before=node)
        args = list(node.args)
        args[1] = local
        if len(args) > 2 and args[2] != -1:  # padding_idx: only the rank holding that row keeps it
            args[2] = args[2] - start if start <= args[2] < end else -1
        node.args = tuple(args)
        users = list(node.users)
        mask = self._call(aten.unsqueeze.default, (outside, -1), after=node)
        zeroed = self._call(aten.masked_fill.Scalar, (node, mask, 0.0), after=mask)
        red = self._call(tp_ops.reduce_from_tp.default, (zeroed, self.group), after=zeroed)
        for u in users:
            u.replace_input_with(node, red)

    def _loss(self, node: fx.Node) -> None:
        logits, target = node.args[:2]
        names = ("weight", "reduction", "ignore_index", "label_smoothing")
        opts = dict(zip(names, node.args[2:]), **node.kwargs)
        reduction, ignore = opts.get("reduction", 1), opts.get("ignore_index", -100)
        vocab = int(_orig_shape(self.src, logits.name)[1])
        start = self.rank * (vocab // self.tp)
        vp = self._call(tp_ops.vocab_parallel_cross_entropy.default, (logits, target, start, ignore, self.group),
                        before=node)
        loss = self._call(operator.getitem, (vp, 0), before=node)
        if reduction == 0:
            result = loss
        elif reduction == 2:
            result = self._call(aten.sum.default, (loss,), before=node)
        else:  # mean over the targets that are not ignored, as cross_entropy does
            total = self._call(aten.sum.default, (loss,), before=node)
            kept = self._call(aten.ne.Scalar, (target, ignore), before=node)
            count = self._call(aten.sum.default, (kept,), before=node)
            result = self._call(aten.div.Tensor, (total, count), before=node)
        node.replace_all_uses_with(result)
        self.graph.erase_node(node)
