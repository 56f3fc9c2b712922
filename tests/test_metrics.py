"""Per-step metrics: the logger's JSONL, plain lines, progress bar and TensorBoard fallback on
made-up steps; the token count and measured MFU from their inputs; and one 2-rank pipeline job
(gloo) whose rank-0 logger writes one JSON line per step matching what ``train_step`` returned.
"""
from __future__ import annotations

import io
import json
import sys
import time

import pytest
import torch

from passes.ir.meta import InputSpec
from passes.ir.plan import Prediction
from runtime.dist.launch import spawn
from runtime.observe.metrics import (MetricsLogger, StepMetrics, dim_sizes, format_line, measured_mfu, step_tokens,
                                     tensorboard_available)
from partitioner.calibration.job_cluster import local_cluster

FIELDS = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens", "tokens_per_s", "mfu", "peak_memory_bytes",
          "skipped"}


def _metrics(step: int, **over) -> StepMetrics:
    base = dict(step=step, loss=2.5 - 0.1 * step, grad_norm=1.25, lr=3e-4, step_time_s=0.5, tokens=4096,
                tokens_per_s=8192.0, mfu=0.0123, peak_memory_bytes=(3 * 2**20, None, 5 * 2**20), skipped=False)
    return StepMetrics(**{**base, **over})


