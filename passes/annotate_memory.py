"""Analysis: bytes of one training step — model state, saved activations, and the peak.

Three facts, all sympy expressions in the named dims (integers when the capture is concrete):

1. **Model state** per parameter (``get_attr`` of a ``Parameter``; tied parameters once):
   parameter, gradient and optimizer-state bytes from :data:`OPTIMIZERS`.
2. **Saved activations**: what autograd really keeps. The graph runs forward on fake tensors
   inside ``torch.autograd.graph.saved_tensors_hooks``; every packed tensor is attributed to the
   node running at that moment (its *saver*). Storages are deduplicated (views count once) and
   each is charged to its *owner*: the node whose output first had the storage, or the saver
   itself for tensors made inside an op (dropout mask, layer-norm mean/rstd, attention
   logsumexp, the log-softmax of a cross entropy). Parameters and buffers are not activations;
   graph inputs that are saved (token ids, targets) are counted separately as input bytes.
3. **Peak** of one steady-state step (optimizer state exists, gradients were set to ``None``):
   a liveness simulation (:class:`passes.liveness.Timeline`) over

   * forward, in node order: each node's new output storages and internal saved tensors are
     allocated; a storage nobody saves is freed after its last use (over all its views);
   * backward, in reverse node order, for nodes the loss's gradient reaches: each input that
     requires grad gets a gradient buffer of its size, except where the op passes the output
     gradient through unchanged (views, reshape/flatten/clone, same-shape add); a second
     gradient for the same tensor is added in place (a transient buffer). The output's gradient
     is freed after the node's backward, and so are the saved storages whose earliest saver
     (the last to run backward) it is. Parameter gradients accumulate and stay;
   * optimizer step: parameters + gradients + state, plus the update's temporaries (see
     :class:`OptimizerModel`).

   ``peak_phase``/``peak_node`` say where the peak is at the dims' hint values; ``peak_bytes``
   is the ``sympy.Max`` of the live totals at the step's local maxima that are the largest
   somewhere on a grid of dims values around the hints (see :mod:`passes.liveness`), so it is
   the simulated peak at the hints and across that grid, not only at the hints (a single
   expression for a concrete capture).

Checkpointed regions (``checkpoint(%submodule, *inputs)`` calls from ``apply_checkpoint``): the fake
run interprets the submodule node by node without checkpointing, so its nodes join the node order
just before the call and every save is seen. A storage made inside a region and saved only by
nodes of that region is not kept after forward (freed after its last use there); the region's
inputs are kept until the end of the region's backward (``torch.utils.checkpoint`` holds them).
At the call's backward the region's forward is replayed: its storages are allocated again
(unsaved ones freed after their last use in the region, saved ones at their saver's backward),
then the region's nodes run backward as in an unchecked graph. ``activation_bytes`` is then what
stays saved between forward and backward with the regions checkpointed.

Not modelled: scratch tensors an op allocates and frees inside itself without saving them, and
allocator rounding/fragmentation (sizes are exact storage bytes, as MemTracker counts on CPU).
"""
from __future__ import annotations

import itertools
import operator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from partitioner.errors import ConfigError
from passes.annotate_flops import checkpoint_submodule
from passes.fake_execution import FakeContext, FakeInterpreter, capture_info, fake_attrs, fake_context, fake_inputs
from passes.liveness import Timeline
from passes.meta import MEMORY, MEMORY_SUMMARY, MemoryMeta, MemorySummary, SavedTensor

aten = torch.ops.aten
_ZERO = sympy.Integer(0)

# Precision-mixed training keeps 2-byte (bf16/fp16) parameters and gradients and fp32 master
# weights and optimizer state.
_HALF_BYTES = 2
_FP32_BYTES = 4
_STEP_BYTES = 4  # torch.optim keeps a 0-dim float32 ``step`` tensor per parameter for Adam(W)


@dataclass(frozen=True, kw_only=True)
class OptimizerModel:
    """Memory of one optimizer, as ``torch.optim`` implements it.

    * ``state_tensors``: per-element state tensors per parameter (Adam: ``exp_avg`` and
      ``exp_avg_sq``; SGD with momentum: ``momentum_buffer``; plain SGD: none). Each has the
      parameter's dtype (fp32 with mixed precision).
    * ``step_tensor``: a 0-dim fp32 ``step`` per parameter (Adam/AdamW), counted because
      ``MemTracker`` counts it.
    * ``sqrt_temporaries``: the update computes ``exp_avg_sq.sqrt() / c`` — two parameter-sized
      temporaries live at once in the single-tensor (CPU) implementation, one buffer the size of
      all parameters in the ``foreach`` (CUDA) implementation.
    """

    name: str
    state_tensors: int
    step_tensor: bool
    sqrt_temporaries: bool


