"""Optimal choice of segments to recompute under a budget of saved-activation bytes.

The chain model (Chen et al. 2016, Rotor): a chain of segments, segment ``i`` with

* ``flops`` f_i: its forward FLOPs, run again in backward if it is recomputed;
* ``saved_bytes`` a_i: bytes of saved activations it stops keeping when recomputed;
* ``boundary_bytes`` b_i: bytes the checkpoint keeps instead (its input, when nothing else
  keeps it already).

With ``base_bytes`` the bytes kept when nothing is recomputed, recomputing a set R keeps
``base - sum_{i in R} (a_i - b_i)`` bytes for ``sum_{i in R} f_i`` extra FLOPs. We want the
cheapest R whose kept bytes fit the budget: a 0/1 knapsack (minimise cost, cover a saving).

It is solved exactly by dynamic programming over the chain with Pareto fronts (Nemhauser and
Ullmann): after segment i the DP state set holds every (cost, saving) pair reachable with the
first i segments that no other pair beats in both. Byte and FLOP counts are arbitrary integers
(no scaling or rounding), and a front stays small in practice (transformer blocks are equal, so
the front grows by one point per block). Two prunings keep it exact: a state already covering
the needed saving is never extended by a costlier state, and no state costlier than the best
covering one is kept. Ties in cost go to the plan that keeps fewer bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from passes.ir.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ChainSegment:
    """One segment of the chain (integers: FLOPs and bytes)."""

    flops: int
    saved_bytes: int
    boundary_bytes: int = 0
    recomputable: bool = True

    def __post_init__(self) -> None:
        if min(self.flops, self.saved_bytes, self.boundary_bytes) < 0:
            raise ConfigError(f"chain segment has a negative cost or size ({self}); FLOPs and bytes are >= 0")

    @property
    def gain(self) -> int:
        """Bytes the plan stops keeping when this segment is recomputed."""
        return self.saved_bytes - self.boundary_bytes


@dataclass(frozen=True, kw_only=True)
class ChainSolution:
    """Which segments to recompute, what it costs (FLOPs) and what stays kept (bytes).

    ``feasible`` is False when no choice fits the budget; ``recompute`` is then the choice that
    keeps the fewest bytes (the cheapest such one).
    """

    recompute: tuple[bool, ...]
    recompute_flops: int
    kept_bytes: int
    feasible: bool


def kept_bytes(segments: Sequence[ChainSegment], recompute: Sequence[bool], base_bytes: int) -> int:
    """Bytes kept under the chain model when the segments flagged in ``recompute`` are recomputed."""
    return base_bytes - sum(s.gain for s, r in zip(segments, recompute) if r)


def solve_chain(segments: Sequence[ChainSegment], budget_bytes: int,
                base_bytes: int | None = None) -> ChainSolution:
    """The cheapest (fewest recompute FLOPs) set of segments to recompute so that at most
    ``budget_bytes`` stay kept; ``base_bytes`` (default: sum of ``saved_bytes``) is what is kept
    when nothing is recomputed. Exact; see the module docstring."""
    base = sum(s.saved_bytes for s in segments) if base_bytes is None else base_bytes
    need = base - budget_bytes  # saving to reach
    if need <= 0:
        return _solution(segments, 0, base, feasible=True)

    # State: (cost, saving, mask). Front: sorted by cost ascending with strictly rising saving.
    front: list[tuple[int, int, int]] = [(0, 0, 0)]
    best: tuple[int, int, int] | None = None  # cheapest state covering ``need`` (max saving on ties)
    for i, seg in enumerate(segments):
        if not seg.recomputable or seg.gain <= 0:
            continue  # recomputing it never helps: it costs FLOPs >= 0 and keeps as much or more
        bit = 1 << i
        grown = [(c + seg.flops, s + seg.gain, m | bit) for c, s, m in front]
        front = _pareto(front, grown)
        for state in front:
            if state[1] >= need and (best is None or (state[0], -state[1]) < (best[0], -best[1])):
                best = state
        if best is not None:
            # A covering state is never worse to extend than a costlier one; drop the costlier.
            front = [st for st in front if st[0] < best[0] or st is best]
    if best is None:
        most = front[-1]  # most saving; among equal saving the cheapest (front is Pareto)
        return _solution(segments, most[2], base, feasible=False)
    return _solution(segments, best[2], base, feasible=True)


def _pareto(a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge two fronts into the states no other state beats (lower cost and higher saving)."""
    merged = sorted(a + b, key=lambda st: (st[0], -st[1]))
    out: list[tuple[int, int, int]] = []
    for st in merged:
        if not out or st[1] > out[-1][1]:
            out.append(st)
    return out


def _solution(segments: Sequence[ChainSegment], mask: int, base: int, *, feasible: bool) -> ChainSolution:
    flags = tuple(bool(mask >> i & 1) for i in range(len(segments)))
    return ChainSolution(recompute=flags,
                         recompute_flops=sum(s.flops for s, r in zip(segments, flags) if r),
                         kept_bytes=kept_bytes(segments, flags, base), feasible=feasible)
