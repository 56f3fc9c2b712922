"""Measure this machine, and fit the cost model's terms to the measurements.

What is measured, in the conditions a rank of a local gloo job sees:

* :func:`measure_matmul`: FLOP/s of square ``n × n`` matmuls per size and dtype in THIS process,
  with :func:`rank_threads` threads (the cores a rank gets when ``world_size`` ranks share them).
* :func:`measure_memcpy`: host memory bandwidth from a large ``Tensor.copy_``.
* :func:`measure_gloo`: ``world_size`` local gloo processes time ``all_reduce``, ``all_gather``,
  ``reduce_scatter``, ``all_to_all`` and a send/recv ping-pong between ranks 0 and 1 at a few
  sizes (:func:`time_collectives`, which a job's own ranks also run on their real groups).

Every measurement takes a ``device``: ``cpu`` (gloo ranks) or ``cuda`` (a GPU job under NCCL,
where the timed region is bracketed by ``torch.cuda.synchronize()``: kernels and collectives run
asynchronously to the host clock).

The fits are pure functions of (size, seconds) samples so that measurements from elsewhere (a
training run's timings) can be refitted the same way:

* :func:`fit_efficiency`: peak FLOP/s and the :class:`~partitioner.cost.cost_model.EfficiencyCurve`
  of :func:`~partitioner.cost.cost_model.compute_time`;
* :func:`fit_alpha_beta`: latency α and bandwidth β of the ring model of
  :func:`~partitioner.cost.cost_model.all_reduce_time` (``2(n−1)α + 2(n−1)/n · bytes/β``), of
  :func:`~partitioner.cost.cost_model.all_gather_time`, ``reduce_scatter_time`` and
  ``all_to_all_time`` (``(n−1)α + (n−1)/n · bytes/β``) or of
  :func:`~partitioner.cost.cost_model.send_recv_time` (``α + bytes/β``).

Both models are affine in the size (``t = c0 + c1·x``). They are fitted by least squares on the
RELATIVE error, ``Σ((c0 + c1·xᵢ)/tᵢ − 1)²``, so a 4 KiB message (tens of µs) counts as much as a
64 MiB one (tenths of a second); plain least squares would fit only the largest sizes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


from partitioner.cost.cluster import COLLECTIVE_FIT_OPS, CollectiveFit, Link
from partitioner.cost.cost_model import (EfficiencyCurve, all_gather_time, all_reduce_time, all_to_all_time,
                                         reduce_scatter_time, send_recv_time)
from passes.ir.errors import ConfigError
from runtime.dist.launch import spawn

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
    point_budget_s: float = 1.0
    """Seconds of samples after which a compute point stops sampling, once it has
    :data:`MIN_SAMPLES` of them: a sample that long already averages the noise within it. A bf16
    matmul of 1024 on a CPU without bf16 instructions takes 2.2 s a call, and 5 repeats of it
    were half of a job's first calibration."""
    max_call_s: float = 5.0
    """A matmul size whose one call the previous size's rate puts above this many seconds is not
    timed, nor any larger size of that dtype (a dtype the CPU emulates: bf16 at 2048 took 56 s
    a call on an AVX2 CPU, most of ``partitioner calibrate``'s 8 minutes there)."""


MIN_SAMPLES = 2
"""Samples a compute point always takes (the fastest is kept)."""

FULL = Effort(repeats=5, min_sample_s=0.05, comm_repeats=30, point_budget_s=4.0)
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


