"""``auto_parallelize``: plan a model for the job it runs in, and return a trainer for this rank.

Called on every rank of a job (torchrun, or :func:`runtime.launch.spawn`)::

    model = auto_parallelize("gpt:layers=4,hidden=64,dropout=0.0", global_batch_size=8,
                             fix="dp=2,pp=2", dump_dir="out")
    for step in range(n):
        loss = model.train_step(batch(step))      # the global batch, the same on every rank
    model.finish()                                 # measurements.json (+ report.html) on rank 0

What happens, in order:

1. ``torch.distributed`` is initialised from env:// if it is not yet (the default group gets a
   long timeout: it only carries start-up and the plan broadcast);
2. rank 0 profiles the model and searches the plan (:mod:`partitioner.search`) on ``cluster``
   (default ``Cluster.local(world_size)``) with ``fix`` pinned; the plan, or the error, is
   broadcast so every rank starts the same plan or fails with the same message;
3. the plan must use exactly the job's ranks (``dp * tp * pp == world_size``) and only knobs the
   runtime implements, else :class:`ConfigError` with the numbers; a plan that fits no device
   raises :class:`InfeasiblePlanError` from the search;
4. rank 0's parameters are broadcast (every rank starts from the same weights), and a
   :class:`runtime.parallel_model.ParallelModel` is built from the plan's knobs (its process
   groups have ``timeout_s``);
5. with ``dump_dir``, rank 0 writes ``plan.json``, ``report.html`` and the IR after every
   analysis pass (``ir/``), and :meth:`AutoParallel.finish` writes ``measurements.json`` and the
   report again with the measured numbers.

Limits: the runtime splits stages by balancing layer counts (:class:`ParallelModel`), not at the
planner's stage boundaries; ``zero_stage=2`` runs as ZeRO-1 (same numbers, gradients not
sharded). Knobs the runtime cannot run (``sequence_parallel``, ``offload="optimizer"``, and
tp/checkpointing/offload when the installed ParallelModel lacks them) are pinned to their
defaults before the search when the user did not pin them, and refused with a hint otherwise.
"""
from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partitioner.cluster import Cluster
from partitioner.errors import ConfigError, InfeasiblePlanError, PartitionerError
from partitioner.model_spec import ModelSpec, build_model
from partitioner.plan_types import Plan
from passes.meta import InputSpec

START_TIMEOUT_S = 600.0
"""Seconds the default process group waits (start-up, plan broadcast): planning on a loaded
machine may take a while; training traffic uses the mesh's groups and ``timeout_s``."""


# ---------------------------------------------------------------------------------------------
# Planning (no process group needed: testable on its own)

def as_spec(model: str | ModelSpec | nn.Module, *, inputs: Sequence[InputSpec] | None = None,
            loss_fn: Callable[..., torch.Tensor] | None = None, dims: dict[str, int] | None = None,
            name: str | None = None, seed: int = 0) -> ModelSpec:
    """A :class:`ModelSpec` from a spec string (built on CPU with ``seed``), a ModelSpec, or a
    module with ``inputs`` (named dims) and ``loss_fn(module, *inputs)``."""
    if isinstance(model, str):
        return build_model(model, device="cpu", seed=seed)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        if inputs is None or loss_fn is None:
            raise ConfigError("auto_parallelize: a bare nn.Module needs inputs=(InputSpec(...), ...) with named "
                              "dims and loss_fn(module, *inputs) -> scalar")
        values = {"batch": 2, **(dims or {})}  # capture traces with example sizes; batch is symbolic anyway
        missing = sorted({d for i in inputs for d in i.shape if isinstance(d, str)} - set(values))
        if missing:
            raise ConfigError(f"auto_parallelize: give a size for the named dim(s) {missing} of the inputs, "
                              f"e.g. dims={{{missing[0]!r}: 128}}")
        return ModelSpec(name=name or type(model).__name__, module=model, inputs=tuple(inputs), loss=loss_fn,
                         dims=values)
    raise ConfigError(f"auto_parallelize: model must be a spec string, a ModelSpec or an nn.Module, "
                      f"got {type(model).__name__}")


