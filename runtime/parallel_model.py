"""``ParallelModel``: data x tensor x pipeline-parallel training of a :class:`ModelSpec`.

Built on every rank of the mesh from the same arguments (every rank captures and splits the
model the same way, so no plan has to be sent around)::

    capture_spec (symbolic batch/seq) -> annotate_shapes -> build_rank_program (tag tp, split into
    pp*v stages balanced by layers, this rank's stages tp-sharded, checkpointed or offloaded;
    runtime/rank_program.py) -> schedule[pp_index]

``train_step(batch)`` takes the *global* batch (every rank gets the same tensors), keeps this
dp rank's contiguous slice, cuts it into ``num_micro_batches`` micro-batches, runs the schedule
(:class:`runtime.stage_executor.StageExecutor`), syncs gradients (tied copies, then the dp
average; :mod:`runtime.grad_sync`), steps AdamW (or ZeRO-1 AdamW) and returns the loss of the
whole global batch, the same float on every rank.

Tensor parallelism: the stage programs call the tp collectives of :mod:`runtime.tp_collectives`
on this rank's tp group, registered under a name derived from the mesh. Parameters a tp rank
holds a shard of keep their original names (:meth:`ParallelModel.full_parameters` gathers them);
replicated parameters get identical gradients on every tp rank (Megatron's f/g operators), so
the dp average runs over the dp group (same tp index) and tied weights sum over the pipeline's
ends of the same tp index, with no extra tp reduction.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from partitioner.errors import ConfigError
from partitioner.model_spec import ModelSpec
from passes.annotate_shapes import annotate_shapes
from passes.apply_tensor_parallel import shard_tensor, unshard_tensor
from passes.capture import capture_spec
from runtime import schedule as schedules
from runtime.grad_sync import (
    DEFAULT_BUCKET_BYTES, BucketedGradSync, TiedCopies, TiedSync, Zero2AdamW, ZeroAdamW, expected_accumulations,
    fill_missing_grads, unique_params, zero_stage,
)
from runtime.mesh import Mesh
from runtime.rank_program import RankProgram, build_rank_program
from runtime.mixed_precision import forward_context, parse_mixed_precision
from runtime.stage_executor import LocalStage, StageExecutor, backward_counts
from runtime.tp_collectives import DistGroup, all_reduce_grads, register_group

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def capture_for_pipeline(spec: ModelSpec, symbolic: Sequence[str] | None = None, *,
                         device: str | None = None) -> fx.GraphModule:
    """The training step of ``spec`` captured with symbolic named dims (default: every dim of its
    inputs) and annotated with shapes: what :class:`ParallelModel` splits. ``device``: the device
    type the stage programs will run on (``"cuda"`` under NCCL), default the module's."""
    if symbolic is None:
        symbolic = sorted({d for inp in spec.inputs for d in inp.shape if isinstance(d, str)})
    return annotate_shapes(capture_spec(spec, symbolic=tuple(symbolic), device=device))


def build_schedule(name: str, pp: int, m: int, v: int) -> dict:
    """The lowered action lists (pipeline index -> actions) of schedule ``name``."""
    if name not in SCHEDULES:
        raise ConfigError(f"parallel_model: unknown schedule {name!r}; use one of {SCHEDULES}")
    if v > 1 and name != "interleaved":
        raise ConfigError(f"parallel_model: virtual_pp={v} needs schedule='interleaved', got {name!r}")
    if name == "gpipe":
        return schedules.gpipe(pp, m)
    if name == "1f1b":
        return schedules.one_f_one_b(pp, m)
    return schedules.interleaved_1f1b(pp, m, v)


STAGE_SEED_STRIDE = 1009
"""Seed offset per pipeline stage (a prime, so stage seeds do not collide with nearby user seeds)."""


