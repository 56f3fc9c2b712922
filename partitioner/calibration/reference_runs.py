"""Reference training runs: a small GPT trained under a few plans on this machine's local gloo
ranks and measured, so that ``partitioner calibrate`` can refit the cost model's framework
overheads (per-op, per-message, per-step, per-offloaded-tensor) to what this machine really
costs, as ``calibrate --from-run`` does with a user's runs.

Microbenchmarks (matmul FLOP/s, memcpy, large-message gloo α-β) miss those overheads, and at
small sizes they are most of a step: on the 2-core CI machine the microbenchmarks alone predict
steps about 75% too short. The overheads are properties of the machine and the runtime, not of
the model, so a fit on the reference GPT carries over to other models (``bench/README.md``: a fit
on zoo gpt predicts llama and hf-gpt2 plans within 15-25% median).

Every plan of :func:`reference_plans` runs in ONE spawn of ``world_size`` ranks (starting gloo
processes is the slow part); each writes ``<out>/<plan>/{plan.json,measurements.json}``.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from partitioner.cost.cluster import Cluster
from passes.ir.errors import ConfigError
from partitioner.inputs.models import build_model
from runtime.observe.measure import StepTimer
from partitioner.compile.build import build_parallel_model, capture_for_pipeline
from passes.ir.config import ParallelConfig
from runtime.dist.mesh import Mesh, init_distributed
from partitioner.search.replay import predict_step_time
from partitioner.search.profile import profile_model
from runtime.dist.launch import preload, spawn
from runtime.observe.measure import RunMeasurements, StepMeasurement

REFERENCE_MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16,dropout=0.0"
"""Small enough to train in seconds on CPU ranks, large enough to have every kind of layer."""
ADAMW = {"lr": 1e-3, "eps": 1e-6}
WARMUP_STEPS = 2
"""Steps of each reference plan left out of the fit: the second step was still 20-50% slower than
the later ones on the 2-core machine (gloo's connections, the allocator, the optimizer state
being created), as the demo, which also skips two, sees."""


def global_batch(world_size: int) -> int:
    """Samples per step: at least 16, a multiple of ``4 * world_size`` (every plan's dp x
    micro-batches divides it)."""
    return 4 * world_size * -(-16 // (4 * world_size))


@dataclass(frozen=True, kw_only=True)
class ReferencePlan:
    """One plan of the reference set (every knob of :data:`passes.ir.plan.KNOBS`)."""
    name: str
    global_batch: int
    dp: int
    tp: int = 1
    pp: int = 1
    num_micro_batches: int = 2
    schedule: str = "1f1b"
    virtual_pp: int = 1
    zero_stage: int = 0
    checkpointing: str = "none"
    offload: str = "none"

    def knobs(self) -> dict:
        return dict(dp=self.dp, tp=self.tp, pp=self.pp, virtual_pp=self.virtual_pp,
                    micro_batch_size=self.global_batch // (self.dp * self.num_micro_batches),
                    num_micro_batches=self.num_micro_batches, schedule=self.schedule, zero_stage=self.zero_stage,
                    sequence_parallel=False, checkpointing=self.checkpointing, offload=self.offload)


def reference_plans(world_size: int) -> tuple[ReferencePlan, ...]:
    """The plans that fit ``world_size`` ranks: data parallel (ZeRO-1 when dp > 1), a pipeline
    (1F1B, and with checkpointing and with activation offload), tensor parallel, and tensor
    parallel inside a pipeline, so that every overhead the refit fits is exercised where the
    world allows it."""
    w = world_size
    if w < 1:
        raise ConfigError(f"reference runs need a world size >= 1, got {w}")
    gb = global_batch(w)
    plans = [ReferencePlan(name=f"dp{w}" + ("-zero1" if w > 1 else ""), global_batch=gb, dp=w,
                           zero_stage=1 if w > 1 else 0),
             # the same plan at 4x the micro-batch: 4x the FLOPs through the same operators, so the
             # refit can tell the FLOP rate from the per-operator overhead
             ReferencePlan(name=f"dp{w}-large" + ("-zero1" if w > 1 else ""), global_batch=4 * gb, dp=w,
                           zero_stage=1 if w > 1 else 0)]
    if w % 2 == 0:
        half = w // 2
        plans += [ReferencePlan(name=f"dp{half}-pp2", global_batch=gb, dp=half, pp=2, num_micro_batches=4),
                  ReferencePlan(name=f"dp{half}-pp2-ckpt", global_batch=gb, dp=half, pp=2, checkpointing="full"),
                  ReferencePlan(name=f"dp{half}-pp2-offload", global_batch=gb, dp=half, pp=2, offload="activations"),
                  ReferencePlan(name=f"dp{half}-tp2", global_batch=gb, dp=half, tp=2)]
    if w % 4 == 0:  # tp inside a pipeline: the usual large-model shape (tp in a node, pp across)
        plans.append(ReferencePlan(name=f"dp{w // 4}-tp2-pp2", global_batch=gb, dp=w // 4, tp=2, pp=2))
    return tuple(plans)


@dataclass(frozen=True, kw_only=True)
class ReferenceResults:
    """What the reference ranks measured: gloo timings and each plan's steps."""

    comm: tuple[dict, ...]
    """Per rank: ``calibrate.time_gloo``'s ``{op: [(bytes, seconds)]}`` (empty without sizes)."""
    steps: tuple[tuple[list[dict], ...], ...]
    """Per rank, per plan of :func:`reference_plans`: the measured steps (dicts of
    :class:`runtime.observe.measure.StepMeasurement`)."""


