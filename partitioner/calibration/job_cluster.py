"""The cluster a job runs on, as this process finds it.

* :func:`detect_cluster`: the default of ``auto_parallelize`` and ``partitioner train``: the job's
  shape from the launcher, its GPUs as :mod:`partitioner.calibration.detect` recognises them, or
  this machine's calibration for CPU ranks.
* :func:`local_cluster`: this machine as one node of ``world_size`` ranks, what a user passes to
  ``auto_parallelize`` and ``plan`` to plan for the machine they are on; for gloo, read from the
  per-machine cache (:mod:`partitioner.calibration.cache`) or measured on a miss: outside a job by
  ranks it starts, inside a job by the job's own ranks.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from partitioner.calibration.cache import exclusive_lock, local_cache_file, read_cached
from partitioner.calibration.calibrate import auto_calibrate, calibrate_in_job
from partitioner.calibration.detect import GpuProperties, gpu_cluster, intra_node_kind, job_shape, match_gpu
from partitioner.cost.cluster import CLUSTER_FILE_ENV, Cluster, Link
from passes.ir.errors import ClusterSpecError
from passes.ir.launcher_env import under_launcher
from runtime.dist import comm
from runtime.dist.launch import refuse_while_starting
from runtime.dist.mesh import START_TIMEOUT_S, init_distributed


def detect_cluster(world_size: int | None = None, *, env: Mapping[str, str] | None = None,
                   inter_node: Link | None = None, host_memory_bytes: int | None = None) -> Cluster:
    """This job's Cluster (the default cluster of ``auto_parallelize`` and ``partitioner train``).

    The shape: an initialised process group's world size, else ``world_size``, else the
    launcher's ``WORLD_SIZE``; nodes = world / ``LOCAL_WORLD_SIZE``. Then, in this order:
    ``$PARTITIONER_CLUSTER_FILE`` (a description of one node, given that job shape); this
    process's CUDA device (:func:`gpu_cluster`; ``inter_node`` and ``host_memory_bytes`` as
    there) unless the job's process group is gloo; else CPU ranks: this machine's calibration for
    the job's ranks (:func:`local_cluster`, measured by the job's own ranks the first time; a job
    spanning several nodes also measures the link between them).
    """
    env = os.environ if env is None else env
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    shape = job_shape(env, world_size=world_size)
    if env.get(CLUSTER_FILE_ENV):
        base = Cluster.from_file(env[CLUSTER_FILE_ENV])
        return replace(base, nodes=shape.nodes, devices_per_node=shape.local_world_size)
    # a gloo job's ranks are CPU processes whatever GPUs the machine has (the demo's, say)
    on_gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    if torch.cuda.is_available() and not on_gloo:
        props = GpuProperties.from_torch(torch.cuda.current_device())
        return gpu_cluster(props, shape, intra_node_kind=intra_node_kind(shape.local_world_size, spec=match_gpu(props)),
                           inter_node=inter_node, host_memory_bytes=host_memory_bytes)
    base = local_cluster(shape.world_size)
    return replace(base, nodes=shape.nodes, devices_per_node=shape.local_world_size)


def local_cluster(world_size: int, backend: str = "gloo") -> Cluster:
    """This machine as one node of ``world_size`` ranks.

    Reads the file named by ``$PARTITIONER_CLUSTER_FILE`` when set (it must exist). Otherwise,
    for gloo, this machine's cached calibration (:func:`cached_local_cluster`), measured the
    first time it is needed; for nccl, this machine's GPUs as :func:`detect_cluster` sees them
    (an error without CUDA: the CPU calibration says nothing about GPUs).
    """
    env = os.environ.get(CLUSTER_FILE_ENV)
    if env:
        base = Cluster.from_file(env)  # an explicit request: a missing file is an error
    elif backend == "gloo":
        base = cached_local_cluster(world_size)
    else:  # the calibration measures CPU processes on gloo: it says nothing about GPUs
        if not torch.cuda.is_available():
            raise ClusterSpecError(
                f"local_cluster({world_size}, backend={backend!r}): no CUDA device is visible to this process; "
                f"plan CPU ranks with backend='gloo', or GPUs elsewhere with a preset "
                f"({', '.join(Cluster.presets())}) or a cluster file")
        return replace(detect_cluster(world_size), nodes=1, devices_per_node=world_size)
    return replace(base, nodes=1, devices_per_node=world_size, backend=backend)


def cached_local_cluster(world_size: int) -> Cluster:
    """This machine's calibrated cluster for ``world_size`` gloo ranks, from the cache; on a miss
    it is measured, cached, and one line on stderr says so.

    Inside a job of ``world_size`` ranks (a process group initialised: torchrun, ``spawn``, any
    launcher; every rank calls this) the job's own ranks calibrate
    (:func:`partitioner.calibration.calibrate.calibrate_in_job`) and rank 0's answer, read or measured, is
    every rank's. Outside a job, :func:`partitioner.calibration.calibrate.auto_calibrate` starts the ranks;
    concurrent callers wait for one calibration, not run four."""
    refuse_while_starting(f"local_cluster({world_size})")
    job = _job_world(world_size)
    # a job spread over several nodes also measures the link between them: a calibration of its own
    path = local_cache_file(world_size, job_shape(world_size=job).nodes if job == world_size else 1)
    if job is not None:
        if job != world_size:
            raise ClusterSpecError(
                f"no calibration of this machine for {world_size} rank(s) can be measured inside this job of {job} "
                f"rank(s); plan for the job's own {job} ranks, or run `partitioner calibrate --world-size "
                f"{world_size}` outside the job first")
        return _cached_in_job(path, world_size)
    if path.is_file():
        return read_cached(path, world_size)
    with exclusive_lock(path):
        if path.is_file():  # another process calibrated while this one waited
            return read_cached(path, world_size)
        _refuse_in_daemon(path, world_size)
        _say(f"partitioner: no calibration of this machine for {world_size} gloo rank(s) in {path.parent}; "
             f"measuring it now (about a minute, once)")
        cal = auto_calibrate(world_size, path)
    _say(f"partitioner: calibrated this machine for {world_size} gloo rank(s) in {cal.elapsed_s:.0f} s; "
         f"cached in {path}")
    return cal.cluster


def _job_world(world_size: int) -> int | None:
    """The world size of the job this process is a rank of, else None: its initialised default
    process group, or the launcher's environment (torchrun, ``spawn``), in which case the default
    group is initialised here from env://, as ``auto_parallelize`` would next."""
    launched = under_launcher()
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if not launched:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world == world_size:
        init_distributed(timeout_s=START_TIMEOUT_S)
    return world


