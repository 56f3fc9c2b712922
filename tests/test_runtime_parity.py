"""Runtime parity: dp x pp training on gloo (4 CPU processes) gives the losses and final parameters
of single-process training of the same model, for every schedule; a failing rank ends the job
with its name, without hanging.

One spawn of 4 ranks runs every plan case (each case builds its own mesh of groups on the first
dp*pp ranks), because starting gloo processes is the slow part.
"""
from __future__ import annotations

import time

import pytest
import torch

from partitioner.inputs.models import build_model
from runtime.dist.launch import LaunchError, spawn
from tests.one_device import train_one_device
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, STEPS, WORLD = 16, 3, 4
# eps=1e-6, not AdamW's 1e-8: the key bias of attention has a gradient that is zero in exact
# arithmetic (softmax is shift invariant) and ~1e-10 of rounding noise in practice, which Adam
# with eps=1e-8 turns into updates of ~lr/100 whose sign depends on the summation order.
ADAMW = {"lr": 1e-3, "eps": 1e-6}
TIMEOUT_S = 20.0

# (dp, pp, schedule, virtual_pp, micro-batches, zero)
CASES = [
    (2, 1, "gpipe", 1, 2, False),
    (1, 1, "interleaved", 2, 2, False),  # two stages on one rank: in-memory hand-off
    (1, 2, "gpipe", 1, 4, False),
    (1, 2, "1f1b", 1, 4, False),
    (1, 2, "interleaved", 2, 4, False),
    (1, 4, "gpipe", 1, 4, False),
    (1, 4, "1f1b", 1, 4, False),
    (2, 2, "gpipe", 1, 2, False),
    (2, 2, "1f1b", 1, 2, False),
    (2, 2, "interleaved", 2, 2, False),
    (2, 2, "1f1b", 1, 2, True),
    (2, 1, "gpipe", 1, 2, True),
]


