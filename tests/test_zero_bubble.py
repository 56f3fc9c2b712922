"""Zero-bubble schedules train like one device: ZB-H1 (``zb1p``) and ZB-V (``zbv``, two chunks
per rank in a V) on gloo, at pp=2 and pp=4, with tied weights (HF GPT-2's embedding and LM head:
under ZBV both live on rank 0), with dp=2 and ZeRO, and with checkpointed and offloaded
activations (also with tp or cp collectives inside the recomputed blocks), each backward split
into its input half (I) and its weight half (W).

All plans run in one spawn of 4 ranks (tests/runtime_cases.py's trainer) and are compared with
single-process AdamW training, clipped and scheduled, at rtol 1e-5.
"""
from __future__ import annotations

import time

import pytest

from runtime.dist.launch import spawn
from tests.runtime_cases import Plan, check_plan, payloads_for, train_plans


def _plan(model, dp, pp, schedule, m, *, zero=0, ckpt="none", offload="none", batch=None, tp=1, cp=1) -> Plan:
    return Plan(model=model, dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_pp=2 if schedule == "zbv" else 1,
                num_micro_batches=m, global_batch=batch or dp * m, zero=zero, checkpointing=ckpt, offload=offload,
                cp=cp)


PLANS = [
    _plan("gpt", 1, 2, "zb1p", 4),
    _plan("gpt", 1, 4, "zb1p", 4),
    _plan("gpt", 1, 2, "zbv", 4),
    _plan("gpt8", 1, 4, "zbv", 8),
    _plan("hf-gpt2", 1, 2, "zb1p", 4),
    _plan("hf-gpt2", 1, 4, "zb1p", 4),
    _plan("hf-gpt2", 1, 2, "zbv", 2),
    _plan("gpt", 2, 2, "zb1p", 2, zero=1),
    _plan("hf-gpt2", 2, 2, "zbv", 2, zero=2),
    _plan("gpt", 1, 2, "zb1p", 4, ckpt="full"),
    _plan("gpt", 1, 2, "zbv", 2, offload="activations"),
    # W replays each checkpointed block once, in the engine's order on every rank, so the tp / cp
    # collectives of one rank's replay meet the same block's on its peers (not another block's)
    _plan("hf-gpt2", 1, 2, "zb1p", 2, ckpt="full", tp=2),
    _plan("gpt-cp", 1, 2, "zb1p", 2, ckpt="full", cp=2, batch=4),
]


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(train_plans, 4, PLANS, payloads_for(PLANS), timeout_s=400)
    print(f"\nspawn of 4 ranks, {len(PLANS)} zero-bubble plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_zero_bubble_plan_trains_like_one_device(distributed, plan):
    check_plan(plan, distributed)
