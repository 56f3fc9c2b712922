"""An analysed graph as bytes, so that one process captures and analyses and every rank lowers.

A job's rank 0 captures the model and runs the analysis passes; :func:`pack_graph` turns the
result into a :class:`GraphPayload` (the graph's nodes, their meta, the names of its tensors) and
:func:`unpack_graph` rebuilds the same GraphModule on each rank around that rank's own module
(its parameters and buffers by name; tensors the model does not own, such as export's lifted
constants, travel by value). Every rank, rank 0 included, lowers the rebuilt graph, so the
programs of all ranks come from one input.

The same carries a lowered stage program from the rank that lowered it to the data-parallel ranks
that run the same one: its checkpointed regions (``fx.GraphModule`` children) travel as graphs of
their own, a tensor held under several names (a region re-lists its block's parameters) comes back
as one object, the graph's code generator travels with it (export's pytree one excepted: a
captured graph comes back with a plain positional signature), and a tensor that the lowering made
from the model's (a tp shard, a ZeRO-3 shard) travels as a token the receiver turns into its own
(``refs=`` here, ``resolve=`` there).

What travels of ``node.meta``: every key the passes write (:data:`PASS_KEYS`) and export's
plain descriptive entries (``stack_trace``, ``nn_module_stack`` with its module types as names,
``torch_fn``, ...). Export's fake values (``val``, ``tensor_meta``) and provenance (``from_node``)
stay behind: they live in one process's shape environment, and nothing after the analysis reads
them (the shapes are in ``meta[SHAPE]``).
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import sympy
import torch
from sympy.core.parameters import evaluate
from torch import fx, nn

from passes.ir.errors import PassError
from passes.ir.meta import EXPORT_MODULE_STACK, KEYS
from passes.ir.graph_modules import graph_module

PASS_KEYS = tuple(KEYS)
"""Every meta key a pass writes (node or graph): these must travel."""

_LEFT_BEHIND = frozenset({"val", "tensor_meta", "from_node", "unbacked_bindings", "example_value",
                          "inline_constraints", "input_shape_constraints"})


@dataclass(frozen=True)
class GraphPayload:
    """A packed graph: ``data`` (pickled nodes, meta and tensor layout) and its size in bytes."""

    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class _Attr:
    """One tensor of the GraphModule, in registration order: by value, or (``value`` None) the
    rank's own module's tensor ``source`` (``name`` when None), the tensor ``resolve(ref)`` gives
    (``ref`` not None), or the tensor of the earlier attribute ``same_as``."""

    name: str
    kind: str  # "parameter" | "buffer"
    value: torch.Tensor | None
    persistent: bool = True  # buffers: in the state dict
    requires_grad: bool = True  # parameters
    source: str | None = None
    ref: Any = None
    same_as: str | None = None


@dataclass(frozen=True)
class _Ref:
    """An argument that is another node's result."""

    name: str


