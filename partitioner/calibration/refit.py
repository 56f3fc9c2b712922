"""Refit the cost model's efficiency terms from training runs (``partitioner calibrate --from-run``).

A run directory holds ``plan.json`` (the :class:`passes.ir.plan.Plan` that ran, with its
per-stage predicted seconds) and ``measurements.json`` (:class:`runtime.observe.measure.RunMeasurements`:
per-rank, per-step compute / p2p / optimizer seconds). After the warm-up step, in order:

Compute slots (``Cluster.compute_slots_per_node``, CPU ranks sharing cores): before any fit,
each run's compute and optimizer seconds are divided by how much sharing the cores slowed its
ranks (:func:`sharing_slowdown`), since the planner prices that in its own ``contention`` term.

* **peak FLOP/s, memory-bound rate and per-op overhead** (``Device.memory_bound_bytes_per_s``,
  ``Device.kernel_overhead_s``): a stage's predicted seconds per micro-batch are
  ``A·x + M·y + C + K·o`` (``A``: the FLOP-rate part, ``x`` = 1 / FLOP/s scale; ``M``: its
  memory-bound nodes' seconds, ``y`` = 1 / their rate's scale; ``C``: the efficiency curve's
  per-kernel constant; ``K``: operators, forward and backward; ``o``: the per-op overhead), all
  read off the planner itself. ``(x, y, o) >= 0`` minimise the squared relative error against
  each rank's measured forward+backward seconds per micro-batch (runs without tensor parallelism
  when there are any: the runtime's compute seconds include tp collectives). At small sizes ``o``
  (framework dispatch) dominates, which one FLOP/s number cannot carry across micro-batch sizes
  and stage depths; what grows with the micro-batch beyond the matmuls is mostly the
  elementwise, norm and softmax nodes, which one thread runs well below the memcpy rate. The
  peak stays within :data:`PEAK_BOUNDS` of what the matmul microbenchmark measured
  (:func:`peak_scale_bounds`), the memory-bound rate within :data:`MEMORY_BOUND_BOUNDS` of the
  memcpy (:func:`memory_bound_scale_bounds`), each weakly anchored to its measurement
  (:data:`ANCHOR_WEIGHTS`): ``o`` and the later terms carry the rest. The rates are kept only
  when they remove a quarter of the compute error the measured rates leave
  (:data:`MIN_RATE_GAIN`): runs that are mostly dispatch cannot tell them, and a large model's
  step is mostly those rates.
* **optimizer stream rate and per-tensor seconds** (``Device.optimizer_bytes_per_s``,
  ``Device.optimizer_tensor_s``): the planner's optimizer term is streamed bytes plus a cost per
  tensor stepped; both scales by non-negative least squares over the runs' median measured
  ``optimizer_s`` (:func:`_fit_optimizer`; the rate alone when the runs cannot tell them apart).
  The memory bandwidth itself (the memcpy, a matmul's bytes on the roofline) stays measured.
* **offload call seconds** (``Device.offload_call_s``), from runs with activation offload
  (without checkpointing when there are such): their measured forward+backward seconds per
  micro-batch less the planner's stage time without the per-call cost, over the stage's copies
  (two per offloaded tensor); median over ranks.
* **pipeline message seconds** (``Cluster.p2p_latency_s``, in place of the link α for pipeline
  sends): each pipelined rank's measured send/receive seconds (post + wait) against the
  planner's ``pp_comm + bubble``; per run the median of the per-rank solutions, then the
  smallest over runs (the other runs' waits carry a partner's unmodelled slowness).
* **collective latencies** and **step overhead** (``Device.step_overhead_s``), last
  (:func:`_fit_latency`): first the latency of the collectives over data-parallel ranks and
  between stages (the gradient buckets, ZeRO's gathers, the tied-weight sync, the loss
  all-reduce) from the runs without tensor or context parallelism, then the link-latency
  multiplier (intra- and inter-node α: the tp and cp collectives inside forward and backward)
  from the runs with them, the first kept as ``Cluster.sync_latency_scale`` over the second;
  each the multiplier (powers of √2) whose predicted STEP times have the smallest mean
  |log(predicted/measured)| over its runs, with the terms above fixed and, for each candidate,
  the step overhead set to the median over ranks of the measured ``other_s`` (batch slicing,
  ``zero_grad``, the loss all-reduce) less the planner's loss all-reduce at that latency. Runs
  all of one kind fit one multiplier for both. Beside the step-end multiplier, at each candidate,
  a fixed wait per synchronising call at the step's end (``Cluster.step_end_wait_s``, counted
  by ``plan_cost.step_end_calls``, within :data:`STEP_END_WAIT_BOUNDS`): on shared cores each
  such call waits for its group's last rank, a cost per call rather than per α.

Medians where one rank is one sample, so one slow rank (a noisy neighbour) does not move the fit.
The presets keep every overhead at 0 / None, so the planner's results on them do not change.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence


from partitioner.cost.cluster import Cluster, PeakFlops
from partitioner.cost.cost_model import memory_bound_rate
from partitioner.search.plan_cost import scalar_all_reduce_time, step_end_scalars
from passes.ir.errors import ConfigError
from passes.ir.plan import Plan



@dataclass(frozen=True, kw_only=True)
class RunData:
    """One run: its plan and, per rank, median measured seconds (warm-up step skipped)."""

    plan: Plan
    compute_per_mb_s: tuple[float, ...]
    """Per rank: forward+backward seconds per micro-batch (median over steps)."""
    optimizer_s: tuple[float, ...]
    """Per rank: optimizer step seconds (median over steps)."""
    step_s: tuple[float, ...]
    """Per rank: wall seconds of a step (median over steps)."""
    p2p_s: tuple[float, ...] = ()
    """Per rank: seconds posting, and waiting on, pipeline sends and receives (median over steps)."""
    other_s: tuple[float, ...] = ()
    """Per rank: the rest of the step (``StepMeasurement.other_s``: batch slicing, ``zero_grad``,
    the loss all-reduce; median over steps)."""
    collective_s: tuple[float, ...] = ()
    """Per rank: the step's gradient all-reduces (``StepMeasurement.collective_s``; median over steps)."""


