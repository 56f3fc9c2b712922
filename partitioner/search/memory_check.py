"""The planner's memory numbers, from the exact replay of the rank programs the plan will run.

The search prunes and ranks candidates with the analytic per-layer model (:mod:`partitioner.search.plan_cost`,
fast, a few percent off). Before a plan is returned, :func:`replay_check` lowers it exactly as the
job will (:func:`partitioner.compile.build.lower_plan`, one lowering for every rank program) and replays
each distinct rank program's step (:func:`partitioner.search.replay.predict_memory`: the liveness of
its own stage modules along its schedule, with the gradient buckets, ZeRO chunks, receive buffers
and optimizer the runtime adds). That replay is what the plan reports as its per-rank and
per-stage peak, and a candidate whose replay does not fit the device is dropped.

Data-parallel replicas run the same program: one replay per (pipeline stage, tp rank) serves
every dp index. Under ZeRO-3 that program holds the rank's parameter shards and its gathers;
the replay places the gathered blocks, the reduce-scatter copies and the shards' state
(:class:`partitioner.search.replay._Zero3Gathers`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from partitioner.compile.build import lower_plan
from partitioner.cost.cluster import Cluster
from partitioner.search.replay import MemoryPrediction, predict_memory
from passes.ir.config import ParallelConfig
from passes.ir.graph_modules import weightless_copy
from passes.ir.meta import CAPTURE
from passes.ir.plan import Plan
from passes.ir.program import global_rank
from passes.ir.zero3_ops import ZERO3_PREFETCH


def global_batch_bytes(graph: fx.GraphModule, global_batch: int) -> int:
    """Bytes of the global batch every rank is handed (``train_step`` slices its share of it)."""
    info = graph.meta[CAPTURE]
    dims = {**dict(info.dims), "batch": global_batch}
    total = 0
    for spec in info.inputs:
        n = 1
        for d in spec.shape:
            n *= dims[d] if isinstance(d, str) else int(d)
        total += n * torch.empty((), dtype=spec.dtype).element_size()
    return total


def replay_rank_peaks(graph: fx.GraphModule, plan: Plan, cluster: Cluster, *,
                      optimizer: str = "adamw", zero3_prefetch: int = ZERO3_PREFETCH) -> tuple[int, ...]:
    """Peak live bytes of every global rank of ``plan`` (index = rank), by the exact replay of
    its rank program on ``graph`` (the analysed capture :func:`partitioner.compile.build.run_analysis_passes` made).
    ``zero3_prefetch``: ZeRO-3 gather sites issued ahead (the runtime's ``zero3_prefetch``)."""
    return replay_config_peaks(graph, plan.config, cluster, global_batch=plan.global_batch, optimizer=optimizer,
                               zero3_prefetch=zero3_prefetch)


def replay_config_peaks(graph: fx.GraphModule, config: ParallelConfig, cluster: Cluster, *,
                        global_batch: int | None = None, optimizer: str = "adamw",
                        zero3_prefetch: int = ZERO3_PREFETCH) -> tuple[int, ...]:
    """As :func:`replay_rank_peaks`, for a bare :class:`ParallelConfig` (bytes per global rank)."""
    return tuple(int(m.peak_bytes) for m in replay_rank_memory(graph, config, cluster, global_batch=global_batch,
                                                                optimizer=optimizer, zero3_prefetch=zero3_prefetch))


def replay_rank_memory(graph: fx.GraphModule, config: ParallelConfig, cluster: Cluster, *,
                       global_batch: int | None = None, optimizer: str = "adamw",
                       zero3_prefetch: int = ZERO3_PREFETCH) -> tuple[MemoryPrediction, ...]:
    """The replay of every global rank of ``config`` (index = rank): its peak and model state
    (bytes). ``global_batch``: samples of the batch every rank is handed (default
    ``config.global_batch``)."""
    c = config
    # shapes are what the replay reads: a real model's weights would be copied and sharded for nothing
    lowering = lower_plan(weightless_copy(graph), c, cluster=cluster, check=False)
    # dp (and cp) ranks run the same program (ZeRO-3: equal, padded shards): one replay per (stage, tp rank)
    firsts = [global_rank(s, 0, t, dp=c.dp_cp, tp=c.tp) for s in range(c.pp) for t in range(c.tp)]
    replayed = replay_ranks(graph, lowering, firsts, global_batch=global_batch, optimizer=optimizer,
                            zero3_prefetch=zero3_prefetch)
    out: dict[int, MemoryPrediction] = {}
    for s in range(c.pp):
        for t in range(c.tp):
            for d in range(c.dp_cp):
                out[global_rank(s, d, t, dp=c.dp_cp, tp=c.tp)] = replayed[global_rank(s, 0, t, dp=c.dp_cp, tp=c.tp)]
    return tuple(out[r] for r in range(c.world_size))


def replay_ranks(graph: fx.GraphModule, lowering, ranks, *, global_batch: int | None = None,
                 optimizer: str = "adamw", zero3_prefetch: int = ZERO3_PREFETCH) -> dict[int, MemoryPrediction]:
    """The replay of the programs of global ``ranks`` (of a mesh from rank 0) of ``lowering``
    (:func:`partitioner.compile.build.lower_plan`'s, of ``graph``): what :func:`replay_rank_memory`
    says of them, without lowering the plan again or replaying the ranks not asked for (a dry
    run replays the representatives it runs)."""
    c = lowering.config
    # the lowered whole graph's dims: with context parallelism its sequence is one cp rank's
    dims = {**dict(lowering.graph.meta[CAPTURE].dims), "batch": c.micro_batch_size}
    batch_bytes = global_batch_bytes(graph, c.global_batch if global_batch is None else global_batch)
    return {r: predict_memory(lowering.rank_program(r), schedule=c.schedule, num_micro_batches=c.num_micro_batches,
                              dims=dims, global_batch_bytes=batch_bytes, zero=c.zero_stage, optimizer=optimizer,
                              zero3_prefetch=zero3_prefetch) for r in ranks}


def with_rank_peaks(plan: Plan, peaks: tuple[int, ...]) -> Plan:
    """``plan`` whose predicted peak (overall, per stage, per rank) is ``peaks``."""
    c = plan.config
    stage_peak = {s: max(peaks[global_rank(s, d, t, dp=c.dp_cp, tp=c.tp)] for d in range(c.dp_cp) for t in range(c.tp))
                  for s in range(c.pp)}
    stages = tuple(dataclasses.replace(st, peak_memory_bytes=float(stage_peak[st.index])) for st in plan.stages)
    predicted = dataclasses.replace(plan.predicted, peak_memory_bytes=float(max(peaks)),
                                    rank_peak_memory_bytes=tuple(float(p) for p in peaks), memory_model="replay")
    return dataclasses.replace(plan, stages=stages, predicted=predicted)


def replay_check(graph: fx.GraphModule, cluster: Cluster, *, optimizer: str = "adamw"):
    """The ``check`` callback of :func:`partitioner.search.search.search`: a candidate with its replayed
    memory numbers (the search drops it when they exceed the device)."""

    def check(plan: Plan) -> Plan:
        return with_rank_peaks(plan, replay_rank_peaks(graph, plan, cluster, optimizer=optimizer))

    return check
