"""Smoke test of bench/plan_quality.py: its quick mode (one model, 4 plans, one step each in one
spawn of 4 gloo ranks) runs the planner's pick and its competitors and tabulates them; and the
sample of plans it runs covers what it claims to. Checks correctness only, never speed."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is scripts, not a package; spawned ranks inherit sys.path

import plan_quality as bench  # noqa: E402

from partitioner.search.profile import profile_model  # noqa: E402
from partitioner.search.search import candidates, feasible_plans, search  # noqa: E402
from passes.ir.config import KNOBS  # noqa: E402

SPEC = bench.MODELS["gpt"]


@pytest.fixture(scope="module")
def cluster():
    return bench.load_cluster("local-cpu")


@pytest.fixture(scope="module")
def profile():
    return profile_model(SPEC, dtype="fp32")


@pytest.fixture(scope="module")
def ranked(cluster, profile):
    return feasible_plans(profile, cluster, global_batch=bench.GLOBAL_BATCH)


@pytest.fixture(scope="module")
def report():
    (r,) = bench.run(bench.QUICK)
    return r


def test_feasible_plans_are_every_candidate_fastest_first_with_the_pick_first(cluster, profile, ranked):
    assert len(ranked) == len(candidates(profile, cluster, bench.GLOBAL_BATCH))  # 8 GiB: all fit
    times = [p.predicted.step_time_s for p in ranked]
    assert times == sorted(times)
    assert ranked[0].config == search(profile, cluster, global_batch=bench.GLOBAL_BATCH).config


def test_the_sample_has_the_pick_the_fastest_and_every_value_of_every_knob(ranked):
    pick = ranked[7]  # any plan can be a pick (another cluster's, or after the memory replay)
    sample = bench.sample_plans(ranked, [pick], 24)
    configs = [p.config for p in sample]
    assert len(sample) >= 24 and pick.config in configs
    assert [p.config for p in ranked[:bench.TOP]] == configs[:bench.TOP]
    for knob in KNOBS:
        assert {getattr(c, knob) for c in configs} == {getattr(p.config, knob) for p in ranked}, knob
    assert {(c.dp, c.tp, c.pp) for c in configs} == {(p.config.dp, p.config.tp, p.config.pp) for p in ranked}
    assert configs[-1] == ranked[-1].config  # spread to the slowest predicted


def test_plans_that_run_alike_are_measured_once(ranked):
    """GPipe and 1F1B with one micro-batch per pipeline run the same action lists: one of them is
    kept (the first); with more micro-batches they differ and both are."""
    one = [p for p in ranked if p.config.pp == 2 and p.config.num_micro_batches == 1
           and p.config.schedule in ("gpipe", "1f1b") and p.config.checkpointing == "none"
           and p.config.zero_stage == 0 and p.config.dp == 2]
    four = [p for p in ranked if p.config.pp == 2 and p.config.num_micro_batches == 4
            and p.config.schedule in ("gpipe", "1f1b") and p.config.checkpointing == "none"
            and p.config.zero_stage == 0 and p.config.dp == 1 and p.config.tp == 2 and not p.config.sequence_parallel]
    assert len(one) == 2 and len(four) == 2
    assert bench.distinct_plans(one) == one[:1]
    assert bench.distinct_plans(four) == four
    kept = bench.distinct_plans(ranked)
    assert len({bench._runs_as(p.config) for p in kept}) == len(kept) < len(ranked)


def test_a_few_plans_are_all_run(ranked):
    assert [p.config for p in bench.sample_plans(ranked[:10], [ranked[3]], 24)] == [p.config for p in ranked[:10]]


def _result(label: str, final_s: tuple[float, ...], picked: bool = False) -> bench.PlanResult:
    return bench.PlanResult(label=label, config=None, predicted_s={"x": 1.0}, predicted_rank={"x": 1}, terms={},
                            picked_by=("x",) if picked else (), step_s=(1.0, 1.0, 1.0), final_s=final_s)


def test_head_to_head_takes_the_median_of_per_round_ratios_against_the_contender_it_trails_most():
    # the rounds' load moves every plan alike: per-round ratios see through it where medians of
    # each plan's own rounds would not: the pick is 1.1x of a in 3 rounds of 4, yet its median
    # (2.2) is below a's (2.5); b is slower than the pick in every round
    pick = _result("pick", (1.1, 3.3, 1.1, 5.5), picked=True)
    a = _result("a", (1.0, 3.0, 2.0, 5.0))
    b = _result("b", (1.2, 3.6, 1.2, 6.0))
    untimed = _result("c", ())
    report = bench.ModelReport(model="m", spec="m", candidates={"x": 4}, plans=(pick, a, b, untimed), eager_loss=1.0)
    q, gap, slower = report.head_to_head("x")
    assert q is a and gap == pytest.approx(0.1) and slower == 3
    report = bench.ModelReport(model="m", spec="m", candidates={"x": 2}, plans=(pick, b), eager_loss=1.0)
    q, gap, slower = report.head_to_head("x")
    assert q is b and gap < 0 and slower == 0  # the pick beats its only contender
    assert bench.ModelReport(model="m", spec="m", candidates={"x": 1}, plans=(_result("p", (), True), a),
                             eager_loss=1.0).head_to_head("x") is None


@pytest.mark.slow
def test_quick_run_measures_the_pick_and_every_plan_computes_the_eager_loss(report, cluster, profile, ranked):
    # at least QUICK.plans: one more per schedule the search offers beyond the plans asked for
    assert len(report.plans) >= bench.QUICK.plans and len(report.ok) == len(report.plans)
    pick = report.pick("local-cpu")
    assert pick.config.knobs() == search(profile, cluster, global_batch=bench.GLOBAL_BATCH).config.knobs()
    assert pick.predicted_rank["local-cpu"] == 1
    assert {p.config.schedule for p in report.plans} == {p.config.schedule for p in ranked}
    for p in report.plans:
        assert len(p.step_s) == bench.QUICK.steps and all(0 < s < 60 for s in p.step_s)
        assert p.first_loss == pytest.approx(report.eager_loss, rel=1e-5)
        same = ranked[p.predicted_rank["local-cpu"] - 1]
        assert same.config.knobs() == p.config.knobs()
        assert p.predicted_s["local-cpu"] == pytest.approx(same.predicted.step_time_s)
    assert sorted(report.measured_rank(p) for p in report.plans) == list(range(1, len(report.plans) + 1))
    assert -1 <= report.spearman("local-cpu") <= 1 and report.gap("local-cpu") >= 0
    # head to head: the pick and the one measured fastest other plan, the same rounds each
    met = [p for p in report.plans if p.final_s]
    assert pick in met and len(met) == 1 + bench.QUICK.contenders
    assert all(len(p.final_s) == bench.QUICK.final and all(0 < s < 60 for s in p.final_s) for p in met)
    (other,) = (p for p in met if p is not pick)
    assert other is min((p for p in report.ok if p is not pick), key=lambda p: p.measured_s)
    assert report.head_to_head("local-cpu")[0] is other


@pytest.mark.slow
def test_the_table_has_a_row_per_plan_and_the_verdict(report):
    text = bench.format_report(report, ("local-cpu",))
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(report.plans)
    assert sum(line.rstrip().endswith("| local-cpu |") for line in rows) == 1
    assert "Spearman rho" in text and "measured rank" in text and "head to head (2 rounds" in text
    assert not math.isnan(report.spearman("local-cpu"))