def meta_copy(spec: ModelSpec) -> ModelSpec:
    """The same model on the meta device (no weights): what analysis and profiling read."""
    module = copy.deepcopy(spec.module).to("meta")  # deepcopy keeps tied weights tied
    return ModelSpec(name=spec.name, module=module, inputs=spec.inputs, loss=spec.loss, dims=dict(spec.dims))


def choose_plan(model: str | ModelSpec, cluster: Cluster, *, world_size: int, global_batch_size: int,
                fix: dict | str | None = None, dtype: str = "fp32", optimizer: str = "adamw") -> Plan:
    """The planner's best plan for ``model`` on ``cluster``, checked against the job's ``world_size``.

    Raises :class:`InfeasiblePlanError` when no plan fits the devices' memory, and
    :class:`ConfigError` when the plan needs a different number of ranks than the job has.
    """
    from partitioner.planning import parse_fix
    from partitioner.profile import profile_model
    from partitioner.search import plan as search

    pinned = parse_fix(fix) if isinstance(fix, str) else dict(fix or {})
    axes = {k: int(pinned[k]) for k in ("dp", "tp", "pp") if k in pinned}
    ranks = axes.get("dp", 1) * axes.get("tp", 1) * axes.get("pp", 1)
    if axes and (world_size % ranks or (len(axes) == 3 and ranks != world_size)):
        raise ConfigError(
            f"plan needs {ranks} ranks (dp={axes.get('dp', 1)} tp={axes.get('tp', 1)} pp={axes.get('pp', 1)}) "
            f"but the job has {world_size}; fix pins them: launch {ranks} processes (torchrun --nproc-per-node "
            f"{ranks}) or change fix so that dp*tp*pp = {world_size}")
    if isinstance(model, str):
        profile = profile_model(model, dtype=dtype, optimizer=optimizer)
    else:
        from partitioner.profile import profile_spec

        profile = profile_spec(meta_copy(model), dtype=dtype, optimizer=optimizer)
    chosen = search(profile, cluster, global_batch=global_batch_size, fix=pinned, optimizer=optimizer)
    # The best plan the runtime can run: a knob it lacks (e.g. optimizer offload), unless the user
    # pinned it, is pinned to its default and the search repeated.
    for knob in _unsupported(chosen):
        if knob in pinned:
            break  # runtime_kwargs refuses it later, naming the knob
        pinned[knob] = _DEFAULTS[knob]
        chosen = search(profile, cluster, global_batch=global_batch_size, fix=pinned, optimizer=optimizer)
    check_world_size(chosen, world_size)
    return chosen


_DEFAULTS = {"tp": 1, "checkpointing": "none", "offload": "none", "sequence_parallel": False}


def _unsupported(plan: Plan) -> list[str]:
    """Knobs of ``plan`` the runtime cannot run, in the order they are dropped."""
    out = []
    for knob, default in _DEFAULTS.items():
        try:
            runtime_kwargs(_with(plan, **{k: v for k, v in _DEFAULTS.items() if k != knob}))
        except ConfigError:
            if getattr(plan, knob) != default:
                out.append(knob)
    return out


def _with(plan: Plan, **knobs) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, **knobs)


def check_world_size(plan: Plan, world_size: int) -> None:
    """Refuse a plan whose ``dp * tp * pp`` is not the job's number of ranks."""
    if plan.world_size != world_size:
        raise ConfigError(
            f"plan needs {plan.world_size} ranks (dp={plan.dp} tp={plan.tp} pp={plan.pp}) but the job has "
            f"{world_size}; launch {plan.world_size} processes (torchrun --nproc-per-node {plan.world_size}) or "
            f"plan for {world_size} devices (cluster=Cluster.local({world_size}), or fix knobs whose product is "
            f"{world_size})")


