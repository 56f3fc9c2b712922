"""Context parallelism end to end: plans with cp > 1 (ring attention and Ulysses, cp = 2 and 4,
alone and with dp, tp (with and without sequence parallelism), pp (1F1B, GPipe, ZBV), ZeRO, full and
per-tensor checkpointing) train the zoo gpt and llama (grouped-query
attention, rotary tables) on gloo like one device: per-step losses, gradient norms, final
parameters and last gradients (fp32, rtol 1e-5), through the whole stack (lowering with the
context-parallel rewrite, the communication check, the runtime's sequence sharding and its
gradient average over dp x cp).

One spawn of 8 ranks runs every plan (spawning is the slow part)."""
from __future__ import annotations

import time

import pytest

from runtime.dist.launch import spawn
from tests.runtime_cases import WORLD, Plan, check_plan, payloads_for, train_plans

pytestmark = pytest.mark.slow


def _plan(model: str, *, cp: int, mode: str, dp: int = 1, tp: int = 1, pp: int = 1, m: int = 1,
          schedule: str = "1f1b", zero: int = 0, checkpointing: str = "none", batch: int | None = None,
          sp: bool = False) -> Plan:
    return Plan(model=model, dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_pp=2 if schedule == "zbv" else 1,
                num_micro_batches=m,
                global_batch=batch or dp * m * 2, zero=zero, checkpointing=checkpointing, offload="none", cp=cp,
                cp_mode=mode, sp=sp)


PLANS = [
    *[_plan(model, cp=cp, mode=mode) for model in ("gpt-cp", "llama-cp") for cp in (2, 4)
      for mode in ("ring", "ulysses")],
    _plan("gpt-cp", cp=2, mode="ring", dp=2, m=2),
    _plan("llama-cp", cp=2, mode="ulysses", dp=2, zero=1),
    _plan("gpt-cp", cp=2, mode="ulysses", pp=2, m=2),
    _plan("llama-cp", cp=2, mode="ring", pp=2, m=4, schedule="gpipe", checkpointing="full"),
    _plan("llama-cp", cp=2, mode="ring", dp=2, pp=2, m=2),
    _plan("gpt-cp", cp=4, mode="ring", dp=2, zero=3),
    _plan("gpt-cp", cp=2, mode="ring", pp=2, m=2, schedule="zbv"),  # a V: the first rank holds the LM head too
    # with tensor parallelism: each tp rank's cp ops run on its heads; the vocab-parallel loss sums
    _plan("gpt-cp", cp=2, mode="ring", tp=2),
    _plan("llama-cp", cp=2, mode="ulysses", tp=2, sp=True),  # 2 kv heads: Ulysses takes the repeated heads
    _plan("llama-cp", cp=2, mode="ring", dp=2, tp=2, m=2, zero=1),
    _plan("gpt-cp", cp=2, mode="ulysses", tp=2, pp=2, m=2, checkpointing="full", sp=True),
    # per-tensor recompute: the cp exchanges' outputs are kept, never run again
    _plan("gpt-cp", cp=2, mode="ring", m=2, checkpointing="tensor"),
    _plan("llama-cp", cp=2, mode="ulysses", dp=2, tp=2, m=2, checkpointing="tensor"),
]


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(train_plans, WORLD, PLANS, payloads_for(PLANS), timeout_s=560)
    print(f"\nspawn of {WORLD} ranks, {len(PLANS)} context-parallel plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_context_parallel_plan_trains_like_one_device(distributed, plan):
    check_plan(plan, distributed)
    # the plan ran context-parallel attention (the runtime would reject a shard of the wrong length)
    attention = {"ring": ["ring_attention"], "ulysses": ["heads_to_seq", "seq_to_heads"]}[plan.cp_mode]
    for r in distributed[:plan.size]:
        ops = r[plan.id]["cp_ops"]
        if "reduce_from_cp" in ops:  # the last stage: its loss is the global mean
            assert ops == sorted(attention + ["reduce_from_cp"]), ops
        else:
            assert ops == attention, ops
