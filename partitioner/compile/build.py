"""From a model to the trainer of one rank: capture once, analyse, lower, run.

::

    graph = capture_for_pipeline(spec)                      # capture (symbolic dims) + analysis, once
    lowering = lower_plan(graph, config, cluster=cluster)   # the one lowering: every rank program, checked
    model = build_parallel_model(graph, config, mesh, cluster=cluster)  # this rank's program, run

:func:`auto_parallelize <partitioner.api.auto.auto_parallelize>` does the same with a plan from the
search in between; tests and benchmarks call these directly with a config of their own.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from torch import fx

from partitioner.cost.cluster import Cluster
from partitioner.cost.cost_model import cost_hooks
from passes.capture.capture import capture_spec
from passes.checks.communication_check import CommunicationSummary, LoweredRank, check_lowered_ranks, check_lowering, rank_calls
from passes.capture.training_step_checks import check_loss, check_trainable, watch_side_effects
from passes.ir.config import DType, ParallelConfig
from passes.ir.errors import ConfigError
from passes.ir.grad_buckets import DEFAULT_BUCKET_BYTES
from passes.ir.graph_modules import copy_graph_module
from passes.ir.program import RankProgram
from passes.ir.graph_transfer import pack_graph, unpack_graph
from passes.lowering.lower import Lowering, lower, programs_of, remember_whole_graph_prefix, whole_graph_prefix
from passes.lowering.manager import PassContext
from passes.lowering.shared_programs import pack_programs, take_programs
from passes.lowering.pipelines import analysis_passes, manager
from passes.ir.zero3_ops import ZERO3_PREFETCH
from runtime.dist import comm
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
    key = _capture_key(spec, tuple(symbolic), device, dims)
    cached = _CAPTURED.get(key)
    if cached is not None:
        return cached
    check_trainable(spec.module, spec.name)
    with watch_side_effects(spec.module, spec.name):
        gm = capture_spec(spec, dims=dims, symbolic=tuple(symbolic), device=device)
    check_loss(gm, spec.name)
    _CAPTURED.put(key, gm)
    return gm


class _GraphMemo:
    """The last few graphs made for keys (None: not kept); each caller gets its own copy."""

    def __init__(self, kept: int = 8) -> None:
        self.kept = kept
        self.graphs: dict[tuple, fx.GraphModule] = {}

    def get(self, key: tuple | None) -> fx.GraphModule | None:
        if key is None or key not in self.graphs:
            return None
        self.graphs[key] = self.graphs.pop(key)  # most recent last
        return copy_graph_module(self.graphs[key])

    def put(self, key: tuple | None, gm: fx.GraphModule) -> None:
        if key is None:
            return
        self.graphs[key] = copy_graph_module(gm)
        while len(self.graphs) > self.kept:
            self.graphs.pop(next(iter(self.graphs)))


_CAPTURED = _GraphMemo()
"""Captures of zoo models on the meta device (no weights: the capture is a function of the spec
string, dtype, dims and device), by :func:`_capture_key`: planning, analysing and dry-running one
model in one process capture it once."""


def _capture_key(spec: ModelSpec, symbolic: tuple[str, ...], device: str | None,
                 dims: dict[str, int] | None) -> tuple | None:
    """What a capture of ``spec`` depends on, or None when it may depend on more (a module of the
    user's own, or one with weights: its values are the user's)."""
    tensors = [*spec.module.parameters(), *spec.module.buffers()]
    if not spec.source or not tensors or any(t.device.type != "meta" for t in tensors):
        return None
    dtypes = tuple(sorted({str(t.dtype) for t in tensors}))
    return (spec.source, dtypes, spec.inputs, tuple(sorted(spec.dims.items())), symbolic, device,
            tuple(sorted((dims or {}).items())))


def run_analysis_passes(gm: fx.GraphModule, *, optimizer: str = "adamw", dtype: DType = "fp32", writer=None,
            memory: bool = True, memory_batch: int | None = None) -> fx.GraphModule:
    """The analysis passes (shapes, blocks, FLOPs and, with ``memory``, memory) over ``gm``, in
    place; returns it. ``memory_batch``: count memory at that batch, concretely (``1``: the
    per-sample numbers the planner profiles). ``writer``: an :class:`ir_dumps.writer.DumpWriter`
    that dumps every pass."""
    ctx = PassContext(optimizer=optimizer, dtype=dtype)
    passes = analysis_passes(ctx, memory=memory, memory_batch=memory_batch)
    pm = manager(passes, instrument=writer)
    gm = pm.run(gm, ctx)
    if writer is not None:
        writer.record_pipeline("analysis", pm.text())
    return gm


def analysed_training_step(spec: ModelSpec, *, device: str | None = None, optimizer: str = "adamw",
                           dtype: DType = "fp32") -> fx.GraphModule:
    """:func:`capture_training_step` of ``spec`` (every named dim symbolic), then
    :func:`run_analysis_passes` (symbolic memory). Like the capture, the analysis of a zoo model
    on the meta device is made once per process for its spec, device, optimizer and dtype (a plan
    and the dry runs of its variants analyse it once; the symbolic run is most of their cost);
    each caller gets its own copy. Any other model is captured and analysed every time."""
    symbolic = sorted({d for inp in spec.inputs for d in inp.shape if isinstance(d, str)})
    capture = _capture_key(spec, tuple(symbolic), device, None)
    key = None if capture is None else (capture, optimizer, dtype)
    cached = _ANALYSED.get(key)
    if cached is not None:
        return cached
    gm = run_analysis_passes(capture_training_step(spec, device=device), optimizer=optimizer, dtype=dtype)
    _ANALYSED.put(key, gm)
    return gm


_ANALYSED = _GraphMemo()
"""Analysed captures of zoo models on the meta device, by capture key, optimizer and dtype
(:func:`analysed_training_step`)."""


def capture_for_pipeline(spec: ModelSpec, symbolic: Sequence[str] | None = None, *,
                         device: str | None = None) -> fx.GraphModule:
    """Capture and analyse ``spec`` (what :func:`build_parallel_model` lowers): one capture, shared
    by every config built from it (the lowering deep-copies it)."""
    return run_analysis_passes(capture_training_step(spec, symbolic=symbolic, device=device))


def lower_plan(graph: fx.GraphModule, config: ParallelConfig, *, cluster: Cluster, mesh: Mesh | None = None,
               ranks: Sequence[int] | None = None, check: bool = True, writer=None, first: int = 0,
               tp_group: str = "tp", ctx: PassContext | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               overlap_grad_sync: bool = True, zero3_prefetch: int = ZERO3_PREFETCH) -> Lowering:
    """The one lowering of a plan: ``graph`` (from :func:`capture_for_pipeline`) under ``config``
    into rank programs (a :class:`passes.lowering.lower.Lowering`; a rank takes its own with
    ``.rank_program(rank, first=first)``), priced on ``cluster`` (what the policy passes cost
    against), then its communication checked.

    Which programs: with ``mesh`` (a process of a job) this rank's only, lowered once per data
    axis (:func:`share_stage_programs`; a rank with a ``writer`` lowers alone) and checked together
    with the mesh's other ranks before any collective of the plan runs (:func:`check_before_launch`);
    with ``ranks`` those global ranks' (``first``: the rank of the plan's rank 0); else every
    program, checked in this one process (:func:`passes.checks.communication_check.check_lowering`).
    ``check=False`` skips the check (a part of a plan cannot be checked alone). ``writer``: an
    :class:`ir_dumps.writer.DumpWriter` that dumps every pass. ``ctx``: the optimizer and
    precision the re-analysis counts (default: the config's precision). ``bucket_bytes`` (bytes),
    ``overlap_grad_sync`` and ``zero3_prefetch``: as the :class:`ParallelModel` that runs it takes
    them (the check sizes what runs). A mesh that cannot run ``config`` is refused before any
    lowering (:func:`runtime.dist.mesh.check_mesh_fits`)."""
    if mesh is not None:
        check_mesh_fits(mesh, config, where="build")
    ctx = ctx or PassContext(dtype=config.dtype)
    cost = cost_hooks(cluster)
    if mesh is not None:
        ranks, first = (mesh.rank,), mesh.first
        # every rank of the mesh, dumping or not (the ranks that dump run the whole graph's passes again, recorded)
        share_whole_graph_prefix(graph, config, mesh, cost=cost, tp_group=tp_group, ctx=ctx)
    programs = None if ranks is None else sorted({p for r in ranks for p in programs_of(config, r, first=first)})
    instrument_for = None if writer is None else (
        lambda name: writer if name == "whole_graph" else writer.scope(name))  # whole graph at the top, stages in folders

    def lower_here() -> Lowering:
        made = lower(graph, config, cost=cost, tp_group=tp_group, programs=programs, instrument_for=instrument_for,
                     ctx=ctx)
        if writer is not None:
            for record in made.pipelines:
                writer.record_pipeline(record.name, record.text)
        return made

    if mesh is not None:  # a rank that dumps lowers alone: its writer records every pass
        lowering, _ = share_stage_programs(graph, config, mesh, lower_here, cost=cost, tp_group=tp_group, ctx=ctx,
                                           share=writer is None)
    else:
        lowering = lower_here()
    if check and mesh is not None:
        check_before_launch(mesh, lowering, lowering.rank_program(mesh.rank, first=mesh.first),
                            bucket_bytes=bucket_bytes, overlap_grad_sync=overlap_grad_sync,
                            zero3_prefetch=zero3_prefetch)
    elif check and ranks is None:
        check_lowering(lowering, first=first, bucket_bytes=bucket_bytes, overlap_grad_sync=overlap_grad_sync,
                       zero3_prefetch=zero3_prefetch)
    elif check:
        raise ConfigError("lower_plan: the programs of some ranks cannot be checked alone; lower every program "
                          "(no ranks=), or lower a job's rank with mesh=, or pass check=False")
    return lowering


def share_whole_graph_prefix(graph: fx.GraphModule, config: ParallelConfig, mesh: Mesh, *, cost, tp_group: str = "tp",
                             ctx: PassContext | None = None) -> Literal["made", "taken", "alone", "none"]:
    """Make the whole-graph prefix of the plan's lowering once per job: the mesh's first rank
    makes it (:func:`passes.lowering.lower.whole_graph_prefix`: the context-parallel rewrite with
    its symbolic shapes, the tensor-parallel tags, the checkpoint and offload policies' fake runs of the whole
    graph), packs it (its tensors travel as names) and broadcasts it over the mesh; every rank,
    the first included, lowers its own programs from the rebuilt copy. So lowering costs the
    distinct programs, not the ranks, and every rank starts from the same bytes. Every rank of
    the mesh calls it at the same point (:func:`lower_plan` does, before lowering). When the
    first rank cannot make or pack it, it sends nothing and each rank lowers alone (and meets
    the same error there). Returns what this rank did: ``made`` (and sent) it, ``taken`` from the
    first rank, lowers ``alone``, or ``none`` (a mesh of one rank, or a plan without a costly prefix)."""
    if not mesh.active or mesh.size == 1:
        return "none"
    made, costly = None, True
    if mesh.rank == mesh.first:
        try:
            prefix = whole_graph_prefix(graph, config, cost=cost, tp_group=tp_group, ctx=ctx)
            costly = prefix is not None
            made = pack_graph(prefix, graph, by_name=True) if costly else None
        except Exception:  # noqa: BLE001 - not lost: every rank runs the same passes in lower() and raises there
            made = None
    made, costly = comm.broadcast_object((made, costly), src=mesh.first, group=mesh.group)
    if made is None:
        return "alone" if costly else "none"
    remember_whole_graph_prefix(graph, config, unpack_graph(made, graph), cost=cost, tp_group=tp_group, ctx=ctx)
    return "made" if mesh.rank == mesh.first else "taken"


def share_stage_programs(graph: fx.GraphModule, config: ParallelConfig, mesh: Mesh, lower_here: Callable[[], Lowering],
                         *, cost, tp_group: str = "tp", ctx: PassContext | None = None,
                         share: bool = True) -> tuple[Lowering, Literal["made", "taken", "alone", "none"]]:
    """Lower each distinct program of the plan once per job, not once per data-parallel rank.

    The ranks of one data axis (the dp x cp ranks at one pipeline rank and tp rank: ``mesh.dp_group``)
    run the same (stage, tp rank) programs (what differs, an ep rank's experts, comes later, in
    :meth:`Lowering.rank_program`). So the first of them lowers them (``lower_here()``: this rank's
    lowering), packs them (:func:`passes.lowering.shared_programs.pack_programs`) and broadcasts them
    over its data axis, and each other one rebuilds them around its own whole graph and tensors
    (:func:`passes.lowering.shared_programs.take_programs`) instead of lowering. Every rank of the
    mesh calls it at the same point (:func:`lower_plan` does, after the whole-graph prefix); the
    data axes broadcast side by side, each over its own group. When the first rank cannot lower or
    pack them it sends nothing (and raises, if lowering failed) and each rank lowers alone; a rank
    that cannot rebuild them lowers alone too. ``share=False``: this rank neither sends nor takes
    (a rank that dumps: its writer records every pass; as a first rank it sends nothing). Returns
    this rank's lowering and what it did: ``made`` (and sent) the programs, ``taken`` them, lowered
    ``alone``, or ``none`` (a data axis of one rank)."""
    if not mesh.active or mesh.dp == 1:
        return lower_here(), "none"
    src = mesh.dp_ranks[0]
    if mesh.rank == src:
        try:
            lowering = lower_here()
        except Exception:
            comm.broadcast_object(None, src=src, group=mesh.dp_group)  # the others lower alone and meet it too
            raise
        shared = None
        if share:
            try:
                shared = pack_programs(lowering, programs_of(config, mesh.rank, first=mesh.first))
            except Exception:  # noqa: BLE001 - not lost: each rank lowers alone
                shared = None
        comm.broadcast_object(shared, src=src, group=mesh.dp_group)
        return lowering, "made" if shared is not None else "alone"
    shared = comm.broadcast_object(None, src=src, group=mesh.dp_group)
    if shared is not None and share:
        try:
            return take_programs(graph, config, shared, cost=cost, tp_group=tp_group, ctx=ctx), "taken"
        except Exception:  # noqa: BLE001 - lowering alone makes the same programs or meets the error
            pass
    return lower_here(), "alone"


def rank_program(graph: fx.GraphModule, config: ParallelConfig, rank: int, *, cluster: Cluster,
                 first: int = 0, tp_group: str = "tp") -> RankProgram:
    """The :class:`passes.ir.program.RankProgram` of global ``rank`` (no process group needed):
    :func:`lower_plan` of that rank's programs, unchecked."""
    return lower_plan(graph, config, cluster=cluster, ranks=(rank,), check=False, first=first,
                      tp_group=tp_group).rank_program(rank, first=first)


def build_parallel_model(graph: fx.GraphModule, config: ParallelConfig, mesh: Mesh, *,
                         cluster: Cluster, optimizer=None, overlap_grad_sync: bool = True,
                         bucket_bytes: int | None = None, tp_group: str = "tp", zero3_prefetch: int = ZERO3_PREFETCH,
                         **runtime) -> ParallelModel:
    """Lower ``graph`` (from :func:`capture_for_pipeline`) for this rank of ``mesh`` under
    ``config`` (:func:`lower_plan`, checked with the mesh's ranks) and return the runtime's
    :class:`ParallelModel` executing it.

    ``cluster``: what the policy passes cost against (``local_cluster(mesh.size)`` for this
    machine). ``tp_group``: the name the programs look their tp group up by (give
    models that live side by side in one process different names). ``zero3_prefetch``: ZeRO-3
    gather sites issued ahead of the running one. ``optimizer`` and ``runtime``
    (``lr_scheduler``, ``clip_grad_norm``, ``nonfinite``): as :class:`ParallelModel` takes them.
    """
    lowering = lower_plan(graph, config, cluster=cluster, mesh=mesh, tp_group=tp_group,
                          bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES, overlap_grad_sync=overlap_grad_sync,
                          zero3_prefetch=zero3_prefetch)
    kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return ParallelModel(lowering.rank_program(mesh.rank, first=mesh.first), mesh, optimizer=optimizer,
                         overlap_grad_sync=overlap_grad_sync, zero3_prefetch=zero3_prefetch, **kwargs, **runtime)


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
