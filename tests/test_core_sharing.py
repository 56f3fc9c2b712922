"""Processor sharing of a node's cores (``partitioner.cost.core_sharing``): on free cores the
simulation is the schedule's own makespan; on one core it is the whole work; in between, the
phases where more ranks compute than there are cores stretch, and idle ranks give theirs away."""
from __future__ import annotations

import pytest

from partitioner.cost.core_sharing import RankWork, rank_counts, shared_makespan
from partitioner.cost.cost_model import _compute_order
from passes.ir.errors import ConfigError
from passes.ir.schedule import compute_makespan

CASES = [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb1p", 4, 2, 1), ("zb1p", 4, 8, 1),
         ("zbv", 2, 4, 2)]


def _work(p: int, v: int, split: bool, ranks: int = 1, tail: float = 0.0) -> dict[int, RankWork]:
    return {r: RankWork(forward=1 / v, backward=2 / v, weight=1 / v if split else 0.0, tail=tail, ranks={0: ranks})
            for r in range(p)}


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_free_cores_give_the_schedules_makespan_and_one_core_the_whole_work(schedule, p, m, v):
    order = _compute_order(schedule, p, m, v)
    split = schedule.startswith("zb")
    work = _work(p, v, split)
    free = shared_makespan(order, work, None)
    assert free == pytest.approx(compute_makespan(order, 1 / v, 2 / v, 1 / v if split else 0.0))
    assert shared_makespan(order, work, p) == pytest.approx(free)  # a core per rank: nothing shared
    assert shared_makespan(order, work, 1) == pytest.approx(p * m * 3)  # one core runs everything in turn
    two = shared_makespan(order, work, 2)
    assert max(free, p * m * 3 / 2) - 1e-9 <= two <= p * m * 3 / 2 + free


def test_the_phase_where_every_rank_computes_runs_at_the_cores_share():
    """1F1B on 4 ranks and 2 cores: the steady phase keeps all four busy, so the step stretches
    beyond its free makespan; GPipe with as many micro-batches has the same work but a longer
    fill, which the idle ranks' cores shorten."""
    order = _compute_order("1f1b", 4, 8, 1)
    work = _work(4, 1, False)
    free, shared = shared_makespan(order, work, None), shared_makespan(order, work, 2)
    assert shared > free + 10  # 33 s free, 8 steady micro-batches x 3 s at half speed and more
    assert shared >= 4 * 8 * 3 / 2


def test_ranks_of_one_stage_compute_together_and_share_like_separate_ranks():
    """Data parallelism (one pipeline rank of 4 ranks): on 2 cores every action runs at half
    speed, the tail (the optimizer step) too."""
    order = _compute_order("1f1b", 1, 3, 1)
    work = _work(1, 1, False, ranks=4, tail=0.5)
    assert shared_makespan(order, work, None) == pytest.approx(3 * 3 + 0.5)
    assert shared_makespan(order, work, 2) == pytest.approx(2 * (3 * 3 + 0.5))


def test_a_rank_on_two_nodes_runs_at_its_slower_nodes_rate():
    order = _compute_order("1f1b", 2, 2, 1)
    counts = rank_counts(2, 4, 6)  # stage 0: 4 ranks on node 0; stage 1: 2 on node 0, 2 on node 1
    assert counts == [{0: 4}, {0: 2, 1: 2}]
    work = {r: RankWork(forward=1.0, backward=2.0, ranks=counts[r]) for r in range(2)}
    alone = shared_makespan(order, work, None)
    # node 0 holds 6 computing ranks on 3 cores when both stages compute, 4 when only stage 0
    assert shared_makespan(order, work, 3) > alone
    assert shared_makespan(order, work, 6) == pytest.approx(alone)


def test_bad_input_is_refused():
    order = _compute_order("1f1b", 2, 2, 1)
    with pytest.raises(ConfigError, match="slots"):
        shared_makespan(order, _work(2, 1, False), 0)
    with pytest.raises(ConfigError, match="weight"):
        RankWork(forward=1.0, backward=1.0, weight=2.0, ranks={0: 1})
    with pytest.raises(ConfigError, match="complete"):  # a list whose input never comes
        shared_makespan({0: order[0], 1: list(reversed(order[1]))}, _work(2, 1, False), None)
