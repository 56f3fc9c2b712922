"""The dump tree of a plan: everything that was decided, as it runs.

``partitioner plan --dump-dir D``, ``partitioner demo``, ``partitioner lower`` and
``auto_parallelize(job=Job(dump_dir=D))`` all write the same tree, with :func:`write_plan_dumps`::

    D/manifest.json          every dump in run order, the pipelines' text, the config, the cluster,
                             and the command that writes the same tree again
    D/00_input.* .. NN_*     the captured graph, then each analysis and whole-graph tag pass
    D/stage<s>_tp<r>/        each (pipeline stage, tp rank) program: 00_split, then its passes,
                             program.txt (the program the runtime executes, as text) and
                             program.onnx (the same program in ONNX, our ops as a custom domain;
                             ``partitioner lower`` and ``plan`` write it, a job only when asked:
                             ``Job(onnx=True)``, ``--onnx``)
    D/stages.dot (.svg)      the whole graph coloured by stage, tp and recompute marked
    D/plan.json, report.html

The IR files are written by the passes as they run (a :class:`ir_dumps.writer.DumpWriter` is the
pass managers' instrument), from the same lowering the runtime executes.
"""
from __future__ import annotations

import contextlib
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from ir_dumps.onnx_export import export_rank_programs
from ir_dumps.stage_dot import write_stage_dot
from ir_dumps.writer import DumpWriter, write_program
from partitioner.compile.build import lower_plan
from partitioner.cost.cluster import Cluster
from passes.ir.errors import PartitionerError
from passes.ir.plan import Plan
from passes.ir.program import global_rank
from passes.lowering.lower import Lowering
from ir_dumps.report import write_report
from runtime.kernels.collectives import trace_groups

ONNX_PARAM_LIMIT_BYTES = 2**30
"""Largest parameter bytes of one stage program written as ONNX (an ONNX file holds its weights)."""


@dataclass(frozen=True, kw_only=True)
class PlanDumps:
    """What :func:`write_plan_dumps` wrote."""
    root: Path
    lowering: Lowering
    programs: tuple[Path, ...]
    """``stage<s>_tp<r>/program.txt`` of every program."""
    onnx: tuple[Path, ...]
    notes: tuple[str, ...]


def reproduce_command(plan_path: str, cluster: Cluster, out: str = "OUT", extra: tuple[str, ...] = ()) -> str:
    """The one command that lowers the plan in ``plan_path`` again into ``out`` (same tree)."""
    where = ["--cluster", "local", "--world-size", str(cluster.world_size)] if cluster.name.startswith("local") else \
        ["--cluster", cluster.name, "--nodes", str(cluster.nodes)]
    return shlex.join(["partitioner", "lower", "--plan", plan_path, *where, *extra, "--dump-dir", out])


def write_plan_dumps(root: str | Path, *, graph: fx.GraphModule, plan: Plan, cluster: Cluster,
                     writer: DumpWriter | None = None, onnx: bool = True, report_graph: bool = True,
                     reproduce_args: tuple[str, ...] = ()) -> PlanDumps:
    """Lower ``graph`` (captured and analysed, see :func:`partitioner.compile.build.capture_for_pipeline`)
    under ``plan.config`` for every (stage, tp rank) and write the whole tree into ``root``.

    ``writer``: the writer the analysis passes were dumped with (default: a new one, and the
    analysis is not in the tree); ``onnx``: also write ``program.onnx`` per program (skipped,
    with a note, for a stage whose parameters exceed :data:`ONNX_PARAM_LIMIT_BYTES` or that
    holds meta tensors). Returns what was written.
    """

    root = Path(root)
    writer = writer or DumpWriter(root, model=plan.model)
    lowering = lower_plan(graph, plan.config, cluster=cluster, writer=writer, check=False)
    (root / "plan.json").write_text(plan.to_json() + "\n")
    programs = tuple(write_program(module, root, f"stage{s}_tp{t}") for (s, t), module in sorted(lowering.programs.items()))
    write_stage_dot(lowering.graph, root / "stages.dot", title=f"{plan.model}: {plan.config.text()}")
    notes: list[str] = []
    paths: list[Path] = []
    if onnx:
        paths, notes = _write_onnx(lowering, root)
    else:
        notes.append("no program.onnx: not asked for (Job(onnx=True), --onnx); the reproduce command writes the "
                     "same tree with it")
    writer.extra.update({
        "config": plan.config.to_dict(), "cluster": plan.cluster,
        "reproduce": reproduce_command(str(root / "plan.json"), cluster, extra=reproduce_args),
        "notes": notes,
    })
    writer.write_manifest()
    write_report(root / "report.html", plan=plan, cluster=cluster, graph=lowering.graph if report_graph else None)
    return PlanDumps(root=root, lowering=lowering, programs=programs, onnx=tuple(paths), notes=tuple(notes))


def _write_onnx(lowering: Lowering, root: Path) -> tuple[list[Path], list[str]]:

    c = lowering.config
    paths, notes = [], []
    for (s, t), module in sorted(lowering.programs.items()):
        params = list(module.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in params)
        if any(p.is_meta for p in params) or nbytes > ONNX_PARAM_LIMIT_BYTES:
            why = "its weights are not materialised (a plan of a model built on the meta device)" \
                if any(p.is_meta for p in params) else f"{nbytes / 2**30:.1f} GiB of parameters"
            notes.append(f"stage{s}_tp{t}: no program.onnx ({why})")
            continue
        program = lowering.rank_program(global_rank(s % c.pp, 0, t, dp=c.dp_cp, tp=c.tp))
        single = _only_stage(program, s)

        def tracing(p, t=t):
            stack = contextlib.ExitStack()
            stack.enter_context(trace_groups(p.tp_group, t, c.tp))
            if p.cp_plan is not None:  # cp rank 0's view (every cp rank runs this program)
                stack.enter_context(trace_groups(p.cp_plan.group, 0, c.cp))
            return stack

        try:
            (path,) = export_rank_programs([single], root / f"stage{s}_tp{t}", tracing=tracing)
        except PartitionerError as exc:
            notes.append(f"stage{s}_tp{t}: no program.onnx ({exc})")
            continue
        target = path.with_name("program.onnx")
        path.replace(target)
        paths.append(target)
    return paths, notes


def _only_stage(program: Any, stage: int) -> Any:
    """``program`` restricted to one of its stages (interleaved ranks hold several)."""
    import dataclasses

    return dataclasses.replace(program, stages=(stage,), modules={stage: program.modules[stage]})
