"""``ParallelModel``: data-parallel x pipeline-parallel training of a :class:`ModelSpec`.

Built on every rank of the mesh from the same arguments (every rank captures and splits the
model the same way, so no plan has to be sent around)::

    capture_spec (symbolic batch/seq) -> annotate_shapes -> split into pp*v stages (balanced by
    layers) -> this rank's stages (stage s on pipeline index s % pp) -> schedule[pp_index]

``train_step(batch)`` takes the *global* batch (every rank gets the same tensors), keeps this
dp rank's contiguous slice, cuts it into ``num_micro_batches`` micro-batches, runs the schedule
(:class:`runtime.stage_executor.StageExecutor`), syncs gradients (tied copies, then the dp
average; :mod:`runtime.grad_sync`), steps AdamW (or ZeRO-1 AdamW) and returns the loss of the
whole global batch, the same float on every rank.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import fx

from partitioner.errors import ConfigError
from partitioner.model_spec import ModelSpec
from passes.annotate_shapes import annotate_shapes
from passes.capture import capture_spec
from passes.pipeline_split import (
    assign_stages_by_layers, balanced_boundaries, find_layers, split_pipeline_stages,
)
from runtime import schedule as schedules
from runtime.grad_sync import (
    DEFAULT_BUCKET_BYTES, TiedCopies, TiedSync, ZeroAdamW, all_reduce_buckets, fill_missing_grads, unique_params,
)
from runtime.mesh import Mesh
from runtime.stage_executor import LocalStage, StageExecutor

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


class ParallelModel:
    """One rank's share of a dp x pp training job (see the module docstring).

    ``graph``: an already captured :func:`capture_for_pipeline` graph to start from (deep-copied,
    so the caller's weights are untouched); by default the spec is captured here. ``zero``: shard
    the AdamW state over dp (ZeRO-1). ``adamw``: keyword arguments of ``torch.optim.AdamW``.
    """

    def __init__(self, spec: ModelSpec, *, dp: int = 1, pp: int = 1, schedule: str = "1f1b",
                 num_micro_batches: int = 1, virtual_pp: int = 1, global_batch: int, mesh: Mesh | None = None,
                 graph: fx.GraphModule | None = None, zero: bool = False, adamw: dict | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0):
        self.mesh = mesh or Mesh(dp, pp, timeout_s=timeout_s)
        if (self.mesh.dp, self.mesh.pp) != (dp, pp):
            raise ConfigError(f"parallel_model: mesh has dp={self.mesh.dp}, pp={self.mesh.pp} but dp={dp}, pp={pp} "
                              f"were asked for; pass matching values")
        if not self.mesh.active:
            raise ConfigError(f"parallel_model: rank {self.mesh.rank} is outside {self.mesh}; build it on mesh ranks only")
        m, v = num_micro_batches, virtual_pp
        if global_batch % (dp * m):
            raise ConfigError(f"parallel_model: global_batch={global_batch} must be divisible by dp * "
                              f"num_micro_batches = {dp} * {m}; e.g. global_batch={dp * m * max(1, global_batch // (dp * m))}")
        self.spec, self.dp, self.pp, self.m, self.v = spec, dp, pp, m, v
        self.global_batch, self.bucket_bytes = global_batch, bucket_bytes
        self.actions = self._schedule(schedule)

        gm = copy.deepcopy(graph) if graph is not None else capture_for_pipeline(spec, device=self.mesh.device.type)
        n_stages = pp * v
        n_layers = len(find_layers(gm))
        boundaries = balanced_boundaries(n_layers, n_stages) if n_stages > 1 else ()
        self.split = split_pipeline_stages(gm, assign_stages_by_layers(gm, boundaries))
        mine = [s for s in range(n_stages) if s % pp == self.mesh.pp_index]
        self.stages = {s: LocalStage(s, self.split.modules[s].to(self.mesh.device), self.split.io[s]) for s in mine}
        self.executor = StageExecutor(self.stages, self.split.io, pp_ranks=self.mesh.pp_ranks,
                                      pp_group=self.mesh.pp_group, num_micro_batches=m, device=self.mesh.device)
        self.tied_sync = TiedSync(self._tied_copies(), self.mesh.device)
        self.params = unique_params([st.module for st in self.stages.values()])
        kwargs = dict(adamw or {})
        if zero:
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
            if len(holders) == 1:
                group = None  # every copy on this rank
            elif holders == [0, self.pp - 1]:
                group = self.mesh.ends_group  # the usual case: embedding first, LM head last
            else:
                group = self.mesh.pp_group  # general: the whole pipeline, zeros from non-holders
            if copies or (group is self.mesh.pp_group and len(holders) > 1):
                out.append(TiedCopies(name, list(copies.values()), group, tuple(ref.shape), ref.dtype))
        return out

    def _grad_sync(self) -> None:
        fill_missing_grads(self.params)
        self.tied_sync()
        all_reduce_buckets(self.params, self.mesh.dp_group, self.dp, bucket_bytes=self.bucket_bytes)

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
        losses = self.executor.run(self.actions, micro, dims, grad_sync=self._grad_sync, step=self._step)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if losses:  # the last stage: mean over micro-batches, then over dp via the sum below
            total += torch.stack(losses).double().mean() / self.dp
        torch.distributed.all_reduce(total, group=self.mesh.group)
        return float(total)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name (a tied weight under each alias its stages read)."""
        out = {}
        for stage in self.stages.values():
            for name, p in stage.module.named_parameters(remove_duplicate=False):
                out[name] = p
        return out


def _has_param(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False