def _cached_in_job(path: Path, world_size: int) -> Cluster:
    """Rank 0 reads the cache and tells the others; on a miss every rank calibrates together.
    One decision for all ranks: a rank that read a file another had just written would otherwise
    skip the collectives the others are in."""
    rank = dist.get_rank()
    cached = None
    if rank == 0 and path.is_file():
        try:
            cached = ("ok", read_cached(path, world_size).to_dict())
        except ClusterSpecError as e:
            cached = ("error", str(e))
    cached = comm.broadcast_object(cached, src=0)
    if cached is not None:
        if cached[0] == "error":
            raise ClusterSpecError(cached[1])
        return Cluster.from_dict(cached[1])
    if rank == 0:
        _say(f"partitioner: no calibration of this machine for {world_size} gloo rank(s) in {path.parent}; "
             f"calibrating inside the job with its {world_size} rank(s) (under a minute, once)")
    cal = calibrate_in_job(path)
    if rank == 0:
        _say(f"partitioner: calibrated this machine inside the job in {cal.elapsed_s:.0f} s; cached in {path}")
    return cal.cluster


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _refuse_in_daemon(path: Path, world_size: int) -> None:
    """A daemonic process (a rank of ``runtime.dist.launch.spawn``) may not start the calibration's
    processes: say what to do instead of failing inside multiprocessing."""
    if multiprocessing.current_process().daemon:
        raise ClusterSpecError(
            f"no cached calibration of this machine for {world_size} rank(s) ({path}), and this process (a "
            f"daemonic process) cannot start the calibration's processes and is not a rank of a {world_size}-rank "
            f"job: call local_cluster({world_size}) in the launching process or inside the job, or run "
            f"`partitioner calibrate --world-size {world_size}`")
