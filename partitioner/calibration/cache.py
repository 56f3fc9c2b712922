"""The per-machine cache of calibrations: where it lives, how a file is keyed, how it is read and
written one writer at a time. What fills it: :mod:`partitioner.calibration.local`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from partitioner.calibration import measure
from partitioner.cost.cluster import Cluster
from passes.ir.errors import ClusterSpecError

CACHE_DIR_ENV = "PARTITIONER_CACHE_DIR"
"""Overrides where calibrations are cached (default: the user cache directory, see :func:`cache_dir`)."""
CALIBRATION_VERSION = 7
"""Part of every cache key: raise it when what a calibration measures or fits changes, so that
an older cached file is not read as a current one."""


def cache_dir() -> Path:
    """Where calibrations are cached: ``$PARTITIONER_CACHE_DIR``, else ``$XDG_CACHE_HOME/partitioner``,
    else ``~/.cache/partitioner``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    # the XDG base-directory rule (platformdirs is not a dependency): a relative
    # $XDG_CACHE_HOME is invalid and ignored
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path("~/.cache").expanduser()
    return base / "partitioner"


@dataclass(kw_only=True, frozen=True, slots=True)
class MachineKey:
    """What a local calibration depends on: two setups that differ in any field are measured
    separately (a copied home directory, a new torch, another world size)."""

    cpu: str
    """CPU model name (``/proc/cpuinfo``)."""
    cores: int
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    torch_version: str
    """``torch.__version__``: kernels and dispatch overheads change between releases."""
    world_size: int
    """Local gloo ranks the calibration was measured for."""
    threads_per_rank: int
    """torch threads per rank (``calibrate.rank_threads``)."""
    nodes: int = 1
    """Nodes the ranks were spread over (a job's ``WORLD_SIZE / LOCAL_WORLD_SIZE``): a job of
    several nodes also measured the link between them."""
    version: int = CALIBRATION_VERSION
    """:data:`CALIBRATION_VERSION` when it was written."""

    @classmethod
    def this_machine(cls, world_size: int, nodes: int = 1) -> MachineKey:
        """The key of this machine for ``world_size`` ranks over ``nodes`` nodes (threads per rank
        from the ranks of one node)."""
        return cls(cpu=measure.cpu_name(), cores=measure.cpu_count(), torch_version=torch.__version__,
                   world_size=world_size, threads_per_rank=measure.rank_threads(world_size // nodes), nodes=nodes)

    def file_name(self) -> str:
        """``local-w<ranks>-t<threads>-c<cores>-torch<version>-<hash>.yaml``: readable, and the
        hash of every field (the CPU name too) makes it unique."""
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        torch_tag = re.sub(r"[^0-9A-Za-z.]+", "_", self.torch_version)
        nodes = f"-n{self.nodes}" if self.nodes > 1 else ""
        return f"local-w{self.world_size}{nodes}-t{self.threads_per_rank}-c{self.cores}-torch{torch_tag}-{digest}.yaml"


def local_cache_file(world_size: int, nodes: int = 1) -> Path:
    """The cached calibration of this machine for ``world_size`` gloo ranks over ``nodes`` nodes
    (it may not exist yet)."""
    return cache_dir() / MachineKey.this_machine(world_size, nodes).file_name()


def read_cached(path: Path, world_size: int) -> Cluster:
    """The cluster of cache file ``path``; a file that does not read raises
    :class:`ClusterSpecError` naming it and how to rewrite it."""
    try:
        return Cluster.from_file(path)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"the cached calibration {path} is corrupt ({e}); rewrite it with `partitioner "
                               f"calibrate --world-size {world_size}`, or delete it to recalibrate on next use") from None


LOCK_TIMEOUT_S = 900.0
"""Seconds a process waits for another's calibration of the same cache file (an 8-rank one
takes a few minutes on a loaded 2-core machine)."""


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive lock of cache file ``path`` (``<path>.lock``; ``filelock``, a torch
    dependency) for the block: one writer at a time. Waiting more than ``timeout_s`` seconds
    raises :class:`ClusterSpecError` naming the lock."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    try:
        lock_cm = FileLock(lock, timeout=timeout_s)
        lock_cm.acquire()
    except Timeout:
        raise ClusterSpecError(f"waited {timeout_s:.0f} s for another process's calibration of this machine "
                               f"({lock} is held); if none is running, a stopped one left it: check with "
                               f"`partitioner calibrate --show`, or pass a cluster preset") from None
    try:
        yield
    finally:
        lock_cm.release()
