"""Our ``partitioner::*`` ops in the dynamo ONNX exporter: its ``custom_translation_table``.

``torch.onnx.export(..., dynamo=True)`` lowers every fx node through an onnxscript function;
:func:`custom_translation_table` maps each of our ops (:mod:`passes.ir.ops`,
:mod:`passes.ir.offload_ops`) to one that emits a single node of the ONNX domain :data:`DOMAIN`
(a marker: a plain ``Identity``), with the attributes the TorchScript exporter's symbolic
functions give it (``ir_dumps.onnx_export``), so a file reads the same whichever exporter wrote
it::

    torch op                       ONNX node (domain partitioner)     attributes
    copy_to_tp(x, group)           CopyToTP(x) -> y
    reduce_from_tp(x, group)       ReduceFromTP(x) -> y
    all_reduce(x, group, op)       AllReduce(x) -> y                  reduce_op (string)
    vocab_parallel_cross_entropy   VocabParallelCrossEntropy(logits, target) -> (loss, softmax)
                                                                      vocab_start, ignore_index
    sharded_dropout                ShardedDropout(x) -> (y, mask)     ratio, dim, rank, degree
    reduce_scatter_seq, all_gather_seq, scatter_to_seq, gather_from_seq
                                   ReduceScatterSeq(x) -> y, ...      dim, tp
    split_point(x)                 Identity(x) -> y                   (the standard domain)
    zero3_gather(shards, ...)      Zero3Gather(shards...) -> [params] degree, stage, site
                                   (a sequence; SequenceAt takes each)
    ring_attention(q, k, v, ...)   RingAttention(q, k, v) -> (out, lse)  causal, degree
    seq_to_heads, heads_to_seq     SeqToHeads(x) -> y, HeadsToSeq(x)  degree
    reduce_from_cp(x, ...)         ReduceFromCP(x) -> y               degree
    load_balanced_positions        LoadBalancedPositions(index) -> y  degree
    ep_dispatch, ep_combine        EpDispatch(x) -> y, EpCombine(x)   dim, degree
    ep_local(x, degree, group)     EpLocal(x) -> y                    degree
    ep_route(ids, experts, ...)    EpRoute(ids) -> (local, owned)     experts, degree
    data_mean(x, degree, group)    DataMean(x) -> y                   degree

The tp group's name is process state, not an attribute (the file's ``ranks`` attribute, added
later, names the group's global ranks). ``offload_begin`` / ``offload_end`` (:data:`DROPPED_OPS`)
have no node: they bracket a node so that its saved tensors wait on the host, which a forward
graph has no place for (the TorchScript trace drops them too), and, returning nothing, they have
no value the exporter could type; :func:`drop_bracket_nodes` takes them out of the exported
program before translation. Output shapes and types come from the exporter (the fx nodes' fake
values), not from the schemas here, which only tell onnxscript inputs from attributes.

onnxscript is imported here: import this module only where the dynamo exporter runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import onnxscript
from onnx.defs import OpSchema

import passes.ir.cp_ops  # noqa: F401  (defines the context-parallel ops)
import passes.ir.moe_ops  # noqa: F401  (defines the expert-parallel ops)
import passes.ir.offload_ops  # noqa: F401  (defines offload_begin / offload_end)
import passes.ir.zero3_ops  # noqa: F401  (defines zero3_gather)
from passes.ir.ops import NAMESPACE

DOMAIN = NAMESPACE
DOMAIN_VERSION = 1

AttrKind = Literal["int", "float", "string"]
_ATTR_TYPES = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "string": OpSchema.AttrType.STRING}
_ANY_TENSOR = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)",
               "tensor(int32)", "tensor(int16)", "tensor(int8)", "tensor(uint8)", "tensor(bool)"]


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """How one torch op becomes one node of :data:`DOMAIN`."""

    op_type: str
    inputs: tuple[str, ...]
    """The torch schema's tensor arguments that become the node's inputs, in order."""
    outputs: int
    attrs: tuple[tuple[str, str, AttrKind], ...] = ()
    """(torch argument, ONNX attribute, kind) for each argument that becomes an attribute."""


_SEQ_ATTRS = (("dim", "dim", "int"), ("tp", "tp", "int"))
NODE_SPECS: dict[str, NodeSpec] = {
    "copy_to_tp": NodeSpec(op_type="CopyToTP", inputs=("x",), outputs=1),
    "reduce_from_tp": NodeSpec(op_type="ReduceFromTP", inputs=("x",), outputs=1),
    "all_reduce": NodeSpec(op_type="AllReduce", inputs=("x",), outputs=1, attrs=(("op", "reduce_op", "string"),)),
    "vocab_parallel_cross_entropy": NodeSpec(
        op_type="VocabParallelCrossEntropy", inputs=("logits", "target"), outputs=2,
        attrs=(("vocab_start", "vocab_start", "int"), ("ignore_index", "ignore_index", "int"))),
    "sharded_dropout": NodeSpec(
        op_type="ShardedDropout", inputs=("x",), outputs=2,
        attrs=(("p", "ratio", "float"), ("dim", "dim", "int"), ("rank", "rank", "int"), ("degree", "degree", "int"))),
    "reduce_scatter_seq": NodeSpec(op_type="ReduceScatterSeq", inputs=("x",), outputs=1, attrs=_SEQ_ATTRS),
    "all_gather_seq": NodeSpec(op_type="AllGatherSeq", inputs=("x",), outputs=1, attrs=_SEQ_ATTRS),
    "scatter_to_seq": NodeSpec(op_type="ScatterToSeq", inputs=("x",), outputs=1, attrs=_SEQ_ATTRS),
    "gather_from_seq": NodeSpec(op_type="GatherFromSeq", inputs=("x",), outputs=1, attrs=_SEQ_ATTRS),
    # context parallelism (passes.ir.cp_ops)
    "ring_attention": NodeSpec(op_type="RingAttention", inputs=("q", "k", "v"), outputs=2,
                               attrs=(("causal", "causal", "int"), ("degree", "degree", "int"))),
    "seq_to_heads": NodeSpec(op_type="SeqToHeads", inputs=("x",), outputs=1, attrs=(("degree", "degree", "int"),)),
    "heads_to_seq": NodeSpec(op_type="HeadsToSeq", inputs=("x",), outputs=1, attrs=(("degree", "degree", "int"),)),
    "reduce_from_cp": NodeSpec(op_type="ReduceFromCP", inputs=("x",), outputs=1,
                               attrs=(("degree", "degree", "int"),)),
    "load_balanced_positions": NodeSpec(op_type="LoadBalancedPositions", inputs=("index",), outputs=1,
                                        attrs=(("degree", "degree", "int"),)),
    # expert parallelism (passes.ir.moe_ops)
    "ep_dispatch": NodeSpec(op_type="EpDispatch", inputs=("x",), outputs=1,
                            attrs=(("dim", "dim", "int"), ("degree", "degree", "int"))),
    "ep_combine": NodeSpec(op_type="EpCombine", inputs=("x",), outputs=1,
                           attrs=(("dim", "dim", "int"), ("degree", "degree", "int"))),
    "ep_local": NodeSpec(op_type="EpLocal", inputs=("x",), outputs=1, attrs=(("degree", "degree", "int"),)),
    "ep_route": NodeSpec(op_type="EpRoute", inputs=("ids",), outputs=2,
                         attrs=(("experts", "experts", "int"), ("degree", "degree", "int"))),
    "data_mean": NodeSpec(op_type="DataMean", inputs=("x",), outputs=1, attrs=(("degree", "degree", "int"),)),
}
"""torch op name (``partitioner::<name>``) -> its ONNX node."""
IDENTITY_OPS = ("split_point",)
"""Our ops that compute an identity of their one input and mean nothing to a forward graph (a
marker for the runtime's autograd): an ONNX ``Identity`` under the fx node's name, so a program
without communication stays runnable."""
DROPPED_OPS = ("offload_begin", "offload_end")
"""Our ops that leave no node in the file."""


def _schema(spec: NodeSpec) -> OpSchema:
    """The node's ONNX schema, for onnxscript only (never registered with onnx: the checker
    leaves a domain it has no schemas for alone, as it did for the TorchScript exporter's nodes)."""
    params = [OpSchema.FormalParameter(name, f"T{i}") for i, name in enumerate(spec.inputs)]
    results = [OpSchema.FormalParameter(f"output{i}", f"R{i}") for i in range(spec.outputs)]
    constraints = [(f"T{i}", _ANY_TENSOR, "") for i in range(len(spec.inputs))] + \
                  [(f"R{i}", _ANY_TENSOR, "") for i in range(spec.outputs)]
    return OpSchema(spec.op_type, DOMAIN, DOMAIN_VERSION, inputs=params, outputs=results,
                    type_constraints=constraints,
                    attributes=[OpSchema.Attribute(name, _ATTR_TYPES[kind], "", required=True)
                                for _, name, kind in spec.attrs])


def _translation(name: str, spec: NodeSpec) -> Callable[..., Any]:
    """The onnxscript function of ``partitioner::<name>``: binds the fx node's arguments by the
    torch schema's names (defaults included) and emits the node."""
    import torch

    op = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), spec.op_type, _schema(spec))
    arguments = getattr(torch.ops.partitioner, name).default._schema.arguments

    def translate(*args: Any, **kwargs: Any) -> Any:
        bound = {a.name: a.default_value for a in arguments if a.has_default_value()}
        bound.update(zip((a.name for a in arguments), args))
        bound.update(kwargs)
        return op(*(bound[i] for i in spec.inputs),
                  **{attr: int(bound[arg]) if kind == "int" else bound[arg] for arg, attr, kind in spec.attrs})

    translate.__name__ = f"partitioner_{name}"
    return translate


