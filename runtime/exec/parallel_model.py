"""``ParallelModel``: one rank's share of a data x tensor x pipeline-parallel training job.

It *executes* a :class:`passes.ir.program.RankProgram` (made by :func:`passes.lowering.lower.lower`):
it captures nothing and runs no pass. Around the program it builds what is process state::

    RankProgram (stage programs, I/O contracts, comms, schedule, config)
        -> stage executor (the schedule's actions; pipeline P2P through runtime.dist.comm)
        -> gradient sync (tied copies, sequence-parallel partial grads, dp buckets / ZeRO)
        -> optimizer (AdamW, ZeRO-1/2 sharded AdamW, or AdamW on the host for offload="optimizer";
           under bf16/fp16 every one of them steps fp32 master weights)

``train_step(batch)`` takes the *global* batch (every rank gets the same tensors), keeps this
dp replica's contiguous slice (with context parallelism: this cp rank's share of its sequence,
:func:`passes.ir.cp_ops.shard_sequence`), cuts it into ``num_micro_batches`` micro-batches, runs the schedule
(:class:`runtime.exec.stage_executor.StageExecutor`), syncs gradients (:mod:`runtime.optim.grad_sync`),
steps the optimizer and returns the loss of the whole global batch, the same float on every rank.

Tensor parallelism: the stage programs call the tp collectives (:mod:`passes.ir.ops`, kernels in
:mod:`runtime.kernels.collectives`) on the group registered under ``program.tp_group``.
Parameters a tp rank holds a shard of keep their original names
(:meth:`ParallelModel.full_parameters` gathers them); replicated parameters get identical
gradients on every tp rank (Megatron's f/g operators), so the dp average runs over the dp group
(same tp index) and tied weights sum over the pipeline's ends of the same tp index.

Precision: the stage programs run in the dtype they were captured in, which the lowering checks
is ``config.dtype``. Under ``bf16``/``fp16`` parameters, gradients and activations are 16-bit and
the optimizer steps fp32 master weights (:mod:`runtime.optim.mixed_precision`); ``fp16`` also scales
the loss dynamically and skips a step whose gradients overflowed (on every rank).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Literal, Mapping, Sequence

import math

import torch
from torch import fx

from passes.ir.config import SPLIT_BACKWARD_SCHEDULES, is_mixed
from passes.ir.errors import ConfigError, NonFiniteError
from passes.ir.grad_buckets import DEFAULT_BUCKET_BYTES, MODE_OF_ZERO_STAGE, unique_params
from passes.ir.meta import CAPTURE, InputBounds
from passes.ir.cp_ops import check_layout, shard_sequence
from passes.ir.program import RankProgram, unshard_tensor
from passes.ir.zero3_ops import ZERO3_PREFETCH, unshard
from passes.ir.meta import ZERO3_PLAN
from runtime.dist import comm
from runtime.exec.batch_check import check_batch
from runtime.optim.grad_sync import (
    BucketedGradSync, ShardedOptimizer, TiedCopies, TiedSync,
    expected_accumulations, fill_missing_grads,
)
from runtime.kernels.collectives import DistGroup, all_reduce_grads, register_group
from runtime.dist.mesh import Mesh, check_mesh_fits
from runtime.optim.zero3 import zero3_gatherer
from runtime.optim.grad_norm import global_grad_norm, scale_grads
from runtime.optim.mixed_precision import DynamicLossScaler, MasterWeightOptimizer
from runtime.optim.optimizer_offload import HostOffloadedOptimizer
from runtime.optim.optimizers import OptimizerFactory, as_factory, build, check_shardable, param_groups
from runtime.optim.lr_schedules import SchedulerFactory
from runtime.exec.compiled import compile_segments, compile_stage
from runtime.exec.stage_executor import LocalStage, StageExecutor, backward_counts
from runtime.exec.split_backward import WeightOrder

STAGE_SEED_STRIDE = 1009
"""Seed offset per pipeline stage (a prime, so stage seeds do not collide with nearby user seeds)."""


class ParallelModel:
    """One rank's share of a training job: runs ``program`` on ``mesh`` (see the module docstring).

    ``adamw``: keyword arguments of ``torch.optim.AdamW`` (the optimizer of every plan: plain,
    ZeRO-sharded, or on the host). ``overlap_grad_sync``: start each gradient bucket's dp
    collective from backward hooks as soon as it is complete (same numbers as after backward).
    ``bucket_bytes``: size of the dp gradient buckets.

    Random streams: with ``pp > 1`` each rank reseeds torch's generators with
    ``torch.initial_seed() + STAGE_SEED_STRIDE * stage`` (pipeline stages must not draw the same
    dropout masks; tp peers and dp replicas keep equal streams).
    """

    def __init__(self, program: RankProgram, mesh: Mesh, *, optimizer: dict | OptimizerFactory | None = None,
                 lr_scheduler: SchedulerFactory | None = None, clip_grad_norm: float | None = None,
                 nonfinite: Literal["stop", "skip"] = "stop", overlap_grad_sync: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, zero3_prefetch: int = ZERO3_PREFETCH):
        c = program.config
        check_mesh_fits(mesh, c, where="parallel_model")
        if program.rank != mesh.rank or program.first != mesh.first:
            raise ConfigError(f"parallel_model: the program is rank {program.rank}'s (mesh from {program.first}), this "
                              f"process is rank {mesh.rank} (mesh from {mesh.first}); lower the program of this rank")
        self.program, self.mesh, self.config = program, mesh, c
        self.dp, self.pp, self.tp, self.m, self.v = c.dp, c.pp, c.tp, c.num_micro_batches, c.virtual_pp
        self.dp_cp = c.dp_cp  # ranks averaging gradients: the dp replicas and each one's cp ranks
        self.global_batch, self.bucket_bytes = c.global_batch, bucket_bytes
        if c.pp > 1:
            # Random streams (dropout): tp peers must draw alike (their replicated regions hold one
            # tensor), but pipeline stages must not, or layer i of every stage gets the same
            # masks. As Megatron does, each stage offsets the seed every rank was given.
            torch.manual_seed(torch.initial_seed() + STAGE_SEED_STRIDE * mesh.pp_index)
        self.actions = list(program.actions)
        self.tp_group_name = program.tp_group
        if c.tp > 1:
            register_group(self.tp_group_name, DistGroup(mesh.tp_group))
        self.cp_plan = program.cp_plan
        if self.cp_plan is not None:
            register_group(self.cp_plan.group, DistGroup(mesh.cp_group))
        if c.ep > 1:
            register_group(program.ep_group, DistGroup(mesh.ep_group))
        if c.dp_cp > 1:  # a load-balancing loss averages its token statistics over the data axis
            register_group(program.data_group, DistGroup(mesh.dp_group))
        # a split backward finds the weight-reading ops on the autograd graph: only the segments between them compile
        compiler = compile_segments if c.schedule in SPLIT_BACKWARD_SCHEDULES else compile_stage
        self.stages = {s: LocalStage(s, module, program.io[s], compiler(module) if c.compile else None)
                       for s, module in ((s, _on_device(m, mesh.device)) for s, m in program.modules.items())}
        # ZeRO-3: keep this dp rank's shard of every parameter; the gathers run through this
        self.zero3 = (zero3_gatherer({s: st.module for s, st in self.stages.items()}, mesh, prefetch=zero3_prefetch)
                      if c.zero_stage == 3 else None)
        self.executor = StageExecutor(self.stages, program.io, pp_ranks=mesh.pp_ranks, pp_group=mesh.pp_group,
                                      pp_reverse_group=mesh.pp_reverse_group, pp_index=mesh.pp_index,
                                      num_micro_batches=c.num_micro_batches, device=mesh.device,
                                      stream_groups=getattr(mesh, "pp_stream_groups", None))
        self.tied_sync = TiedSync(self._tied_copies(), mesh.device)
        self.params = unique_params([st.module for st in self.stages.values()])
        # ep: the routed experts this rank holds average their gradients over the ranks holding the same experts
        expert_names = set(program.expert_params)
        self.expert_params = [p for n, p in self.named_parameters().items() if n in expert_names]
        # sequence parallelism: replicated params read on sequence chunks; grads summed over tp first
        self.sp_params = [self.named_parameters()[n] for n in program.sp_grad_params]
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ConfigError(f"parallel_model: clip_grad_norm={clip_grad_norm}; give a max norm > 0, or None")
        if nonfinite not in ("stop", "skip"):
            raise ConfigError(f"parallel_model: nonfinite={nonfinite!r}; choose 'stop' or 'skip'")
        factory = as_factory(optimizer)
        self.zero = c.zero_stage
        self.expert_buckets: BucketedGradSync | None = None
        self.grad_buckets = self._grad_buckets(overlap_grad_sync)
        self.executor.weight_order = self._weight_order()
        no_decay = self._no_decay()
        flags = [no_decay[id(p)] for p in self.params]
        weights = self._param_norm_weights()
        if c.offload == "optimizer":
            self.optimizer = HostOffloadedOptimizer(self.params, factory=factory, no_decay=flags)
        elif self.zero == 3:  # the parameters are the shards: any elementwise optimizer steps them as they are
            self.optimizer = (MasterWeightOptimizer(self.params, factory=factory, no_decay=flags) if is_mixed(c.dtype)
                              else build(factory, param_groups(self.params, flags)))
            check_shardable(getattr(self.optimizer, "optimizer", self.optimizer), 3)
        elif self.zero:
            # ep: the experts a rank holds are sharded over their replicas, stepped by the same optimizer
            syncs = [b for b in (self.grad_buckets, self.expert_buckets) if b is not None]
            self.optimizer = ShardedOptimizer(syncs, factory=factory, no_decay=no_decay, norm_weight=weights)
        elif is_mixed(c.dtype):
            self.optimizer = MasterWeightOptimizer(self.params, factory=factory, no_decay=flags)
        else:
            self.optimizer = build(factory, param_groups(self.params, flags))
        self.torch_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        """The torch optimizer that steps (the inner one of a master-weight or ZeRO optimizer)."""
        self.lr_scheduler = lr_scheduler(self.torch_optimizer) if lr_scheduler is not None else None
        self.clip_grad_norm, self.nonfinite = clip_grad_norm, nonfinite
        self.loss_scaler = DynamicLossScaler() if c.dtype == "fp16" else None
        experts = {id(p) for p in self.expert_params}
        self.norm_weights = ([seg.weight for seg in self.optimizer.segments] if isinstance(self.optimizer, ShardedOptimizer)
                             else [weights[id(p)] / (c.expert_replicas if id(p) in experts else
                                                     self.dp_cp // c.shard_degree if self.zero == 3 else self.dp_cp)
                                   for p in self.params])
        """How much each gradient of :meth:`_fp32_grads` counts in the global norm (see
        :meth:`_param_norm_weights`; dp replicas 1/dp, disjoint ZeRO chunks and ZeRO-3 shards 1,
        HSDP's replica groups 1/replicas, an ep rank's experts 1/expert replicas)."""
        self.step_count = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_lr: float | None = None

    @property
    def inputs(self):
        """The graph inputs (with named dims) a batch holds, in order."""
        return self.program.inputs

    # ------------------------------------------------------------------------------------------
    def _tied_copies(self) -> list[TiedCopies]:
        """Every tied weight this rank takes part in syncing: its local copies and the group."""
        out = []
        for name, tied in sorted(self.program.tied.items()):
            holders = sorted({self.config.stage_rank(s) for s in tied.stages})
            copies = tied.copies({s: st.module for s, st in self.stages.items()})
            if len(holders) == 1:
                group = None  # every copy on this rank
            elif holders == [0, self.pp - 1]:
                group = self.mesh.ends_group  # the usual case: embedding first, LM head last
            else:
                group = self.mesh.pp_group  # general: the whole pipeline, zeros from non-holders
            if copies or (group is self.mesh.pp_group and len(holders) > 1):
                out.append(TiedCopies(name, copies, group, tied.local_shape, tied.dtype))
        return out

    def _grad_buckets(self, overlap: bool) -> BucketedGradSync | None:
        """The dp gradient buckets (None when there is nothing to average or shard)."""
        if (self.dp_cp == 1 and not self.zero) or self.zero == 3:  # ZeRO-3 reduce-scatters in backward
            return None
        accumulations = expected_accumulations({s: unique_params([st.module]) for s, st in self.stages.items()},
                                               backward_counts(self.actions))
        experts = {id(p) for p in self.expert_params}
        if experts:
            # each rank's expert gradient already sums its ep group's tokens: summed over the
            # expert replicas it covers the whole batch, which the dp x cp replicas average
            self.expert_buckets = BucketedGradSync(
                self.expert_params, self.mesh.ep_replica_group, self.config.expert_replicas,
                rank=self.mesh.dp_index // self.config.ep, bucket_bytes=self.bucket_bytes, overlap=overlap,
                mode=MODE_OF_ZERO_STAGE[self.zero], accumulations=accumulations, divisor=self.dp_cp)
        return BucketedGradSync([p for p in self.params if id(p) not in experts], self.mesh.dp_group, self.dp_cp,
                                rank=self.mesh.dp_index, bucket_bytes=self.bucket_bytes,
                                late=[p for t in self.tied_sync.tied for p in t.copies] + self.sp_params,
                                overlap=overlap, mode=MODE_OF_ZERO_STAGE[self.zero], accumulations=accumulations)

    def _weight_order(self) -> WeightOrder | None:
        """The order a split backward's weight half accumulates parameters in, where gradient
        buckets launch from its hooks: reverse parameter order, each bucket in one call."""
        syncs = [s for s in (self.grad_buckets, self.expert_buckets) if s is not None and s.hooked]
        if not syncs:
            return None
        return WeightOrder(position={id(p): -k for k, p in enumerate(self.params)},
                           buckets={id(p): (id(s), k) for s in syncs for k, b in enumerate(s.buckets) for p in b.params})

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

        chunks = [self.grad_buckets.finish(before_late=tied)]
        if self.expert_buckets is not None:
            chunks.append(self.expert_buckets.finish())
        if chunks[0] is not None:
            self.optimizer.set_grad(torch.cat(chunks))  # ZeRO: this rank's averaged chunks, dp's then the experts'

    def _step(self) -> None:
        """The OPTIMIZER_STEP action: (fp16) unscale; the global gradient norm; stop, skip or
        clip; the optimizer; the learning-rate scheduler. Every decision is the same on every
        rank: the overflow flag and the norm are reduced over the whole mesh."""
        # Gradients are zeroed at the start of the next step, not here, so that after a step
        # they can still be read (tests compare them with single-device training).
        if self.zero3 is not None:
            self.zero3.reset()  # nothing gathered outlives the shards it was gathered from
        grads = self._fp32_grads()
        if self.loss_scaler is not None:
            overflow = self.loss_scaler.unscale(grads, self.mesh.group, self.mesh.device)
            self.loss_scaler.update(overflow)
            if overflow:  # every rank skips this step (the flag was reduced over the mesh)
                self.skipped_steps += 1
                self.last_grad_norm = float("inf")
                return
        norm = self._grad_norm(grads)
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            if self.nonfinite == "stop":
                raise NonFiniteError(f"step {self.step_count}: the global gradient norm is {norm} (a NaN or inf "
                                     f"loss or gradient); lower the learning rate, clip, use bf16 instead of fp16, "
                                     f"or pass nonfinite='skip' to skip such steps")
            self.skipped_steps += 1
            return
        if self.clip_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never up
            coef = self.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                scale_grads(grads, coef)
        self.last_lr = float(self.torch_optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.step_count += 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global gradient norm: a collective over the whole mesh, so it waits for the last
        rank to finish its backward (timed apart from the optimizer by ``runtime.observe.measure``)."""
        return global_grad_norm(self._norm_terms(grads), self.mesh.group, self.mesh.device)

    def _fp32_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer is about to step with, in the order of
        :attr:`norm_weights`: a ZeRO chunk's segments, a master-weight optimizer's fp32 master
        gradients, else the parameters' own."""
        if isinstance(self.optimizer, ShardedOptimizer):
            return [pc.grad for pc in self.optimizer.pieces]
        if isinstance(self.optimizer, MasterWeightOptimizer):
            self.optimizer.prepare_grads()
            return [m.grad for m in self.optimizer.masters]
        return [p.grad for p in self.params]

    def _norm_terms(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[torch.Tensor, float]]:
        return [(g, w) for g, w in zip(grads, self.norm_weights) if g is not None and w > 0]

    def _no_decay(self) -> dict[int, bool]:
        """Per parameter (by id): it takes no weight decay (the lowering's record, by name)."""
        names = self.program.no_weight_decay
        out: dict[int, bool] = {}
        for name, p in self.named_parameters().items():
            out[id(p)] = out.get(id(p), False) or name in names
        return {id(p): out.get(id(p), p.dim() < 2) for p in self.params}

    def _param_norm_weights(self) -> dict[int, float]:
        """Per parameter (by id), how much its gradient counts in the global norm's sum of
        squares, so that the sum over the ranks of one dp replica counts each element of the
        model's gradient once: tp-replicated parameters 1/tp (every tp rank holds the same
        gradient), each copy of a tied weight 1/copies; tp shards and everything else 1."""
        plan = self.program.tp_plan
        names: dict[int, str] = {}
        for name, p in self.named_parameters().items():
            names.setdefault(id(p), name)
        copies = {alias: len(tied.stages) for tied in self.program.tied.values() for alias in tied.aliases}

        def weight(p) -> float:
            name = names[id(p)]
            sharding = plan.params.get(name) if plan is not None else None
            sharded = sharding is not None and sharding.dim is not None
            return (1.0 if sharded else 1.0 / self.tp) / copies.get(name, 1)

        return {id(p): weight(p) for p in self.params}

    # ------------------------------------------------------------------------------------------
    def micro_batches(self, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
                      ) -> tuple[list[dict[str, torch.Tensor]], dict[str, int]]:
        """This dp rank's micro-batches (graph inputs by name) and the named dims of one micro-batch,
        from the *global* ``batch``: every graph input in order, or a mapping from the inputs' names
        (the Hugging Face habit). The batch is checked against the captured contract first
        (:func:`runtime.exec.batch_check.check_batch`: shapes, dtypes, token id ranges, the graph's dim
        ranges), before any collective, so a bad batch fails alike on every rank."""
        batch = tuple(check_batch(self.inputs, batch, batch_size=self.global_batch, bounds=self._input_bounds(),
                                  where="train_step/eval_step").values())
        if len(batch) != len(self.inputs):
            raise ConfigError(f"parallel_model: train_step got {len(batch)} tensors; the model takes "
                              f"{[i.name for i in self.inputs]}")
        dims = self._named_dims(zip(self.inputs, batch))
        if dims.get("batch") != self.global_batch:
            raise ConfigError(f"parallel_model: batch has {dims.get('batch')} samples, global_batch is "
                              f"{self.global_batch}; pass the whole global batch on every rank")
        rows = self.global_batch // self.dp
        mine = {}
        replica = self.mesh.replica_index
        for spec, t in zip(self.inputs, batch):
            if spec.name in self.consumed_inputs:
                axis = list(spec.shape).index("batch")
                mine[spec.name] = t.narrow(axis, replica * rows, rows)
        dims = self._cp_shard(mine, dims)
        micro, dims = self._split(mine), {**dims, "batch": rows // self.m}
        self._placeholders(micro, dims)
        return micro, dims

    def _cp_shard(self, rows: dict[str, torch.Tensor], dims: Mapping[str, int]) -> dict[str, int]:
        """Context parallelism: replace each sequence-carrying input of ``rows`` (in place) by this
        cp rank's shard of its sequence; returns ``dims`` with the sequence at its local length
        (what the programs, captured so, take). Without cp: ``dims`` as given."""
        plan = self.cp_plan
        if plan is None:
            return dict(dims)
        seq = dims.get(plan.seq_dim)
        if seq is not None:
            check_layout(seq, plan.degree, f"the batch's {plan.seq_dim!r} length")
            if self.config.sequence_parallel and (seq // plan.degree) % self.tp:
                raise ConfigError(f"the batch's {plan.seq_dim!r} length {seq} gives each of cp={plan.degree} ranks "
                                  f"{seq // plan.degree} tokens, which sequence parallelism cannot cut over tp="
                                  f"{self.tp}; use a length that is a multiple of {plan.degree * self.tp} and of "
                                  f"{2 * plan.degree}")
        cp_index = self.mesh.cp_index
        for name, dim in plan.sharded_inputs:
            if name in rows:
                rows[name] = shard_sequence(rows[name], dim, cp_index, plan.degree)
        return {**dims, plan.seq_dim: seq // plan.degree} if seq is not None else dict(dims)

    def _input_bounds(self) -> InputBounds:
        """The captured graph's :class:`InputBounds` (every stage program carries its capture's),
        for the global batch: under context parallelism the programs' capture holds a cp rank's
        sequence length, the batch the whole sequence."""
        for st in self.stages.values():
            info = st.module.meta.get(CAPTURE)
            if info is not None:
                bounds = getattr(info, "bounds", InputBounds())  # a graph captured before bounds were recorded
                plan = self.cp_plan
                if plan is None:
                    return bounds
                return dataclasses.replace(bounds, dims=tuple(
                    dataclasses.replace(b, high=b.high * plan.degree) if b.name == plan.seq_dim and b.high is not None
                    else b for b in bounds.dims))
        return InputBounds()

    @property
    def consumed_inputs(self) -> tuple[str, ...]:
        """The graph inputs whose values this rank's stages read (first stage: the model inputs;
        last stage: the labels; middle stages: none), in the model's input order. An input a
        stage reads only the size of (export may take a dim from any input) is not among them:
        it gets a placeholder of the right shape that holds no data (:meth:`_placeholders`)."""
        read = {name for name, shape_only in self._graph_inputs().items() if not shape_only}
        return tuple(i.name for i in self.inputs if i.name in read)

    def _graph_inputs(self) -> dict[str, bool]:
        """Each graph input a local stage takes -> whether every stage reads only its size."""
        out: dict[str, bool] = {}
        for st in self.stages.values():
            placeholders = [n for n in st.module.graph.nodes if n.op == "placeholder"]
            for node, inp in zip(placeholders, st.io.inputs):
                if inp.kind == "graph_input":
                    sizes_only = bool(node.users) and all(_reads_size_only(u) for u in node.users)
                    out[inp.name] = out.get(inp.name, True) and sizes_only
        return out

    def _placeholders(self, micro: list[dict[str, torch.Tensor]], dims: Mapping[str, int]) -> None:
        """Give each micro-batch a zero-stride tensor of the micro-batch's shape for every input
        a stage reads only the size of (no memory, no data loaded)."""
        specs = {i.name: i for i in self.inputs}
        for name, shape_only in self._graph_inputs().items():
            if shape_only:
                shape = [dims[d] if isinstance(d, str) else int(d) for d in specs[name].shape]
                empty = torch.zeros((), dtype=specs[name].dtype, device=self.mesh.device).expand(shape)
                for mb in micro:
                    mb.setdefault(name, empty)

    def _named_dims(self, pairs) -> dict[str, int]:
        dims: dict[str, int] = {}
        for spec, t in pairs:
            if t.dim() != len(spec.shape):
                raise ConfigError(f"parallel_model: input {spec.name!r} has {t.dim()} dims, the model takes "
                                  f"{len(spec.shape)} {tuple(spec.shape)}")
            for d, size in zip(spec.shape, t.shape):
                if isinstance(d, str):
                    if dims.setdefault(d, int(size)) != int(size):
                        raise ConfigError(f"parallel_model: dim {d!r} is {dims[d]} in one input and {int(size)} in "
                                          f"{spec.name!r}; every input must agree")
        return dims

    def _split(self, rows: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This dp rank's rows of each consumed input, on the device, in ``m`` micro-batches."""
        mb = self.global_batch // (self.dp * self.m)
        micro = [dict() for _ in range(self.m)]
        specs = {i.name: i for i in self.inputs}
        for name, t in rows.items():
            spec = specs[name]
            axis = list(spec.shape).index("batch")
            t = t.to(self.mesh.device)
            if t.is_floating_point() and spec.dtype.is_floating_point:
                t = t.to(spec.dtype)  # a bf16/fp16 plan takes its floating inputs in that dtype
            for i, chunk in enumerate(t.split(mb, dim=axis)):
                micro[i][name] = chunk
        return micro

    def train_step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global ``batch``; returns its mean loss (same on every rank)."""
        micro, dims = self.micro_batches(batch)
        return self._run_step(micro, dims)

    def train_local(self, rows: Mapping[str, torch.Tensor], dims: Mapping[str, int]) -> float:
        """One optimizer step from this dp replica's rows only (per-rank data loading).

        ``rows[name]``: for each of :attr:`consumed_inputs`, this dp replica's contiguous share of
        the global batch along its ``batch`` dim (``global_batch // dp`` samples: rows
        ``[r * n, (r + 1) * n)`` of the global batch for replica ``r = dp_index // cp``, so the
        step equals ``train_step`` on that batch), at the whole sequence (with context
        parallelism the rank keeps its share of it). ``dims``: the named dims other than ``batch`` (e.g.
        ``{"seq": 64}``): a middle stage has no rows and needs them for its receive shapes.
        Returns the global batch's mean loss, the same float on every rank."""
        check_batch(self.inputs, rows, batch_size=self.global_batch // self.dp, bounds=self._input_bounds(), names=self.consumed_inputs, dims={k: v for k, v in dims.items() if k != "batch"}, where="train_local", batch_rule="global_batch // dp")  # noqa: E501
        want, got = set(self.consumed_inputs), set(rows)
        if want != got:
            raise ConfigError(f"parallel_model: train_local got inputs {sorted(got)}; this rank (stage "
                              f"{sorted(self.stages)}) reads {sorted(want)}: load exactly those")
        n = self.global_batch // self.dp
        specs = {i.name: i for i in self.inputs}
        named = self._named_dims((specs[k], v) for k, v in rows.items())
        if rows and named.get("batch") != n:
            raise ConfigError(f"parallel_model: train_local got {named.get('batch')} samples; a dp rank takes "
                              f"global_batch // dp = {n}")
        for k, v in dims.items():
            if k != "batch" and named.get(k, v) != v:
                raise ConfigError(f"parallel_model: dims say {k}={v} but the rows have {k}={named[k]}")
        need = {d for i in self.inputs for d in i.shape if isinstance(d, str)} - {"batch"}
        missing = sorted(need - set(dims) - set(named))
        if missing:
            raise ConfigError(f"parallel_model: train_local needs the size of {missing} in dims")
        rows = dict(rows)
        dims = self._cp_shard(rows, {**named, **dims})
        micro, dims = self._split(rows), {**dims, "batch": n // self.m}
        self._placeholders(micro, dims)
        return self._run_step(micro, dims)

    def _run_step(self, micro: list[dict[str, torch.Tensor]], dims: dict[str, int]) -> float:
        self.optimizer.zero_grad()
        for buckets in (self.grad_buckets, self.expert_buckets):
            if buckets is not None:
                buckets.reset()
        if self.loss_scaler is not None:
            self.executor.loss_scale = self.loss_scaler.scale
        hooks = contextlib.nullcontext()
        if self.zero3 is not None:
            self.zero3.reset()
            hooks = self.zero3.hooks()  # saved gathered parameters are freed and gathered again in backward
        with hooks:
            losses = self.executor.run(self.actions, micro, dims, grad_sync=self._grad_sync, step=self._step)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if losses:  # the last stage: mean over micro-batches, then over dp via the sum below
            # every tp (and cp) rank of the last stage computed the same loss: counted once
            total += torch.stack(losses).double().mean() / (self.dp_cp * self.tp)
        comm.all_reduce(total, self.mesh.group)
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
        return self._gather_full(self._unshard_dp({n: p.detach() for n, p in self.named_parameters().items()}))

    def full_master_parameters(self) -> dict[str, torch.Tensor]:
        """As :meth:`full_parameters`, for the weights the optimizer steps: a 16-bit plan's fp32
        master copies (under ZeRO all-gathered over dp first), else the parameters themselves."""
        named = self.named_parameters()
        if isinstance(self.optimizer, ShardedOptimizer):
            masters = self.optimizer.full_masters()
        elif isinstance(self.optimizer, MasterWeightOptimizer):
            masters = self.optimizer.master_of()
        else:
            masters = {id(p): p.detach() for p in named.values()}
        return self._gather_full(self._unshard_dp({n: masters[id(p)] for n, p in named.items()}))

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """As :meth:`full_parameters`, for the gradients of the last step (after their sync):
        under ZeRO the dp-averaged chunks are all-gathered first (collective over dp and tp)."""
        return self._gather_full(self.synced_gradients())

    def synced_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's gradients of the last step by name, after the dp sync (tp shards as they
        are). Under ZeRO, where a rank keeps only its chunk, the chunks are all-gathered over dp
        (collective: every dp rank must call it)."""
        named = self.named_parameters()
        if isinstance(self.optimizer, ShardedOptimizer):
            full = self.optimizer.full_gradients()
            return {n: full[id(p)] for n, p in named.items() if id(p) in full}
        return self._unshard_dp({n: p.grad for n, p in named.items()})

    def _unshard_dp(self, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """ZeRO-3: each dp shard all-gathered over dp into this tp rank's full tensor (collective
        over dp); other plans: ``tensors`` as they are."""
        if self.zero3 is None:
            return tensors
        records = {r.name: r for st in self.stages.values() for r in st.module.meta[ZERO3_PLAN].params}
        shapes = {alias: records[alias] for alias in tensors if alias in records}
        out = dict(tensors)
        for name in sorted(tensors):  # the same order on every dp rank
            t = tensors[name]
            record = shapes.get(name)
            if record is None:
                continue
            t = t if t is not None else torch.zeros(record.shard_numel, dtype=record.dtype, device=self.mesh.device)
            degree = self.config.shard_degree
            pieces = [torch.empty_like(t) for _ in range(degree)]
            if degree > 1:
                comm.all_gather(pieces, t, self.mesh.dp_shard_group)
            else:
                pieces = [t]
            out[name] = unshard(pieces, record.shape)
        return out

    def _gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._gather_experts(self._gather_tp(tensors))

    def _gather_experts(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With ep > 1: ``tensors`` with every expert of the ep group's ranks (each holds its own
        experts, under the model's names). Collective over the ep group."""
        if self.config.ep == 1:
            return tensors
        names, stacked = set(self.program.expert_params), set(self.program.stacked_experts)
        mine = {n: t.detach().cpu() for n, t in tensors.items() if n in names and t is not None}
        out = dict(tensors)
        parts = comm.all_gather_object(mine, self.mesh.ep_group)  # in ep rank order
        for part in parts:
            out.update({n: t.to(self.mesh.device) for n, t in part.items() if n not in stacked})
        for n in stacked & set(mine):  # each ep rank's rows of a stacked weight, in order
            out[n] = torch.cat([part[n] for part in parts]).to(self.mesh.device)
        return out

    def _gather_tp(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = self.program.tp_plan
        out = {}
        for name, t in sorted(tensors.items()):  # the same order on every tp rank
            sharding = plan.params[name] if plan is not None else None
            if sharding is None or sharding.dim is None:
                out[name] = t.clone()
                continue
            shards = [torch.empty_like(t) for _ in range(self.tp)]
            comm.all_gather(shards, t, self.mesh.tp_group)
            out[name] = unshard_tensor(shards, sharding)
        return out


def _on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` with its parameters and buffers on ``device``: moved only when one is elsewhere
    (a module already there is left as it is; ``Module.to`` would swap every fake parameter of a
    dry run, which fake tensors refuse)."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device == device for t in tensors):
        return module
    return module.to(device)


def _reads_size_only(node: fx.Node) -> bool:
    """Whether ``node`` uses its input for its shape alone (``sym_size``, ``size``, ``dim``)."""
    target = node.target
    return (target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_size.default)
            or getattr(target, "__name__", "") in ("sym_size", "size", "dim"))