OPTIMIZERS: dict[str, OptimizerModel] = {
    # "sgd" is SGD without momentum (torch's default): no state, in-place update, no temporaries.
    "sgd": OptimizerModel(name="sgd", state_tensors=0, step_tensor=False, sqrt_temporaries=False),
    "sgd-momentum": OptimizerModel(name="sgd-momentum", state_tensors=1, step_tensor=False, sqrt_temporaries=False),
    "adam": OptimizerModel(name="adam", state_tensors=2, step_tensor=True, sqrt_temporaries=True),
    "adamw": OptimizerModel(name="adamw", state_tensors=2, step_tensor=True, sqrt_temporaries=True),
}

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


def annotate_memory(gm: fx.GraphModule, ctx: Any = None, *, optimizer: str = "adamw",
                    mixed_precision: bool = False) -> fx.GraphModule:
    """Write :class:`MemoryMeta` (bytes) under ``node.meta[MEMORY]`` for every node and the
    step's :class:`MemorySummary` (bytes) under ``gm.meta[MEMORY_SUMMARY]``; returns ``gm``.

    ``optimizer`` is one of :data:`OPTIMIZERS`; ``mixed_precision`` models bf16/fp16 parameters
    and gradients (2 bytes each per element) with fp32 master weights (4) and fp32 optimizer
    state (Adam: 8), i.e. 16 bytes per parameter element for Adam. Activation bytes always come
    from the graph's own dtypes: capture a bf16 model to get bf16 activations.
    """
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    opt = OPTIMIZERS[optimizer]
    info = capture_info(gm)
    run = observe_saved_tensors(gm)
    state = _model_state(run, opt, mixed_precision)
    _write_node_meta(run, state)
    foreach = info.device == "cuda"
    peak = _simulate_step(run, state, opt, foreach=foreach, hints=info.symbols())

    activation = sympy.expand(sympy.Add(*[s.size for s in run.storages.values()
                                          if s.kept and s.kind in ("activation", "internal")]))
    inputs = sympy.expand(sympy.Add(*[s.size for s in run.storages.values() if s.kept and s.kind == "input"]))
    notes = [
        f"optimizer {optimizer}: {'foreach' if foreach else 'single-tensor'} implementation "
        f"({info.device}); steady state (state exists, gradients set to None before the step)",
        "peak_phase/peak_node located at the dims' hints " + ", ".join(f"{n}={v}" for n, v in info.dims)
        + f" ({peak.hint_bytes} bytes); peak_bytes is the Max over the step's points that are the "
        "largest somewhere on a grid of dims values (hint * 2**k, k = -3, -2.5, ..., 6); see passes.liveness",
    ]
    if mixed_precision and info.dtype == torch.float32:
        notes.append("mixed precision: model state uses 2-byte params/grads, but activations are "
                     "those of the fp32 graph; capture a bf16 model for 2-byte activations")
    gm.meta[MEMORY_SUMMARY] = MemorySummary(
        param_count=state.total("numel"),
        param_bytes=state.total("param"),
        grad_bytes=state.total("grad"),
        optimizer_bytes=state.total("opt"),
        buffer_bytes=sympy.expand(sympy.Add(*[s.size for s in run.storages.values() if s.kind == "buffer"])),
        activation_bytes=activation,
        input_bytes=inputs,
        peak_bytes=peak.bytes,
        peak_phase=peak.phase,
        peak_node=peak.node,
        optimizer=optimizer,
        mixed_precision=mixed_precision,
        notes=tuple(notes),
    )
    return gm


# ---------------------------------------------------------------------------------------------
# Forward run on fake tensors: storages, who owns them, who saves them.

