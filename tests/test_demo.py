"""``partitioner demo --steps 3`` (a small GPT, fast settings): trains on 4 gloo ranks, matches
single-process training, and writes plan.json, report.html, measurements.json and the IR dumps.
Plus the corpus it trains on."""
from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
import torch

from partitioner.cli import corpus
from partitioner.api.auto import choose_plan
from partitioner.cli.main import main
from partitioner.cli.demo import DEMO_GLOBAL_BATCH, plan_lines
from partitioner.search.search import runner_up
from passes.ir.plan import Alternative, Plan
from partitioner.calibration.job_cluster import local_cluster

SMALL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,dropout=0.0"


def test_demo_runs_matches_one_process_and_writes_every_file(tmp_path, capfd):
    out = tmp_path / "demo"
    start = time.perf_counter()
    assert main(["demo", "--steps", "3", "--model", SMALL, "--dump-dir", str(out)]) == 0
    elapsed = time.perf_counter() - start
    captured = capfd.readouterr()
    text = captured.out
    print(f"demo --steps 3: {elapsed:.1f} s")
    assert "Warning" not in captured.err, captured.err[-3000:]  # nothing a user can do nothing about
    assert text.startswith("demo: "), text[:500]
    # the ranks detect the cluster, as auto_parallelize does by default (here: the suite's cluster file)
    assert captured.err.count("partitioner: detected cluster: 1 node(s) x 4 ") == 1, captured.err[-3000:]
    assert "matches single-process training: max rel diff" in text
    bars = re.findall(r"^(step +\d+/\d+)  loss", text, flags=re.M)
    assert bars == ["step   1/3", "step   2/3", "step   3/3"]

    plan = Plan.from_json((out / "plan.json").read_text())
    # nothing pinned: the demo runs the search's own choice, and says what came second and by how much
    searched = choose_plan(SMALL, local_cluster(4), world_size=4, global_batch=DEMO_GLOBAL_BATCH)
    assert plan.knobs() == searched.knobs()
    assert f"plan (nothing pinned; the search chose the rest): {plan.summary()}" in text
    second = runner_up(plan)
    assert second is not None and second.knobs != plan.knobs() and second.loss_s >= 0
    assert second.loss_fraction == pytest.approx(second.step_time_s / plan.predicted.step_time_s - 1)
    line = re.search(r"^runner-up: (.*): ([0-9.]+) s predicted, lost by ([0-9.e-]+) s \(([0-9.]+)%\)(; a tie, the simpler plan is chosen)?$", text, flags=re.M)
    assert line, text
    assert float(line.group(2)) == pytest.approx(second.step_time_s, abs=1e-4)
    assert float(line.group(4)) == pytest.approx(100 * second.loss_fraction, abs=0.01)
    assert re.search(r"step time \(median over ranks\): [0-9.]+ s measured, [0-9.]+ s predicted \([-+][0-9.]+% off\)", text)
    m = json.loads((out / "measurements.json").read_text())
    assert m["world_size"] == 4 and [len(s) for s in m["steps"]] == [3, 3, 3, 3]
    assert m["predicted_step_time_s"] == plan.predicted.step_time_s
    for rank, steps in enumerate(m["steps"]):
        for s in steps:
            assert s["rank"] == rank and s["wall_s"] > s["compute_s"] > 0
        # The first two steps are memory-tracked (the peak is reached once AdamW state exists).
        assert [s["peak_memory_bytes"] is not None for s in steps] == [True, True, False]
        assert steps[1]["peak_memory_bytes"] >= steps[0]["peak_memory_bytes"] > 0
    losses = [s["loss"] for s in m["steps"][0]]
    assert all(f"loss {x:.4f}" in text for x in losses)
    report = (out / "report.html").read_text()
    assert 'id="measured"' in report  # written again after training, with the measurements
    assert 'id="timeline-measured"' in report  # the last step as the ranks timed it, under the simulated one
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest and (out / "05_annotate_memory.txt").is_file()
    programs = [f"stage{s}_tp{t}" for s in range(plan.pp) for t in range(plan.tp)]
    assert sorted(manifest["pipelines"]) == sorted(["analysis", "whole_graph", *programs])
    last = out / programs[-1]
    # ONNX only when asked (--onnx): the exporter would trace every program again before step one
    assert (last / "program.txt").is_file() and not (last / "program.onnx").exists()
    assert any("no program.onnx: not asked for" in note for note in manifest["notes"]), manifest["notes"]


def test_corpus_is_real_text_deterministic_bytes():
    data = corpus.corpus_bytes()
    assert b"Beautiful is better than ugly." in data and b"def dumps(" in data
    idx, targets = corpus.batch(5, 4, 16)
    again = corpus.batch(5, 4, 16)
    assert idx.shape == targets.shape == (4, 16) and idx.dtype == torch.int64
    assert torch.equal(idx, again[0]) and torch.equal(targets, again[1])
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # next-byte targets
    assert not torch.equal(idx, corpus.batch(6, 4, 16)[0])
    assert int(idx.max()) < corpus.VOCAB


def test_plan_lines_name_the_runner_up_and_its_loss():
    plan = choose_plan(SMALL, local_cluster(4), world_size=4, global_batch=DEMO_GLOBAL_BATCH)
    best = plan.predicted.step_time_s
    slower = Alternative(knobs={**plan.knobs(), "zero_stage": 2}, step_time_s=1.25 * best, peak_memory_bytes=1.0,
                         reason="slower")
    faster = Alternative(knobs={**plan.knobs(), "tp": 4}, step_time_s=0.5 * best, peak_memory_bytes=1e12,
                         reason="needs more memory")  # faster but does not fit: not the runner-up
    plan = dataclasses.replace(plan, alternatives=(slower, faster))
    second = runner_up(plan)
    assert second.knobs == slower.knobs and second.loss_fraction == pytest.approx(0.25)
    assert second.loss_s == pytest.approx(0.25 * best)
    lines = plan_lines(plan, None)
    assert lines[0].startswith("plan (nothing pinned; the search chose the rest): ")
    assert lines[1].endswith(f"lost by {0.25 * best:.3g} s (25.00%)") and "zero=2" in lines[1]
    assert plan_lines(plan, "dp=2")[0].startswith("plan (pinned dp=2; ")
    tie = dataclasses.replace(slower, step_time_s=best)
    assert plan_lines(dataclasses.replace(plan, alternatives=(tie,)), None)[1].endswith(
        "lost by 0 s (0.00%); a tie, the simpler plan is chosen")
    assert plan_lines(dataclasses.replace(plan, alternatives=(faster,)), None)[1] == \
        "runner-up: none (no other candidate fits)"
