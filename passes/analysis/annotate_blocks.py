"""Analysis: the model's layer chain — embedding, repeated blocks, head — and each node's place in it.

The planner profiles the chain, the pipeline split cuts it into stages and the checkpoint
policy recomputes its blocks; all three read the chain this pass writes, so a stage boundary
at chain index ``k`` means the same thing to each of them.

Blocks
    A *layer* is a module path's first indexed component (``blocks.3`` of ``blocks.3.attn.qkv``,
    ``model.layers.3`` of ``model.layers.3.mlp``). Layers are grouped by container (the path
    before the index); the container whose layers hold the most compute nodes is the stack (a
    small ``Sequential`` stem of conv, norm and activation loses to the stages of a CNN, and any
    head to a transformer's blocks). Its blocks are numbered ``1 .. L`` in graph order.
Other nodes
    * a compute node inside a block takes the block's index;
    * one before the first block node (embeddings, masks, positions) takes ``0``, one after the
      last (final norm, LM head, loss) ``L + 1``, one in between the index of the latest block
      before it (never less than the index of what it reads);
    * a parameter (``get_attr``) inside a block's module path takes that block, any other its
      first user's index; a graph input its first user's; the output ``L + 1``.
A graph without repeated layers has no blocks: every node is index 0 (``"model"``).

Writes ``node.meta[BLOCK]`` (:class:`BlockMeta`) on every node and ``gm.meta[LAYER_CHAIN]``
(:class:`LayerChain`). Reads module paths only (export's ``nn_module_stack``), so it runs on
any captured graph; nodes a later rewrite inserts have no index.
"""
from __future__ import annotations

import re
from typing import Any

from torch import fx

from passes.ir.meta import module_path
from passes.ir.meta import BLOCK, LAYER_CHAIN, BlockMeta, LayerChain

_INDEX = re.compile(r"\d+")
_COMPUTE = ("call_function", "call_method", "call_module")


def layer_of(path: str) -> str | None:
    """The layer (``container.<int>``) a module path lies in: its first indexed component."""
    parts = path.split(".") if path else []
    for i in range(1, len(parts)):
        if _INDEX.fullmatch(parts[i]):
            return ".".join(parts[:i + 1])
    return None


def find_blocks(gm: fx.GraphModule) -> LayerChain:
    """The repeated blocks of ``gm`` in graph order (see the module docstring)."""
    by_container: dict[str, list[str]] = {}
    weight: dict[str, int] = {}  # compute nodes inside each container's layers
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        layer = layer_of(module_path(node))
        if layer is not None:
            container = layer.rpartition(".")[0]
            if layer not in by_container.setdefault(container, []):
                by_container[container].append(layer)
            weight[container] = weight.get(container, 0) + 1
    if not by_container:
        return LayerChain(blocks=())
    container = max(by_container, key=lambda c: (weight[c], len(by_container[c])))
    return LayerChain(blocks=tuple(by_container[container]), containers=(container,))


def annotate_blocks(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Write :class:`BlockMeta` on every node and :class:`LayerChain` on ``gm`` (module docstring)."""
    chain = find_blocks(gm)
    gm.meta[LAYER_CHAIN] = chain
    if not chain.blocks:
        for node in gm.graph.nodes:
            node.meta[BLOCK] = BlockMeta(index=0, name="model")
        return gm
    number = {b: i + 1 for i, b in enumerate(chain.blocks)}
    head = len(chain.blocks) + 1
    names = chain.names
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op in _COMPUTE]
    in_block = {n: number.get(layer_of(module_path(n)) or "") for n in compute}
    positions = [i for i, n in enumerate(compute) if in_block[n] is not None]
    first, last = positions[0], positions[-1]

    index: dict[fx.Node, int] = {}
    latest = 0
    for i, n in enumerate(compute):
        if in_block[n] is not None:
            index[n] = latest = in_block[n]
        elif i < first:
            index[n] = 0
        elif i > last:
            index[n] = head
        else:
            index[n] = max([latest, *(index[a] for a in n.all_input_nodes if a in index)])
    for n in nodes:
        if n.op == "get_attr":
            own = number.get(layer_of(str(n.target)) or "")
            users = [index[u] for u in n.users if u in index]
            index[n] = own if own is not None else (min(users) if users else 0)
    for n in nodes:
        if n.op == "placeholder":
            index[n] = min((index[u] for u in n.users if u in index), default=0)
        elif n.op == "output":
            index[n] = head
    for n in nodes:
        n.meta[BLOCK] = BlockMeta(index=index[n], name=names[index[n]])
    return gm
