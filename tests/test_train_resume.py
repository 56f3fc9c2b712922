"""``partitioner train``: a run killed mid-training and resumed with ``--resume`` gives the losses of
the uninterrupted run, under the same plan, another plan and another world size; every step's
metrics are in the JSONL.

Five launches of local ranks, each a real ``partitioner train`` process per rank (env://):
uninterrupted (dp=2, 16 steps, warm-up + cosine, clipping that is active); the same with
checkpoints every 5 steps and rank 1 SIGKILLed in step 12 (``$PARTITIONER_FAULT``); a resume of
that under dp=2, one under pp=2 and one on a single rank. The resumed runs continue from step 10 (the latest complete
checkpoint: model, optimizer, scheduler, sampler position, RNG) and must reproduce steps 11-16.
"""
from __future__ import annotations

import json
import math

import pytest

from tests.train_cli import launch_train, outputs_of_success

pytestmark = pytest.mark.slow

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,dropout=0.0"
STEPS, KILL_AT, EVERY = 16, 12, 5
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens", "tokens_per_s", "mfu", "peak_memory_bytes",
               "skipped"}


def _text() -> str:
    import inspect

    import argparse
    return inspect.getsource(argparse)[:40_000]


def _ok(results) -> str:
    return outputs_of_success(results)[0]


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_run_resumes_with_the_uninterrupted_losses_under_the_same_and_another_plan(tmp_path):
    from runtime.checkpoint.directory import complete_checkpoints, step_dir_name

    data = tmp_path / "corpus.txt"
    data.write_text(_text(), encoding="utf-8")
    common = ["--model", MODEL, "--global-batch", "8", "--steps", str(STEPS), "--lr", "1e-2", "--data", str(data),
              "--seed", "5", "--warmup", "3", "--clip-grad-norm", "0.5"]
    _ok(launch_train(2, [*common, "--fix", "dp=2", "--metrics", str(tmp_path / "full.jsonl")]))
    full = _jsonl(tmp_path / "full.jsonl")
    assert [m["step"] for m in full] == list(range(STEPS))
    for m in full:  # every metric, every step
        assert set(m) >= METRIC_KEYS, m
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["lr"] > 0 and m["tokens"] == 8 * 16
        assert m["tokens_per_s"] > 0 and m["mfu"] > 0 and len(m["peak_memory_bytes"]) == 2
    assert any(m["peak_memory_bytes"][0] for m in full)  # the memory-tracked steps
    lrs = [m["lr"] for m in full]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[-1] < 0.3 * max(lrs)  # warm-up, then the cosine decay
    assert sum(m["grad_norm"] > 0.5 for m in full) >= STEPS // 2  # clipping is active
    losses = [m["loss"] for m in full]

    ckpt = tmp_path / "ckpt"
    killed = launch_train(2, [*common, "--fix", "dp=2", "--save-dir", str(ckpt), "--save-every", str(EVERY)],
                     env_extra={"PARTITIONER_FAULT": f"rank=1,step={KILL_AT},action=1"})
    assert any(code != 0 for code, _, _ in killed), "the fault must stop the run"
    assert [p.name for p in complete_checkpoints(ckpt)] == [step_dir_name(5), step_dir_name(10)]

    for world, fix, name, rel in ((2, "dp=2", "same", 1e-6), (2, "pp=2", "other", 1e-5), (1, "dp=1", "one", 1e-5)):
        out = _ok(launch_train(world, [*common, "--fix", fix, "--resume", str(ckpt),
                                       "--metrics", str(tmp_path / f"{name}.jsonl")]))
        assert "at step 10" in out, out
        resumed = _jsonl(tmp_path / f"{name}.jsonl")
        assert [m["step"] for m in resumed] == list(range(10, STEPS))
        assert [m["loss"] for m in resumed] == pytest.approx(losses[10:], rel=rel, abs=0), f"resumed under {fix}"
        assert [m["lr"] for m in resumed] == pytest.approx(lrs[10:], rel=1e-12)
