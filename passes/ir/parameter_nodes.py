"""Which nodes of a graph module are its trainable parameters' side: one rule for the split-backward
rewrite (what W holds, where the data enters, which uses get their own alias) and the runtime's
compiled segments (which ops stay eager for the split to find).

A node is *parameter-only* when its value depends on trainable parameters and on no placeholder
(a ``get_attr`` of a parameter, its views, casts and aliases); a buffer or a constant is neither
side. A node that reads a parameter-only node and the data is where the two meet: a matmul's
weight side, a norm's affine parameters.
"""
from __future__ import annotations

import torch
from torch import fx


def parameter_of(g: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The parameter a ``get_attr`` node of ``g`` reads, else None (a buffer, another node)."""
    if node.op != "get_attr":
        return None
    try:
        return g.get_parameter(str(node.target))
    except AttributeError:
        return None


def parameter_only(g: fx.GraphModule, trainable: set[int] | None = None) -> dict[fx.Node, bool]:
    """Each node of ``g`` -> whether its value depends on trainable parameters (``id``s in
    ``trainable``; default: ``g``'s parameters that require grad) and on no placeholder."""
    if trainable is None:
        trainable = {id(p) for p in g.parameters() if p.requires_grad}
    out: dict[fx.Node, bool] = {}
    for node in g.graph.nodes:
        if node.op == "placeholder":
            out[node] = False
        elif node.op == "get_attr":
            p = parameter_of(g, node)
            out[node] = p is not None and id(p) in trainable
        else:
            ins = node.all_input_nodes
            out[node] = bool(ins) and any(out.get(a, False) for a in ins) and not any(reads_data(a, out) for a in ins)
    return out


def reads_data(node: fx.Node, param_only: dict[fx.Node, bool]) -> bool:
    """Whether ``node``'s value depends on a placeholder other than through parameter-only nodes."""
    return node.op == "placeholder" or (node.op == "call_function" and not param_only.get(node, False)
                                        and any(reads_data(a, param_only) for a in node.all_input_nodes))
