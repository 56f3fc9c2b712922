"""ONNX per pipeline stage: ``stage<s>_tp<r>.onnx`` for each stage of a :class:`PipelineSplit`.

Each stage program is exported with the dynamo exporter (``torch.onnx.export(..., dynamo=True)``
of ``torch.export.export(strict=False)``, no graph optimisation, so parameters stay initializers
under their original names such as ``blocks.0.attn.qkv.weight``), our ops through its
``custom_translation_table`` (:mod:`ir_dumps.onnx_translations`). Where the dynamo exporter
fails (or onnxscript, which it needs, is not installed), the TorchScript exporter
(``dynamo=False``, no constant folding; identical tensors it deduplicates appear as ``Identity``
nodes whose output keeps the name) writes the file instead, with a ``RuntimeWarning`` naming the
failure; ``exporter=`` (:data:`EXPORTERS`) picks one. Metadata ``partitioner.exporter``
(``dynamo`` / ``torchscript``) says which wrote a file, and ``partitioner.exporter_fallback`` why
the dynamo exporter did not. Our decisions travel along:

* ``model.metadata_props``: ``partitioner.stage``, ``partitioner.n_stages``, ``partitioner.tp_rank``,
  ``partitioner.tp_degree``, ``partitioner.tied`` and ``partitioner.annotations`` (JSON: per fx
  node of the stage, its checkpoint / tensor-parallel / offload facts);
* initializer ``doc_string``: the parameter's stage, tensor-parallel sharding and tied copies;
* communication (``with_comm=True``, the default) as nodes of the custom domain
  ``partitioner``::

      partitioner.Recv() -> add_2            (graph input add_2 replaced; attrs: src_stage, shape, dtype)
      partitioner.Send(add_2) -> add_2.sent  (attrs: dst_stages)

  A stage with communication nodes is a faithful picture, not runnable in onnxruntime (it has no
  kernel for the custom domain); ``with_comm=False`` keeps the plain, runnable program.

One file per (pipeline stage, tp rank): :func:`export_split` writes the unsharded stages (as tp
rank 0); :func:`export_rank_programs` writes the programs of given
:class:`passes.ir.program.RankProgram` s, each stage as its rank runs it (sharded parameters as
that rank's slices under their original names). Tracing runs the programs, so their custom ops
need real kernels, which the runtime owns: the caller passes ``tracing``, a context in which
they run on one process (:func:`runtime.kernels.collectives.trace_groups`). The tensor-parallel
collectives (``torch.ops.partitioner.*``, :mod:`passes.ir.ops`) become custom-domain nodes, the
same under both exporters (the translation table of the dynamo one, ONNX symbolic functions
registered for the TorchScript one)::

    partitioner.CopyToTP(x) -> y                  identity forward, all-reduce of the gradient
    partitioner.ReduceFromTP(x) -> y              all-reduce (sum) forward
    partitioner.AllReduce(x) -> y                 (attr reduce_op)
    partitioner.VocabParallelCrossEntropy(logits, target) -> (loss, softmax)   (attrs vocab_start, ignore_index)
    partitioner.ShardedDropout(x) -> (y, mask)    one device's mask, this rank's slice (attrs ratio, dim, rank, degree)

each named after its fx node and carrying ``tp_rank``, ``tp_degree`` and ``ranks`` (the global
ranks of its tp group). The model's metadata adds ``partitioner.rank`` and
``partitioner.tp_params`` (JSON: per parameter of the stage, its shard dim, sections, local and
full shape). Such a file opens in Netron as the rank's program; like Send/Recv it has no kernel
in onnxruntime.
"""
from __future__ import annotations

import contextlib
import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Literal, Mapping, Sequence

import sympy
import torch
from torch import fx

from ir_dumps.encode import facts, to_json
from passes.ir.errors import PassError
from passes.ir.meta import (
    CAPTURE, CHECKPOINT, PIPELINE_STAGE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN, PipelineSplit, StageIO, TensorMeta,
    dim_symbol,
)
from passes.ir.program import RankProgram
from passes.ir.graph_modules import compiled
import passes.ir.cp_ops  # noqa: F401  (the ops must exist before their symbolics)
import passes.ir.moe_ops  # noqa: F401
import passes.ir.ops  # noqa: F401

