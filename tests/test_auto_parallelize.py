"""auto_parallelize end to end: a module of one's own (a ModelSpec: named-dim inputs and a loss function),
planned for 4 gloo ranks (dp=2 x pp=2 pinned) and trained in one spawn, gives the losses of
single-process training; eval_step gives the single-process loss after those steps; the
per-step measurements add up. Plus the start-up refusals, which need no processes.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.one_device import train_one_device

from partitioner import Job, ModelSpec, Training
from partitioner.api.auto import check_world_size, choose_plan
from partitioner.errors import ConfigError, InfeasiblePlanError
from partitioner.inputs.models import build_model
from runtime.dist.launch import spawn
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, STEPS, WORLD = 8, 3, 4
FIX = "dp=2,pp=2,schedule=1f1b,num_micro_batches=2,offload=none,checkpointing=none"
ADAMW = {"lr": 1e-3, "eps": 1e-6}  # eps: see test_runtime_parity (noise-level key-bias gradients)


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS + 1)]


def _rank():
    """One rank: a bare module (not a spec string) through auto_parallelize."""
    from partitioner.api.auto import auto_parallelize

    import os

    spec = build_model(GPT)
    if os.environ["RANK"] != "0":  # rank 0's weights are broadcast: perturb the others to prove it
        with torch.no_grad():
            for p in spec.module.parameters():
                p.add_(1.0)
    start = time.perf_counter()
    own = ModelSpec(module=spec.module, inputs=spec.inputs, loss=spec.loss, dims={"seq": 8})
    trainer = auto_parallelize(own, local_cluster(WORLD), training=Training(global_batch=GLOBAL_BATCH, optimizer=ADAMW),
                               fix=FIX, job=Job(timeout_s=30))
    built = time.perf_counter() - start
    batches = _batches(spec)
    losses = [trainer.train_step(b) for b in batches[:STEPS]]
    evaluated = trainer.eval_step(batches[STEPS])
    run = trainer.finish()
    blocks = {s: sorted({n.split(".")[1] for n, _ in st.module.named_parameters() if n.startswith("blocks.")},
                        key=int) for s, st in trainer.model.stages.items()}
    return {"losses": losses, "eval": evaluated, "plan": trainer.plan, "steps": run.steps, "build_s": built,
            "stages": sorted(trainer.model.stages), "blocks": blocks, "notes": trainer.notes}


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    out = spawn(_rank, WORLD, timeout_s=300)
    build = max(r["build_s"] for r in out)
    print(f"\nspawn of {WORLD} ranks: {time.perf_counter() - start:.1f} s, build {build:.1f} s")
    return out


@pytest.fixture(scope="module")
def reference():
    spec = build_model(GPT)
    batches = _batches(spec)
    losses, module = train_one_device(spec, batches[:STEPS], adamw=ADAMW)
    with torch.no_grad():
        evaluated = spec.loss(module, *batches[STEPS]).item()
    return losses, evaluated


def test_losses_equal_single_process_training(distributed, reference):
    ref_losses, ref_eval = reference
    assert len(set(ref_losses)) == STEPS  # training moves: equal losses would prove nothing
    for rank, r in enumerate(distributed):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert r["losses"] == distributed[0]["losses"], "every rank returns the same loss"
        assert r["eval"] == pytest.approx(ref_eval, rel=1e-5), f"rank {rank} eval_step"


def test_plan_is_the_pinned_pipeline_cut_where_the_plan_cuts(distributed):
    plan = distributed[0]["plan"]
    assert (plan.dp, plan.tp, plan.pp, plan.num_micro_batches, plan.schedule) == (2, 1, 2, 2, "1f1b")
    assert [r["stages"] for r in distributed] == [[0], [0], [1], [1]]  # pp index = rank // dp
    for r in distributed:
        assert not any("balancing" in n for n in r["notes"])
        for s, blocks in r["blocks"].items():  # the chain's blocks 1..L are the model's blocks 0..L-1
            (start, stop), = plan.stages[s].layers
            assert [int(b) for b in blocks] == [i - 1 for i in range(max(start, 1), min(stop, 5))]


def test_plan_config_carries_the_plan_stage_split():
    plan = choose_plan(GPT, local_cluster(4), world_size=4, global_batch=GLOBAL_BATCH, fix=FIX)
    (first,), (second,) = (s.layers for s in plan.stages)
    assert plan.config.stage_boundaries == (second[0],) and first == (0, second[0])
    inter = choose_plan(GPT, local_cluster(4), world_size=4, global_batch=GLOBAL_BATCH,
                        fix="dp=2,pp=2,schedule=interleaved,virtual_pp=2,num_micro_batches=2")
    # chunk k of pipeline rank s is virtual stage k*pp + s: the boundaries are its chunks' starts
    starts = {k * 2 + st.index: r[0] for st in inter.stages for k, r in enumerate(st.layers)}
    assert inter.config.stage_boundaries == tuple(starts[v] for v in range(1, 4))


def test_a_stage_without_blocks_is_lowered_as_planned():
    from partitioner.compile.build import capture_for_pipeline, lower_plan
    from passes.ir.config import ParallelConfig

    graph = capture_for_pipeline(build_model(GPT))
    lowering = lower_plan(graph, ParallelConfig(pp=2, stage_boundaries=(1,)), cluster=local_cluster(2), check=False)
    first = {n for n, _ in lowering.programs[(0, 0)].named_parameters()}
    assert first == {"wte.weight", "wpe.weight"}  # the embedding alone: chain index 0
    assert "blocks.0.ln_1.weight" in {n for n, _ in lowering.programs[(1, 0)].named_parameters()}


def test_measurements_add_up(distributed):
    steps = distributed[0]["steps"]
    assert [len(s) for s in steps] == [STEPS] * WORLD
    for rank, per_rank in enumerate(steps):
        for m in per_rank:
            assert m.rank == rank
            parts = m.compute_s + m.recv_wait_s + m.send_wait_s + m.p2p_post_s + m.collective_s + m.optimizer_s
            assert 0 < m.compute_s and parts <= m.wall_s * 1.001
            assert m.other_s == pytest.approx(m.wall_s - parts, abs=1e-6)
            assert list(m.compute_by_stage_s) == [rank // 2]
            # Memory is tracked on the first two steps only (the dispatch mode slows ops).
            assert (m.peak_memory_bytes is not None) == (m.step < 2)
    params = sum(p.numel() * 4 for p in build_model(GPT).module.parameters())
    # Step 1 starts with AdamW state: each rank holds about half the model (one pipeline stage)
    # as parameters, gradients and two moments (~2x the model), plus activations; certainly less
    # than 4 whole models.
    for per_rank in steps:
        assert params < per_rank[1].peak_memory_bytes < 4 * params


# -- refusals at start (no processes) -----------------------------------------------------------

def test_world_size_not_matching_plan_is_refused_with_numbers():
    with pytest.raises(ConfigError, match=r"plan needs 4 ranks \(dp=2 tp=1 pp=2 cp=1\) but the job has 2"):
        choose_plan(GPT, local_cluster(4), world_size=2, global_batch=GLOBAL_BATCH, fix=FIX)


def test_plan_that_fits_no_device_is_infeasible_at_start():
    tiny = local_cluster(4)
    tiny = dataclasses.replace(tiny, device=dataclasses.replace(tiny.device, memory_bytes=64 * 1024))
    with pytest.raises(InfeasiblePlanError, match="no plan fits"):
        choose_plan(GPT, tiny, world_size=4, global_batch=GLOBAL_BATCH)


def test_the_search_offers_only_what_runs():
    from partitioner.api.auto import auto_parallelize
    from partitioner.search.profile import profile_model
    from partitioner.search.search import candidates

    profile = profile_model(GPT, dtype="fp32")
    cands = candidates(profile, local_cluster(4), GLOBAL_BATCH)
    # CPU ranks: offload (to the ranks' own memory) only when pinned
    assert {c.zero_stage for c in cands} == {0, 1, 2, 3} and {c.offload for c in cands} == {"none"}
    pinned = candidates(profile, local_cluster(4), GLOBAL_BATCH, fix={"offload": "optimizer"})
    assert pinned and {c.offload for c in pinned} == {"optimizer"}
    assert not [c for c in pinned if c.zero_stage]  # host AdamW is unsharded
    with pytest.raises(ConfigError, match="no candidate plan.*offload='optimizer'.*zero_stage=1"):
        candidates(profile, local_cluster(4), GLOBAL_BATCH, fix={"offload": "optimizer", "zero_stage": 1, "dp": 4})
    with pytest.raises(ConfigError, match="dtype 'fp8'.*fp32, bf16, fp16"):
        auto_parallelize(GPT, training=Training(global_batch=GLOBAL_BATCH, dtype="fp8"))
    plan = choose_plan(GPT, local_cluster(4), world_size=4, global_batch=GLOBAL_BATCH, fix=FIX)
    check_world_size(plan, 4)
    with pytest.raises(ConfigError, match="the plan trains in fp32, not bf16"):  # before any process work
        auto_parallelize(GPT, training=Training(global_batch=GLOBAL_BATCH, dtype="bf16"), plan=plan)


def test_live_bytes_counts_storages_once_and_frees_them():
    from runtime.observe.measure import LiveBytes

    existing = torch.zeros(1000)  # 4000 bytes live before tracking starts
    mode = LiveBytes([existing])
    with mode:
        a = torch.ones(2000)  # +8000
        view = a[:10]  # shares a's storage: +0
        existing.add_(1)  # in place on a known storage: +0
        b = a * 2  # +8000
        del a  # the view keeps the storage alive
        assert mode.live == 20000
        del view, b
    assert (mode.live, mode.peak) == (4000, 20000)


def test_returned_plan_memory_is_the_replay_and_matches_each_rank_measured(distributed):
    """The plan's own peak (what decided that it fits) is the exact replay of each rank's program,
    and each rank's measured peak (live storages, steps 0 and 1) is within 5% of its number."""
    plan = distributed[0]["plan"]
    assert plan.predicted.memory_model == "replay"
    peaks = plan.predicted.rank_peak_memory_bytes
    assert len(peaks) == WORLD and plan.predicted.peak_memory_bytes == max(peaks)
    for st in plan.stages:  # a stage's peak is the largest of its ranks' (dp replicas are equal)
        assert st.peak_memory_bytes == max(peaks[st.index * 2:(st.index + 1) * 2])
    for rank, per_rank in enumerate(distributed[0]["steps"]):
        measured = max(m.peak_memory_bytes for m in per_rank if m.peak_memory_bytes is not None)
        assert measured == pytest.approx(peaks[rank], rel=0.05), f"rank {rank}: measured {measured}, plan {peaks[rank]}"


@pytest.mark.parametrize("spec", ["gpt:layers=2,hidden=64,heads=4,vocab=500,seq=32",
                                  "hf-gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,seq=32"])
def test_planner_counts_tied_weights_once(spec):
    """The embedding and the LM head share one tensor: the plan's parameter count and model-state
    bytes are the module's own (not the untied copy's, +13% on these models)."""
    from partitioner.inputs.model_spec import meta_copy
    from partitioner.search.profile import profile_spec

    model = build_model(spec)
    own = sum(p.numel() for p in model.module.parameters())  # each tensor once
    names = [n for n, _ in model.module.named_parameters(remove_duplicate=False)]
    assert len(names) > len(dict(model.module.named_parameters()))  # the model does tie weights
    assert profile_spec(meta_copy(model)).param_count == own
    plan = choose_plan(model, local_cluster(1), world_size=1, global_batch=4,
                       fix="dp=1,tp=1,pp=1,offload=none,checkpointing=none")
    memory = plan.stages[0].memory
    assert (memory["parameters"], memory["gradients"], memory["optimizer"]) == (4 * own, 4 * own, 8 * own)