@dataclass(eq=False)
class _Storage:
    """One storage seen in the forward run."""

    ref: StorageWeakRef
    size: sympy.Expr  # bytes
    hint: int  # bytes at the dims' hints
    kind: str  # "param", "buffer", "input", "activation" (a node output), "internal" (saved only)
    owner: fx.Node | None  # None for parameters and buffers the graph never reads
    index: int  # position of the owner in node order (-1 without owner)
    last_use: int = -1  # last node (position) that reads any tensor on this storage
    graph_output: bool = False
    savers: list[fx.Node] = field(default_factory=list)
    release_at: fx.Node | None = None  # node whose backward frees it (earliest saver that runs)
    # Made inside a checkpointed region and saved by nodes of that region: those saves happen
    # again when the region is recomputed in backward, on a recomputed copy (key ("re", storage)).
    re_savers: list[fx.Node] = field(default_factory=list)
    re_release_at: fx.Node | None = None
    # For internal tensors that require grad (e.g. the log-softmax inside a cross entropy): the
    # bytes of the gradient the op's backward computes for it on the way to its inputs.
    inner_grad: tuple[sympy.Expr, int] | None = None

    @property
    def kept(self) -> bool:
        return bool(self.savers)


class _RegionInterpreter(FakeInterpreter):
    """Runs a checkpointed region's submodule node by node, reporting its nodes to ``outer``."""

    def __init__(self, sub: fx.GraphModule, attrs: dict[str, torch.Tensor], outer: "_InliningInterpreter"):
        super().__init__(sub, attrs, on_node=outer.on_node)
        self.outer = outer

    def run(self, *args: Any) -> Any:
        # already inside the outer run's python dispatcher and reparametrization
        return fx.Interpreter.run(self, *args)

    def run_node(self, n: fx.Node) -> Any:
        self.outer.current = n
        self.outer.inner.setdefault(self.outer.calling, []).append(n)
        return super().run_node(n)


class _InliningInterpreter(FakeInterpreter):
    """A FakeInterpreter that runs each ``checkpoint(%submodule, *inputs)`` as the plain
    submodule, interpreted node by node, so the forward run sees the region's own nodes.
    ``inner[call]`` lists the region's nodes (placeholders and output included) in run order."""

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, torch.Tensor], on_node):
        super().__init__(gm, attrs, on_node=on_node)
        self.inner: dict[fx.Node, list[fx.Node]] = {}
        self.calling: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        sub = checkpoint_submodule(self.module, n)
        if sub is None:
            return super().run_node(n)
        self.current = self.calling = n
        args, _ = self.fetch_args_kwargs_from_env(n)
        prefix = n.args[0].target + "."
        attrs = {**self.attrs, **{k[len(prefix):]: v for k, v in self.attrs.items() if k.startswith(prefix)}}
        result = _RegionInterpreter(sub, attrs, self).run(*args[1:])
        self.current = n
        if self.on_node is not None:
            self.on_node(n, result)
        return result


@dataclass
class _ForwardRun:
    gm: fx.GraphModule
    fake: FakeContext
    order: list[fx.Node]
    index: dict[fx.Node, int]
    values: dict[fx.Node, Any]
    storages: dict[StorageWeakRef, _Storage]
    node_storages: dict[fx.Node, list[_Storage]]  # storages of each node's outputs (views included)
    saved_by: dict[fx.Node, list[_Storage]]  # distinct storages each node saves
    runs_backward: set[fx.Node]
    param_with_grad: set[_Storage]
    param_order: list[_Storage]  # parameters in ``gm.parameters()`` order (the optimizer's)
    itemsize: dict[_Storage, int]  # bytes per element of each parameter
    # Checkpointed regions: call node -> the region's nodes (in ``order``, just before the call),
    # each region node -> its call, a region's placeholders -> the parent's argument nodes, and
    # call node -> the region's output nodes (one per output).
    regions: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    region_of: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def outer(self, node: fx.Node) -> fx.Node:
        """``node`` itself, or for a node inside a checkpointed region the region's call in the
        graph: the call saves the region's inputs (for the recompute) and hands out its
        outputs, which is all that is kept of a region."""
        return self.region_of.get(node, node)
    alias: dict[fx.Node, fx.Node] = field(default_factory=dict)
    region_outputs: dict[fx.Node, tuple[fx.Node, ...]] = field(default_factory=dict)

    def size(self, value: Any) -> tuple[sympy.Expr, int]:
        return self.fake.to_sympy(value), _hint(value)


