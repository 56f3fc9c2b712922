"""``checkpointing="tensor"`` on two gloo ranks: the zoo ResNet, the zoo U-Net and Hugging Face BERT
(dropout off) trained at dp=2, and BERT (its MLM head tied to the word embeddings) at pp=2 and at
tp=2 (its collectives kept, never run again) with two micro-batches, through
:func:`partitioner.compile.build.build_parallel_model`:

* three AdamW steps give bit-identical losses and parameters to the same plan without
  checkpointing (the executor runs the same ops on the same values), and the same as one device;
* every rank program really recomputes some of its op outputs (``gm.meta[TENSOR_REMAT_PLAN]``,
  run through ``TensorRematCodeGen``), or the parity proves nothing;
* the memory replay of each rank program (what a returned plan carries as its peak) is within 3%
  of the peak that rank measures (live tensor storages over the steps, AdamW state included),
  and below the peak of the same plan without checkpointing where activations are part of that
  peak (not for BERT at dp=2, whose peak is its model state at the step's end).

BatchNorm (ResNet, U-Net) normalizes over each dp rank's own rows, so the one-device reference
computes the loss as the mean of the per-shard losses (the step dp=2, and pp=2's and tp=2's two
micro-batches of the same rows, take).
"""
from __future__ import annotations

import time

import pytest
import torch

from partitioner.search.memory_check import replay_rank_memory
from passes.ir.config import ParallelConfig
from runtime.dist.launch import spawn
from runtime.optim.optimizers import as_factory
from tests.runtime_cases import packed_graph, unpacked_graph
from tests.test_checkpoint_dag_parity import ADAMW, GLOBAL_BATCH, MODELS, _batches, assert_trains_like_one_device
from partitioner.calibration.job_cluster import local_cluster

POLICIES = ("tensor", "none")
CASES = [("resnet", "dp2"), ("unet", "dp2"), ("hf-bert", "dp2"), ("hf-bert", "pp2"), ("hf-bert", "tp2")]
WORLD, TIMEOUT_S, TOLERANCE = 2, 60.0, 0.03


def _config(layout: str, policy: str) -> ParallelConfig:
    if layout == "dp2":
        return ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=WORLD, checkpointing=policy)
    # two micro-batches: the same rows as the one-device reference's two shards
    axis = {"pp2": "pp", "tp2": "tp"}[layout]
    return ParallelConfig.for_global_batch(GLOBAL_BATCH, num_micro_batches=2, checkpointing=policy, **{axis: WORLD})


def _recomputed(program) -> list[int]:
    """Nodes each stage module of the rank recomputes (0 for a module not lowered under ``tensor``)."""
    from passes.ir.meta import TENSOR_REMAT_PLAN
    from passes.rewrites.tensor_remat import TensorRematCodeGen

    out = []
    for gm in program.modules.values():
        plan = gm.meta.get(TENSOR_REMAT_PLAN)
        runs = isinstance(gm.graph._codegen, TensorRematCodeGen)  # noqa: SLF001
        out.append(len(plan.recomputed) if plan is not None and runs else 0)
    return out


def _run(payloads):
    """On each rank, per (model, layout, policy): per-step losses, trained parameters, the nodes
    each of its stages recomputes, and the peak live bytes over the steps."""
    import runtime.observe.measure as measure
    from partitioner.compile.build import build_parallel_model
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=300)
    meshes = {"dp2": Mesh(WORLD, 1, timeout_s=TIMEOUT_S), "pp2": Mesh(1, WORLD, timeout_s=TIMEOUT_S),
              "tp2": Mesh(1, 1, WORLD, timeout_s=TIMEOUT_S)}
    graphs = {m: unpacked_graph(MODELS[m], p) for m, p in payloads.items()}
    out = {}
    for model, layout in CASES:
        spec, graph = graphs[model]
        for policy in POLICIES:
            torch.distributed.barrier()
            pm = build_parallel_model(graph, _config(layout, policy), meshes[layout], optimizer=as_factory(ADAMW), cluster=local_cluster(meshes[layout].size))
            timer = measure.StepTimer(pm, track_memory=True)
            losses, peak = [], 0
            for k, batch in enumerate(_batches(spec)):
                m = timer.measure(k, lambda: pm.train_step(batch))
                losses.append(m.loss)
                peak = max(peak, m.peak_memory_bytes or 0)
            out[(model, layout, policy)] = {"losses": losses, "params": pm.full_parameters(), "peak": peak,
                                            "recomputed": _recomputed(pm.program)}
    return out


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    payloads = {m: packed_graph(MODELS[m]) for m in sorted({m for m, _ in CASES})}
    results = spawn(_run, WORLD, payloads, timeout_s=900)
    print(f"\nspawn of {WORLD} ranks: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_tensor_plan_recomputes_on_every_stage(distributed, case):
    for rank, r in enumerate(distributed):
        assert all(k > 0 for k in r[(*case, "tensor")]["recomputed"]), (rank, r[(*case, "tensor")]["recomputed"])
        assert not any(r[(*case, "none")]["recomputed"])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_tensor_plan_trains_exactly_like_no_checkpointing(distributed, case):
    for rank, r in enumerate(distributed):
        got, none = r[(*case, "tensor")], r[(*case, "none")]
        assert got["losses"] == none["losses"], rank
        assert got["params"].keys() == none["params"].keys() and got["params"]
        for name, value in got["params"].items():
            assert torch.equal(value, none["params"][name]), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_tensor_plan_trains_like_one_device(distributed, case):
    assert_trains_like_one_device(case[0], [r[(*case, "tensor")] for r in distributed])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_replayed_peak_matches_each_rank_measured(distributed, case):
    model, layout = case
    graph = unpacked_graph(MODELS[model], packed_graph(MODELS[model]))[1]
    replayed = {p: replay_rank_memory(graph, _config(layout, p), local_cluster(WORLD)) for p in POLICIES}
    rows = []
    for rank, r in enumerate(distributed):
        got, predicted = r[(*case, "tensor")]["peak"], replayed["tensor"][rank].peak_bytes
        rows.append(f"rank {rank}: replay {predicted} ({replayed['tensor'][rank].where}), measured {got} "
                    f"({(predicted - got) / got:+.2%}); without checkpointing measured {r[(*case, 'none')]['peak']}")
    print(f"\n{'-'.join(case)}\n  " + "\n  ".join(rows))
    for rank, r in enumerate(distributed):
        assert replayed["tensor"][rank].peak_bytes == pytest.approx(r[(*case, "tensor")]["peak"], rel=TOLERANCE), \
            rows[rank]
        if replayed["none"][rank].parts["activations"]:  # activations are part of the peak: the policy lowers it
            assert replayed["tensor"][rank].peak_bytes < replayed["none"][rank].peak_bytes, rows[rank]
            assert r[(*case, "tensor")]["peak"] < r[(*case, "none")]["peak"], rows[rank]
        else:  # the peak is the model state at the step's end (tiny BERT at dp=2): the same with the policy
            assert replayed["tensor"][rank].peak_bytes == replayed["none"][rank].peak_bytes, rows[rank]
