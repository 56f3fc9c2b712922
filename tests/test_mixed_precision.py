"""16-bit training end to end: ``auto_parallelize(training=Training(dtype="bf16"/"fp16"))`` on 4 gloo ranks (one
spawn) trains 16-bit parameters, gradients and activations with fp32 master weights, and its
masters match plain eager mixed precision on one process (tests/one_device.py).

The check is on the fp32 masters after a few steps: ``deviation = |masters - reference| /
|reference - initial|`` (global L2 norms). A run that did not train (lr = 0) has deviation 1
exactly, so the bound below is one such a run cannot meet; the same run is put through the
"parameters moved" check and must fail it.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from partitioner.inputs.models import build_model
from runtime.dist.launch import spawn
from tests.one_device import train_one_device_16bit
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, STEPS, WORLD = 8, 4, 4
ADAMW = {"lr": 1e-3, "eps": 1e-6}
MAX_DEVIATION = 0.1
FP16_SCALE = 2.0 ** 8
"""fp16's initial loss scale in the parity case: small enough that no step of this model overflows
(which step overflows depends on how the plan sums the gradients, so the reference could skip
others); the overflow path has its own case, whose 2**24 overflows every step here."""
"""Largest |masters - reference| / |reference - initial| a 16-bit plan may show (lr = 0: 1.0)."""


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    fix: str
    lr: float = ADAMW["lr"]
    loss_scale: float | None = None  # fp16: the initial dynamic loss scale

    @property
    def id(self) -> str:
        return (f"{self.dtype}-{self.fix.replace(',', '-').replace('=', '')}" + ("-lr0" if self.lr == 0 else "")
                + (f"-scale{self.loss_scale:g}" if self.loss_scale else ""))


PLAN = "schedule=1f1b,num_micro_batches=2,checkpointing=none,offload=none,sequence_parallel=false"
CASES = [
    Case("bf16", f"dp=2,pp=2,tp=1,zero_stage=0,{PLAN}"),
    Case("bf16", "dp=2,tp=2,pp=1,zero_stage=2,schedule=1f1b,num_micro_batches=2,checkpointing=none,offload=none"),
    Case("bf16", "dp=2,pp=2,tp=1,zero_stage=0,schedule=1f1b,num_micro_batches=2,checkpointing=full,offload=optimizer"),
    Case("fp16", f"dp=2,pp=2,tp=1,zero_stage=1,{PLAN}", loss_scale=FP16_SCALE),
    Case("fp16", f"dp=2,pp=2,tp=1,zero_stage=0,{PLAN}", loss_scale=2.0 ** 24),
    Case("bf16", f"dp=2,pp=2,tp=1,zero_stage=0,{PLAN}", lr=0.0),
]
TRAINED = [c for c in CASES if c.lr > 0 and c.loss_scale != 2.0 ** 24]
OVERFLOWING = next(c for c in CASES if c.loss_scale == 2.0 ** 24)
CONTROL = next(c for c in CASES if c.lr == 0)


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _rank(checkpoint: str):
    from partitioner import Job, Training
    from partitioner.api.auto import auto_parallelize

    out = {}
    for k, case in enumerate(CASES):
        spec = build_model(GPT)
        training = Training(global_batch=GLOBAL_BATCH, optimizer={**ADAMW, "lr": case.lr}, dtype=case.dtype)
        trainer = auto_parallelize(GPT, local_cluster(WORLD), training=training, fix=case.fix, job=Job(timeout_s=60))
        pm = trainer.model
        if case.loss_scale is not None:
            pm.loss_scaler.scale = case.loss_scale
        if k == 1:  # the first plan's checkpoint, loaded under another plan (ZeRO-2, tp=2)
            trainer.load(checkpoint)
            out["loaded"] = pm.full_master_parameters()
            # a fresh trainer of the same plan (the search already ran for it: no second one)
            trainer = auto_parallelize(GPT, local_cluster(WORLD), training=training, plan=trainer.plan,
                                       job=Job(timeout_s=60))
            pm = trainer.model
        initial = {n: p.detach().float().clone() for n, p in pm.full_master_parameters().items()}
        losses = [trainer.train_step(b) for b in _batches(spec)]
        if k == 0:
            trainer.save(checkpoint)
        tracked = [m.peak_memory_bytes for m in trainer.timer.steps if m.peak_memory_bytes is not None]
        out[case.id] = {
            "measured_peak": max(tracked), "planned_peak": trainer.plan.predicted.rank_peak_memory_bytes[pm.mesh.rank],
            "memory_model": trainer.plan.predicted.memory_model,
            "losses": losses, "initial": initial, "masters": pm.full_master_parameters(),
            "param_dtypes": sorted({str(p.dtype) for p in pm.params}),
            "boundary_dtypes": sorted({str(i.meta.dtype) for io in pm.program.io for i in io.inputs
                                       if i.kind == "recv" and i.meta.dtype.is_floating_point}),
            "optimizer": type(pm.optimizer).__name__, "summary": trainer.plan.summary(),
            "skipped": pm.loss_scaler.skipped if pm.loss_scaler is not None else None,
            "scale": pm.loss_scaler.scale if pm.loss_scaler is not None else None,
        }
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bf16-checkpoint"))


@pytest.fixture(scope="module")
def distributed(checkpoint):
    start = time.perf_counter()
    results = spawn(_rank, WORLD, checkpoint, timeout_s=600)
    print(f"\nspawn of {WORLD} ranks, {len(CASES)} plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def references():
    out = {}
    for dtype in sorted({c.dtype for c in CASES}):
        spec = build_model(GPT)
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        initial = {n: p.detach().to(torch_dtype).float() for n, p in spec.module.named_parameters()}
        losses, masters = train_one_device_16bit(spec, _batches(spec), adamw=ADAMW, dtype=torch_dtype,
                                                 loss_scale=FP16_SCALE if dtype == "fp16" else None)
        out[dtype] = {"losses": losses, "masters": masters, "initial": initial}
    return out


def _norm(tensors) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def deviation(masters: dict, reference: dict) -> float:
    """|masters - reference masters| / |reference masters - initial| over the parameters this
    rank holds (a pipeline stage's)."""
    ref, init = reference["masters"], reference["initial"]
    names = [n for n in masters if n in ref]
    assert names, f"no parameter names in common with the reference: {sorted(masters)[:4]}"
    return _norm(masters[n].float() - ref[n] for n in names) / _norm(ref[n] - init[n] for n in names)


def check_trained_16bit(result: dict, reference: dict, dtype: str) -> None:
    """What a 16-bit run must show: 16-bit parameters and boundary activations, fp32 masters that
    moved from their start and that match the one-process reference."""
    want = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    assert result["param_dtypes"] == [want]
    assert result["boundary_dtypes"] in ([], [want])
    assert all(m.dtype == torch.float32 for m in result["masters"].values()), "master weights must be fp32"
    names = [n for n in result["masters"] if n in reference["masters"]]
    moved = _norm(result["masters"][n] - result["initial"][n] for n in names)
    assert moved > 0.5 * _norm(reference["masters"][n] - reference["initial"][n] for n in names), \
        "the parameters did not move"
    assert deviation(result["masters"], reference) < MAX_DEVIATION


@pytest.mark.parametrize("case", TRAINED, ids=lambda c: c.id)
def test_16bit_plan_trains_like_one_process_mixed_precision(distributed, references, case):
    for rank, result in enumerate(distributed):
        r = result[case.id]
        print(f"{case.id} rank {rank}: deviation {deviation(r['masters'], references[case.dtype]):.4f}, "
              f"{r['optimizer']}, losses {r['losses']}")
        check_trained_16bit(r, references[case.dtype], case.dtype)
        assert r["summary"].endswith(f"{case.dtype}") or f" {case.dtype}:" in r["summary"]


@pytest.mark.parametrize("case", TRAINED, ids=lambda c: c.id)
def test_16bit_plan_memory_is_each_rank_measured_peak(distributed, case):
    """The plan's returned per-rank peak (the replay of the 16-bit rank programs: 2-byte
    parameters, gradients and activations, fp32 masters and moments) against each rank's measured
    peak of live storages: within 5%."""
    for rank, result in enumerate(distributed):
        r = result[case.id]
        print(f"{case.id} rank {rank}: measured {r['measured_peak']} planned {r['planned_peak']:.0f} "
              f"({r['measured_peak'] / r['planned_peak'] - 1:+.1%})")
        assert r["memory_model"] == "replay"
        assert r["measured_peak"] == pytest.approx(r["planned_peak"], rel=0.05), f"rank {rank}"


def test_a_run_that_does_not_train_fails_the_check(distributed, references):
    """The negative control: lr = 0 keeps the masters at their start (deviation 1.0), and the
    check above refuses it."""
    for result in distributed:
        r = result[CONTROL.id]
        assert deviation(r["masters"], references["bf16"]) == pytest.approx(1.0, abs=1e-6)
        with pytest.raises(AssertionError):
            check_trained_16bit(r, references["bf16"], "bf16")


def test_fp16_parity_case_skipped_no_step(distributed):
    case = next(c for c in TRAINED if c.dtype == "fp16")
    assert [r[case.id]["skipped"] for r in distributed] == [0] * WORLD


def test_fp16_overflow_skips_the_step_on_every_rank(distributed):
    """A loss scale that overflows fp16 (2**24 times a loss of about 4, every step): every rank
    skips every step, the masters stay finite and where they started, and the scale backs off."""
    for result in distributed:
        r = result[OVERFLOWING.id]
        assert r["skipped"] == STEPS
        for n, m in r["masters"].items():
            assert torch.equal(m, r["initial"][n]), n
        assert r["scale"] == OVERFLOWING.loss_scale / 2 ** STEPS


def test_16bit_checkpoint_holds_the_fp32_masters(distributed, checkpoint):
    """A bf16 plan's checkpoint holds its fp32 master weights under the original names: loaded
    under another bf16 plan (dp=2 x tp=2, ZeRO-2: the masters are dp chunks there) and into the
    plain fp32 model, every weight is the saving plan's master, bit for bit."""
    from runtime.checkpoint.directory import latest_checkpoint
    from runtime.checkpoint.io import load_into_module

    saved = {}
    for result in distributed:
        saved.update(result[CASES[0].id]["masters"])
    module = build_model(GPT).module
    load_into_module(module, latest_checkpoint(checkpoint))
    plain = dict(module.named_parameters())
    for name, master in saved.items():
        if name in plain:
            assert torch.equal(plain[name], master), name
    for rank, result in enumerate(distributed):
        for name, loaded in result["loaded"].items():
            assert torch.equal(loaded, saved[name]), f"rank {rank}: {name}"
