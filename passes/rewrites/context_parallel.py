"""Rewrite: context parallelism (cp) — the program of every cp rank when the sequence is cut over ``degree`` ranks.

The program is the same on every cp rank (the ops read the rank from the cp group at run time,
as the tp collectives do). Every activation holds this rank's share of the sequence under the load-balanced layout of
:mod:`passes.ir.cp_ops` (chunks ``r`` and ``2*cp-1-r`` of ``2*cp``); per-token ops (embeddings,
norms, MLPs, the LM head) run unchanged on it, and only attention and what depends on positions
or on the whole sequence is rewritten. Graph patterns (ops of :mod:`passes.ir.cp_ops`, ``g`` the
cp group's name)::

    ring:     sdpa(q, k, v, is_causal=c, scale=s)
                  -> getitem(partitioner.ring_attention(q, k, v, c, s, cp, g), 0)
    ulysses:  sdpa(q, k, v, ...) -> partitioner.heads_to_seq(sdpa(seq_to_heads(q), seq_to_heads(k),
                  seq_to_heads(v), ...))                       (H/cp heads over the whole sequence)
    GQA:      k = reshape(expand(unsqueeze(k_kv, 2), ...))   (repeat_kv before sdpa)
                  -> the op reads k_kv (ring always; Ulysses when the kv heads divide by cp):
                  kv heads travel, not their copies
    positions: arange(S_local) -> partitioner.load_balanced_positions(arange(S_local), cp, g)
              buffer[:S_local] along d -> index_select(buffer, d, <those positions>)
    loss:     cross_entropy_loss(x, t) (mean)
                  -> reduce_from_cp(cross_entropy_loss(x, t, reduction=sum), cp, g)
                     / reduce_from_cp(count(t != ignore), cp, g)

The graph's inputs that carry the named sequence dim (token ids, targets, position ids) become
this rank's shards: the runtime feeds ``shard_sequence(x, dim, cp_rank, cp)`` for each input listed
in :class:`~passes.ir.cp_ops.ContextParallelPlan` ``.sharded_inputs``. Sizes read from those
inputs (``sym_size``) are then local, so views follow; positions computed from them
(``arange``) are mapped to the TRUE positions of the rank's chunks, so position embeddings and
rotary tables are those of one device.

**Loss.** The mean cross-entropy becomes the sum over this rank's tokens divided by the number of
counted tokens over all cp ranks; the sum is all-reduced in forward, and its backward multiplies
by ``degree``. So every rank's loss *value* is the single-device mean, and each rank's parameter
gradients are ``degree`` x its tokens' share of the single-device gradient: **the runtime
averages gradients over the cp group** as over dp (one average over dp x cp ranks, Megatron's
convention).

Requires: ``gm.meta[CAPTURE]`` with the sequence dim ``seq_dim`` kept symbolic (sizes come from
the inputs; a specialized length would leave the global length baked into views) and its hint
divisible by ``2 * degree``; attention as ``aten.scaled_dot_product_attention`` without an
explicit mask or dropout. Provides: ``gm.meta[CONTEXT_PARALLEL]`` (a ``ContextParallelPlan``);
``gm.meta[CAPTURE]`` with the sequence dim's hint and bound divided by ``degree``. Node analysis
meta (shapes, FLOPs, memory) is dropped: rerun the analysis passes on the result. Parameters are
shared with ``gm`` (not copied).

Not rewritten (left as they are, so a graph that has them is wrong under cp): other losses or
reductions over the sequence, masks built from positions, ops that mix tokens other than
attention (sequence convolutions).
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

import torch
from torch import fx

import passes.ir.cp_ops  # noqa: F401  (defines torch.ops.partitioner.ring_attention etc.)
from passes.ir.meta import CONTEXT_PARALLEL
from passes.ir.cp_ops import CP_MODES, ContextParallelPlan, CPMode, check_heads, check_layout
from passes.ir.errors import ConfigError, PassError
from passes.ir.graph_modules import graph_module
from passes.ir.meta import (
    CAPTURE,
    EXPORT_VAL,
    FLOP_SUMMARY,
    FLOPS,
    MEMORY,
    MEMORY_SUMMARY,
    SHAPE,
    CaptureInfo,
)

aten = torch.ops.aten
cp_ops = torch.ops.partitioner
_SDPA = aten.scaled_dot_product_attention.default
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_MEAN, _SUM = 1, 2  # aten reduction enum
_STALE = (SHAPE, FLOPS, MEMORY)
_STALE_GRAPH = (FLOP_SUMMARY, MEMORY_SUMMARY)


def apply_context_parallel(gm: fx.GraphModule, ctx: Any = None, *, degree: int, group: str,
                           mode: CPMode = "ring", seq_dim: str = "seq", tp: int = 1) -> fx.GraphModule:
    """The program of every rank of ``degree`` cp ranks, attention exchanging over the cp group
    registered as ``group``; ``mode``: ``"ring"`` (K/V blocks travel the ring) or ``"ulysses"``
    (all-to-all to head shards). ``tp``: the tensor-parallel degree the program is sharded over
    afterwards (each tp rank's cp ops see ``heads / tp`` heads). Returns a new GraphModule
    (``gm`` is left as it was).

    Raises ConfigError for a bad degree/mode, a sequence hint not divisible by
    ``2 * degree``, or (Ulysses) heads not divisible by ``tp * degree``; PassError for a graph it
    cannot rewrite (no capture info, specialized sequence dim, attention with a mask or dropout).
    """
    if mode not in CP_MODES:
        raise ConfigError(f"apply_context_parallel: mode={mode!r}; use one of {CP_MODES}")
    if not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"apply_context_parallel: degree={degree!r}; give the cp degree, an integer >= 1")
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"apply_context_parallel: tp={tp!r}; give the tensor-parallel degree, an integer >= 1")
    info: CaptureInfo | None = gm.meta.get(CAPTURE)
    if info is None:
        raise PassError("apply_context_parallel needs gm.meta['capture']; capture the graph with "
                        "passes.capture.capture.capture_model / capture_spec")
    dims = dict(info.dims)
    if seq_dim not in dims:
        raise PassError(f"apply_context_parallel: no dim named {seq_dim!r} in the capture (dims: {sorted(dims)}); "
                        f"name the sequence dim in the InputSpec shapes or pass seq_dim=")
    if seq_dim not in info.symbolic:
        raise PassError(f"apply_context_parallel: the sequence dim {seq_dim!r} was specialized to {dims[seq_dim]} "
                        f"at capture, so the global length is baked into the graph's views; capture with "
                        f"symbolic=(..., {seq_dim!r})")
    check_layout(dims[seq_dim], degree, f"{seq_dim}")
    if any(getattr(n.target, "namespace", None) == "partitioner" and n.target._opname in ("ring_attention",
           "seq_to_heads") for n in gm.graph.nodes):
        raise PassError("apply_context_parallel: the graph already has context-parallel attention; run the pass once")

    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        for key in _STALE:
            node.meta.pop(key, None)
    rw = _Rewriter(graph, info, degree=degree, group=group, mode=mode, seq_dim=seq_dim, tp=tp)
    rw.run()
    graph.eliminate_dead_code()
    graph.lint()
    graph._tracer_cls, graph._tracer_extras = None, {}  # a plain program (picklable), as the tp rewrite leaves it
    out = graph_module(gm, graph, class_name=type(gm).__name__)
    _carry_attributes(gm, out)
    out.meta.update({k: v for k, v in gm.meta.items() if k not in _STALE_GRAPH})
    out.meta[CAPTURE] = _local_capture(info, seq_dim, degree)
    out.meta[CONTEXT_PARALLEL] = ContextParallelPlan(
        mode=mode, degree=degree, group=group, seq_dim=seq_dim, seq_len=dims[seq_dim],
        sharded_inputs=tuple(rw.sharded), attention=rw.attention, positions=rw.positions, losses=rw.losses)
    return out


def context_parallel_problems(gm: fx.GraphModule, *, seq_dim: str = "seq") -> list[str]:
    """Why ``apply_context_parallel`` cannot rewrite ``gm`` at any degree (empty: it can): no
    symbolic sequence dim named ``seq_dim``, no attention, attention with an explicit mask or with
    dropout. What the planner asks before it offers cp > 1 (divisibility by a degree is the
    config's and the rewrite's to check)."""
    info: CaptureInfo | None = gm.meta.get(CAPTURE)
    if info is None:
        return ["the graph has no capture info (gm.meta['capture'])"]
    out = []
    if seq_dim not in dict(info.dims):
        out.append(f"the model's inputs name no {seq_dim!r} dim")
    elif seq_dim not in info.symbolic:
        out.append(f"the {seq_dim!r} dim was captured specialized, not symbolic")
    attention = [n for n in gm.graph.nodes if n.target is _SDPA]
    if not attention:
        out.append("the graph has no scaled_dot_product_attention to exchange the sequence in")
    return out + [p for node in attention for p in attention_problems(node)]


def attention_problems(node: fx.Node) -> list[str]:
    """Why the rewrite cannot cut one ``scaled_dot_product_attention`` node (empty: it can)."""
    a, out = sdpa_args(node), []
    if a["attn_mask"] is not None:
        out.append(f"attention {node.name!r} has an explicit attn_mask (only is_causal=True or no mask is cut)")
    if a["dropout_p"]:
        out.append(f"attention {node.name!r} has dropout_p={a['dropout_p']} (context-parallel attention has none)")
    return out


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of a ``scaled_dot_product_attention`` node by name, defaults filled in."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    return {**dict(zip(names, (None, None, None, None, 0.0, False))), **dict(zip(names, node.args)), **node.kwargs}


def _carry_attributes(gm: fx.GraphModule, out: fx.GraphModule) -> None:
    """Give ``out`` every parameter and buffer of ``gm`` under every name, shared: a GraphModule
    built from a graph copies only what its ``get_attr`` nodes read, and export reads a tied weight
    under one of its names (``lm_head.weight``), while the pipeline split names each stage's copy
    by the module that uses it (``wte.weight`` on the first stage)."""
    for kind, named in (("parameter", gm.named_parameters(remove_duplicate=False)),
                        ("buffer", gm.named_buffers(remove_duplicate=False))):
        for name, t in named:
            *path, leaf = name.split(".")
            parent = out
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            if not hasattr(parent, leaf):
                getattr(parent, f"register_{kind}")(leaf, t)


def _local_capture(info: CaptureInfo, seq_dim: str, degree: int) -> CaptureInfo:
    """The capture info as this rank's inputs see it: the sequence hint and bound per rank."""
    dims = tuple((n, v // degree if n == seq_dim else v) for n, v in info.dims)
    bounds = info.bounds
    new_dims = tuple(dataclasses.replace(b, high=None if b.high is None else b.high // degree)
                     if b.name == seq_dim else b for b in bounds.dims)
    return dataclasses.replace(info, dims=dims, bounds=dataclasses.replace(bounds, dims=new_dims))


def _val_shape(node: Any) -> tuple | None:
    val = node.meta.get(EXPORT_VAL) if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


class _Rewriter:
    def __init__(self, graph: fx.Graph, info: CaptureInfo, *, degree: int, group: str, mode: CPMode,
                 seq_dim: str, tp: int):
        self.graph, self.info = graph, info
        self.degree, self.group, self.mode, self.tp = degree, group, mode, tp
        self.seq_dim = seq_dim
        self.sharded: list[tuple[str, int]] = []
        self.seq_sizes: set[fx.Node] = set()  # nodes whose value is the (now local) sequence length
        self.attention = self.positions = self.losses = 0

    def run(self) -> None:
        seq_of = {spec.name: spec.shape.index(self.seq_dim) for spec in self.info.inputs if self.seq_dim in spec.shape}
        for node in self.graph.nodes:
            if node.op == "placeholder" and node.target in seq_of:
                self.sharded.append((node.target, seq_of[node.target]))
        sharded = dict(self.sharded)
        handlers = {_SDPA: self._attention, aten.cross_entropy_loss.default: self._loss,
                    aten.slice.Tensor: self._buffer_slice, **{t: self._arange for t in _ARANGES}}
        for node in list(self.graph.nodes):
            if node.target is aten.sym_size.int and node.args[0].op == "placeholder" \
                    and sharded.get(node.args[0].target) == node.args[1]:
                self.seq_sizes.add(node)
            elif node.target in handlers:
                before, meta = set(self.graph.nodes), dict(node.meta)
                handlers[node.target](node)
                # inserted nodes belong where the node they replace did (its block, module path)
                for new in set(self.graph.nodes) - before:
                    for k_, v_ in meta.items():
                        if k_ not in _STALE and k_ != EXPORT_VAL:
                            new.meta.setdefault(k_, v_)

    # --- positions ---------------------------------------------------------------------------------
    def _arange(self, node: fx.Node) -> None:
        args = list(node.args)
        if node.target is aten.arange.default:
            start, end, step = 0, args[0], 1
        else:
            start, end = args[0], args[1]
            step = args[2] if len(args) > 2 else 1
        if start != 0 or step != 1 or end not in self.seq_sizes:
            return
        users = list(node.users)
        with self.graph.inserting_after(node):
            pos = self.graph.call_function(cp_ops.load_balanced_positions.default, (node, self.degree, self.group))
        for user in users:
            user.replace_input_with(node, pos)
        self.positions += 1

    def _buffer_slice(self, node: fx.Node) -> None:
        x, dim, *rest = node.args
        start = rest[0] if rest else None
        end = rest[1] if len(rest) > 1 else None
        step = rest[2] if len(rest) > 2 else 1
        if x.op != "get_attr" or start not in (0, None) or step != 1 or end not in self.seq_sizes:
            return
        with self.graph.inserting_before(node):
            index = self.graph.call_function(aten.arange.default, (end,),
                                             {"dtype": torch.long, "device": torch.device(self.info.device)})
            pos = self.graph.call_function(cp_ops.load_balanced_positions.default, (index, self.degree, self.group))
            new = self.graph.call_function(aten.index_select.default, (x, dim, pos))
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.positions += 1

    # --- attention ------------------------------------------------------------------------------------
    def _attention(self, node: fx.Node) -> None:
        a = sdpa_args(node)
        if a["attn_mask"] is not None:
            raise PassError(f"apply_context_parallel: attention {node.name!r} has an explicit attn_mask, which "
                            f"context parallelism cannot cut; use is_causal=True or no mask")
        if a["dropout_p"]:
            raise PassError(f"apply_context_parallel: attention {node.name!r} has dropout_p={a['dropout_p']}; "
                            f"context-parallel attention has no attention dropout: set it to 0")
        q, k, v = a["query"], a["key"], a["value"]
        causal, scale, gqa = bool(a["is_causal"]), a.get("scale"), bool(a.get("enable_gqa", False))
        q_shape = _val_shape(q)
        if self.mode == "ulysses" and q_shape is not None and isinstance(q_shape[1], int):
            check_heads(q_shape[1], self.degree, "heads", self.tp)
        k_src, v_src = repeat_kv_source(k), repeat_kv_source(v)
        # The op reads the kv heads when each tp rank holds whole ones and (Ulysses) they divide
        # over its cp ranks; else the repeated heads, exact too
        if k_src is not None and v_src is not None and k_src[1] == v_src[1] and k_src[1] % self.tp == 0 \
                and (self.mode == "ring" or k_src[1] % (self.tp * self.degree) == 0):
            k, v, gqa = k_src[0], v_src[0], True
        if self.mode == "ulysses" and gqa:
            kv_shape = _val_shape(k)
            if kv_shape is not None and isinstance(kv_shape[1], int):
                check_heads(kv_shape[1], self.degree, "kv heads", self.tp)
        with self.graph.inserting_before(node):
            if self.mode == "ring":
                ring = self.graph.call_function(cp_ops.ring_attention.default,
                                                (q, k, v, causal, scale, self.degree, self.group))
                new = self.graph.call_function(operator.getitem, (ring, 0))
            else:
                heads = [self.graph.call_function(cp_ops.seq_to_heads.default, (t, self.degree, self.group))
                         for t in (q, k, v)]
                kwargs = {"scale": scale, "enable_gqa": gqa} if gqa else {"scale": scale}
                attn = self.graph.call_function(_SDPA, (*heads, None, 0.0, causal), kwargs)
                new = self.graph.call_function(cp_ops.heads_to_seq.default, (attn, self.degree, self.group))
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.attention += 1

    # --- loss -----------------------------------------------------------------------------------------
    def _loss(self, node: fx.Node) -> None:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        a = {**dict(zip(names, (None, None, None, _MEAN, -100, 0.0))), **dict(zip(names, node.args)), **node.kwargs}
        if a["reduction"] not in (_MEAN, _SUM):
            return  # per-token losses stay this rank's tokens
        if a["weight"] is not None and a["reduction"] == _MEAN:
            raise PassError(f"apply_context_parallel: class-weighted mean cross-entropy {node.name!r} is not "
                            f"supported under context parallelism; use reduction='sum' or no weight")
        g = self.group
        with self.graph.inserting_before(node):
            local = self.graph.call_function(aten.cross_entropy_loss.default,
                                             (a["input"], a["target"], a["weight"], _SUM, a["ignore_index"],
                                              a["label_smoothing"]))
            total = self.graph.call_function(cp_ops.reduce_from_cp.default, (local, self.degree, g))
            if a["reduction"] == _SUM:
                new = total
            else:
                kept = self.graph.call_function(aten.ne.Scalar, (a["target"], a["ignore_index"]))
                dtype = _loss_dtype(node)
                count = self.graph.call_function(aten.sum.default, (kept,), {"dtype": dtype})
                count = self.graph.call_function(cp_ops.reduce_from_cp.default, (count, self.degree, g))
                new = self.graph.call_function(aten.div.Tensor, (total, count))
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.losses += 1


def _loss_dtype(node: fx.Node) -> torch.dtype:
    val = node.meta.get(EXPORT_VAL)
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def repeat_kv_source(node: Any) -> tuple[fx.Node, int] | None:
    """``(k_kv, kv heads)`` when ``node`` is ``reshape(expand(unsqueeze(k_kv, 2), [b, kvh, rep, s, d]))``
    (the repeat_kv of grouped-query attention, an identity slice allowed before the unsqueeze), else None."""
    if not isinstance(node, fx.Node) or node.target not in _RESHAPES:
        return None
    e = node.args[0]
    if not isinstance(e, fx.Node) or e.target is not aten.expand.default:
        return None
    u = e.args[0]
    if not isinstance(u, fx.Node) or u.target is not aten.unsqueeze.default or u.args[1] != 2:
        return None
    src = u.args[0]
    while isinstance(src, fx.Node) and src.target is aten.slice.Tensor and tuple(src.args[1:3]) == (0, 0) \
            and (len(src.args) < 4 or src.args[3] >= 2**62):
        src = src.args[0]
    kvh = e.args[1][1]
    if not isinstance(src, fx.Node) or not isinstance(kvh, int):
        return None
    shape = _val_shape(src)
    if shape is not None and shape[1] != kvh:
        return None
    return src, kvh
