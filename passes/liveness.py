"""A memory timeline: allocations and frees of one training step, and where its peak is.

Sizes are carried twice: as sympy expressions in the named dims and as integers at the dims'
hint values. The peak is located with the integers (comparing polynomials is undefined in
general) and then reported as the symbolic sum of what is live at that point, so it is exact at
the hints and is the size of the same set of buffers at any other dims.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import sympy


@dataclass(frozen=True, kw_only=True)
class Peak:
    """The largest live total of a timeline (bytes), and where it happens."""

    bytes: sympy.Expr  # symbolic sum of the buffers live at the peak
    hint_bytes: int  # the same at the dims' hint values
    phase: str  # "forward", "backward" or "optimizer"
    node: str  # node (or parameter) being processed when the peak happens


class Timeline:
    """Records ``alloc``/``free`` events in program order, tagged with the phase and node.

    Each key is a buffer (a storage, a gradient buffer, a temporary); allocating a live key or
    freeing a dead one is a bug in the caller and raises ``KeyError``/``ValueError``.
    """

    def __init__(self) -> None:
        self._sizes: dict[Hashable, tuple[sympy.Expr, int]] = {}
        self._live: set[Hashable] = set()
        self._events: list[tuple[bool, Hashable]] = []  # (is_alloc, key)
        self._total = 0
        self._peak = -1
        self._peak_event = -1
        self._peak_where = ("", "")
        self._where = ("", "")

    def at(self, phase: str, node: str) -> None:
        """Tag the following events with ``phase`` and ``node``."""
        self._where = (phase, node)

    def alloc(self, key: Hashable, size: sympy.Expr, hint: int) -> None:
        """A buffer of ``size`` bytes (``hint`` bytes at the dims' hints) becomes live."""
        if key in self._live:
            raise ValueError(f"buffer {key!r} allocated twice")
        self._sizes[key] = (size, hint)
        self._live.add(key)
        self._events.append((True, key))
        self._total += hint
        if self._total > self._peak:
            self._peak = self._total
            self._peak_event = len(self._events)
            self._peak_where = self._where

    def free(self, key: Hashable) -> None:
        self._live.remove(key)
        self._events.append((False, key))
        self._total -= self._sizes[key][1]

    def is_live(self, key: Hashable) -> bool:
        return key in self._live

    @property
    def current(self) -> int:
        """Live bytes now, at the hints."""
        return self._total

    def peak(self) -> Peak:
        """Replay the events up to the peak and sum the live buffers' expressions."""
        live: set[Hashable] = set()
        for is_alloc, key in self._events[: self._peak_event]:
            if is_alloc:
                live.add(key)
            else:
                live.discard(key)
        exprs = [self._sizes[k][0] for k in live]
        total = sympy.expand(sympy.Add(*exprs)) if exprs else sympy.Integer(0)
        return Peak(bytes=total, hint_bytes=max(self._peak, 0), phase=self._peak_where[0], node=self._peak_where[1])
