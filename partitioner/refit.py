"""Refit the cost model's efficiency terms from training runs (``partitioner calibrate --from-run``).

A run directory holds ``plan.json`` (the :class:`partitioner.plan_types.Plan` that ran, with its
per-stage predicted seconds) and ``measurements.json`` (:class:`runtime.measure.RunMeasurements`:
per-rank, per-step compute / optimizer seconds). Two multiplicative terms of the cluster are
refitted, each as the median over ranks (and runs) of measured over predicted, after the warm-up
step:

* **effective peak FLOP/s** of the device (every dtype scaled alike): the planner's compute time
  of a stage is ``Σ flops/(P·e) + h/e`` per kernel (:func:`partitioner.cost_model.compute_time`),
  so at these sizes it is close to ``1/P``. The ratio (from runs without tensor parallelism when
  there are any: the runtime's compute seconds include tp collectives) compares a rank's measured forward+backward
  seconds per micro-batch (``compute_s / num_micro_batches``) with the plan's ``StagePlan.time_s``
  of its pipeline rank; ``P`` is divided by it and the plans re-evaluated so that the per-kernel
  constant is accounted for (secant steps on ``1/P``).
* **memory bandwidth** (the optimizer step is memory bound in the planner): measured
  ``optimizer_s`` against the plan's ``optimizer`` term.

* **link latency** (intra- and inter-node α), last: the multiplier (powers of √2) whose predicted
  STEP times have the smallest median |log(predicted/measured)| over the runs, with the two
  terms above fixed. At small sizes the step is dominated by per-message and per-op costs that the
  FLOP-based compute term cannot carry.

Only median ratios are used, so one slow rank (a noisy neighbour) does not move the fit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from partitioner.cluster import Cluster, PeakFlops
from partitioner.errors import ConfigError
from partitioner.plan_types import Plan

ROUNDS = 3


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


@dataclass(frozen=True, kw_only=True)
class Refit:
    """The refitted cluster and how it moved (ratios are measured / predicted before the refit)."""

    cluster: Cluster
    flops_scale: float
    """New peak FLOP/s over old."""
    bandwidth_scale: float
    """New memory bandwidth over old."""
    latency_scale: float
    """New link latency (intra- and inter-node) over old."""
    compute_ratio_before: float
    compute_ratio_after: float
    step_log_error: float
    """Median |log(predicted / measured step seconds)| over the runs after the refit."""
    runs: int


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
    comp, opt, wall = [], [], []
    for rank_steps in steps:
        kept = rank_steps[skip_first:] or rank_steps
        comp.append(statistics.median(s["compute_s"] for s in kept) / plan.num_micro_batches)
        opt.append(statistics.median(s["optimizer_s"] for s in kept))
        wall.append(statistics.median(s["wall_s"] for s in kept))
    if len(steps) != plan.world_size:
        raise ConfigError(f"refit: {meas_file} has {len(steps)} ranks but plan.json needs {plan.world_size}")
    return RunData(plan=plan, compute_per_mb_s=tuple(comp), optimizer_s=tuple(opt), step_s=tuple(wall))


def _pp_index(plan: Plan, rank: int) -> int:
    return rank // (plan.dp * plan.tp)  # runtime.mesh: tp fastest, then dp, then pp


def _reevaluate(plan: Plan, cluster: Cluster, profiles: dict) -> Plan:
    from partitioner.fidelity import predict_step_time
    from partitioner.profile import profile_model

    if plan.model not in profiles:
        profiles[plan.model] = profile_model(plan.model, dtype=_dtype(plan))
    return predict_step_time(profiles[plan.model], cluster, plan.knobs(), global_batch=plan.global_batch)


def _dtype(plan: Plan) -> str:
    return "fp32"  # the runtime trains fp32 weights; mixed precision is a separate knob there


def _compute_ratio(runs: Sequence[RunData], plans: Sequence[Plan]) -> float:
    # The runtime's compute seconds include the tp collectives called inside forward/backward
    # (their waits are not separable there); runs without tp give the kernels alone, so they are
    # used when there are any, and the link-latency fit then accounts for the collectives.
    pure = [(r, p) for r, p in zip(runs, plans) if p.tp == 1]
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


def refit(runs: Sequence[RunData], cluster: Cluster) -> Refit:
    """Scale ``cluster``'s peak FLOP/s and memory bandwidth so the plans of ``runs`` predict the
    measured compute seconds per micro-batch and optimizer seconds (median ratio 1)."""
    if not runs:
        raise ConfigError("refit: give at least one run directory")
    profiles: dict = {}
    plans = [_reevaluate(r.plan, cluster, profiles) for r in runs]
    before = _compute_ratio(runs, plans)
    # Predicted compute is a + b·x in x = 1/flops_scale (the per-kernel constant ``a`` does not
    # scale with P), so predicted/measured = 1/ratio is affine in x (exactly for one rank, nearly
    # for a median): secant steps on 1/ratio towards 1, started from x = ratio (exact when a = 0).
    xs, rs = [1.0], [before]
    x, ratio = before, before
    for _ in range(ROUNDS + 1):
        plans = [_reevaluate(r.plan, _scaled(cluster, 1 / x, 1.0), profiles) for r in runs]
        ratio = _compute_ratio(runs, plans)
        xs.append(x)
        rs.append(ratio)
        if abs(ratio - 1) < 0.005 or rs[-1] == rs[-2]:
            break
        y1, y0 = 1 / rs[-1], 1 / rs[-2]
        x = max(x + (1 - y1) * (xs[-1] - xs[-2]) / (y1 - y0), 1e-6)
    flops = 1 / xs[-1]
    opt_ratios = []
    for run, plan in zip(runs, plans):
        predicted = plan.predicted.terms.get("optimizer", 0.0)
        if predicted > 0:
            opt_ratios += [m / predicted for m in run.optimizer_s if m > 0]
    bandwidth = 1 / statistics.median(opt_ratios) if opt_ratios else 1.0
    fitted = _scaled(cluster, flops, bandwidth)
    latency, step_err = _fit_latency(runs, fitted, profiles)
    return Refit(cluster=_with_latency(fitted, latency), flops_scale=flops, bandwidth_scale=bandwidth,
                 latency_scale=latency, compute_ratio_before=before, compute_ratio_after=ratio,
                 step_log_error=step_err, runs=len(runs))


def _with_latency(cluster: Cluster, scale: float) -> Cluster:
    links = {name: dataclasses.replace(getattr(cluster, name), latency_s=getattr(cluster, name).latency_s * scale)
             for name in ("intra_node", "inter_node")}
    return dataclasses.replace(cluster, **links)


def _step_log_error(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> float:
    errs = []
    for run in runs:
        predicted = _reevaluate(run.plan, cluster, profiles).predicted.step_time_s
        errs.append(abs(math.log(predicted / statistics.median(run.step_s))))
    return statistics.median(errs)


def _fit_latency(runs: Sequence[RunData], cluster: Cluster, profiles: dict) -> tuple[float, float]:
    """The link-latency multiplier (a grid of powers of 2, 1/16 .. 64) whose step-time predictions
    have the smallest median |log(predicted / measured)| over ``runs``. Compute is fitted first
    (from compute seconds alone); what remains of the step is mostly per-message cost: pipeline
    send/recv, tp and dp collectives (gloo's per-call overhead, which the calibration's large
    messages see little of)."""
    best = (float("inf"), 1.0)
    for k in range(-8, 13):
        scale = 2.0 ** (k / 2)
        best = min(best, (_step_log_error(runs, _with_latency(cluster, scale), profiles), scale))
    return best[1], best[0]


def refit_from_runs(dirs: Sequence[str | Path], cluster: Cluster, out: str | Path) -> Refit:
    """:func:`refit` over run directories ``dirs`` (each with plan.json and measurements.json;
    a directory without them is searched one level down); writes the refitted cluster to ``out``."""
    runs = [load_run(d) for d in expand_run_dirs(dirs)]
    result = refit(runs, cluster)
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