DOMAIN = "partitioner"
OPSET = 18
Exporter = Literal["dynamo", "torchscript"]
ExporterChoice = Literal["auto", "dynamo", "torchscript"]
EXPORTERS: tuple[ExporterChoice, ...] = ("auto", "dynamo", "torchscript")
"""``auto``: the dynamo exporter, the TorchScript one where it fails; the others: that one only."""
_ANNOTATION_KEYS = (PIPELINE_STAGE, CHECKPOINT, TENSOR_PARALLEL, "offload")


def stage_example_inputs(split: PipelineSplit | Sequence[StageIO], stage: int,
                         dims: Mapping[str, int]) -> tuple[Any, ...]:
    """Inputs of stage ``stage`` for tracing: zeros of each input's shape and dtype (token ids
    of 0 are valid indices), sizes evaluated from ``dims`` (named dim -> int)."""
    subs = {dim_symbol(k): int(v) for k, v in dims.items()}
    io = split.io if isinstance(split, PipelineSplit) else split
    out: list[Any] = []
    for inp in io[stage].inputs:
        if inp.kind == "size":
            out.append(_concrete(inp.value, subs, inp.name))
        else:
            meta: TensorMeta = inp.meta  # type: ignore[assignment]
            shape = tuple(_concrete(d, subs, inp.name) for d in meta.shape)
            out.append(torch.zeros(shape, dtype=meta.dtype))
    return tuple(out)


def export_stage(split: PipelineSplit, stage: int, path: str | Path, *, dims: Mapping[str, int],
                 tp_rank: int = 0, with_comm: bool = True, opset: int = OPSET,
                 exporter: ExporterChoice = "auto") -> Path:
    """Export stage ``stage`` of ``split`` to ``path``; returns the path. See the module docstring
    (``exporter``: :data:`EXPORTERS`)."""
    import onnx

    path = Path(path)
    traced = _trace(split.modules[stage], split.io, stage, path, dims=dims, opset=opset, exporter=exporter)
    model = traced.model
    _annotate(model, split.modules[stage], _split_facts(split), stage, tp_rank)
    _record_exporter(model, traced)
    if with_comm:
        _add_comm_nodes(model, split.io[stage], stage)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def export_split(split: PipelineSplit, out_dir: str | Path, *, dims: Mapping[str, int], with_comm: bool = True,
                 opset: int = OPSET, exporter: ExporterChoice = "auto") -> list[Path]:
    """``stage<s>_tp<r>.onnx`` for every stage (tp rank 0; see the module docstring)."""
    out_dir = Path(out_dir)
    tp_rank = 0
    return [export_stage(split, s, out_dir / f"stage{s}_tp{tp_rank}.onnx", dims=dims, tp_rank=tp_rank,
                         with_comm=with_comm, opset=opset, exporter=exporter) for s in range(split.n_stages)]


