"""Measure this machine and write the cluster file that ``Cluster.local(world_size)`` reads.

What is measured, in the conditions a rank of a local gloo job sees:

* :func:`measure_matmul`: FLOP/s of square ``n × n`` matmuls per size and dtype in THIS process,
  with :func:`rank_threads` threads (the cores a rank gets when ``world_size`` ranks share them).
* :func:`measure_memcpy`: host memory bandwidth from a large ``Tensor.copy_``.
* :func:`measure_gloo`: ``world_size`` local gloo processes time ``all_reduce`` and a send/recv
  ping-pong between ranks 0 and 1 at a few sizes.

The fits are pure functions of (size, seconds) samples so that measurements from elsewhere (a
training run's timings) can be refitted the same way:

* :func:`fit_efficiency`: peak FLOP/s and the :class:`~partitioner.cost.cost_model.EfficiencyCurve`
  of :func:`~partitioner.cost.cost_model.compute_time`;
* :func:`fit_alpha_beta`: latency α and bandwidth β of the ring model of
  :func:`~partitioner.cost.cost_model.all_reduce_time` (``2(n−1)α + 2(n−1)/n · bytes/β``) or of
  :func:`~partitioner.cost.cost_model.send_recv_time` (``α + bytes/β``).

Both models are affine in the size (``t = c0 + c1·x``). They are fitted by least squares on the
RELATIVE error, ``Σ((c0 + c1·xᵢ)/tᵢ − 1)²``, so a 4 KiB message (tens of µs) counts as much as a
64 MiB one (tenths of a second); plain least squares would fit only the largest sizes.

:func:`run_calibration` runs everything and writes a YAML cluster file (default: this machine's
cache file, :func:`partitioner.cost.cluster.local_cache_file`, which ``Cluster.local`` reads) with the
measurements summarized in its header comments, plus ``<file>.calibration.json`` next to it with
every sample and fit. A :class:`Recipe` says how much is measured: :data:`AUTO_RECIPE` is what
``Cluster.local`` runs by itself the first time, :data:`FULL_RECIPE` what ``partitioner
calibrate`` runs.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from partitioner.cost.cluster import Cluster, Device, Link, PeakFlops
from partitioner.cost.cost_model import EfficiencyCurve, all_reduce_time, send_recv_time
from passes.ir.errors import ConfigError
from runtime.dist.launch import spawn
from runtime.observe.measure import PhaseClock

KiB, MiB = 2**10, 2**20

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Sizes and repeats. ``quick`` keeps the whole calibration to a few seconds (tests, smoke runs);
# its small sizes leave the peaks and bandwidths pessimistic and the copy may stay in cache.
MATMUL_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
QUICK_MATMUL_SIZES = (32, 64, 128, 256, 512)
COMM_SIZES = (4 * KiB, 64 * KiB, 512 * KiB, 4 * MiB, 16 * MiB, 64 * MiB)
QUICK_COMM_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB)
MEMCPY_BYTES = 256 * MiB  # well above the last-level cache of current server CPUs
QUICK_MEMCPY_BYTES = 32 * MiB


@dataclass(frozen=True, kw_only=True)
class Effort:
    """How hard to measure: repeats per point and the shortest timed sample (seconds)."""

    repeats: int
    """Timed samples per point; the fastest is kept. Other processes (this machine is shared)
    only ever ADD time, so the minimum is the reproducible estimate of what the hardware does;
    medians of the same points moved by 10x between runs under load."""
    min_sample_s: float
    """A compute sample loops the operation until it lasts at least this long (seconds), so
    that timer resolution does not dominate tiny kernels."""
    comm_repeats: int
    """Timed single operations per size for gloo (see ``_gloo_worker``)."""


FULL = Effort(repeats=5, min_sample_s=0.05, comm_repeats=30)
QUICK = Effort(repeats=7, min_sample_s=0.005, comm_repeats=15)


# ---------------------------------------------------------------------------------------------
# Fits (pure; reusable for timings that come from elsewhere)
# ---------------------------------------------------------------------------------------------


def _fit_affine(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """``(c0, c1)`` with ``c0 >= 0``, ``c1 > 0`` minimizing ``Σ((c0 + c1·xᵢ)/tᵢ − 1)²``.

    Falls back to a line through the origin when the unconstrained fit has ``c0 < 0`` or
    ``c1 <= 0`` (noise on a flat curve).
    """
    if len(xs) != len(ts) or not xs:
        raise ConfigError(f"a fit needs as many sizes as times, and at least one; got {len(xs)} and {len(ts)}")
    if any(t <= 0 for t in ts) or any(x < 0 for x in xs):
        raise ConfigError(f"a fit needs positive times and sizes >= 0; got sizes {list(xs)}, times {list(ts)}")
    # Normal equations of the weighted problem: rows (1/t, x/t), target 1.
    s00 = sum(1 / t**2 for t in ts)
    s01 = sum(x / t**2 for x, t in zip(xs, ts))
    s11 = sum(x**2 / t**2 for x, t in zip(xs, ts))
    r0 = sum(1 / t for t in ts)
    r1 = sum(x / t for x, t in zip(xs, ts))
    det = s00 * s11 - s01**2
    if len(set(xs)) >= 2 and det > 0:
        c0 = (r0 * s11 - r1 * s01) / det
        c1 = (s00 * r1 - s01 * r0) / det
        if c0 >= 0 and c1 > 0:
            return c0, c1
    if s11 == 0:
        raise ConfigError("a fit needs at least one sample of positive size")
    return 0.0, r1 / s11


def _fit_offset(xs: Sequence[float], ts: Sequence[float], c1: float) -> float:
    """The ``c0 >= 0`` minimizing ``Σ((c0 + c1·xᵢ)/tᵢ − 1)²`` for a fixed slope ``c1``."""
    c0 = sum((1 - c1 * x / t) / t for x, t in zip(xs, ts)) / sum(1 / t**2 for t in ts)
    return max(c0, 0.0)


@dataclass(frozen=True, kw_only=True)
class EfficiencyFit:
    """Peak FLOP/s of one dtype and the efficiency curve that reproduces measured kernel times."""

    peak_flops_per_s: float
    """The peak the curve is relative to (FLOP/s); by default the best rate measured."""
    curve: EfficiencyCurve
    """``compute_time(f) = (f + peak·half_saturation_s) / (peak·peak_efficiency)`` seconds."""

    def predict_seconds(self, flops: float) -> float:
        """Seconds the fitted model gives one kernel of ``flops`` FLOPs."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak_flops_per_s * self.curve.efficiency(flops, self.peak_flops_per_s))


