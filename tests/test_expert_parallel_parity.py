"""Mixture of experts on gloo ranks, trained like one device: the zoo ``moe`` decoder (4 experts,
top-2, a shared expert, the load-balancing loss weighed 0.1) and Hugging Face Mixtral, Qwen3-MoE
and LFM2-MoE under data parallelism alone (a load-balancing loss averages its token statistics
over the data axis; LFM2-MoE has none); the
zoo model with the experts spread over ep = 2 and 4 ranks, alone, with expert replicas (dp > ep),
with pp, with cp and with full checkpointing; Hugging Face Mixtral, Qwen3-MoE and LFM2-MoE (stacked
experts: each ep rank holds its rows of them) at ep = 2 and 4, with expert replicas, with pp and
with full checkpointing: per-step losses (the LM loss plus
the aux loss), gradient norms, final parameters and last gradients (router included) at rtol 1e-5,
and each rank holding experts / ep of the expert parameters.
Under ZeRO-1/2 the experts' gradients and optimizer state are sharded over the ranks holding the
same experts, the rest over dp.
A checkpoint saved at ep=2 (also under ZeRO-2) loads at ep=4 (the next step's loss and parameters
as the ep=2 run's) and into the plain module (its parameters as saved). The planner's memory replay of ep plans is
within 5% of each rank's measured peak (the live bytes of its first two training steps), and an ep
rank holds less than a replica of the whole.

One micro-batch per replica: the aux loss of a step is then one device's (with micro-batches it is
each micro-batch's, as under any gradient accumulation).

One spawn of 8 ranks runs every plan."""
from __future__ import annotations

import dataclasses
import time

import pytest

import torch

from runtime.dist.launch import spawn
from tests.runtime_cases import ADAMW, MODELS, TIMEOUT_S, WORLD, Plan, check_plan, payloads_for, train_plans
from tests.runtime_cases import packed_graph, unpacked_graph

pytestmark = pytest.mark.slow


def _plan(*, dp: int, ep: int = 1, pp: int = 1, cp: int = 1, checkpointing: str = "none", model: str = "moe",
          zero: int = 0) -> Plan:
    return Plan(model=model, dp=dp, tp=1, pp=pp, schedule="1f1b", virtual_pp=1, num_micro_batches=1,
                global_batch=2 * dp, zero=zero, checkpointing=checkpointing, offload="none", cp=cp, ep=ep)


PLANS = [
    _plan(dp=2),  # no ep: the aux loss over the data axis
    # Hugging Face Mixtral (stacked experts, not spread yet): its aux loss, recomputed from every
    # layer's router logits, over the data axis
    _plan(dp=2, model="hf-mixtral"),
    _plan(dp=2, ep=2),
    _plan(dp=4, ep=4),
    _plan(dp=4, ep=2),  # two ranks hold each expert: its gradient averages over them
    _plan(dp=2, ep=2, pp=2),
    _plan(dp=2, ep=2, checkpointing="full"),
    _plan(dp=2, cp=2, ep=4),  # the ep group spans the cp ranks: tokens are tokens
    # stacked experts (Hugging Face batched_mm): each ep rank holds its rows of them
    _plan(dp=2, ep=2, model="hf-mixtral"),
    _plan(dp=2, ep=2, model="hf-qwen3-moe"),
    _plan(dp=4, ep=4, model="hf-qwen3-moe"),
    _plan(dp=2, ep=2, model="hf-lfm2-moe"),
    _plan(dp=4, ep=4, model="hf-lfm2-moe"),
    _plan(dp=4, ep=2, model="hf-lfm2-moe"),  # expert replicas
    # a stage boundary between the MoE layers: layer 0's router logits travel to the last stage's aux loss
    _plan(dp=2, ep=2, pp=2, model="hf-qwen3-moe"),
    _plan(dp=2, ep=2, pp=2, model="hf-lfm2-moe"),
    _plan(dp=2, ep=2, checkpointing="full", model="hf-mixtral"),
    # ZeRO: the experts' state sharded over the ranks holding them (two here), the rest over dp
    _plan(dp=4, ep=2, zero=2),
    _plan(dp=4, ep=2, zero=1, model="hf-qwen3-moe"),
    _plan(dp=4, ep=2, zero=2, model="hf-lfm2-moe"),
    _plan(dp=2, ep=2, zero=2, model="hf-qwen3-moe"),  # one rank holds each expert: its shard is all of it
    # the plain replicas the memory test sets the ep ranks' parameters beside, and ZeRO-2 of
    # Qwen3-MoE's experts sharded over their two replicas
    _plan(dp=2, model="hf-qwen3-moe"),
    _plan(dp=2, model="hf-lfm2-moe"),  # no aux loss: nothing averages over the data axis
    _plan(dp=4, ep=2, zero=2, model="hf-qwen3-moe"),
]
AUX_LOSS = {"moe", "hf-mixtral", "hf-qwen3-moe"}  # the models with a load-balancing loss
# measured while they train (their first two steps): a memory plan is a parity plan too
MEMORY_PLANS = [_plan(dp=2), _plan(dp=2, ep=2), _plan(dp=4, ep=2), _plan(dp=4, ep=4),
                _plan(dp=2, model="hf-qwen3-moe"), _plan(dp=2, ep=2, model="hf-qwen3-moe"),
                _plan(dp=4, ep=4, model="hf-qwen3-moe"),
                _plan(dp=2, ep=2, pp=2, model="hf-qwen3-moe"),
                _plan(dp=2, model="hf-lfm2-moe"), _plan(dp=4, ep=4, model="hf-lfm2-moe"),
                _plan(dp=4, ep=2, zero=2), _plan(dp=4, ep=2, zero=1, model="hf-qwen3-moe"),
                _plan(dp=4, ep=2, zero=2, model="hf-qwen3-moe"), _plan(dp=4, ep=2, zero=2, model="hf-lfm2-moe")]
