"""report.html (parses, every section, timeline drawn from the runtime's schedule with the
textbook bubble), the stage-coloured DOT, and ``ir-dumps explain``."""
from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from ir_dumps.cli import main
from ir_dumps.explain import NOT_DECIDED
from ir_dumps.report import plan_schedule, render_report, timeline_intervals
from ir_dumps.stage_dot import stage_colour, stage_dot
from partitioner.cost.cluster import Cluster
from passes.ir.config import ParallelConfig
from passes.ir.plan import MEMORY_TERMS, Alternative, Plan, Prediction, StagePlan
from passes.ir.schedule import compute_only
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"


class Elements(HTMLParser):
    """Every start tag with its attributes, in order; fails on unbalanced svg/table/section."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("svg", "g", "table", "section", "tr"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in ("svg", "g", "table", "section", "tr"):
            assert self.open and self.open[-1] == tag, (tag, self.open[-5:])
            self.open.pop()

    def find(self, tag=None, **attrs):
        return [a for t, a in self.tags if (tag is None or t == tag)
                and all(a.get(k.rstrip("_")) == v for k, v in attrs.items())]

    def with_class(self, cls):
        return [a for _, a in self.tags if cls in a.get("class", "").split()]


def parse(text: str) -> Elements:
    p = Elements()
    p.feed(text)
    p.close()
    assert p.open == []
    return p


def synthetic_plan(*, pp=4, m=8, schedule="gpipe", v=1, time_s=0.3, pp_comm=0.0) -> Plan:
    """A plan with equal stages and no communication, so the bubble has a closed form."""
    mem = {"parameters": 1e9, "gradients": 1e9, "optimizer": 4e9, "activations": 3e9, "buffers": 1e8}
    stages = tuple(StagePlan(index=i, layers=tuple((i + c * pp, i + c * pp + 1) for c in range(v)),
                             layer_names=(f"blocks.{i}",), param_bytes=1e9, peak_memory_bytes=sum(mem.values()),
                             memory=mem, time_s=time_s) for i in range(pp))
    step = (m + pp - 1) * time_s
    terms = {"compute": m * time_s, "pp_comm": pp_comm, "bubble": (pp - 1) * time_s, "total": step}
    alts = (Alternative(knobs={"dp": 1, "tp": 1, "pp": pp, "schedule": "1f1b"}, step_time_s=step * 1.1,
                        peak_memory_bytes=5e9, reason="slower by 10.0%"),
            Alternative(knobs={"dp": 1, "tp": 4, "pp": 1}, step_time_s=step, peak_memory_bytes=9e10,
                        reason="needs 90.00 GiB of 80.00 GiB"))
    config = ParallelConfig(pp=pp, virtual_pp=v, micro_batch_size=1, num_micro_batches=m, schedule=schedule)
    return Plan(model="gpt:test", cluster="dgx-a100-80gb x 1", global_batch=m, config=config, stages=stages,
                predicted=Prediction(step_time_s=step, tflops_per_device=100.0, mfu=0.4,
                                     peak_memory_bytes=sum(mem.values()), bubble_fraction=(pp - 1) / (m + pp - 1),
                                     terms=terms),
                alternatives=alts)


CLUSTER = Cluster.preset("dgx-a100-80gb")


# ------------------------------------------------------------------------------------------- report
def test_report_has_every_section():
    plan = synthetic_plan()
    doc = parse(render_report(plan=plan, cluster=CLUSTER))
    assert len(doc.find("svg", id="timeline")) == 1
    assert len(doc.find("svg", id="memory-chart")) == 1
    assert len(doc.find("svg", id="terms-bar")) == 1
    assert doc.find(id="capacity-line")
    groups = doc.with_class("stage-mem")
    assert [g["data-stage"] for g in groups] == [str(i) for i in range(plan.pp)]
    # One rect per memory term in every stage group (5 terms x 4 stages).
    assert sum(len(doc.with_class(f"mem-{t}")) for t in MEMORY_TERMS) == len(MEMORY_TERMS) * plan.pp
    assert len(doc.find("table", id="alternatives")) == 1
    assert len(doc.with_class("alternative")) == len(plan.alternatives)
    assert [a["data-rank"] for a in doc.with_class("rank")] == [str(r) for r in range(plan.pp)]
    assert not doc.find("script") and not doc.find("link")  # self-contained: no JS, no stylesheet links
    assert not [a for _, a in doc.tags if any(str(v).startswith("http") for k, v in a.items() if k != "xmlns")]
    assert not doc.find(id="measured")  # only with measurements


def test_report_text_names_why_alternatives_lost():
    text = render_report(plan=synthetic_plan(), cluster=CLUSTER)
    assert "slower by 10.0%" in text and "needs 90.00 GiB of 80.00 GiB" in text


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 2)])
def test_timeline_draws_the_runtime_schedule(schedule, v):
    plan = synthetic_plan(schedule=schedule, v=v)
    actions = compute_only(plan_schedule(plan))
    rows, _ = timeline_intervals(plan, plan_schedule(plan))
    for rank, pieces in rows.items():
        drawn = [p.label for p in pieces if p.kind in ("fwd", "bwd", "wgt")]
        assert drawn == [str(a) for a in actions[rank]]  # same actions, same order
    doc = parse(render_report(plan=plan, cluster=CLUSTER))
    assert len(doc.with_class("fwd")) == plan.pp * plan.num_micro_batches * v
    assert len(doc.with_class("bwd")) == plan.pp * plan.num_micro_batches * v  # B, or the I halves
    # the weight halves of a split backward, drawn apart
    assert len(doc.with_class("wgt")) == (plan.pp * plan.num_micro_batches * v if schedule.startswith("zb") else 0)


@pytest.mark.parametrize("pp,m", [(4, 8), (2, 6), (1, 4)])
def test_idle_time_is_the_textbook_bubble(pp, m):
    plan = synthetic_plan(pp=pp, m=m, schedule="1f1b")
    rows, makespan = timeline_intervals(plan, plan_schedule(plan))
    assert makespan == pytest.approx((m + pp - 1) * plan.stages[0].time_s)
    idle = sum(p.end - p.start for pieces in rows.values() for p in pieces if p.kind == "idle")
    assert idle / (makespan * pp) == pytest.approx((pp - 1) / (m + pp - 1))


def test_communication_is_drawn_when_predicted():
    plan = synthetic_plan(pp=2, m=4, pp_comm=0.8)
    rows, makespan = timeline_intervals(plan, plan_schedule(plan))
    comm = [p for pieces in rows.values() for p in pieces if p.kind == "comm"]
    # 2 * m messages over the step: 0.1 s of transit each. Only transit a rank waits on is drawn
    # (a message that arrived while the rank computed costs it nothing): rank 1 waits the whole
    # 0.1 s for micro-batch 0's activation, right after stage 0's first forward (0.1 s).
    assert comm and all("RECV" in p.label and p.end - p.start <= 0.1 + 1e-12 for p in comm)
    first = next(p for p in rows[1] if p.kind == "comm")
    assert (first.label, first.start, first.end) == ("1RECV_F0<-0", pytest.approx(0.1), pytest.approx(0.2))
    assert makespan > timeline_intervals(synthetic_plan(pp=2, m=4), plan_schedule(plan))[1]


def test_measured_side_by_side():
    plan = synthetic_plan(pp=2, m=4)
    measured = {0: {"step_time_s": plan.predicted.step_time_s * 1.25, "peak_memory_bytes": 5e9},
                "1": {"step_time_s": plan.predicted.step_time_s, "peak_memory_bytes": 9.1e9}}
    text = render_report(plan=plan, cluster=CLUSTER, measured=measured)
    doc = parse(text)
    assert len(doc.find("table", id="measured")) == 1
    assert [r["data-rank"] for r in doc.find("tr") if "data-rank" in r] == ["0", "1"]
    assert "1.25x" in text and "1.00x" in text


# --------------------------------------------------------------------------------- graph fixtures
@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """Tiny GPT through shapes, FLOPs, checkpoint policy and stage tagging, with dumps."""
    from partitioner.inputs.models import build_model
    from passes.analysis.annotate_flops import annotate_flops
    from passes.analysis.annotate_shapes import annotate_shapes
    from passes.capture.capture import capture_spec
    from passes.policies.checkpoint_policy import checkpoint_policy
    from ir_dumps.writer import DumpWriter
    from passes.analysis.annotate_blocks import annotate_blocks
    from passes.lowering.manager import Pass, PassManager
    from passes.policies.pipeline_stages import assign_stages_by_layers, tag_pipeline_stages

    def stages(gm, ctx=None):
        return tag_pipeline_stages(gm, assign_stages_by_layers(gm, [1]))

    def recompute_block_1(gm, ctx=None):
        return checkpoint_policy(gm, ctx, policy="full")

    out = tmp_path_factory.mktemp("dumps")
    passes = [Pass(name="annotate_shapes", fn=annotate_shapes), Pass(name="annotate_blocks", fn=annotate_blocks),
              Pass(name="annotate_flops", fn=annotate_flops),
              Pass(name="checkpoint_policy", fn=recompute_block_1), Pass(name="pipeline_stages", fn=stages)]
    gm = PassManager(passes, instrument=DumpWriter(out)).run(capture_spec(build_model(GPT)))
    return gm, out


def test_report_with_graph_counts_nodes_per_stage(dumped):
    gm, _ = dumped
    doc = parse(render_report(plan=synthetic_plan(pp=2, m=4), cluster=CLUSTER, graph=gm))
    assert len(doc.find("table", id="graph-table")) == 1


def test_planning_writes_report_beside_plan_json(tmp_path):
    from partitioner import Training
    from partitioner.api.planning import plan

    chosen = plan("gpt:layers=2,hidden=64,heads=2,vocab=128,seq=32", local_cluster(2), training=Training(global_batch=4),
                  fix="pp=2", dump_dir=tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["config"]["pp"] == 2
    doc = parse((tmp_path / "report.html").read_text())
    assert [g["data-stage"] for g in doc.with_class("stage-mem")] == ["0", "1"]
    assert len(doc.with_class("idle")) > 0  # pp=2: the bubble shows
    assert len(doc.with_class("alternative")) == len(chosen.alternatives)


# ------------------------------------------------------------------------------------------ stage DOT
def test_stage_dot_is_deterministic_and_coloured(dumped):
    gm, _ = dumped
    text = stage_dot(gm)
    assert text == stage_dot(gm)
    assert "subgraph cluster_stage_0" in text and "subgraph cluster_stage_1" in text
    by_name = {n.name: n for n in gm.graph.nodes}
    line = next(l for l in text.splitlines() if l.strip().startswith('"linear_4" ['))
    assert by_name["linear_4"].meta["pipeline_stage"] == 1
    assert f'fillcolor="{stage_colour(1)}"' in line and "dashed" in line  # stage 1, recomputed
    cross = [l for l in text.splitlines() if "color=red" in l]
    assert cross and all('label="0 -> 1"' in l for l in cross)
    assert stage_colour(0) != stage_colour(1)


# ------------------------------------------------------------------------------------------ explain
def test_explain_names_stage_recompute_and_missing_decisions(dumped, capsys):
    gm, out = dumped
    assert main(["explain", str(out), "--node", "%linear_4"]) == 0
    text = capsys.readouterr().out
    assert "module blocks.1.attn.qkv" in text
    assert "decided by pass pipeline_stages" in text and "stage 1" in text
    assert "decided by pass checkpoint_policy" in text and "recompute=True" in text
    assert "recompute_flops=" in text and "bytes_saved=" in text
    assert "fwd+bwd FLOPs per stage" in text
    assert text.count(NOT_DECIDED) == 2  # no tensor-parallel or offload pass ran


def test_explain_reads_plan_json_and_reports_boundary(dumped, capsys):
    gm, out = dumped
    (out / "plan.json").write_text(synthetic_plan(pp=2, m=4).to_json())
    try:
        boundary = next(n for n in gm.graph.nodes if n.meta.get("pipeline_stage") == 0
                        and any(u.meta.get("pipeline_stage") == 1 for u in n.users) and n.op == "call_function")
        assert main(["explain", str(out), "--node", boundary.name]) == 0
    finally:
        (out / "plan.json").unlink()
    text = capsys.readouterr().out
    assert "crosses a stage boundary" in text
    assert "plan: pp=2" in text and "per micro-batch" in text


def test_explain_unknown_node_is_a_usage_error(dumped, capsys):
    _, out = dumped
    assert main(["explain", str(out), "--node", "no_such_node"]) == 2
    assert "no node 'no_such_node'" in capsys.readouterr().err


def test_measured_timeline_aligns_ranks_and_draws_waits_as_idle():
    from types import SimpleNamespace

    from ir_dumps.report import idle_fraction, measured_intervals

    # rank 1 starts 10 ms later (wall clock); its forward waits 5 ms for rank 0's activations
    timelines = {0: [("0F0", 0.000, 0.010), ("0SEND_F0->1", 0.010, 0.011), ("0B0", 0.030, 0.050)],
                 1: [("1RECV_F0<-0", 0.000, 0.001), ("1F0", 0.001, 0.016), ("wait", 0.001, 0.006),
                     ("1B0", 0.016, 0.030), ("1SEND_B0->0", 0.030, 0.031)]}
    rows, makespan = measured_intervals(timelines, {0: 100.000, 1: 100.010})
    assert makespan == pytest.approx(0.050)
    r1 = [(p.kind, round(p.start, 3), round(p.end, 3)) for p in rows[1]]
    assert r1[:4] == [("idle", 0.0, 0.01), ("comm", 0.01, 0.011), ("idle", 0.011, 0.016), ("fwd", 0.016, 0.026)]
    assert ("bwd", 0.026, 0.04) in r1 and r1[-1] == ("idle", 0.041, 0.05)
    busy = sum(p.end - p.start for p in rows[0] if p.kind in ("fwd", "bwd"))
    assert busy == pytest.approx(0.030)
    assert 0 < idle_fraction(rows, makespan) < 1
    steps = [SimpleNamespace(rank=r, step=7, timeline=tuple(t), started_at=100.0 + 0.01 * r)
             for r, t in sorted(timelines.items())]
    html_text = render_report(plan=synthetic_plan(pp=2, m=1), cluster=Cluster.load("local-cpu"), measured_step=steps)
    doc = Elements()
    doc.feed(html_text)
    assert len(doc.find("svg", id="timeline-measured")) == 1 and "Measured (step 7)" in html_text
    assert "timeline-measured" not in render_report(plan=synthetic_plan(pp=2, m=1), cluster=Cluster.load("local-cpu"))
