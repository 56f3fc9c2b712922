"""ONNX per pipeline stage: ``stage<s>_tp<r>.onnx`` for each stage of a :class:`PipelineSplit`.

Each stage program is exported with the TorchScript exporter (``torch.onnx.export(...,
dynamo=False)``, no constant folding, so parameters stay initializers under their original
names such as ``blocks.0.attn.qkv.weight``; identical tensors the exporter deduplicates appear
as ``Identity`` nodes whose output keeps the name). Our decisions travel along:

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
rank 0); :func:`export_rank_programs` writes every tp rank's own program, built by
:func:`runtime.rank_program.build_rank_program` (sharded parameters as that rank's slices under
their original names). Its tensor-parallel collectives (``torch.ops.partitioner.*``, see
:mod:`runtime.tp_collectives`) become custom-domain nodes through ONNX symbolic functions
registered for the TorchScript exporter::

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
import json
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import sympy
import torch
from torch import fx

from ir_dumps.encode import facts, to_json
from partitioner.errors import PassError
from passes.meta import (
    CAPTURE, CHECKPOINT, PIPELINE_STAGE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN, PipelineSplit, StageIO, TensorMeta,
    dim_symbol,
)

DOMAIN = "partitioner"
OPSET = 17
_ANNOTATION_KEYS = (PIPELINE_STAGE, CHECKPOINT, TENSOR_PARALLEL, "offload")


def stage_example_inputs(split: PipelineSplit, stage: int, dims: Mapping[str, int]) -> tuple[Any, ...]:
    """Inputs of stage ``stage`` for tracing: zeros of each input's shape and dtype (token ids
    of 0 are valid indices), sizes evaluated from ``dims`` (named dim -> int)."""
    subs = {dim_symbol(k): int(v) for k, v in dims.items()}
    out: list[Any] = []
    for inp in split.io[stage].inputs:
        if inp.kind == "size":
            out.append(_concrete(inp.value, subs, inp.name))
        else:
            meta: TensorMeta = inp.meta  # type: ignore[assignment]
            shape = tuple(_concrete(d, subs, inp.name) for d in meta.shape)
            out.append(torch.zeros(shape, dtype=meta.dtype))
    return tuple(out)


def export_stage(split: PipelineSplit, stage: int, path: str | Path, *, dims: Mapping[str, int],
                 tp_rank: int = 0, with_comm: bool = True, opset: int = OPSET) -> Path:
    """Export stage ``stage`` of ``split`` to ``path``; returns the path. See the module docstring."""
    import onnx

    path = Path(path)
    model = _trace(split.modules[stage], split, stage, path, dims=dims, opset=opset)
    _annotate(model, split.modules[stage], split, stage, tp_rank)
    if with_comm:
        _add_comm_nodes(model, split.io[stage], stage)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def export_split(split: PipelineSplit, out_dir: str | Path, *, dims: Mapping[str, int], with_comm: bool = True,
                 opset: int = OPSET) -> list[Path]:
    """``stage<s>_tp<r>.onnx`` for every stage (tp rank 0; see the module docstring)."""
    out_dir = Path(out_dir)
    tp_rank = 0
    return [export_stage(split, s, out_dir / f"stage{s}_tp{tp_rank}.onnx", dims=dims, tp_rank=tp_rank,
                         with_comm=with_comm, opset=opset) for s in range(split.n_stages)]


def export_rank_programs(gm: fx.GraphModule, *, tp: int, pp: int, out_dir: str | Path,
                         dims: Mapping[str, int] | None = None, checkpointing: str = "none",
                         with_comm: bool = True, opset: int = OPSET) -> list[Path]:
    """``stage<s>_tp<r>.onnx`` in ``out_dir`` for every pipeline stage ``s`` < ``pp`` and tp rank
    ``r`` < ``tp``: the program rank (s, dp 0, r) runs, from ``build_rank_program(gm, dp=1, ...)``
    (no process group needed). Returns the paths, stage-major.

    ``gm``: the captured, shape-annotated training step (not changed); ``dims``: named dim ->
    int for the example inputs (default: the capture's hints); ``checkpointing``: passed to
    the rank-program builder. ``with_comm=False`` leaves out Send/Recv (the tp collectives are
    the program itself and always stay). See the module docstring for what a file holds.
    """
    import onnx

    from runtime.rank_program import build_rank_program, global_rank

    if dims is None:
        info = gm.meta.get(CAPTURE)
        if info is None:
            raise PassError("onnx_export: gm has no capture info to take example dims from; pass dims=")
        dims = dict(info.dims)
    out_dir = Path(out_dir)
    paths = []
    for stage in range(pp):
        for tp_rank in range(tp):
            rank = global_rank(stage, 0, tp_rank, dp=1, tp=tp)
            program = build_rank_program(gm, dp=1, tp=tp, pp=pp, rank=rank, checkpointing=checkpointing,
                                         tp_group=_TRACE_GROUP)
            module, path = program.modules[stage], out_dir / f"stage{stage}_tp{tp_rank}.onnx"
            model = _trace(module, program.split, stage, path, dims=dims, opset=opset)
            _annotate(model, module, program.split, stage, tp_rank)
            _annotate_rank(model, program, stage)
            if with_comm:
                peers = {(c.kind, c.peer_stage): c.ranks[0] for c in program.comms if c.kind in ("send", "recv")}
                _add_comm_nodes(model, program.io[stage], stage, peers=peers)
            onnx.checker.check_model(model)
            onnx.save(model, str(path))
            paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------
# Tensor-parallel collectives: ONNX symbolic functions for the TorchScript exporter.
# The tp group the rank programs are built for while exporting: the name simulated_groups gives
# rank 0 of a one-rank group under this prefix (the name itself does not reach the ONNX file).
_TRACE_PREFIX = "onnx_export/trace"
_TRACE_GROUP = f"{_TRACE_PREFIX}/rank0"
# torch op name -> ONNX op type of the custom domain
TP_OP_TYPES = {"copy_to_tp": "CopyToTP", "reduce_from_tp": "ReduceFromTP", "all_reduce": "AllReduce",
               "vocab_parallel_cross_entropy": "VocabParallelCrossEntropy", "sharded_dropout": "ShardedDropout"}


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


_SYMBOLICS = {"copy_to_tp": _sym_copy_to_tp, "reduce_from_tp": _sym_reduce_from_tp, "all_reduce": _sym_all_reduce,
              "vocab_parallel_cross_entropy": _sym_vocab_parallel_cross_entropy,
              "sharded_dropout": _sym_sharded_dropout}


def register_tp_symbolics(opset: int = OPSET) -> None:
    """Register the ONNX symbolic functions of ``partitioner::*`` ops for ``opset`` (idempotent)."""
    import runtime.tp_collectives  # noqa: F401  (the ops must exist before their symbolics)
    import runtime.tp_dropout  # noqa: F401

    for name, fn in _SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(f"{DOMAIN}::{name}", fn, opset)


@contextlib.contextmanager
def _trace_group() -> Iterator[None]:
    """A one-rank simulated tp group for tracing: the exporter runs each collective once on
    this rank's shard (values are this rank's partial sums; only shapes and the graph matter)."""
    from runtime.tp_collectives import simulated_groups, unregister_group

    (name,) = simulated_groups(_TRACE_PREFIX, 1)
    assert name == _TRACE_GROUP, name
    try:
        yield
    finally:
        unregister_group(name)


def _trace(module: fx.GraphModule, split: PipelineSplit, stage: int, path: Path, *, dims: Mapping[str, int],
           opset: int) -> Any:
    """Export ``module`` (stage ``stage`` of ``split``'s contracts) with the TorchScript exporter
    and load it back."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    io = split.io[stage]
    args = stage_example_inputs(split, stage, dims)
    register_tp_symbolics(opset)
    with warnings.catch_warnings(), _trace_group():
        # The legacy exporter is the one that keeps parameter names; its deprecation and
        # training-mode dropout warnings say nothing about this stage.
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(module, args, str(path), dynamo=False, do_constant_folding=False, opset_version=opset,
                              input_names=[i.name for i in io.inputs], output_names=[o.name for o in io.outputs])
        except Exception as exc:  # noqa: BLE001 - name the stage and the fix
            raise PassError(f"onnx_export: stage {stage} did not export ({type(exc).__name__}: {exc}); "
                            f"try with_comm=False or a smaller opset, or inspect the stage module's .code") from exc
    return onnx.load(str(path))


# --------------------------------------------------------------------------------------------------
def _annotate(model: Any, module: fx.GraphModule, split: PipelineSplit, stage: int, tp_rank: int) -> None:
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


def _annotate_rank(model: Any, program: Any, stage: int) -> None:
    """Rank facts of a :class:`runtime.rank_program.RankProgram`: the global rank, each
    parameter's sharding with its local and full shape, and the tp collectives' attributes."""
    from onnx import helper

    from runtime.rank_program import global_rank

    module, full = program.modules[stage], program.split.modules[stage]
    plan = program.tp_plan
    params = {}
    for name, param in module.named_parameters():
        sharding = plan.params.get(name) if plan is not None else None
        params[name] = {"dim": getattr(sharding, "dim", None), "sections": list(getattr(sharding, "sections", ())),
                        "reason": getattr(sharding, "reason", ""), "shape": list(param.shape),
                        "full_shape": list(full.get_parameter(name).shape)}
    for key, value in (("partitioner.rank", str(program.rank)),
                       ("partitioner.tp_params", json.dumps(params, sort_keys=True))):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    # The trace records the collectives in execution order, which is the fx graph's order with
    # checkpointed regions (get_attr submodules called by the checkpoint) entered where called.
    fx_order = list(_tp_collectives(module))
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type in TP_OP_TYPES.values()]
    same_order = [n.op_type for n in nodes] == [TP_OP_TYPES[op] for op, _ in fx_order]
    ranks = [global_rank(program.pp_index, program.dp_index, t, dp=program.dp, tp=program.tp)
             for t in range(program.tp)]
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
