"""The forward run on fake tensors that the memory, checkpoint and offload passes share: every
storage the step's forward makes, who owns it, and which nodes autograd saves it for.

The graph runs forward once on fake tensors inside ``torch.autograd.graph.saved_tensors_hooks``;
every packed tensor is attributed to the node running at that moment (its *saver*). Storages are
deduplicated (views count once) and each is charged to its *owner*: the node whose output first
had the storage, or the saver itself for tensors made inside an op (dropout mask, layer-norm
mean/rstd, attention logsumexp). Checkpointed regions (``checkpoint(%submodule, *inputs)``) are
interpreted node by node, so their saves are seen too; under selective checkpointing (the ``dag``
policy) the storages of a region's cached nodes are marked ``cached``: kept after forward. :func:`observe_saved_tensors` returns
the run (:class:`ForwardRun`); the passes read storage identities that ``MemoryMeta`` only sums.
"""
from __future__ import annotations

import contextlib
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

from passes.analysis.annotate_flops import checkpoint_submodule
from passes.ir.meta import CAPTURE, REMAT
from passes.ir.offload_ops import OFFLOAD_BEGIN, watch_packs
from passes.analysis.liveness import MemoryObserver
from passes.capture.fake_execution import FakeContext, FakeInterpreter, capture_info, fake_attrs, fake_context, fake_inputs

aten = torch.ops.aten

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
    # Made by a cached node of a selectively checkpointed region (``node.meta[REMAT]``): the
    # checkpoint holds it from forward until the region's replay hands it to the recompute.
    cached: bool = False

    @property
    def kept(self) -> bool:
        return bool(self.savers) or self.cached


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

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, torch.Tensor], on_node, *, symbolic: bool = True):
        super().__init__(gm, attrs, on_node=on_node, symbolic=symbolic)
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
    param_names: dict[_Storage, str]  # each parameter's qualified name in ``gm``
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
    # what each node saves that an activation-offload region moves to the host: (owner, bytes);
    # saved for its backward, but not device memory (not in ``storages``)
    offloaded_by: dict[fx.Node, list[tuple[fx.Node, sympy.Expr]]] = field(default_factory=dict)

    def size(self, value: Any) -> tuple[sympy.Expr, int]:
        return self.fake.to_sympy(value), _hint(value)


def _hint(value: Any) -> int:
    return int(guarding_hint_or_throw(value)) if isinstance(value, torch.SymInt) else int(value)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) value: an op's arguments or outputs."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


@dataclass(eq=False)
class FakeRun:
    """One forward run of a graph on fake tensors under ``saved_tensors_hooks``: every node's
    result (``values``, checkpointed regions' nodes included), each packed tensor with the node
    that saved it, each region call's nodes in run order, and the fake parameters. ``offloaded``:
    the saved tensors activation-offload regions moved to the host, with the node that saved
    each (they are saved for backward, but hold no device memory)."""

    fake: FakeContext
    attrs: dict[str, torch.Tensor]
    values: dict[fx.Node, Any]
    packed: list[tuple[fx.Node, torch.Tensor]]
    inner: dict[fx.Node, list[fx.Node]]
    offloaded: list[tuple[fx.Node, torch.Tensor]] = field(default_factory=list)


_RECENT_RUNS: list = []
"""The last :data:`_RECENT` :class:`FakeRun` s made without an offload observer and with every dim
concrete, newest first, as (signature, the nodes of the graph it ran, run). The stage pipeline
asks for the same run two or three times in a row (``shard_parameters`` observes the gathers'
savers, ``annotate_shapes`` and ``annotate_memory`` re-analyse the program); the planner's
memory replay, the dumps and the job's own lowering ask again for the programs of the same
plan, and a fake run is most of what each costs. The nodes an entry holds stay alive until it
is pushed out."""
_RECENT = 8


