"""``auto_parallelize``: plan a model for the job it runs in, and return a trainer for this rank.

Called on every rank of a job (torchrun, or :func:`runtime.dist.launch.spawn`)::

    model = auto_parallelize("gpt:layers=4,hidden=64,dropout=0.0", training=Training(global_batch=8),
                             fix="dp=2,pp=2", job=Job(dump_dir="out"))
    for step in range(n):
        loss = model.train_step(batch(step))      # the global batch, the same on every rank
    model.finish()                                 # measurements.json (+ report.html) on rank 0

What happens, in order (every rank, unless said):

1. ``torch.distributed`` is initialised from env:// if it is not yet (the default group gets a
   long timeout: it only carries start-up and the plan broadcast);
2. rank 0 captures the model (:func:`partitioner.compile.build.capture_training_step`, every named dim
   symbolic) and runs the analysis passes (shapes, blocks, FLOPs, memory per sample); the
   analysed graph travels to every rank (:mod:`passes.ir.graph_transfer`), which rebuilds it
   around its own module, and rank 0's weights are broadcast into it: the job captures once;
3. rank 0 profiles that graph (:func:`partitioner.search.profile.profile_graph`) and searches the plan
   (:mod:`partitioner.search.search`) on ``cluster`` (default ``detect_cluster()``, printed in one line) with ``fix``
   pinned (or takes the ``plan`` given); the plan, or the error, is broadcast so every rank
   starts the same plan or fails with the same message. The search offers only configs the lowering and the runtime carry out;
4. the plan must use exactly the job's ranks (``dp * tp * pp == world_size``), else
   :class:`ConfigError` with the numbers; a plan that fits no device raises
   :class:`InfeasiblePlanError` from the search;
5. each rank lowers every rank program from the graph (:func:`passes.lowering.lower.lower`) and checks
   that their communication matches (:mod:`passes.checks.communication_check`: no collective, the same
   verdict on every rank, before any collective of training), then runs its own; with
   ``job.dump_dir``, rank 0's lowering also dumps every pass (:func:`partitioner.api.dumps.write_plan_dumps`);
6. a :class:`runtime.exec.parallel_model.ParallelModel` executes the program (its process groups
   have ``job.timeout_s``); :meth:`AutoParallel.finish` writes ``measurements.json`` and the report
   again with the measured numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx

from ir_dumps.report import write_report
from ir_dumps.writer import DumpWriter
from partitioner.compile.build import (capture_training_step, check_before_launch, lower_plan, run_analysis_passes,
                                      share_stage_programs, share_whole_graph_prefix)
from partitioner.calibration.job_cluster import detect_cluster
from partitioner.cost.cost_model import cost_hooks
from partitioner.cost.cluster import Cluster
from partitioner.calibration.detect import describe
from partitioner.api.dumps import write_plan_dumps
from partitioner.search.memory_check import replay_check
from partitioner.inputs.job import Job
from partitioner.inputs.model_spec import ModelSpec, meta_copy
from partitioner.inputs.models import as_spec
from partitioner.inputs.knobs import check_fix
from partitioner.inputs.training import Training
from partitioner.search.profile import (ModelProfile, profile_graph, profile_model, profile_spec, with_dag,
                                        with_tensor_remat)
from partitioner.search.search import check_pinned_inputs
from partitioner.search.search import search
from passes.ir.config import TORCH_DTYPES
from passes.ir.errors import CaptureError, ConfigError, InfeasiblePlanError, PartitionerError, PassError
from passes.ir.graph_transfer import pack_graph, unpack_graph
from passes.ir.plan import Plan
from passes.ir.schedule.actions import Kind
from passes.lowering.manager import PassContext
from runtime.checkpoint import directory as checkpoint_dir
from runtime.dist import comm
from runtime.checkpoint.directory import TrainState
from runtime.exec.data import RankLoader, ShardedSampler
from runtime.dist.faults import arm_from_env, gather_pids
from runtime.observe.measure import PhaseClock, RunMeasurements, StepMeasurement, StepTimer
from runtime.observe.metrics import MetricsLogger, StepMetrics, dim_sizes, gather_step_metrics, step_tokens
from runtime.dist.mesh import START_TIMEOUT_S, Mesh, default_backend, init_distributed
from runtime.exec.parallel_model import ParallelModel


# ---------------------------------------------------------------------------------------------
# Planning (no process group needed: testable on its own)

def choose_plan(model: str | ModelSpec, cluster: Cluster, *, world_size: int, global_batch: int,
                fix: dict | str | None = None, dtype: str = "fp32", optimizer: str = "adamw",
                profile: ModelProfile | None = None, graph: fx.GraphModule | None = None) -> Plan:
    """The planner's best plan for ``model`` on ``cluster``, checked against the job's ``world_size``.

    ``profile``: the model's profile when the caller has it (a job profiles the graph it captured);
    otherwise the model is profiled here. ``graph``: the analysed capture; with it, the plan's
    memory is the exact replay of its rank programs (:mod:`partitioner.search.memory_check`) and a
    candidate that the replay shows does not fit is dropped. Raises :class:`InfeasiblePlanError` when no plan fits the
    devices' memory, and :class:`ConfigError` when the plan needs a different number of ranks than
    the job has. ``checkpointing="tensor"`` is priced (a MILP over the whole graph) only when
    ``fix`` pins it: then a ``profile`` made without it is priced here from ``graph``.
    """
    pinned = check_fix(fix, where="choose_plan: fix")
    axes = {k: int(pinned[k]) for k in ("dp", "tp", "pp", "cp") if k in pinned}
    ranks = axes.get("dp", 1) * axes.get("tp", 1) * axes.get("pp", 1) * axes.get("cp", 1)
    if axes and (world_size % ranks or (len(axes) == 4 and ranks != world_size)):
        raise ConfigError(
            f"plan needs {ranks} ranks (dp={axes.get('dp', 1)} tp={axes.get('tp', 1)} pp={axes.get('pp', 1)} "
            f"cp={axes.get('cp', 1)}) but the job has {world_size}; fix pins them: launch {ranks} processes "
            f"(torchrun --nproc-per-node {ranks}) or change fix so that dp*cp*tp*pp = {world_size}")
    if isinstance(model, ModelSpec):  # what its inputs rule out, refused before the profile captures it
        check_pinned_inputs(pinned, model.inputs, where="choose_plan: fix")
    # checkpointing='tensor' is priced by a MILP over the whole graph: only when pinned
    tensor = pinned.get("checkpointing") == "tensor"
    if profile is None:
        profile = (profile_model(model, dtype=dtype, optimizer=optimizer, tensor_remat=tensor) if isinstance(model, str)
                   else profile_spec(meta_copy(model), dtype=dtype, optimizer=optimizer, tensor_remat=tensor))
    elif tensor and graph is not None and not profile.tensor_remat_asked:
        profile = with_tensor_remat(profile, graph)
    # checkpointing='dag' (the dag policy over every block, a cost that grows with depth) is
    # priced when pinned, else by the search where a dag plan can win (search's price_dag)
    later = graph is not None and not profile.dag_asked and pinned.get("checkpointing") in (None, "dag")
    if later and pinned.get("checkpointing") == "dag":
        profile, later = with_dag(profile, graph), False
    check = replay_check(graph, cluster, optimizer=optimizer) if graph is not None else None
    chosen = search(profile, cluster, global_batch=global_batch, fix=pinned, optimizer=optimizer, check=check,
                    price_dag=functools.partial(with_dag, profile, graph) if later else None)
    check_world_size(chosen, world_size)
    return chosen


def check_world_size(plan: Plan, world_size: int) -> None:
    """Refuse a plan whose ``dp * cp * tp * pp`` is not the job's number of ranks."""
    if plan.world_size != world_size:
        raise ConfigError(
            f"plan needs {plan.world_size} ranks (dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.config.cp}) but "
            f"the job has {world_size}; launch {plan.world_size} processes (torchrun --nproc-per-node {plan.world_size}) or "
            f"plan for {world_size} devices (cluster=local_cluster({world_size}), or fix knobs whose product is "
            f"{world_size})")



