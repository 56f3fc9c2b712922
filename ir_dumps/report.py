"""``report.html``: one self-contained page showing every decision of a plan.

Sections (stable ids, so tests and people can find them):

* ``#knobs`` — the chosen knobs and the prediction (step time, TFLOP/s, MFU, peak, bubble);
* ``#terms`` — the step time by cause (``Prediction.terms``) as one stacked bar;
* ``#memory-chart`` — per stage (``<g class="stage-mem" data-stage="i">``) the peak memory of one
  device stacked by term (parameters, gradients, optimizer, activations, buffers) against the
  device capacity;
* ``#timeline`` — ranks x time: the pipeline schedule's action lists (the very lists
  :mod:`passes.ir.schedule` hands the runtime) timed by :func:`passes.ir.schedule.simulate` with each
  stage's predicted forward/backward time; forward, backward, communication, grad sync and
  idle time (the bubble) each have a colour and a class;
  under a measured run, the measured timeline below it, and under ZeRO-3 each rank's gathers and
  reduce-scatters (``#zero3-timeline``);
* ``#alternatives`` — the candidate plans the search rejected and why;
* ``#measured`` — measured vs predicted per rank, when measurements are given;
* ``#graph`` — nodes per stage and the annotations passes left (checkpoint, tensor parallel,
  offload), when a graph is given.

No network: CSS and SVG are inline, there is no script. Output is deterministic for equal inputs.
"""
from __future__ import annotations

import html
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from passes.ir.plan import MEMORY_TERMS, Plan, format_bytes
from passes.ir import schedule as sched
from passes.ir.schedule import simulate
from passes.ir.meta import CHECKPOINT, PIPELINE_STAGE, TENSOR_PARALLEL

# Forward is taken as a third of a stage's fwd+bwd time: the backward of a matmul costs two
# forwards (input and weight gradients), the usual 1:2 split of the cost model.
FWD_SHARE = 1.0 / 3.0

MEMORY_COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759",
                  "activations": "#76b7b2", "buffers": "#b07aa1"}
TERM_COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
                "#9c755f", "#bab0ac"]
ACTION_CLASSES = {"F": "fwd", "B": "bwd", "I": "bwd", "W": "wgt", "SEND_F": "comm", "RECV_F": "comm", "SEND_B": "comm",
                  "RECV_B": "comm", "ALL_REDUCE": "sync", "GRAD_NORM": "sync",
                  "ALL_GATHER": "sync", "STEP": "step"}

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222;
       background: #fff; max-width: 1320px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd;
       padding-bottom: 4px; }
