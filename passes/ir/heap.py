"""The cyclic garbage collector in a process that imports torch.

Importing torch and its compiler stack (which ``torch.export`` and the optimizers load) makes
about 280,000 objects that live as long as the process. Each full collection scans them all
(about 0.15 s of CPU here), and the collector runs one every time the heap has grown by a quarter:
a process that imports, captures and trains spends 10-25% of its CPU in the collector. Frozen
objects (:func:`gc.freeze`) are never scanned again.

Capturing, analysing and lowering a graph make and drop millions of small objects (fx nodes,
sympy expressions, fake tensors). At Python's default threshold a young collection runs every
700 allocations, and their survivors trigger a full collection every ~70,000. Measured on the
dry-run and search tests (one process, one thread): 7,811 young and 51 full collections, 9% of
the CPU; with a young threshold of 20,000, 222 and 3, and 11% less CPU; with 100,000 no gain (the
young generation no longer fits the cache). :func:`collect_young_less_often` sets
:data:`YOUNG_THRESHOLD`, 10,000: run beside another test process (as the suite's two workers
run), 10,000 took 3% less CPU than 20,000 (464 young and 6 full collections).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Run the body (the imports a process lives with) with the collector off, then freeze every
    object alive: no full collection while the heap grows through the imports, none that scans
    them afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


YOUNG_THRESHOLD = 10_000
"""Allocations (less deallocations) between two collections of the young generation, in the
processes the project starts (ranks, the command line)."""


def collect_young_less_often() -> None:
    """Collect the young generation every :data:`YOUNG_THRESHOLD` allocations, not Python's 700
    (never fewer than a threshold already set higher). For processes the project owns: a
    library call does not change its caller's collector."""
    young, *older = gc.get_threshold()
    if 0 < young < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, *older)


def freeze_inherited() -> None:
    """In a process forked from one that has imported what it needs (a fork server's rank): leave
    the inherited objects out of every collection. It also keeps the collector from writing to
    their pages, which the child shares with its parent until written."""
    gc.freeze()