# ---------------------------------------------------------------------------------------------
# The trainer one rank gets back

class AutoParallel:
    """This rank's share of an auto-parallelized training job (see the module docstring).

    ``plan``: the Plan; ``model``: the :class:`ParallelModel`; ``timer``: per-step measurements
    (:class:`runtime.observe.measure.StepTimer`); ``identities``: host and pid of every rank (for naming
    a dead peer, :mod:`runtime.dist.faults`).
    """

    def __init__(self, model: Any, plan: Plan, cluster: Cluster, spec: ModelSpec, *, dump_dir: Path | None,
                 track_memory: bool | int = 2, notes: Sequence[str] = ()):

        self.model, self.plan, self.cluster, self.spec = model, plan, cluster, spec
        self.dump_dir = dump_dir
        self.rank = dist.get_rank()
        self.notes = list(notes)
        self.timer = StepTimer(model, track_memory=track_memory)
        self.build_seconds: dict[str, float] = {}
        """Wall seconds of each phase of :func:`auto_parallelize` on this rank (capture, analysis,
        plan, mesh, lower, runtime)."""
        self.identities = gather_pids(model.mesh.group)
        self._fault = arm_from_env(model.executor, self.rank)
        self._step = 0
        self.last_metrics: StepMetrics | None = None
        """The last step's :class:`runtime.observe.metrics.StepMetrics` (every rank), set by :meth:`record_step`."""
        self._metrics_logger: MetricsLogger | None = None
        self.sampler = None
        """The data sampler of :meth:`fit` (its ``state_dict()`` goes into a checkpoint's ``extra``)."""

    @property
    def last_action(self):
        """The schedule action this rank ran last (or runs now), for failure messages."""
        return self.timer.last_action

    def train_step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the *global* batch (the same tensors on every rank); returns the
        batch's mean loss, the same float on every rank. Measured (:mod:`runtime.observe.measure`)."""
        return self._measured_step(lambda: self.model.train_step(batch),
                                   tokens=step_tokens(dim_sizes(self.model.inputs, batch))).loss

    def _measured_step(self, run: Callable[[], float], *, tokens: int) -> StepMeasurement:
        """One step: the fault-injection hook, the measurement, the step count, the metrics."""
        if self._fault is not None:
            self._fault.begin_step(self._step)
        skipped_before = self.model.skipped_steps
        m = self.timer.measure(self._step, run)
        self._step += 1
        self.record_step(m, tokens=tokens, skipped=self.model.skipped_steps > skipped_before)
        return m

    def attach_metrics(self, logger: MetricsLogger | None) -> None:
        """Log every step's metrics to ``logger`` from now on (``None`` detaches). Make the
        logger on rank 0 only and pass ``None`` on the others: every rank computes the metrics
        (a collective), only the one with a logger writes them."""
        self._metrics_logger = logger

    def record_step(self, measurement: StepMeasurement, *, tokens: int, skipped: bool = False) -> StepMetrics:
        """The :class:`runtime.observe.metrics.StepMetrics` of the step just measured, on every rank (a
        collective over the mesh: one small all-gather of each rank's peak memory and wall
        time); stored on ``last_metrics`` and logged to the attached logger. ``tokens``: tokens
        of the global batch (batch x seq for token models, else samples); ``skipped``: the
        optimizer skipped the step. :meth:`train_step` and :meth:`fit` call it; a loop that
        measures steps itself calls it after each one."""
        metrics = gather_step_metrics(self.model, measurement, tokens=tokens, predicted=self.plan.predicted,
                                      skipped=skipped)
        self.last_metrics = metrics
        if self._metrics_logger is not None:
            self._metrics_logger.log(metrics)
        return metrics

    def fit(self, dataset: Any, *, steps: int, seed: int = 0, sampler_state: dict | None = None,
            on_step: Callable[[int, float], None] | None = None) -> list[float]:
        """Train ``steps`` optimizer steps on ``dataset`` (any ``torch.utils.data.Dataset`` of
        fixed-shape samples: dicts name -> tensor, or tuples in input order), each rank loading
        only the fields its stages read of its dp shard (:mod:`runtime.exec.data`). Returns the losses
        (the same on every rank).

        The sample order is a function of ``seed`` and the epoch only; ``sampler_state`` (a
        ``self.sampler.state_dict()``, e.g. saved with a checkpoint) continues that sequence,
        its seed winning over ``seed``. A later call on a dataset of the same length with the
        same seed continues where the last one stopped. ``on_step(step, loss)`` is called after
        each step with the number of steps done so far. Steps are measured as by
        :meth:`train_step` (data loading is outside the measurement)."""
        pm = self.model
        sampler = self.sampler
        if (sampler_state is not None or sampler is None or sampler.num_samples != len(dataset)
                or sampler.seed != seed):
            sampler = ShardedSampler(len(dataset), pm.config.global_batch, dp=pm.config.dp,
                                     dp_index=pm.mesh.replica_index, seed=seed)  # cp ranks share samples
            if sampler_state is not None:
                sampler.load_state_dict(sampler_state)
        self.sampler = sampler
        self.loader = loader = RankLoader(dataset, sampler, pm.consumed_inputs, pm.inputs)
        losses = []
        for _ in range(steps):
            rows, dims = loader.next()
            m = self._measured_step(lambda: pm.train_local(rows, dims),
                                    tokens=pm.config.global_batch * int(dims.get("seq", 1)))
            losses.append(m.loss)
            if on_step is not None:
                on_step(self._step, m.loss)
        return losses

    def eval_step(self, batch: Sequence[torch.Tensor]) -> float:
        """The mean loss of the global ``batch`` without gradients or an optimizer step.

        Runs the forward half of this rank's schedule (its RECV_F / F / SEND_F actions, in
        schedule order: forwards depend only on earlier forwards, so the filtered lists cannot
        deadlock) under ``torch.no_grad``. The stage programs are the captured *training* graph:
        dropout, if the model has any, stays active as captured.
        """

        pm = self.model
        forward = [a for a in pm.actions if a.kind in (Kind.RECV_F, Kind.FORWARD, Kind.SEND_F)]
        micro, dims = pm.micro_batches(batch)
        with torch.no_grad():
            losses = pm.executor.run(forward, micro, dims, grad_sync=lambda: None, step=lambda: None)
        total = torch.zeros((), dtype=torch.float64, device=pm.mesh.device)
        if losses:  # as train_step: every tp rank of the last stage holds the same loss
            total += torch.stack(losses).double().mean() / (pm.dp_cp * pm.tp)
        comm.all_reduce(total, pm.mesh.group)
        return float(total)

    def save(self, root: str | Path, *, keep: int | None = None, extra: dict | None = None) -> Path:
        """Checkpoint parameters, optimizer state and train state (RNG per rank, lr scheduler,
        loss scaler, ``extra``: e.g. the data sampler's position) atomically into
        ``root/step_<step>`` (:mod:`runtime.checkpoint.directory`: a save killed midway leaves the
        earlier checkpoints loadable); keeps the last ``keep`` (``None``: all). Returns the
        checkpoint's directory. Loadable under any other plan, or into the plain model
        (``runtime.checkpoint.io.load_into_module(module, path)``). Every rank calls it."""

        return checkpoint_dir.save(self.model, root, step=self._step, keep=keep, extra=extra,
                                   plan=self.plan.summary())

    def load(self, path: str | Path) -> TrainState:
        """Load a checkpoint written under any plan: ``path`` is a root (its latest complete
        checkpoint) or one checkpoint directory; training continues from its step. Returns the
        :class:`runtime.checkpoint.directory.TrainState` (``step``, ``extra``, ``path``)."""

        state = checkpoint_dir.load(self.model, path)
        self._step = state.step
        return state

    def gather_measurements(self):
        """Every rank's step measurements with the plan's predictions (a collective over the
        mesh); a :class:`runtime.observe.measure.RunMeasurements` on every rank."""

        steps = comm.all_gather_object(self.timer.steps, self.model.mesh.group)
        p = self.plan.predicted
        return RunMeasurements(plan_summary=self.plan.summary(), predicted_step_time_s=p.step_time_s,
                               predicted_peak_memory_bytes=p.peak_memory_bytes, predicted_terms=dict(p.terms),
                               world_size=len(steps), steps=steps, notes=self.notes + _TRACKER_NOTE)

    def finish(self) -> Any:
        """Gather measurements; on rank 0 with a dump dir write ``measurements.json`` and the
        report with the measured column. Returns the RunMeasurements (every rank)."""
        run = self.gather_measurements()
        if self.rank == 0 and self.dump_dir is not None:

            run.write(self.dump_dir / "measurements.json")
            write_report(self.dump_dir / "report.html", plan=self.plan, cluster=self.cluster,
                         measured=run.summary_by_rank(), graph=getattr(self, "_graph", None),
                         measured_step=[steps[-1] for steps in run.steps] if all(run.steps) else None)
        return run