COLLECTIVE_OPS = ("all_reduce",) + COLLECTIVE_FIT_OPS
"""Collectives timed over a whole group: the all-reduce (the link's own α-β) and those a link
keeps fits of its own for (``Link.collectives``)."""
COMM_OPS = ("all_reduce", "send_recv") + COLLECTIVE_FIT_OPS
_RING_TIME = {"all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time, "all_to_all": all_to_all_time}


def _comm_terms(op: str, n: int) -> tuple[float, float]:
    """``(latency steps, bytes factor)`` of ``op`` over ``n`` ranks: t = steps·α + factor·bytes/β,
    the cost model's form (``bytes``: the all-reduced buffer, the all-gather's output, the
    reduce-scatter's input, the all-to-all's buffer per rank, the message)."""
    if op in COLLECTIVE_OPS and n < 2:
        raise ConfigError(f"an {op} fit needs a group of at least 2 ranks, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in COLLECTIVE_FIT_OPS:
        return n - 1, (n - 1) / n
    if op == "send_recv":
        return 1, 1.0
    raise ConfigError(f"unknown communication op {op!r}; choose one of {', '.join(COMM_OPS)}")


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Latency α and bandwidth β fitted to timings of one operation, as a :class:`Link` holds them."""

    op: str
    """One of :data:`COMM_OPS`: a collective (ring model over ``world_size`` ranks) or ``"send_recv"``."""
    world_size: int
    """Ranks of the collective (2 for send/recv)."""
    latency_s: float
    """α: seconds per message (per ring step for the all-reduce)."""
    bandwidth_bytes_per_s: float
    """β: bytes/s per rank, one direction."""

    def link(self, kind: str = "loopback") -> Link:
        """A :class:`Link` with these α and β."""
        return Link(kind=kind, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_s=self.latency_s)

    def collective_fit(self) -> CollectiveFit:
        """This fit as a :class:`Link`'s per-collective entry (``Link.collectives``)."""
        return CollectiveFit(op=self.op, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_s=self.latency_s)

    def predict_seconds(self, nbytes: float) -> float:
        """Seconds the cost model gives ``op`` on ``nbytes`` with this link."""
        if self.op == "all_reduce":
            return all_reduce_time(nbytes, self.world_size, self.link())
        if self.op in _RING_TIME:
            return _RING_TIME[self.op](nbytes, self.world_size, self.link())
        return send_recv_time(nbytes, self.link())


def fit_alpha_beta(samples: Sequence[tuple[float, float]], op: str, world_size: int = 2) -> LinkFit:
    """Fit α (seconds) and β (bytes/s) to ``(bytes, seconds)`` samples of ``op``.

    ``all_reduce`` over ``world_size`` ranks: ``t = 2(n−1)·α + 2(n−1)/n · bytes/β``;
    ``all_gather``, ``reduce_scatter``, ``all_to_all``: ``t = (n−1)·α + (n−1)/n · bytes/β``;
    ``send_recv``: ``t = α + bytes/β`` (one message, one way). Least squares on relative error
    (:func:`_fit_affine`); α >= 0.
    """
    steps, factor = _comm_terms(op, world_size)
    c0, c1 = _fit_affine([factor * b for b, _ in samples], [t for _, t in samples])
    return LinkFit(op=op, world_size=world_size if op != "send_recv" else 2,
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


def device_synchronizer(device: str | None):
    """``(torch.device, sync)``: the device to measure on (``None``: ``cpu``) and what waits for
    its queued work: ``torch.cuda.synchronize`` on a CUDA device (kernels and NCCL collectives
    return before they finish), nothing on the CPU, whose operations are done on return."""
    import torch

    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"cannot measure on {dev}: no CUDA device is visible to this process; measure on "
                              f"'cpu', or run on a machine with a GPU")
        return dev, lambda: torch.cuda.synchronize(dev)
    if dev.type != "cpu":
        raise ConfigError(f"cannot measure on {dev}: the calibration measures 'cpu' or 'cuda' devices")
    return dev, lambda: None


def _time_per_call(fn, effort: Effort, sync=lambda: None) -> float:
    """Seconds of one ``fn()`` call: warm up, size an inner loop to ``min_sample_s``, then keep
    the fastest of ``effort.repeats`` samples, or of fewer once they add up to
    ``effort.point_budget_s`` (at least :data:`MIN_SAMPLES`; see :class:`Effort`). The call that
    sizes the loop is the first sample when it alone lasts ``min_sample_s``. ``sync`` waits for
    the device (:func:`device_synchronizer`) before the clock starts and before it stops."""
    fn()  # warm-up: allocator, thread pool, kernel selection
    sync()
    start = time.perf_counter()
    fn()
    sync()
    first = max(time.perf_counter() - start, 1e-9)
    loops = max(1, min(10_000, math.ceil(effort.min_sample_s / first)))
    samples = [first] if loops == 1 else []
    while len(samples) < effort.repeats:
        if len(samples) >= MIN_SAMPLES and sum(samples) * loops >= effort.point_budget_s:
            break
        sync()
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        sync()
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
                   threads: int | None = None, effort: Effort = FULL, device: str | None = None) -> list[MatmulSample]:
    """Time square matmuls of every size in ``sizes`` (smallest first) for every dtype (``fp32``,
    ``bf16``, ``fp16``), up to the size whose one call would take more than ``effort.max_call_s``.

    Runs in this process on ``device`` (``cpu`` by default; ``cuda`` synchronises around every
    timed sample) with ``threads`` torch threads (default: all cores; :func:`calibrate` passes
    :func:`rank_threads`), restored afterwards.
    """
    import torch

    dev, sync = device_synchronizer(device)

    unknown = [d for d in dtypes if d not in _TORCH_DTYPES]
    if unknown:
        raise ConfigError(f"measure_matmul: unknown dtype(s) {unknown}; choose from {', '.join(_TORCH_DTYPES)}")
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError(f"measure_matmul: sizes must be positive, got {list(sizes)}")
    out = []
    with _num_threads(threads or cpu_count()):
        for dtype in dtypes:
            torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
            previous = None
            for n in sorted(sizes):
                if previous is not None and previous.seconds * (n / previous.n) ** 3 > effort.max_call_s:
                    break  # (Effort.max_call_s) this size and the larger ones would take minutes
                gen = torch.Generator().manual_seed(n)
                a = torch.randn(n, n, generator=gen).to(dev, torch_dtype)
                b = torch.randn(n, n, generator=gen).to(dev, torch_dtype)
                seconds = _time_per_call(lambda: torch.mm(a, b), effort, sync)
                previous = MatmulSample(dtype=dtype, n=n, flops=2.0 * n**3, seconds=seconds)
                out.append(previous)
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
                   effort: Effort = FULL, device: str | None = None) -> MemcpyMeasurement:
    """Time ``Tensor.copy_`` of ``nbytes`` (float32) and of 4 KiB in this process, inside
    ``device``'s memory (``cpu`` by default: host memory; ``cuda``: device memory)."""
    import torch

    if nbytes < 4 * KiB:
        raise ConfigError(f"measure_memcpy: nbytes must be at least 4 KiB, got {nbytes}")
    dev, sync = device_synchronizer(device)
    with _num_threads(threads or cpu_count()):
        src = torch.ones(nbytes // 4, device=dev)
        dst = torch.empty_like(src)
        seconds = _time_per_call(lambda: dst.copy_(src), effort, sync)
        small_src, small_dst = torch.ones(KiB, device=dev), torch.empty(KiB, device=dev)
        small = _time_per_call(lambda: small_dst.copy_(small_src), effort, sync)
    return MemcpyMeasurement(nbytes=(nbytes // 4) * 4, seconds=seconds, small_copy_s=small)


@dataclass(frozen=True, kw_only=True)
class CommSample:
    """One timed communication at one size."""

    op: str
    """One of :data:`COMM_OPS` (``"send_recv"``: one way)."""
    world_size: int
    """Ranks taking part (2 for send/recv)."""
    nbytes: int
    """Buffer bytes as the cost model counts them: the all-reduced tensor, the all-gather's output,
    the reduce-scatter's input, the all-to-all's buffer per rank, the message."""
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
    """:func:`time_collectives` over the whole default group, on the CPU."""
    return time_collectives(sizes, repeats)


def _collective_calls(op: str, nbytes: int, n: int, group, device):
    """``(call, bytes)``: one ``op`` over a group of ``n`` ranks moving about ``nbytes`` as the
    cost model counts them (the all-reduced buffer, the all-gather's output, the reduce-scatter's
    input, the all-to-all's buffer per rank), each through the call the runtime makes:
    :mod:`runtime.dist.comm`'s all-reduce, list all-gather and list reduce-scatter (the forms the
    runtime uses on gloo and NCCL alike; ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
    work on gloo too but warn of their deprecation in torch 2.13), and ``all_to_all_single`` as
    the Ulysses kernel (``runtime.kernels.context_parallel``) calls it."""
    import torch
    import torch.distributed as dist

    from runtime.dist import comm

    if op == "all_reduce":
        buf = torch.ones(max(1, nbytes // 4), device=device)
        return (lambda: comm.all_reduce(buf, group)), buf.numel() * 4
    per = max(1, nbytes // (4 * n))  # floats of one rank's part
    if op == "all_gather":
        mine, parts = torch.ones(per, device=device), [torch.empty(per, device=device) for _ in range(n)]
        return (lambda: comm.all_gather(parts, mine, group)), per * n * 4
    if op == "reduce_scatter":
        out, parts = torch.empty(per, device=device), [torch.ones(per, device=device) for _ in range(n)]
        return (lambda: comm.reduce_scatter(out, parts, group)), per * n * 4
    if op == "all_to_all":
        src, dst = torch.ones(per * n, device=device), torch.empty(per * n, device=device)
        return (lambda: dist.all_to_all_single(dst, src, group=group)), per * n * 4
    raise ConfigError(f"unknown collective {op!r}; choose one of {', '.join(COLLECTIVE_OPS)}")


def time_collectives(sizes: Sequence[int], repeats: int, *, ranks: Sequence[int] | None = None, group=None,
                     ops: Sequence[str] = COLLECTIVE_OPS, device: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """On every rank of ``ranks`` (global ranks; default: the whole world, ``group`` then the
    default group), members only: time each collective of ``ops`` at each size (bytes) over
    ``group``, and a send/recv ping-pong between the group's first two ranks; returns
    ``{op: [(bytes, s)], "send_recv": [(bytes, s)]}`` (the send/recv list only on the group's
    first rank). ``device``: where the buffers live (``cuda`` under NCCL; synchronised around
    every sample, :func:`device_synchronizer`).

    Every sample is ONE operation after a barrier, and the fastest of ``repeats`` is kept: a
    loop of many operations would average in the scheduling delays of other processes (a gloo
    message waits for both peers to be on a core), which on a loaded machine multiplied the time
    of a 4 KiB message by 10. Repeats go round-robin over the sizes (1, 2, ..., then again), so
    that a burst of load spoils one repeat of several sizes rather than every repeat of one.
    """
    import torch
    import torch.distributed as dist

    dev, sync = device_synchronizer(device)
    ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
    rank, n = dist.get_rank(), len(ranks)
    if rank not in ranks:
        raise ConfigError(f"time_collectives: rank {rank} is not in the timed group {list(ranks)}; call it on "
                          f"the group's members only")
    first, second = ranks[0], ranks[1] if n > 1 else None

    def ping_pong(buf: torch.Tensor) -> None:  # ranks other than the first two only wait at barriers
        if rank == first:
            dist.send(buf, dst=second)
            dist.recv(buf, src=second)
        elif rank == second:
            dist.recv(buf, src=first)
            dist.send(buf, dst=first)

    def ping_pong_call(nbytes: int):
        buf = torch.ones(max(1, nbytes // 4), device=dev)
        return (lambda: ping_pong(buf)), buf.numel() * 4

    timed = [(op, (lambda nb, op=op: _collective_calls(op, nb, n, group, dev)), 1) for op in ops]
    if n > 1:
        timed.append(("send_recv", ping_pong_call, 2))
    out: dict[str, list[tuple[int, float]]] = {}
    for name, make, messages in timed:
        calls = [make(nbytes) for nbytes in sizes]
        for call, _ in calls:
            call()  # warm-up: connections, buffers
        best = [math.inf] * len(calls)
        for _ in range(repeats):
            for i, (call, _) in enumerate(calls):
                dist.barrier(group=group)
                sync()
                start = time.perf_counter()
                call()
                sync()
                # a ping-pong is two messages: one way is half of it
                best[i] = min(best[i], (time.perf_counter() - start) / messages)
        out[name] = [(nbytes, t) for (_, nbytes), t in zip(calls, best)]
    if rank != first:
        out["send_recv"] = []  # only the first rank timed whole round trips
    dist.barrier(group=group)
    return out


@dataclass(frozen=True, kw_only=True)
class GlooMeasurement:
    """Communication timings on one group and the α-β fits of the cost model."""

    all_reduce: tuple[CommSample, ...]
    send_recv: tuple[CommSample, ...]
    all_reduce_fit: LinkFit
    send_recv_fit: LinkFit
    collectives: tuple[CommSample, ...] = ()
    """Samples of the collectives in :data:`~partitioner.cost.cluster.COLLECTIVE_FIT_OPS`
    (all-gather, reduce-scatter, all-to-all), every op's sizes in turn."""
    collective_fits: tuple[LinkFit, ...] = ()
    """One fit per op of :attr:`collectives` (none when they were not timed)."""

    def link(self, kind: str = "loopback") -> Link:
        """The :class:`Link` these fits describe: the all-reduce's α and β, and a fit of its own
        for every other collective timed (``Link.collectives``)."""
        base = self.all_reduce_fit.link(kind)
        return dataclasses.replace(base, collectives=tuple(f.collective_fit() for f in self.collective_fits))


def measure_gloo(world_size: int, sizes: Sequence[int] = COMM_SIZES, *, effort: Effort = FULL,
                 timeout_s: float = 120.0) -> GlooMeasurement:
    """Spawn ``world_size`` (>= 2) local gloo processes; time the collectives of :data:`COLLECTIVE_OPS`
    and ranks 0 ↔ 1 send/recv.

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
    """The samples and fits of :func:`time_collectives`' results on every rank of the group
    (index = rank in the group): a collective's time per size is the slowest rank's fastest
    repeat; send/recv is the first rank's."""
    world_size = len(per_rank)

    def samples(op: str) -> tuple[CommSample, ...]:
        return tuple(CommSample(op=op, world_size=world_size, nbytes=nbytes, seconds=max(r[op][i][1] for r in per_rank))
                     for i, (nbytes, _) in enumerate(per_rank[0][op]))

    def fit(op: str, timed: Sequence[CommSample]) -> LinkFit:
        return fit_alpha_beta([(c.nbytes, c.seconds) for c in timed], op, world_size)

    all_reduce = samples("all_reduce")
    send_recv = tuple(CommSample(op="send_recv", world_size=2, nbytes=nbytes, seconds=s)
                      for nbytes, s in per_rank[0]["send_recv"])
    others = {op: samples(op) for op in COLLECTIVE_FIT_OPS if per_rank[0].get(op)}
    return GlooMeasurement(
        all_reduce=all_reduce, send_recv=send_recv,
        all_reduce_fit=fit("all_reduce", all_reduce),
        send_recv_fit=fit_alpha_beta([(c.nbytes, c.seconds) for c in send_recv], "send_recv"),
        collectives=tuple(c for timed in others.values() for c in timed),
        collective_fits=tuple(fit(op, timed) for op, timed in others.items()))


# ---------------------------------------------------------------------------------------------
# The whole calibration
# ---------------------------------------------------------------------------------------------
