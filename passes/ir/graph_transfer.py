"""An analysed graph as bytes, so that one process captures and analyses and every rank lowers.

A job's rank 0 captures the model and runs the analysis passes; :func:`pack_graph` turns the
result into a :class:`GraphPayload` (the graph's nodes, their meta, the names of its tensors) and
:func:`unpack_graph` rebuilds the same GraphModule on each rank around that rank's own module
(its parameters and buffers by name; tensors the model does not own, such as export's lifted
constants, travel by value). Every rank, rank 0 included, lowers the rebuilt graph, so the
programs of all ranks come from one input.

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
from typing import Any

import torch
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
    """One tensor of the GraphModule, in registration order; ``value`` is None when the rank's
    own module holds it under ``name``."""

    name: str
    kind: str  # "parameter" | "buffer"
    value: torch.Tensor | None
    persistent: bool = True  # buffers: in the state dict
    requires_grad: bool = True  # parameters


@dataclass(frozen=True)
class _Ref:
    """An argument that is another node's result."""

    name: str


def pack_graph(gm: fx.GraphModule, module: nn.Module, *, by_name: bool = False) -> GraphPayload:
    """``gm`` (captured from ``module`` and analysed) as bytes. Raises :class:`PassError` naming
    the node when the graph holds something that cannot travel (a submodule call, a local
    function as target). ``by_name``: ``gm`` is a copy of a graph built around ``module`` (a
    lowering's whole-graph prefix of the analysed graph): a tensor travels as a name when
    ``module`` holds one of its shape and dtype under that name, not only when it is the same object."""
    owned = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    named = ({**dict(module.named_parameters(remove_duplicate=False)),
              **dict(module.named_buffers(remove_duplicate=False))} if by_name else {})

    def travels_as_name(name: str, t: torch.Tensor) -> bool:
        same = named.get(name)
        return id(t) in owned or (same is not None and same.shape == t.shape and same.dtype == t.dtype)

    attrs = []
    for prefix, sub in gm.named_modules():
        if prefix and type(sub) is not nn.Module:
            raise PassError(f"pack_graph: the graph holds submodule {prefix!r} ({type(sub).__name__}); only "
                            f"tensor attributes can be rebuilt on another rank: capture on every rank instead")
        for local, p in sub._parameters.items():
            if p is not None:
                name = f"{prefix}.{local}" if prefix else local
                attrs.append(_Attr(name, "parameter", None if travels_as_name(name, p) else p.detach(),
                                   requires_grad=p.requires_grad))
        for local, b in sub._buffers.items():
            if b is not None:
                name = f"{prefix}.{local}" if prefix else local
                attrs.append(_Attr(name, "buffer", None if travels_as_name(name, b) else b,
                                   persistent=local not in sub._non_persistent_buffers_set))
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise PassError(f"pack_graph: node {node.name!r} calls module {node.target!r}; only graphs of "
                            f"function calls can be rebuilt on another rank")
        nodes.append((node.op, node.name, node.target,
                      fx.node.map_arg(node.args, lambda n: _Ref(n.name)),
                      fx.node.map_arg(node.kwargs, lambda n: _Ref(n.name)),
                      _portable_meta(node.meta)))
    body = {"nodes": nodes, "attrs": attrs, "meta": _portable_meta(gm.meta)}
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(body)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise PassError(f"pack_graph: the graph of {type(module).__name__} cannot be pickled ({exc}); "
                        f"capture on every rank instead") from exc
    return GraphPayload(buf.getvalue())


def unpack_graph(payload: GraphPayload, module: nn.Module) -> fx.GraphModule:
    """The GraphModule :func:`pack_graph` packed, its parameters and buffers taken from
    ``module`` (this rank's copy of the model) by name."""
    body = pickle.loads(payload.data)
    # Tensors registered in the captured graph's order (an fx.GraphModule built from a root
    # would register only what get_attr nodes name, in node order).
    gm = graph_module(nn.Module(), fx.Graph())
    for attr in body["attrs"]:
        value = attr.value if attr.value is not None else _owned(module, attr)
        *path, local = attr.name.split(".")
        holder = gm
        for part in path:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        if attr.kind == "parameter":
            if not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=attr.requires_grad)
            holder.register_parameter(local, value)
        else:
            holder.register_buffer(local, value, persistent=attr.persistent)

    graph = fx.Graph()
    graph._codegen = fx.graph.CodeGen()  # capture's plain positional signature
    made: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs, meta in body["nodes"]:
        node = graph.create_node(op, target, _resolve(args, made), _resolve(kwargs, made), name=name)
        if node.name != name:
            raise PassError(f"unpack_graph: node {name!r} came back as {node.name!r}")
        node.meta.update(meta)
        made[name] = node
    gm.graph = graph  # recompiles
    gm.meta.update(body["meta"])
    return gm


def _owned(module: nn.Module, attr: _Attr) -> torch.Tensor:
    try:
        return module.get_parameter(attr.name) if attr.kind == "parameter" else module.get_buffer(attr.name)
    except AttributeError as exc:
        raise PassError(f"unpack_graph: this rank's model has no {attr.kind} {attr.name!r}; every rank must build "
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
    """Pickles ops by their registered names (torch's op objects do not pickle themselves)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (obj._qualified_op_name, None)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order_op, (obj.name(),)
        return NotImplemented


def _op(qualified: str, overload: str | None) -> Any:
    namespace, name = qualified.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload or "default")


def _higher_order_op(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


