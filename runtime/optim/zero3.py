"""ZeRO-3 on one rank: keep this dp rank's shard of every parameter and build the gatherer the
stage programs' ``zero3_gather`` ops run through (:mod:`runtime.kernels.zero3`).

The lowering (:mod:`passes.rewrites.shard_parameters`) gives every dp rank the same program, whose shard
parameters hold dp rank 0's values and whose ``zero3_sources`` attribute holds the full tensors.
Here each shard takes this rank's piece (:func:`passes.ir.zero3_ops.shard_of`) in place (the
``Parameter`` objects, which the regions and the optimizer share, stay the same) and the full
tensors are dropped.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import fx

from passes.ir.errors import ConfigError
from passes.ir.zero3_ops import ZERO3_PREFETCH, keeps_gathered, shard_of
from passes.ir.meta import ZERO3_PLAN
from runtime.kernels.zero3 import ParamGatherer, register_gatherer


def zero3_gatherer(modules: Mapping[int, fx.GraphModule], mesh, *, prefetch: int = ZERO3_PREFETCH) -> ParamGatherer:
    """Shard this rank's stage programs in place and register their gatherer.

    ``modules``: the rank's stage programs by global stage index (each lowered with
    ``zero_stage=3``). ``prefetch``: sites gathered ahead of the one running (0: none)."""
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"zero3: prefetch must be an int >= 0 (sites gathered ahead), got {prefetch!r}")
    sites = {}
    group_name = None
    for stage, module in modules.items():
        plan = module.meta.get(ZERO3_PLAN)
        if plan is None:
            raise ConfigError(f"zero3: stage {stage}'s program was not lowered with zero_stage=3 (no "
                              f"{ZERO3_PLAN!r} in its meta); lower it from the same config")
        if plan.degree != mesh.dp_shard:
            raise ConfigError(f"zero3: stage {stage} is sharded over {plan.degree} dp ranks, the mesh's shard groups "
                              f"have {mesh.dp_shard}; build the mesh with Mesh(..., dp_shard=config.hsdp_shard)")
        group_name = plan.group
        sources = getattr(module, "zero3_sources", None)
        if sources is not None:  # first ParallelModel built from this program: take this rank's shards
            with torch.no_grad():
                for record in plan.params:
                    p = module.get_parameter(record.name)
                    p.data = shard_of(sources[record.name].to(p.device), plan.degree, mesh.dp_shard_index)
            del module.zero3_sources
        for site in plan.sites:
            shards = [module.get_parameter(n) for n in site.params]
            shapes = [plan.param(n).shape for n in site.params]
            sites[(stage, site.site)] = (site, shards, shapes)
    keep = keeps_gathered(m.meta[ZERO3_PLAN] for m in modules.values())
    gatherer = ParamGatherer(mesh.dp_shard_group, mesh.dp_shard, sites, prefetch=prefetch,
                             replica_group=mesh.dp_replica_group, replicas=mesh.dp // mesh.dp_shard, keep=keep)
    if group_name is not None:
        register_gatherer(group_name, gatherer)
    return gatherer
