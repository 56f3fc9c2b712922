"""Tag: which nodes and parameters Megatron-style tensor parallelism shards, for a tp degree.

Writes ``node.meta[TENSOR_PARALLEL]`` (:class:`TPMeta`) on every node and
``gm.meta[TENSOR_PARALLEL_PLAN]`` (:class:`TensorParallelPlan`: one :class:`ParamSharding` per
parameter). ``apply_tensor_parallel`` rewrites from these facts.

Recognised patterns (Shoeybi et al. 2019), found by propagating a *sharded dim* forward:

* a linear (``aten.linear``, or ``aten.addmm`` of HF's Conv1D) whose input is replicated is a
  **column** seed: its output features are split across ranks;
* the split dim flows through views/reshapes (a ``hidden`` dim becomes the ``heads`` dim),
  transposes, splits (fused q/k/v: the weight is split per section), elementwise ops, RoPE,
  GQA's expand, and attention, to a linear whose input features are sharded: **row**
  (its output is all-reduced, its bias added once afterwards). Sizes that must be divided by
  the tp degree are those at the sharded dim (heads, kv heads, hidden/tp);
* context-parallel attention (:mod:`passes.ir.cp_ops`, written before this tagging) runs on the
  heads a tp rank holds: ``ring_attention`` and Ulysses' ``seq_to_heads`` / ``heads_to_seq``
  pass a shard by heads through (every cp rank of a tp rank holds that rank's heads);
* an embedding indexed by graph-input ids is a **vocab_embedding** (rows split);
* a column linear whose sharded output reaches ``cross_entropy_loss`` as its class dim is the
  **vocab_head** and the loss a **vocab_loss** (Megatron's vocabulary-parallel cross-entropy).

Whenever the sharded dim meets an op it cannot pass (a layer norm, a graph output, a size not
divisible by tp, a replicated operand of full size at the sharded dim, a parameter wanted
sharded two ways), every seed feeding that node is made replicated with the reason, and the
propagation runs again until nothing fails. Sizes come from ``node.meta[SHAPE]``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

import passes.ir.cp_ops  # noqa: F401  (defines the context-parallel ops matched below)
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import (SHAPE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN, ParamSharding, TensorParallelPlan,
                            TPMeta)

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_TRANSPOSES = {aten.transpose.int}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
# Ops passing a tensor through unchanged in shape (no pointwise tag on some of them).
_PASSTHROUGH = {aten.dropout.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
                aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
                aten.detach.default, aten.lift_fresh_copy.default}
_CHECKS = {aten._assert_tensor_metadata.default}  # no output; fine on a shard
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int}
_MAX_INT = 2 ** 62
_CP_BY_HEADS = {torch.ops.partitioner.seq_to_heads.default, torch.ops.partitioner.heads_to_seq.default}
_RING = torch.ops.partitioner.ring_attention.default


@dataclass(frozen=True)
class _Shard:
    """A sharded value during propagation: the dim, its sections and the seeds it comes from."""

    dim: int
    sections: tuple[int, ...]
    seeds: frozenset[str]


class _Fail(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def tag_tensor_parallel(gm: fx.GraphModule, ctx: Any = None, *, degree: int = 2) -> fx.GraphModule:
    """Tag ``gm`` for tensor parallelism over ``degree`` ranks; returns ``gm``.

    Needs ``node.meta[SHAPE]`` (runs ``annotate_shapes`` when missing). Nodes and parameters that
    cannot be sharded stay replicated with the reason in their :class:`TPMeta` / :class:`ParamSharding`.
    """
    if not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"tensor-parallel degree must be a positive int, got {degree!r}")
    if any(n.op == "call_function" and SHAPE not in n.meta for n in gm.graph.nodes):
        from passes.analysis.annotate_shapes import annotate_shapes
        annotate_shapes(gm)
    params = dict(gm.named_parameters(remove_duplicate=False))
    forced: dict[str, str] = {}  # seed node name -> why it must stay replicated
    refined: dict[str, tuple[int, ...]] = {}  # column seed -> sections discovered at a split
    for _ in range(4 * len(gm.graph.nodes) + 4):
        result = _propagate(gm, degree, params, forced, refined)
        if result is not None:  # None: a seed was forced replicated or refined; sweep again
            metas, plan = result
            break
    else:  # pragma: no cover - each retry forces a seed or refines one, so this cannot loop
        raise PassError("tensor_parallel_patterns: propagation did not converge")
    for node in gm.graph.nodes:
        node.meta[TENSOR_PARALLEL] = metas[node.name]
    gm.meta[TENSOR_PARALLEL_PLAN] = TensorParallelPlan(degree=degree, params=plan)
    return gm


# --- propagation ------------------------------------------------------------------------------
def _propagate(gm, degree, params, forced, refined):
    """One forward sweep. Returns None after forcing/refining a seed, else (metas, plan)."""
    state: dict[fx.Node, Any] = {}  # node -> _Shard | list[_Shard|None] | None (replicated)
    metas: dict[str, TPMeta] = {}
    wants: dict[str, list[tuple[str, ParamSharding]]] = {}  # param -> (node, sharding) per use

    def want(node, attr, sharding):
        wants.setdefault(attr.target, []).append((node.name, sharding))

    for node in gm.graph.nodes:
        try:
            meta, out = _visit(node, state, degree, params, forced, refined, want)
        except _Fail as f:
            seeds = _seeds_of(node, state)
            if not seeds:  # nothing sharded reaches here; the failing op is itself a seed
                seeds = frozenset({node.name})
            for s in seeds:
                forced.setdefault(s, f"{f.reason} (at {node.name})")
            return None
        except _Refine as r:
            for s in r.seeds:
                refined[s] = r.sections
            return None
        state[node] = out
        metas[node.name] = meta

    # One sharding per parameter: a tied weight (embedding + LM head) must agree across uses.
    plan: dict[str, ParamSharding] = {}
    for name in params:
        plan[name] = ParamSharding(dim=None, reason="not read by a tensor-parallel op")
    for target, uses in wants.items():
        first = uses[0][1]
        if any((s.dim, s.sections) != (first.dim, first.sections) for _, s in uses[1:]):
            for node_name, _ in uses:
                forced.setdefault(node_name, f"parameter {target} is wanted sharded differently by its uses "
                                             f"{[n for n, _ in uses]}")
            return None
        plan[target] = first
    # Aliases of one tensor (a tied ``wte.weight`` read as ``lm_head.weight``) share its sharding.
    by_id: dict[int, str] = {id(p): name for name, p in params.items() if name in wants}
    for name, p in params.items():
        if name not in wants and id(p) in by_id:
            s = plan[by_id[id(p)]]
            plan[name] = ParamSharding(dim=s.dim, sections=s.sections, reason=f"tied to {by_id[id(p)]}: {s.reason}")
    return metas, plan


class _Refine(Exception):
    def __init__(self, seeds, sections):
        super().__init__()
        self.seeds, self.sections = seeds, sections


def _seeds_of(node: fx.Node, state) -> frozenset[str]:
    out: set[str] = set()
    for a in node.all_input_nodes:
        v = state.get(a)
        for s in (v if isinstance(v, list) else [v]):
            if isinstance(s, _Shard):
                out |= s.seeds
    return frozenset(out)


def _shape(node: fx.Node) -> tuple[sympy.Expr, ...]:
    meta = node.meta.get(SHAPE)
    if meta is None or len(meta.tensors) != 1:
        raise _Fail(f"no single-tensor shape for {node.name}")
    return meta.tensor.shape


def _param(node: Any, params) -> fx.Node | None:
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in params:
        return node
    return None


def _is_int(x) -> bool:
    try:
        return sympy.Integer(x) == x
    except (TypeError, ValueError):
        return False


def _divisible(size, degree: int) -> bool:
    return _is_int(size) and int(size) % degree == 0


def _visit(node, state, degree, params, forced, refined, want):
    """TPMeta and propagated state of one node; raises _Fail / _Refine."""
    repl = TPMeta(role="replicated", reason="no sharded input")
    if node.op in ("placeholder", "get_attr"):
        reason = "parameter (see the plan)" if node.op == "get_attr" else "graph input"
        return TPMeta(role="replicated", reason=reason), None
    ins = {a: state.get(a) for a in node.all_input_nodes}
    if node.op == "output":
        if any(v is not None for v in ins.values()):
            raise _Fail("a sharded tensor is a graph output")
        return repl, None
    target = node.target
    sharded_in = [a for a, v in ins.items() if v is not None]

    if target is operator.getitem:
        src, idx = node.args
        v = state.get(src)
        if isinstance(v, list):
            s = v[idx]
            return (TPMeta(role="sharded", shard_dim=s.dim, sections=s.sections, reason="piece of a split")
                    if s else repl), s
        if v is not None:
            raise _Fail(f"getitem of sharded {src.name}")
        return repl, None

    # Seeds: linear/addmm with a parameter weight on replicated input; embedding on graph ids.
    if target in (aten.linear.default, aten.addmm.default):
        return _linear(node, state, degree, params, forced, refined, want)
    if target is aten.embedding.default:
        return _embedding(node, state, degree, params, forced, want)
    if target is aten.cross_entropy_loss.default and sharded_in:
        return _cross_entropy(node, state, degree)

    if not sharded_in:
        return repl, None
    first = state[sharded_in[0]]
    if isinstance(first, list):
        raise _Fail(f"{_op_name(node)} reads a split's list directly")
    seeds = frozenset().union(*(state[a].seeds for a in sharded_in))

    def out(dim, sections=None, reason=""):
        sh = _Shard(dim, first.sections if sections is None else sections, seeds)
        return TPMeta(role="sharded", shard_dim=dim, sections=sh.sections, reason=reason), sh

    if target in _CHECKS:
        return TPMeta(role="sharded", reason="metadata check"), None
    x = node.args[0]
    if target in _PASSTHROUGH:
        if state.get(x) is None:
            raise _Fail(f"{_op_name(node)} mixes sharded and replicated operands")
        return out(first.dim, reason="passes the shard through")
    if target in _TRANSPOSES:
        nd = len(_shape(x))
        d0, d1 = (d % nd for d in node.args[1:3])
        dim = d1 if first.dim == d0 else d0 if first.dim == d1 else first.dim
        return out(dim, reason="transpose")
    if target is aten.permute.default:
        perm = [d % len(node.args[1]) for d in node.args[1]]
        return out(perm.index(first.dim), reason="permute")
    if target is aten.unsqueeze.default:
        nd = len(_shape(node))
        d = node.args[1] % nd
        return out(first.dim + (1 if d <= first.dim else 0), reason="unsqueeze")
    if target is aten.expand.default:
        sizes = node.args[1]
        dim = first.dim + (len(sizes) - len(_shape(x)))
        if sizes[dim] not in (-1,) and not (_is_int(sizes[dim]) and _divisible(sizes[dim], degree)):
            raise _Fail(f"expand size {sizes[dim]} at the sharded dim is not divisible by tp={degree}")
        return out(dim, sections=(int(_shape(node)[dim]),), reason=f"expand: size at dim {dim} divided by tp")
    if target is aten.slice.Tensor:
        nd = len(_shape(x))
        d = (node.args[1] if len(node.args) > 1 else 0) % nd
        if d == first.dim:
            start = node.args[2] if len(node.args) > 2 else 0
            end = node.args[3] if len(node.args) > 3 else _MAX_INT
            step = node.args[4] if len(node.args) > 4 else 1
            if not (start == 0 and step == 1 and _is_int(end) and end >= _shape(x)[d]):
                raise _Fail("slice along the sharded dim")
        return out(first.dim, reason="slice of another dim")
    if target is aten.flatten.using_ints or target in _VIEWS:
        return _view(node, first, seeds, degree, out)
    if target in _SPLITS:
        return _split(node, first, seeds, degree)
    if target is aten.cat.default:
        tensors = node.args[0]
        nd = len(_shape(node))
        d = (node.args[1] if len(node.args) > 1 else 0) % nd
        if any(state.get(t) is None or state[t].dim != first.dim for t in tensors) or d == first.dim:
            raise _Fail("cat along the sharded dim or of mixed operands")
        return out(first.dim, reason="cat of another dim")
    if target is aten.scaled_dot_product_attention.default:
        q, k, v = node.args[:3]
        if any(state.get(t) is None or state[t].dim != len(_shape(t)) - 3 for t in (q, k, v)):
            raise _Fail("attention with q, k, v not all sharded by heads")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        _check_broadcast(mask, node, first.dim, state)
        dim = len(_shape(node)) - 3
        return out(dim, sections=(int(_shape(node)[dim]),), reason="attention by heads")
    if target in _CP_BY_HEADS:  # [B, H, S, D]: the all-to-all trades sequence for heads, dim 1 stays heads
        if first.dim != 1:
            raise _Fail(f"{_op_name(node)} of a tensor not sharded by heads")
        heads = _shape(node)[1]
        if not _divisible(heads, degree):
            raise _Fail(f"{heads} heads after {_op_name(node)} not divisible by tp={degree}")
        return out(1, sections=(int(heads),), reason="context-parallel exchange of this rank's heads")
    if target is _RING:  # -> (out [B, H, S, D], lse [B, H, S]), both by heads
        if any(state.get(t) is None or state[t].dim != 1 for t in node.args[:3]):
            raise _Fail("ring attention with q, k, v not all sharded by heads")
        shapes = node.meta[SHAPE].tensors
        sh = _Shard(1, (int(shapes[0].shape[1]),), seeds)
        return (TPMeta(role="sharded", shard_dim=1, sections=sh.sections, reason="ring attention by heads"),
                [sh, sh])
    if target in (aten.matmul.default, aten.bmm.default):
        a, b = node.args[:2]
        na = len(_shape(a))
        if not all(state.get(t) is not None and state[t].dim == first.dim for t in (a, b)) or first.dim >= na - 2:
            raise _Fail("matmul of sharded operands along a matrix dim")
        return out(first.dim, reason="batched matmul by heads")
    if target in _SOFTMAX:
        nd = len(_shape(x))
        if node.args[1] % nd == first.dim:
            raise _Fail("softmax along the sharded dim")
        return out(first.dim, reason="softmax of another dim")
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        for a in sharded_in:
            if state[a].dim - len(_shape(a)) != first.dim - len(_shape(sharded_in[0])):
                raise _Fail(f"{_op_name(node)} of operands sharded along different dims")
            if state[a].sections != first.sections:
                raise _Fail(f"{_op_name(node)} of operands with different sections")
        dim = first.dim + len(_shape(node)) - len(_shape(sharded_in[0]))
        for a in node.all_input_nodes:
            if state.get(a) is None:
                _check_broadcast(a, node, dim, state)
        return out(dim, reason="pointwise")
    raise _Fail(f"{_op_name(node)} cannot run on a shard")


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _check_broadcast(a, node, dim, state) -> None:
    """A replicated operand of a sharded op must be size 1 (or absent) at the sharded dim."""
    if not isinstance(a, fx.Node):
        return
    meta = a.meta.get(SHAPE)
    if meta is None or len(meta.tensors) != 1:
        return
    shape, nd = meta.tensor.shape, len(_shape(node))
    pos = dim - (nd - len(shape))
    if 0 <= pos < len(shape) and shape[pos] != 1:
        raise _Fail(f"replicated operand {a.name} has full size {shape[pos]} at the sharded dim")


def _linear(node, state, degree, params, forced, refined, want):
    is_addmm = node.target is aten.addmm.default
    x, w = (node.args[1], node.args[2]) if is_addmm else (node.args[0], node.args[1])
    bias = node.args[0] if is_addmm else (node.args[2] if len(node.args) > 2 else None)
    w_param, b_param = _param(w, params), _param(bias, params)
    xs = state.get(x)
    out_dim = len(_shape(node)) - 1
    if w_param is None or len(_shape(w)) != 2 or (bias is not None and b_param is None):
        if xs is not None or (bias is not None and state.get(bias) is not None):
            raise _Fail("matmul whose weight is not a parameter")
        return TPMeta(role="replicated", reason="weight is not a 2-D parameter"), None
    w_in, w_out = (0, 1) if is_addmm else (1, 0)  # Conv1D keeps weight as [in, out]
    if xs is not None:
        if xs.dim != len(_shape(x)) - 1:
            raise _Fail("linear input sharded along a dim other than its features")
        sections = xs.sections or (_shape(x)[-1],)
        want(node, w_param, ParamSharding(dim=w_in, sections=_ints(sections), reason=f"row-parallel {node.name}"))
        if b_param is not None:
            want(node, b_param, ParamSharding(dim=None, reason=f"bias of row-parallel {node.name}: added once "
                                                                "after the all-reduce"))
        return TPMeta(role="row", reason="input features sharded: partial sums all-reduced"), None
    if node.name in forced:
        reason = forced[node.name]
        want(node, w_param, ParamSharding(dim=None, reason=f"{node.name} kept replicated: {reason}"))
        if b_param is not None:
            want(node, b_param, ParamSharding(dim=None, reason=f"{node.name} kept replicated: {reason}"))
        return TPMeta(role="replicated", reason=reason), None
    n_out = _shape(w)[w_out]
    sections = refined.get(node.name, (n_out,))
    if not all(_divisible(s, degree) for s in sections):
        raise _Fail(f"output features {_ints(sections)} not divisible by tp={degree}")  # forces this seed
    want(node, w_param, ParamSharding(dim=w_out, sections=_ints(sections), reason=f"column-parallel {node.name}"))
    if b_param is not None:
        want(node, b_param, ParamSharding(dim=0, sections=_ints(sections), reason=f"bias of column-parallel {node.name}"))
    sh = _Shard(out_dim, _ints(sections), frozenset({node.name}))
    role = "vocab_head" if _reaches_loss(node) else "column"
    return TPMeta(role=role, shard_dim=out_dim, sections=sh.sections, reason="output features sharded"), sh


def _reaches_loss(node: fx.Node) -> bool:
    """Whether the linear's output flows (through shape ops only) into cross_entropy_loss."""
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target is aten.cross_entropy_loss.default:
                return True
            if u.target in _VIEWS or u.target in _PASSTHROUGH or u.target is aten.flatten.using_ints:
                frontier.append(u)
    return False


