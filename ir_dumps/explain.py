"""``ir-dumps explain DIR --node N``: why a node is where it is, from the dumps alone.

For each decision — pipeline stage, tensor-parallel sharding, recompute (activation
checkpointing), offload — it prints the value, the pass whose dump first shows it, and the cost
terms that went into it: the node's own FLOPs and bytes, its checkpoint region's recompute FLOPs
and bytes saved, the sharding reason, and, when ``plan.json`` lies in DIR, what the plan's
search weighed: the stage's predicted time and memory, the tensor-parallel communication the
plan pays and the candidates with another tp degree that lost. Then the rank programs
(``stage<s>_tp<r>/``) that hold the node, with its cost there. A decision no dump records is
reported as "not decided by any pass". Reads only JSON (``manifest.json``, ``*.json``, ``plan.json``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ir_dumps.reader import DumpDir, DumpError, GraphDump, NodeDump, load_dump_dir, sympy_value
from passes.ir.config import ParallelConfig
from passes.ir.plan import format_bytes
from passes.ir.meta import dim_symbol

NOT_DECIDED = "not decided by any pass"
DECISIONS = (("stage", "pipeline_stage"), ("sharding", "tensor_parallel"), ("recompute", "checkpoint"),
             ("offload", "offload"))


def explain_node(path: str | Path, name: str) -> str:
    """The explanation text for node ``name`` (``%`` prefix optional) of dump directory ``path``."""
    dump = load_dump_dir(path)
    name = name.removeprefix("%")
    history: list[tuple[str, GraphDump, NodeDump]] = []
    programs: dict[str, tuple[GraphDump, NodeDump]] = {}  # scope -> its last dump holding the node
    for entry in dump.entries:
        graph = dump.load(entry)
        node = graph.node(name)
        if node is None:
            continue
        if entry.dir:
            programs[entry.dir] = (graph, node)
        else:
            history.append((entry.name, graph, node))
    if not history and not programs:
        raise DumpError(f"no node {name!r} in any dump of {dump.path}; `ir-dumps show {dump.path} --pass P` "
                        f"lists a pass's nodes")
    if not history:  # only in rank programs (a node a rewrite inserted)
        history = [(f"{scope}/(program)", graph, node) for scope, (graph, node) in programs.items()]
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
    lines += _programs(programs, node)
    return "\n".join(lines) + "\n"


def _programs(programs: dict[str, tuple[GraphDump, NodeDump]], whole: NodeDump) -> list[str]:
    """The rank programs holding the node and its cost in each (after the rewrites of that rank)."""
    if not programs:
        return ["rank programs: none hold it (no lowering in these dumps)"]
    out = [f"rank programs holding it: {', '.join(programs)}"]
    for scope, (graph, node) in programs.items():
        fwd = _fwd(node)
        total = _fwd(whole, (graph.graph.get("capture") or {}).get("dims") or [])
        share = f" ({fwd / total:.0%} of the whole graph's at these dims)" if fwd is not None and total else ""
        shape = node.meta.get("shape") or {}
        tensors = "; ".join(f"{t.get('shape')} {t.get('dtype')}" for t in shape.get("tensors", []))
        memory = node.meta.get("memory") or {}
        kept = f", kept for backward {memory.get('kept_bytes')} bytes" if memory.get("kept_bytes") else ""
        out.append(f"  {scope}: fwd FLOPs {_num(fwd) if fwd is not None else '?'}{share}, output {tensors or '?'}{kept}")
    return out


def _fwd(node: NodeDump, dims: Any = ()) -> float | None:
    """The node's forward FLOPs, evaluated at ``dims`` (``[[name, size], ...]``) when symbolic."""
    flops = node.meta.get("flops")
    if not isinstance(flops, dict):
        return None
    try:
        value = sympy_value(flops.get("fwd", 0)).subs({dim_symbol(str(k)): int(v) for k, v in dims})
        return float(value)
    except (TypeError, ValueError):
        return None


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
            placement = ParallelConfig(pp=max(pp, 1), virtual_pp=int(plan.get("virtual_pp", 1)),
                                       schedule=plan.get("schedule") or "1f1b")
            rank = placement.stage_rank(value)
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
            params = tplan.get("params") or {}
            reads = [graph.node(a.removeprefix("%")) for a in _refs(node.args)]
            targets = [n.target for n in reads if n is not None and n.op == "get_attr"] + [node.target]
            for target in dict.fromkeys(t for t in targets if t in params):
                out.append(f"parameter {target}: {params[target]}")
            out.append(f"tp degree {tplan.get('degree')}")
        out += _tp_cost(plan)
        return out
    # offload and anything a later pass adds: print its fields generically.
    return [" ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)]


def _refs(args: Any) -> list[str]:
    """The ``%node`` references in a dumped argument list (nested lists included)."""
    out: list[str] = []
    for a in args if isinstance(args, (list, tuple)) else [args]:
        if isinstance(a, (list, tuple)):
            out += _refs(a)
        elif isinstance(a, str) and a.startswith("%"):
            out.append(a)
    return out


def _tp_cost(plan: dict | None) -> list[str]:
    """What the plan's search weighed for its tp degree: the tp communication it pays, and the
    candidates with another degree that lost (plan.json's prediction and alternatives)."""
    if plan is None:
        return ["(no plan.json here: the degree was given, not searched)"]
    pred = plan.get("predicted") or {}
    terms = pred.get("terms") or {}
    step = float(pred.get("step_time_s", 0) or 0)
    tp = plan.get("tp", 1)
    out = [f"cost: the search chose tp={tp}: predicted step {step * 1e3:.3f} ms, of which tensor-parallel "
           f"communication {float(terms.get('tp_comm', 0)) * 1e3:.3f} ms and compute {float(terms.get('compute', 0)) * 1e3:.3f} ms"]
    others = [a for a in plan.get("alternatives") or [] if (a.get("knobs") or {}).get("tp") not in (None, tp)]
    for alt in others[:3]:
        knobs = alt.get("knobs") or {}
        out.append(f"  lost: tp={knobs.get('tp')} dp={knobs.get('dp')} pp={knobs.get('pp')}: "
                   f"{float(alt.get('step_time_s', 0)) * 1e3:.3f} ms, {alt.get('reason')}")
    if not others:
        out.append("  (no candidate with another tp degree among the plan's alternatives; pinned, or far slower)")
    return out


def _stage_flops(graph: GraphDump, stage: int) -> list[str]:
    """Forward+backward FLOPs per stage from the node annotations (at the captured dims): the
    quantity a layer-balanced split evens out."""

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
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        data = {**data["config"], **{k: v for k, v in data.items() if k != "config"}}  # knobs read at top level
    return data
