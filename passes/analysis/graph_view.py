"""Analysis view: an analysed fx training graph as a ``networkx.DiGraph``, and the graph algorithms
the planner needs on it (cut points by dominators, topological generations).

One DiGraph node per fx node, named by the fx node's name; an edge ``u -> v`` for every fx input
``u`` of ``v`` (data flow, parameters and graph inputs included). Node attributes, all at the
dims' hint values (plain ints):

==================  ==============================================================================
``op``              ``"placeholder"``, ``"get_attr"``, ``"output"`` or the call's target
                    (``"aten.conv2d.default"``)
``kind``            ``"input"``, ``"param"``, ``"buffer"``, ``"compute"`` or ``"output"``
``is_param``,       booleans: a parameter (or buffer) read, a graph input, the graph's output node
``is_input``,
``is_output``
``activation``      a compute node whose value lives on an activation storage (its own or, for a
                    view, an earlier node's); parameters' views and sizes are not activations
``out_bytes``       bytes of the new output storages the node allocates (0 for views)
``internal_bytes``  bytes of storages the op makes inside itself for its backward (dropout noise,
                    layer-norm mean/rstd, attention logsumexp), never any node's output
``kept_bytes``      bytes of the node's own storages (outputs and internals) that autograd keeps
``flops``,          forward and backward FLOPs (``annotate_flops``: matmul-class work only)
``bwd_flops``
``owns``            :class:`StorageFacts` of every activation/internal storage the node owns
``reads``           names of the activation/internal storages the node reads (views resolved to
                    the storage they view; graph inputs, parameters and buffers left out)
``recomputable``    the node can run again in backward with the same result and no side effect:
                    a call that mutates nothing (no in-place op writes its storages), is not one
                    of the project's ``partitioner::*`` ops (collectives, process state: running
                    one again on one rank would desynchronise its group) and is not a graph
                    input, parameter or output
``random``          the op may draw random numbers (dropout, fused attention:
                    :func:`draws_random`): recomputing it needs the RNG state
``weighted``        a ``call_module`` whose module holds parameters (a traced, not exported, graph)
``block``           ``node.meta[BLOCK].name`` when ``annotate_blocks`` ran, else ``None``
==================  ==============================================================================

Graph attributes: ``loss`` (name of the node the output's first element is), ``fixed_bytes``
(bytes of graph inputs autograd keeps: token ids, targets; always on device), ``fwd_flops`` and
``bwd_flops`` (whole graph), and ``storage_of`` (storage name -> the forward run's storage
object, for passes that relate the view to their own run: :func:`view_of_run`).

Storages and their savers come from one forward run on fake tensors
(:func:`passes.analysis.saved_tensors.observe_saved_tensors`, the observation ``annotate_memory`` makes),
so views count once and an op's internal saves are seen; FLOPs come from ``node.meta[FLOPS]``.
The graph must not hold checkpointed regions yet (the view is of the plain forward).

Cut points
    A *cut point* is an activation every forward path from the inputs to the loss passes
    through. Paths run on the *trunk* (:func:`trunk`: activations that depend on both a graph
    input and a parameter) from its roots (an embedding lookup, the first conv); with a virtual
    source feeding them, the cut points are the dominators of the loss
    (:func:`networkx.immediate_dominators`). Parameters and *side* activations (made from sizes
    and parameters alone: ``arange`` positions, RoPE tables, a constant causal mask; or from the
    inputs alone: a padding mask or position ids from the token ids) start no path, as they could
    be made anywhere. This depends on the graph only, not on its node order.
    :func:`passes.policies.checkpoint_policy.cut_points` splits the checkpoint regions there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import networkx as nx
import sympy
import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from passes.ir.errors import PassError
from passes.ir.meta import BLOCK, CAPTURE, EXPORT_VAL, FLOPS, SHAPE
from passes.ir.ops import NAMESPACE
from passes.analysis.saved_tensors import observe_saved_tensors

StorageKind = Literal["activation", "internal"]
NodeKind = Literal["input", "param", "buffer", "compute", "output"]
SOURCE = "__source__"
"""Name of the virtual source node :func:`forward_cut_points` adds (never an fx node name)."""

_CALLS = ("call_function", "call_method", "call_module")
_RANDOM_OPS = ("dropout", "bernoulli", "rand", "randn", "randint", "randperm", "multinomial", "normal",
               "uniform", "native_dropout", "feature_dropout", "alpha_dropout")


@dataclass(frozen=True, kw_only=True)
class StorageFacts:
    """One activation or internal storage of the forward: ``name`` (``"<owner>:<k>"``, the owner's
    k-th storage), ``owner`` (node whose op allocates it), ``nbytes`` (bytes at the dims' hints),
    ``kept`` (autograd keeps it for backward), ``kind`` (a node output or an op-internal save),
    ``savers`` (the nodes autograd keeps it for whose backward runs, in forward order: backward
    unpacks it when each of them runs; empty for a kept storage no running backward unpacks)."""

    name: str
    owner: str
    nbytes: int
    kept: bool
    kind: StorageKind
    savers: tuple[str, ...] = ()


def to_networkx(gm_or_graph: fx.GraphModule | fx.Graph, *, storages: bool = True) -> nx.DiGraph:
    """The DiGraph view of an analysed training graph (attributes in the module docstring; bytes
    and FLOPs at the dims' hints). Needs ``annotate_shapes`` and ``annotate_flops`` to have run
    and ``gm.meta[CAPTURE]``; a bare ``fx.Graph`` is read through its owning module.

    ``storages=False``: the structure only, from any fx graph (no fake forward run, no meta
    needed): bytes are 0, ``owns``/``reads`` empty, FLOPs from ``node.meta[FLOPS]`` where present,
    and ``activation`` is a compute node whose value holds a tensor (by its shape meta; assumed
    when unknown). Enough for the cut points."""
    gm = gm_or_graph.owning_module if isinstance(gm_or_graph, fx.Graph) else gm_or_graph
    if not isinstance(gm, fx.GraphModule):
        raise PassError("to_networkx: the graph has no owning GraphModule; pass the captured GraphModule "
                        "(its capture info and parameters are needed for the fake forward run)")
    if not storages:
        return _structure(gm)
    missing = [n.name for n in gm.graph.nodes if n.op in _CALLS and FLOPS not in n.meta]
    if missing:
        raise PassError(f"to_networkx: node {missing[0]!r} has no node.meta[{FLOPS!r}]; run annotate_shapes and "
                        f"annotate_flops first")
    return view_of_run(gm, observe_saved_tensors(gm))


def view_of_run(gm: fx.GraphModule, run) -> nx.DiGraph:
    """:func:`to_networkx` from a forward run already made (``observe_saved_tensors(gm)``, e.g.
    the memory analysis's own): FLOPs are 0 where ``node.meta`` has none, and
    ``G.graph["storage_of"]`` maps each storage name to the run's storage object."""
    if run.regions:
        raise PassError("to_networkx: the graph holds checkpointed regions; build the view from the graph before "
                        "apply_checkpoint (the view describes the plain forward)")
    name_of: dict = {}  # _Storage -> its name
    owned: dict[fx.Node, list] = {}
    for st in run.storages.values():
        if st.kind in ("activation", "internal") and st.owner is not None:
            owned.setdefault(st.owner, []).append(st)
    for node, sts in owned.items():
        sts.sort(key=lambda s: (s.kind != "activation", s.index))
        for k, st in enumerate(sts):
            name_of[st] = f"{node.name}:{k}"

    def kind_of(node: fx.Node) -> NodeKind:
        return _kind(node, run.node_storages.get(node, []))

    def storage_attrs(node: fx.Node, kind: NodeKind) -> dict:
        own = tuple(StorageFacts(name=name_of[st], owner=node.name, nbytes=st.hint, kept=st.kept, kind=st.kind,
                                 savers=tuple(n.name for n in sorted(st.savers, key=run.index.__getitem__)
                                              if n in run.runs_backward))
                    for st in owned.get(node, ()))
        reads: dict[str, None] = {}
        for src in node.all_input_nodes:
            for st in run.node_storages.get(src, ()):
                if st in name_of:
                    reads[name_of[st]] = None
        return dict(activation=kind == "compute" and any(st in name_of for st in run.node_storages.get(node, [])),
                    out_bytes=sum(s.nbytes for s in own if s.kind == "activation"),
                    internal_bytes=sum(s.nbytes for s in own if s.kind == "internal"),
                    kept_bytes=sum(s.nbytes for s in own if s.kept), owns=own, reads=tuple(reads))

    fixed = sum(st.hint for st in run.storages.values() if st.kind == "input" and st.kept)
    G = _view(gm, fixed_bytes=fixed, kind_of=kind_of, storage_attrs=storage_attrs, mutated=_mutated_owners(gm, run))
    G.graph["storage_of"] = {name: st for st, name in name_of.items()}
    return G


def _structure(gm: fx.GraphModule) -> nx.DiGraph:
    """:func:`to_networkx` without the fake run (``storages=False``)."""
    buffers = {name for name, _ in gm.named_buffers()}

    def kind_of(node: fx.Node) -> NodeKind:
        kind = _kind(node, None)
        return "buffer" if kind == "param" and node.target in buffers else kind

    def storage_attrs(node: fx.Node, kind: NodeKind) -> dict:
        return dict(activation=kind == "compute" and _holds_tensor(node), out_bytes=0, internal_bytes=0,
                    kept_bytes=0, owns=(), reads=())

    return _view(gm, fixed_bytes=0, kind_of=kind_of, storage_attrs=storage_attrs)


def _view(gm: fx.GraphModule, *, fixed_bytes: int, kind_of, storage_attrs, mutated=frozenset()) -> nx.DiGraph:
    """The DiGraph of ``gm``: the attributes every view has, plus ``storage_attrs(node, kind)``
    (``activation``, the bytes, ``owns``, ``reads``); one edge per fx input."""
    hints = gm.meta[CAPTURE].symbols() if CAPTURE in gm.meta else {}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [a for a in tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    G = nx.DiGraph(loss=outs[0].name if outs else None, fixed_bytes=fixed_bytes)
    fwd = bwd = 0
    for node in gm.graph.nodes:
        kind = kind_of(node)
        flops = node.meta.get(FLOPS)
        f, b = ((int(sympy.sympify(flops.fwd).subs(hints)), int(sympy.sympify(flops.bwd).subs(hints)))
                if flops is not None else (0, 0))
        fwd, bwd = fwd + f, bwd + b
        G.add_node(node.name, op=str(node.target) if node.op in _CALLS else node.op, kind=kind,
                   is_param=kind in ("param", "buffer"), is_input=kind == "input", is_output=kind == "output",
                   flops=f, bwd_flops=b, random=draws_random(node),
                   recomputable=kind == "compute" and not _mutates(node) and node not in mutated
                   and not is_project_op(node),
                   weighted=_weighted(gm, node), block=node.meta[BLOCK].name if BLOCK in node.meta else None,
                   **storage_attrs(node, kind))
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            G.add_edge(src.name, node.name)
    G.graph.update(fwd_flops=fwd, bwd_flops=bwd)
    return G


def _holds_tensor(node: fx.Node) -> bool:
    """Whether a compute node's value holds a tensor (sizes and scalars do not), by its shape
    meta or export's example value; assumed when neither is known (a ``symbolic_trace`` graph)."""
    shape = node.meta.get(SHAPE)
    if shape is not None:
        return bool(shape.tensors)
    val = node.meta.get(EXPORT_VAL)
    if val is not None:
        return any(isinstance(v, torch.Tensor) for v in tree_leaves(val))
    return True


def _weighted(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A ``call_module`` of a module that holds parameters (its weights are inside the call)."""
    if node.op != "call_module":
        return False
    try:
        return any(True for _ in gm.get_submodule(str(node.target)).parameters())
    except AttributeError:
        return False


def forward_cut_points(G: nx.DiGraph) -> tuple[str, ...]:
    """The cut points of the forward (module docstring): trunk nodes every path from the inputs
    to the loss passes through, in forward order; the loss itself is left out. Empty when the
    graph has no loss or no trunk reaches it."""
    H = trunk(G)
    loss = G.graph.get("loss")
    if loss not in H:
        return ()
    H = H.subgraph(nx.ancestors(H, loss) | {loss}).copy()
    H.add_edges_from((SOURCE, r) for r in [n for n in H if H.in_degree(n) == 0])
    idom = nx.immediate_dominators(H, SOURCE)
    chain = []
    node = idom.get(loss)
    while node is not None and node != SOURCE:
        chain.append(node)
        node = idom.get(node)
    return tuple(reversed(chain))


def activation_graph(G: nx.DiGraph) -> nx.DiGraph:
    """The subgraph of activation nodes (the forward's data flow without inputs, parameters,
    sizes and the output node)."""
    return G.subgraph([n for n, d in G.nodes(data=True) if d["activation"]])


def trunk(G: nx.DiGraph) -> nx.DiGraph:
    """The activations that depend both on a graph input and on a parameter: the data as the
    model's weights transform it (from the embedding lookup or the first conv on). The others
    are *side* activations and could be made anywhere, as parameters and inputs are read
    anywhere: those made from sizes and parameters alone (``arange`` positions, RoPE tables,
    constant masks) and those made from the inputs alone (an attention mask or position ids
    from the token ids, shifted labels)."""
    A = activation_graph(G)
    fed = _reached(G, [n for n, d in G.nodes(data=True) if d["is_input"]])
    weights = [n for n, d in G.nodes(data=True) if d["kind"] == "param" or d.get("weighted")]
    through = _reached(G, weights) | {n for n in weights if G.nodes[n]["kind"] == "compute"}
    return A.subgraph([n for n in A if n in fed and n in through])


def _reached(G: nx.DiGraph, sources: list[str]) -> set[str]:
    """Every node a path from one of ``sources`` reaches (the sources themselves excepted unless reached)."""
    H = nx.DiGraph(G.edges)
    H.add_edges_from((SOURCE, s) for s in sources)
    return nx.descendants(H, SOURCE) - {SOURCE} if sources else set()


def generations(G: nx.DiGraph) -> tuple[tuple[str, ...], ...]:
    """Topological generations of the activation graph: each holds nodes that only read
    activations of earlier generations (nodes of one generation could run at the same time)."""
    return tuple(tuple(g) for g in nx.topological_generations(activation_graph(G)))


def _kind(node: fx.Node, storages) -> NodeKind:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return "buffer" if storages and all(st.kind == "buffer" for st in storages) else "param"
    return "compute"


def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def is_project_op(node: fx.Node) -> bool:
    """Whether ``node`` calls one of the project's ``partitioner::*`` custom ops (tp and sp
    collectives, cp exchanges, ZeRO-3 gathers, offload brackets, sharded dropout)."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) == NAMESPACE


def _mutates(node: fx.Node) -> bool:
    """An op that writes one of its arguments (``add_``, ``copy_``, ``index_put_``)."""
    schema = _schema(node)
    return bool(schema is not None and schema.is_mutable)


def _mutated_owners(gm: fx.GraphModule, run) -> set[fx.Node]:
    """Owners of activation storages that some in-place op writes: recomputing them would give
    the value before the write."""
    out = set()
    for node in gm.graph.nodes:
        if _mutates(node):
            for src in node.all_input_nodes:
                for st in run.node_storages.get(src, ()):
                    if st.kind == "activation" and st.owner is not None:
                        out.add(st.owner)
    return out


def draws_random(node: fx.Node) -> bool:
    """Whether ``node``'s op may draw random numbers (tagged ``nondeterministic_seeded``, which
    fused attention is whatever its ``dropout_p``, or a dropout/rand op by name): recomputing it
    needs the RNG state it ran with."""
    schema = _schema(node)
    if schema is not None and getattr(torch.Tag, "nondeterministic_seeded", None) in getattr(node.target, "tags", ()):
        return True
    name = schema.name.split("::")[-1] if schema is not None else str(node.target)
    return name in _RANDOM_OPS