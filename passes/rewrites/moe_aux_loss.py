"""Rewrite: a load-balancing loss over the whole batch of the data axis, as one device computes it.

The Switch/Mixtral loss of an MoE block is ``E * sum_e f_e * P_e`` with ``f_e`` and ``P_e``
averages over the batch's tokens. A data-parallel (or context-parallel) rank sees only its share
of the tokens, and the product of two averages is not the average of the products: each rank's
loss would differ from one device's. Here both factors of each product that
:mod:`passes.analysis.annotate_moe` listed as an aux-loss term (the zoo's ``mean * mean``), or
that a top-k it listed for one feeds (Hugging Face's ``load_balancing_loss_func``, which
recomputes the routing, sums counts and probabilities over the layers and divides by the
tokens: :func:`aux_products`), become ``data_mean(factor)`` over the ``degree`` ranks of the
data axis (equal token counts, so the mean of the ranks' averages is the batch's average;
:mod:`passes.ir.moe_ops`). Every rank then holds one device's loss.

With micro-batches the averages are those of each micro-batch's tokens (as every framework
computes them under gradient accumulation), so the loss is one device's when each step is one
micro-batch per replica.

Requires :class:`passes.ir.meta.MoeLayers`. Not averaged: a product whose factors lie in
another pipeline stage than the top-k that names it (the rewrite sees one stage program).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

import passes.ir.moe_ops  # noqa: F401  (defines torch.ops.partitioner.data_mean)
from passes.analysis.annotate_moe import op_of, through_views
from passes.ir.meta import MOE_LAYERS

aten = torch.ops.aten
_ops = torch.ops.partitioner


def average_aux_loss(gm: fx.GraphModule, ctx: Any = None, *, degree: int, group: str) -> fx.GraphModule:
    """Make each load-balancing product's token averages those of the data axis' ``degree`` ranks,
    whose group is registered as ``group`` (module docstring)."""
    layers = gm.meta.get(MOE_LAYERS)
    if degree == 1 or layers is None:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    named = [nodes[t] for b in layers.blocks for t in b.aux_loss if t in nodes]
    named += [nodes[t] for t in layers.aux_loss if t in nodes]
    products: dict[fx.Node, None] = {}
    for node in named:
        for product in ([node] if op_of(node) is aten.mul else aux_products(node) if op_of(node) is aten.topk else []):
            products[product] = None
    done: dict[fx.Node, fx.Node] = {}
    for product in products:
        for operand in product.all_input_nodes:
            if operand in done:
                continue
            with gm.graph.inserting_after(operand):
                shared = gm.graph.call_function(_ops.data_mean.default, (operand, degree, group))
            done[operand] = shared
            product.replace_input_with(operand, shared)
    gm.recompile()
    return gm


def aux_products(topk: fx.Node) -> list[fx.Node]:
    """The ``f_e * P_e`` products of a top-k's load-balancing loss: a ``mul`` of something its
    chosen ids feed (the tokens per expert) and something its probabilities feed without passing
    through the choice (the mean router probability). Hugging Face's ``load_balancing_loss_func``
    recomputes the top-k for it and sums the counts and probabilities over the layers first."""
    ids = [u for u in topk.users if u.target is operator.getitem and u.args[1] == 1]
    chosen = _forward(ids)
    probs = _forward([through_views(topk.args[0])]) - _forward([topk])
    out = []
    for n in chosen:
        if op_of(n) is not aten.mul or len(n.all_input_nodes) != 2:
            continue
        a, b = n.all_input_nodes
        if (a in chosen and b in probs and b not in chosen) or (b in chosen and a in probs and a not in chosen):
            out.append(n)
    return out


def _forward(starts: list[fx.Node]) -> set[fx.Node]:
    out, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.users)
    return out