def _shared_graph(spec):
    """The captured, analysed graph of ``spec`` on every rank: rank 0 captures it and the others
    rebuild it around their own module (on shared cores, one capture instead of one per rank)."""
    import torch.distributed as dist

    from passes.ir.graph_transfer import pack_graph, unpack_graph
    from runtime.dist.comm import broadcast_object

    payload = None
    if dist.get_rank() == 0:
        graph = capture_for_pipeline(spec)
        payload = pack_graph(graph, spec.module)
    return unpack_graph(broadcast_object(payload, src=0), spec.module)


def _rank_main(plans: tuple[ReferencePlan, ...], steps: int, cluster: Cluster,
               comm_sizes: tuple[int, ...], comm_repeats: int) -> tuple[dict, list[list[dict]]]:
    """On every rank: the gloo timings (``comm_sizes``; first, while the ranks do nothing else),
    then each plan's measured steps. ``cluster`` is what the lowering costs against
    (``local_cluster`` here would start the very calibration these runs are part of)."""
    from partitioner.calibration.measure import time_gloo

    init_distributed(timeout_s=300)
    comm = time_gloo(comm_sizes, comm_repeats) if comm_sizes else {}
    return comm, run_plans(plans, steps, cluster)


def run_plans(plans: tuple[ReferencePlan, ...], steps: int, cluster: Cluster) -> list[list[dict]]:
    """On every rank of the initialised default group (its size the plans' world): each plan's
    measured steps (dicts of :class:`runtime.observe.measure.StepMeasurement`), in order."""
    import torch

    meshes = {}
    for p in plans:  # every rank creates every group, in the same order
        if (p.dp, p.pp, p.tp) not in meshes:
            meshes[(p.dp, p.pp, p.tp)] = Mesh(p.dp, p.pp, p.tp, timeout_s=120)
    spec = build_model(REFERENCE_MODEL)
    graph = _shared_graph(spec)
    batches_of = {gb: [spec.example_inputs({"batch": gb}, seed=10 + k) for k in range(steps)]
                  for gb in sorted({p.global_batch for p in plans})}
    out = []
    for p in _plan_bar(plans, steps):
        batches = batches_of[p.global_batch]
        torch.distributed.barrier()
        config = ParallelConfig.for_global_batch(
            p.global_batch, dp=p.dp, pp=p.pp, tp=p.tp, schedule=p.schedule, num_micro_batches=p.num_micro_batches,
            virtual_pp=p.virtual_pp, zero_stage=p.zero_stage, checkpointing=p.checkpointing, offload=p.offload)
        pm = build_parallel_model(graph, config, meshes[(p.dp, p.pp, p.tp)], cluster=cluster, optimizer=ADAMW)
        timer = StepTimer(pm, track_memory=False)
        for k, b in enumerate(batches):
            timer.measure(k + 1, lambda b=b: pm.train_step(b))
        out.append([dataclasses.asdict(s) for s in timer.steps])
    torch.distributed.barrier()
    return out