.sub { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: flex; gap: 28px; flex-wrap: wrap; align-items: flex-start; }
.legend { font-size: 12px; margin: 4px 0; } .legend span.sw { display: inline-block; width: 11px; height: 11px;
       margin: 0 4px 0 12px; vertical-align: -1px; border: 1px solid #888; }
svg text { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
.fwd { fill: #4e79a7; } .bwd { fill: #59a14f; } .wgt { fill: #8cd17d; } .comm { fill: #f28e2b; } .sync { fill: #b07aa1; }
.step { fill: #9c755f; } .idle { fill: url(#hatch); }
.z3.inflight { fill: #d4a6c8; } .z3.exposed { fill: #a33; } .z3.reduce { fill: #76b7b2; }
.note { font-size: 12px; color: #555; max-width: 1200px; }
.lost { color: #a33; white-space: nowrap; } .won { color: #292; font-weight: bold; }
"""


@dataclass(frozen=True, kw_only=True)
class Interval:
    """One drawn piece of a rank's timeline: seconds from the step start, kind, label."""
    start: float
    end: float
    kind: str
    """``fwd``, ``bwd``, ``comm``, ``sync``, ``step`` or ``idle``."""
    label: str


def write_report(path: str | Path, *, plan: Plan, cluster: Any, schedule: Mapping[int, list] | None = None,
                 measured: Mapping[Any, Mapping[str, float]] | None = None, graph: Any = None,
                 measured_step: Any = None) -> Path:
    """Write ``report.html`` for ``plan`` on ``cluster`` (a :class:`partitioner.cost.cluster.Cluster`).

    ``schedule``: per-rank action lists (default: generated from the plan's pp, num_micro_batches,
    schedule and virtual_pp by :mod:`passes.ir.schedule`). ``measured``: per rank
    ``{"step_time_s": seconds, "peak_memory_bytes": bytes}`` shown beside the prediction.
    ``graph``: an fx.GraphModule whose nodes carry pass annotations. ``measured_step``: one step's
    :class:`runtime.observe.measure.StepMeasurement` of every rank (a list by rank), drawn as the measured
    timeline under the simulated one. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(plan=plan, cluster=cluster, schedule=schedule, measured=measured, graph=graph,
                                  measured_step=measured_step), encoding="utf-8")
    return path


def render_report(*, plan: Plan, cluster: Any, schedule: Mapping[int, list] | None = None,
                  measured: Mapping[Any, Mapping[str, float]] | None = None, graph: Any = None,
                  measured_step: Any = None) -> str:
    """The HTML text of :func:`write_report`."""
    if schedule is None:
        schedule = plan_schedule(plan)
    capacity = float(getattr(getattr(cluster, "device", None), "memory_bytes", 0) or 0)
    sections = [
        _header(plan, cluster),
        _section("knobs", "Plan", _knobs_tables(plan)),
        _section("terms", "Step time by cause", _terms_bar(plan)),
        _section("memory", "Peak memory per device, by stage", _memory_chart(plan, capacity)),
        _section("schedule", f"Pipeline schedule ({plan.schedule}, p={plan.pp}, m={plan.num_micro_batches}"
                 + (f", v={plan.virtual_pp}" if plan.virtual_pp > 1 else "") + ")",
                 _timeline(plan, schedule, _measured_timelines(measured_step))),
        _section("alternatives-section", "Candidates that lost", _alternatives(plan)),
    ]
    if measured:
        sections.append(_section("measured-section", "Measured vs predicted", _measured(plan, measured)))
    if graph is not None:
        sections.append(_section("graph", "Graph annotations", _graph_summary(graph)))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>plan report: {_e(plan.model)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(sections) + "\n</body></html>\n")


# --------------------------------------------------------------------------------------- schedule
def plan_schedule(plan: Plan) -> dict[int, list]:
    """The per-rank action lists the runtime executes for ``plan`` (see :mod:`passes.ir.schedule`)."""
    return sched.build(plan.schedule, plan.pp, plan.num_micro_batches, max(plan.virtual_pp, 1))


def stage_times(plan: Plan) -> tuple[dict[int, float], dict[int, float]]:
    """Forward and backward seconds per global (virtual) stage and micro-batch.

    ``StagePlan.time_s`` is a rank's fwd+bwd time over all its chunks; each of the ``v`` chunks
    (the schedule's placement: global stage ``c * pp + r``, or ZBV's V) gets an equal share, split
    :data:`FWD_SHARE` forward.
    """
    v = max(plan.virtual_pp, 1)
    fwd, bwd = {}, {}
    for st in plan.stages:
        for c in range(v):
            g = plan.config.rank_stages(st.index)[c]
            fwd[g] = st.time_s / v * FWD_SHARE
            bwd[g] = st.time_s / v * (1 - FWD_SHARE)
    return fwd, bwd


def timeline_intervals(plan: Plan, schedule: Mapping[int, list]) -> tuple[dict[int, list[Interval]], float]:
    """Simulate ``schedule`` with the plan's predicted times; per rank the intervals to draw
    (idle gaps included) and the makespan in seconds."""

    fwd, bwd = stage_times(plan)
    n_stages = len({a.stage for acts in schedule.values() for a in acts if a.stage is not None})
    default = sum(fwd.values()) / len(fwd) if fwd else 1e-3
    fwd_t = {s: fwd.get(s, default) for s in range(n_stages)}
    bwd_t = {s: bwd.get(s, 2 * default) for s in range(n_stages)}
    terms = plan.predicted.terms
    # pp_comm is the step's total point-to-point time; each micro-batch crosses a boundary twice.
    messages = 2 * plan.num_micro_batches * max(plan.virtual_pp, 1)
    comm = terms.get("pp_comm", 0.0) / messages if plan.pp > 1 else 0.0
    result = simulate(dict(schedule), fwd_t, bwd_t, comm, grad_sync_time=terms.get("dp_comm", 0.0),
                      step_time=terms.get("optimizer", 0.0))
    out: dict[int, list[Interval]] = {}
    for rank, timed in sorted(result.timelines.items()):
        pieces: list[Interval] = []
        clock = 0.0
        for t in timed:
            a = t.action
            kind = ACTION_CLASSES[a.kind.value]
            start = t.start
            if kind == "comm" and t.end > t.start:
                # A RECV spans the wait for the sender plus the transit: split the two.
                start = max(t.start, t.end - comm)
            if start > clock + 1e-15:
                pieces.append(Interval(start=clock, end=start, kind="idle", label="idle"))
            if t.end > start or kind != "comm":
                pieces.append(Interval(start=start, end=t.end, kind=kind, label=str(a)))
            clock = max(clock, t.end)
        if result.makespan > clock + 1e-15:
            pieces.append(Interval(start=clock, end=result.makespan, kind="idle", label="idle"))
        out[rank] = pieces
    return out, result.makespan


def measured_intervals(timelines: Mapping[int, Sequence[Sequence]],
                       started_at: Mapping[int, float] | None = None) -> tuple[dict[int, list[Interval]], float]:
    """The intervals of one measured step per rank (:attr:`runtime.observe.measure.StepMeasurement.timeline`:
    (action, start, end) seconds from the rank's step start), shifted by each rank's wall-clock
    start (``started_at``) so the ranks line up; a receive waited on inside a compute action, and
    every gap between actions, is idle. Returns the rows and the makespan in seconds."""
    first = min(started_at.values()) if started_at else 0.0
    rows: dict[int, list[Interval]] = {}
    for rank, timed in sorted(timelines.items()):
        shift = (started_at or {}).get(rank, first) - first
        actions = sorted(((str(label), float(a) + shift, float(b) + shift) for label, a, b in timed),
                         key=lambda t: t[1])
        waits = [(a, b) for label, a, b in actions if label == "wait"]
        pieces: list[Interval] = []
        clock = 0.0
        for label, a, b in actions:
            if label == "wait":
                continue
            kind = _kind_of(label)
            if a > clock + 1e-9:
                pieces.append(Interval(start=clock, end=a, kind="idle", label="idle"))
            cuts = sorted((max(a, wa), min(b, wb)) for wa, wb in waits if wa < b and wb > a)
            cursor = a
            for wa, wb in cuts:  # the receives this action waited on, drawn as idle inside it
                if wa > cursor:
                    pieces.append(Interval(start=cursor, end=wa, kind=kind, label=label))
                pieces.append(Interval(start=wa, end=wb, kind="idle", label=f"{label}: waiting for a receive"))
                cursor = max(cursor, wb)
            if b > cursor:
                pieces.append(Interval(start=cursor, end=b, kind=kind, label=label))
            clock = max(clock, b)
        rows[rank] = pieces
    makespan = max((p.end for pieces in rows.values() for p in pieces), default=0.0)
    for pieces in rows.values():
        end = pieces[-1].end if pieces else 0.0
        if makespan > end + 1e-9:
            pieces.append(Interval(start=end, end=makespan, kind="idle", label="idle"))
    return rows, makespan


def _measured_timelines(steps: Any) -> tuple[dict[int, Sequence], dict[int, float], int, dict[int, Sequence]] | None:
    """(timeline by rank, wall-clock start by rank, step, ZeRO-3 collectives by rank) of one
    step's measurements, if timed."""
    if not steps or not all(getattr(m, "timeline", None) for m in steps):
        return None
    spans = {m.rank: m.collectives for m in steps if getattr(m, "collectives", None)}
    return ({m.rank: m.timeline for m in steps}, {m.rank: m.started_at for m in steps}, steps[0].step, spans)


def _kind_of(label: str) -> str:
    """The drawing class of an action's text (``2F0``, ``1SEND_B3->0``, ``ALL_REDUCE``)."""
    if label in ACTION_CLASSES:
        return ACTION_CLASSES[label]
    match = _ACTION_KIND.match(label)
    return ACTION_CLASSES.get(match.group(1), "comm") if match else "comm"


_ACTION_KIND = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|F|B)\d+")


def idle_fraction(rows: Mapping[int, Sequence[Interval]], makespan: float) -> float:
    """Idle rank-time over all rank-time (the bubble, with every other wait)."""
    idle = sum(p.end - p.start for pieces in rows.values() for p in pieces if p.kind == "idle")
    return idle / (makespan * len(rows)) if makespan > 0 and rows else 0.0


def _timeline(plan: Plan, schedule: Mapping[int, list], measured: tuple | None = None) -> str:
    rows, makespan = timeline_intervals(plan, schedule)
    out = _timeline_svg(rows, makespan, "timeline", plan)
    if measured is not None:
        timelines, started, step, spans = measured
        m_rows, m_span = measured_intervals(timelines, started)
        if m_span > 0:
            out += (f'<h3>Measured (step {step})</h3>' + _timeline_svg(m_rows, m_span, "timeline-measured", None)
                    + f'<p class="note" id="timeline-measured-note">Measured makespan {_ms(m_span)} (simulated '
                      f'{_ms(makespan)}); idle {idle_fraction(m_rows, m_span):.1%} of rank-time (simulated '
                      f'{idle_fraction(rows, makespan):.1%}): every action as the runtime timed it on each rank '
                      f'(<code>runtime.observe.measure.StepTimer</code>), aligned by the ranks\' wall clocks; a receive '
                      f'waited on inside a forward or backward is drawn idle.</p>')
            if spans:
                out += _zero3_timeline(spans, started, m_span, plan)
    return out


def _zero3_timeline(spans: Mapping[int, Sequence[Sequence]], started_at: Mapping[int, float], makespan: float,
                    plan: Plan) -> str:
    """ZeRO-3's measured collectives on the measured timeline's axis: per rank, each site's
    all-gather from its issue to its end (the part compute waited on drawn dark: exposed) above,
    its reduce-scatters below; the exposed seconds against the planner's ``dp_comm``."""
    left, width, row_h, top = 70, 1180, 30, 8
    scale = width / makespan if makespan > 0 else 0.0
    first = min(started_at.values()) if started_at else 0.0
    svg = [f'<svg id="zero3-timeline" xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
           f'height="{top + row_h * len(spans) + 8}" role="img" aria-label="ZeRO-3 gathers and reduce-scatters">']
    exposed: dict[int, float] = {}
    reduce: dict[int, float] = {}
    for i, (rank, rows) in enumerate(sorted(spans.items())):
        y = top + i * row_h
        shift = started_at.get(rank, first) - first
        svg.append(f'<g class="rank" data-rank="{rank}"><text x="{left - 8}" y="{y + row_h / 2 + 4}" '
                   f'text-anchor="end" font-size="12">rank {rank}</text>')
        for label, issued, waited, done, *_ in rows:
            issued, waited, done = (float(t) + shift for t in (issued, waited, done))
            gather = str(label).startswith("AG")
            parts = ([("inflight", issued, waited, y + 3), ("exposed", waited, done, y + 3)] if gather
                     else [("reduce", issued, done, y + row_h / 2)])
            if gather:
                exposed[rank] = exposed.get(rank, 0.0) + done - waited
            else:
                reduce[rank] = reduce.get(rank, 0.0) + done - issued
            for kind, a, b, yy in parts:
                if b <= a:
                    continue
                svg.append(f'<rect class="z3 {kind}" x="{left + a * scale:.2f}" y="{yy:.1f}" '
                           f'width="{max((b - a) * scale, 0.6):.2f}" height="{row_h / 2 - 3:.1f}" stroke="#fff" '
                           f'stroke-width="0.3"><title>{_e(str(label))} {kind}: {_ms(a)} - {_ms(b)}</title></rect>')
        svg.append("</g>")
    svg.append("</svg>")
    worst = max(exposed, key=lambda r: exposed[r] + reduce.get(r, 0.0), default=None)
    predicted = plan.predicted.terms.get("dp_comm", 0.0)
    note = (f'<p class="note" id="zero3-timeline-note">ZeRO-3, measured: each site\'s all-gather from its issue '
            f'(the next site\'s goes out before the current one computes: prefetch) to its end, the part compute '
            f'waited on dark; reduce-scatters below. Rank {worst} waited {_ms(exposed.get(worst, 0.0))} on gathers '
            f'and spent {_ms(reduce.get(worst, 0.0))} in reduce-scatters this step; the plan predicts '
            f'{_ms(predicted)} of data-parallel communication not hidden by compute (dp_comm).</p>'
            if worst is not None else "")
    legend = _legend([("gather in flight", "#d4a6c8"), ("gather waited on (exposed)", "#a33"),
                      ("reduce-scatter", "#76b7b2")])
    return '<h3>ZeRO-3 gathers and reduce-scatters (measured)</h3>' + legend + "\n".join(svg) + note


def _timeline_svg(rows: Mapping[int, list[Interval]], makespan: float, svg_id: str, plan: Plan | None) -> str:
    left, width, row_h, top = 70, 1180, 30, 24
    scale = width / makespan if makespan > 0 else 0.0
    height = top + row_h * len(rows) + 34
    svg = [f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
           f'role="img" aria-label="pipeline timeline">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3f3f3"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#c8c8c8" stroke-width="2"/></pattern></defs>']
    idle_total = busy_total = 0.0
    for i, (rank, pieces) in enumerate(rows.items()):
        y = top + i * row_h
        svg.append(f'<g class="rank" data-rank="{rank}"><text x="{left - 8}" y="{y + row_h / 2 + 4}" '
                   f'text-anchor="end" font-size="12">rank {rank}</text>')
        for piece in pieces:
            x0, w = left + piece.start * scale, max((piece.end - piece.start) * scale, 0.0)
            if piece.kind == "idle":
                idle_total += piece.end - piece.start
            elif piece.kind in ("fwd", "bwd", "wgt"):
                busy_total += piece.end - piece.start
            svg.append(f'<rect class="act {piece.kind}" x="{x0:.2f}" y="{y + 3}" width="{max(w, 0.6):.2f}" '
                       f'height="{row_h - 6}" stroke="#fff" stroke-width="0.5"><title>{_e(piece.label)}: '
                       f'{_ms(piece.start)} - {_ms(piece.end)}</title></rect>')
            short = re.fullmatch(r"\d+([FBIW])(\d+)", piece.label)
            if piece.kind in ("fwd", "bwd", "wgt") and w >= 16 and short:
                # "F3" / "B3" / "I3" / "W3" (the stage is in the tooltip); the micro-batch is what
                # people scan for.
                svg.append(f'<text x="{x0 + w / 2:.2f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                           f'font-size="10" fill="#fff">{short.group(1)}{_e(short.group(2))}</text>')
        svg.append("</g>")
    axis_y = top + row_h * len(rows) + 4
    svg.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + width}" y2="{axis_y}" stroke="#444"/>')
    for k in range(6):
        t = makespan * k / 5
        x = left + t * scale
        svg.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#444"/>'
                   f'<text x="{x:.2f}" y="{axis_y + 17}" text-anchor="middle" font-size="11">{_ms(t)}</text>')
    svg.append("</svg>")
    total = idle_total + busy_total
    bubble = idle_total / (makespan * len(rows)) if makespan > 0 and rows else 0.0
    legend = _legend([("forward", "#4e79a7"), ("backward", "#59a14f"), ("send/recv in transit", "#f28e2b"),
                      ("grad all-reduce", "#b07aa1"), ("optimizer step", "#9c755f"), ("idle (bubble)", "#e0e0e0")])
    if plan is None:
        return "\n".join(svg)
    times = [s.time_s for s in plan.stages]
    imbalance = (f" Stages differ in time ({_ms(min(times))} to {_ms(max(times))} per micro-batch), so "
                 f"faster ranks also wait on the slowest one." if times and max(times) > 1.01 * min(times) else "")
    note = (f'<p class="note" id="timeline-note">Simulated makespan {_ms(makespan)}; idle {bubble:.1%} of '
            f'rank-time (the plan\'s fill/drain bubble is {plan.predicted.bubble_fraction:.1%}).{imbalance} '
            f'Drawn from the per-rank action lists of <code>passes.ir.schedule</code> (the lists the runtime '
            f'executes), timed by <code>simulate</code> with each stage\'s predicted fwd+bwd time split 1:2 '
            f'and the plan\'s pp_comm spread over its messages; only transit a rank waits on is drawn.</p>'
            if total > 0 else "")
    return legend + "\n".join(svg) + note


# --------------------------------------------------------------------------------------- sections
def _header(plan: Plan, cluster: Any) -> str:
    name = getattr(cluster, "name", str(cluster))
    dev = getattr(cluster, "device", None)
    dev_text = f"{getattr(dev, 'name', '?')}, {format_bytes(float(getattr(dev, 'memory_bytes', 0)))}" if dev else ""
    return (f'<h1>Plan report: {_e(plan.model)}</h1><div class="sub" id="summary">cluster {_e(name)} '
            f'({_e(plan.cluster)}; {_e(dev_text)}), {plan.world_size} devices, global batch {plan.global_batch}'
            f'</div><p class="sub">{_e(plan.summary())}</p>')


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>\n{body}\n</section>'


def _knobs_tables(plan: Plan) -> str:
    knobs = "".join(f"<tr><th>{_e(k)}</th><td>{_e(str(v))}</td></tr>" for k, v in plan.knobs().items())
    p = plan.predicted
    pred = [("step time", _ms(p.step_time_s)), ("TFLOP/s per device", f"{p.tflops_per_device:.2f}"),
            ("MFU", f"{p.mfu:.1%}"), ("peak memory", format_bytes(p.peak_memory_bytes)),
            ("bubble fraction", f"{p.bubble_fraction:.1%}")]
    pred_rows = "".join(f'<tr><th>{_e(k)}</th><td class="num">{_e(v)}</td></tr>' for k, v in pred)
    term_rows = "".join(f'<tr><th>{_e(k)}</th><td class="num">{_ms(v)}</td></tr>' for k, v in p.terms.items())
    stage_rows = "".join(
        f'<tr><td>{s.index}</td><td>{_e(", ".join(s.layer_names))}</td><td class="num">{format_bytes(s.param_bytes)}'
        f'</td><td class="num">{format_bytes(s.peak_memory_bytes)}</td><td class="num">{_ms(s.time_s)}</td></tr>'
        for s in plan.stages)
    return (f'<div class="grid"><table id="knob-table"><tr><th colspan="2">knobs</th></tr>{knobs}</table>'
            f'<table id="prediction-table"><tr><th colspan="2">predicted</th></tr>{pred_rows}</table>'
            f'<table id="terms-table"><tr><th colspan="2">step time terms</th></tr>{term_rows}</table>'
            f'<table id="stage-table"><tr><th>stage</th><th>layers</th><th>params</th><th>peak</th>'
            f'<th>fwd+bwd / micro-batch</th></tr>{stage_rows}</table></div>')


def _terms_bar(plan: Plan) -> str:
    terms = [(k, v) for k, v in plan.predicted.terms.items() if k != "total" and v > 0]
    total = sum(v for _, v in terms)
    width, left = 1180, 10
    svg = [f'<svg id="terms-bar" xmlns="http://www.w3.org/2000/svg" width="{width + 2 * left}" height="44">']
    x = float(left)
    legend = []
    for i, (k, v) in enumerate(terms):
        w = width * v / total if total else 0
        colour = TERM_COLOURS[i % len(TERM_COLOURS)]
        svg.append(f'<rect class="term" data-term="{_e(k)}" x="{x:.2f}" y="4" width="{w:.2f}" height="26" '
                   f'fill="{colour}" stroke="#fff"><title>{_e(k)}: {_ms(v)} ({v / total:.1%})</title></rect>')
        if w > 60:
            svg.append(f'<text x="{x + w / 2:.2f}" y="21" text-anchor="middle" font-size="11" fill="#fff">'
                       f'{_e(k)} {v / total:.0%}</text>')
        legend.append((f"{k} {_ms(v)}", colour))
        x += w
    svg.append("</svg>")
    return _legend(legend) + "".join(svg)


def _memory_chart(plan: Plan, capacity: float) -> str:
    peaks = [max(s.peak_memory_bytes, sum(s.memory.get(t, 0.0) for t in MEMORY_TERMS)) for s in plan.stages]
    top_value = max(peaks, default=1.0) or 1.0
    # Draw the capacity line when it is on a readable scale; a tiny model on an 80 GiB device
    # would otherwise be a row of invisible bars.
    capacity_on_scale = 0 < capacity <= 4 * top_value
    axis_max = max(top_value, capacity if capacity_on_scale else 0.0) * 1.1
    bar_w, gap, left, top, plot_h = 56, 28, 80, 20, 300
    width = left + len(plan.stages) * (bar_w + gap) + 220
    svg = [f'<svg id="memory-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + plot_h + 50}">']
    for k in range(6):
        v = axis_max * k / 5
        y = top + plot_h - plot_h * k / 5
        svg.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 200}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{format_bytes(v)}</text>')
    for i, st in enumerate(plan.stages):
        x = left + gap / 2 + i * (bar_w + gap)
        y = top + plot_h
        svg.append(f'<g class="stage-mem" data-stage="{st.index}">')
        for term in MEMORY_TERMS:
            v = st.memory.get(term, 0.0)
            h = plot_h * v / axis_max
            y -= h
            svg.append(f'<rect class="mem-{term}" x="{x}" y="{y:.2f}" width="{bar_w}" height="{h:.2f}" '
                       f'fill="{MEMORY_COLOURS[term]}"><title>stage {st.index} {term}: {format_bytes(v)}</title></rect>')
        svg.append(f'<text x="{x + bar_w / 2}" y="{y - 4:.2f}" text-anchor="middle" font-size="10">'
                   f'{format_bytes(peaks[i])}</text>'
                   f'<text x="{x + bar_w / 2}" y="{top + plot_h + 16}" text-anchor="middle" font-size="12">'
                   f'stage {st.index}</text></g>')
    if capacity_on_scale:
        y = top + plot_h - plot_h * capacity / axis_max
        svg.append(f'<line id="capacity-line" x1="{left}" y1="{y:.2f}" x2="{width - 200}" y2="{y:.2f}" '
                   f'stroke="#d62728" stroke-width="2" stroke-dasharray="6,4"/><text x="{width - 196}" '
                   f'y="{y + 4:.2f}" font-size="12" fill="#d62728">capacity {format_bytes(capacity)}</text>')
    elif capacity > 0:
        svg.append(f'<text id="capacity-line" x="{width - 196}" y="{top + 12}" font-size="12" fill="#d62728">'
                   f'capacity {format_bytes(capacity)}</text><text x="{width - 196}" y="{top + 28}" '
                   f'font-size="11" fill="#d62728">(off scale: {capacity / top_value:.0f}x the peak)</text>')
    svg.append("</svg>")
    return _legend([(t, MEMORY_COLOURS[t]) for t in MEMORY_TERMS]) + "".join(svg)


def _alternatives(plan: Plan) -> str:
    if not plan.alternatives:
        return '<table id="alternatives"><tr><td>the search recorded no alternatives</td></tr></table>'
    chosen = plan.knobs()
    rows = [f'<tr class="chosen"><td class="won">chosen</td><td>{_e(_knob_text(chosen))}</td>'
            f'<td class="num">{_ms(plan.predicted.step_time_s)}</td>'
            f'<td class="num">{format_bytes(plan.predicted.peak_memory_bytes)}</td><td>-</td></tr>']
    for i, alt in enumerate(plan.alternatives):
        diff = {k: v for k, v in alt.knobs.items() if chosen.get(k) != v}
        rows.append(f'<tr class="alternative" data-index="{i}"><td>{i + 1}</td>'
                    f'<td>{_e(_knob_text(diff) or "same knobs")}</td><td class="num">{_ms(alt.step_time_s)}</td>'
                    f'<td class="num">{format_bytes(alt.peak_memory_bytes)}</td>'
                    f'<td class="lost">{_e(alt.reason)}</td></tr>')
    return ('<table id="alternatives"><tr><th>#</th><th>knobs (differences from the chosen plan)</th>'
            '<th>step time</th><th>peak memory</th><th>why it lost</th></tr>' + "".join(rows) + "</table>")


def _measured(plan: Plan, measured: Mapping[Any, Mapping[str, float]]) -> str:
    by_rank = {int(r): v for r, v in measured.items()}
    rows = []
    for rank in sorted(by_rank):
        m = by_rank[rank]
        stage = plan.stages[rank % plan.pp] if plan.stages else None
        pred_mem = stage.peak_memory_bytes if stage else plan.predicted.peak_memory_bytes
        t, mem = m.get("step_time_s"), m.get("peak_memory_bytes")
        rows.append(f'<tr data-rank="{rank}"><td>{rank}</td><td class="num">{_ms(plan.predicted.step_time_s)}</td>'
                    f'<td class="num">{_ms(t) if t is not None else "-"}</td>'
                    f'<td class="num">{_ratio(t, plan.predicted.step_time_s)}</td>'
                    f'<td class="num">{format_bytes(pred_mem)}</td>'
                    f'<td class="num">{format_bytes(mem) if mem is not None else "-"}</td>'
                    f'<td class="num">{_ratio(mem, pred_mem)}</td></tr>')
    return ('<table id="measured"><tr><th>rank</th><th>predicted step</th><th>measured step</th><th>measured / '
            'predicted</th><th>predicted peak</th><th>measured peak</th><th>measured / predicted</th></tr>'
            + "".join(rows) + "</table>")


def _graph_summary(graph: Any) -> str:

    keys = (PIPELINE_STAGE, CHECKPOINT, TENSOR_PARALLEL, "offload")
    per_stage: dict[Any, Counter] = {}
    for node in graph.graph.nodes:
        stage = node.meta.get(PIPELINE_STAGE, "-")
        c = per_stage.setdefault(stage, Counter())
        c["nodes"] += 1
        for key in keys[1:]:
            value = node.meta.get(key)
            if value is not None and (key != CHECKPOINT or getattr(value, "recompute", True)):
                c[key] += 1
    rows = "".join(f'<tr><td>{_e(str(s))}</td>' + "".join(f'<td class="num">{c[k]}</td>' for k in
                   ("nodes",) + keys[1:]) + "</tr>" for s, c in sorted(per_stage.items(), key=lambda kv: str(kv[0])))
    return ('<table id="graph-table"><tr><th>stage</th><th>nodes</th><th>recomputed</th><th>tensor parallel</th>'
            f'<th>offloaded</th></tr>{rows}</table><p class="note">Per-node reasons: '
            '<code>python -m ir_dumps explain DIR --node N</code>; stage-coloured graph: '
            '<code>ir_dumps.stage_dot</code>.</p>')


# --------------------------------------------------------------------------------------- helpers
def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(f'<span class="sw" style="background:{c}"></span>{_e(t)}'
                                             for t, c in items) + "</div>"


def _knob_text(knobs: Mapping[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def _ratio(measured: float | None, predicted: float) -> str:
    return f"{measured / predicted:.2f}x" if measured is not None and predicted else "-"


def _ms(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