@dataclass(frozen=True, kw_only=True)
class Refit:
    """The refitted cluster and how it moved (ratios are measured / predicted before the refit)."""

    cluster: Cluster
    flops_scale: float
    """New peak FLOP/s over old."""
    bandwidth_scale: float
    """New optimizer stream rate (``Device.optimizer_bytes_per_s``) over old."""
    latency_scale: float
    """New link latency (intra- and inter-node) over old."""
    compute_ratio_before: float
    compute_ratio_after: float
    step_log_error: float
    """Median |log(predicted / measured step seconds)| over the runs after the refit."""
    runs: int
    kernel_overhead_s: float = 0.0
    """Fitted framework seconds per dispatched operator (``Device.kernel_overhead_s``)."""
    memory_bound_scale: float = 1.0
    """Fitted rate of the memory-bound nodes (``Device.memory_bound_bytes_per_s``) over the measured
    memory bandwidth (the memcpy), within :data:`MEMORY_BOUND_BOUNDS`."""
    p2p_latency_s: float | None = None
    """Fitted seconds per pipeline message (``Cluster.p2p_latency_s``)."""
    step_overhead_s: float = 0.0
    """Fitted host seconds per step (``Device.step_overhead_s``)."""
    offload_call_s: float = 0.0
    """Fitted seconds per offloaded tensor per copy (``Device.offload_call_s``)."""
    optimizer_tensor_s: float = 0.0
    """Fitted optimizer seconds per tensor stepped (``Device.optimizer_tensor_s``)."""
    sync_latency_scale: float | None = None
    """Fitted multiplier of the (refitted) link α for the step-end collectives
    (``Cluster.sync_latency_scale``); ``None`` when the runs cannot tell them from the
    tensor-parallel ones (all or none have tp or cp)."""
    step_end_wait_s: float = 0.0
    """Fitted seconds each synchronising call at the step's end waits, once per call
    (``Cluster.step_end_wait_s``), within :data:`STEP_END_WAIT_BOUNDS`."""

    def overheads_text(self) -> str:
        """The fitted overheads in one line, as the CLI and the calibration file's header print them."""
        sync = f"x{self.sync_latency_scale:.3g}" if self.sync_latency_scale is not None else "x1"
        return (f"per-op overhead {self.kernel_overhead_s * 1e6:.3g} us, memory-bound ops at "
                f"x{self.memory_bound_scale:.3g} the memcpy rate, pipeline message "
                f"{(self.p2p_latency_s or 0.0) * 1e3:.3g} ms, step-end collectives {sync} the link's α "
                f"+ {self.step_end_wait_s * 1e3:.3g} ms a call, step overhead "
                f"{self.step_overhead_s * 1e3:.3g} ms, offload call {self.offload_call_s * 1e6:.3g} us, "
                f"optimizer {self.optimizer_tensor_s * 1e6:.3g} us a tensor")


def load_run(path: str | Path, skip_first: int = 1) -> RunData:
    """Read ``plan.json`` and ``measurements.json`` of run directory ``path``."""
    path = Path(path)
    plan_file, meas_file = path / "plan.json", path / "measurements.json"
    for f in (plan_file, meas_file):
        if not f.is_file():
            raise ConfigError(f"refit: {f} is missing; a run directory needs plan.json and measurements.json "
                              f"(write them with RunMeasurements.write and Plan.to_json)")
    plan = Plan.from_json(plan_file.read_text())
    data = json.loads(meas_file.read_text())
    steps = data.get("steps")
    if not steps or not all(steps):
        raise ConfigError(f"refit: {meas_file} has no steps; run at least two steps")
    comp, opt, wall, p2p, other, coll = [], [], [], [], [], []
    for rank_steps in steps:
        kept = rank_steps[skip_first:] or rank_steps
        comp.append(statistics.median(s["compute_s"] for s in kept) / plan.num_micro_batches)
        opt.append(statistics.median(s["optimizer_s"] for s in kept))
        wall.append(statistics.median(s["wall_s"] for s in kept))
        other.append(statistics.median(s.get("other_s", 0.0) for s in kept))
        coll.append(statistics.median(s.get("collective_s", 0.0) for s in kept))
        p2p.append(statistics.median(s.get("recv_wait_s", 0.0) + s.get("send_wait_s", 0.0) + s.get("p2p_post_s", 0.0)
                                     for s in kept))
    if len(steps) != plan.world_size:
        raise ConfigError(f"refit: {meas_file} has {len(steps)} ranks but plan.json needs {plan.world_size}")
    return RunData(plan=plan, compute_per_mb_s=tuple(comp), optimizer_s=tuple(opt), step_s=tuple(wall),
                   p2p_s=tuple(p2p), other_s=tuple(other), collective_s=tuple(coll))


def _pp_index(plan: Plan, rank: int) -> int:
    return rank // (plan.config.dp_cp * plan.tp)  # runtime.dist.mesh: tp fastest, then dp x cp, then pp


def _reevaluate(plan: Plan, cluster: Cluster, profiles: dict) -> Plan:
    from partitioner.search.replay import predict_step_time
    from partitioner.search.profile import profile_model

    tensor = plan.knobs().get("checkpointing") == "tensor"  # priced only for the runs that used it
    key = (plan.model, _dtype(plan), tensor)
    if key not in profiles:
        profiles[key] = profile_model(plan.model, dtype=_dtype(plan), tensor_remat=tensor)
    return predict_step_time(profiles[key], cluster, plan.knobs(), global_batch=plan.global_batch)


def _dtype(plan: Plan) -> str:
    return plan.config.dtype  # a 16-bit plan ran the model captured in that dtype


def _compute_ratio(runs: Sequence[RunData], plans: Sequence[Plan]) -> float:
    # The runtime's compute seconds include the tp collectives (and offload copies) called inside
    # forward/backward; runs without them (_plain) give the kernels alone, so they are used when
    # there are any, and the link-latency fit then accounts for the collectives.
    plain = {id(r) for r in _plain(runs)}
    pure = [(r, p) for r, p in zip(runs, plans) if id(r) in plain]
    ratios = []
    for run, plan in (pure or list(zip(runs, plans))):
        for rank, measured in enumerate(run.compute_per_mb_s):
            predicted = plan.stages[_pp_index(plan, rank)].time_s
            if predicted > 0 and measured > 0:
                ratios.append(measured / predicted)
    if not ratios:
        raise ConfigError("refit: no rank has both a measured and a predicted compute time")
    return statistics.median(ratios)


def _scaled(cluster: Cluster, flops: float, bandwidth: float) -> Cluster:
    pf = cluster.device.peak_flops
    scaled = PeakFlops(**{f.name: (getattr(pf, f.name) * flops if getattr(pf, f.name) else getattr(pf, f.name))
                          for f in dataclasses.fields(pf)})
    device = dataclasses.replace(cluster.device, peak_flops=scaled,
                                 memory_bandwidth_bytes_per_s=cluster.device.memory_bandwidth_bytes_per_s * bandwidth)
    return dataclasses.replace(cluster, device=device, name=f"{cluster.name}+refit")


_KEEP = object()