def fit_efficiency(samples: Sequence[tuple[float, float]], peak_flops_per_s: float | None = None) -> EfficiencyFit:
    """Fit :class:`EfficiencyCurve` to ``(flops, seconds)`` samples of single kernels.

    ``compute_time`` is affine in the FLOPs: ``t = f/(P·e) + h/e`` (``P`` the peak, ``e``
    ``peak_efficiency``, ``h`` ``half_saturation_s``). We fit ``t = c0 + c1·f`` on relative
    error (:func:`_fit_affine`), then ``e = 1/(c1·P)`` and ``h = c0·e``. ``P`` defaults to the
    best measured rate ``max(f/t)``; pass a datasheet peak to express the curve relative to it.
    If the fit's asymptotic rate ``1/c1`` beats ``P`` (``e > 1``, noise), ``e`` is capped at 1
    and ``c0`` refitted with ``c1 = 1/P``.
    """
    if not samples:
        raise ConfigError("fit_efficiency needs at least one (flops, seconds) sample")
    flops, secs = [float(f) for f, _ in samples], [float(t) for _, t in samples]
    best = max(f / t for f, t in zip(flops, secs))
    peak = best if peak_flops_per_s is None else float(peak_flops_per_s)
    if peak <= 0:
        raise ConfigError(f"fit_efficiency: peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    c0, c1 = _fit_affine(flops, secs)
    efficiency = 1 / (c1 * peak)
    if efficiency > 1:
        efficiency, c1 = 1.0, 1 / peak
        c0 = _fit_offset(flops, secs, c1)
    return EfficiencyFit(peak_flops_per_s=peak,
                         curve=EfficiencyCurve(peak_efficiency=efficiency, half_saturation_s=c0 * efficiency))


COMM_OPS = ("all_reduce", "send_recv")


def _comm_terms(op: str, n: int) -> tuple[float, float]:
    """``(latency steps, bytes factor)`` of ``op`` over ``n`` ranks: t = steps·α + factor·bytes/β."""
    if op == "all_reduce":
        if n < 2:
            raise ConfigError("an all-reduce fit needs a group of at least 2 ranks")
        return 2 * (n - 1), 2 * (n - 1) / n
    if op == "send_recv":
        return 1, 1.0
    raise ConfigError(f"unknown communication op {op!r}; choose one of {', '.join(COMM_OPS)}")


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Latency α and bandwidth β fitted to timings of one operation, as a :class:`Link` holds them."""

    op: str
    """``"all_reduce"`` (ring model over ``world_size`` ranks) or ``"send_recv"``."""
    world_size: int
    """Ranks of the all-reduce (2 for send/recv)."""
    latency_s: float
    """α: seconds per message (per ring step for the all-reduce)."""
    bandwidth_bytes_per_s: float
    """β: bytes/s per rank, one direction."""

    def link(self, kind: str = "loopback") -> Link:
        """A :class:`Link` with these α and β."""
        return Link(kind=kind, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_s=self.latency_s)

    def predict_seconds(self, nbytes: float) -> float:
        """Seconds the cost model gives ``op`` on ``nbytes`` with this link."""
        if self.op == "all_reduce":
            return all_reduce_time(nbytes, self.world_size, self.link())
        return send_recv_time(nbytes, self.link())


def fit_alpha_beta(samples: Sequence[tuple[float, float]], op: str, world_size: int = 2) -> LinkFit:
    """Fit α (seconds) and β (bytes/s) to ``(bytes, seconds)`` samples of ``op``.

    ``all_reduce`` over ``world_size`` ranks: ``t = 2(n−1)·α + 2(n−1)/n · bytes/β``;
    ``send_recv``: ``t = α + bytes/β`` (one message, one way). Least squares on relative error
    (:func:`_fit_affine`); α >= 0.
    """
    steps, factor = _comm_terms(op, world_size)
    c0, c1 = _fit_affine([factor * b for b, _ in samples], [t for _, t in samples])
    return LinkFit(op=op, world_size=world_size if op == "all_reduce" else 2,
                   latency_s=c0 / steps, bandwidth_bytes_per_s=1 / c1)


# ---------------------------------------------------------------------------------------------
# Machine facts
# ---------------------------------------------------------------------------------------------


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_threads(world_size: int) -> int:
    """Threads one rank of ``world_size`` local ranks gets: ``max(1, cores // world_size)``.

    torchrun sets ``OMP_NUM_THREADS=1`` (and ``runtime.dist.launch.spawn`` does the same); when there
    are at least as many ranks as cores, as on small machines, that is the same number. With
    more cores than ranks a rank could use ``cores // world_size`` threads if the launcher lets
    it, and that is what we measure: the best rate a rank can reach without oversubscription.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    return max(1, cpu_count() // world_size)


@contextlib.contextmanager
def _num_threads(threads: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes, lowered to the cgroup (container) limit if any.

    Reads ``/proc/meminfo`` (``MemTotal``), else ``os.sysconf``; psutil is not a dependency.
    """
    total = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * KiB  # the file says kB and means KiB
                break
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError) as e:
            raise ConfigError("cannot read this host's memory size (no /proc/meminfo, no sysconf); "
                              "write the cluster file by hand (docs/cluster_schema.md)") from e
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            limit = int(Path(limit_file).read_text().strip())  # "max" (no limit) raises ValueError
            if 0 < limit < total:
                total = limit
    return total


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo``, or ``"cpu"``."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "cpu"


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def _time_per_call(fn, effort: Effort) -> float:
    """Seconds of one ``fn()`` call: warm up, size an inner loop to ``min_sample_s``, then keep
    the fastest of ``effort.repeats`` samples (see :class:`Effort`)."""
    fn()  # warm-up: allocator, thread pool, kernel selection
    start = time.perf_counter()
    fn()
    first = max(time.perf_counter() - start, 1e-9)
    loops = max(1, min(10_000, math.ceil(effort.min_sample_s / first)))
    samples = []
    for _ in range(effort.repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops)
    return min(samples)


@dataclass(frozen=True, kw_only=True)
class MatmulSample:
    """One timed square matmul ``[n, n] @ [n, n]``."""

    dtype: str
    n: int
    flops: float
    """``2·n³`` FLOPs (one multiply-add = 2)."""
    seconds: float
    """Seconds of one matmul (fastest repeat)."""

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


def measure_matmul(dtypes: Sequence[str] = ("fp32", "bf16"), sizes: Sequence[int] = MATMUL_SIZES, *,
                   threads: int | None = None, effort: Effort = FULL) -> list[MatmulSample]:
    """Time square matmuls of every size in ``sizes`` for every dtype (``fp32``, ``bf16``, ``fp16``).

    Runs in this process with ``threads`` torch threads (default: all cores; :func:`calibrate`
    passes :func:`rank_threads`), restored afterwards.
    """
    import torch

    unknown = [d for d in dtypes if d not in _TORCH_DTYPES]
    if unknown:
        raise ConfigError(f"measure_matmul: unknown dtype(s) {unknown}; choose from {', '.join(_TORCH_DTYPES)}")
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError(f"measure_matmul: sizes must be positive, got {list(sizes)}")
    out = []
    with _num_threads(threads or cpu_count()):
        for dtype in dtypes:
            torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
            for n in sizes:
                gen = torch.Generator().manual_seed(n)
                a = torch.randn(n, n, generator=gen).to(torch_dtype)
                b = torch.randn(n, n, generator=gen).to(torch_dtype)
                seconds = _time_per_call(lambda: torch.mm(a, b), effort)
                out.append(MatmulSample(dtype=dtype, n=n, flops=2.0 * n**3, seconds=seconds))
    return out


@dataclass(frozen=True, kw_only=True)
class MemcpyMeasurement:
    """A large host-memory copy, and a tiny one for the per-copy overhead."""

    nbytes: int
    """Bytes of the copied tensor."""
    seconds: float
    """Seconds of ``dst.copy_(src)`` of ``nbytes`` (fastest repeat)."""
    small_copy_s: float
    """Seconds of a 4 KiB copy: the fixed cost of one copy."""

    @property
    def copy_bytes_per_s(self) -> float:
        """Tensor bytes copied per second: the rate of an offload copy (``host_to_device``)."""
        return self.nbytes / self.seconds

    @property
    def memory_bandwidth_bytes_per_s(self) -> float:
        """Bytes through memory per second, read plus write (``2·nbytes``/s): what
        ``memory_bound_time`` divides by."""
        return 2 * self.nbytes / self.seconds


def measure_memcpy(nbytes: int = MEMCPY_BYTES, *, threads: int | None = None,
                   effort: Effort = FULL) -> MemcpyMeasurement:
    """Time ``Tensor.copy_`` of ``nbytes`` (float32) and of 4 KiB in this process."""
    import torch

    if nbytes < 4 * KiB:
        raise ConfigError(f"measure_memcpy: nbytes must be at least 4 KiB, got {nbytes}")
    with _num_threads(threads or cpu_count()):
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        seconds = _time_per_call(lambda: dst.copy_(src), effort)
        small_src, small_dst = torch.ones(KiB), torch.empty(KiB)
        small = _time_per_call(lambda: small_dst.copy_(small_src), effort)
    return MemcpyMeasurement(nbytes=(nbytes // 4) * 4, seconds=seconds, small_copy_s=small)


@dataclass(frozen=True, kw_only=True)
class CommSample:
    """One timed communication at one size."""

    op: str
    """``"all_reduce"`` or ``"send_recv"`` (one way)."""
    world_size: int
    """Ranks taking part (2 for send/recv)."""
    nbytes: int
    """Buffer bytes (the all-reduced tensor; the message)."""
    seconds: float
    """Seconds of one operation, fastest of the repeats (all-reduce: the slowest rank's)."""

    @property
    def algorithm_bytes_per_s(self) -> float:
        """``nbytes / seconds``: the rate a user sees, before the ring's 2(n−1)/n factor."""
        return self.nbytes / self.seconds


def _gloo_worker(sizes: Sequence[int], repeats: int, timeout_s: float) -> dict[str, list[tuple[int, float]]]:
    """Runs on every rank: joins a gloo group, then :func:`time_gloo`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return time_gloo(sizes, repeats)


def time_gloo(sizes: Sequence[int], repeats: int) -> dict[str, list[tuple[int, float]]]:
    """On every rank of an initialized gloo group: time all_reduce at each size (bytes), and a
    send/recv ping-pong between ranks 0 and 1; returns ``{"all_reduce": [(bytes, s)],
    "send_recv": [(bytes, s)]}`` (the send/recv list only on rank 0).

    Every sample is ONE operation after a barrier, and the fastest of ``repeats`` is kept: a
    loop of many operations would average in the scheduling delays of other processes (a gloo
    message waits for both peers to be on a core), which on a loaded machine multiplied the time
    of a 4 KiB message by 10. Repeats go round-robin over the sizes (1, 2, ..., then again), so
    that a burst of load spoils one repeat of several sizes rather than every repeat of one.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()

    def all_reduce(buf: torch.Tensor) -> None:
        dist.all_reduce(buf)

    def ping_pong(buf: torch.Tensor) -> None:  # ranks other than 0 and 1 only wait at barriers
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        elif rank == 1:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)

    out: dict[str, list[tuple[int, float]]] = {}
    for name, op, messages in (("all_reduce", all_reduce, 1), ("send_recv", ping_pong, 2)):
        bufs = [torch.ones(max(1, nbytes // 4)) for nbytes in sizes]
        for buf in bufs:
            op(buf)  # warm-up: connections, buffers
        best = [math.inf] * len(bufs)
        for _ in range(repeats):
            for i, buf in enumerate(bufs):
                dist.barrier()
                start = time.perf_counter()
                op(buf)
                # a ping-pong is two messages: one way is half of it
                best[i] = min(best[i], (time.perf_counter() - start) / messages)
        out[name] = [(buf.numel() * 4, t) for buf, t in zip(bufs, best)]
    if rank != 0:
        out["send_recv"] = []  # only rank 0 timed whole round trips
    dist.barrier()
    return out


@dataclass(frozen=True, kw_only=True)
class GlooMeasurement:
    """gloo timings on local processes and the α-β fits of the cost model."""

    all_reduce: tuple[CommSample, ...]
    send_recv: tuple[CommSample, ...]
    all_reduce_fit: LinkFit
    send_recv_fit: LinkFit


def measure_gloo(world_size: int, sizes: Sequence[int] = COMM_SIZES, *, effort: Effort = FULL,
                 timeout_s: float = 120.0) -> GlooMeasurement:
    """Spawn ``world_size`` (>= 2) local gloo processes; time all_reduce and ranks 0 ↔ 1 send/recv.

    Processes start through :func:`runtime.dist.launch.spawn` (MASTER_ADDR=127.0.0.1, a free port,
    one torch thread per rank as under torchrun); the process group has a ``timeout_s`` timeout
    and the whole job is killed after ``2·timeout_s`` seconds, so nothing hangs. All-reduce time
    per size is the slowest rank's fastest repeat; send/recv is half of rank 0's round trip.
    """
    if world_size < 2:
        raise ConfigError(f"measure_gloo needs world_size >= 2 to time communication, got {world_size}")
    if not sizes or any(s < 4 for s in sizes):
        raise ConfigError(f"measure_gloo: sizes must be at least 4 bytes, got {list(sizes)}")
    per_rank = spawn(_gloo_worker, world_size, tuple(sizes), effort.comm_repeats, timeout_s,
                     timeout_s=2 * timeout_s)
    return gloo_measurement(per_rank)


def gloo_measurement(per_rank: Sequence[dict]) -> GlooMeasurement:
    """The samples and fits of :func:`time_gloo`'s results on every rank (index = rank): the
    all-reduce time per size is the slowest rank's fastest repeat; send/recv is rank 0's."""
    world_size = len(per_rank)
    all_reduce = tuple(
        CommSample(op="all_reduce", world_size=world_size, nbytes=nbytes,
                   seconds=max(r["all_reduce"][i][1] for r in per_rank))
        for i, (nbytes, _) in enumerate(per_rank[0]["all_reduce"]))
    send_recv = tuple(CommSample(op="send_recv", world_size=2, nbytes=nbytes, seconds=s)
                      for nbytes, s in per_rank[0]["send_recv"])
    return GlooMeasurement(
        all_reduce=all_reduce, send_recv=send_recv,
        all_reduce_fit=fit_alpha_beta([(c.nbytes, c.seconds) for c in all_reduce], "all_reduce", world_size),
        send_recv_fit=fit_alpha_beta([(c.nbytes, c.seconds) for c in send_recv], "send_recv"))


# ---------------------------------------------------------------------------------------------
# The whole calibration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Everything :func:`run_calibration` measured and fitted, and the cluster built from it."""

    cluster: Cluster
    world_size: int
    threads_per_rank: int
    matmul: tuple[MatmulSample, ...]
    efficiency: dict[str, EfficiencyFit]
    """Fit per dtype (``fp32``, ``bf16``); ``peak_flops_per_s`` is what the cluster file holds."""
    memcpy: MemcpyMeasurement
    gloo: GlooMeasurement
    path: Path | None = None
    """Where the cluster file was written."""
    elapsed_s: float = 0.0
    """Seconds the calibration took."""
    refit: Any = None
    """The :class:`partitioner.calibration.refit.Refit` of the reference runs (``cluster`` is its cluster),
    or None when they were skipped."""
    reference_dirs: tuple[Path, ...] = ()
    """The reference runs' directories (plan.json + measurements.json each)."""
    recipe: str = "full"
    """Name of the :class:`Recipe` measured."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each phase (matmul, memcpy, gloo and the reference runs, refit)."""

    def to_json(self) -> dict:
        """Every sample and fit as plain numbers (what ``<file>.calibration.json`` holds)."""
        return {
            "recipe": self.recipe, "world_size": self.world_size, "threads_per_rank": self.threads_per_rank,
            "cpu": cpu_name(), "cores": cpu_count(), "elapsed_s": self.elapsed_s, "phases_s": self.phases,
            "matmul": [asdict(s) | {"flops_per_s": s.flops_per_s} for s in self.matmul],
            "efficiency": {d: {"peak_flops_per_s": f.peak_flops_per_s, **asdict(f.curve)}
                           for d, f in self.efficiency.items()},
            "memcpy": asdict(self.memcpy) | {"copy_bytes_per_s": self.memcpy.copy_bytes_per_s,
                                             "memory_bandwidth_bytes_per_s":
                                                 self.memcpy.memory_bandwidth_bytes_per_s},
            "all_reduce": [asdict(s) for s in self.gloo.all_reduce],
            "send_recv": [asdict(s) for s in self.gloo.send_recv],
            "all_reduce_fit": asdict(self.gloo.all_reduce_fit),
            "send_recv_fit": asdict(self.gloo.send_recv_fit),
            "cluster": self.cluster.to_dict(),
            "refit": ({k: v for k, v in asdict(self.refit).items() if k != "cluster"}
                      | {"runs_dirs": [str(d) for d in self.reference_dirs]} if self.refit is not None else None),
        }


def build_cluster(world_size: int, efficiency: dict[str, EfficiencyFit], memcpy: MemcpyMeasurement,
                  gloo: GlooMeasurement, *, threads_per_rank: int, host_memory: int | None = None,
                  name: str = "local-calibrated") -> Cluster:
    """The one-node gloo cluster these measurements describe.

    Device memory is host memory / ``world_size``; the device's memory bandwidth is the copy's
    read+write rate; ``intra_node`` (and ``inter_node``, unused with one node) carry the
    all-reduce fit, since collectives dominate data and tensor parallelism (the send/recv fit is
    in the calibration JSON); ``host_to_device`` is the copy rate with the small-copy latency.
    bf16 falls back to fp32's peak when not measured; tf32 = fp32, fp16 = bf16 (schema defaults).
    The matmul rates are one rank's alone; ``compute_slots_per_node`` (cores over threads per
    rank) says how many ranks reach them at once.
    """
    host = host_memory if host_memory is not None else host_memory_bytes()
    fp32 = efficiency["fp32"].peak_flops_per_s
    bf16 = efficiency["bf16"].peak_flops_per_s if "bf16" in efficiency else fp32
    fp16 = efficiency["fp16"].peak_flops_per_s if "fp16" in efficiency else None
    link = gloo.all_reduce_fit.link("loopback")
    return Cluster(
        name=name, nodes=1, devices_per_node=world_size, backend="gloo",
        device=Device(name=f"{cpu_name()} ({threads_per_rank} thread{'s' * (threads_per_rank > 1)} per rank)",
                      memory_bytes=host // world_size,
                      memory_bandwidth_bytes_per_s=memcpy.memory_bandwidth_bytes_per_s,
                      peak_flops=PeakFlops(fp32=fp32, bf16=bf16, fp16=fp16)),
        intra_node=link, inter_node=link, host_memory_bytes=host,
        host_to_device=Link(kind="loopback", bandwidth_bytes_per_s=memcpy.copy_bytes_per_s,
                            latency_s=memcpy.small_copy_s),
        compute_slots_per_node=max(1, cpu_count() // threads_per_rank))


def _header(cal: Calibration) -> str:
    g = cal.gloo
    lines = [
        f"Written by `partitioner calibrate` on {datetime.datetime.now().isoformat(timespec='seconds')}: "
        f"measurements of this machine ({cpu_name()}, {cpu_count()} cores),",
        f"{cal.world_size} gloo ranks with {cal.threads_per_rank} torch thread(s) each. Samples and fits: the "
        f".calibration.json file next to this one.",
        f"{cal.cluster.compute_slots_per_node} rank(s) compute at once at the measured rate (cores // threads per "
        f"rank); more ranks computing share the cores (StepTimeTerms.contention).",
    ]
    for dtype, fit in cal.efficiency.items():
        lines.append(f"{dtype} matmul: peak {fit.peak_flops_per_s / 1e9:.3g} GFLOP/s, EfficiencyCurve("
                     f"peak_efficiency={fit.curve.peak_efficiency:.3g}, "
                     f"half_saturation_s={fit.curve.half_saturation_s:.3g})")
    for fit in (g.all_reduce_fit, g.send_recv_fit):
        lines.append(f"{fit.op} ({fit.world_size} ranks): alpha {fit.latency_s * 1e6:.3g} us, "
                     f"beta {fit.bandwidth_bytes_per_s / 1e9:.3g} GB/s")
    lines.append(f"memcpy of {cal.memcpy.nbytes / MiB:.0f} MiB: {cal.memcpy.copy_bytes_per_s / 1e9:.3g} GB/s copied "
                 f"({cal.memcpy.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s read+write)")
    if cal.refit is not None:
        r = cal.refit
        lines.append(f"refit to {r.runs} reference training runs (partitioner/calibration/reference_runs.py): peak FLOP/s "
                     f"x{r.flops_scale:.3g}, {r.overheads_text()}, link latency x{r.latency_scale:.3g}")
    return "".join(f"# {line}\n" for line in lines)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory and a rename, so a
    reader (another rank, a crash half-way) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_calibration(cal: Calibration, out: str | Path) -> Path:
    """Write the cluster file (YAML with a comment header, or JSON) and ``<out>.calibration.json``
    (first, so that a cluster file is never without its samples)."""
    path = Path(out).expanduser()
    data = cal.cluster.to_dict()
    text = json.dumps(data, indent=2) + "\n" if path.suffix == ".json" else _header(cal) + yaml.safe_dump(data, sort_keys=False)
    _write_atomically(path.with_name(path.name + ".calibration.json"), json.dumps(cal.to_json(), indent=2) + "\n")
    _write_atomically(path, text)
    Cluster.from_file(path)  # what Cluster.local will do: fail here rather than later
    return path


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What one calibration measures, and how hard."""

    name: str
    effort: Effort
    matmul_sizes: tuple[int, ...]
    """Square matmul sizes ``n`` timed per dtype."""
    comm_sizes: tuple[int, ...]
    """gloo message sizes in bytes."""
    memcpy_bytes: int
    """Bytes of the large copy (above the last-level cache for a true memory bandwidth)."""
    reference_steps: int
    """Steps of each reference plan (:mod:`partitioner.calibration.reference_runs`; the first is warm-up);
    0: none, the microbenchmarks alone (which predict small steps far too short)."""


FULL_RECIPE = Recipe(name="full", effort=FULL, matmul_sizes=MATMUL_SIZES, comm_sizes=COMM_SIZES,
                     memcpy_bytes=MEMCPY_BYTES, reference_steps=8)
"""``partitioner calibrate``: every size, 6 measured reference steps per plan (after 2 of warm-up)."""
AUTO_RECIPE = Recipe(name="auto", effort=Effort(repeats=5, min_sample_s=0.01, comm_repeats=10),
                     matmul_sizes=MATMUL_SIZES[:-1], comm_sizes=QUICK_COMM_SIZES, memcpy_bytes=128 * MiB,
                     reference_steps=6)
"""What ``Cluster.local`` runs the first time: the reference runs, which carry most of what a
small step costs, with 4 measured steps each after 2 of warm-up (medians over ranks and steps;
a step costs a tenth of a second, starting the processes and lowering the plans tens of
seconds); gloo timed by the same processes and up to the 4 MiB messages that local jobs'
buckets send; no 2048 matmul."""
QUICK_RECIPE = Recipe(name="quick", effort=QUICK, matmul_sizes=QUICK_MATMUL_SIZES, comm_sizes=QUICK_COMM_SIZES,
                      memcpy_bytes=QUICK_MEMCPY_BYTES, reference_steps=0)
"""``calibrate --quick``: microbenchmarks only, small sizes (seconds; numbers pessimistic)."""
TINY_RECIPE = Recipe(name="tiny", effort=Effort(repeats=2, min_sample_s=0.001, comm_repeats=2),
                     matmul_sizes=(32, 64), comm_sizes=(4 * KiB, 64 * KiB), memcpy_bytes=1 * MiB, reference_steps=0)
"""The least that runs every measurement (tests of the machinery, not of the numbers)."""


def run_calibration(world_size: int = 4, out: str | Path | None = None, quick: bool = False, *,
                    dtypes: Sequence[str] = ("fp32", "bf16"), write: bool = True,
                    reference_runs: bool | None = None, recipe: Recipe | None = None) -> Calibration:
    """Measure matmuls, memcpy and gloo for ``world_size`` local ranks, fit, and write the file.

    ``out`` defaults to this machine's cache file (``cluster.local_cache_file``: what
    ``Cluster.local`` reads when ``$PARTITIONER_CLUSTER_FILE`` is unset), so a calibration
    refreshes it. ``recipe`` (default :data:`QUICK_RECIPE` when ``quick``, else
    :data:`FULL_RECIPE`) says what is measured. Communication needs >= 2 processes, so a
    ``world_size`` of 1 times gloo on 2. ``reference_runs``: override the recipe's (False: none;
    True: at least :data:`FULL_RECIPE`'s steps); the reference plans train a small GPT on the
    ranks (:mod:`partitioner.calibration.reference_runs`) and the cluster's framework overheads are refitted
    to them (:func:`partitioner.calibration.refit.refit`); the runs are kept in ``<out>.runs/``. A tqdm bar
    of the phases goes to stderr when it is a terminal.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if "fp32" not in dtypes:
        raise ConfigError(f"calibration needs fp32 among the dtypes (the cluster's base peak), got {list(dtypes)}")
    recipe = _with_reference_override(recipe or (QUICK_RECIPE if quick else FULL_RECIPE), reference_runs)
    path = Path(out).expanduser() if out is not None else _default_out(world_size)
    start = time.perf_counter()
    clock = PhaseClock()
    threads = rank_threads(world_size)
    together = bool(recipe.reference_steps) and world_size >= 2
    phases = ["matmul", "memcpy", "gloo + reference runs" if together else "gloo"]
    if recipe.reference_steps:
        phases.append("refit" if together else "reference runs + refit")
    with _phase_bar(phases) as bar:
        matmul = measure_matmul(dtypes, recipe.matmul_sizes, threads=threads, effort=recipe.effort)
        efficiency = {d: fit_efficiency([(s.flops, s.seconds) for s in matmul if s.dtype == d]) for d in dtypes}
        _lap(clock, bar, phases)
        memcpy = measure_memcpy(recipe.memcpy_bytes, threads=threads, effort=recipe.effort)
        _lap(clock, bar, phases)
        if together:
            # one spawn for the gloo timings and the reference runs: starting processes is the slow part
            gloo, reference = _gloo_and_reference(world_size, recipe, efficiency, memcpy, threads)
        else:
            gloo, reference = measure_gloo(max(world_size, 2), recipe.comm_sizes, effort=recipe.effort), None
        _lap(clock, bar, phases)
        cluster = build_cluster(world_size, efficiency, memcpy, gloo, threads_per_rank=threads)
        cal = Calibration(cluster=cluster, world_size=world_size, threads_per_rank=threads, matmul=tuple(matmul),
                          efficiency=efficiency, memcpy=memcpy, gloo=gloo, recipe=recipe.name)
        if recipe.reference_steps:
            cal = _with_reference_runs(cal, path, recipe, reference)
            _lap(clock, bar, phases)
    cal = replace(cal, elapsed_s=time.perf_counter() - start, phases=clock.seconds)
    if write:
        cal = replace(cal, path=write_calibration(cal, path))
    return cal



def _phase_bar(phases: Sequence[str]):
    """A tqdm bar over the calibration's phases on stderr, drawn only when stderr is a terminal
    (``disable=None``): logs and tests stay clean. Its description names the phase under way."""
    from tqdm import tqdm

    return tqdm(total=len(phases), desc=f"calibrate: {phases[0]}", unit="phase", file=sys.stderr,
                dynamic_ncols=True, disable=None)


def _lap(clock: PhaseClock, bar, phases: Sequence[str]) -> None:
    """End phase ``phases[bar.n]``: its seconds on ``clock``, the bar one on, naming the next."""
    done = phases[bar.n]
    clock.lap(done)
    if bar.n + 1 < len(phases):
        bar.set_description_str(f"calibrate: {phases[bar.n + 1]}", refresh=False)
    bar.update(1)


def _default_out(world_size: int) -> Path:
    from partitioner.cost.cluster import local_cache_file

    return local_cache_file(world_size)


def _with_reference_override(recipe: Recipe, reference_runs: bool | None) -> Recipe:
    if reference_runs is None:
        return recipe
    steps = max(recipe.reference_steps, FULL_RECIPE.reference_steps) if reference_runs else 0
    return replace(recipe, reference_steps=steps)


def _gloo_and_reference(world_size: int, recipe: Recipe, efficiency: dict[str, EfficiencyFit],
                        memcpy: MemcpyMeasurement, threads: int):
    """(gloo measurement, reference results) from one spawn of ``world_size`` ranks. The lowering
    there costs against the cluster of the compute measurements (it reads no links)."""
    from partitioner.calibration.reference_runs import measure_reference

    placeholder = LinkFit(op="all_reduce", world_size=world_size, latency_s=0.0, bandwidth_bytes_per_s=1.0)
    provisional = build_cluster(world_size, efficiency, memcpy,
                                GlooMeasurement(all_reduce=(), send_recv=(), all_reduce_fit=placeholder,
                                                send_recv_fit=placeholder), threads_per_rank=threads)
    results = measure_reference(world_size, provisional, steps=recipe.reference_steps,
                                comm_sizes=recipe.comm_sizes, comm_repeats=recipe.effort.comm_repeats)
    return gloo_measurement(results.comm), results


def _with_reference_runs(cal: Calibration, path: Path, recipe: Recipe, results=None) -> Calibration:
    """``cal`` refitted to the reference runs (``results`` when they ran with the gloo timings,
    else run now), which are written to ``<path>.runs/``."""
    from partitioner.calibration.reference_runs import measure_reference, write_reference
    from partitioner.calibration.refit import load_run, refit

    if results is None:
        results = measure_reference(cal.world_size, cal.cluster, steps=recipe.reference_steps)
    dirs = write_reference(results, path.with_name(path.name + ".runs"), cal.cluster)
    from partitioner.calibration.reference_runs import WARMUP_STEPS

    # the warm-up steps out when the recipe leaves at least two measured ones
    skip = WARMUP_STEPS if recipe.reference_steps >= WARMUP_STEPS + 2 else 1
    result = refit([load_run(d, skip_first=skip) for d in dirs], cal.cluster)
    return replace(cal, cluster=result.cluster, refit=result, reference_dirs=tuple(dirs))


def auto_calibrate(world_size: int, path: Path) -> Calibration:
    """What ``Cluster.local`` runs on a cache miss: :data:`AUTO_RECIPE` for ``world_size`` ranks,
    written to ``path``."""
    return run_calibration(world_size, path, recipe=AUTO_RECIPE)


JOB_RECIPE = replace(AUTO_RECIPE, name="job", reference_steps=4)
"""What a job calibrates with its own ranks on a cache miss (:func:`calibrate_in_job`): the
automatic recipe with 4 steps per reference plan (2 of warm-up), bounded to well under a
minute on a 2-core machine."""


def calibrate_in_job(path: Path, recipe: Recipe = JOB_RECIPE) -> Calibration:
    """Calibrate this machine with the ranks of the job that is running (every rank calls it,
    the default process group initialised, its world the calibration's): no process is started.

    Rank 0 times the matmuls and the copy alone (the other ranks wait, as a rank's compute is
    measured without contention: ``compute_slots_per_node`` models the sharing), every rank
    times gloo on the job's group, every rank trains the reference plans, and rank 0 fits,
    writes ``path`` (under the cache lock) and sends its :class:`Calibration` to the others:
    every rank returns the same one.
    """
    import torch.distributed as dist

    from partitioner.cost.cluster import exclusive_lock
    from partitioner.calibration.reference_runs import ReferenceResults, reference_plans, run_plans
    from runtime.dist import comm

    world, rank = dist.get_world_size(), dist.get_rank()
    start = time.perf_counter()
    clock = PhaseClock()
    threads = rank_threads(world)
    matmul, efficiency, memcpy = None, None, None
    if rank == 0:
        matmul = measure_matmul(("fp32", "bf16"), recipe.matmul_sizes, threads=threads, effort=recipe.effort)
        efficiency = {d: fit_efficiency([(s.flops, s.seconds) for s in matmul if s.dtype == d])
                      for d in ("fp32", "bf16")}
        memcpy = measure_memcpy(recipe.memcpy_bytes, threads=threads, effort=recipe.effort)
    efficiency, memcpy = comm.broadcast_object((efficiency, memcpy), src=0)
    clock.lap("matmul + memcpy")
    timings = time_gloo(recipe.comm_sizes, recipe.effort.comm_repeats) if world >= 2 else None
    clock.lap("gloo")
    placeholder = LinkFit(op="all_reduce", world_size=world, latency_s=0.0, bandwidth_bytes_per_s=1.0)
    provisional = build_cluster(world, efficiency, memcpy,
                                GlooMeasurement(all_reduce=(), send_recv=(), all_reduce_fit=placeholder,
                                                send_recv_fit=placeholder), threads_per_rank=threads)
    steps = run_plans(reference_plans(world), recipe.reference_steps, provisional) if recipe.reference_steps else []
    clock.lap("reference runs")
    gathered = comm.all_gather_object((timings, steps))
    cal = None
    if rank == 0:
        gloo = gloo_measurement([t for t, _ in gathered]) if world >= 2 else _no_peers()
        cluster = build_cluster(world, efficiency, memcpy, gloo, threads_per_rank=threads)
        cal = Calibration(cluster=cluster, world_size=world, threads_per_rank=threads, matmul=tuple(matmul),
                          efficiency=efficiency, memcpy=memcpy, gloo=gloo, recipe=recipe.name)
        if recipe.reference_steps:
            results = ReferenceResults(comm=tuple(t or {} for t, _ in gathered),
                                       steps=tuple(tuple(s) for _, s in gathered))
            cal = _with_reference_runs(cal, path, recipe, results)
        clock.lap("refit")
        cal = replace(cal, elapsed_s=time.perf_counter() - start, phases=clock.seconds)
        with exclusive_lock(path):
            cal = replace(cal, path=write_calibration(cal, path))
    return comm.broadcast_object(cal, src=0)


def _no_peers() -> GlooMeasurement:
    """A one-rank job sends nothing: its links are the ``local-cpu`` preset's (never priced)."""
    link = Cluster.preset("local-cpu").intra_node
    fits = {op: LinkFit(op=op, world_size=2, latency_s=link.latency_s, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s)
            for op in COMM_OPS}
    return GlooMeasurement(all_reduce=(), send_recv=(), all_reduce_fit=fits["all_reduce"],
                           send_recv_fit=fits["send_recv"])


def calibrate(world_size: int = 4, out: str | Path | None = None, quick: bool = False) -> Cluster:
    """Measure this machine for ``world_size`` local gloo ranks and write the cluster file that
    ``Cluster.local`` reads (default: this machine's cache file); returns it.

    See :func:`run_calibration` for the measurements and fits behind it.
    """
    return run_calibration(world_size, out, quick).cluster