def runtime_kwargs(plan: Plan) -> dict[str, Any]:
    """ParallelModel keyword arguments for ``plan``'s knobs; refuses knobs the runtime lacks."""
    from runtime.parallel_model import ParallelModel

    accepted = inspect.signature(ParallelModel.__init__).parameters
    kwargs: dict[str, Any] = dict(dp=plan.dp, pp=plan.pp, schedule=plan.schedule,
                                  num_micro_batches=plan.num_micro_batches, virtual_pp=plan.virtual_pp,
                                  global_batch=plan.global_batch, zero=plan.zero_stage)
    if plan.sequence_parallel:
        kwargs["sequence_parallel"] = True
    boundaries, _ = plan_stage_boundaries(plan)
    if boundaries:
        kwargs["stage_boundaries"] = boundaries
    # tp/checkpointing/offload are passed only when they differ from the runtime's defaults, so
    # a runtime without them still runs every plan that does not use them.
    for knob, default in (("tp", 1), ("checkpointing", "none"), ("offload", "none")):
        value = getattr(plan, knob)
        if value != default:
            if knob not in accepted:
                raise ConfigError(f"auto_parallelize: the plan uses {knob}={value}, which this runtime's "
                                  f"ParallelModel does not implement; plan with fix='{knob}={default}'")
            supported = _runtime_choices(knob)
            if supported is not None and value not in supported:
                raise ConfigError(f"auto_parallelize: the plan uses {knob}={value}; the runtime implements "
                                  f"{knob} in {supported}; plan with fix='{knob}={default}'")
            kwargs[knob] = value
    return kwargs


def plan_stage_boundaries(plan: Plan) -> tuple[tuple[int, ...] | None, str]:
    """The block index where each virtual stage ``1 .. pp*virtual_pp - 1`` of ``plan`` starts
    (``StagePlan.layers`` index the chain embedding = 0, blocks 1..L, head = L+1; chunk ``k`` of
    stage ``s`` is virtual stage ``k*pp + s``), and ``""``; or ``(None, why)`` when the runtime,
    which cuts between blocks, cannot follow the plan (a stage holding no block)."""
    n = plan.pp * plan.virtual_pp
    if n == 1:
        return (), ""
    ranges = {}
    for stage in plan.stages:
        for k, r in enumerate(stage.layers):
            ranges[k * plan.pp + stage.index] = tuple(r)
    if sorted(ranges) != list(range(n)):
        return None, f"the plan lists {len(ranges)} stage chunks for {n} virtual stages"
    blocks = ranges[n - 1][1] - 2  # the chain ends with the head at L + 1
    for vs in range(n):
        start, stop = ranges[vs]
        if min(stop, blocks + 1) <= max(start, 1):
            return None, f"virtual stage {vs} holds no block (chain {start}..{stop - 1}); the runtime cuts between blocks"
    return tuple(ranges[vs][0] - 1 for vs in range(1, n)), ""


def _runtime_choices(knob: str) -> tuple | None:
    """The values of ``knob`` the runtime's rank programs implement (None: unknown/any)."""
    try:
        from runtime import rank_program
    except ImportError:
        return None
    return getattr(rank_program, {"checkpointing": "CHECKPOINTING", "offload": "OFFLOAD"}.get(knob, ""), None)


# ---------------------------------------------------------------------------------------------
# The trainer one rank gets back

