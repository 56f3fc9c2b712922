"""The chain solver against brute force over all subsets, and its speed on long chains."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from partitioner.errors import ConfigError
from passes.solvers.checkpoint_solver import ChainSegment, kept_bytes, solve_chain


def _brute_force(segments, budget, base):
    """(min cost, min kept at that cost) over all 2^n subsets fitting the budget, or None."""
    best = None
    for flags in itertools.product((False, True), repeat=len(segments)):
        if any(f and not s.recomputable for f, s in zip(flags, segments)):
            continue
        kept = kept_bytes(segments, flags, base)
        if kept > budget:
            continue
        cost = sum(s.flops for s, f in zip(segments, flags) if f)
        if best is None or (cost, kept) < best:
            best = (cost, kept)
    return best


def _random_chain(rng: random.Random, n: int) -> list[ChainSegment]:
    segs = []
    for _ in range(n):
        saved = rng.randrange(0, 10**9)
        segs.append(ChainSegment(flops=rng.randrange(0, 10**12), saved_bytes=saved,
                                 boundary_bytes=rng.randrange(0, saved // 3 + 2) if rng.random() < 0.9
                                 else saved + rng.randrange(1, 100),  # some segments never help
                                 recomputable=rng.random() < 0.9))
    return segs


@pytest.mark.parametrize("seed", range(40))
def test_solver_matches_brute_force(seed):
    rng = random.Random(seed)
    segs = _random_chain(rng, rng.randrange(1, 13))
    base = sum(s.saved_bytes for s in segs) + rng.randrange(0, 10**8)  # plus bytes outside segments
    min_kept = min(kept_bytes(segs, f, base) for f in itertools.product((False, True), repeat=len(segs))
                   if not any(x and not s.recomputable for x, s in zip(f, segs)))
    budget = rng.randrange(min_kept - 10**8, base + 10**8)
    sol = solve_chain(segs, budget, base)
    expected = _brute_force(segs, budget, base)
    if expected is None:
        assert not sol.feasible
        assert sol.kept_bytes == min_kept  # the closest it can get
    else:
        assert sol.feasible
        assert (sol.recompute_flops, sol.kept_bytes) == expected
        assert sol.kept_bytes <= budget
    assert not any(r and not s.recomputable for r, s in zip(sol.recompute, segs))
    assert sol.recompute_flops == sum(s.flops for s, r in zip(segs, sol.recompute) if r)


def test_equal_blocks_pick_fewest_and_cheapest():
    # Four equal blocks and one cheap-but-small one: saving 2 blocks' worth needs 2 blocks.
    segs = [ChainSegment(flops=100, saved_bytes=1000, boundary_bytes=100) for _ in range(4)]
    segs.append(ChainSegment(flops=1, saved_bytes=50))
    base = sum(s.saved_bytes for s in segs)
    sol = solve_chain(segs, base - 1800, base)
    assert sum(sol.recompute[:4]) == 2 and sol.recompute_flops == 200
    sol = solve_chain(segs, base - 1850, base)  # now the small one is needed too
    assert sol.recompute_flops == 201 and sol.recompute[4]
    assert solve_chain(segs, base, base).recompute == (False,) * 5  # budget already met


def test_hundred_segments_fast():
    rng = random.Random(7)
    segs = _random_chain(rng, 100)
    base = sum(s.saved_bytes for s in segs)
    start = time.perf_counter()
    sol = solve_chain(segs, base // 2, base)
    elapsed = time.perf_counter() - start
    print(f"solver: 100 random segments in {elapsed * 1e3:.1f} ms")
    assert sol.feasible and sol.kept_bytes <= base // 2
    assert elapsed < 5.0


def test_negative_sizes_rejected():
    with pytest.raises(ConfigError, match="negative"):
        ChainSegment(flops=-1, saved_bytes=0)