def pack_graph(gm: fx.GraphModule, module: nn.Module, *, by_name: bool = False,
               refs: Mapping[int, Any] | None = None) -> GraphPayload:
    """``gm`` (captured from ``module`` and analysed) as bytes. Raises :class:`PassError` naming
    the node when the graph holds something that cannot travel (a submodule other than a plain
    holder of tensors or a graph module, a submodule call, a local function as target). ``by_name``:
    ``gm`` is a copy of a graph built around ``module`` (a lowering's whole-graph prefix of the
    analysed graph): a tensor travels as a name when ``module`` holds one of its shape and dtype
    under that name, not only when it is the same object. ``refs``: tokens by ``id`` of tensors of
    ``gm``; such a tensor travels as its token, which :func:`unpack_graph`'s ``resolve`` turns
    into the receiver's tensor."""
    refs = refs or {}
    named = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    owned: dict[int, str] = {}
    for name, t in named.items():
        owned.setdefault(id(t), name)

    def place(name: str, t: torch.Tensor) -> dict[str, Any]:
        if id(t) in refs:
            return {"value": None, "ref": refs[id(t)]}
        if named.get(name) is t:
            return {"value": None}
        if id(t) in owned:
            return {"value": None, "source": owned[id(t)]}
        same = named.get(name) if by_name else None
        if same is not None and same.shape == t.shape and same.dtype == t.dtype:
            return {"value": None}
        return {"value": t.detach() if isinstance(t, nn.Parameter) else t}

    if len(dict(gm.named_modules(remove_duplicate=False))) != len(dict(gm.named_modules())):
        raise PassError("pack_graph: the graph holds one submodule under two names; it cannot be rebuilt as one")
    modules, graphs, attrs = [], {}, []
    seen: dict[int, str] = {}  # id of a tensor -> the name it was packed under first
    for prefix, sub in gm.named_modules():
        if isinstance(sub, fx.GraphModule):
            modules.append((prefix, "graph", type(sub).__name__))
            graphs[prefix] = _pack_nodes(sub)
        elif prefix and type(sub) is nn.Module:
            modules.append((prefix, "module", ""))
        else:
            raise PassError(f"pack_graph: the graph holds submodule {prefix!r} ({type(sub).__name__}); only "
                            f"tensor attributes and graph modules can be rebuilt on another rank: capture on "
                            f"every rank instead")
        for local, p in sub._parameters.items():
            if p is not None:
                name = f"{prefix}.{local}" if prefix else local
                where = {"value": None, "same_as": seen[id(p)]} if id(p) in seen else place(name, p)
                seen.setdefault(id(p), name)
                attrs.append(_Attr(name, "parameter", requires_grad=p.requires_grad, **where))
        for local, b in sub._buffers.items():
            if b is not None:
                name = f"{prefix}.{local}" if prefix else local
                where = {"value": None, "same_as": seen[id(b)]} if id(b) in seen else place(name, b)
                seen.setdefault(id(b), name)
                attrs.append(_Attr(name, "buffer", persistent=local not in sub._non_persistent_buffers_set, **where))
    body = {"modules": modules, "graphs": graphs, "attrs": attrs}
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(body)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise PassError(f"pack_graph: the graph of {type(module).__name__} cannot be pickled ({exc}); "
                        f"capture on every rank instead") from exc
    return GraphPayload(buf.getvalue())


def _pack_nodes(gm: fx.GraphModule) -> dict[str, Any]:
    """One graph module's nodes, meta and code generator (export's pytree one stays behind)."""
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise PassError(f"pack_graph: node {node.name!r} calls module {node.target!r}; only graphs of "
                            f"function calls can be rebuilt on another rank")
        nodes.append((node.op, node.name, node.target,
                      fx.node.map_arg(node.args, lambda n: _Ref(n.name)),
                      fx.node.map_arg(node.kwargs, lambda n: _Ref(n.name)),
                      _portable_meta(node.meta)))
    codegen = gm.graph._codegen
    keep = type(codegen) is not fx.graph.CodeGen and not isinstance(codegen, fx.graph._PyTreeCodeGen)
    return {"nodes": nodes, "meta": _portable_meta(gm.meta), "codegen": codegen if keep else None}


