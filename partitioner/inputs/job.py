"""How the job runs, besides its cluster: :class:`Job`, the group ``auto_parallelize(job=...)`` and
``partitioner train`` (``--timeout``, ``--dump-dir``) read. Checked when made, so a bad value is
refused before any rank starts work."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from partitioner.inputs.run_options import check_option
from passes.ir.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """Where and how the job runs: its timeouts, what it writes, what it measures."""

    timeout_s: float = 60.0
    """Seconds any training collective or receive may wait before the job fails naming the
    rank that stopped answering (``--timeout``)."""
    dump_dir: str | Path | None = None
    """Rank 0 writes the dump tree here (every pass of the lowering, each rank program,
    ``plan.json``, ``report.html``; ``measurements.json`` at ``finish()``; ``--dump-dir``).
    ``None``: nothing is written."""
    onnx: bool = False
    """Rank 0 also writes ``program.onnx`` beside each ``program.txt`` of the dump tree (``--onnx``).
    Off by default: the exporter traces every program again (torch.export, then ONNX's own
    decompositions), which costs more than capture, plan and lowering together and would hold up
    every rank's first step; ``partitioner lower --plan D/plan.json`` writes the same tree with
    ONNX afterwards (the command is in ``D/manifest.json``)."""
    track_memory: bool | int = 2
    """On CPU, the number of first steps whose live bytes are tracked (slower steps; the peak is
    reached by the second); ``True``: every step, ``False``/``0``: none. CUDA peaks are read
    every step at no cost."""

    def __post_init__(self) -> None:
        check_option("timeout", self.timeout_s, spelled="Job.timeout_s")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ConfigError(f"Job.dump_dir is {type(self.dump_dir).__name__}; give a directory path (str or "
                              f"pathlib.Path), or None to write nothing")
        if not isinstance(self.onnx, bool):
            raise ConfigError(f"Job.onnx is {type(self.onnx).__name__}; give True (write program.onnx at build) or "
                              f"False")
        if not isinstance(self.track_memory, int) or (self.track_memory is not True and self.track_memory < 0):
            raise ConfigError(f"Job.track_memory must be True, False or a number of steps >= 0, got "
                              f"{self.track_memory!r}; e.g. 2 (the default: the first two steps)")