def _ints(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t)


def _embedding(node, state, degree, params, forced, want):
    w, idx = node.args[:2]
    w_param = _param(w, params)
    if w_param is None:
        return TPMeta(role="replicated", reason="embedding table is not a parameter"), None
    if state.get(idx) is not None:
        raise _Fail("embedding indexed by a sharded tensor")
    rows = _shape(w)[0]
    reason = forced.get(node.name)
    if reason is None and not _reads_graph_input(idx):
        reason = "indices are not token ids from a graph input (positions stay replicated, as in Megatron)"
    if reason is None and not _divisible(rows, degree):
        reason = f"{rows} rows not divisible by tp={degree}"
    if reason is not None:
        want(node, w_param, ParamSharding(dim=None, reason=f"{node.name}: {reason}"))
        return TPMeta(role="replicated", reason=reason), None
    want(node, w_param, ParamSharding(dim=0, sections=(int(rows),), reason=f"vocab-parallel embedding {node.name}"))
    return TPMeta(role="vocab_embedding", reason="rows sharded; out-of-range ids masked, then all-reduced"), None


def _reads_graph_input(node: fx.Node) -> bool:
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        if n.op == "call_function" and n.target is not aten.sym_size.int:
            frontier.extend(n.all_input_nodes)
    return False


def _cross_entropy(node, state, degree):
    logits, target = node.args[:2]
    s = state.get(logits)
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if state.get(target) is not None:
        raise _Fail("cross-entropy targets are sharded")
    if len(_shape(logits)) != 2 or s.dim != 1 or len(s.sections) > 1:
        raise _Fail("cross-entropy over logits not [tokens, vocab] sharded by vocabulary")
    if weight is not None or smoothing:
        raise _Fail("vocab-parallel cross-entropy supports no class weights or label smoothing")
    return TPMeta(role="vocab_loss", reason="Megatron vocab-parallel CE: max, sum-exp, target-logit all-reduces"), None