PEAK_BOUNDS = (0.5, 2.0)
"""How far the refit may move the compute peak from the FLOP/s the matmul microbenchmark measured
(its large square matmuls, ``EfficiencyFit.peak_flops_per_s``): a factor in ``[0.5, 2]``.

The microbenchmark times the kernels the runs' large matmuls call (``torch.matmul``, same dtype,
same threads per rank), so the peak is a measurement, not a free knob. What makes a training
step's compute slower than that rate is priced by other terms: small kernels by the efficiency
curve, dispatch by the per-op overhead, cores shared between ranks by ``contention``. The
reference model is small (its FLOP time is a minority of its compute seconds next to the
per-kernel and per-op constants), so the fitted peak is weakly identified: unbounded, a few
percent of error, noise in one rank, or a per-kernel constant the planner over-prices let the fit
use the peak as a stand-in for those constants and move it by x1000 (a 2-core CPU shown at
162 TFLOP/s). A factor of 2 either way still covers what the measurement itself can be off by on a
shared machine (a neighbour slowing the microbenchmark, turbo, the cache state of a loop) and the
planner's efficiency curve being a GPU default rather than this machine's (peak efficiency 0.75
against the ~1 measured on CPUs)."""


def peak_scale_bounds(cluster: Cluster, matmul_flops_per_s: float | None, dtype: str = "fp32") -> tuple[float, float]:
    """The factors on ``cluster``'s peak FLOP/s (``dtype``) the refit may choose: those that keep it
    within :data:`PEAK_BOUNDS` of ``matmul_flops_per_s`` (the microbenchmark's measured FLOP/s for
    that dtype; ``None``: the cluster's own peak, taken as the measurement)."""
    peak = cluster.device.peak_flops.for_dtype(dtype)
    anchor = peak if matmul_flops_per_s is None else float(matmul_flops_per_s)
    if not (peak > 0 and anchor > 0):
        raise ConfigError(f"refit: the peak FLOP/s ({peak:g}) and the measured matmul FLOP/s ({anchor:g}) must "
                          f"be > 0; re-run `partitioner calibrate`")
    return PEAK_BOUNDS[0] * anchor / peak, PEAK_BOUNDS[1] * anchor / peak


MEMORY_BOUND_BOUNDS = (1 / 16, 2.0)
"""Where the refit may put the rate of the graph's memory-bound nodes (``Device.memory_bound_bytes_per_s``),
as a factor of the memcpy's read+write rate the calibration measured (``memory_bandwidth_bytes_per_s``):
``[1/16, 2]``.

The memcpy streams one large buffer through every thread a rank has; a rank's elementwise,
normalising and softmax nodes run on small tensors in one thread and mostly do arithmetic per
element (erf, exp, a mean and a variance). Timed on this 2-core machine at the reference model's
sizes (16 KiB to 1 MiB, one thread, dispatch left out): copies and adds ran 1.5-5x the 19 GB/s
DRAM memcpy (the tensors sit in cache), GELU, layer norm and softmax forwards 1/5 to 1/2 of it,
their backwards slower still. 1/16 leaves the slowest of those a factor of 2 for a neighbour on a
shared machine; 2 admits the cached copies without letting the rate, nearly collinear with the FLOP
rate across micro-batch sizes, run off where the runs say little."""

ANCHOR_WEIGHTS = (0.05, 0.01)
"""Weights of ``log(peak / measured matmul FLOP/s)`` and ``log(memory-bound rate / memcpy rate)`` in
the compute refit's residuals (each rank's relative error is one residual): moving the peak by x2
costs what a 3.5% error on one rank does, the memory-bound rate x2 what a 0.7% error does. The peak
is measured on the very kernels the runs call, the memcpy is not what an elementwise op does: the
runs move the second far more easily. Mostly the direction the runs cannot resolve (the FLOP and
memory-bound parts both grow with the micro-batch) is decided by them. Without a matmul
measurement (``refit(matmul_flops_per_s=None)``) the peak has no anchor: it moves within its
bounds first, the memory-bound rate only for what the peak cannot explain."""


def memory_bound_scale_bounds(cluster: Cluster) -> tuple[float, float]:
    """The factors on ``cluster``'s memory-bound rate (``cost_model.memory_bound_rate``) the refit
    may choose: those that keep it within :data:`MEMORY_BOUND_BOUNDS` of the measured memory
    bandwidth (``Device.memory_bandwidth_bytes_per_s``, the calibration's memcpy)."""
    dev = cluster.device
    rate = memory_bound_rate(dev)
    return (MEMORY_BOUND_BOUNDS[0] * dev.memory_bandwidth_bytes_per_s / rate,
            MEMORY_BOUND_BOUNDS[1] * dev.memory_bandwidth_bytes_per_s / rate)


def _with_memory_bound_scale(cluster: Cluster, y: float) -> Cluster:
    """``cluster`` with its memory-bound nodes' rate divided by ``y`` (``Device.memory_bound_bytes_per_s``)."""
    if y == 1.0:
        return cluster
    return _with_device(cluster, memory_bound_bytes_per_s=memory_bound_rate(cluster.device) / y)


