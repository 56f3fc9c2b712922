"""Which parameters take no weight decay: norm weights and biases (fewer than 2 dims) and the
tables of embedding lookups, as Megatron-LM and torchtitan train.

Read off the whole captured graph, before the pipeline split: a tied embedding / LM head weight
is an embedding table on the first stage and a matmul operand on the last, and both copies must
land in the same group. Every alias of a tied parameter is listed, so each stage finds its copy
under the name it holds it by. The plain-module rule the single-device reference uses is
:func:`runtime.optim.optimizers.module_param_groups` (``nn.Embedding`` weights and 0/1-D parameters):
for a captured model the two agree.
"""
from __future__ import annotations

import torch
from torch import fx

from passes.ir.meta import CAPTURE

_EMBEDDING_OPS = (torch.ops.aten.embedding.default, torch.ops.aten.embedding_bag.default,
                  torch.ops.aten._embedding_bag.default)


def no_weight_decay_names(gm: fx.GraphModule) -> frozenset[str]:
    """Names (every alias) of the parameters of ``gm`` that take no weight decay."""
    names = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _EMBEDDING_OPS:
            table = node.args[0]
            if isinstance(table, fx.Node) and table.op == "get_attr":
                names.add(str(table.target))
    for name, p in gm.named_parameters(remove_duplicate=False):
        if p.dim() < 2:
            names.add(name)
    info = gm.meta.get(CAPTURE)
    for group in (info.tied if info is not None else ()):
        if names & set(group):
            names.update(group)
    return frozenset(names)
