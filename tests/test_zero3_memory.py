"""The memory replay of ZeRO-3 plans (partitioner.search.replay, partitioner.search.memory_check) against what
the ranks measure on gloo: the replayed per-rank peak is within 5% of each rank's measured peak
(live tensor storages, steps with optimizer state) for a GPT at dp=2, dp=2 x pp=2, dp=2 with full
checkpointing and a Llama at dp=2, the same GPT plans keeping the gathered parameters from forward
to backward (reshard_after_forward=False), and HSDP (dp=4 in shard groups of 2); and the model state a rank holds (parameters, gradients,
AdamW state) under ZeRO-3 is 1/dp of ZeRO-0's, as measured and as replayed.

The measurement is :class:`runtime.observe.measure.LiveBytes` as every measured step takes it (it also
sees what the ZeRO-3 kernels allocate inside themselves: the prefetched gathers, the
reduce-scatter's fp32 buffers).
"""
from __future__ import annotations

import time

import pytest

from partitioner.search.memory_check import replay_rank_memory
from runtime.dist.launch import spawn
from tests import runtime_cases
from tests.runtime_cases import Plan
from partitioner.calibration.job_cluster import local_cluster

LLAMA = "llama:layers=4,hidden=32,heads=4,kv_heads=2,vocab=64,seq=8"
WORLD, BATCH = 4, 8
TOLERANCE = 0.05


def _plan(model, dp, pp=1, m=2, ckpt="none", zero=3, hsdp=None, keep=False) -> Plan:
    return Plan(model, dp, 1, pp, "1f1b", 1, m, BATCH, zero, ckpt, "none", hsdp=hsdp, reshard=not keep)


PEAK_PLANS = [_plan("gpt", 2), _plan("gpt", 2, pp=2), _plan("gpt", 2, ckpt="full"), _plan("llama", 2),
              # the gathered parameters kept from forward to backward (reshard_after_forward=False)
              _plan("gpt", 2, keep=True), _plan("gpt", 2, pp=2, m=4, keep=True), _plan("gpt", 2, ckpt="full", keep=True),
              # HSDP: shard groups of 2 of dp=4
              _plan("gpt", 4, m=1, hsdp=2), _plan("llama", 4, m=2, hsdp=2, keep=True)]
STATE_PLANS = {(2, 0): _plan("gpt", 2, zero=0), (2, 3): PEAK_PLANS[0],
               (4, 0): _plan("gpt", 4, m=1, zero=0), (4, 3): _plan("gpt", 4, m=1)}
PLANS = PEAK_PLANS + [p for p in STATE_PLANS.values() if p not in PEAK_PLANS]


def _with_llama() -> None:
    runtime_cases.MODELS.setdefault("llama", LLAMA)


@pytest.fixture(scope="module")
def measured():
    _with_llama()
    start = time.perf_counter()
    results = spawn(runtime_cases.measure_memory, WORLD, PLANS, runtime_cases.payloads_for(PLANS),
                    {"llama": LLAMA}, timeout_s=900)
    print(f"\nspawn of {WORLD} ranks, {len(PLANS)} plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def replayed():
    """The replay of every plan, per rank (as the planner returns it for the plan)."""
    _with_llama()
    out = {}
    for plan in PLANS:
        _, graph = runtime_cases.unpacked_graph(runtime_cases.MODELS[plan.model],
                                                runtime_cases.packed_graph(runtime_cases.MODELS[plan.model]))
        out[plan.id] = replay_rank_memory(graph, plan.config(), local_cluster(plan.size))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plan", PEAK_PLANS, ids=lambda p: p.id)
def test_replayed_peak_matches_each_rank_measured(measured, replayed, plan):
    rows = []
    for rank in range(plan.size):
        m, predicted = measured[rank][plan.id], replayed[plan.id][rank].peak_bytes
        rows.append(f"rank {rank}: replay {predicted} ({replayed[plan.id][rank].where}), measured {m['peak']} "
                    f"({(predicted - m['peak']) / m['peak']:+.1%})")
    print(f"\n{plan.id}\n  " + "\n  ".join(rows))
    for rank in range(plan.size):
        m, predicted = measured[rank][plan.id], replayed[plan.id][rank].peak_bytes
        assert predicted == pytest.approx(m["peak"], rel=TOLERANCE), rows[rank]


@pytest.mark.slow
def test_zero3_model_state_is_one_dp_th_of_zero0(measured, replayed):
    rows, ratios = [], {}
    for (dp, zero), plan in sorted(STATE_PLANS.items()):
        m = measured[0][plan.id]
        total = m["params"] + m["grads"] + m["optimizer"]
        mem = replayed[plan.id][0]
        # the replay's model state: parameters and optimizer state, plus the gradients (one per parameter)
        assert mem.state_bytes + mem.param_bytes == total, (plan.id, mem.state_bytes + mem.param_bytes, total)
        rows.append((dp, zero, m["params"], m["grads"], m["optimizer"], total))
        ratios.setdefault(dp, {})[zero] = total
    print("\n dp zero   params    grads  optimizer    total")
    for dp, zero, p, g, o, t in rows:
        print(f"{dp:3d} {zero:4d} {p:8d} {g:8d} {o:10d} {t:8d}")
    for dp, by_zero in ratios.items():
        ratio = by_zero[3] / by_zero[0]
        print(f"dp={dp}: ZeRO-3 / ZeRO-0 = {ratio:.4f} (1/dp = {1 / dp:.4f})")
        # 1/dp, plus each parameter's padding to a multiple of dp and AdamW's per-tensor step
        assert 1 / dp <= ratio < 1.01 / dp


def test_replay_places_the_prefetched_gather_and_refuses_a_mismatched_zero_stage():
    """Without prefetch the replay's peak is lower (one site's gather less in flight), and a
    program lowered with ZeRO-3 replayed as ZeRO-0 (or the reverse) is refused."""
    from partitioner.compile.build import lower_plan
    from partitioner.errors import ConfigError
    from partitioner.search.replay import predict_memory
    from partitioner.search.memory_check import global_batch_bytes
    from passes.ir.meta import CAPTURE

    plan = PEAK_PLANS[0]
    _, graph = runtime_cases.unpacked_graph(runtime_cases.MODELS["gpt"],
                                            runtime_cases.packed_graph(runtime_cases.MODELS["gpt"]))
    c = plan.config()
    program = lower_plan(graph, c, cluster=local_cluster(2), check=False).rank_program(0)
    dims = {**dict(graph.meta[CAPTURE].dims), "batch": c.micro_batch_size}
    kw = dict(schedule=c.schedule, num_micro_batches=c.num_micro_batches, dims=dims,
              global_batch_bytes=global_batch_bytes(graph, BATCH))
    ahead, none = (predict_memory(program, zero=3, zero3_prefetch=k, **kw) for k in (1, 0))
    assert none.peak_bytes < ahead.peak_bytes
    assert ahead.parts.get("gathered", 0) > none.parts.get("gathered", 0)
    with pytest.raises(ConfigError, match="lowered with zero_stage=3"):
        predict_memory(program, zero=0, **kw)