def export_rank_programs(programs: Sequence[RankProgram], out_dir: str | Path, *, dims: Mapping[str, int] | None = None,
                         with_comm: bool = True, opset: int = OPSET,
                         tracing: Callable[[RankProgram], ContextManager] | None = None,
                         exporter: ExporterChoice = "auto") -> list[Path]:
    """``stage<s>_tp<r>.onnx`` in ``out_dir`` for every stage ``s`` of every program (tp rank
    ``r`` its ``tp_index``): the program as that rank runs it. Returns the paths, in order.

    ``dims``: named dim -> int for the example inputs (default: the capture's hints);
    ``tracing(program)``: the context the program's custom ops run in while traced (see the
    module docstring; without one, a program with tp collectives cannot be traced).
    ``with_comm=False`` leaves out Send/Recv (the tp collectives are the program itself and always stay);
    ``exporter``: :data:`EXPORTERS`.
    """
    import onnx

    out_dir = Path(out_dir)
    paths = []
    for program in programs:
        for stage in program.stages:
            module, path = program.modules[stage], out_dir / f"stage{stage}_tp{program.tp_index}.onnx"
            stage_dims = dims if dims is not None else _dims_of(module)
            with (tracing(program) if tracing is not None else contextlib.nullcontext()):
                traced = _trace(module, program.io, stage, path, dims=stage_dims, opset=opset, exporter=exporter)
            model = traced.model
            _annotate(model, module, _program_facts(program), stage, program.tp_index)
            _record_exporter(model, traced)
            _annotate_rank(model, program, stage)
            if with_comm:
                peers = {(c.kind, c.peer_stage): c.ranks[0] for c in program.comms if c.kind in ("send", "recv")}
                _add_comm_nodes(model, program.io[stage], stage, peers=peers)
            onnx.checker.check_model(model)
            onnx.save(model, str(path))
            paths.append(path)
    return paths


def _dims_of(module: fx.GraphModule) -> dict[str, int]:
    info = module.meta.get(CAPTURE)
    if info is None:
        raise PassError("onnx_export: the program has no capture info to take example dims from; pass dims=")
    return dict(info.dims)


@dataclass(frozen=True)
class _Facts:
    """What the annotations need of a split or a rank program."""
    n_stages: int
    skip: str
    tied: dict[str, tuple[int, ...]]
    aliases: dict[str, tuple[str, ...]]


def _split_facts(split: PipelineSplit) -> _Facts:
    return _Facts(split.n_stages, split.skip, dict(split.tied), dict(split.aliases))


def _program_facts(program: RankProgram) -> _Facts:
    return _Facts(program.n_stages, "relay", {n: t.stages for n, t in program.tied.items()},
                  {n: t.aliases for n, t in program.tied.items()})


# --------------------------------------------------------------------------------------------------
# Tensor-parallel collectives: ONNX symbolic functions for the TorchScript exporter (the
# dynamo exporter's translations, with the same node types and attributes, are in
# ir_dumps.onnx_translations).
# torch op name -> ONNX op type of the custom domain
TP_OP_TYPES = {"copy_to_tp": "CopyToTP", "reduce_from_tp": "ReduceFromTP", "all_reduce": "AllReduce",
               "vocab_parallel_cross_entropy": "VocabParallelCrossEntropy", "sharded_dropout": "ShardedDropout",
               "reduce_scatter_seq": "ReduceScatterSeq", "all_gather_seq": "AllGatherSeq",
               "scatter_to_seq": "ScatterToSeq", "gather_from_seq": "GatherFromSeq"}


def _same_type(out: Any, like: Any) -> Any:
    """Give a custom node's output its input's type, so the exporter's shape inference goes on."""
    out.setType(like.type())
    return out


def _sym_copy_to_tp(g, x, group):
    return _same_type(g.op(f"{DOMAIN}::CopyToTP", x), x)


def _sym_reduce_from_tp(g, x, group):
    return _same_type(g.op(f"{DOMAIN}::ReduceFromTP", x), x)


def _sym_all_reduce(g, x, group, op):
    from torch.onnx import symbolic_helper

    return _same_type(g.op(f"{DOMAIN}::AllReduce", x, reduce_op_s=symbolic_helper._maybe_get_const(op, "s")), x)


def _sym_vocab_parallel_cross_entropy(g, logits, target, vocab_start, ignore_index, group):
    from torch.onnx import symbolic_helper

    loss, softmax = g.op(f"{DOMAIN}::VocabParallelCrossEntropy", logits, target,
                         vocab_start_i=symbolic_helper._maybe_get_const(vocab_start, "i"),
                         ignore_index_i=symbolic_helper._maybe_get_const(ignore_index, "i"), outputs=2)
    sizes = symbolic_helper._get_tensor_sizes(logits)
    if sizes:  # loss is one value per token: [N] of [N, V/tp]
        loss.setType(logits.type().with_sizes(sizes[:1]))
    return loss, _same_type(softmax, logits)


