"""ZeRO-3 on gloo: parameters sharded over dp, gathered per block (and again in backward, or kept
from the forward with reshard_after_forward=False), their gradients reduce-scattered into the
shards; alone, with tp=2, with pp=2, with full checkpointing, for a GPT, a Llama (GQA, untied) and a Hugging Face GPT-2 (tied embedding and LM
head on the first and last stage). Every plan trains like one device: the same losses, clipped
gradient norms, parameters and gradients after three AdamW steps (fp32, rtol 1e-5).

Also, per rank: the parameters and the optimizer state it holds are its 1/dp shards; the gathers
it issued are those the schedule says (one per site in forward, one per re-gathered site in
backward, per micro-batch); with prefetch off the numbers are the same.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from runtime.dist.launch import spawn
from tests import runtime_cases
from tests.runtime_cases import Plan, payloads_for, reference
from partitioner.calibration.job_cluster import local_cluster

LLAMA = "llama:layers=4,hidden=32,heads=4,kv_heads=2,vocab=64,seq=8"
WORLD = 4


def _plan(model, dp, tp=1, pp=1, m=2, ckpt="none", batch=8, keep=False) -> Plan:
    return Plan(model, dp, tp, pp, "1f1b", 1, m, batch, 3, ckpt, "none", reshard=not keep)


PLANS = [
    _plan("gpt", 2), _plan("gpt", 4, m=1), _plan("gpt", 2, tp=2, m=1), _plan("gpt", 2, pp=2),
    _plan("gpt", 2, m=1, ckpt="full"), _plan("gpt", 2, pp=2, ckpt="full"),
    _plan("llama", 2), _plan("llama", 2, tp=2, m=1), _plan("llama", 2, pp=2, ckpt="full"),
    _plan("hf-gpt2", 2), _plan("hf-gpt2", 2, pp=2), _plan("hf-gpt2", 2, tp=2, m=1),
    # reshard_after_forward=False: the forward's gathers kept for backward (and for the next
    # micro-batch's forward while 1F1B holds them)
    _plan("gpt", 2, pp=2, m=4, keep=True), _plan("gpt", 2, m=1, ckpt="full", keep=True),
    _plan("llama", 2, tp=2, m=1, keep=True), _plan("hf-gpt2", 2, pp=2, keep=True),
]
NO_PREFETCH = _plan("gpt", 2, pp=2)


def _with_llama() -> None:
    runtime_cases.MODELS.setdefault("llama", LLAMA)


def _train(plans, payloads):
    _with_llama()
    return runtime_cases.train_plans(plans, payloads)


def _states(plan: Plan, payload) -> dict:
    """One rank's view of a ZeRO-3 plan after two steps, with prefetch and without (each model its
    own group names), and of the same model under ZeRO-0 on pp=2 (ranks 0 and 1): parameter and
    optimizer-state elements, gathers issued, the sites, the losses."""
    from partitioner.compile.build import build_parallel_model
    from runtime.observe.measure import StepTimer
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=300)
    spec, graph = runtime_cases.unpacked_graph(runtime_cases.MODELS[plan.model], payload)
    batches = runtime_cases.batches(spec, plan.global_batch)
    mesh = Mesh(plan.dp, plan.pp, plan.tp, timeout_s=runtime_cases.TIMEOUT_S)
    plain = Mesh(1, 2, 1, timeout_s=runtime_cases.TIMEOUT_S)
    out = {}
    for prefetch, key in ((1, "prefetch"), (0, "none")):
        pm = build_parallel_model(graph, plan.config(), mesh, optimizer=runtime_cases.ADAMW, zero3_prefetch=prefetch,
                                  tp_group=f"tp{prefetch}", cluster=local_cluster(mesh.size))
        losses = [pm.train_step(b) for b in batches[:2]]
        state = sum(t.numel() for s in pm.torch_optimizer.state.values() for t in s.values() if t.dim() > 0)
        g = pm.zero3
        forward = sum(len(order) for order in g.schedule.forward_order.values())
        backward = sum(len(order) for order in g.schedule.backward_order.values())
        issued = g.issued
        # a third step, timed: the collectives each rank records for the report's ZeRO-3 timeline
        timed = StepTimer(pm, track_memory=False).measure(2, lambda: pm.train_step(batches[2]))
        out[key] = {"param_elems": sum(p.numel() for p in pm.params), "state_elems": state, "issued": issued,
                    "sites": (forward, backward), "losses": losses, "step_issued": g.issued - issued,
                    "timed": {"rank": mesh.rank, "step": 2, "timeline": timed.timeline,
                              "started_at": timed.started_at, "collectives": timed.collectives}}
    torch.distributed.barrier()
    if plain.active:
        pm = build_parallel_model(graph, plan.config().replace(dp=1, zero_stage=0, micro_batch_size=4), plain,
                                  optimizer=runtime_cases.ADAMW, cluster=local_cluster(plain.size))
        pm.train_step(batches[0])
        state = sum(t.numel() for s in pm.torch_optimizer.state.values() for t in s.values() if t.dim() > 0)
        out["zero0"] = {"param_elems": sum(p.numel() for p in pm.params), "state_elems": state}
    return out


@pytest.fixture(scope="module")
def distributed():
    _with_llama()
    start = time.perf_counter()
    results = spawn(_train, WORLD, PLANS, payloads_for(PLANS), timeout_s=900)
    print(f"\nspawn of {WORLD} ranks: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_zero3_plan_trains_like_one_device(distributed, plan):
    _with_llama()
    ref = reference(plan.model, plan.global_batch)
    for rank in range(plan.size):
        covered = _check_like_one_device(distributed[rank][plan.id], ref, f"rank {rank}")
        if plan.pp == 1:
            assert covered == {id(p) for p in ref[1].parameters()}


def _check_like_one_device(r: dict, ref, where: str) -> set[int]:
    """One rank's losses, clipped norms, parameters and gradients against the single-device
    ``ref`` (:func:`tests.runtime_cases.reference`); returns the reference parameters covered."""
    ref_losses, ref_module, ref_norms, _ = ref
    assert "error" not in r, r.get("error")
    assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), where
    assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), where
    covered = set()
    for name, value in r["params"].items():
        expected = ref_module.get_parameter(name)
        torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} {name}: {m}")
        torch.testing.assert_close(r["grads"][name], expected.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{where} grad {name}: {m}")
        covered.add(id(expected))
    return covered


@pytest.fixture(scope="module")
def sharded_state():
    results = spawn(_states, NO_PREFETCH.size, NO_PREFETCH, runtime_cases.packed_graph(runtime_cases.MODELS["gpt"]),
                    timeout_s=300)
    return {key: [r.get(key) for r in results] for key in ("prefetch", "none", "zero0")}


@pytest.mark.slow
def test_each_rank_holds_its_shard_of_the_parameters_and_optimizer_state(sharded_state):
    # NO_PREFETCH is dp=2 x pp=2 on 4 ranks: ranks 0, 1 hold stage 0 (dp peers); zero0 is pp=2 on 2 ranks
    zero3, zero0 = sharded_state["prefetch"], sharded_state["zero0"]
    full_stage0 = zero0[0]["param_elems"]
    for rank in (0, 1):
        assert zero3[rank]["param_elems"] <= math.ceil(full_stage0 / 2) + 64  # padding: < dp per parameter
        assert zero3[rank]["param_elems"] >= full_stage0 / 2
        assert zero3[rank]["state_elems"] == 2 * zero3[rank]["param_elems"]  # AdamW: exp_avg, exp_avg_sq
    assert zero0[0]["state_elems"] == 2 * full_stage0


@pytest.mark.slow
def test_gathers_follow_the_schedule_with_and_without_prefetch(sharded_state):
    for key in ("prefetch", "none"):
        for r in sharded_state[key][:2]:
            forward, backward = r["sites"]
            steps, m = 2, NO_PREFETCH.num_micro_batches
            assert backward >= 1
            # every site once per forward, every re-gathered site once per backward, per micro-batch
            assert r["issued"] == steps * m * (forward + backward), key
    assert sharded_state["prefetch"][0]["losses"] == sharded_state["none"][0]["losses"]


@pytest.mark.slow
def test_each_rank_times_its_gathers_and_reduce_scatters_and_the_report_draws_them(sharded_state):
    from types import SimpleNamespace

    from ir_dumps.report import render_report
    from partitioner.cost.cluster import Cluster
    from tests.test_report import parse, synthetic_plan

    for key in ("prefetch", "none"):
        for r in sharded_state[key]:
            spans = r["timed"]["collectives"]
            gathers = [x for x in spans if x[0].startswith("AG")]
            reduces = [x for x in spans if x[0].startswith("RS")]
            forward, backward = r["sites"]
            assert len(gathers) == r["step_issued"]  # every gather issued this step, timed when taken
            assert len(reduces) == NO_PREFETCH.num_micro_batches * forward  # each site's, per micro-batch
            assert all(0 <= issued <= waited <= done for _, issued, waited, done, _ in spans)
            # with prefetch, a gather goes out while the site before it computes (all but each
            # pass's first); without, each when its site waits for it
            ahead = [x for x in gathers if x[4]]
            assert (len(ahead) > len(gathers) // 2) if key == "prefetch" else not ahead, (key, len(ahead), len(gathers))
            assert all(waited > issued for _, issued, waited, _, _ in ahead)
    steps = [SimpleNamespace(**r["timed"]) for r in sharded_state["prefetch"]]
    text = render_report(plan=synthetic_plan(pp=2, m=2), cluster=Cluster.load("local-cpu"), measured_step=steps)
    doc = parse(text)
    assert len(doc.find("svg", id="zero3-timeline")) == 1
    drawn = doc.with_class("z3")
    assert len([a for a in drawn if "reduce" in a["class"]]) == sum(
        1 for r in sharded_state["prefetch"] for x in r["timed"]["collectives"] if x[0].startswith("RS"))
    assert any("exposed" in a["class"] for a in drawn) and 'id="zero3-timeline-note"' in text


def _checkpoint_round_trip(directory: str, payload):
    """Train a ZeRO-3 dp=2 x pp=2 plan one step and save it; load it into a tp=2 x pp=2 plan and
    into a ZeRO-3 dp=4 plan: the parameters, and the loss of one more step (which reads the
    optimizer state), must be the same everywhere."""
    import os

    from partitioner.compile.build import build_parallel_model
    from runtime.checkpoint.io import load_checkpoint, save_checkpoint
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=300)
    model = runtime_cases.MODELS["gpt"]
    spec, graph = runtime_cases.unpacked_graph(model, payload)
    batches = runtime_cases.batches(spec, 8)
    out = {}
    for name, plan in (("zero3", _plan("gpt", 2, pp=2)), ("tp2pp2", _plan("gpt", 1, tp=2, pp=2)),
                       ("zero3_dp4", _plan("gpt", 4, m=1))):
        config = plan.config() if name != "tp2pp2" else plan.config().replace(zero_stage=0)
        mesh = Mesh(plan.dp, plan.pp, plan.tp, timeout_s=runtime_cases.TIMEOUT_S)
        pm = build_parallel_model(graph, config, mesh, optimizer=runtime_cases.ADAMW, cluster=local_cluster(mesh.size))
        if name == "zero3":
            pm.train_step(batches[0])
            save_checkpoint(pm, os.path.join(directory, "ckpt"), step=1)
        else:
            assert load_checkpoint(pm, os.path.join(directory, "ckpt")) == 1
        out[name] = {"params": pm.full_parameters(), "next_loss": pm.train_step(batches[1])}
    return out


@pytest.mark.slow
def test_a_zero3_checkpoint_loads_under_other_plans_and_into_the_plain_module(tmp_path):
    from runtime.checkpoint.io import load_into_module

    results = spawn(_checkpoint_round_trip, WORLD, str(tmp_path), runtime_cases.packed_graph(runtime_cases.MODELS["gpt"]),
                    timeout_s=600)
    saved = results[0]["zero3"]["params"]
    module = runtime_cases.build_model(runtime_cases.MODELS["gpt"]).module
    assert load_into_module(module, tmp_path / "ckpt") == 1
    plain = dict(module.named_parameters(remove_duplicate=False))
    for rank, r in enumerate(results):
        for name in ("tp2pp2", "zero3_dp4"):
            for key, value in r[name]["params"].items():
                full = saved.get(key, results[2]["zero3"]["params"].get(key))  # stage 1's from its own rank
                if full is not None:
                    assert torch.equal(value, full), (rank, name, key)
                assert torch.equal(value, plain[key].detach()), (rank, name, key)
    losses = {r[name]["next_loss"] for r in results for name in ("zero3", "tp2pp2", "zero3_dp4")}
    assert max(losses) - min(losses) < 1e-6 * max(losses), losses


HSDP = [("gpt", 2, "none"), ("hf-gpt2", 2, "none"), ("llama", 2, "full")]  # dp=4: 2 shard groups of 2


def _train_hsdp(cases, payloads):
    """HSDP plans (dp=4, shard groups of 2): per case, the losses, norms, full parameters and
    gradients, as :func:`tests.runtime_cases.train_plans` reports them."""
    from partitioner.compile.build import build_parallel_model
    from runtime.dist.mesh import Mesh, init_distributed

    _with_llama()
    init_distributed(timeout_s=600)
    mesh = Mesh(4, 1, 1, timeout_s=runtime_cases.TIMEOUT_S, dp_shard=2)
    out = {}
    for model, shard, ckpt in cases:
        spec, graph = runtime_cases.unpacked_graph(runtime_cases.MODELS[model], payloads[model])
        config = _plan(model, 4, m=1, ckpt=ckpt).config().replace(hsdp_shard=shard)
        pm = build_parallel_model(graph, config, mesh, optimizer=runtime_cases.ADAMW,
                                  lr_scheduler=runtime_cases.SCHEDULE, clip_grad_norm=runtime_cases.CLIP, cluster=local_cluster(mesh.size))
        losses, norms = [], []
        for b in runtime_cases.batches(spec, 8):
            losses.append(pm.train_step(b))
            norms.append(pm.last_grad_norm)
        out[model] = {"losses": losses, "norms": norms, "params": pm.full_parameters(), "grads": pm.full_gradients(),
                      "param_elems": sum(p.numel() for p in pm.params)}
    return out


@pytest.mark.slow
def test_hsdp_trains_like_one_device():
    _with_llama()
    payloads = {model: runtime_cases.packed_graph(runtime_cases.MODELS[model]) for model, _, _ in HSDP}
    results = spawn(_train_hsdp, 4, HSDP, payloads, timeout_s=900)
    for model, _, _ in HSDP:
        ref = reference(model, 8)
        full = sum(p.numel() for p in ref[1].parameters())
        for rank, r in enumerate(results):
            _check_like_one_device(r[model], ref, f"{model} rank {rank}")
            # each rank holds half the model (its shard group has 2 ranks), not a quarter
            assert full / 2 <= r[model]["param_elems"] <= full / 2 + 64, (model, rank)


# every model with tp=2 and with pp=2 (dp=4 in shard groups of 2: 8 ranks)
HSDP_COMPOSED = [Plan(model, 4, tp, pp, "1f1b", 1, pp, 8, 3, ckpt, "none", hsdp=2)
                 for model in ("gpt", "llama", "hf-gpt2") for tp, pp in ((2, 1), (1, 2))
                 for ckpt in (["full"] if (model, pp) == ("llama", 2) else ["none"])]


@pytest.fixture(scope="module")
def hsdp_composed():
    _with_llama()
    return spawn(_train, 8, HSDP_COMPOSED, payloads_for(HSDP_COMPOSED), timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("plan", HSDP_COMPOSED, ids=lambda p: p.id)
def test_hsdp_with_tp_or_pp_trains_like_one_device(hsdp_composed, plan):
    _with_llama()
    ref = reference(plan.model, plan.global_batch)
    for rank in range(plan.size):
        _check_like_one_device(hsdp_composed[rank][plan.id], ref, f"rank {rank}")