def _hint(value: Any) -> int:
    return int(guarding_hint_or_throw(value)) if isinstance(value, torch.SymInt) else int(value)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def observe_saved_tensors(gm: fx.GraphModule) -> _ForwardRun:
    """Run ``gm``'s forward on fake tensors under ``saved_tensors_hooks`` and record, per node,
    the storages autograd saves and who owns them. Shared by the memory, checkpoint and offload
    passes, which need storage identities that :class:`MemoryMeta` only summarizes."""
    info = capture_info(gm)
    fake = fake_context(info)
    attrs = fake_attrs(fake, gm, info.device, requires_grad=True)
    values: dict[fx.Node, Any] = {}  # strong refs: no storage is recycled during the run
    packed: list[tuple[fx.Node, torch.Tensor]] = []
    interp = _InliningInterpreter(gm, attrs, on_node=values.__setitem__)

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append((interp.current, t))
        return t

    with _eager_dropout(info.device), fake.mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        interp.run(*fake_inputs(fake, info))

    order: list[fx.Node] = []
    regions: dict[fx.Node, list[fx.Node]] = {}
    alias: dict[fx.Node, fx.Node] = {}
    region_outputs: dict[fx.Node, tuple[fx.Node, ...]] = {}
    for node in gm.graph.nodes:
        inner = interp.inner.get(node)
        if inner is not None:  # a checkpoint call: its region's nodes run just before it
            placeholders = [n for n in inner if n.op == "placeholder"]
            alias.update(zip(placeholders, [a for a in node.args[1:] if isinstance(a, fx.Node)]))
            out = next(n for n in inner if n.op == "output")
            outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
            region_outputs[node] = tuple(alias.get(o, o) for o in outs)
            regions[node] = [n for n in inner if n.op not in ("placeholder", "output")]
            order.extend(regions[node])
        order.append(node)
    index = {n: i for i, n in enumerate(order)}
    run = _ForwardRun(gm=gm, fake=fake, order=order, index=index, values=values, storages={},
                      node_storages={}, saved_by={}, runs_backward=set(), param_with_grad=set(),
                      param_order=[], itemsize={}, regions=regions, alias=alias, region_outputs=region_outputs,
                      region_of={n: call for call, nodes in regions.items() for n in nodes})
    for node in order:
        mine: list[_Storage] = []
        for t in _tensors(values.get(node)):
            ref = StorageWeakRef(t.untyped_storage())
            st = run.storages.get(ref)
            if st is None:
                kind = {"get_attr": "param" if isinstance(t, torch.nn.Parameter) else "buffer",
                        "placeholder": "input"}.get(node.op, "activation")
                size, hint = run.size(t.untyped_storage().nbytes())
                st = run.storages[ref] = _Storage(ref=ref, size=size, hint=hint, kind=kind, owner=node,
                                                  index=index[node])
            if st not in mine:
                mine.append(st)
        run.node_storages[node] = mine
        for st in mine:
            st.last_use = max(st.last_use, index[node])
        for src in node.all_input_nodes:
            for st in run.node_storages.get(alias.get(src, src), ()):
                st.last_use = max(st.last_use, index[node])
        if node.op == "output":
            for src in node.all_input_nodes:
                for st in run.node_storages.get(src, ()):
                    st.graph_output = True

    # Parameters and buffers the graph never reads are still memory (MemTracker counts them).
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        fake_t = attrs[name]
        ref = StorageWeakRef(fake_t.untyped_storage())
        if ref not in run.storages:
            size, hint = run.size(fake_t.untyped_storage().nbytes())
            run.storages[ref] = _Storage(ref=ref, size=size, hint=hint, owner=None, index=-1,
                                         kind="param" if isinstance(t, torch.nn.Parameter) else "buffer")
        if isinstance(t, torch.nn.Parameter) and run.storages[ref].kind == "param":
            run.param_order.append(run.storages[ref])
            run.itemsize[run.storages[ref]] = fake_t.element_size()
    for saver, t in packed:
        ref = StorageWeakRef(t.untyped_storage())
        st = run.storages.get(ref)
        if st is None:  # made inside the op and never any node's output (dropout noise, lse, ...)
            size, hint = run.size(t.untyped_storage().nbytes())
            st = run.storages[ref] = _Storage(ref=ref, size=size, hint=hint, kind="internal", owner=saver,
                                              index=index[saver], last_use=index[saver])
        if st.kind in ("param", "buffer"):
            continue  # saved weights are model state, not activations
        region = run.region_of.get(saver)
        savers = st.re_savers if region is not None and run.region_of.get(st.owner) is region else st.savers
        if saver not in savers:
            savers.append(saver)
            if st not in run.saved_by.get(saver, ()):
                run.saved_by.setdefault(saver, []).append(st)
        if st.kind == "internal" and t.requires_grad and st.inner_grad is None:
            st.inner_grad = run.size(t.numel() * t.element_size())

    # torch.utils.checkpoint holds a region's inputs until the region's backward is over, i.e.
    # until its first node's backward: that node stands for the holder.
    for call, nodes in regions.items():
        first = next((n for n in nodes if n.op in ("call_function", "call_method", "call_module")), None)
        for arg in call.args[1:]:
            for st in run.node_storages.get(arg, ()) if first is not None and isinstance(arg, fx.Node) else ():
                if st.kind in ("activation", "input", "internal") and first not in st.savers:
                    st.savers.append(first)

    _reach_backward(run)
    for st in run.storages.values():
        running = [s for s in st.savers if s in run.runs_backward]
        st.release_at = min(running, key=index.__getitem__) if running else None
        running = [s for s in st.re_savers if s in run.runs_backward]
        st.re_release_at = min(running, key=index.__getitem__) if running else None
    return run


