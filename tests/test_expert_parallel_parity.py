"""Mixture of experts on gloo ranks, trained like one device: the zoo ``moe`` decoder (4 experts,
top-2, a shared expert, the load-balancing loss weighed 0.1) under data parallelism alone (the
load-balancing loss averages its token statistics over the data axis) and with the experts spread
over ep = 2 and 4 ranks, alone, with expert replicas (dp > ep), with pp, with cp and with full
checkpointing: per-step losses (the LM loss plus the aux loss), gradient norms, final parameters
and last gradients (router included) at rtol 1e-5, and each rank holding experts / ep of the experts.

One micro-batch per replica: the aux loss of a step is then one device's (with micro-batches it is
each micro-batch's, as under any gradient accumulation).

One spawn of 8 ranks runs every plan."""
from __future__ import annotations

import time

import pytest

from runtime.dist.launch import spawn
from tests.runtime_cases import WORLD, Plan, check_plan, payloads_for, train_plans

pytestmark = pytest.mark.slow


def _plan(*, dp: int, ep: int = 1, pp: int = 1, cp: int = 1, checkpointing: str = "none") -> Plan:
    return Plan(model="moe", dp=dp, tp=1, pp=pp, schedule="1f1b", virtual_pp=1, num_micro_batches=1,
                global_batch=2 * dp, zero=0, checkpointing=checkpointing, offload="none", cp=cp, ep=ep)


PLANS = [
    _plan(dp=2),  # no ep: the aux loss over the data axis
    _plan(dp=2, ep=2),
    _plan(dp=4, ep=4),
    _plan(dp=4, ep=2),  # two ranks hold each expert: its gradient averages over them
    _plan(dp=2, ep=2, pp=2),
    _plan(dp=2, ep=2, checkpointing="full"),
    _plan(dp=2, cp=2, ep=4),  # the ep group spans the cp ranks: tokens are tokens
]


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(train_plans, WORLD, PLANS, payloads_for(PLANS), timeout_s=400)
    print(f"\nspawn of {WORLD} ranks, {len(PLANS)} expert-parallel plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_moe_plan_trains_like_one_device(distributed, plan):
    check_plan(plan, distributed)
    ranks = [r[plan.id] for r in distributed[:plan.size]]
    held = [set(r["expert_params"]) for r in ranks]
    if plan.ep == 1:
        assert not any(held), "without ep no parameter averages apart from the data axis"
        return
    every = set().union(*held)
    # 4 layers x 4 experts x 3 weights, on every pipeline rank's layers
    assert len(every) == 4 * 4 * 3, sorted(every)
    for i, names in enumerate(held):
        assert len(names) * plan.ep == len([n for n in every if _layer(n) in {_layer(m) for m in names}]), \
            f"rank {i} holds {len(names)} expert weights"
    for group in range(0, plan.size, plan.ep):  # an ep group holds each expert of its layers once
        members = held[group:group + plan.ep]
        assert sum(map(len, members)) == len(set().union(*members))


def _layer(name: str) -> str:
    return name.split(".moe.")[0]
