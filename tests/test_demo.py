"""``partitioner demo --steps 3`` (a small GPT, fast settings): trains on 4 gloo ranks, matches
single-process training, and writes plan.json, report.html, measurements.json and the IR dumps.
Plus the corpus it trains on."""
from __future__ import annotations

import json
import re
import time

import torch

from partitioner import corpus
from partitioner.cli import main
from passes.ir.plan import Plan

SMALL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,dropout=0.0"


def test_demo_runs_matches_one_process_and_writes_every_file(tmp_path, capfd):
    out = tmp_path / "demo"
    start = time.perf_counter()
    assert main(["demo", "--steps", "3", "--model", SMALL, "--dump-dir", str(out)]) == 0
    elapsed = time.perf_counter() - start
    text = capfd.readouterr().out
    print(f"demo --steps 3: {elapsed:.1f} s")
    assert "matches single-process training: max rel diff" in text
    bars = re.findall(r"^(step +\d+/\d+) \[[#.]+\]  loss", text, flags=re.M)
    assert bars == ["step   1/3", "step   2/3", "step   3/3"]

    plan = Plan.from_json((out / "plan.json").read_text())
    assert (plan.dp, plan.pp, plan.tp) == (2, 2, 1)  # the demo's default fix: pipeline stages show
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
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest and (out / "04_annotate_memory.txt").is_file()
    assert sorted(manifest["pipelines"]) == ["analysis", "stage0_tp0", "stage1_tp0", "whole_graph"]
    assert (out / "stage1_tp0" / "program.txt").is_file() and (out / "stage1_tp0" / "program.onnx").is_file()


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