@contextmanager
def _eager_dropout(device: str) -> Iterator[None]:
    """Make ``dropout`` save for backward what eager saves on ``device``, at any depth.

    FakeInterpreter runs composite ops through the Python dispatcher (so they keep symbolic
    sizes), where ``aten.dropout`` decomposes to ``native_dropout``: a 1-byte bool mask is saved,
    as CUDA eager does. CPU eager computes ``input * noise`` and saves a noise tensor of the
    input's dtype (also inside attention's math path), so on CPU we hide the Python
    decomposition and the SymInt-safe C++ kernel runs, as in eager.
    """
    op = aten.dropout.default
    hidden = {}
    if device == "cpu":
        for key in list(op.py_kernels):
            if key != torch._C.DispatchKey.Meta:
                hidden[key] = op.py_kernels.pop(key)
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.update(hidden)
        op._dispatch_cache.clear()


def _grad_inputs(run: _ForwardRun, node: fx.Node) -> list[tuple[int, fx.Node]]:
    """(position, input node) of every tensor argument that requires grad, repeats included."""
    out = []
    for pos, arg in enumerate(tree_leaves((node.args, node.kwargs))):
        if isinstance(arg, fx.Node):
            v = run.values.get(arg)
            if isinstance(v, torch.Tensor) and v.requires_grad:
                out.append((pos, run.alias.get(arg, arg)))  # a region's input is the parent's node
    return out


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _reach_backward(run: _ForwardRun) -> None:
    """Which nodes run a backward (the loss's gradient reaches them) and which params get a grad."""
    has_grad = {n for n in _output_nodes(run) if _requires_grad(run.values.get(n))}
    for node in reversed(run.order):
        if node not in has_grad or node.op in ("placeholder", "get_attr"):
            continue
        run.runs_backward.add(node)
        if _is_getitem(node):
            has_grad.add(node.args[0])
            continue
        if node in run.regions:  # the gradient enters the region at its outputs
            has_grad.update(run.region_outputs[node])
            continue
        for _, src in _grad_inputs(run, node):
            if src.op == "get_attr":
                run.param_with_grad.update(st for st in run.node_storages[src] if st.kind == "param")
            else:
                has_grad.add(src)


def _output_nodes(run: _ForwardRun) -> list[fx.Node]:
    out = next(n for n in reversed(run.order) if n.op == "output")
    return [a for a in tree_leaves(out.args) if isinstance(a, fx.Node)]


def _requires_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


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