def _signature(gm: fx.GraphModule, watching: bool) -> tuple:
    """What a fake run of ``gm`` depends on, by name (a copy of a graph has the same): its
    capture info, every (sub)graph's nodes with their ops, targets and arguments, and the
    parameters and buffers with their shapes, dtypes and ties. The values of tensors do not
    matter (the run is on fakes). A pass that changes any of these makes a new signature."""
    def arg(a):
        return ("%", a.name) if isinstance(a, fx.Node) else a

    graphs = tuple((name, tuple((n.name, n.op, n.target, fx.node.map_aggregate(n.args, arg),
                                 fx.node.map_aggregate(n.kwargs, arg)) for n in sub.graph.nodes))
                   for name, sub in gm.named_modules() if isinstance(sub, fx.GraphModule))
    first: dict[int, str] = {}
    tensors = tuple((name, first.setdefault(id(t), name), tuple(t.shape), t.stride(), t.dtype, t.requires_grad,
                     isinstance(t, torch.nn.Parameter))
                    for name, t in [*gm.named_parameters(remove_duplicate=False),
                                    *gm.named_buffers(remove_duplicate=False)])
    return (gm.meta.get(CAPTURE), graphs, tensors, watching)


def _same(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an argument that does not compare (a tensor constant): run again
        return False


def _nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Every (sub)graph's nodes in order, by module name: where a run's nodes stood when it was made."""
    return {name: list(sub.graph.nodes) for name, sub in gm.named_modules() if isinstance(sub, fx.GraphModule)}


def _rebind(run: FakeRun, made_on: dict[str, list[fx.Node]], gm: fx.GraphModule) -> FakeRun:
    """``run`` (made on a graph whose nodes were ``made_on``) as a run of ``gm``, a graph of the
    same signature: each node of the first stands for the node of ``gm`` at the same place (the
    first graph may have changed since)."""
    now = _nodes(gm)
    if all(a is b for name, nodes in made_on.items() for a, b in zip(nodes, now[name])):
        return run
    node = {a: b for name, nodes in made_on.items() for a, b in zip(nodes, now[name])}
    return FakeRun(fake=run.fake, attrs=run.attrs, values={node[n]: v for n, v in run.values.items()},
                   packed=[(node.get(n), t) for n, t in run.packed],  # None: saved before any node ran
                   inner={node[c]: [node[n] for n in nodes] for c, nodes in run.inner.items()},
                   offloaded=[(node.get(n), t) for n, t in run.offloaded])


def fake_forward_run(gm: fx.GraphModule, *, observer: MemoryObserver | None = None) -> FakeRun:
    """Run ``gm``'s forward on fake tensors under ``saved_tensors_hooks``, each checkpointed region
    interpreted node by node (what :func:`observe_saved_tensors` reads, and the shapes
    ``annotate_shapes`` writes). The last few runs at concrete dims are remembered by what they
    depend on (:data:`_RECENT_RUNS`): a graph of the same signature, this one unchanged or a copy,
    gets its run again, unless an offload ``observer`` must see the run's packs.

    Offload regions replace the run's saved-tensor hooks with their own; the run watches them
    (:func:`passes.ir.offload_ops.watch_packs`), so what a region keeps on the device is packed
    here and what it moves to the host is in ``offloaded`` (and told to ``observer``)."""
    offload = _has_offload(gm)
    live = observer is not None and offload  # the observer is told the packs as they are made
    sig = _signature(gm, live)
    if not live:
        for i, (known, made_on, run) in enumerate(_RECENT_RUNS):
            if _same(known, sig):
                _RECENT_RUNS.insert(0, _RECENT_RUNS.pop(i))
                return _rebind(run, made_on, gm)
    info = capture_info(gm)
    fake = fake_context(info)
    attrs = fake_attrs(fake, gm, info.device, requires_grad=True)
    values: dict[fx.Node, Any] = {}  # strong refs: no storage is recycled during the run
    packed: list[tuple[fx.Node, torch.Tensor]] = []
    offloaded: list[tuple[fx.Node, torch.Tensor]] = []
    interp = _InliningInterpreter(gm, attrs, on_node=values.__setitem__, symbolic=fake.symbolic)

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append((interp.current, t))
        return t

    def to_host(region: int, t: torch.Tensor) -> None:
        offloaded.append((interp.current, t))
        if live:
            observer.offloaded(region, t)

    watch = watch_packs(to_host) if offload else contextlib.nullcontext()
    with _eager_dropout(info.device), fake.mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            watch:
        interp.run(*fake_inputs(fake, info))
    run = FakeRun(fake=fake, attrs=attrs, values=values, packed=packed, inner=interp.inner, offloaded=offloaded)
    # Only runs with every dim concrete are kept: with symbols, a reader that asks a size
    # concretely installs a guard in the run's shape environment, which would specialize the
    # next reader's sizes.
    if not (live or fake.symbolic):
        _RECENT_RUNS[:] = [(sig, _nodes(gm), run), *_RECENT_RUNS[:_RECENT - 1]]
    return run


def _has_offload(gm: fx.GraphModule) -> bool:
    return any(n.target is OFFLOAD_BEGIN for sub in gm.modules() if isinstance(sub, fx.GraphModule)
               for n in sub.graph.nodes if n.op == "call_function")


def observe_saved_tensors(gm: fx.GraphModule, *, observer: MemoryObserver | None = None) -> _ForwardRun:
    """Run ``gm``'s forward on fake tensors under ``saved_tensors_hooks`` and record, per node,
    the storages autograd saves and who owns them. Shared by the memory, checkpoint and offload
    passes, which need storage identities that :class:`MemoryMeta` only summarizes.
    ``observer``: told each saved tensor an offload region moves to the host; what a region keeps
    on the device is then recorded here too (:func:`passes.ir.offload_ops.watch_packs`)."""
    raw = fake_forward_run(gm, observer=observer)
    fake, attrs, values, packed = raw.fake, raw.attrs, raw.values, raw.packed

    order: list[fx.Node] = []
    regions: dict[fx.Node, list[fx.Node]] = {}
    alias: dict[fx.Node, fx.Node] = {}
    region_outputs: dict[fx.Node, tuple[fx.Node, ...]] = {}
    for node in gm.graph.nodes:
        inner = raw.inner.get(node)
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
                      param_order=[], param_names={}, itemsize={}, regions=regions, alias=alias, region_outputs=region_outputs,
                      region_of={n: call for call, nodes in regions.items() for n in nodes})
    for node in order:
        mine: list[_Storage] = []
        for t in tensor_leaves(values.get(node)):
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
            run.param_names[run.storages[ref]] = name
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

    moved: dict[fx.Node, set] = {}
    for saver, t in raw.offloaded:  # each storage once per saver, unless the saver also keeps it on the device
        ref = StorageWeakRef(t.untyped_storage())
        st = run.storages.get(ref)
        if ref in moved.setdefault(saver, set()) or (st is not None and st in run.saved_by.get(saver, ())):
            continue
        moved[saver].add(ref)
        size = st.size if st is not None else run.size(t.untyped_storage().nbytes())[0]
        run.offloaded_by.setdefault(saver, []).append((st.owner if st is not None else saver, size))

    # torch.utils.checkpoint holds a region's inputs until the region's backward is over, i.e.
    # until its first node's backward: that node stands for the holder.
    for call, nodes in regions.items():
        first = next((n for n in nodes if n.op in ("call_function", "call_method", "call_module")), None)
        for arg in call.args[1:]:
            for st in run.node_storages.get(arg, ()) if first is not None and isinstance(arg, fx.Node) else ():
                if st.kind in ("activation", "input", "internal") and first not in st.savers:
                    st.savers.append(first)

    # Selective checkpointing keeps the outputs of a cached node's ops (its own storages).
    for nodes in regions.values():
        cached = {n for n in nodes if getattr(n.meta.get(REMAT), "cached", False)}
        for st in run.storages.values():
            if st.owner in cached and st.kind in ("activation", "internal"):
                st.cached = True

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


Storage = _Storage
ForwardRun = _ForwardRun
