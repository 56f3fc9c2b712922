"""A memory timeline: allocations and frees of one training step, and where its peak is.

Sizes are carried three ways: as sympy expressions in the named dims, as integers at the dims'
hint values, and as coefficient vectors (monomial -> coefficient) of those expressions.

* The peak's **place** (phase, node) and ``hint_bytes`` come from the integers.
* The peak's **expression** must hold at other dims too, where another point of the step may be
  the largest (model state does not grow with batch and sequence, activations do). Every local
  maximum of the timeline (the total just before a free that follows an allocation) is a
  candidate; a candidate whose every coefficient is at most another's is never larger at any
  positive dims and is dropped as it comes. Of the candidates left (the Pareto frontier, which
  grows with depth), ``bytes`` keeps those that are the largest at some point of a grid of dims
  values (each symbolic dim at its hint times 2**k, k = -3, -2.5, ..., 6, at least 1) and is their
  ``sympy.Max``: exact on the grid and at the hints, and never more than the simulated peak
  anywhere. It is a single expression when the capture is concrete or one point dominates.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable

import sympy

Vector = dict[sympy.Expr, sympy.Expr]  # monomial -> coefficient


class MemoryObserver:
    """Watches the memory pass's simulation of a step as it runs (the planner's memory replay,
    :mod:`partitioner.search.replay`, records it so). Every method does nothing here; an
    observer overrides what it needs. Sizes are bytes at the dims' hints."""

    def at(self, phase: str, node: str) -> None:
        """The following events belong to ``phase`` (``forward``, ``backward``, ``optimizer``) and ``node``."""

    def alloc(self, key: Hashable, hint_bytes: int) -> None:
        """Buffer ``key`` becomes live."""

    def free(self, key: Hashable) -> None:
        """Buffer ``key`` is released."""

    def param_grad(self, key: Hashable, param: str) -> None:
        """Buffer ``key`` is (now) the ``.grad`` of parameter ``param`` (its qualified name)."""

    def offloaded(self, region: int, tensor) -> None:
        """Offload region ``region`` moved the storage of ``tensor`` (a saved tensor) to the host."""


_SILENT = MemoryObserver()


@dataclass(frozen=True, kw_only=True)
class Peak:
    """The largest live total of a timeline (bytes), and where it happens."""

    bytes: sympy.Expr  # Max over the non-dominated local maxima; exact at the hints
    hint_bytes: int  # the peak at the dims' hint values
    phase: str  # "forward", "backward" or "optimizer" (at the hints)
    node: str  # node (or parameter) being processed when the peak happens (at the hints)


class Timeline:
    """Records ``alloc``/``free`` events in program order, tagged with the phase and node.

    Each key is a buffer (a storage, a gradient buffer, a temporary); allocating a live key raises
    ``ValueError`` and freeing a dead one ``KeyError`` (both are bugs in the caller).
    """

    def __init__(self, observer: MemoryObserver | None = None) -> None:
        self.observer = observer or _SILENT
        self._sizes: dict[Hashable, tuple[Vector, int]] = {}
        self._live: set[Hashable] = set()
        self._total = 0
        self._vector: Vector = {}
        self._rising = False  # last event was an allocation
        self._where = ("", "")
        self._peak = (-1, "", "")  # (hint bytes, phase, node)
        self._frontier: list[Vector] = []

    def at(self, phase: str, node: str) -> None:
        """Tag the following events with ``phase`` and ``node``."""
        self.observer.at(phase, node)
        self._where = (phase, node)

    def alloc(self, key: Hashable, size: sympy.Expr, hint: int) -> None:
        """A buffer of ``size`` bytes (``hint`` bytes at the dims' hints) becomes live."""
        self.observer.alloc(key, int(hint))
        if key in self._live:
            raise ValueError(f"buffer {key!r} allocated twice")
        vec = _vector(size)
        self._sizes[key] = (vec, hint)
        self._live.add(key)
        self._total += hint
        _add(self._vector, vec, 1)
        self._rising = True
        if self._total > self._peak[0]:
            self._peak = (self._total, *self._where)

    def free(self, key: Hashable) -> None:
        """The buffer ``key`` is released."""
        self.observer.free(key)
        if self._rising:
            self._candidate()
        self._live.remove(key)
        vec, hint = self._sizes[key]
        self._total -= hint
        _add(self._vector, vec, -1)
        self._rising = False

    def is_live(self, key: Hashable) -> bool:
        return key in self._live

    @property
    def current(self) -> int:
        """Live bytes now, at the hints."""
        return self._total

    def peak(self, hints: dict[sympy.Symbol, int] | None = None) -> Peak:
        """The peak of the events so far (see the module docstring); ``hints`` gives each
        symbolic dim's example value."""
        if self._rising:
            self._candidate()
            self._rising = False
        exprs = [_expr(v) for v in _on_grid(self._frontier, hints or {})] or [sympy.Integer(0)]
        hint, phase, node = self._peak
        return Peak(bytes=exprs[0] if len(exprs) == 1 else sympy.Max(*exprs), hint_bytes=max(hint, 0),
                    phase=phase, node=node)

    def _candidate(self) -> None:
        vec = {m: c for m, c in self._vector.items() if c != 0}
        if any(_dominates(f, vec) for f in self._frontier):
            return
        self._frontier = [f for f in self._frontier if not _dominates(vec, f)] + [vec]


_ONE = sympy.Integer(1)
_GRID_POWERS = [k / 2 for k in range(-6, 13)]  # hint * 2**-3 .. hint * 2**6 in steps of sqrt(2)


def _vector(size: sympy.Expr) -> Vector:
    if isinstance(size, (int, sympy.Integer)):
        return {_ONE: int(size)}
    return {m: (int(c) if c.is_Integer else c) for m, c in sympy.expand(size).as_coefficients_dict().items()}


def _on_grid(frontier: list[Vector], hints: dict[sympy.Symbol, int]) -> list[Vector]:
    """The candidates that are the largest at one point or more of the dims grid, in order."""
    if len(frontier) <= 1 or not hints:
        return frontier  # concrete sizes: one candidate survives, the largest
    names = sorted(hints, key=str)
    axes = [sorted({max(1, round(hints[n] * 2.0 ** k)) for k in _GRID_POWERS}) for n in names]
    monomials = {m for v in frontier for m in v}
    winners: set[int] = set()
    for values in itertools.product(*axes):
        point = dict(zip(names, values))
        at = {m: int(m.xreplace(point)) for m in monomials}
        totals = [sum(c * at[m] for m, c in v.items()) for v in frontier]
        winners.add(max(range(len(frontier)), key=totals.__getitem__))
    return [v for i, v in enumerate(frontier) if i in winners]


def _add(total: Vector, vec: Vector, sign: int) -> None:
    for m, c in vec.items():
        total[m] = total.get(m, 0) + sign * c


def _dominates(a: Vector, b: Vector) -> bool:
    """``a >= b`` coefficient by coefficient, hence at every positive value of the dims."""
    return all(a.get(m, 0) >= c for m, c in b.items()) and all(c >= 0 or m in b for m, c in a.items())


def _expr(vec: Vector) -> sympy.Expr:
    return sympy.Add(*[c * m for m, c in vec.items()]) if vec else sympy.Integer(0)