def _model_state(run: _ForwardRun, opt: OptimizerModel, mixed_precision: bool) -> _ModelState:
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
        p_bytes = _HALF_BYTES if mixed_precision else itemsize
        state.param[st] = (numel * p_bytes, st.hint // itemsize * p_bytes)
        if st not in run.param_with_grad:
            continue  # no gradient, so no optimizer state either
        state_bytes = _FP32_BYTES if mixed_precision else itemsize
        state.state_elem_bytes = state_bytes
        per_elem = opt.state_tensors * state_bytes + (_FP32_BYTES if mixed_precision else 0)  # + master
        fixed = _STEP_BYTES if opt.step_tensor else 0
        state.grad[st] = state.param[st]
        state.opt[st] = (numel * per_elem + fixed, st.hint // itemsize * per_elem + fixed)
    return state


# ---------------------------------------------------------------------------------------------
# Node meta.

def _write_node_meta(run: _ForwardRun, state: _ModelState) -> None:
    kept: dict[fx.Node, list[sympy.Expr]] = {}
    for st in run.storages.values():
        if st.kept and st.kind in ("activation", "internal", "input"):
            kept.setdefault(st.owner, []).append(st.size)
    for node in run.order:
        new = [st.size for st in run.node_storages.get(node, ()) if st.kind == "activation" and st.owner is node]
        saved = tuple(SavedTensor(owner=st.owner.name, nbytes=st.size) for st in run.saved_by.get(node, ()))
        meta = MemoryMeta(output_bytes=_sum(new), saved=saved, kept_bytes=_sum(kept.get(node, [])))
        params = [st for st, first in state.first_node.items() if first is node]
        if params:
            meta = MemoryMeta(output_bytes=meta.output_bytes, saved=saved, kept_bytes=meta.kept_bytes,
                              param_bytes=_sum([state.param[st][0] for st in params]),
                              grad_bytes=_sum([state.grad[st][0] for st in params if st in state.grad]),
                              optimizer_bytes=_sum([state.opt[st][0] for st in params if st in state.opt]))
        node.meta[MEMORY] = meta


def _sum(exprs: list[sympy.Expr]) -> sympy.Expr:
    return sympy.expand(sympy.Add(*exprs)) if exprs else _ZERO


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


def _simulate_step(run: _ForwardRun, state: _ModelState, opt: OptimizerModel, *, foreach: bool,
                   hints: dict[sympy.Symbol, int]):
    tl = Timeline()
    tl.at("forward", "(model state)")
    for st in run.storages.values():
        if st.kind == "param" and st in state.param:
            tl.alloc(("param", st), *state.param[st])
            if st in state.opt:
                tl.alloc(("opt", st), *state.opt[st])
        elif st.kind in ("buffer", "input"):
            tl.alloc(st, st.size, st.hint)

    # Forward: allocate each node's new storages; free unsaved ones after their last use.
    dies_at: dict[int, list[_Storage]] = {}
    for st in run.storages.values():
        if st.kind in ("activation", "internal") and st.release_at is None and not st.graph_output:
            dies_at.setdefault(max(st.last_use, st.index), []).append(st)
    born: dict[fx.Node, list[_Storage]] = {}
    for st in run.storages.values():
        if st.kind in ("activation", "internal"):
            born.setdefault(st.owner, []).append(st)
    release: dict[fx.Node, list[Any]] = {}  # node -> timeline keys freed after its backward
    for st in run.storages.values():
        if st.release_at is not None and st.kind in ("activation", "internal"):
            release.setdefault(st.release_at, []).append(st)  # graph inputs stay with the caller
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
        mine = [k for k in list(grads.slot) if k[0] is node]
        outs = [grads.slot.pop(k) for k in mine]
        if node in run.regions:
            # The region's outputs take the gradients, then its forward is replayed.
            for (_, idx), key in zip(mine, outs):
                out = run.region_outputs[node][idx]
                grads.add((out, 0), key, _tensor_bytes(run, run.values[out]))
            for inner in run.regions[node]:
                tl.at("backward", f"{inner.name} (recompute)")
                for st in born.get(inner, ()):
                    tl.alloc(("re", st), st.size, st.hint)
                for st in recompute_dies.get(inner, ()):
                    tl.free(("re", st))
            continue
        if _is_getitem(node):
            parent, idx = node.args[0], node.args[1]
            for key in outs:
                grads.add((parent, idx), key, _tensor_bytes(run, run.values[node]))
            continue
        # Gradients of differentiable tensors made inside the op (composite ops run several
        # autograd nodes): live while the op's input gradients are computed.
        inner = [st for st in born.get(node, ()) if st.inner_grad is not None]
        for st in inner:
            tl.alloc(("inner", st), *st.inner_grad)
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

    # Optimizer step: parameters, gradients and state are live; the update adds temporaries.
    if opt.sqrt_temporaries and state.opt:
        elem = state.state_elem_bytes
        if foreach:
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
    if target in _ADD:
        return same_shape and "alpha" not in node.kwargs
    if target in _SUB:
        return same_shape and pos == 0
    if target in _DROPOUT:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return same_shape and (p == 0 or not train)
    return False