def _view(node, first, seeds, degree, out):
    """Map the sharded dim through a view/reshape/flatten by grouping dims of equal products."""
    src, dst = list(_shape(node.args[0])), list(_shape(node))
    groups = _groups(src, dst)
    if groups is None:
        raise _Fail(f"cannot match view dims {src} -> {dst}")
    for ins, outs in groups:
        if first.dim not in ins:
            continue
        lead_in = [i for i in ins if src[i] != 1]
        lead_out = [o for o in outs if dst[o] != 1]
        if not lead_in or lead_in[0] != first.dim or not lead_out:
            raise _Fail("view splits the sharded dim below an outer dim")
        dim = lead_out[0]
        if not _divisible(dst[dim], degree):
            raise _Fail(f"size {dst[dim]} at the sharded dim after the view is not divisible by tp={degree}")
        if len(first.sections) > 1 and (len(ins) != 1 or len(outs) != 1):
            raise _Fail("view reshapes a dim made of several sections (fused q/k/v)")
        sections = first.sections if len(first.sections) > 1 else (int(dst[dim]),)
        return out(dim, sections=sections, reason=f"view: size at dim {dim} divided by tp")
    raise _Fail("sharded dim lost in a view")  # pragma: no cover


def _groups(src, dst):
    """Pair runs of dims with equal products: [([src dims], [dst dims]), ...] or None."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi, pj = sympy.Integer(1), sympy.Integer(1)
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while not _same_size(pi, pj):
            if i >= len(src) and j >= len(dst):
                return None
            # grow the side whose product is (numerically at the hints) smaller
            grow_src = j >= len(dst) or (i < len(src) and _num(pi) < _num(pj))
            if grow_src:
                gi.append(i); pi *= src[i]; i += 1
            else:
                gj.append(j); pj *= dst[j]; j += 1
        # trailing size-1 dims join the current group
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i); i += 1
        groups.append((gi, gj))
    return groups


def _same_size(a, b) -> bool:
    """Whether sizes ``a`` and ``b`` (products of dims) are equal. ``expand`` decides it for
    polynomials in the dims, the usual case, ~100x faster than ``simplify`` (tens of ms a call);
    ``simplify`` only for anything else (floor, Mod, ...)."""
    diff = sympy.expand(a - b)
    if diff == 0:
        return True
    if diff.is_polynomial():  # expanded polynomials are canonical: nonzero means different
        return False
    return sympy.simplify(diff) == 0


def _num(expr) -> float:
    # Symbolic dims are at least 2; substituting 7 orders products of hidden sizes and dims.
    return float(sympy.sympify(expr).subs({s: 7 for s in sympy.sympify(expr).free_symbols}))


def _split(node, first, seeds, degree):
    x = node.args[0]
    shape = _shape(x)
    nd = len(shape)
    target = node.target
    d = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    size = shape[d]
    if target is aten.chunk.default:
        n = node.args[1]
        pieces = [size / n] * n
    elif target is aten.split_with_sizes.default:
        pieces = list(node.args[1])
    else:
        step = node.args[1]
        pieces = [step] * int(sympy.ceiling(size / step))
    if d != first.dim:
        sh = _Shard(first.dim, first.sections, seeds)
        return (TPMeta(role="sharded", shard_dim=first.dim, sections=first.sections, reason="split of another dim"),
                [sh] * len(pieces))
    pieces = tuple(int(p) for p in pieces)
    if first.sections != pieces:
        if len(first.sections) == 1:
            raise _Refine(seeds, pieces)  # the seed's weight must be split per section
        raise _Fail(f"split {pieces} does not match sections {first.sections}")
    if target is aten.chunk.default:
        raise _Fail("chunk along the sharded dim")
    if not all(p % degree == 0 for p in pieces):
        raise _Fail(f"split sizes {pieces} not divisible by tp={degree}")
    return (TPMeta(role="sharded", shard_dim=d, sections=pieces, reason="split into sections, each sharded"),
            [_Shard(d, (p,), seeds) for p in pieces])


def sharded_param_bytes(gm: fx.GraphModule) -> tuple[int, int]:
    """``(bytes of parameters the plan shards, bytes of all parameters)``, tied ones counted once."""
    plan: TensorParallelPlan = gm.meta[TENSOR_PARALLEL_PLAN]
    sharded = total = 0
    for name, p in gm.named_parameters():  # deduplicated: a tied weight once
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if plan.params[name].dim is not None:
            sharded += nbytes
    return sharded, total
