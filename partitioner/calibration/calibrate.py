"""Calibrate this machine: measure it (:mod:`partitioner.calibration.measure`), train a few
reference plans (:mod:`partitioner.calibration.reference_runs`), and write the cluster file that
:func:`partitioner.calibration.local.local_cluster` reads.

:func:`run_calibration` runs everything and writes a YAML cluster file (default: this machine's
cache file, :func:`partitioner.calibration.cache.local_cache_file`) with the measurements
summarized in its header comments, plus ``<file>.calibration.json`` next to it with every sample
and fit. A :class:`Recipe` says how much is measured: :data:`AUTO_RECIPE` is what
``local_cluster`` runs by itself the first time, :data:`JOB_RECIPE` what the ranks of a job run
together, :data:`FULL_RECIPE` what ``partitioner calibrate`` runs.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Sequence
from typing import Any
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from partitioner.calibration.detect import JobShape, job_shape
from partitioner.cost.cluster import Cluster, Device, DeviceEfficiency, Link, PeakFlops
from passes.ir.errors import ConfigError
from runtime.observe.measure import PhaseClock
from runtime.observe.progress import terminal_bar

from partitioner.calibration.measure import (
    COMM_OPS, COMM_SIZES, EfficiencyFit, Effort, FULL, GlooMeasurement, KiB, LinkFit, MATMUL_SIZES,
    MEMCPY_BYTES, MatmulSample, MemcpyMeasurement, MiB, QUICK, QUICK_COMM_SIZES, QUICK_MATMUL_SIZES,
    QUICK_MEMCPY_BYTES, cpu_count, cpu_name, fit_efficiency, gloo_measurement, host_memory_bytes,
    measure_gloo, measure_matmul, measure_memcpy, rank_threads, time_collectives,
)


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
    nodes: int = 1
    """Nodes of the job that measured it (``WORLD_SIZE / LOCAL_WORLD_SIZE``): with more than one,
    :attr:`gloo` was timed on the ranks of one node and :attr:`inter_node` across nodes."""
    inter_node: GlooMeasurement | None = None
    """Timings on a group of one rank per node (the cluster's ``inter_node`` link); None on one node."""

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
            "collectives": [asdict(s) for s in self.gloo.collectives],
            "collective_fits": {f.op: asdict(f) for f in self.gloo.collective_fits},
            "nodes": self.nodes,
            "inter_node": _comm_json(self.inter_node) if self.inter_node is not None else None,
            "cluster": self.cluster.to_dict(),
            "refit": ({k: v for k, v in asdict(self.refit).items() if k != "cluster"}
                      | {"runs_dirs": [str(d) for d in self.reference_dirs]} if self.refit is not None else None),
        }


def _comm_json(m: GlooMeasurement) -> dict:
    """The samples and fits of one group's timings as plain numbers."""
    return {"all_reduce": [asdict(s) for s in m.all_reduce], "send_recv": [asdict(s) for s in m.send_recv],
            "collectives": [asdict(s) for s in m.collectives], "all_reduce_fit": asdict(m.all_reduce_fit),
            "send_recv_fit": asdict(m.send_recv_fit), "collective_fits": {f.op: asdict(f) for f in m.collective_fits}}


