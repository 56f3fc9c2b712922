"""The step simulation of the memory analysis: model state per parameter, then the liveness of
one steady-state training step over forward, backward and the optimizer step (see
:mod:`passes.analysis.annotate_memory` for what is allocated and freed when, and
:class:`passes.analysis.liveness.Timeline` for the symbolic peak).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from passes.ir.config import is_mixed
from passes.ir.optimizers import OptimizerModel
from passes.analysis.graph_view import view_of_run
from passes.ir.errors import PassError
from passes.ir.meta import TENSOR_REMAT
from passes.analysis.liveness import MemoryObserver, Timeline
from passes.solvers.remat_solver import may_recompute, problem_from_view, recompute_schedule
from passes.analysis.saved_tensors import (_ForwardRun, _grad_inputs, _is_getitem, _output_nodes, _requires_grad,
                                           _Storage)

aten = torch.ops.aten
_ZERO = sympy.Integer(0)

# Precision-mixed training keeps 2-byte (bf16/fp16) parameters and gradients and fp32 master
# weights and optimizer state.
_HALF_BYTES = 2
_FP32_BYTES = 4
_STEP_BYTES = 4  # torch.optim keeps a 0-dim float32 ``step`` tensor per parameter for Adam(W)


# Ops whose backward hands the output gradient to an input unchanged (no new buffer): reshapes
# (a view of a contiguous gradient), copies and same-dtype casts (identity backward).
_PASS_THROUGH = {
    aten.reshape.default, aten.flatten.using_ints, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.view_as.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten.type_as.default, aten.unflatten.int,
    # sum's backward expands the output gradient: a view, no new buffer
    aten.sum.default, aten.sum.dim_IntList,
}
# add(a, b): both inputs receive the output gradient itself when their shape is the output's.
_ADD = {aten.add.Tensor, aten.add_.Tensor}
_SUB = {aten.sub.Tensor, aten.sub_.Tensor}
_DROPOUT = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default}


# ---------------------------------------------------------------------------------------------
# Model state.

@dataclass
class _ModelState:
    """Bytes of each parameter storage that is trained (gets a gradient)."""

    first_node: dict[_Storage, fx.Node]  # the get_attr node that carries each parameter's bytes
    numel: dict[_Storage, sympy.Expr]
    numel_hint: dict[_Storage, int]
    param: dict[_Storage, tuple[sympy.Expr, int]]
    grad: dict[_Storage, tuple[sympy.Expr, int]]
    opt: dict[_Storage, tuple[sympy.Expr, int]]
    state_elem_bytes: int  # bytes per element of optimizer state tensors (for temporaries)

    def total(self, what: str) -> sympy.Expr:
        if what == "numel":
            return sympy.expand(sympy.Add(*self.numel.values()))
        table = {"param": self.param, "grad": self.grad, "opt": self.opt}[what]
        return sympy.expand(sympy.Add(*[v[0] for v in table.values()]))


def _model_state(run: _ForwardRun, opt: OptimizerModel, dtype: str) -> _ModelState:
    mixed = is_mixed(dtype)  # 16-bit params/grads, fp32 masters and optimizer state
    state = _ModelState(first_node={}, numel={}, numel_hint={}, param={}, grad={}, opt={}, state_elem_bytes=_FP32_BYTES)
    for node in run.order:
        if node.op == "get_attr":
            for st in run.node_storages[node]:
                if st.kind == "param":
                    state.first_node.setdefault(st, node)
    for st in run.param_order:
        itemsize = run.itemsize[st]
        numel = st.size / itemsize
        state.numel[st] = numel
        state.numel_hint[st] = st.hint // itemsize
        p_bytes = _HALF_BYTES if mixed else itemsize
        state.param[st] = (numel * p_bytes, st.hint // itemsize * p_bytes)
        if st not in run.param_with_grad:
            continue  # no gradient, so no optimizer state either
        state_bytes = _FP32_BYTES if mixed else itemsize
        state.state_elem_bytes = state_bytes
        per_elem = opt.state_tensors * state_bytes + (_FP32_BYTES if mixed else 0)  # + master
        fixed = _STEP_BYTES if opt.step_tensor else 0
        state.grad[st] = state.param[st]
        state.opt[st] = (numel * per_elem + fixed, st.hint // itemsize * per_elem + fixed)
    return state


# ---------------------------------------------------------------------------------------------
# Liveness over one step.

class _Grads:
    """Gradient buffers with reference counts (one buffer may be several tensors' gradient)."""

    def __init__(self, timeline: Timeline):
        self.tl = timeline
        self.refs: dict[tuple[str, int], int] = {}
        self.slot: dict[tuple[fx.Node, int], tuple[str, int]] = {}  # (node, output index) -> buffer
        self._ids = itertools.count()

    def new(self, size: tuple[sympy.Expr, int]) -> tuple[str, int]:
        key = ("grad", next(self._ids))
        self.tl.alloc(key, *size)
        self.refs[key] = 1
        return key

    def ref(self, key: tuple[str, int]) -> tuple[str, int]:
        self.refs[key] += 1
        return key

    def unref(self, key: tuple[str, int]) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.tl.free(key)

    def add(self, slot: tuple[fx.Node, int], key: tuple[str, int], size: tuple[sympy.Expr, int]) -> None:
        """Accumulate gradient buffer ``key`` (a reference we own) into ``slot``."""
        old = self.slot.get(slot)
        if old is None:
            self.slot[slot] = key
        elif self.refs[old] == 1:
            self.unref(key)  # added in place into the buffer the slot owns
        else:
            self.slot[slot] = self.new(size)  # shared buffer: out-of-place sum
            self.unref(old)
            self.unref(key)


def _accumulate_param(grads: _Grads, param_grad: dict[_Storage, tuple[str, int]], st: _Storage,
                      key: tuple[str, int], grad_size: tuple[sympy.Expr, int], key_hint: int) -> None:
    """AccumulateGrad: the first gradient of a parameter becomes its ``.grad`` (the buffer is
    stolen when nobody else holds it and it has the ``.grad`` size, else copied); later ones
    (tied parameters) are added in place and released."""
    if st in param_grad:
        grads.unref(key)
    elif grads.refs[key] == 1 and key_hint == grad_size[1]:
        param_grad[st] = key
    else:
        param_grad[st] = grads.new(grad_size)
        grads.unref(key)


@dataclass(frozen=True)
class TensorRematEvents:
    """What a per-tensor recompute decision (``node.meta[TENSOR_REMAT]``) changes in the step, as
    :func:`passes.solvers.remat_solver.recompute_schedule` times it and the executor runs it:
    ``recomputed`` storages (of recomputed nodes) are not kept after forward; at the start of a
    node's backward, ``remade[node]`` lists its recomputes in forward order as (storages made,
    timeline keys freed right after: sources whose last use was that recompute and that nothing
    unpacks here); after the node's backward its ``dropped`` recomputed storages are freed; a
    needed storage of a node not recomputed is freed after the backward of ``release[storage]``
    (None: kept until backward ends) unless a recompute freed it (``freed_early``)."""

    recomputed: frozenset[_Storage]
    remade: dict[fx.Node, list[tuple[list[_Storage], list[Any]]]]
    dropped: dict[fx.Node, list[_Storage]]
    release: dict[_Storage, fx.Node | None]
    freed_early: frozenset[_Storage]


def tensor_remat_events(gm: fx.GraphModule, run: _ForwardRun) -> TensorRematEvents | None:
    """The :class:`TensorRematEvents` of ``gm``'s per-tensor recompute decision (None without one)."""
    chosen = {n.name for n in gm.graph.nodes if getattr(n.meta.get(TENSOR_REMAT), "recompute", False)}
    if not chosen:
        return None
    view = view_of_run(gm, run)
    problem = problem_from_view(view)
    unknown = chosen - {n for n, ok in zip(problem.nodes, may_recompute(problem, "peak")) if ok}
    if unknown:
        raise PassError(f"memory analysis: node {sorted(unknown)[0]!r} is marked for recompute but cannot be "
                        f"recomputed on demand (no activation of its own, written in place, or kept for a backward "
                        f"that never runs); decide again on this graph with the peak bound")
    sched = recompute_schedule(problem, [n in chosen for n in problem.nodes])
    at = list(gm.graph.nodes)  # the view's positions are places in the graph
    storage_of = view.graph["storage_of"]

    def node(position: float) -> fx.Node | None:
        return at[int(position)] if position >= 0 else None

    def storage(j: int) -> _Storage:
        return storage_of[problem.storages[j].name]

    made = {v: [storage(j) for j in js] for v, js in sched.made.items()}

    def unpacked(j: int, q: int) -> bool:
        return problem.storages[j].kept and q in problem.storages[j].used_at

    # A source whose last use falls on a recompute at the moment it is dropped, with no unpack of
    # it there, goes right after the last recompute reading it (the executor's use count hits 0).
    last_reader: dict[tuple[str, int], int] = {}  # ("node", v) / ("storage", j) -> recompute freeing it
    owned_by: dict[int, list[int]] = {}
    for j, st in enumerate(problem.storages):
        owned_by.setdefault(st.owner, []).append(j)
    for v, q in sched.recompute_at.items():
        owned = owned_by.get(v, [])
        readers = [w for j in owned for w in problem.storages[j].readers if sched.recompute_at.get(w) == q]
        if sched.free_after[v] == q and readers and not any(unpacked(j, q) for j in owned):
            last_reader["node", v] = max(readers)
    for j, end in sched.storage_free_after.items():
        readers = [w for w in problem.storages[j].readers if sched.recompute_at.get(w) == end]
        if readers and not unpacked(j, int(end)):
            last_reader["storage", j] = max(readers)
    frees: dict[int, list[Any]] = {}
    for (kind, k), w in last_reader.items():
        keys = [("tensor_remat", st) for st in made[k]] if kind == "node" else [storage(k)]
        frees.setdefault(w, []).extend(keys)
    remade: dict[fx.Node, list[tuple[list[_Storage], list[Any]]]] = {}
    dropped: dict[fx.Node, list[_Storage]] = {}
    for v in sorted(sched.recompute_at):
        remade.setdefault(node(sched.recompute_at[v]), []).append((made[v], frees.get(v, [])))
        if ("node", v) not in last_reader and node(sched.free_after[v]) is not None:
            dropped.setdefault(node(sched.free_after[v]), []).extend(made[v])
    return TensorRematEvents(
        recomputed=frozenset(storage(j) for j, st in enumerate(problem.storages) if problem.nodes[st.owner] in chosen),
        remade=remade, dropped=dropped,
        release={storage(j): node(end) for j, end in sched.storage_free_after.items()},
        freed_early=frozenset(storage(k) for kind, k in last_reader if kind == "storage"))


def _simulate_step(run: _ForwardRun, state: _ModelState, opt: OptimizerModel, *, device: str,
                   hints: dict[sympy.Symbol, int], remat: TensorRematEvents | None = None,
                   observer: MemoryObserver | None = None):
    tl = Timeline(observer)
    tl.at("forward", "(model state)")
    for st in run.storages.values():
        if st.kind == "param" and st in state.param:
            tl.alloc(("param", st), *state.param[st])
            if st in state.opt:
                tl.alloc(("opt", st), *state.opt[st])
        elif st.kind in ("buffer", "input"):
            tl.alloc(st, st.size, st.hint)

    # Forward: allocate each node's new storages; free unsaved ones after their last use.
    recomputed = remat.recomputed if remat is not None else frozenset()
    held = remat.release if remat is not None else {}
    dies_at: dict[int, list[_Storage]] = {}
    for st in run.storages.values():
        unkept = st in recomputed or (st.release_at is None and st not in held)  # held: a recompute reads it
        if st.kind in ("activation", "internal") and unkept and not st.graph_output \
                and not st.cached:  # a selective checkpoint holds it until the region's replay
            dies_at.setdefault(max(st.last_use, st.index), []).append(st)
    born: dict[fx.Node, list[_Storage]] = {}
    for st in run.storages.values():
        if st.kind in ("activation", "internal"):
            born.setdefault(st.owner, []).append(st)
    release: dict[fx.Node, list[Any]] = {}  # node -> timeline keys freed after its backward
    for st in run.storages.values():
        if st in recomputed or st.kind not in ("activation", "internal"):
            pass  # graph inputs stay with the caller
        elif st in held:
            if held[st] is not None and st not in remat.freed_early:
                release.setdefault(held[st], []).append(st)
        elif st.release_at is not None and not st.cached:
            release.setdefault(st.release_at, []).append(st)
        if st.re_release_at is not None:
            release.setdefault(st.re_release_at, []).append(("re", st))
    recompute_dies = _recompute_deaths(run, born)
    for i, node in enumerate(run.order):
        tl.at("forward", node.name)
        for st in born.get(node, ()):
            tl.alloc(st, st.size, st.hint)
        for st in dies_at.get(i, ()):
            tl.free(st)

    # Backward: reverse node order over the nodes the loss's gradient reaches.
    grads = _Grads(tl)
    param_grad: dict[_Storage, tuple[str, int]] = {}
    for out in _output_nodes(run):
        if _requires_grad(run.values.get(out)):
            tl.at("backward", out.name)
            grads.add((out, 0), grads.new(_tensor_bytes(run, run.values[out])), _tensor_bytes(run, run.values[out]))
    for node in reversed(run.order):
        if node not in run.runs_backward:
            continue
        tl.at("backward", node.name)
        for made, gone in remat.remade.get(node, ()) if remat is not None else ():  # its unpacks recompute first
            for st in made:
                tl.alloc(("tensor_remat", st), st.size, st.hint)
            for key in gone:
                tl.free(key)
        mine = [k for k in list(grads.slot) if k[0] is node]
        outs = [grads.slot.pop(k) for k in mine]
        if node in run.regions:
            # The region's outputs take the gradients, then its forward is replayed.
            for (_, idx), key in zip(mine, outs):
                out = run.region_outputs[node][idx]
                grads.add((out, 0), key, _tensor_bytes(run, run.values[out]))
            # torch.utils.checkpoint stops the replay once the last node that saves a tensor
            # has run again; what the replay made that nobody saves dies with it.
            inner_nodes = run.regions[node]
            stop = max((k + 1 for k, n in enumerate(inner_nodes) if run.saved_by.get(n)), default=0)
            for inner in inner_nodes[:stop]:
                tl.at("backward", f"{inner.name} (recompute)")
                for st in born.get(inner, ()):
                    if st.cached:  # the forward's tensor itself serves the recompute
                        tl.free(st)
                    tl.alloc(("re", st), st.size, st.hint)
                for st in recompute_dies.get(inner, ()):
                    tl.free(("re", st))
            for inner in inner_nodes[:stop]:
                for st in born.get(inner, ()):
                    if st.re_release_at is None and tl.is_live(("re", st)):
                        tl.free(("re", st))
            continue
        if _is_getitem(node):
            parent, idx = node.args[0], node.args[1]
            for key in outs:
                grads.add((parent, idx), key, _tensor_bytes(run, run.values[node]))
            continue
        # Gradients of differentiable tensors made inside the op (a composite op runs several
        # autograd nodes, e.g. attention's math path: scores, softmax, dropout, matmul): its
        # backward walks them latest first, each made from the one after it, which dies then;
        # the earliest one is live while the op's input gradients are computed.
        inner = [st for st in born.get(node, ()) if st.inner_grad is not None]
        for k, st in enumerate(reversed(inner)):
            tl.alloc(("inner", st), *st.inner_grad)
            if k:
                tl.free(("inner", inner[len(inner) - k]))
        inner = inner[:1]
        for pos, src in _grad_inputs(run, node):
            value = run.values[src]
            if outs and _passes_through(run, node, pos, src) and len(outs) == 1:
                key = grads.ref(outs[0])
            else:
                key = grads.new(_tensor_bytes(run, value))
            params = [st for st in run.node_storages.get(src, ()) if st in state.grad] if src.op == "get_attr" else []
            if params:
                _accumulate_param(grads, param_grad, params[0], key, state.grad[params[0]],
                                  _tensor_bytes(run, value)[1])
                tl.observer.param_grad(param_grad[params[0]], run.param_names[params[0]])
            elif src.op == "get_attr":
                grads.unref(key)  # a frozen parameter or buffer: the gradient is dropped
            else:
                grads.add((src, 0), key, _tensor_bytes(run, value))
        for key in outs:
            grads.unref(key)
        for st in inner:
            tl.free(("inner", st))
        for key in release.get(node, ()):
            tl.free(key)
        for st in remat.dropped.get(node, ()) if remat is not None else ():
            tl.free(("tensor_remat", st))

    # Optimizer step: parameters, gradients and state are live; the update adds temporaries.
    if opt.temporaries(device) and state.opt:
        elem = state.state_elem_bytes
        if opt.implementation(device) == "foreach":
            tl.at("optimizer", "(all parameters)")
            total = sympy.expand(sympy.Add(*[state.numel[st] for st in state.opt]) * elem)
            tl.alloc(("tmp", 0), total, sum(state.numel_hint[st] for st in state.opt) * elem)
            tl.free(("tmp", 0))
        else:
            # One parameter at a time, in the optimizer's order: ``denom = sqrt(v) / c`` holds
            # two temporaries of this parameter's size while the previous parameter's ``denom``
            # (a local not yet rebound) is still alive.
            best, best_hint, prev = None, -1, None
            for st in run.param_order:
                if st not in state.opt:
                    continue  # no gradient: the optimizer skips it
                hint = 2 * state.numel_hint[st] + (state.numel_hint[prev] if prev is not None else 0)
                if hint > best_hint:
                    best, best_hint = (st, prev), hint
                prev = st
            st, prev = best
            tl.at("optimizer", state.first_node[st].name if st in state.first_node else "")
            size = (state.numel[st] * elem, state.numel_hint[st] * elem)
            if prev is not None:
                tl.alloc(("tmp", 2), state.numel[prev] * elem, state.numel_hint[prev] * elem)
            tl.alloc(("tmp", 0), *size)  # exp_avg_sq.sqrt()
            tl.alloc(("tmp", 1), *size)  # ... / bias_correction2_sqrt
            for key in (("tmp", 0), ("tmp", 1), ("tmp", 2)):
                if tl.is_live(key):
                    tl.free(key)
    else:
        tl.at("optimizer", "(step)")
        tl.alloc(("tmp", 0), _ZERO, 0)
        tl.free(("tmp", 0))
    return tl.peak(hints)


def _recompute_deaths(run: _ForwardRun, born: dict[fx.Node, list[_Storage]]) -> dict[fx.Node, list[_Storage]]:
    """Region node -> recomputed storages freed right after it runs in the replayed forward: the
    region's storages no region node saves, after their last use inside the region."""
    dies: dict[fx.Node, list[_Storage]] = {}
    for nodes in run.regions.values():
        last: dict[_Storage, fx.Node] = {}
        for node in nodes:
            for st in born.get(node, ()):
                last[st] = node
            for src in node.all_input_nodes:
                for st in run.node_storages.get(run.alias.get(src, src), ()):
                    if st in last:
                        last[st] = node
        for st, node in last.items():
            if st.re_release_at is None:
                dies.setdefault(node, []).append(st)
    return dies


def _tensor_bytes(run: _ForwardRun, t: torch.Tensor) -> tuple[sympy.Expr, int]:
    return run.size(t.numel() * t.element_size())


def _passes_through(run: _ForwardRun, node: fx.Node, pos: int, src: fx.Node) -> bool:
    """Does ``node``'s backward give input ``src`` the output gradient itself (no new buffer)?"""
    out = run.values.get(node)
    if not isinstance(out, torch.Tensor):
        return False
    src_value = run.values[src]
    same_shape = tuple(src_value.shape) == tuple(out.shape) and src_value.dtype == out.dtype
    if run.node_storages.get(node) and run.node_storages.get(src) \
            and run.node_storages[node][0] is run.node_storages[src][0]:
        return True  # a view: its backward is a view of the gradient
    target = node.target
    if target in _PASS_THROUGH:
        return src_value.dtype == out.dtype
    if target is aten.cat.default:  # each input's gradient is a narrow view of the output's
        return src_value.dtype == out.dtype
    if target in _ADD:
        return same_shape and "alpha" not in node.kwargs
    if target in _SUB:
        return same_shape and pos == 0
    if target in _DROPOUT:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return same_shape and (p == 0 or not train)
    return False