def _plan_bar(plans: tuple[ReferencePlan, ...], steps: int):
    """``plans`` under a tqdm bar on rank 0's stderr, drawn only when that is a terminal
    (``disable=None``) and cleared when done (the calibration's own bar takes the line back)."""
    import sys

    import torch.distributed as dist
    from tqdm import tqdm

    return tqdm(plans, desc=f"reference runs ({steps} steps each)", unit="plan", file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=None if dist.get_rank() == 0 else True)


def measure_reference(world_size: int, cluster: Cluster, *, steps: int = 6, comm_sizes: tuple[int, ...] = (),
                      comm_repeats: int = 0, timeout_s: float = 900.0) -> ReferenceResults:
    """Train :data:`REFERENCE_MODEL` under every plan of :func:`reference_plans` on
    ``world_size`` local gloo ranks for ``steps`` steps (the first is warm-up), in ONE spawn;
    with ``comm_sizes`` the same ranks first time gloo at those sizes (bytes), so that a
    calibration starts its processes once. ``cluster``: what the lowering costs against (its
    links are not used)."""
    if steps < 2:
        raise ConfigError(f"reference runs need at least 2 steps (the first is warm-up), got {steps}")
    plans = reference_plans(world_size)
    preload("partitioner.calibration.reference_runs", "passes.capture.preload")
    per_rank = spawn(_rank_main, world_size, plans, steps, cluster, tuple(comm_sizes), comm_repeats,
                     timeout_s=timeout_s)
    return ReferenceResults(comm=tuple(c for c, _ in per_rank), steps=tuple(tuple(s) for _, s in per_rank))


def write_reference(results: ReferenceResults, out_dir: str | Path, cluster: Cluster, *,
                    elapsed_s: float = 0.0) -> list[Path]:
    """Write each reference plan's ``plan.json`` (predicted on ``cluster``) and
    ``measurements.json`` under ``out_dir``; returns the run directories
    (``partitioner.calibration.refit.refit_from_runs`` takes them)."""
    world_size = len(results.steps)
    plans = reference_plans(world_size)
    profile = profile_model(REFERENCE_MODEL, dtype="fp32")
    dirs = []
    for k, p in enumerate(plans):
        plan = predict_step_time(profile, cluster, p.knobs(), global_batch=p.global_batch)
        per_rank = [[StepMeasurement(**{**s, "compute_by_stage_s": {int(i): v for i, v in s["compute_by_stage_s"].items()}})
                     for s in results.steps[rank][k]] for rank in range(world_size)]
        run = RunMeasurements(plan_summary=plan.summary(), predicted_step_time_s=plan.predicted.step_time_s,
                              predicted_peak_memory_bytes=plan.predicted.peak_memory_bytes,
                              predicted_terms=plan.predicted.terms, world_size=world_size, steps=per_rank,
                              notes=[f"reference run {p.name} of partitioner calibrate "
                                     f"({elapsed_s:.0f} s for all plans)"])
        d = Path(out_dir) / p.name
        run.write(d / "measurements.json")
        (d / "plan.json").write_text(plan.to_json() + "\n")
        dirs.append(d)
    return dirs


def run_reference(world_size: int, out_dir: str | Path, cluster: Cluster, *, steps: int = 6,
                  timeout_s: float = 900.0) -> list[Path]:
    """:func:`measure_reference` (no gloo timings) then :func:`write_reference`: the run
    directories under ``out_dir``."""
    start = time.perf_counter()
    results = measure_reference(world_size, cluster, steps=steps, timeout_s=timeout_s)
    return write_reference(results, out_dir, cluster, elapsed_s=time.perf_counter() - start)