def build_cluster(world_size: int, efficiency: dict[str, EfficiencyFit], memcpy: MemcpyMeasurement,
                  gloo: GlooMeasurement, *, threads_per_rank: int, host_memory: int | None = None,
                  name: str = "local-calibrated", inter_node: GlooMeasurement | None = None,
                  ranks_per_node: int | None = None) -> Cluster:
    """The one-node gloo cluster these measurements describe (a job of several nodes sets its
    shape on it: ``detect_cluster``).

    Device memory is host memory / ``ranks_per_node`` (default ``world_size``); the device's memory bandwidth is the copy's
    read+write rate; ``intra_node`` carries the all-reduce fit, since collectives dominate data
    and tensor parallelism, with the all-gather, reduce-scatter and all-to-all fits as its
    ``collectives`` (the send/recv fit is in the calibration JSON); ``inter_node`` is the same
    link on one node, else the fits of ``inter_node``'s timings across nodes (kind ``ethernet``:
    gloo between hosts is TCP); ``host_to_device`` is the copy rate with the small-copy latency.
    bf16 falls back to fp32's peak when not measured; tf32 = fp32, fp16 = bf16 (schema defaults).
    Each peak comes with the efficiency curve fitted against it (:func:`device_efficiency`), which
    the cost model prices the kernels with.
    The matmul rates are one rank's alone; ``compute_slots_per_node`` (cores over threads per
    rank) says how many ranks reach them at once.
    """
    host = host_memory if host_memory is not None else host_memory_bytes()
    fp32 = efficiency["fp32"].peak_flops_per_s
    bf16 = efficiency["bf16"].peak_flops_per_s if "bf16" in efficiency else fp32
    fp16 = efficiency["fp16"].peak_flops_per_s if "fp16" in efficiency else None
    link = gloo.link("loopback")
    return Cluster(
        name=name, nodes=1, devices_per_node=world_size, backend="gloo",
        device=Device(name=f"{cpu_name()} ({threads_per_rank} thread{'s' * (threads_per_rank > 1)} per rank)",
                      memory_bytes=host // (ranks_per_node or world_size),
                      memory_bandwidth_bytes_per_s=memcpy.memory_bandwidth_bytes_per_s,
                      peak_flops=PeakFlops(fp32=fp32, bf16=bf16, fp16=fp16),
                      efficiency=device_efficiency(efficiency)),
        intra_node=link, inter_node=inter_node.link("ethernet") if inter_node is not None else link,
        host_memory_bytes=host,
        host_to_device=Link(kind="loopback", bandwidth_bytes_per_s=memcpy.copy_bytes_per_s,
                            latency_s=memcpy.small_copy_s),
        compute_slots_per_node=max(1, cpu_count() // threads_per_rank))


def device_efficiency(efficiency: dict[str, EfficiencyFit]) -> DeviceEfficiency:
    """``Device.efficiency`` from the matmul fits per dtype: each fit's curve (relative to its own
    peak, which :func:`build_cluster` writes as the dtype's peak); bf16 takes fp32's curve when
    it was not measured, as it takes its peak; tf32 and fp16 the schema's defaults (fp32's,
    bf16's) unless measured."""
    curves = {d: f.curve for d, f in efficiency.items()}
    return DeviceEfficiency(fp32=curves["fp32"], bf16=curves.get("bf16", curves["fp32"]),
                            tf32=curves.get("tf32"), fp16=curves.get("fp16"))


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
    for where, m in (("", g), ("across nodes, ", cal.inter_node)):
        for fit in (m.all_reduce_fit, m.send_recv_fit, *m.collective_fits) if m is not None else ():
            lines.append(f"{where}{fit.op} ({fit.world_size} ranks): alpha {fit.latency_s * 1e6:.3g} us, "
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
    Cluster.from_file(path)  # what local_cluster will do: fail here rather than later
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
"""What ``local_cluster`` runs the first time: the reference runs, which carry most of what a
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
    ``local_cluster`` reads when ``$PARTITIONER_CLUSTER_FILE`` is unset), so a calibration
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
    """A bar over the calibration's phases (:func:`runtime.observe.progress.terminal_bar`); its
    description names the phase under way."""
    return terminal_bar(len(phases), unit="phase", desc=f"calibrate: {phases[0]}")


def _lap(clock: PhaseClock, bar, phases: Sequence[str]) -> None:
    """End phase ``phases[bar.n]``: its seconds on ``clock``, the bar one on, naming the next."""
    done = phases[bar.n]
    clock.lap(done)
    if bar.n + 1 < len(phases):
        bar.set_description_str(f"calibrate: {phases[bar.n + 1]}", refresh=False)
    bar.update(1)


def _default_out(world_size: int) -> Path:
    from partitioner.calibration.cache import local_cache_file

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
    # the peak stays anchored to the matmul microbenchmark (refit.PEAK_BOUNDS)
    result = refit([load_run(d, skip_first=skip) for d in dirs], cal.cluster,
                   matmul_flops_per_s={d: f.peak_flops_per_s for d, f in cal.efficiency.items()})
    return replace(cal, cluster=result.cluster, refit=result, reference_dirs=tuple(dirs))


def auto_calibrate(world_size: int, path: Path) -> Calibration:
    """What ``local_cluster`` runs on a cache miss: :data:`AUTO_RECIPE` for ``world_size`` ranks,
    written to ``path``."""
    return run_calibration(world_size, path, recipe=AUTO_RECIPE)


JOB_RECIPE = replace(AUTO_RECIPE, name="job", reference_steps=8)
"""What a job calibrates with its own ranks on a cache miss (:func:`calibrate_in_job`): the
automatic recipe with 8 steps per reference plan (2 of warm-up, 6 measured: with 2 the medians
moved 10-20% from one calibration to the next, step to step noise on shared cores that the refit
then charged to the latencies). Building each plan costs more than its steps, so the 4 extra
steps add about 2 s for 4 ranks on a shared 2-core machine (13 s with 4 steps)."""


def calibrate_in_job(path: Path, recipe: Recipe = JOB_RECIPE) -> Calibration:
    """Calibrate this machine with the ranks of the job that is running (every rank calls it,
    the default process group initialised, its world the calibration's): no process is started.

    Rank 0 times the matmuls and the copy alone (the other ranks wait, as a rank's compute is
    measured without contention: ``compute_slots_per_node`` models the sharing), the ranks time
    all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over sizes on the job's
    groups (:func:`job_comm_groups`: the world on one node; node 0's ranks and one rank per node
    when ``LOCAL_WORLD_SIZE`` says the job spans several, the latter fitting ``inter_node``),
    every rank trains the reference plans, and rank 0 fits,
    writes ``path`` (under the cache lock) and sends its :class:`Calibration` to the others:
    every rank returns the same one.
    """
    import torch.distributed as dist

    from partitioner.calibration.cache import exclusive_lock
    from partitioner.calibration.reference_runs import ReferenceResults, reference_plans, run_plans
    from runtime.dist import comm

    world, rank = dist.get_world_size(), dist.get_rank()
    start = time.perf_counter()
    clock = PhaseClock()
    shape = job_shape(world_size=world)  # nodes from the launcher's LOCAL_WORLD_SIZE
    threads = rank_threads(shape.local_world_size)  # a node's ranks share its cores
    matmul, efficiency, memcpy = None, None, None
    if rank == 0:
        matmul = measure_matmul(("fp32", "bf16"), recipe.matmul_sizes, threads=threads, effort=recipe.effort)
        efficiency = {d: fit_efficiency([(s.flops, s.seconds) for s in matmul if s.dtype == d])
                      for d in ("fp32", "bf16")}
        memcpy = measure_memcpy(recipe.memcpy_bytes, threads=threads, effort=recipe.effort)
    efficiency, memcpy = comm.broadcast_object((efficiency, memcpy), src=0)
    clock.lap("matmul + memcpy")
    groups = job_comm_groups(shape)
    timings = time_job_groups(groups, recipe.comm_sizes, recipe.effort.comm_repeats)
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
        gloo, inter = job_measurements(groups, [t for t, _ in gathered])
        cluster = build_cluster(world, efficiency, memcpy, gloo, threads_per_rank=threads, inter_node=inter,
                                ranks_per_node=shape.local_world_size)
        cal = Calibration(cluster=cluster, world_size=world, threads_per_rank=threads, matmul=tuple(matmul),
                          efficiency=efficiency, memcpy=memcpy, gloo=gloo, recipe=recipe.name, nodes=shape.nodes,
                          inter_node=inter)
        if recipe.reference_steps:
            results = ReferenceResults(comm=tuple(t.get("intra") or {} for t, _ in gathered),
                                       steps=tuple(tuple(s) for _, s in gathered))
            cal = _with_reference_runs(cal, path, recipe, results)
        clock.lap("refit")
        cal = replace(cal, elapsed_s=time.perf_counter() - start, phases=clock.seconds)
        with exclusive_lock(path):
            cal = replace(cal, path=write_calibration(cal, path))
    return comm.broadcast_object(cal, src=0)


@dataclass(frozen=True, kw_only=True)
class JobCommGroups:
    """The groups a job's calibration times its links on (global ranks, node-major).

    One node: the whole world is the intra-node group. Several nodes: the ranks of node 0 (the
    intra-node link; none when a node runs one rank) and one rank per node, each node's first
    (the inter-node link). One group of each kind, the other ranks waiting: a cluster's link is
    what one group gets on its own; ``cost_model.group_link`` shares a node's NICs among the
    groups that use them at once."""

    shape: JobShape
    intra: tuple[int, ...]
    """Ranks timed for ``intra_node``: node 0's (the world on one node); () with one rank per node."""
    inter: tuple[int, ...]
    """Ranks timed for ``inter_node``: one per node; () on one node."""


def job_comm_groups(shape: JobShape) -> JobCommGroups:
    """The groups of :class:`JobCommGroups` for a job of ``shape``."""
    local = shape.local_world_size
    intra = tuple(range(local)) if local > 1 else ()
    inter = tuple(range(0, shape.world_size, local)) if shape.nodes > 1 else ()
    return JobCommGroups(shape=shape, intra=intra, inter=inter)


def time_job_groups(groups: JobCommGroups, sizes: Sequence[int], repeats: int, *, device: str | None = None,
                    timeout_s: float = 120.0) -> dict[str, dict | None]:
    """On every rank of the job: time the collectives (:func:`time_collectives`) on the intra-node
    group, then on the inter-node group, this rank's part of each (``None`` where it is not a
    member). Every rank makes both groups (``new_group`` is collective) and meets the others at
    a barrier after each, so the groups are timed one after the other on a quiet job."""
    import torch.distributed as dist

    from runtime.dist import comm

    rank = dist.get_rank()
    out: dict[str, dict | None] = {"intra": None, "inter": None}
    for name, ranks in (("intra", groups.intra), ("inter", groups.inter)):
        if not ranks:
            continue
        whole = len(ranks) == groups.shape.world_size
        group = None if whole else comm.new_group(ranks, timeout_s=timeout_s)
        if rank in ranks:
            out[name] = time_collectives(sizes, repeats, ranks=ranks, group=group, device=device)
        dist.barrier()
    return out


def job_measurements(groups: JobCommGroups, per_rank: Sequence[dict]) -> tuple[GlooMeasurement,
                                                                               GlooMeasurement | None]:
    """``(intra-node, inter-node)`` measurements from every rank's :func:`time_job_groups` result
    (index = global rank). With one rank per node the inter-node fits serve as both (the
    intra-node link is never used); a job of one rank gets :func:`_no_peers`."""
    def of(key: str, ranks: tuple[int, ...]) -> GlooMeasurement | None:
        return gloo_measurement([per_rank[r][key] for r in ranks]) if ranks else None

    intra, inter = of("intra", groups.intra), of("inter", groups.inter)
    if intra is None:
        return (inter, inter) if inter is not None else (_no_peers(), None)
    return intra, inter


def _no_peers() -> GlooMeasurement:
    """A one-rank job sends nothing: its links are the ``local-cpu`` preset's (never priced)."""
    link = Cluster.preset("local-cpu").intra_node
    fits = {op: LinkFit(op=op, world_size=2, latency_s=link.latency_s, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s)
            for op in COMM_OPS}
    return GlooMeasurement(all_reduce=(), send_recv=(), all_reduce_fit=fits["all_reduce"],
                           send_recv_fit=fits["send_recv"])


def calibrate(world_size: int = 4, out: str | Path | None = None, quick: bool = False) -> Cluster:
    """Measure this machine for ``world_size`` local gloo ranks and write the cluster file that
    ``local_cluster`` reads (default: this machine's cache file); returns it.

    See :func:`run_calibration` for the measurements and fits behind it.
    """
    return run_calibration(world_size, out, quick).cluster