def _case_id(case) -> str:
    dp, pp, schedule, v, m, zero = case
    return f"dp{dp}-pp{pp}-{schedule}-v{v}-m{m}" + ("-zero1" if zero else "")


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _train_cases(cases, payload):
    """On each rank: every case's per-step losses and this rank's final parameters. ``payload``:
    the model's graph, captured once by the test process (``packed_graph``)."""
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    # The world group only paces the cases (a barrier each), so it may wait long on this shared
    # machine; the meshes' groups, where training happens, keep the short timeout.
    init_distributed(timeout_s=200)

    spec, graph = unpacked_graph(GPT, payload)  # each case deep-copies it
    batches = _batches(spec)
    # Every rank builds every case's groups first: a rank outside a case's mesh would otherwise
    # wait in the next case's group creation while the others train, and time out.
    meshes = [Mesh(case[0], case[1], timeout_s=TIMEOUT_S) for case in cases]
    out = {}
    for case, mesh in zip(cases, meshes):
        dp, pp, schedule, v, m, zero = case
        torch.distributed.barrier()  # ranks outside the last case's mesh wait for it to end
        if not mesh.active:
            continue
        start = time.perf_counter()
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=dp, pp=pp, schedule=schedule, num_micro_batches=m,
                                                 virtual_pp=v, zero_stage=int(zero))
        model = build_parallel_model(graph, config, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
        built = time.perf_counter()
        losses = [model.train_step(b) for b in batches]
        params = {name: p.detach().clone() for name, p in model.named_parameters().items()}
        grads = {name: g.clone() for name, g in model.synced_gradients().items()}  # last step's, dp-averaged
        state = model.optimizer.state_bytes() if zero else sum(
            t.numel() * t.element_size() for st in model.optimizer.state.values() for t in st.values() if t.dim())
        out[_case_id(case)] = {"losses": losses, "params": params, "grads": grads, "build_s": built - start,
                               "train_s": time.perf_counter() - built, "optimizer_state_bytes": state,
                               "coords": (mesh.pp_index, mesh.dp_index, mesh.pp_ranks, mesh.dp_ranks, mesh.ends_ranks)}
    return out


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(_train_cases, WORLD, CASES, packed_graph(GPT), timeout_s=240)
    print(f"\nspawn of {WORLD} ranks, {len(CASES)} cases: {time.perf_counter() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def reference():
    """Single-process AdamW training: per-step losses and the final module."""
    spec = build_model(GPT)
    return train_one_device(spec, _batches(spec), adamw=ADAMW)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_same_losses_and_parameters_as_one_device(distributed, reference, case):
    ref_losses, ref_model = reference
    key = _case_id(case)
    dp, pp = case[0], case[1]
    ranks = [r[key] for r in distributed[:dp * pp]]
    for rank, result in enumerate(ranks):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert result["losses"] == ranks[0]["losses"], "every rank must return the same loss"
    # Training moved the weights (by ~lr per step): parity of untouched weights would prove nothing.
    initial = build_model(GPT).module
    moved = max((p - initial.get_parameter(n)).abs().max().item() for n, p in ref_model.named_parameters())
    assert moved > 1e-3

    covered = set()
    for rank, result in enumerate(ranks):
        for name, value in result["params"].items():
            expected = ref_model.get_parameter(name)  # a tied weight under any of its names
            torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
            covered.add(id(expected))
            # AdamW hides a wrong gradient scale (its update is scale invariant): check the
            # last step's synced gradients too (loss scaling, dp average, tied-weight sum). A wrong
            # scale is off by >= 1/(dp*m); float32 sums in another order are off by ~1e-5 of the
            # largest entry on an element that cancels (seen: 1.2e-7 on an element of 1.4e-3 of the
            # position table, two stages on one rank), as in tests/test_runtime_property.py.
            g = expected.grad
            torch.testing.assert_close(result["grads"][name], g, rtol=1e-5, atol=1e-4 * g.abs().max().item() + 1e-8,
                                       msg=lambda m: f"rank {rank} grad of {name}: {m}")
    missing = [n for n, p in ref_model.named_parameters() if id(p) not in covered]
    assert not missing, f"no rank holds {missing}"
    print(f"{key}: build {max(r['build_s'] for r in ranks):.2f} s, 3 steps {max(r['train_s'] for r in ranks):.2f} s")


def test_mesh_layout_tp_fastest_then_dp_then_pp(distributed):
    coords = [r["dp2-pp2-gpipe-v1-m2"]["coords"] for r in distributed]
    #          (pp_index, dp_index, pp_ranks, dp_ranks, ends_ranks)
    assert coords == [(0, 0, (0, 2), (0, 1), (0, 2)), (0, 1, (1, 3), (0, 1), (1, 3)),
                      (1, 0, (0, 2), (2, 3), (0, 2)), (1, 1, (1, 3), (2, 3), (1, 3))]
    assert distributed[3]["dp1-pp4-1f1b-v1-m4"]["coords"][4] == (0, 3)


def test_zero1_shards_optimizer_state_over_dp(distributed):
    plain = distributed[0]["dp2-pp2-1f1b-v1-m2"]["optimizer_state_bytes"]
    sharded = [r["dp2-pp2-1f1b-v1-m2-zero1"]["optimizer_state_bytes"] for r in distributed[:2]]
    # Two moments per parameter element; each of the 2 dp ranks keeps half (+ < dp elements of padding).
    assert all(abs(s - plain / 2) <= 2 * 4 * 2 for s in sharded), (plain, sharded)


def _fail_on_rank_one():
    from runtime.dist.mesh import Mesh

    mesh = Mesh(1, 2, timeout_s=TIMEOUT_S)
    if mesh.rank == 1:
        raise ValueError("boom from the test")
    torch.distributed.all_reduce(torch.ones(1), group=mesh.group)  # waits for rank 1 forever
    return "unreachable"


def test_failing_rank_is_named_without_hanging():
    start = time.perf_counter()
    with pytest.raises(LaunchError, match=r"rank 1 of 2 raised ValueError: boom from the test"):
        spawn(_fail_on_rank_one, 2, timeout_s=60)
    # Far below both the spawn timeout and the gloo timeout: rank 0 was killed, not waited for.
    assert time.perf_counter() - start < TIMEOUT_S