def measured_matmul_flops(cluster_file: str | Path) -> dict[str, float]:
    """Per dtype, the FLOP/s the matmul microbenchmark measured, from ``<cluster_file>.calibration.json``
    (what ``partitioner calibrate`` writes beside a cluster file; a refitted cluster's own peak is
    no measurement); empty without one."""
    f = Path(str(cluster_file) + ".calibration.json")
    try:
        return {d: float(fit["peak_flops_per_s"]) for d, fit in json.loads(f.read_text())["efficiency"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def sharing_slowdown(run: RunData, cluster: Cluster) -> float:
    """How much slower a rank of ``run`` computed than alone because a node's ranks shared its
    compute slots (``Cluster.compute_slots_per_node``): the ranks' measured busy seconds
    (compute and optimizer) per node, over the part of the step they could spread them over (wall
    less the gradient all-reduces and the rest of the step, which every rank waits in together),
    is how many computed at once on average; beyond the slots each ran at ``slots / that`` of
    its rate. 1 without slots, or with a slot for every rank of a node."""
    ranks, slots = len(run.compute_per_mb_s), cluster.compute_slots_per_node
    per_node = min(ranks, cluster.devices_per_node)
    if slots is None or slots >= per_node:
        return 1.0
    m = run.plan.num_micro_batches
    busy = (sum(c * m for c in run.compute_per_mb_s) + sum(run.optimizer_s)) * per_node / ranks
    spans = [w - c - o for w, c, o in zip(run.step_s, run.collective_s or (0.0,) * ranks, run.other_s or (0.0,) * ranks)]
    span = statistics.median(spans)
    return max(1.0, busy / span / slots) if span > 0 else 1.0


def _uncontended(runs: Sequence[RunData], cluster: Cluster) -> list[RunData]:
    """``runs`` with every rank's compute and optimizer seconds divided by the run's
    :func:`sharing_slowdown`: what the planner's compute terms price (it adds the sharing back
    as ``StepTimeTerms.contention``), so that the fitted FLOP rate and overheads do not count it
    twice."""
    out = []
    for run in runs:
        k = sharing_slowdown(run, cluster)
        out.append(run if k == 1.0 else dataclasses.replace(
            run, compute_per_mb_s=tuple(c / k for c in run.compute_per_mb_s),
            optimizer_s=tuple(o / k for o in run.optimizer_s)))
    return out


def _plain(runs: Sequence[RunData]) -> list[RunData]:
    """Runs whose compute seconds are kernels alone: no tensor parallelism (its collectives run
    inside forward/backward) and no activation offload (its copies and saved-tensor hooks run
    inside them too, and belong to the planner's ``offload`` term). Checkpointed runs stay: their
    recompute is operators the planner counts."""
    return [r for r in runs if r.plan.tp == 1 and r.plan.offload != "activations"]


def _with_overheads(cluster: Cluster, kernel_s: float | None = None, p2p_s=_KEEP) -> Cluster:
    """``cluster`` with the per-kernel overhead and the pipeline per-message seconds replaced."""
    device = cluster.device if kernel_s is None else dataclasses.replace(cluster.device, kernel_overhead_s=kernel_s)
    return dataclasses.replace(cluster, device=device,
                               p2p_latency_s=cluster.p2p_latency_s if p2p_s is _KEEP else p2p_s)


def _nnls(rows: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    """Least squares ``Σ_j a_j·x_j ≈ t`` over ``rows`` of ``(a_1, .., a_n, t)`` with every
    ``x_j >= 0`` (``scipy.optimize.nnls``), among the solutions whose free (non-zero) unknowns
    the rows can tell apart (:func:`_separable`): a split between nearly collinear columns (one
    micro-batch size, one stage depth) would be noise. Of equally good solutions the one with
    more free unknowns, then the earlier ones (a fit that one FLOP rate explains keeps ``x_1``).
    Without any such solution, all zeros."""
    import numpy as np

    m = np.asarray(rows, dtype=np.float64)
    a, t = m[:, :-1], m[:, -1]
    x, _, _ = _nnls_separable(a, t, tuple(range(a.shape[1])), {})
    return tuple(float(v) for v in x)


def _nnls_separable(a, t, cols: tuple[int, ...], memo: dict):
    """(x, squared error, free unknowns): the best separable non-negative least squares over
    columns ``cols`` of ``a`` (the others held at 0). scipy's solution is the answer when
    ``cols`` are separable (it is then unique). Otherwise every separable support lies in
    ``cols`` less one column (separable sets are closed under taking subsets: Fischer's
    inequality), so the best of scipy's solution (when its support is separable) and of those
    smaller problems is."""
    import numpy as np
    from scipy.optimize import nnls

    if cols in memo:
        return memo[cols]
    x = np.zeros(a.shape[1])
    if cols:
        x[list(cols)] = nnls(a[:, list(cols)], t)[0]
    support = tuple(c for c in cols if x[c] > 0)
    found = [(x, float(((a @ x - t) ** 2).sum()), support)] if _separable(a[:, list(support)]) else []
    if not (found and _separable(a[:, list(cols)])):
        found += [_nnls_separable(a, t, tuple(c for c in cols if c != drop), memo) for drop in cols]
    best = found[0]
    for cand in found[1:]:
        tie = abs(cand[1] - best[1]) <= 1e-12 * max(cand[1], best[1]) + 1e-15
        if cand[1] < best[1] and not tie or tie and (-len(cand[2]), cand[2]) < (-len(best[2]), best[2]):
            best = cand
    memo[cols] = best
    return best


def _separable(cols) -> bool:
    """Whether columns ``cols`` (of the rows) can be told apart: their Gram determinant above
    1e-6 of the product of its diagonal (1 for orthogonal columns, 0 for dependent ones); a column
    of zeros (an unknown the rows never exercise) cannot."""
    import numpy as np

    gram = cols.T @ cols
    scale = float(np.prod(np.diagonal(gram)))
    return cols.shape[1] == 0 or (scale > 0 and float(np.linalg.det(gram)) > 1e-6 * scale)


def _fit_compute(runs: Sequence[RunData], cluster: Cluster, profiles: dict,
                 x_bounds: tuple[float, float] = (1e-3, 1e4),
                 y_bounds: tuple[float, float] = (1.0, 1.0),
                 anchors: tuple[float | None, float | None] = (None, None)) -> tuple[float, float, float]:
    """(1 / FLOP/s scale, 1 / memory-bound rate scale, per-op overhead seconds) fitted to measured
    compute per micro-batch.

    A stage's predicted seconds per micro-batch are ``A·x + M·y + C + K·o``: ``A`` the FLOP-rate
    part (scales with 1/peak), ``M`` its memory-bound nodes' seconds (scale with 1/their rate,
    ``cost_model.memory_bound_rate``), ``C`` the curve's per-kernel constant, ``K`` its operators
    (forward and backward) and ``o`` the per-op overhead. ``A``, ``M``, ``C`` and ``K`` are read
    off the planner by evaluating each plan at peak x1 and x2, at memory-bound rate x2 and with a
    unit overhead, so the model is exactly the planner's; (x, y, o) >= 0 minimise the squared
    RELATIVE error over ranks (runs without tensor parallelism or offload when there are any, see
    :func:`_plain`), ``x`` within ``x_bounds`` (:func:`peak_scale_bounds`) and ``y`` within
    ``y_bounds`` (:func:`memory_bound_scale_bounds`; ``(1, 1)``: the rate kept); an unknown held
    at the bound it crosses, the others refitted."""
    base = _with_overheads(cluster, 0.0)
    pure = _plain(runs) or list(runs)
    p1 = [_reevaluate(r.plan, base, profiles) for r in pure]
    p2 = [_reevaluate(r.plan, _scaled(base, 2.0, 1.0), profiles) for r in pure]
    pm = [_reevaluate(r.plan, _with_memory_bound_scale(base, 0.5), profiles) for r in pure]
    pk = [_reevaluate(r.plan, _with_overheads(base, 1e-3), profiles) for r in pure]
    rows = []
    for run, a, b, m, k in zip(pure, p1, p2, pm, pk):
        for rank, measured in enumerate(run.compute_per_mb_s):
            i = _pp_index(run.plan, rank)
            t1, t2, tm, tk = a.stages[i].time_s, b.stages[i].time_s, m.stages[i].time_s, k.stages[i].time_s
            flop_part, mem_part, kernels = 2 * (t1 - t2), 2 * (t1 - tm), (tk - t1) / 1e-3
            const = t1 - flop_part - mem_part
            if measured > 0:
                rows.append((flop_part / measured, mem_part / measured, kernels / measured, 1 - const / measured))
    if not rows:
        raise ConfigError("refit: no rank has a measured compute time")
    fit = _fit_rows(rows, pure, base, profiles, x_bounds, y_bounds, anchors)
    # the rates keep their measurements unless moving them explains what the per-op overhead
    # alone cannot (:data:`MIN_RATE_GAIN`)
    held = tuple(_held(b, a) for b, a in zip((x_bounds, y_bounds), anchors))
    if held == (x_bounds, y_bounds):
        return fit
    kept = _fit_rows(rows, pure, base, profiles, *held, anchors)
    moved, measured = (statistics.median(abs(e) for e in _compute_errors(pure, base, profiles, *z)) for z in (fit, kept))
    return fit if moved < (1 - MIN_RATE_GAIN) * measured else kept


def _fit_rows(rows, pure, base: Cluster, profiles: dict, x_bounds, y_bounds, anchors) -> tuple[float, float, float]:
    """(x, y, o) of :func:`_fit_compute`'s ``rows``: the bounded linear solution (one trimming
    pass), refined on the planner itself (:func:`_refine_compute`)."""
    # the linear start holds y at 1 (the rate the cluster has): across micro-batch sizes the FLOP
    # and the memory-bound parts grow alike, and a split of nearly collinear columns would be
    # noise; the refinement frees it, anchored to the measurements (:func:`_refine_compute`)
    y0 = min(max(1.0, y_bounds[0]), y_bounds[1])
    bounds = (x_bounds, (y0, y0), (0.0, math.inf))
    z = _bounded_nnls(rows, bounds)
    # one trimming pass: ranks whose relative error is far above the typical one (a run a
    # neighbour slowed down, a mechanism with its own overhead) do not pull the fit
    res = [abs(sum(c * v for c, v in zip(row, z)) - row[-1]) for row in rows]
    cut = max(3 * statistics.median(res), 0.05)
    kept = [row for row, r in zip(rows, res) if r <= cut]
    if len(kept) >= 2 and len(kept) < len(rows):
        z = _bounded_nnls(kept, bounds)
    return _refine_compute(pure, base, profiles, *z, x_bounds=x_bounds, y_bounds=y_bounds, anchors=anchors)


MIN_RATE_GAIN = 0.25
"""How much of the compute error (median over ranks of |predicted / measured − 1|) that remains
with the peak FLOP/s and the memory-bound rate at their microbenchmarks' values the refitted
rates must remove to be kept: a quarter; otherwise the rates stay measured and the per-op
overhead alone is fitted.

Runs whose compute is mostly per-op dispatch cannot tell a rate: the calibration's reference GPT
(hidden 64) spends about 5% of its seconds on FLOPs. Two calibrations of one idle machine fitted
its peak at x0.81 and x1.81 of the same measured matmul rate and the memory-bound rate at x0.38
and x2 (the bound) of the memcpy; five refits of such runs, freed, moved the peak from x0.72 to
x2.0 and the memory-bound rate from x0.1 to x2.0 while their step error changed by -0.06 to
+0.01 against the measured rates. Carried to a model whose steps are 90% matmuls (a 30-layer,
576-wide Llama), a doubled peak halves its predicted compute. Runs that do tell a rate (its part
varies across micro-batch sizes and stage depths differently from the operator count) fit it
far better than the measured value does, and keep it."""


def _held(bounds: tuple[float, float], anchor: float | None) -> tuple[float, float]:
    """A rate's scale held at ``anchor`` (its microbenchmark's; ``None``: 1, the cluster's own
    rate), kept inside ``bounds``."""
    a = min(max(1.0 if anchor is None else anchor, bounds[0]), bounds[1])
    return a, a


def _compute_errors(runs: Sequence[RunData], base: Cluster, profiles: dict, x: float, y: float, o: float) -> list[float]:
    """Per rank of ``runs``, predicted / measured − 1 of the compute seconds per micro-batch on
    ``base`` with the peak scaled by ``1 / x``, the memory-bound rate by ``1 / y`` and ``o``
    seconds per op."""
    cluster = _with_overheads(_with_memory_bound_scale(_scaled(base, 1 / x, 1.0), y), o)
    plans = [_reevaluate(run.plan, cluster, profiles) for run in runs]
    return [plans[k].stages[_pp_index(run.plan, rank)].time_s / measured - 1
            for k, run in enumerate(runs) for rank, measured in enumerate(run.compute_per_mb_s) if measured > 0]


def _bounded_nnls(rows: Sequence[tuple[float, ...]], bounds: Sequence[tuple[float, float]]) -> tuple[float, ...]:
    """:func:`_nnls` of the unknowns with each held inside its ``bounds`` (lower, upper): an
    unknown the free solution puts outside them is clamped to the bound it crosses and the others
    refitted with it held there (the per-op overhead carries what the peak may not), until none
    crosses. An unknown whose bounds are equal is held from the start."""
    n = len(bounds)
    held: dict[int, float] = {j: lo for j, (lo, hi) in enumerate(bounds)
                               if math.isfinite(hi) and hi - lo <= 1e-12 * max(abs(hi), 1.0)}
    while True:
        free = [j for j in range(n) if j not in held]
        sol = dict(held)
        if free:
            fitted = _nnls([tuple(row[j] for j in free) + (row[-1] - sum(row[j] * v for j, v in held.items()),)
                            for row in rows])
            sol.update(zip(free, fitted))
        out = [j for j in free if not bounds[j][0] <= sol[j] <= bounds[j][1]]
        if not out:
            return tuple(sol[j] for j in range(n))
        # hold the one furthest outside its bounds (in log terms), then refit the rest
        def excess(j: int) -> float:
            lo, hi = bounds[j]
            v = max(sol[j], 1e-300)
            return math.log(lo / v) if v < lo else math.log(v / hi)
        worst = max(out, key=excess)
        held[worst] = min(max(sol[worst], bounds[worst][0]), bounds[worst][1])


def _refine_compute(runs: Sequence[RunData], base: Cluster, profiles: dict, x: float, y: float, o: float, *,
                    x_bounds: tuple[float, float] = (1e-3, 1e4),
                    y_bounds: tuple[float, float] = (1.0, 1.0),
                    anchors: tuple[float | None, float | None] = (None, None)) -> tuple[float, float, float]:
    """(x, y, o) refined on the planner itself: its stage times are a roofline per kernel (the
    larger of FLOP and byte time), which the linear split above only approximates (a kernel at the
    bandwidth roof does not speed up with peak FLOP/s). Robust least squares of the relative
    errors, from the linear solution, with ``o >= 0``, ``x`` within ``x_bounds`` and ``y`` within
    ``y_bounds`` (scipy), plus :data:`ANCHOR_WEIGHTS` times ``log(x / anchors[0])`` and
    ``log(y / anchors[1])``: where the runs cannot tell the FLOP part from the memory-bound part
    (both grow with the micro-batch), the split stays near the microbenchmarks (``anchors``: the
    ``x`` that gives the measured matmul rate and the ``y`` that gives the memcpy rate; ``None``:
    no measurement, no anchor)."""
    from scipy.optimize import least_squares

    def residuals(z) -> list[float]:
        return (_compute_errors(runs, base, profiles, math.exp(z[0]), math.exp(z[1]), z[2] * 1e-6)
                + [w * (v - math.log(a)) for w, v, a in zip(ANCHOR_WEIGHTS, z[:2], anchors) if a is not None])

    lows, highs = [], []
    for lo, hi in (x_bounds, y_bounds):
        lo, hi = math.log(lo), math.log(hi)
        if hi - lo < 1e-9:  # pinned: least_squares needs lower < upper
            lo, hi = lo - 1e-9, hi + 1e-9
        lows.append(lo)
        highs.append(hi)
    start = [min(max(math.log(v), lo), hi) for v, lo, hi in zip((x, y), lows, highs)] + [o * 1e6]
    fit = least_squares(residuals, start, bounds=(lows + [0.0], highs + [math.inf]),
                        loss="soft_l1", f_scale=0.1, diff_step=1e-3)
    if not fit.success:  # keep the linear solution (least squares never ends above its start)
        return x, y, o
    lx, ly = (min(max(float(v), math.log(b[0])), math.log(b[1])) for v, b in zip(fit.x[:2], (x_bounds, y_bounds)))
    return math.exp(lx), math.exp(ly), float(fit.x[2]) * 1e-6


def refit(runs: Sequence[RunData], cluster: Cluster, *,
          matmul_flops_per_s: float | Mapping[str, float] | None = None) -> Refit:
    """Refit ``cluster`` to ``runs``: peak FLOP/s, the memory-bound nodes' rate and the per-kernel
    overhead (least squares on the measured compute seconds per micro-batch), the optimizer's
    stream rate (optimizer seconds), then the link-latency multiplier and the per-message
    pipeline overhead (step seconds).

    ``matmul_flops_per_s``: the FLOP/s the matmul microbenchmark measured for the runs' dtype
    (``EfficiencyFit.peak_flops_per_s``; or per dtype); the refitted peak stays within
    :data:`PEAK_BOUNDS` of it and is anchored to it (``None``, or no entry for that dtype: within
    the bounds of the cluster's own peak, unanchored). The memory-bound rate stays within
    :data:`MEMORY_BOUND_BOUNDS` of the cluster's memory bandwidth (the measured memcpy)."""
    if not runs:
        raise ConfigError("refit: give at least one run directory")
    profiles: dict = {}
    # compute and optimizer seconds as one rank alone would take them: the planner adds what
    # sharing the node's cores costs as its own term
    alone = _uncontended(runs, cluster)
    plans = [_reevaluate(r.plan, cluster, profiles) for r in runs]
    before = _compute_ratio(alone, plans)
    dtype = _dtype((_plain(runs) or list(runs))[0].plan)
    if isinstance(matmul_flops_per_s, Mapping):
        matmul_flops_per_s = matmul_flops_per_s.get(dtype)
    lo, hi = peak_scale_bounds(cluster, matmul_flops_per_s, dtype)
    peak = cluster.device.peak_flops.for_dtype(dtype)
    mem_lo, mem_hi = memory_bound_scale_bounds(cluster)
    # anchors: the x that gives the measured matmul rate (none without a measurement: the peak
    # moves within its bounds as before), the y that gives the memcpy rate
    anchors = (peak / matmul_flops_per_s if matmul_flops_per_s else None,
               memory_bound_rate(cluster.device) / cluster.device.memory_bandwidth_bytes_per_s)
    x, y, kernel_s = _fit_compute(alone, cluster, profiles, x_bounds=(1 / hi, 1 / lo),
                                  y_bounds=(1 / mem_hi, 1 / mem_lo), anchors=anchors)
    flops = 1 / x
    fitted = _with_overheads(_with_memory_bound_scale(_scaled(cluster, flops, 1.0), y), kernel_s)
    plans = [_reevaluate(r.plan, fitted, profiles) for r in runs]
    ratio = _compute_ratio(alone, plans)
    bandwidth, tensor_s = _fit_optimizer(alone, fitted, profiles)
    # the optimizer's stream rate, not the memory bandwidth the graph's memory-bound nodes run at
    dev = fitted.device
    fitted = _with_device(fitted, optimizer_bytes_per_s=(dev.optimizer_bytes_per_s or dev.memory_bandwidth_bytes_per_s)
                          * bandwidth, optimizer_tensor_s=tensor_s)
    fitted = _with_device(fitted, offload_call_s=_fit_device_seconds(_offloaded(alone), fitted, profiles, "offload_call_s"))
    p2p_s = _fit_p2p(runs, fitted, profiles)
    fitted = _with_overheads(fitted, p2p_s=p2p_s)
    latency, sync, wait, step_err = _fit_latency(runs, fitted, profiles)
    fitted = _with_step_overhead(runs, _with_wait(_with_sync(_with_latency(fitted, latency), sync), wait))
    return Refit(cluster=fitted, flops_scale=flops,
                 bandwidth_scale=bandwidth, latency_scale=latency, compute_ratio_before=before,
                 compute_ratio_after=ratio, step_log_error=step_err, runs=len(runs),
                 kernel_overhead_s=kernel_s, memory_bound_scale=fitted.device.memory_bound_bytes_per_s
                 / fitted.device.memory_bandwidth_bytes_per_s if fitted.device.memory_bound_bytes_per_s else 1.0,
                 p2p_latency_s=p2p_s,
                 step_overhead_s=fitted.device.step_overhead_s, offload_call_s=fitted.device.offload_call_s,
                 optimizer_tensor_s=fitted.device.optimizer_tensor_s, sync_latency_scale=sync,
                 step_end_wait_s=wait)


def _fit_optimizer(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> tuple[float, float]:
    """(stream-rate scale, ``Device.optimizer_tensor_s``): per run, the planner's optimizer term
    is ``a·B + c·n`` (``B``: its streamed-bytes seconds at the cluster's rate; ``n``: tensors
    stepped, read off the planner at 1 ms a tensor), against the median over ranks of the
    measured optimizer seconds. ``(a, c) >= 0`` by non-negative least squares on relative errors
    when the runs' ``n / B`` differ (a ZeRO-1/2 run steps a few flat segments, a pipeline stage
    fewer tensors than a whole model), the rate at most the memory bandwidth; else the rate alone
    (``c`` kept), the median ratio."""
    base = _with_device(cluster, optimizer_tensor_s=0.0)
    rows = []
    for run in runs:
        measured = [m for m in run.optimizer_s if m > 0]
        t0 = _reevaluate(run.plan, base, profiles).predicted.terms.get("optimizer", 0.0)
        t1 = _reevaluate(run.plan, _with_device(base, optimizer_tensor_s=1e-3), profiles).predicted.terms.get(
            "optimizer", 0.0)
        if measured and t0 > 0:
            rows.append((t0, (t1 - t0) / 1e-3, statistics.median(measured)))
    if not rows:
        return 1.0, cluster.device.optimizer_tensor_s
    shares = [n / b for b, n, _ in rows]
    if max(shares) > 1.1 * min(shares):
        a, c = _nnls([(b / m, n / m, 1.0) for b, n, m in rows])
        # the stream is never faster than memory: below that (a few small tensors, the bytes do
        # not show) the rate is the memory bandwidth and the tensors carry the rest
        dev = cluster.device
        floor = (dev.optimizer_bytes_per_s or dev.memory_bandwidth_bytes_per_s) / dev.memory_bandwidth_bytes_per_s
        if a < floor:
            a = floor
            (c,) = _nnls([(n / m, 1.0 - a * b / m) for b, n, m in rows])
        return 1 / a, c
    ratios = [m / (b + n * cluster.device.optimizer_tensor_s) for b, n, m in rows]
    return 1 / statistics.median(ratios), cluster.device.optimizer_tensor_s


def _with_device(cluster: Cluster, **fields) -> Cluster:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **fields))


def _fit_device_seconds(runs: Sequence[RunData], cluster: Cluster, profiles: dict, field: str) -> float:
    """``Device.<field>`` (seconds per call, >= 0) from ``runs``, whose measured forward+backward
    seconds per micro-batch include those calls: each rank's excess over the planner's stage time
    without them, over the stage's calls (the slope, read off the planner at 1 ms a call); the
    median over ranks and runs. The cluster's value is kept without runs."""
    sols = []
    for run in runs:
        e0 = _reevaluate(run.plan, _with_device(cluster, **{field: 0.0}), profiles)
        e1 = _reevaluate(run.plan, _with_device(cluster, **{field: 1e-3}), profiles)
        for rank, measured in enumerate(run.compute_per_mb_s):
            i = _pp_index(run.plan, rank)
            slope = (e1.stages[i].time_s - e0.stages[i].time_s) / 1e-3
            if slope > 0 and measured > 0:
                sols.append((measured - e0.stages[i].time_s) / slope)
    return max(statistics.median(sols), 0.0) if sols else getattr(cluster.device, field)


def _offloaded(runs: Sequence[RunData]) -> list[RunData]:
    """Runs with activation offload (without checkpointing when there are such): their compute
    carries the copies and the offload hooks (``Device.offload_call_s``)."""
    off = [r for r in runs if r.plan.offload == "activations"]
    return [r for r in off if r.plan.checkpointing == "none"] or off


def _with_step_overhead(runs: Sequence[RunData], cluster: Cluster, profiles: dict | None = None) -> Cluster:
    """``cluster`` with ``Device.step_overhead_s`` = the median over every rank of every run of
    its measured ``other_s`` less the planner's loss all-reduce, its step-end wait included (>= 0;
    ``profiles`` unused)."""
    base = _with_device(cluster, step_overhead_s=0.0)
    # the loss's all-reduce ends the step outside every timed action (in ``other_s``); the
    # gradient norm's, the other scalar all-reduce the planner's ``framework`` term prices, is
    # timed as a collective (``collective_s``)
    loss_ar = scalar_all_reduce_time(base) + base.step_end_wait_s * step_end_scalars(base.world_size, "fp32").get("loss", 0)
    rest = [o - loss_ar for run in runs for o in run.other_s]
    return _with_device(base, step_overhead_s=max(statistics.median(rest), 0.0)) if rest else cluster


def _with_latency(cluster: Cluster, scale: float) -> Cluster:
    links = {name: getattr(cluster, name).with_latency_scale(scale)
             for name in ("intra_node", "inter_node")}
    return dataclasses.replace(cluster, **links)


def _step_log_errors(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> list[float]:
    errs = []
    for run in runs:
        predicted = _reevaluate(run.plan, cluster, profiles).predicted.step_time_s
        errs.append(abs(math.log(predicted / statistics.median(run.step_s))))
    return errs


def _fit_p2p(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> float | None:
    """Seconds per pipeline message (``Cluster.p2p_latency_s``, >= 0): each pipelined rank's
    measured send/receive seconds (posting and waiting: ``RunData.p2p_s``) against the planner's
    ``pp_comm + bubble``, which is affine in it (``P0 + α·M``, read off the planner), solved per
    rank; the median of those solutions (robust to a rank a neighbour slowed down). ``None``
    (keep the link's α) without pipelined runs."""
    rows = []
    # tp runs' bubbles carry their tp collectives, whose latency is fitted after this, and
    # offload runs' waits their partner's copies: left out when there are other pipelined runs
    piped = [r for r in runs if r.plan.pp > 1]
    for run in _plain(piped) or piped:
        e0 = _reevaluate(run.plan, _with_overheads(cluster, p2p_s=0.0), profiles).predicted.terms
        e1 = _reevaluate(run.plan, _with_overheads(cluster, p2p_s=1e-3), profiles).predicted.terms
        p0 = e0.get("pp_comm", 0.0) + e0.get("bubble", 0.0)
        slope = (e1.get("pp_comm", 0.0) + e1.get("bubble", 0.0) - p0) / 1e-3
        sols = [(measured - p0) / slope for measured in run.p2p_s if measured > 0 and slope > 0]
        if sols:  # each rank's exact solution; the run's median
            rows.append(statistics.median(sols))
    if not rows:
        return cluster.p2p_latency_s
    # the least-contended run: waits in the others also carry a partner's unmodelled slowness
    # (a recompute or a neighbour), which would be charged to every message of every plan
    return max(min(rows), 0.0)


STEP_END_WAIT_BOUNDS = (0.0, 10e-3)
"""Where the refit may put the fixed wait of each step-end call (``Cluster.step_end_wait_s``):
``[0, 10 ms]``. It is what a call waits for its group's last rank to arrive when the ranks share
cores: at most about one scheduler period (CFS lets every runnable task run within a few ms to
~12 ms on 1-4 CPUs), and the per-phase timelines on the 2-core machine put each step-end phase
at 1-3.6 ms, its α included. A larger value would be a straggler's compute or a neighbour's
burst charged to every call of every plan; non-negative because waiting never makes a call
faster. GPUs (NCCL, a rank per device) fit about 0."""


def _fit_latency(runs: Sequence[RunData], cluster: Cluster, profiles: dict
                 ) -> tuple[float, float | None, float, float]:
    """(link-latency multiplier, step-end multiplier over it or None, step-end wait per call,
    median error).

    Two kinds of collective pay the link's latency: those ranks call in step inside forward and
    backward (tensor parallelism's, context parallelism's exchanges) and those at the step's end
    (the gradient reduction per bucket, ZeRO-1/2's all-gather, the tied-weight sync, the loss
    all-reduce), which each rank reaches from its own backward. On CPU ranks sharing cores the
    second kind waits for the group's last rank to be scheduled: a fixed wait per call
    (``Cluster.step_end_wait_s``, :data:`STEP_END_WAIT_BOUNDS`, counted by
    ``plan_cost.step_end_calls``) beside a multiplier of their α. The runs without tp or cp fit
    the step-end multiplier and the wait together, then the runs with them fit the link's (the
    step-end ones held, the multiplier kept as ``Cluster.sync_latency_scale`` relative to it, so
    that intra- and inter-node links keep their ratio). When the runs are all of one kind, one
    multiplier for both (``None``). Each fit: the multiplier on a grid of powers of √2 (1/16 .. 64)
    with the smallest MEAN |log(predicted / measured)| step time over its runs (a median would
    let the few runs the collectives dominate go unfitted), the wait at each the best within its
    bounds, with compute, kernel overhead and pipeline messages fitted before (from their own
    measured seconds) and the step overhead refitted at each candidate (:func:`_with_step_overhead`)."""
    inside = [r for r in runs if r.plan.tp > 1 or r.plan.cp > 1]
    outside = [r for r in runs if not (r.plan.tp > 1 or r.plan.cp > 1)]
    both, wait = _best_latency_scale(outside or runs, runs, lambda k: _with_latency(cluster, k), profiles)
    if not inside or not outside:
        fitted = _with_wait(_with_latency(cluster, both), wait)
        return both, None, wait, _median_step_error(runs, fitted, profiles)
    link, _ = _best_latency_scale(inside, runs, lambda k: _with_wait(_with_sync(_with_latency(cluster, k), both / k),
                                                                       wait), profiles, fit_wait=False)
    fitted = _with_wait(_with_sync(_with_latency(cluster, link), both / link), wait)
    return link, both / link, wait, _median_step_error(runs, fitted, profiles)


def _best_latency_scale(fit_on: Sequence[RunData], runs: Sequence[RunData], make, profiles: dict, *,
                        fit_wait: bool = True) -> tuple[float, float]:
    """(multiplier ``k``, step-end wait): the ``k`` (powers of √2, 1/16 .. 64) whose cluster
    ``make(k)`` predicts the step times of ``fit_on`` with the smallest mean |log error|, the
    step overhead set from ``runs`` at each ``k`` (it is what the measured rest of the step
    leaves after the loss all-reduce, whose latency is being fitted). ``fit_wait``: at each
    ``k`` also the wait per step-end call (:data:`STEP_END_WAIT_BOUNDS`) with the smallest error;
    the step time is affine in it (its calls, read off the planner, less the loss's, which the
    step overhead gives back while it stays >= 0). Else ``make(k)``'s wait."""
    if not fit_wait:
        best = (float("inf"), 1.0)
        for k in range(-8, 13):
            scale = 2.0 ** (k / 2)
            errs = _step_log_errors(fit_on, _with_step_overhead(runs, make(scale), profiles), profiles)
            best = min(best, (statistics.fmean(errs), scale))
        return best[1], make(1.0).step_end_wait_s
    measured = [statistics.median(r.step_s) for r in fit_on]
    # calls per run: the slope of its step time in the wait, the step overhead held at 0
    probe = _with_device(_with_wait(make(1.0), 0.0), step_overhead_s=0.0)
    at0 = _step_times(fit_on, probe, profiles)
    calls = [(t1 - t0) / 1e-3 for t0, t1 in zip(at0, _step_times(fit_on, _with_wait(probe, 1e-3), profiles))]
    best = (float("inf"), 1.0, 0.0)
    for k in range(-8, 13):
        scale = 2.0 ** (k / 2)
        cl = _with_step_overhead(runs, _with_wait(make(scale), 0.0), profiles)
        # the measured rest of the step less the loss all-reduce: the overhead at wait 0 (unclipped)
        rest = _step_overhead_rest(runs, cl)
        held = cl.device.step_overhead_s if rest is not None else 0.0  # no rest measured: the cluster's, held
        base = [t - held for t in _step_times(fit_on, cl, profiles)]
        wait, err = _best_wait(base, calls, measured, rest)
        best = min(best, (err, scale, wait))
    return best[1], best[2]


def _best_wait(base: Sequence[float], calls: Sequence[float], measured: Sequence[float],
               rest: float | None) -> tuple[float, float]:
    """(wait, mean |log error|): the wait per step-end call within :data:`STEP_END_WAIT_BOUNDS`
    that best predicts ``measured`` as ``base + w·calls + max(rest − w, 0)`` (the step overhead
    refitted at ``w``: the measured rest less the loss's wait; ``None``: no rest measured, 0)."""

    def err(w: float) -> float:
        over = max(rest - w, 0.0) if rest is not None else 0.0
        return statistics.fmean(abs(math.log(max(b + w * n + over, 1e-12) / m))
                                for b, n, m in zip(base, calls, measured))

    lo, hi = STEP_END_WAIT_BOUNDS
    grid = [lo + (hi - lo) * i / 400 for i in range(401)]
    i = min(range(len(grid)), key=lambda j: err(grid[j]))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    from scipy.optimize import minimize_scalar  # scipy only where a refit runs

    fine = minimize_scalar(err, bounds=(a, b), method="bounded", options={"xatol": 1e-7})
    w = float(fine.x) if fine.success and err(float(fine.x)) <= err(grid[i]) else grid[i]
    return w, err(w)


def _step_overhead_rest(runs: Sequence[RunData], cluster: Cluster) -> float | None:
    """The median over every rank of every run of its measured ``other_s`` less the planner's
    loss all-reduce without its wait (``cluster``'s wait 0), not clipped at 0; ``None`` without ranks."""
    loss_ar = scalar_all_reduce_time(cluster)
    rest = [o - loss_ar for run in runs for o in run.other_s]
    return statistics.median(rest) if rest else None


def _step_times(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> list[float]:
    return [_reevaluate(run.plan, cluster, profiles).predicted.step_time_s for run in runs]


def _with_wait(cluster: Cluster, wait: float) -> Cluster:
    return dataclasses.replace(cluster, step_end_wait_s=wait)


def _median_step_error(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> float:
    return statistics.median(_step_log_errors(runs, _with_step_overhead(runs, cluster, profiles), profiles))


def _with_sync(cluster: Cluster, scale: float | None) -> Cluster:
    return dataclasses.replace(cluster, sync_latency_scale=scale)


def refit_from_runs(dirs: Sequence[str | Path], cluster: Cluster, out: str | Path, *,
                    matmul_flops_per_s: float | Mapping[str, float] | None = None) -> Refit:
    """:func:`refit` over run directories ``dirs`` (each with plan.json and measurements.json;
    a directory without them is searched one level down); writes the refitted cluster to ``out``."""
    runs = [load_run(d) for d in expand_run_dirs(dirs)]
    result = refit(runs, cluster, matmul_flops_per_s=matmul_flops_per_s)
    result.cluster.to_file(out)
    return result


def expand_run_dirs(dirs: Sequence[str | Path]) -> list[Path]:
    """Run directories under ``dirs``: each itself when it holds plan.json, else its subdirectories
    (recursively) that do."""
    out: list[Path] = []
    for d in dirs:
        d = Path(d)
        if (d / "plan.json").is_file():
            out.append(d)
        else:
            out += sorted(p.parent for p in d.rglob("plan.json"))
    if not out:
        raise ConfigError(f"refit: no plan.json under {[str(d) for d in dirs]}")
    return out
