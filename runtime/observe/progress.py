"""The progress bars a person sees in a terminal: the training steps, the calibration's phases, the
dry run's ranks. One rule for all of them: a tqdm bar on stderr, drawn only when stderr is a
terminal (``disable=None``), so logs, captured output and tests get their plain lines alone."""
from __future__ import annotations

import sys


def terminal_bar(total: int, *, unit: str, desc: str | None = None, initial: int = 0, show: bool = True):
    """A tqdm bar over ``total`` ``unit``\\ s (``initial`` done) on stderr, drawn when stderr is a
    terminal and ``show`` (e.g. only on the rank that echoes); ``desc`` names what is under way."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=None if show else True)