def _sym_sharded_dropout(g, x, p, dim, rank, degree, sections):
    from torch.onnx import symbolic_helper

    const = symbolic_helper._maybe_get_const
    y, mask = g.op(f"{DOMAIN}::ShardedDropout", x, ratio_f=const(p, "f"), dim_i=const(dim, "i"),
                   rank_i=const(rank, "i"), degree_i=const(degree, "i"), outputs=2)
    return _same_type(y, x), mask


def _sym_seq(op_type: str, scale_up: bool, degree: str = "tp"):
    """Symbolic of an op ``(x, dim, degree, group)`` whose dim ``dim`` grows (gathers) or shrinks
    (scatters) by its degree: the sequence-parallel ops (attrs ``dim`` and ``tp``) and the
    expert-parallel dispatch and combine (``degree="degree"``: attrs ``dim`` and ``degree``)."""
    def symbolic(g, x, dim, tp, group):
        from torch.onnx import symbolic_helper

        d, t = symbolic_helper._maybe_get_const(dim, "i"), symbolic_helper._maybe_get_const(tp, "i")
        out = g.op(f"{DOMAIN}::{op_type}", x, dim_i=d, **{f"{degree}_i": t})
        sizes = symbolic_helper._get_tensor_sizes(x)
        if sizes and sizes[d] is not None:
            sizes = list(sizes)
            sizes[d] = sizes[d] * t if scale_up else sizes[d] // t
            out.setType(x.type().with_sizes(sizes))
        else:
            out.setType(x.type())
        return out
    return symbolic


