"""The cyclic garbage collector in a process that imports torch.

Importing torch and its compiler stack (which ``torch.export`` and the optimizers load) makes
about 280,000 objects that live as long as the process. Each full collection scans them all
(about 0.15 s of CPU here), and the collector runs one every time the heap has grown by a quarter:
a process that imports, captures and trains spends 10-25% of its CPU in the collector. Frozen
objects (:func:`gc.freeze`) are never scanned again.
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


def freeze_inherited() -> None:
    """In a process forked from one that has imported what it needs (a fork server's rank): leave
    the inherited objects out of every collection. It also keeps the collector from writing to
    their pages, which the child shares with its parent until written."""
    gc.freeze()