_TRACKER_NOTE = ["on CPU, steps whose peak_memory_bytes is set ran under the live-bytes tracker (slower): "
                 "take step times from the others (summary_by_rank skips the first 2 steps)"]


def _from_rank0(make: Callable[[], Any]) -> Any:
    """Rank 0 runs ``make``; every rank returns its (picklable) result or raises its error (same
    type, same text), so a refusal on rank 0 does not leave the others waiting."""
    box: Any = None
    if dist.get_rank() == 0:
        try:
            box = ("ok", make())
        except PartitionerError as exc:
            box = ("error", type(exc).__name__, str(exc))
    box = comm.broadcast_object(box, src=0)
    if box[0] == "error":
        _, kind, message = box
        raise _ERRORS.get(kind, ConfigError)(message)
    return box[1]


_ERRORS = {cls.__name__: cls for cls in (InfeasiblePlanError, ConfigError, CaptureError, PassError)}


def _broadcast_weights(graph: torch.fx.GraphModule, device: torch.device) -> None:
    """Every rank starts from rank 0's weights: the captured graph's parameters and buffers, in
    name order, through the job's device (an NCCL group carries CUDA tensors only)."""
    tensors = dict(graph.named_parameters())
    tensors.update(dict(graph.named_buffers()))
    with torch.no_grad():
        comm.broadcast_tensors([t for _, t in sorted(tensors.items())], src=0, device=device)