assert set(MEMORY_PLANS) <= set(PLANS)
# expert weights of the whole model: the zoo's per expert, Hugging Face's stacked per layer
EXPERT_WEIGHTS = {"moe": 4 * 4 * 3, "hf-mixtral": 2 * 2, "hf-qwen3-moe": 2 * 2, "hf-lfm2-moe": 2 * 2}


# (case, model, the saving run's knobs): experts per module, stacked experts, and ZeRO-2's flat
# state (the experts' sharded over their two replicas); each loads at dp=4 ep=4 without ZeRO
CHECKPOINT_CASES = [("moe", "moe", {"dp": 2, "ep": 2}), ("hf-qwen3-moe", "hf-qwen3-moe", {"dp": 2, "ep": 2}),
                    ("moe-zero2", "moe", {"dp": 4, "ep": 2, "zero_stage": 2})]


def _plans_then_checkpoint(plans, payloads, root: str) -> dict:
    """On each rank: :func:`train_plans` (the memory of :data:`MEMORY_PLANS` tracked), then each
    of :data:`CHECKPOINT_CASES`: its saving run
    trains two steps and saves, then a third step; dp=4 ep=4 loads the checkpoint and takes that
    third step."""
    from partitioner.calibration.job_cluster import local_cluster
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from runtime.checkpoint.io import load_checkpoint, save_checkpoint
    from runtime.dist.mesh import Mesh

    out = train_plans(plans, payloads, track_memory={p.id for p in MEMORY_PLANS})
    load = ParallelConfig.for_global_batch(4, dp=4, ep=4)
    configs = [ParallelConfig.for_global_batch(4, **knobs) for _, _, knobs in CHECKPOINT_CASES]
    meshes = {c: Mesh.for_config(c, timeout_s=TIMEOUT_S) for c in dict.fromkeys([*configs, load])}
    for (case, name, _), save in zip(CHECKPOINT_CASES, configs):
        spec, graph = unpacked_graph(MODELS[name], payloads.get(name) or packed_graph(MODELS[name]))
        batches = [spec.example_inputs({"batch": 4}, seed=200 + k) for k in range(3)]
        for kind, config in (("save", save), ("load", load)):
            torch.distributed.barrier()  # the load starts after the save has finished
            mesh = meshes[config]
            if not mesh.active:
                continue
            model = build_parallel_model(graph, config, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
            if kind == "save":
                for b in batches[:2]:
                    model.train_step(b)
                save_checkpoint(model, f"{root}/{case}-ep2", step=2)
                saved = model.full_parameters()
            else:
                assert load_checkpoint(model, f"{root}/{case}-ep2") == 2
                saved = None
            loss = model.train_step(batches[2])
            out[f"{case}-{kind}"] = {"loss": loss, "params": model.full_parameters(), "saved": saved}
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_ckpt")
    start = time.perf_counter()
    results = spawn(_plans_then_checkpoint, WORLD, PLANS, payloads_for(PLANS), str(root), timeout_s=400)
    print(f"\nspawn of {WORLD} ranks, {len(PLANS)} expert-parallel plans: {time.perf_counter() - start:.1f} s")
    return str(root), results


@pytest.fixture(scope="module")
def distributed(run):
    return run[1]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_moe_plan_trains_like_one_device(distributed, plan):
    check_plan(plan, distributed)
    ranks = [r[plan.id] for r in distributed[:plan.size]]
    held = [set(r["expert_params"]) for r in ranks]
    if plan.ep == 1:
        assert not any(held), "without ep no parameter averages apart from the data axis"
        if plan.model in AUX_LOSS:
            assert all("data_mean" in r["data_ops"] for r in ranks), "the aux loss averages over the data axis"
        return
    every = set().union(*held)
    assert len(every) == EXPERT_WEIGHTS[plan.model], sorted(every)
    whole = {n: p.numel() for n, p in _plain(plan.model).named_parameters() if n in every}
    for i, r in enumerate(ranks):  # experts / ep of its layers' expert parameters
        numel = r["expert_numel"]
        layers = {_layer(n) for n in numel}
        assert sum(numel.values()) * plan.ep == sum(v for n, v in whole.items() if _layer(n) in layers), \
            f"rank {i} holds {sum(numel.values())} expert parameters"
    if plan.model == "moe":
        for group in range(0, plan.size, plan.ep):  # an ep group holds each expert of its layers once
            members = held[group:group + plan.ep]
            assert sum(map(len, members)) == len(set().union(*members))


def _layer(name: str) -> str:
    return name.split(".moe.")[0].split(".mlp.")[0].split(".feed_forward.")[0]


def _plain(model: str) -> torch.nn.Module:
    from partitioner.inputs.models import build_model
    return build_model(MODELS[model]).module


@pytest.mark.parametrize("case, model", [(case, model) for case, model, _ in CHECKPOINT_CASES])
def test_a_checkpoint_saved_at_ep2_loads_at_ep4_and_into_the_plain_model(run, case, model):
    from runtime.checkpoint.io import load_into_module
    root, results = run
    saved, loaded = results[0][f"{case}-save"], results[0][f"{case}-load"]
    assert loaded["loss"] == pytest.approx(saved["loss"], rel=1e-6)
    assert set(loaded["params"]) == set(saved["params"])
    for name, value in saved["params"].items():
        torch.testing.assert_close(loaded["params"][name], value, rtol=1e-5, atol=1e-7, msg=name)
    module = _plain(model)
    assert load_into_module(module, f"{root}/{case}-ep2") == 2
    for name, value in saved["saved"].items():  # a tied weight under the name the rank lists it by
        torch.testing.assert_close(module.get_parameter(name).detach(), value, rtol=0, atol=0, msg=name)
    assert {id(module.get_parameter(n)) for n in saved["saved"]} == {id(p) for p in module.parameters()}


@pytest.mark.parametrize("plan", MEMORY_PLANS, ids=lambda p: p.id)
def test_replayed_peak_matches_each_rank_measured(run, plan):
    from partitioner.calibration.job_cluster import local_cluster
    from partitioner.search.memory_check import replay_rank_memory
    _, results = run
    errors = [f"rank {r}: {results[r][plan.id]['error']}" for r in range(plan.size) if "error" in results[r][plan.id]]
    assert not errors, f"{plan.id} raised while it trained:\n" + "\n".join(errors)
    _, graph = unpacked_graph(MODELS[plan.model], packed_graph(MODELS[plan.model]))
    replayed = replay_rank_memory(graph, plan.config(), local_cluster(plan.size))
    plain = results[0][_plan(dp=2, model=plan.model).id]["memory"]
    print(f"\n{plan.id}: " + ", ".join(f"rank {r} replay {replayed[r].peak_bytes} measured "
                                        f"{results[r][plan.id]['memory']['peak']}" for r in range(plan.size)))
    for rank in range(plan.size):
        measured = results[rank][plan.id]["memory"]
        assert replayed[rank].peak_bytes == pytest.approx(measured["peak"], rel=0.05), (
            f"rank {rank}: replay {replayed[rank].peak_bytes}, measured {measured['peak']}")
        if plan.ep > 1:  # its 1/ep of the experts: fewer parameters than a replica of the whole
            assert measured["params"] < plain["params"]
        unsharded = dataclasses.replace(plan, zero=0)
        if plan.zero and unsharded in MEMORY_PLANS:  # ZeRO's share of the optimizer state, the experts' included
            assert measured["optimizer"] < results[rank][unsharded.id]["memory"]["optimizer"]