class AutoParallel:
    """This rank's share of an auto-parallelized training job (see the module docstring).

    ``plan``: the Plan; ``model``: the :class:`ParallelModel`; ``timer``: per-step measurements
    (:class:`runtime.measure.StepTimer`); ``identities``: host and pid of every rank (for naming
    a dead peer, :mod:`runtime.faults`).
    """

    def __init__(self, model: Any, plan: Plan, cluster: Cluster, spec: ModelSpec, *, dump_dir: Path | None,
                 track_memory: bool | int = 2, notes: Sequence[str] = ()):
        from runtime.faults import arm_from_env, gather_pids
        from runtime.measure import StepTimer

        self.model, self.plan, self.cluster, self.spec = model, plan, cluster, spec
        self.dump_dir = dump_dir
        self.rank = dist.get_rank()
        self.notes = list(notes)
        self.timer = StepTimer(model, track_memory=track_memory)
        self.identities = gather_pids(model.mesh.group)
        self._fault = arm_from_env(model.executor, self.rank)
        self._step = 0

    @property
    def last_action(self):
        """The schedule action this rank ran last (or runs now), for failure messages."""
        return self.timer.last_action

    def train_step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the *global* batch (the same tensors on every rank); returns the
        batch's mean loss, the same float on every rank. Measured (:mod:`runtime.measure`)."""
        if self._fault is not None:
            self._fault.begin_step(self._step)
        m = self.timer.measure(self._step, lambda: self.model.train_step(batch))
        self._step += 1
        return m.loss

    def eval_step(self, batch: Sequence[torch.Tensor]) -> float:
        """The mean loss of the global ``batch`` without gradients or an optimizer step.

        Runs the forward half of this rank's schedule (its RECV_F / F / SEND_F actions, in
        schedule order: forwards depend only on earlier forwards, so the filtered lists cannot
        deadlock) under ``torch.no_grad``. The stage programs are the captured *training* graph:
        dropout, if the model has any, stays active as captured.
        """
        from runtime.schedule_actions import Kind

        pm = self.model
        forward = [a for a in pm.actions if a.kind in (Kind.RECV_F, Kind.FORWARD, Kind.SEND_F)]
        micro, dims = pm.micro_batches(batch)
        with torch.no_grad():
            losses = pm.executor.run(forward, micro, dims, grad_sync=lambda: None, step=lambda: None)
        total = torch.zeros((), dtype=torch.float64, device=pm.mesh.device)
        if losses:  # as train_step: every tp rank of the last stage holds the same loss
            total += torch.stack(losses).double().mean() / (pm.dp * getattr(pm, "tp", 1))
        dist.all_reduce(total, group=pm.mesh.group)
        return float(total)

    def save(self, directory: str | Path) -> None:
        """Checkpoint parameters and optimizer state under the original parameter names
        (:mod:`runtime.checkpoint_io`); loadable under any other plan or into the plain model."""
        from runtime.checkpoint_io import save_checkpoint

        save_checkpoint(self.model, directory, step=self._step)

    def load(self, directory: str | Path) -> int:
        """Load a checkpoint written under any plan; training continues from its step."""
        from runtime.checkpoint_io import load_checkpoint

        self._step = load_checkpoint(self.model, directory)
        return self._step

    def gather_measurements(self):
        """Every rank's step measurements with the plan's predictions (a collective over the
        mesh); a :class:`runtime.measure.RunMeasurements` on every rank."""
        from runtime.measure import RunMeasurements

        steps: list[Any] = [None] * dist.get_world_size(self.model.mesh.group)
        dist.all_gather_object(steps, self.timer.steps, group=self.model.mesh.group)
        p = self.plan.predicted
        return RunMeasurements(plan_summary=self.plan.summary(), predicted_step_time_s=p.step_time_s,
                               predicted_peak_memory_bytes=p.peak_memory_bytes, predicted_terms=dict(p.terms),
                               world_size=len(steps), steps=steps, notes=self.notes + _TRACKER_NOTE)

    def finish(self) -> Any:
        """Gather measurements; on rank 0 with a dump dir write ``measurements.json`` and the
        report with the measured column. Returns the RunMeasurements (every rank)."""
        run = self.gather_measurements()
        if self.rank == 0 and self.dump_dir is not None:
            from ir_dumps.report import write_report

            run.write(self.dump_dir / "measurements.json")
            write_report(self.dump_dir / "report.html", plan=self.plan, cluster=self.cluster,
                         measured=run.summary_by_rank(), graph=getattr(self, "_graph", None))
        return run


_TRACKER_NOTE = ["on CPU, steps whose peak_memory_bytes is set ran under the live-bytes tracker (slower): "
                 "take step times from the others (summary_by_rank skips the first 2 steps)"]


