"""From a model to the trainer of one rank: capture once, analyse, lower, run.

::

    graph = capture_for_pipeline(spec)                      # capture (symbolic dims) + analysis, once
    model = build_parallel_model(graph, config, mesh)       # lower this rank's program, run it

:func:`auto_parallelize <partitioner.api.auto.auto_parallelize>` does the same with a plan from the
search in between; tests and benchmarks call these directly with a config of their own.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Sequence

from torch import fx

from partitioner.cost.cluster import Cluster
from partitioner.cost.cost_model import cost_hooks
from passes.capture.capture import capture_spec
from passes.checks.communication_check import CommunicationSummary, LoweredRank, check_lowered_ranks, check_lowering, rank_calls
from passes.capture.training_step_checks import check_loss, check_trainable, watch_side_effects
from passes.ir.config import ParallelConfig
from passes.ir.grad_buckets import DEFAULT_BUCKET_BYTES
from passes.ir.program import RankProgram
from passes.lowering.lower import Lowering, lower, lower_rank, programs_of
from passes.lowering.manager import PassContext
from passes.lowering.pipelines import analysis_passes, manager
from passes.ir.zero3_ops import ZERO3_PREFETCH
from runtime.dist.mesh import check_mesh_fits
from runtime.exec.parallel_model import ParallelModel

if TYPE_CHECKING:
    from partitioner.inputs.model_spec import ModelSpec
    from runtime.dist.mesh import Mesh
    from runtime.exec.parallel_model import ParallelModel


def capture_training_step(spec: ModelSpec, *, symbolic: Sequence[str] | None = None,
                          device: str | None = None, dims: dict[str, int] | None = None) -> fx.GraphModule:
    """The training step of ``spec`` captured once, every named dim symbolic by default (a plan
    picks the micro-batch later). ``device``: the device type the programs will run on; ``dims``:
    sizes of named dims other than the spec's defaults. Refuses a model without trainable
    parameters and a loss that is not a scalar; warns of Python side effects in ``forward``
    (:mod:`passes.capture.training_step_checks`). Every front door captures through here, so
    ``analyze``, ``plan`` and ``auto_parallelize`` refuse and warn alike."""
    if symbolic is None:
        symbolic = sorted({d for inp in spec.inputs for d in inp.shape if isinstance(d, str)})
    check_trainable(spec.module, spec.name)
    with watch_side_effects(spec.module, spec.name):
        gm = capture_spec(spec, dims=dims, symbolic=tuple(symbolic), device=device)
    check_loss(gm, spec.name)
    return gm


def run_analysis_passes(gm: fx.GraphModule, *, optimizer: str = "adamw", mixed_precision: bool = False, writer=None,
            memory: bool = True, memory_batch: int | None = None) -> fx.GraphModule:
    """The analysis passes (shapes, blocks, FLOPs and, with ``memory``, memory) over ``gm``, in
    place; returns it. ``memory_batch``: count memory at that batch, concretely (``1``: the
    per-sample numbers the planner profiles). ``writer``: an :class:`ir_dumps.writer.DumpWriter`
    that dumps every pass."""
    ctx = PassContext(optimizer=optimizer, mixed_precision=mixed_precision)
    passes = analysis_passes(ctx, memory=memory, memory_batch=memory_batch)
    pm = manager(passes, instrument=writer)
    gm = pm.run(gm, ctx)
    if writer is not None:
        writer.record_pipeline("analysis", pm.text())
    return gm


def capture_for_pipeline(spec: ModelSpec, symbolic: Sequence[str] | None = None, *,
                         device: str | None = None) -> fx.GraphModule:
    """Capture and analyse ``spec`` (what :func:`build_parallel_model` lowers): one capture, shared
    by every config built from it (the lowering deep-copies it)."""
    return run_analysis_passes(capture_training_step(spec, symbolic=symbolic, device=device))


def build_parallel_model(graph: fx.GraphModule, config: ParallelConfig, mesh: Mesh, *,
                         cluster: Cluster, optimizer=None, overlap_grad_sync: bool = True,
                         bucket_bytes: int | None = None, tp_group: str = "tp", zero3_prefetch: int = ZERO3_PREFETCH,
                         **runtime) -> ParallelModel:
    """Lower ``graph`` (from :func:`capture_for_pipeline`) for this rank of ``mesh`` under
    ``config`` and return the runtime's :class:`ParallelModel` executing it.

    ``cluster``: what the policy passes cost against (``local_cluster(mesh.size)`` for this
    machine). ``tp_group``: the name the programs look their tp group up by (give
    models that live side by side in one process different names). ``zero3_prefetch``: ZeRO-3
    gather sites issued ahead of the running one. ``optimizer`` and ``runtime``
    (``lr_scheduler``, ``clip_grad_norm``, ``nonfinite``): as :class:`ParallelModel` takes them.
    """

    program = lower_own_checked(graph, config, mesh, cluster=cluster, tp_group=tp_group,
                                bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                overlap_grad_sync=overlap_grad_sync, zero3_prefetch=zero3_prefetch)
    kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return ParallelModel(program, mesh, optimizer=optimizer, overlap_grad_sync=overlap_grad_sync,
                         zero3_prefetch=zero3_prefetch, **kwargs, **runtime)


def lower_own_checked(graph: fx.GraphModule, config: ParallelConfig, mesh: Mesh, *, cluster: Cluster,
                      ctx: PassContext | None = None, tp_group: str = "tp", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      overlap_grad_sync: bool = True, zero3_prefetch: int = ZERO3_PREFETCH) -> RankProgram:
    """This rank's program of ``config``: only this rank's (stage, tp rank) programs are lowered,
    then the whole plan is checked with the other ranks of ``mesh`` (:func:`check_before_launch`).
    ``ctx``: the optimizer and precision the re-analysis counts (default: the config's precision).
    A mesh that cannot run ``config`` is refused before any lowering (:func:`runtime.dist.mesh.check_mesh_fits`)."""
    check_mesh_fits(mesh, config, where="build")
    lowering = lower(graph, config, cost=cost_hooks(cluster), tp_group=tp_group,
                     programs=programs_of(config, mesh.rank, first=mesh.first),
                     ctx=ctx or PassContext(mixed_precision=config.mixed_precision))
    program = lowering.rank_program(mesh.rank, first=mesh.first)
    check_before_launch(mesh, lowering, program, bucket_bytes=bucket_bytes, overlap_grad_sync=overlap_grad_sync,
                        zero3_prefetch=zero3_prefetch)
    return program


def check_before_launch(mesh: Mesh, lowering: Lowering, program: RankProgram, *,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap_grad_sync: bool = True,
                        zero3_prefetch: int = ZERO3_PREFETCH) -> CommunicationSummary:
    """Check the whole plan's communication before the first step, on every rank of ``mesh``.

    Each process lowered only its own rank's programs (``lowering``; ``program`` is this rank's).
    The ranks exchange what they lowered (:class:`LoweredRank`: a digest of the plan and of the
    programs, and the program's communication calls) in one all-gather of a fixed shape, which
    every rank issues at the same point, and each rank then checks them all
    (:func:`passes.checks.communication_check.check_lowered_ranks`): the same verdict everywhere, before
    any collective of the plan runs. Raises :class:`CommunicationMismatchError`."""
    mine = LoweredRank(rank=program.rank, plan=plan_digest(lowering.config), programs=tuple(sorted(lowering.programs)),
                       digest=lowering.digest(),
                       calls=rank_calls(program, bucket_bytes=bucket_bytes, overlap_grad_sync=overlap_grad_sync,
                                        zero3_prefetch=zero3_prefetch))
    return check_lowered_ranks(mesh.exchange(mine), config=lowering.config)


def plan_digest(config: ParallelConfig) -> str:
    """A short hash of ``config`` (what :class:`LoweredRank` compares across ranks)."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


def lower_checked_all(graph: fx.GraphModule, config: ParallelConfig, *, cluster: Cluster, first: int = 0,
                      tp_group: str = "tp", ctx: PassContext | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      overlap_grad_sync: bool = True, zero3_prefetch: int = ZERO3_PREFETCH):
    """Every rank's program of ``config`` (a :class:`passes.lowering.lower.Lowering`; a rank takes its own
    with ``.rank_program(rank, first=first)``), its communication checked first
    (:func:`passes.checks.communication_check.check_lowering`; raises :class:`CommunicationMismatchError`).
    One process checks the whole plan alone, without a collective (the processes of a job each
    lower only their own programs and check together: :func:`check_before_launch`). ``bucket_bytes`` (bytes) and
    ``overlap_grad_sync``: as the ParallelModel that runs it takes them."""
    lowering = lower(graph, config, cost=cost_hooks(cluster), tp_group=tp_group,
                     ctx=ctx or PassContext(mixed_precision=config.mixed_precision))
    check_lowering(lowering, first=first, bucket_bytes=bucket_bytes, overlap_grad_sync=overlap_grad_sync,
                   zero3_prefetch=zero3_prefetch)
    return lowering


def lower_all(graph: fx.GraphModule, config: ParallelConfig, *, cluster: Cluster, tp_group: str = "tp", writer=None):
    """Every (stage, tp rank) program of ``config`` (a :class:`passes.lowering.lower.Lowering`); with an
    :class:`ir_dumps.writer.DumpWriter`, every pass is dumped into its tree."""
    instrument_for = None
    if writer is not None:
        def instrument_for(name: str):
            return writer if name == "whole_graph" else writer.scope(name)
    lowering = lower(graph, config, cost=cost_hooks(cluster), tp_group=tp_group, instrument_for=instrument_for,
                     ctx=PassContext(mixed_precision=config.mixed_precision))
    if writer is not None:
        for record in lowering.pipelines:
            writer.record_pipeline(record.name, record.text)
    return lowering


def rank_program(graph: fx.GraphModule, config: ParallelConfig, rank: int, *, cluster: Cluster,
                 first: int = 0, tp_group: str = "tp"):
    """The :class:`passes.ir.program.RankProgram` of global ``rank`` (no process group needed)."""
    return lower_rank(graph, config, rank, cost=cost_hooks(cluster), first=first, tp_group=tp_group,
                      ctx=PassContext(mixed_precision=config.mixed_precision))
