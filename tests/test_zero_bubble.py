"""Zero-bubble schedules train like one device: ZB-H1 (``zb1p``) and ZB-V (``zbv``, two chunks
per rank in a V) on gloo, at pp=2 and pp=4, with tied weights (HF GPT-2's embedding and LM head:
under ZBV both live on rank 0), with dp=2 and ZeRO, and with checkpointed and offloaded
activations (also with tp or cp collectives inside the recomputed blocks), each backward split
into its input half (I) and its weight half (W); beside them, ZBV and interleaved chunks of
unequal depth (six blocks over four chunks, split as the search splits them).

All plans run in one spawn of 4 ranks (tests/runtime_cases.py's trainer) and are compared with
single-process AdamW training, clipped and scheduled, at rtol 1e-5.
"""
from __future__ import annotations

import time

import pytest

from partitioner.cost.cluster import Cluster
from partitioner.search.profile import profile_model
from partitioner.search.search import search
from runtime.dist.launch import spawn
from tests.runtime_cases import MODELS, Plan, check_plan, payloads_for, train_plans


def _plan(model, dp, pp, schedule, m, *, zero=0, ckpt="none", offload="none", batch=None, tp=1, cp=1,
          at=None) -> Plan:
    return Plan(model=model, dp=dp, tp=tp, pp=pp, schedule=schedule,
                virtual_pp=2 if schedule in ("zbv", "interleaved") else 1, stage_boundaries=at,
                num_micro_batches=m, global_batch=batch or dp * m, zero=zero, checkpointing=ckpt, offload=offload,
                cp=cp)


PLANS = [
    _plan("gpt", 1, 2, "zb1p", 4),
    _plan("gpt", 1, 4, "zb1p", 4),
    _plan("gpt", 1, 2, "zbv", 4),
    _plan("gpt8", 1, 4, "zbv", 8),
    # the search's split of six blocks into 1, 2, 2, 1: stages start at chain 2, 4, 6 (checked below)
    _plan("gpt6", 1, 2, "zbv", 4, at=(2, 4, 6)),
    _plan("gpt6", 1, 2, "interleaved", 4, at=(2, 4, 6)),
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


@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_the_uneven_plans_split_as_the_search_does(schedule):
    plan = next(p for p in PLANS if p.model == "gpt6" and p.schedule == schedule)
    chosen = search(profile_model(MODELS["gpt6"], dtype="fp32"), Cluster.preset("local-cpu", nodes=2),
                    global_batch=plan.global_batch, fix={"pp": 2, "dp": 1, "tp": 1, "schedule": schedule,
                                                         "virtual_pp": 2, "num_micro_batches": 4})
    assert chosen.config.stage_boundaries == plan.stage_boundaries


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(train_plans, 4, PLANS, payloads_for(PLANS), timeout_s=400)
    print(f"\nspawn of 4 ranks, {len(PLANS)} zero-bubble plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_zero_bubble_plan_trains_like_one_device(distributed, plan):
    check_plan(plan, distributed)