def _broadcast_plan(make: Callable[[], Plan]) -> Plan:
    """Rank 0 runs ``make``; every rank returns its plan or raises its error (same type, same text)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", make().to_json())
        except PartitionerError as exc:
            box[0] = ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        _, kind, message = box[0]
        errors = {"InfeasiblePlanError": InfeasiblePlanError, "ConfigError": ConfigError}
        raise errors.get(kind, ConfigError)(message)
    return Plan.from_json(box[0][1])


def auto_parallelize(model: str | ModelSpec | nn.Module, cluster: Cluster | str | None = None, *,
                     inputs: Sequence[InputSpec] | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                     dims: dict[str, int] | None = None, optimizer: dict | None = None, global_batch_size: int,
                     dump_dir: str | Path | None = None, fix: dict | str | None = None, plan: Plan | None = None,
                     dtype: str = "fp32", timeout_s: float = 60.0, track_memory: bool | int = 2) -> AutoParallel:
    """Plan ``model`` for this job and build this rank's trainer (call on every rank).

    ``model``: a spec string (``"gpt:layers=4,hidden=64"``), a :class:`ModelSpec`, or an
    ``nn.Module`` with ``inputs`` (InputSpecs with named dims, e.g. ``("batch", "seq")``),
    ``loss_fn(module, *inputs) -> scalar`` and ``dims`` (default sizes of the named dims other
    than batch). ``cluster``: a Cluster or preset name (default ``Cluster.local(world_size)``).
    ``optimizer``: keyword arguments of AdamW (the runtime's optimizer), e.g. ``{"lr": 1e-3}``.
    ``fix``: knobs to pin (``"dp=2,pp=2"`` or a dict). ``plan``: skip the search and run this
    plan (still checked against the world size). ``timeout_s``: seconds any training collective
    or receive may wait before the job fails. See the module docstring for what is written to
    ``dump_dir``.
    """
    from runtime.mesh import init_distributed
    from runtime.parallel_model import ParallelModel

    if optimizer is not None and not isinstance(optimizer, dict):
        raise ConfigError("auto_parallelize: optimizer= takes AdamW keyword arguments (a dict, e.g. {'lr': 1e-3}); "
                          "the runtime builds AdamW (or ZeRO-1 AdamW) over each rank's parameters itself")
    init_distributed(timeout_s=max(timeout_s, START_TIMEOUT_S))
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = as_spec(model, inputs=inputs, loss_fn=loss_fn, dims=dims)
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    cluster = cluster or Cluster.local(world)
    if plan is None:
        chosen = _broadcast_plan(lambda: choose_plan(model if isinstance(model, str) else spec, cluster,
                                                     world_size=world, global_batch_size=global_batch_size,
                                                     fix=fix, dtype=dtype))
    else:
        check_world_size(plan, world)
        chosen = plan
    if chosen.global_batch != global_batch_size:
        raise ConfigError(f"auto_parallelize: the plan is for global batch {chosen.global_batch}, "
                          f"not {global_batch_size}; re-plan or pass the plan's batch size")
    kwargs = runtime_kwargs(chosen)
    notes = []
    boundaries, why = plan_stage_boundaries(chosen)
    if boundaries is None:
        notes.append(f"stages split by balancing layer counts, not at the plan's boundaries: {why}")

    with torch.no_grad():  # every rank starts from rank 0's weights
        for t in list(spec.module.parameters()) + list(spec.module.buffers()):
            dist.broadcast(t, src=0)
    pm = ParallelModel(spec, **kwargs, adamw=optimizer, timeout_s=timeout_s)
    out_dir = Path(dump_dir) if dump_dir is not None else None
    trainer = AutoParallel(pm, chosen, cluster, spec, dump_dir=out_dir, track_memory=track_memory, notes=notes)
    if out_dir is not None and rank == 0:
        trainer._graph = write_dumps(spec, chosen, cluster, out_dir)
    return trainer


def write_dumps(spec: ModelSpec, plan: Plan, cluster: Cluster, out_dir: Path):
    """``plan.json``, ``report.html`` and ``ir/`` (the graph after each analysis pass, at the plan's
    micro-batch size) in ``out_dir``; returns the analysed graph."""
    from ir_dumps.report import write_report
    from partitioner.analysis import analyze

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.json").write_text(plan.to_json() + "\n")
    analysis = analyze(meta_copy(spec), batch=plan.micro_batch_size, dump_dir=out_dir / "ir")
    write_report(out_dir / "report.html", plan=plan, cluster=cluster, graph=analysis.graph)
    return analysis.graph