def auto_parallelize(model: str | ModelSpec, cluster: Cluster | str | None = None, *, training: Training,
                     fix: dict | str | None = None, plan: Plan | None = None, job: Job = Job()) -> AutoParallel:
    """Plan ``model`` for this job and build this rank's trainer (call on every rank).

    ``model``: a spec string (``"gpt:layers=4,hidden=64"``, or ``path/to/file.py:factory``) or a
    :class:`ModelSpec` (a module of your own with its inputs, named dims such as ``("batch",
    "seq")``, and its loss). ``cluster``: a Cluster, preset name or cluster file (default
    :func:`detect_cluster`: the GPUs and launcher this job sees, or this machine's CPU
    calibration, measured by the job's ranks the first time).
    ``training``: what to train with (:class:`partitioner.inputs.training.Training`: the global
    batch, the optimizer, whose state the planner costs, its lr schedule, gradient clipping, what
    a NaN/inf gradient does, the dtype). A 16-bit dtype casts the module (in place) and its
    floating inputs to it before capture; without one, the plan's dtype, else the cluster's
    (:attr:`Cluster.default_dtype`: bf16 on GPUs, fp32 on CPU ranks).
    How to parallelize: ``fix`` pins knobs and the search chooses the rest (``"dp=2,pp=2"`` or a
    dict, ``--fix``), or ``plan`` is run as it is (a :class:`Plan`, e.g. ``Plan.from_json`` of a
    ``plan.json``; ``--plan``), still checked against the world size; not both.
    ``job``: how the job runs (:class:`partitioner.inputs.job.Job`: the timeout of every
    collective and receive, the dump directory, memory tracking). See the module docstring for
    what is written to ``job.dump_dir``.
    """

    # The groups and the pinned knobs are refused here, before any rank joins the job.
    if not isinstance(training, Training):
        raise ConfigError(f"auto_parallelize: training is {type(training).__name__}, not a Training; pass "
                          f"training=Training(global_batch=8, ...) (from partitioner import Training)")
    if not isinstance(job, Job):
        raise ConfigError(f"auto_parallelize: job is {type(job).__name__}, not a Job; pass "
                          f"job=Job(timeout_s=60, dump_dir=...) (from partitioner import Job) or leave it out")
    if plan is not None and fix is not None:
        raise ConfigError("auto_parallelize: fix and plan both given; a plan fixes every knob already: pass "
                          "plan=... alone, or fix=... alone to search the rest")
    if plan is not None and not isinstance(plan, Plan):
        raise ConfigError(f"auto_parallelize: plan is {type(plan).__name__}, not a Plan; pass "
                          f"Plan.from_json(open('plan.json').read()), or fix=... to search")
    global_batch, dtype, timeout_s = training.global_batch, training.dtype, job.timeout_s
    fix = check_fix(fix, where="auto_parallelize: fix")
    factory = training.optimizer_factory()
    planned_optimizer = training.optimizer_name()  # what the planner counts state bytes for
    if dtype is None and plan is not None:
        dtype = plan.config.dtype
    if plan is not None and plan.global_batch != global_batch:
        raise ConfigError(f"auto_parallelize: the plan is for global batch {plan.global_batch}, not {global_batch}; "
                          f"pass Training(global_batch={plan.global_batch}) or re-plan for {global_batch}")
    if plan is not None and plan.config.dtype != dtype:  # its byte counts and rank programs are another dtype's
        raise ConfigError(f"auto_parallelize: the plan trains in {plan.config.dtype}, not {dtype}; "
                          f"pass Training(dtype={plan.config.dtype!r}) or re-plan for {dtype}")
    clock = PhaseClock()
    spec = as_spec(model)
    check_pinned_inputs(fix, spec.inputs, where="auto_parallelize: fix")  # what the inputs rule out
    clock.lap("model")
    init_distributed(timeout_s=max(timeout_s, START_TIMEOUT_S))
    clock.lap("join")
    world, rank = dist.get_world_size(), dist.get_rank()
    detected = cluster is None
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    cluster = cluster or detect_cluster(world)
    if detected and rank == 0:
        print(f"partitioner: detected cluster: {describe(cluster)} ({cluster.name}; pass cluster= to override)",
              file=sys.stderr, flush=True)
    dtype = dtype or cluster.default_dtype
    if dtype != "fp32":  # every rank: the graph is rebuilt around each rank's own (cast) module
        spec = spec.cast(TORCH_DTYPES[dtype])
    device = torch.device("cuda", torch.cuda.current_device()) if default_backend() == "nccl" else torch.device("cpu")
    out_dir = Path(job.dump_dir) if job.dump_dir is not None else None
    writer = DumpWriter(out_dir, model=spec.name) if out_dir is not None and rank == 0 else None
    clock.lap("cluster")

    # Rank 0 captures the model and analyses it (memory per sample: batch 1, concretely, what the
    # search profiles); every rank rebuilds that graph around its own module and lowers it.
    def capture_and_analyse():
        captured = capture_training_step(spec, device=device.type)
        clock.lap("capture")
        run_analysis_passes(captured, optimizer=planned_optimizer, dtype=dtype, writer=writer, memory_batch=1)
        clock.lap("analysis")
        return pack_graph(captured, spec.module)

    graph = unpack_graph(_from_rank0(capture_and_analyse), spec.module)
    clock.lap("graph to every rank")
    _broadcast_weights(graph, device)
    clock.lap("weights")
    if plan is None:
        chosen = Plan.from_json(_from_rank0(lambda: choose_plan(
            spec, cluster, world_size=world, global_batch=global_batch, fix=fix, dtype=dtype,
            optimizer=planned_optimizer,
            profile=profile_graph(graph, dtype=dtype, name=spec.name, dag=False), graph=graph).to_json()))
    else:
        check_world_size(plan, world)
        chosen = plan
    # plan.json says what the job planned on (detected, calibrated or given), not only a name
    chosen = dataclasses.replace(chosen, cluster_spec=cluster.to_dict())
    if chosen.global_batch != global_batch:
        raise ConfigError(f"auto_parallelize: the plan is for global batch {chosen.global_batch}, "
                          f"not {global_batch}; re-plan or pass Training(global_batch={chosen.global_batch})")
    clock.lap("plan")

    mesh = Mesh.for_config(chosen.config, timeout_s=timeout_s)
    clock.lap("mesh")
    ctx = PassContext(optimizer=planned_optimizer, dtype=chosen.config.dtype)
    if writer is not None:
        # the other ranks' lower_plan takes the whole-graph prefix from this one: make and send it
        share_whole_graph_prefix(graph, chosen.config, mesh, cost=cost_hooks(cluster), ctx=ctx)
        dumps = write_plan_dumps(out_dir, graph=graph, plan=chosen, cluster=cluster, writer=writer,
                                 onnx=job.onnx)
        # the ranks of its data axis wait for its programs: it sends none, they lower alone
        share_stage_programs(graph, chosen.config, mesh, lambda: dumps.lowering, cost=cost_hooks(cluster), ctx=ctx,
                             share=False)
        program = dumps.lowering.rank_program(rank)
        check_before_launch(mesh, dumps.lowering, program)
        clock.lap("lower+dumps")
    else:
        program = lower_plan(graph, chosen.config, cluster=cluster, mesh=mesh, ctx=ctx).rank_program(
            mesh.rank, first=mesh.first)
        clock.lap("lower")
    pm = ParallelModel(program, mesh, optimizer=factory, lr_scheduler=training.lr_scheduler,
                       clip_grad_norm=training.clip_grad_norm, nonfinite=training.nonfinite)
    trainer = AutoParallel(pm, chosen, cluster, spec, dump_dir=out_dir, track_memory=job.track_memory)
    clock.lap("runtime")
    trainer.build_seconds = dict(clock.seconds)
    if writer is not None:
        trainer._graph = dumps.lowering.graph
    return trainer
