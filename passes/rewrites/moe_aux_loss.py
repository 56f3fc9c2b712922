"""Rewrite: a load-balancing loss over the whole batch of the data axis, as one device computes it.

The Switch/Mixtral loss of an MoE block is ``E * sum_e f_e * P_e`` with ``f_e`` and ``P_e``
averages over the batch's tokens. A data-parallel (or context-parallel) rank sees only its share
of the tokens, and the product of two averages is not the average of the products: each rank's
loss would differ from one device's. Here each average feeding a product that
:mod:`passes.analysis.annotate_moe` listed as the block's aux-loss term becomes
``data_mean(average)`` over the ``degree`` ranks of the data axis (equal token counts, so the
mean of the ranks' means is the batch's mean; :mod:`passes.ir.moe_ops`). Every rank then holds
one device's loss.

With micro-batches the averages are those of each micro-batch's tokens (as every framework
computes them under gradient accumulation), so the loss is one device's when each step is one
micro-batch per replica.

Requires :class:`passes.ir.meta.MoeLayers`; a block whose aux term is not a product of token
averages (``mean``) is left as it is.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

import passes.ir.moe_ops  # noqa: F401  (defines torch.ops.partitioner.data_mean)
from passes.analysis.annotate_moe import op_of, through_views
from passes.ir.meta import MOE_LAYERS

aten = torch.ops.aten
_ops = torch.ops.partitioner


def average_aux_loss(gm: fx.GraphModule, ctx: Any = None, *, degree: int, group: str) -> fx.GraphModule:
    """Make each listed aux-loss term's token averages those of the data axis' ``degree`` ranks,
    whose group is registered as ``group`` (module docstring)."""
    layers = gm.meta.get(MOE_LAYERS)
    if degree == 1 or layers is None:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    terms = [nodes[t] for b in layers.blocks for t in b.aux_loss if t in nodes]
    done: set[fx.Node] = set()
    for term in terms:
        for operand in term.all_input_nodes:
            mean = through_views(operand)
            if op_of(mean) is not aten.mean or mean in done:
                continue
            done.add(mean)
            with gm.graph.inserting_after(mean):
                shared = gm.graph.call_function(_ops.data_mean.default, (mean, degree, group))
            mean.replace_all_uses_with(shared, delete_user_cb=lambda u: u is not shared)
    gm.recompile()
    return gm