def unpack_graph(payload: GraphPayload, module: nn.Module,
                 resolve: Callable[[Any], torch.Tensor] | None = None) -> fx.GraphModule:
    """The GraphModule :func:`pack_graph` packed, its parameters and buffers taken from
    ``module`` (this rank's copy of the model) by name, and those packed as tokens from
    ``resolve(token)``."""
    body = pickle.loads(payload.data)
    # Modules and tensors registered in the packed graph's order (an fx.GraphModule built from a
    # root would register only what get_attr nodes name, in node order).
    made: dict[str, nn.Module] = {}
    for path, kind, class_name in body["modules"]:
        sub = graph_module(nn.Module(), fx.Graph(), class_name=class_name) if kind == "graph" else nn.Module()
        if path:
            parent, _, local = path.rpartition(".")
            made[parent].add_module(local, sub)
        made[path] = sub
    gm = made[""]
    tensors: dict[str, torch.Tensor] = {}
    for attr in body["attrs"]:
        if attr.same_as is not None:
            value = tensors[attr.same_as]
        elif attr.ref is not None:
            if resolve is None:
                raise PassError(f"unpack_graph: {attr.kind} {attr.name!r} travelled as a token; pass resolve=")
            value = resolve(attr.ref)
        elif attr.value is not None:
            value = attr.value
        else:
            value = _owned(module, attr)
        tensors[attr.name] = value
        owner, _, local = attr.name.rpartition(".")
        holder = made[owner]
        if attr.kind == "parameter":
            if not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=attr.requires_grad)
                tensors[attr.name] = value
            holder.register_parameter(local, value)
        else:
            holder.register_buffer(local, value, persistent=attr.persistent)
    for path, packed in body["graphs"].items():
        _unpack_nodes(made[path], packed)
    return gm


def _unpack_nodes(gm: fx.GraphModule, packed: dict[str, Any]) -> None:
    graph = fx.Graph()
    graph._codegen = packed["codegen"] or fx.graph.CodeGen()  # else capture's plain positional signature
    made: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs, meta in packed["nodes"]:
        node = graph.create_node(op, target, _resolve(args, made), _resolve(kwargs, made), name=name)
        if node.name != name:
            raise PassError(f"unpack_graph: node {name!r} came back as {node.name!r}")
        node.meta.update(meta)
        made[name] = node
    gm.graph = graph  # recompiles
    gm.meta.update(packed["meta"])


def _owned(module: nn.Module, attr: _Attr) -> torch.Tensor:
    name = attr.source or attr.name
    try:
        return module.get_parameter(name) if attr.kind == "parameter" else module.get_buffer(name)
    except AttributeError as exc:
        raise PassError(f"unpack_graph: this rank's model has no {attr.kind} {name!r}; every rank must build "
                        f"the same model") from exc


def _resolve(value: Any, made: dict[str, fx.Node]) -> Any:
    if isinstance(value, _Ref):
        return made[value.name]
    if isinstance(value, tuple):
        return tuple(_resolve(v, made) for v in value)
    if isinstance(value, list):
        return [_resolve(v, made) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, made) for k, v in value.items()}
    return value


def _portable_meta(meta: dict) -> dict:
    """The entries of ``meta`` that travel: the passes' (as they are) and export's plain ones."""
    out = {}
    for key, value in meta.items():
        if key in _LEFT_BEHIND:
            continue
        if key == EXPORT_MODULE_STACK and isinstance(value, dict):
            value = {k: (v[0], _type_name(v[1])) for k, v in value.items()}
        elif key not in PASS_KEYS and not _picklable(value):
            continue  # export's bookkeeping we never read
        out[key] = value
    return out


def _type_name(t: Any) -> str:
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', t)}"


def _picklable(value: Any) -> bool:
    try:
        _Pickler(io.BytesIO()).dump(value)
    except Exception:  # noqa: BLE001 - anything that does not pickle stays behind
        return False
    return True


class _Pickler(pickle.Pickler):
    """Pickles ops by their registered names (torch's op objects do not pickle themselves), and
    symbolic expressions as their head and arguments, rebuilt unevaluated (:func:`_expression`)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, sympy.Basic) and obj.args:
            return _expression, (obj.func, obj.args)
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (obj._qualified_op_name, None)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order_op, (obj.name(),)
        return NotImplemented


def _expression(head: Any, args: tuple) -> sympy.Basic:
    """``head(*args)`` without evaluating: the packed expression was already in its final form,
    and sympy's default unpickling evaluates it again (a ``Max`` of a memory bound's terms compares
    every pair symbolically: a 4-layer Llama's graph took 0.17 s to unpack in a fresh process, and
    0.017 s rebuilt unevaluated)."""
    with evaluate(False):
        return head(*args)


def _op(qualified: str, overload: str | None) -> Any:
    namespace, name = qualified.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload or "default")


def _higher_order_op(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


