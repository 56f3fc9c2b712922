"""``ir-dumps explain DIR --node N``: why a node is where it is, from the dumps alone.

For each decision — pipeline stage, tensor-parallel sharding, recompute (activation
checkpointing), offload — it prints the value, the pass whose dump first shows it, and the cost
terms that went into it: the node's own FLOPs and bytes, its checkpoint region's recompute FLOPs
and bytes saved, the sharding reason, and, when ``plan.json`` lies in DIR, the stage's predicted
time and memory from the plan. A decision no dump records is reported as "not decided by any
pass". Reads only JSON (``manifest.json``, ``NN_<pass>.json``, ``plan.json``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ir_dumps.reader import DumpDir, DumpError, GraphDump, NodeDump, load_dump_dir
from partitioner.plan_types import format_bytes

NOT_DECIDED = "not decided by any pass"
DECISIONS = (("stage", "pipeline_stage"), ("sharding", "tensor_parallel"), ("recompute", "checkpoint"),
             ("offload", "offload"))


def explain_node(path: str | Path, name: str) -> str:
    """The explanation text for node ``name`` (``%`` prefix optional) of dump directory ``path``."""
    dump = load_dump_dir(path)
    name = name.removeprefix("%")
    history: list[tuple[str, GraphDump, NodeDump]] = []
    for entry in dump.entries:
        graph = dump.load(entry)
        node = graph.node(name)
        if node is not None:
            history.append((entry.name, graph, node))
    if not history:
        raise DumpError(f"no node {name!r} in any dump of {dump.path}; `ir-dumps show {dump.path} --pass P` "
                        f"lists a pass's nodes")
    pass_name, graph, node = history[-1]
    lines = [f"node %{node.name}: {node.op} {node.target}" + (f"  (module {node.module})" if node.module else ""),
             f"as of the last dump that has it: {pass_name}"]
    lines += _costs(node)
    plan = _load_plan(dump)
    for title, key in DECISIONS:
        first = next((p for p, _, n in history if key in n.meta), None)
        value = node.meta.get(key)
        lines.append(f"{title}:")
        if value is None:
            lines.append(f"  {NOT_DECIDED}" + (f" (key {key!r} absent)" if key != "pipeline_stage" else ""))
            if key == "pipeline_stage" and plan is not None:
                lines.append(f"  plan: pp={plan.get('pp')}, this graph was not split")
            continue
        lines.append(f"  decided by pass {first}")
        lines += ["  " + line for line in _decision(key, value, node, graph, plan)]
    return "\n".join(lines) + "\n"


def _costs(node: NodeDump) -> list[str]:
    out = ["cost terms of the node:"]
    flops = node.meta.get("flops")
    if isinstance(flops, dict):
        out.append(f"  flops fwd={flops.get('fwd')} bwd={flops.get('bwd')} kind={flops.get('kind')}")
    memory = node.meta.get("memory")
    if isinstance(memory, dict):
        fields = ("output_bytes", "kept_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")
        out.append("  memory " + " ".join(f"{f}={memory.get(f)}" for f in fields if memory.get(f) not in (None, 0)))
        saved = memory.get("saved") or []
        if saved:
            out.append("  saved for backward: " + ", ".join(f"{s.get('owner')}:{s.get('nbytes')}" for s in saved))
    shape = node.meta.get("shape")
    if isinstance(shape, dict) and shape.get("tensors"):
        out.append("  shape " + "; ".join(f"{t.get('shape')} {t.get('dtype')}" for t in shape["tensors"]))
    return out if len(out) > 1 else out + ["  (no flops/memory annotations in the dumps)"]


def _decision(key: str, value: Any, node: NodeDump, graph: GraphDump, plan: dict | None) -> list[str]:
    if key == "pipeline_stage":
        out = [f"stage {value}"]
        if plan is not None:
            stages = plan.get("stages") or []
            pp = int(plan.get("pp", 1))
            rank = value % pp if pp else value
            st = next((s for s in stages if s.get("index") == rank), None)
            out.append(f"plan: pp={pp} virtual_pp={plan.get('virtual_pp', 1)} schedule={plan.get('schedule')}; "
                       f"stage {value} runs on pipeline rank {rank}")
            if st is not None:
                mem = st.get("memory", {})
                out.append(f"stage {rank} layers {st.get('layer_names')}: fwd+bwd {st.get('time_s', 0) * 1e3:.3f} ms "
                           f"per micro-batch, peak {format_bytes(st.get('peak_memory_bytes', 0))} ("
                           + ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items()) + ")")
            others = [s for s in stages if s.get("index") != rank]
            if others:
                slowest = max(stages, key=lambda s: s.get("time_s", 0))
                out.append(f"slowest stage is {slowest.get('index')} ({slowest.get('time_s', 0) * 1e3:.3f} ms): "
                           f"the split balances per-stage time")
        out += _stage_flops(graph, value)
        consumers = [u for u in node.users if (n := graph.node(u)) is not None
                     and n.meta.get("pipeline_stage") not in (None, value)]
        if consumers:
            out.append(f"crosses a stage boundary: read by {', '.join(consumers)} on stage(s) "
                       + ", ".join(sorted({str(graph.node(u).meta['pipeline_stage']) for u in consumers})))
        return out
    if key == "checkpoint":
        out = [f"recompute={value.get('recompute')} region={value.get('region')} policy={value.get('policy')}"]
        cplan = graph.graph.get("checkpoint_plan")
        if isinstance(cplan, dict):
            region = next((r for r in cplan.get("regions", []) if r.get("index") == value.get("region")), None)
            if region is not None:
                out.append(f"region {region.get('name')}: recompute_flops={region.get('recompute_flops')} "
                           f"bytes_saved={region.get('bytes_saved')} ({len(region.get('nodes', []))} nodes)")
            out.append(f"policy {cplan.get('policy')}: saved bytes {cplan.get('saved_bytes_before')} -> "
                       f"{cplan.get('saved_bytes_after')}, budget {cplan.get('budget_bytes')}")
        return out
    if key == "tensor_parallel":
        out = [" ".join(f"{k}={v}" for k, v in value.items() if v not in (None, "", []))]
        tplan = graph.graph.get("tensor_parallel_plan")
        if isinstance(tplan, dict):
            param = (tplan.get("params") or {}).get(node.target)
            out.append(f"tp degree {tplan.get('degree')}" + (f"; parameter {node.target}: {param}" if param else ""))
        return out
    # offload and anything a later pass adds: print its fields generically.
    return [" ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)]


def _stage_flops(graph: GraphDump, stage: int) -> list[str]:
    """Forward+backward FLOPs per stage from the node annotations (at the captured dims): the
    quantity a layer-balanced split evens out."""
    from ir_dumps.reader import sympy_value
    from passes.meta import dim_symbol

    dims = (graph.graph.get("capture") or {}).get("dims") or []
    subs = {dim_symbol(str(k)): int(v) for k, v in dims}
    per_stage: dict[int, Any] = {}
    for n in graph.nodes:
        f, st = n.meta.get("flops"), n.meta.get("pipeline_stage")
        if isinstance(f, dict) and isinstance(st, int):
            per_stage[st] = per_stage.get(st, 0) + sympy_value(f.get("fwd", 0)) + sympy_value(f.get("bwd", 0))
    if not per_stage:
        return []
    text = ", ".join(f"{s}: {_num(v.subs(subs) if hasattr(v, 'subs') else v)}" for s, v in sorted(per_stage.items()))
    return [f"fwd+bwd FLOPs per stage ({text}); this node's stage {stage} holds "
            f"{_share(per_stage, stage, subs)} of the total"]


def _num(v: Any) -> str:
    try:
        return f"{float(v):.3g}"
    except TypeError:
        return str(v)


def _share(per_stage: dict, stage: int, subs: dict) -> str:
    try:
        total = float(sum(per_stage.values()).subs(subs))
        return f"{float(per_stage.get(stage, 0).subs(subs)) / total:.1%}" if total else "?"
    except (TypeError, AttributeError):
        return "?"


def _load_plan(dump: DumpDir) -> dict | None:
    path = Path(dump.path) / "plan.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
