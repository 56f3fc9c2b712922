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

One file per (pipeline stage, tp rank); only tp rank 0 is exported until rank programs carry
``TensorParallelPlan.rank``.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

import sympy
import torch

from ir_dumps.encode import facts, to_json
from partitioner.errors import PassError
from passes.meta import (
    CHECKPOINT, PIPELINE_STAGE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN, PipelineSplit, TensorMeta, dim_symbol,
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
    path.parent.mkdir(parents=True, exist_ok=True)
    module, io = split.modules[stage], split.io[stage]
    args = stage_example_inputs(split, stage, dims)
    in_names = [i.name for i in io.inputs]
    out_names = [o.name for o in io.outputs]
    with warnings.catch_warnings():
        # The legacy exporter is the one that keeps parameter names; its deprecation and
        # training-mode dropout warnings say nothing about this stage.
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(module, args, str(path), dynamo=False, do_constant_folding=False, opset_version=opset,
                              input_names=in_names, output_names=out_names)
        except Exception as exc:  # noqa: BLE001 - name the stage and the fix
            raise PassError(f"onnx_export: stage {stage} did not export ({type(exc).__name__}: {exc}); "
                            f"try with_comm=False or a smaller opset, or inspect split.modules[{stage}].code") from exc
    model = onnx.load(str(path))
    _annotate(model, split, stage, tp_rank)
    if with_comm:
        _add_comm_nodes(model, split, stage)
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


# --------------------------------------------------------------------------------------------------
def _annotate(model: Any, split: PipelineSplit, stage: int, tp_rank: int) -> None:
    module = split.modules[stage]
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


def _add_comm_nodes(model: Any, split: PipelineSplit, stage: int) -> None:
    from onnx import helper

    io = split.io[stage]
    graph = model.graph
    recv_names = {i.name: i for i in io.inputs if i.kind == "recv"}
    recv_nodes = []
    for value in list(graph.input):
        inp = recv_names.get(value.name)
        if inp is None:
            continue
        graph.input.remove(value)
        recv_nodes.append(helper.make_node(
            "Recv", [], [value.name], name=f"recv_{value.name}", domain=DOMAIN,
            doc_string=f"receive {value.name} from stage {inp.source}",
            src_stage=int(inp.source), shape=[str(d) for d in inp.meta.shape],  # type: ignore[union-attr]
            dtype=str(inp.meta.dtype).removeprefix("torch.")))  # type: ignore[union-attr]
        graph.value_info.append(value)  # keep its type for readers
    # Receives come first, so the node list stays topologically sorted.
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend(recv_nodes + existing)
    for out in io.outputs:
        if out.dests:
            graph.node.append(helper.make_node(
                "Send", [out.name], [f"{out.name}.sent"], name=f"send_{out.name}", domain=DOMAIN,
                doc_string=f"send {out.name} to stages {list(out.dests)}", dst_stages=list(out.dests)))
    if recv_nodes or any(o.dests for o in io.outputs):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _concrete(value: Any, subs: dict, name: str) -> int:
    expr = sympy.sympify(value).subs(subs)
    if not expr.is_Integer:
        raise PassError(f"onnx_export: size {value} of input {name!r} is symbolic after substituting dims "
                        f"{sorted(str(k) for k in subs)}; pass every named dim in dims=")
    return int(expr)