class ParallelModel:
    """One rank's share of a dp x pp training job (see the module docstring).

    ``graph``: an already captured :func:`capture_for_pipeline` graph to start from (deep-copied,
    so the caller's weights are untouched); by default the spec is captured here. ``zero``: shard
    the AdamW state over dp (``True`` or 1: ZeRO-1; 2: ZeRO-2, gradients reduce-scattered too).
    ``overlap_grad_sync``: start each gradient bucket's dp collective from backward hooks as soon
    as it is complete (same numbers as after backward). ``mixed_precision``: ``None`` (fp32) or
    ``"bf16"`` (autocast forwards, fp32 master weights; :mod:`runtime.mixed_precision`).
    ``adamw``: keyword arguments of ``torch.optim.AdamW``.
    ``tp``: tensor-parallel degree (Megatron sharding found by ``tag_tensor_parallel``; dropout
    on shards draws one device's mask, :mod:`passes.sharded_dropout`).
    ``checkpointing``: ``"none"``, ``"full"`` or ``"selective"`` activation recomputation per
    stage; ``offload``: ``"none"``, ``"activations"`` (every saved activation to host) or ``"auto"``.
    ``sequence_parallel``: Megatron sequence parallelism inside the tp rank programs (tp > 1).
    ``stage_boundaries``: the block index where each virtual stage after the first starts (a
    plan's split, :func:`partitioner.auto.plan_stage_boundaries`); default: balanced layer counts.

    Random streams: with ``pp > 1`` each rank reseeds torch's generators with
    ``torch.initial_seed() + STAGE_SEED_STRIDE * stage`` (pipeline stages must not draw the same
    dropout masks; tp peers and dp replicas keep equal streams).
    """

    def __init__(self, spec: ModelSpec, *, dp: int = 1, pp: int = 1, schedule: str = "1f1b",
                 num_micro_batches: int = 1, virtual_pp: int = 1, global_batch: int, mesh: Mesh | None = None,
                 graph: fx.GraphModule | None = None, zero: bool | int = False, adamw: dict | None = None,
                 mixed_precision: str | None = None, overlap_grad_sync: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0, tp: int = 1,
                 checkpointing: str = "none", offload: str = "none", sequence_parallel: bool = False,
                 stage_boundaries: Sequence[int] | None = None):
        self.mesh = mesh or Mesh(dp, pp, tp, timeout_s=timeout_s)
        if (self.mesh.dp, self.mesh.pp, self.mesh.tp) != (dp, pp, tp):
            raise ConfigError(f"parallel_model: mesh has dp={self.mesh.dp}, pp={self.mesh.pp}, tp={self.mesh.tp} but "
                              f"dp={dp}, pp={pp}, tp={tp} were asked for; pass matching values")
        if not self.mesh.active:
            raise ConfigError(f"parallel_model: rank {self.mesh.rank} is outside {self.mesh}; build it on mesh ranks only")
        m, v = num_micro_batches, virtual_pp
        if global_batch % (dp * m):
            raise ConfigError(f"parallel_model: global_batch={global_batch} must be divisible by dp * "
                              f"num_micro_batches = {dp} * {m}; e.g. global_batch={dp * m * max(1, global_batch // (dp * m))}")
        self.spec, self.dp, self.pp, self.tp, self.m, self.v = spec, dp, pp, tp, m, v
        self.global_batch, self.bucket_bytes = global_batch, bucket_bytes
        if pp > 1:
            # Random streams (dropout): tp peers must draw alike (their replicated regions hold one
            # tensor), but pipeline stages must not, or layer i of every stage gets the same
            # masks. As Megatron does, each stage offsets the seed every rank was given.
            torch.manual_seed(torch.initial_seed() + STAGE_SEED_STRIDE * self.mesh.pp_index)
        self.actions = self._schedule(schedule)

        gm = graph if graph is not None else capture_for_pipeline(spec, device=self.mesh.device.type)
        # A name per mesh group and per model: several meshes (tests) may live in one process.
        self.tp_group_name = f"tp{list(self.mesh.tp_ranks)}@{id(self):x}"
        # build_rank_program deep-copies the graph, so the caller's weights are untouched.
        self.program: RankProgram = build_rank_program(
            gm, dp=dp, tp=tp, pp=pp, virtual_pp=v, rank=self.mesh.rank, first=self.mesh.first,
            checkpointing=checkpointing, offload=offload, tp_group=self.tp_group_name,
            sequence_parallel=sequence_parallel, stage_boundaries=stage_boundaries)
        if tp > 1:
            register_group(self.tp_group_name, DistGroup(self.mesh.tp_group))
        self.split = self.program.split
        self.stages = {s: LocalStage(s, module.to(self.mesh.device), self.split.io[s])
                       for s, module in self.program.modules.items()}
        self.executor = StageExecutor(self.stages, self.split.io, pp_ranks=self.mesh.pp_ranks,
                                      pp_group=self.mesh.pp_group, num_micro_batches=m, device=self.mesh.device,
                                      forward_context=forward_context(parse_mixed_precision(
                                          mixed_precision, self.mesh.device.type)))
        self.tied_sync = TiedSync(self._tied_copies(), self.mesh.device)
        self.params = unique_params([st.module for st in self.stages.values()])
        # sequence parallelism: replicated params read on sequence chunks; grads summed over tp first
        self.sp_params = [self.named_parameters()[n] for n in self.program.sp_grad_params]
        kwargs = dict(adamw or {})
        self.zero = zero_stage(zero)
        self.grad_buckets = self._grad_buckets(overlap_grad_sync)
        if self.zero == 2:
            self.optimizer = Zero2AdamW(self.grad_buckets, **kwargs)
        elif self.zero == 1:
            self.optimizer = ZeroAdamW(self.params, self.mesh.dp_group, self.mesh.dp_index, dp, **kwargs)
        else:
            self.optimizer = torch.optim.AdamW(self.params, **kwargs)

    # ------------------------------------------------------------------------------------------
    def _schedule(self, name: str) -> list:
        full = build_schedule(name, self.pp, self.m, self.v)
        schedules.validate(full)
        return full[self.mesh.pp_index]

    def _tied_copies(self) -> list[TiedCopies]:
        """Every tied weight this rank takes part in syncing: its local copies and the group."""
        out = []
        for name in sorted(self.split.tied):
            stages = self.split.tied[name]
            holders = sorted({s % self.pp for s in stages})
            copies: dict[int, torch.nn.Parameter] = {}
            for s in stages:
                if s in self.stages:
                    module = self.stages[s].module
                    for alias in self.split.aliases[name]:
                        try:
                            p = module.get_parameter(alias)
                        except AttributeError:
                            continue
                        copies[id(p)] = p
            ref = self.split.modules[stages[0]].get_parameter(
                next(a for a in self.split.aliases[name] if _has_param(self.split.modules[stages[0]], a)))
            ref = next(iter(copies.values()), None) if copies else self._local_like(name, ref)
            if len(holders) == 1:
                group = None  # every copy on this rank
            elif holders == [0, self.pp - 1]:
                group = self.mesh.ends_group  # the usual case: embedding first, LM head last
            else:
                group = self.mesh.pp_group  # general: the whole pipeline, zeros from non-holders
            if copies or (group is self.mesh.pp_group and len(holders) > 1):
                out.append(TiedCopies(name, list(copies.values()), group, tuple(ref.shape), ref.dtype))
        return out

    def _local_like(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as this tp rank's shard of parameter ``name`` (``full`` when replicated)."""
        plan = self.program.tp_plan
        if plan is None or plan.params[name].dim is None:
            return full
        return shard_tensor(full, plan.params[name], self.mesh.tp_index, self.tp)

    def _grad_buckets(self, overlap: bool) -> BucketedGradSync | None:
        """The dp gradient buckets (None when there is nothing to average or shard)."""
        if self.dp == 1 and self.zero != 2:
            return None
        accumulations = expected_accumulations({s: unique_params([st.module]) for s, st in self.stages.items()},
                                               backward_counts(self.actions))
        return BucketedGradSync(self.params, self.mesh.dp_group, self.dp, rank=self.mesh.dp_index,
                                bucket_bytes=self.bucket_bytes, late=[p for t in self.tied_sync.tied for p in t.copies] + self.sp_params,
                                overlap=overlap, shard=self.zero == 2, accumulations=accumulations)

    def _sp_grad_sync(self) -> None:
        if self.sp_params:
            fill_missing_grads(self.sp_params)
            all_reduce_grads(self.sp_params, self.tp_group_name)

    def _grad_sync(self) -> None:
        if self.grad_buckets is None:
            self._sp_grad_sync()
            fill_missing_grads(self.params)
            self.tied_sync()
            return

        def tied() -> None:  # tied copies' buckets start after their sum is complete
            fill_missing_grads([p for t in self.tied_sync.tied for p in t.copies])
            self.tied_sync()
            self._sp_grad_sync()

        chunk = self.grad_buckets.finish(before_late=tied)
        if chunk is not None:
            self.optimizer.set_grad(chunk)  # ZeRO-2: this rank's averaged chunk

    def _step(self) -> None:
        # Gradients are zeroed at the start of the next step, not here, so that after a step
        # they can still be read (tests compare them with single-device training).
        self.optimizer.step()

    # ------------------------------------------------------------------------------------------
    def micro_batches(self, batch: Sequence[torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]], dict[str, int]]:
        """This dp rank's micro-batches (graph inputs by name) and the named dims of one micro-batch."""
        if len(batch) != len(self.spec.inputs):
            raise ConfigError(f"parallel_model: train_step got {len(batch)} tensors; the model takes "
                              f"{[i.name for i in self.spec.inputs]}")
        dims: dict[str, int] = {}
        for spec, t in zip(self.spec.inputs, batch):
            for d, size in zip(spec.shape, t.shape):
                if isinstance(d, str):
                    dims[d] = int(size)
        if dims.get("batch") != self.global_batch:
            raise ConfigError(f"parallel_model: batch has {dims.get('batch')} samples, global_batch is "
                              f"{self.global_batch}; pass the whole global batch on every rank")
        mb = self.global_batch // (self.dp * self.m)
        micro = [dict() for _ in range(self.m)]
        for spec, t in zip(self.spec.inputs, batch):
            axis = list(spec.shape).index("batch")
            mine = t.narrow(axis, self.mesh.dp_index * mb * self.m, mb * self.m).to(self.mesh.device)
            for i, chunk in enumerate(mine.split(mb, dim=axis)):
                micro[i][spec.name] = chunk
        return micro, {**dims, "batch": mb}

    def train_step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global ``batch``; returns its mean loss (same on every rank)."""
        micro, dims = self.micro_batches(batch)
        self.optimizer.zero_grad()
        if self.grad_buckets is not None:
            self.grad_buckets.reset()
        losses = self.executor.run(self.actions, micro, dims, grad_sync=self._grad_sync, step=self._step)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if losses:  # the last stage: mean over micro-batches, then over dp via the sum below
            # every tp rank of the last stage computed the same loss: counted once via / tp
            total += torch.stack(losses).double().mean() / (self.dp * self.tp)
        torch.distributed.all_reduce(total, group=self.mesh.group)
        return float(total)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name (a tied weight under each alias its stages read)."""
        out = {}
        for stage in self.stages.values():
            # a checkpointed region (a GraphModule child) re-lists the parameters it reads
            regions = {n for n, child in stage.module.named_children() if isinstance(child, fx.GraphModule)}
            for name, p in stage.module.named_parameters(remove_duplicate=False):
                if name.split(".", 1)[0] not in regions:
                    out[name] = p
        return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name, tp-sharded ones all-gathered over the tp group into
        the full tensors (copies). Collective: every rank of the tp group must call it."""
        return self._gather_full({n: p.detach() for n, p in self.named_parameters().items()})

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """As :meth:`full_parameters`, for the gradients of the last step (after their sync)."""
        return self._gather_full({n: p.grad for n, p in self.named_parameters().items()})

    def _gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = self.program.tp_plan
        out = {}
        for name, t in sorted(tensors.items()):  # the same order on every tp rank
            sharding = plan.params[name] if plan is not None else None
            if sharding is None or sharding.dim is None:
                out[name] = t.clone()
                continue
            shards = [torch.empty_like(t) for _ in range(self.tp)]
            torch.distributed.all_gather(shards, t.contiguous(), group=self.mesh.tp_group)
            out[name] = unshard_tensor(shards, sharding)
        return out


def _has_param(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False