def test_jsonl_one_line_per_step_with_every_field(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    logger = MetricsLogger(jsonl=path, echo=False)
    steps = [_metrics(k, skipped=k == 1) for k in range(3)]
    for k, m in enumerate(steps):
        logger.log(m)
        # flushed after each step: a run killed now keeps the lines written so far
        assert len(path.read_text().splitlines()) == k + 1
    logger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3
    for line, m in zip(lines, steps):
        assert set(line) == FIELDS
        assert StepMetrics.from_json(line) == m
    assert lines[1]["skipped"] is True and lines[0]["peak_memory_bytes"] == [3 * 2**20, None, 5 * 2**20]


def test_plain_line_names_every_field_and_the_largest_peak():
    out = io.StringIO()  # not a terminal: plain lines, no bar
    with MetricsLogger(total_steps=10, stream=out) as logger:
        logger.log(_metrics(3))
        logger.log(_metrics(4, grad_norm=None, lr=None, mfu=None, peak_memory_bytes=(None, None), skipped=True))
    first, second = out.getvalue().splitlines()
    assert first == ("step 3/10 | loss 2.2000 | gnorm 1.25 | lr 3.00e-04 | 8.19k tok/s | MFU 1.23% | "
                     "mem 5.00 MiB | 0.500 s")
    assert second == "step 4/10 | loss 2.1000 | gnorm - | lr - | 8.19k tok/s | MFU - | mem - | 0.500 s | skipped"
    assert format_line(_metrics(7)).startswith("step 7 | loss")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_progress_bar_with_the_fields_as_postfix():
    pytest.importorskip("tqdm")
    out = _Terminal()
    logger = MetricsLogger(total_steps=4, stream=out)
    for k in range(2):
        logger.log(_metrics(k))
    logger.close()
    text = out.getvalue()
    assert "\r" in text and "2/4" in text  # a redrawn bar, not one line per step
    assert "loss 2.4000" in text and "MFU 1.23%" in text and "step 0 |" not in text


def test_tensorboard_missing_is_skipped_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    assert not tensorboard_available()
    with pytest.warns(RuntimeWarning, match="tensorboard is not installed"):
        logger = MetricsLogger(jsonl=tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb", echo=False)
    logger.log(_metrics(0))
    logger.close()
    assert logger.tensorboard is None and not (tmp_path / "tb").exists()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 1


def test_tensorboard_scalars_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    logger = MetricsLogger(tensorboard_dir=tmp_path / "tb", echo=False)
    logger.log(_metrics(0))
    logger.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_tokens_are_batch_times_seq_else_samples():
    ids = InputSpec(name="input_ids", shape=("batch", "seq"), dtype=torch.long, high=64)
    labels = InputSpec(name="labels", shape=("batch", "seq"), dtype=torch.long, high=64)
    batch = [torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)]
    assert step_tokens(dim_sizes([ids, labels], batch)) == 32
    x = InputSpec(name="x", shape=("batch", 16))
    assert step_tokens(dim_sizes([x], [torch.zeros(6, 16)])) == 6


def test_measured_mfu_scales_the_prediction_by_step_time():
    p = Prediction(step_time_s=2.0, tflops_per_device=1.0, mfu=0.4, peak_memory_bytes=0.0, bubble_fraction=0.0,
                   terms={})
    assert measured_mfu(p, 2.0) == pytest.approx(0.4)
    assert measured_mfu(p, 4.0) == pytest.approx(0.2)  # twice as slow: half the utilisation
    assert measured_mfu(p, 0.0) is None


# ---------------------------------------------------------------------------------------------
# One 2-rank job: dp=1 x pp=2 on gloo

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, STEPS, WORLD, TRACKED = 4, 3, 2, 2
FIX = "dp=1,pp=2,schedule=1f1b,num_micro_batches=2,offload=none,checkpointing=none"


def _rank(jsonl: str):
    import os

    from partitioner import Job, Training
    from partitioner.api.auto import auto_parallelize
    from partitioner.inputs.models import build_model

    spec = build_model(GPT)
    trainer = auto_parallelize(GPT, local_cluster(WORLD), training=Training(global_batch=GLOBAL_BATCH,
                                                                            optimizer={"lr": 1e-3}),
                               fix=FIX, job=Job(timeout_s=60, track_memory=TRACKED))
    logger = MetricsLogger(jsonl=jsonl, total_steps=STEPS) if os.environ["RANK"] == "0" else None
    trainer.attach_metrics(logger)
    losses, metrics = [], []
    for k in range(STEPS):
        losses.append(trainer.train_step(spec.example_inputs({"batch": GLOBAL_BATCH}, seed=k)))
        metrics.append(trainer.last_metrics)
    if logger is not None:
        logger.close()
    p = trainer.plan.predicted
    reports = {name: hasattr(trainer.model, name) for name in ("last_grad_norm", "last_lr")}
    return {"losses": losses, "metrics": metrics, "predicted": (p.mfu, p.step_time_s), "reports": reports}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    jsonl = tmp_path_factory.mktemp("metrics") / "train.jsonl"
    start = time.perf_counter()
    out = spawn(_rank, WORLD, str(jsonl), timeout_s=300)
    print(f"\nspawn of {WORLD} ranks: {time.perf_counter() - start:.1f} s")
    return out, jsonl


def test_job_writes_one_line_per_step_on_rank_0(job):
    out, jsonl = job
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == STEPS
    for k, line in enumerate(lines):
        assert set(line) == FIELDS
        assert line["step"] == k
        assert line["loss"] == out[0]["losses"][k]  # what train_step returned, exactly
        assert line["tokens"] == GLOBAL_BATCH * 8
        assert line["tokens_per_s"] > 0 and line["step_time_s"] > 0
        assert line["mfu"] is not None and line["mfu"] > 0
        peaks = line["peak_memory_bytes"]
        assert len(peaks) == WORLD
        if k < TRACKED:  # CPU: the first steps run under the live-bytes tracker
            assert all(isinstance(p, int) and p > 0 for p in peaks)
        else:
            assert peaks == [None] * WORLD


def test_job_metrics_are_the_same_on_every_rank(job):
    out, _ = job
    assert out[0]["metrics"] == out[1]["metrics"]
    assert [m.loss for m in out[1]["metrics"]] == out[1]["losses"]
    predicted_mfu, predicted_s = out[0]["predicted"]
    for m in out[0]["metrics"]:
        assert m.tokens_per_s == pytest.approx(m.tokens / m.step_time_s)
        # the planner's MFU definition: same model FLOPs and peak, measured instead of predicted time
        assert m.mfu == pytest.approx(predicted_mfu * predicted_s / m.step_time_s)
        # grad norm and lr are reported once the model exposes them
        assert (m.grad_norm is not None) == out[0]["reports"]["last_grad_norm"]
        assert (m.lr is not None) == out[0]["reports"]["last_lr"]
        if m.lr is not None:
            assert m.lr == pytest.approx(1e-3)
        if m.grad_norm is not None:
            assert m.grad_norm > 0