def _sym_ep_local(g, x, degree, group):
    """This ep rank's columns of the combine weights: the last dim shrinks by ``degree``."""
    from torch.onnx import symbolic_helper

    n = symbolic_helper._maybe_get_const(degree, "i")
    out = g.op(f"{DOMAIN}::EpLocal", x, degree_i=n)
    sizes = symbolic_helper._get_tensor_sizes(x)
    out.setType(x.type().with_sizes([*sizes[:-1], sizes[-1] // n]) if sizes and sizes[-1] is not None else x.type())
    return out


def _sym_ep_route(g, ids, experts, degree, group):
    """The gathered rows' expert ids as indices into this ep rank's stacked rows, and which it owns."""
    from torch.onnx import symbolic_helper

    const = symbolic_helper._maybe_get_const
    local, owned = g.op(f"{DOMAIN}::EpRoute", ids, experts_i=const(experts, "i"), degree_i=const(degree, "i"),
                        outputs=2)
    local.setType(ids.type())
    owned.setType(ids.type().with_dtype(torch.bool))
    return local, owned


def _sym_cp(op_type: str, seq_scale: int = 0):
    """Symbolic of a context-parallel op of one tensor input (attr ``degree``); ``seq_scale``:
    Ulysses' all-to-all, +1 (the sequence grows by degree, heads shrink) or -1 (the inverse)."""
    def symbolic(g, x, degree, group):
        from torch.onnx import symbolic_helper

        d = symbolic_helper._maybe_get_const(degree, "i")
        out = g.op(f"{DOMAIN}::{op_type}", x, degree_i=d)
        sizes = symbolic_helper._get_tensor_sizes(x)
        if seq_scale and sizes and None not in sizes[1:3]:
            b, h, s, e = sizes
            sizes = [b, h // d, s * d, e] if seq_scale > 0 else [b, h * d, s // d, e]
            out.setType(x.type().with_sizes(sizes))
        else:
            out.setType(x.type())
        return out
    return symbolic


def _sym_ring_attention(g, q, k, v, causal, scale, degree, group):
    from torch.onnx import symbolic_helper

    const = symbolic_helper._maybe_get_const
    out, lse = g.op(f"{DOMAIN}::RingAttention", q, k, v, causal_i=int(const(causal, "b")),
                    degree_i=const(degree, "i"), outputs=2)
    return _same_type(out, q), lse


_SYMBOLICS = {"reduce_scatter_seq": _sym_seq("ReduceScatterSeq", False), "all_gather_seq": _sym_seq("AllGatherSeq", True),
              "scatter_to_seq": _sym_seq("ScatterToSeq", False), "gather_from_seq": _sym_seq("GatherFromSeq", True),
              "copy_to_tp": _sym_copy_to_tp, "reduce_from_tp": _sym_reduce_from_tp, "all_reduce": _sym_all_reduce,
              "vocab_parallel_cross_entropy": _sym_vocab_parallel_cross_entropy,
              "sharded_dropout": _sym_sharded_dropout,
              "ring_attention": _sym_ring_attention, "seq_to_heads": _sym_cp("SeqToHeads", +1),
              "heads_to_seq": _sym_cp("HeadsToSeq", -1), "reduce_from_cp": _sym_cp("ReduceFromCP"),
              "load_balanced_positions": _sym_cp("LoadBalancedPositions"),
              "ep_dispatch": _sym_seq("EpDispatch", True, "degree"), "ep_combine": _sym_seq("EpCombine", False, "degree"),
              "ep_local": _sym_ep_local, "ep_route": _sym_ep_route, "data_mean": _sym_cp("DataMean"),
              "split_point": lambda g, x: g.op("Identity", x)}  # a marker for the runtime's autograd


def register_tp_symbolics(opset: int = OPSET) -> None:
    """Register the ONNX symbolic functions of ``partitioner::*`` ops for ``opset`` (idempotent)."""
    for name, fn in _SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(f"{DOMAIN}::{name}", fn, opset)


@dataclass(frozen=True, kw_only=True)
class Traced:
    """An exported stage, before our annotations."""

    model: Any
    """The ``onnx.ModelProto``."""
    exporter: Exporter
    """Which exporter wrote it (metadata ``partitioner.exporter``)."""
    fallback_reason: str | None = None
    """Why the dynamo exporter's file is not the one (``exporter="auto"`` fell back), else ``None``."""


def _trace(module: fx.GraphModule, ios: Sequence[StageIO], stage: int, path: Path, *, dims: Mapping[str, int],
           opset: int, exporter: ExporterChoice = "auto") -> Traced:
    """Export ``module`` (stage ``stage`` of the contracts ``ios``): the dynamo exporter, and the
    TorchScript exporter where it fails (``exporter="auto"``; a ``RuntimeWarning`` names why)."""
    if exporter not in EXPORTERS:
        raise PassError(f"onnx_export: exporter {exporter!r} is not one of {EXPORTERS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    io = ios[stage]
    args = stage_example_inputs(ios, stage, dims)
    reason = None
    if exporter != "torchscript":
        try:
            with _closing_offload_regions():
                return Traced(model=_export_dynamo(module, args, io, opset), exporter="dynamo")
        except Exception as exc:  # noqa: BLE001 - any failure of the dynamo exporter falls back (or is named)
            reason = _first_line(exc)
            if exporter == "dynamo":
                raise PassError(f"onnx_export: stage {stage}: the dynamo exporter failed ({reason}); "
                                f"export with exporter='auto' to fall back to the TorchScript exporter") from exc
            warnings.warn(f"onnx_export: stage {stage}: the dynamo exporter failed ({reason}); "
                          f"{path.name} is the TorchScript exporter's (metadata partitioner.exporter=torchscript)",
                          RuntimeWarning, stacklevel=3)
    with _closing_offload_regions():
        model = _export_torchscript(module, args, io, stage, path, opset)
    return Traced(model=model, exporter="torchscript", fallback_reason=reason)


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause of ``exc`` (the exporter wraps the real error
    in a long report), after the outer types: ``ConversionError <- DispatchError: No ONNX ...``."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    lines = str(root).strip().splitlines()
    text = " <- ".join(type(e).__name__ for e in chain) + (f": {lines[0]}" if lines else "")
    return text[:500]


def _export_dynamo(module: fx.GraphModule, args: tuple[Any, ...], io: StageIO, opset: int) -> Any:
    """``torch.onnx.export(..., dynamo=True)`` with our ops as custom-domain nodes
    (:mod:`ir_dumps.onnx_translations`); the model, in memory (nothing written)."""
    from ir_dumps.onnx_translations import drop_bracket_nodes  # imports onnxscript

    with warnings.catch_warnings(), _quiet_exporter_logs():
        # training-mode and pytree deprecation warnings say nothing about this stage
        warnings.simplefilter("ignore")
        exported = torch.export.export(compiled(module), args, strict=False)
        drop_bracket_nodes(exported)
        # what torch.onnx.export(exported, args, dynamo=True, opset_version=opset,
        # custom_translation_table=custom_translation_table()) does, with the registry of ONNX
        # functions (torchlib and ours) built once per process instead of once per program
        from torch.onnx._internal.exporter import _core

        program = _core.export(exported, args, registry=_registry(opset), verbose=False, report=False,
                               # no graph optimisation: it folds constant expressions of parameters (a
                               # transposed weight) into new initializers; parameters must keep their names
                               optimize=False, opset_version=opset)
    _name_boundary(program.model.graph, [i.name for i in io.inputs if i.kind != "size"], [o.name for o in io.outputs])
    return program.model_proto


@functools.lru_cache(maxsize=None)
def _registry(opset: int) -> Any:
    """The dynamo exporter's registry of ONNX functions, torchlib's and our custom ops'
    (:func:`ir_dumps.onnx_translations.custom_translation_table`), as ``torch.onnx.export`` builds
    it for ``opset``: building it parses every torchlib function, about a third of exporting a
    small program."""
    from torch.onnx._internal.exporter import _constants, _registration

    from ir_dumps.onnx_translations import custom_translation_table

    registry = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))
    for op, function in custom_translation_table().items():
        registry.register_op(op, function, is_complex=False)
    return registry


def _name_boundary(graph: Any, inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """Give the graph's inputs and outputs (an ``onnx_ir`` graph) the stage contract's names.

    The dynamo exporter names values after the nodes of its own re-trace, so a contract name
    (an fx node name of the whole graph) may already be another value's: that value is renamed
    first (``<name>__<k>``). An output that is a graph input or an earlier output gets an
    ``Identity``, so every name is produced once."""
    import onnx_ir as ir

    taken = {v.name: v for v in _values(graph)}
    claimed: set[int] = set()

    def claim(value: Any, name: str) -> None:
        other = taken.get(name)
        if other is not None and other is not value:
            k = 1
            while f"{name}__{k}" in taken:
                k += 1
            other.name = f"{name}__{k}"
            taken[other.name] = other
        taken.pop(value.name, None)
        value.name = name
        taken[name] = value
        claimed.add(id(value))

    for value, name in zip(graph.inputs, inputs):
        claim(value, name)
    for index, (value, name) in enumerate(zip(list(graph.outputs), outputs)):
        if id(value) in claimed or value.is_graph_input():
            node = ir.Node("", "Identity", [value], num_outputs=1, name=f"identity_{name}")
            graph.append(node)
            node.outputs[0].type, node.outputs[0].shape = value.type, value.shape
            graph.outputs[index] = value = node.outputs[0]
        claim(value, name)


def _values(graph: Any) -> Iterator[Any]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs


@contextlib.contextmanager
def _closing_offload_regions() -> Iterator[None]:
    """Close the offload regions (their saved-tensor hooks) a trace opened and, failing between
    an ``offload_begin`` and its ``offload_end``, left open: the process trains on afterwards."""
    from passes.ir.offload_ops import end_region, open_regions

    depth = len(open_regions())
    try:
        yield
    finally:
        while len(open_regions()) > depth:
            end_region(open_regions()[-1].region)


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """The exporter logs a warning for each torchvision op it cannot register (torchvision is not
    ours to need); raised to errors only while it runs."""
    import logging

    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _export_torchscript(module: fx.GraphModule, args: tuple[Any, ...], io: StageIO, stage: int, path: Path,
                        opset: int) -> Any:
    """The TorchScript exporter (``dynamo=False``, no constant folding, so parameters stay
    initializers under their names), written to ``path`` and loaded back."""
    import onnx

    register_tp_symbolics(opset)
    with warnings.catch_warnings():
        # its deprecation and training-mode dropout warnings say nothing about this stage
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(compiled(module), args, str(path), dynamo=False, do_constant_folding=False, opset_version=opset,
                              input_names=[i.name for i in io.inputs], output_names=[o.name for o in io.outputs])
        except Exception as exc:  # noqa: BLE001 - name the stage and the fix
            raise PassError(f"onnx_export: stage {stage} did not export ({type(exc).__name__}: {exc}); "
                            f"try with_comm=False or a smaller opset, or inspect the stage module's .code") from exc
    return onnx.load(str(path))


def _record_exporter(model: Any, traced: Traced) -> None:
    """``partitioner.exporter`` (and ``partitioner.exporter_fallback``, the dynamo exporter's
    failure, when the TorchScript exporter stood in) in the model's metadata."""
    props = {"partitioner.exporter": traced.exporter}
    if traced.fallback_reason is not None:
        props["partitioner.exporter_fallback"] = traced.fallback_reason
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


# --------------------------------------------------------------------------------------------------
def _annotate(model: Any, module: fx.GraphModule, split: _Facts, stage: int, tp_rank: int) -> None:
    tp_plan = module.meta.get(TENSOR_PARALLEL_PLAN) if hasattr(module, "meta") else None
    annotations: dict[str, dict[str, Any]] = {}
    for node in module.graph.nodes:
        found = {key: to_json(value) for key, value in facts(node.meta) if key in _ANNOTATION_KEYS[1:]}
        if found:
            annotations[node.name] = found
    props = {
        "partitioner.stage": str(stage),
        "partitioner.n_stages": str(split.n_stages),
        "partitioner.tp_rank": str(tp_rank),
        "partitioner.tp_degree": str(getattr(tp_plan, "degree", 1)),
        "partitioner.skip": split.skip,
        "partitioner.tied": json.dumps({k: list(v) for k, v in sorted(split.tied.items())}),
        "partitioner.annotations": json.dumps(annotations, sort_keys=True),
    }
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    model.doc_string = f"pipeline stage {stage} of {split.n_stages}, tp rank {tp_rank}"
    model.graph.doc_string = model.doc_string
    canonical = {alias: name for name, names in split.aliases.items() for alias in names}
    for init in model.graph.initializer:
        parts = [f"stage {stage}"]
        sharding = getattr(tp_plan, "params", {}).get(init.name) if tp_plan is not None else None
        if sharding is not None and sharding.dim is not None:
            parts.append(f"tp sharded along dim {sharding.dim} ({sharding.reason})".replace(" ()", ""))
        else:
            parts.append("tp replicated")
        name = canonical.get(init.name, init.name)
        if name in split.tied:
            parts.append(f"tied copy of {name} on stages {list(split.tied[name])}")
        init.doc_string = "; ".join(parts)


def _annotate_rank(model: Any, program: RankProgram, stage: int) -> None:
    """Rank facts of a :class:`passes.ir.program.RankProgram`: the global rank, each
    parameter's sharding with its local and full shape, and the tp collectives' attributes."""
    from onnx import helper

    module = program.modules[stage]
    plan = program.tp_plan
    params = {}
    for name, param in module.named_parameters():
        sharding = plan.params.get(name) if plan is not None else None
        full = list(param.shape)
        if sharding is not None and sharding.dim is not None:
            full[sharding.dim] *= program.tp
        params[name] = {"dim": getattr(sharding, "dim", None), "sections": list(getattr(sharding, "sections", ())),
                        "reason": getattr(sharding, "reason", ""), "shape": list(param.shape), "full_shape": full}
    for key, value in (("partitioner.rank", str(program.rank)),
                       ("partitioner.tp_params", json.dumps(params, sort_keys=True))):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    # The trace records the collectives in execution order, which is the fx graph's order with
    # checkpointed regions (get_attr submodules called by the checkpoint) entered where called.
    fx_order = list(_tp_collectives(module))
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type in TP_OP_TYPES.values()]
    same_order = [n.op_type for n in nodes] == [TP_OP_TYPES[op] for op, _ in fx_order]
    ranks = [program.rank_of(program.pp_index, program.dp_index, t) for t in range(program.tp)]
    for i, node in enumerate(nodes):
        if same_order:  # otherwise the exporter's names stay
            node.name = fx_order[i][1]
        node.doc_string = f"tp collective over global ranks {ranks} (this rank: tp rank {program.tp_index})"
        node.attribute.extend([helper.make_attribute("tp_rank", program.tp_index),
                               helper.make_attribute("tp_degree", program.tp),
                               helper.make_attribute("ranks", ranks)])


def _tp_collectives(gm: fx.GraphModule, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(op name, fx node path) of each ``partitioner::*`` op of ``gm`` in execution order; a node
    inside a called submodule (a checkpointed region) is named ``<submodule>/<node>``."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if getattr(node.target, "namespace", None) == DOMAIN:
            if node.target._opname in TP_OP_TYPES:  # the offload brackets move no data: not in the file
                yield node.target._opname, prefix + node.name
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and isinstance(sub := _submodule(gm, arg.target), fx.GraphModule):
                yield from _tp_collectives(sub, f"{prefix}{arg.target}/")


def _submodule(gm: fx.GraphModule, target: str) -> torch.nn.Module | None:
    try:
        return gm.get_submodule(target)
    except AttributeError:  # a parameter or buffer
        return None


def _add_comm_nodes(model: Any, io: StageIO, stage: int, *, peers: Mapping[tuple[str, int], int] | None = None) -> None:
    """Send/Recv nodes for the stage's boundary tensors; ``peers``: (``"send"``/``"recv"``, peer
    stage) -> the peer's global rank, added as attribute ``peer_rank`` where known."""
    from onnx import helper

    peers = peers or {}
    graph = model.graph
    recv_names = {i.name: i for i in io.inputs if i.kind == "recv"}
    recv_nodes = []
    for value in list(graph.input):
        inp = recv_names.get(value.name)
        if inp is None:
            continue
        graph.input.remove(value)
        extra = {"peer_rank": peers[("recv", inp.source)]} if ("recv", inp.source) in peers else {}
        recv_nodes.append(helper.make_node(
            "Recv", [], [value.name], name=f"recv_{value.name}", domain=DOMAIN,
            doc_string=f"receive {value.name} from stage {inp.source}",
            src_stage=int(inp.source), shape=[str(d) for d in inp.meta.shape],  # type: ignore[union-attr]
            dtype=str(inp.meta.dtype).removeprefix("torch."), **extra))  # type: ignore[union-attr]
        graph.value_info.append(value)  # keep its type for readers
    # Receives come first, so the node list stays topologically sorted.
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend(recv_nodes + existing)
    for out in io.outputs:
        if out.dests:
            ranks = [peers[("send", d)] for d in out.dests if ("send", d) in peers]
            extra = {"peer_ranks": ranks} if ranks else {}
            graph.node.append(helper.make_node(
                "Send", [out.name], [f"{out.name}.sent"], name=f"send_{out.name}", domain=DOMAIN,
                doc_string=f"send {out.name} to stages {list(out.dests)}", dst_stages=list(out.dests), **extra))
    has_domain = any(o.domain == DOMAIN for o in model.opset_import)  # the tp collectives may have added it
    if (recv_nodes or any(o.dests for o in io.outputs)) and not has_domain:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _concrete(value: Any, subs: dict, name: str) -> int:
    expr = sympy.sympify(value).subs(subs)
    if not expr.is_Integer:
        raise PassError(f"onnx_export: size {value} of input {name!r} is symbolic after substituting dims "
                        f"{sorted(str(k) for k in subs)}; pass every named dim in dims=")
    return int(expr)
