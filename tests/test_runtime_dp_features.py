"""Data-parallel runtime features on gloo (one spawn of 4 CPU ranks): gradient buckets overlapped
with backward, ZeRO-1 and ZeRO-2, against single-process AdamW training (16-bit training:
tests/test_mixed_precision.py).

* overlap on/off at dp=2 and (dp, pp)=(2, 2): same losses, parameters and synced gradients as one
  process (rtol 1e-5); with overlap a bucket's all-reduce starts inside the last backward action.
* ZeRO-1 and ZeRO-2 at dp=2, dp=4 and (dp, pp)=(2, 2): same losses, parameters and (all-gathered)
  averaged gradients; after the step a rank holds 1/dp of the optimizer state and of the
  gradients. Gradient bytes are measured after EVERY backward action: under ZeRO-2 at most 1/dp
  of the full gradients plus the buckets in flight, under ZeRO-1 the full gradients.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from partitioner.inputs.models import build_model
from runtime.dist.launch import spawn
from tests.one_device import train_one_device
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, STEPS, WORLD = 16, 3, 4
ADAMW = {"lr": 1e-3, "eps": 1e-6}  # eps=1e-6: see tests/test_runtime_parity.py
TIMEOUT_S = 20.0
BUCKET_BYTES = 16 * 2**10  # several buckets for this tiny model, so overlap has something to overlap


@dataclass(frozen=True)
class Case:
    dp: int
    pp: int
    m: int
    zero: int = 0
    overlap: bool = True

    @property
    def id(self) -> str:
        return f"dp{self.dp}-pp{self.pp}-m{self.m}-zero{self.zero}-{'overlap' if self.overlap else 'serial'}"


CASES = [
    Case(2, 1, 2), Case(2, 1, 2, overlap=False),
    Case(2, 2, 2), Case(2, 2, 2, overlap=False),
    Case(2, 1, 2, zero=2), Case(4, 1, 4, zero=2), Case(2, 2, 4, zero=2), Case(2, 1, 4, zero=2, overlap=False),
    Case(4, 1, 4, zero=1),
]


def _record_gradient_bytes(model) -> list[int]:
    """Wrap the executor's backward action: after each one, append the gradient bytes the rank
    holds (every ``p.grad``, plus what the dp sync holds: ZeRO chunks and buckets in flight)."""
    held: list[int] = []
    backward = model.executor._backward

    def measured(action):
        backward(action)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.params if p.grad is not None)
        held.append(grads + model.grad_buckets.held_bytes())

    model.executor._backward = measured
    return held


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _train_cases(cases, payload):
    """On each rank: every case's results. ``payload``: the model's graph, captured once by the test process."""
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=200)
    spec, graph = unpacked_graph(GPT, payload)
    batches = _batches(spec)
    meshes = [Mesh(c.dp, c.pp, timeout_s=TIMEOUT_S) for c in cases]
    out = {}
    for case, mesh in zip(cases, meshes):
        torch.distributed.barrier()
        if not mesh.active:
            continue
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=case.dp, pp=case.pp, schedule="1f1b",
                                                 num_micro_batches=case.m, zero_stage=case.zero)
        model = build_parallel_model(graph, config, mesh, optimizer=ADAMW, bucket_bytes=BUCKET_BYTES,
                                     overlap_grad_sync=case.overlap, cluster=local_cluster(mesh.size))
        held_after_backward = _record_gradient_bytes(model)
        start = time.perf_counter()
        losses = [model.train_step(b) for b in batches]
        named = model.named_parameters()
        total_numel = sum(p.numel() for p in model.params)
        result = {"losses": losses, "train_s": time.perf_counter() - start,
                  "params": {n: p.detach().clone() for n, p in named.items()},
                  "grads": {n: None if p.grad is None else p.grad.clone() for n, p in named.items()},
                  "synced_grads": {n: g.clone() for n, g in model.synced_gradients().items()},
                  "held_after_backward": held_after_backward[-case.m:],  # the last step's micro-batches
                  "max_bucket_bytes": max(b.numel for b in model.grad_buckets.buckets) * 4,
                  "param_bytes": total_numel * 4, "buckets": len(model.grad_buckets.buckets)}
        if case.zero:
            result["state_bytes"] = model.optimizer.state_bytes()
            result["grad_bytes"] = model.optimizer.grad_bytes()
        # Backward of the last step: when each backward action ended and when each bucket started.
        result["backward_done_s"] = dict(model.executor.backward_done_s)
        result["launches"] = [(e.bucket, e.time_s, e.from_hook) for e in model.grad_buckets.last_events]
        out[case.id] = result
    return out


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(_train_cases, WORLD, CASES, packed_graph(GPT), timeout_s=240)
    print(f"\nspawn of {WORLD} ranks, {len(CASES)} cases: {time.perf_counter() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def reference():
    spec = build_model(GPT)
    return train_one_device(spec, _batches(spec), adamw=ADAMW)


def _ranks(distributed, case):
    return [r[case.id] for r in distributed[:case.dp * case.pp]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_same_losses_and_parameters_as_one_device(distributed, reference, case):
    ref_losses, ref_model = reference
    covered = set()
    for rank, result in enumerate(_ranks(distributed, case)):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert result["buckets"] > 1  # the tiny model still exercises several buckets
        for name, value in result["params"].items():
            expected = ref_model.get_parameter(name)
            torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
            covered.add(id(expected))
            if case.zero:
                assert result["grads"][name] is None, f"ZeRO must free the full gradient of {name}"
            # AdamW is scale invariant: check the synced gradients as well (ZeRO: all-gathered)
            torch.testing.assert_close(result["synced_grads"][name], expected.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {rank} grad of {name}: {m}")
    assert {id(p) for p in ref_model.parameters()} <= covered


@pytest.mark.parametrize("case", [c for c in CASES if c.overlap and c.zero == 0], ids=lambda c: c.id)
def test_overlap_starts_buckets_inside_the_last_backward(distributed, case):
    for rank, result in enumerate(_ranks(distributed, case)):
        last_backward_end = max(result["backward_done_s"].values())
        hooked = [t for _, t, from_hook in result["launches"] if from_hook]
        assert hooked, f"rank {rank}: no bucket was started by a backward hook"
        assert min(hooked) < last_backward_end, f"rank {rank}: first bucket started after backward ended"
        # the first micro-batch's backward must not trigger (only the last accumulation counts)
        first_mb_end = min(result["backward_done_s"].values())
        assert min(hooked) > first_mb_end, f"rank {rank}: a bucket started before its last accumulation"


def test_serial_path_starts_buckets_after_backward(distributed):
    for result in _ranks(distributed, Case(2, 1, 2, overlap=False)):
        last_backward_end = max(result["backward_done_s"].values())
        assert all(not hook and t > last_backward_end for _, t, hook in result["launches"])


@pytest.mark.parametrize("case", [c for c in CASES if c.zero], ids=lambda c: c.id)
def test_zero_holds_one_dp_th_of_state_and_gradients(distributed, case):
    for result in _ranks(distributed, case):
        full = result["param_bytes"]
        padding = result["buckets"] * case.dp * 4  # each bucket padded by < dp fp32 elements
        assert abs(result["grad_bytes"] - full / case.dp) <= padding, (result["grad_bytes"], full, case.dp)
        # two moments (exp_avg, exp_avg_sq) per element of the shard
        assert abs(result["state_bytes"] - 2 * full / case.dp) <= 2 * padding, (result["state_bytes"], full)


@pytest.mark.parametrize("case", [c for c in CASES if c.zero == 2], ids=lambda c: c.id)
def test_zero2_holds_sharded_gradients_during_backward(distributed, case):
    """After every backward of a step (not only after the sync), a ZeRO-2 rank holds its fp32
    chunks (1/dp of the padded gradients) plus at most two buckets in flight, never the full
    gradients of its stage."""
    for rank, result in enumerate(_ranks(distributed, case)):
        full, padding = result["param_bytes"], result["buckets"] * case.dp * 4
        bound = full / case.dp + padding + 2 * result["max_bucket_bytes"]
        assert bound < full  # the bound says something: the tiny model has many small buckets
        assert len(result["held_after_backward"]) == case.m
        for k, held in enumerate(result["held_after_backward"]):
            assert held <= bound, f"rank {rank}, backward {k}: {held} gradient bytes > {bound:.0f} ({full} full)"
        assert max(result["held_after_backward"]) > 0


def test_zero1_keeps_full_gradients_through_accumulation(distributed):
    """ZeRO-1 reduce-scatters once, after the last accumulation: the earlier backwards hold every
    gradient of the rank in full (what the planner counts for it)."""
    case = Case(4, 1, 4, zero=1)
    for rank, result in enumerate(_ranks(distributed, case)):
        for k, held in enumerate(result["held_after_backward"][:-1]):
            assert held >= result["param_bytes"], f"rank {rank}, backward {k}: {held} < {result['param_bytes']}"