def custom_translation_table() -> dict[Any, Callable[..., Any]]:
    """``torch.ops.partitioner.<op>.default`` -> onnxscript function, for every op of ours that
    has a node (``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``)."""
    import torch

    table: dict[Any, Callable[..., Any]] = {getattr(torch.ops.partitioner, name).default: _translation(name, spec)
                                            for name, spec in NODE_SPECS.items()}
    table.update({getattr(torch.ops.partitioner, name).default: _identity for name in IDENTITY_OPS})
    table[torch.ops.partitioner.zero3_gather.default] = _zero3_gather
    return table


def _zero3_gather_op() -> Any:
    variadic = OpSchema.FormalParameterOption.Variadic
    schema = OpSchema("Zero3Gather", DOMAIN, DOMAIN_VERSION,
                      inputs=[OpSchema.FormalParameter("shards", "T", param_option=variadic, is_homogeneous=False)],
                      outputs=[OpSchema.FormalParameter("params", "S")],
                      type_constraints=[("T", _ANY_TENSOR, ""), ("S", [f"seq({t})" for t in _ANY_TENSOR], "")],
                      attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "", required=True)
                                  for name in ("degree", "stage", "site")])
    return onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), "Zero3Gather", schema)


def _zero3_gather(shards: Any, shapes: Any, degree: int, group: str, stage: int, site: int) -> Any:
    """``zero3_gather``: ``Zero3Gather(shards...)``, whose output is the sequence of the full
    parameters (the exporter takes each with ``SequenceAt``, typed by the fx node's values); the
    dp degree, stage and gather site as attributes, the dp group's name being process state."""
    return _zero3_gather_op()(*shards, degree=degree, stage=stage, site=site)


def _identity(x: Any) -> Any:
    from onnxscript import opset18

    return opset18.Identity(x)


def drop_bracket_nodes(program: Any) -> int:
    """Erase the :data:`DROPPED_OPS` nodes from ``program`` (a ``torch.export.ExportedProgram``,
    the exporter's own copy of the graph), in every graph it holds; returns how many."""
    import torch

    targets = {getattr(torch.ops.partitioner, name).default for name in DROPPED_OPS}
    erased = 0
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target in targets]
        for node in nodes:
            module.graph.erase_node(node)  # returns nothing: no users
        if nodes:
            module.recompile()
        erased += len(nodes)
    return erased
