"""Policy (tag half) of the pipeline split: which stage each node of a training step runs on.

A :class:`StageAssignment` comes from layer boundaries, from the layer chain's stage starts (what
the search decides), or from an explicit node -> stage mapping; :func:`tag_pipeline_stages` writes
it to ``node.meta[PIPELINE_STAGE]``. :mod:`passes.rewrites.pipeline_split` carves the stage
programs from it. Virtual stages: ``n_stages = pp * v`` stages; stage ``s`` runs on rank
``s % pp`` as chunk ``s // pp`` (Megatron interleaving), see :func:`stage_rank_chunk`.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import torch
from torch import fx

from passes.ir.errors import PassError
from passes.ir.meta import module_path
from passes.ir.meta import BLOCK, LAYER_CHAIN, PIPELINE_STAGE, SHAPE, LayerChain, StageAssignment

COMPUTE_OPS = ("call_function", "call_method", "call_module")
"""The node ops that compute (and so are placed on a stage); placeholders and attributes follow."""


# --------------------------------------------------------------------------------------------
# Policy: stage assignments
# --------------------------------------------------------------------------------------------
def find_layers(gm: fx.GraphModule) -> list[str]:
    """The repeated blocks of the model in graph order (``["blocks.0", "blocks.1", ...]``), as
    ``annotate_blocks`` found them (``gm.meta[LAYER_CHAIN]``)."""
    return list(_chain(gm).blocks)


def balanced_boundaries(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Layer indexes where stages 1..n-1 start, spreading ``n_layers`` as evenly as possible."""
    if not 1 <= n_stages <= n_layers:
        raise PassError(f"pipeline_split: cannot spread {n_layers} layers over {n_stages} stages; "
                        f"use 1 to {n_layers} stages")
    return tuple(round(i * n_layers / n_stages) for i in range(1, n_stages))


def chain_starts(n_blocks: int, n_stages: int, starts: Sequence[int] | None = None) -> tuple[int, ...]:
    """The layer-chain index where each stage ``1 .. n_stages - 1`` starts (chain: 0 embedding,
    ``1 .. n_blocks`` blocks, ``n_blocks + 1`` head): ``starts`` checked, or by default the blocks
    spread evenly (embedding with the first block, head with the last)."""
    if starts is None:
        return tuple(1 + b for b in balanced_boundaries(n_blocks, n_stages)) if n_stages > 1 else ()
    starts = tuple(int(x) for x in starts)
    if len(starts) != n_stages - 1 or list(starts) != sorted(set(starts)) or (starts and not
                                                                           1 <= starts[0] <= starts[-1] <= n_blocks + 1):
        raise PassError(f"pipeline_split: stage starts {list(starts)} for {n_stages} stages must be {n_stages - 1} "
                        f"strictly increasing layer-chain indexes in 1..{n_blocks + 1} (0 is the embedding)")
    return starts


def assign_stages_by_chain(gm: fx.GraphModule, starts: Sequence[int]) -> StageAssignment:
    """Stage of every node from the layer-chain index where each stage ``1..`` starts.

    Every compute node goes with its chain index (``node.meta[BLOCK]``): stage ``s`` holds the
    indexes ``starts[s-1] .. starts[s] - 1``. Nodes that read graph inputs only (sizes of the
    token ids, an ``arange``, flattened targets) are placed by :func:`assign_stages` on the
    earliest stage that uses them, so they are never sent.
    """
    chain = _chain(gm)
    starts = chain_starts(chain.n_blocks, len(starts) + 1, starts)
    memo: dict[fx.Node, bool] = {}
    mapping = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS or (_reads_only_placeholders(node, memo) and not is_size(node)):
            continue
        meta = node.meta.get(BLOCK)
        if meta is None:
            raise PassError(f"pipeline_split: node {node.name!r} has no node.meta[{BLOCK!r}]; run annotate_blocks "
                            f"on the captured graph before splitting it")
        mapping[node.name] = sum(b <= meta.index for b in starts)
    return assign_stages(gm, mapping, n_stages=len(starts) + 1)


def assign_stages_by_layers(gm: fx.GraphModule, boundaries: Sequence[int | str]) -> StageAssignment:
    """Stage of every node from layer boundaries: ``boundaries[i]`` is the first block of stage
    ``i + 1``, as an index into :func:`find_layers` or a block name (``"blocks.2"``); the
    embedding goes with the first block, the head with the last (:func:`assign_stages_by_chain`)."""
    layers = find_layers(gm)
    if not layers:
        raise PassError("pipeline_split: found no repeated layers (module paths like 'blocks.0'); "
                        "pass an explicit node -> stage mapping instead")
    index = {name: i for i, name in enumerate(layers)}
    starts = []
    for b in boundaries:
        if isinstance(b, str):
            if b not in index:
                raise PassError(f"pipeline_split: boundary {b!r} is not a layer; layers are {layers}")
            b = index[b]
        starts.append(int(b))
    if any(not 0 < b < len(layers) for b in starts) or starts != sorted(set(starts)):
        raise PassError(f"pipeline_split: boundaries {list(boundaries)} must be strictly increasing layer "
                        f"indexes in 1..{len(layers) - 1} (the model has {len(layers)} layers)")
    return assign_stages_by_chain(gm, [1 + b for b in starts])


def tag_pipeline_stages_by_chain(gm: fx.GraphModule, ctx: Any = None, *, starts: Sequence[int]) -> fx.GraphModule:
    """Write ``node.meta[PIPELINE_STAGE]`` on every node: stage ``s`` holds the layer-chain
    indexes from ``starts[s-1]`` up to ``starts[s] - 1`` (:func:`assign_stages_by_chain`); the
    graph itself is not split (:func:`split_pipeline_stages` carves the stage programs)."""
    return tag_pipeline_stages(gm, assign_stages_by_chain(gm, starts))


def _chain(gm: fx.GraphModule) -> LayerChain:
    chain = gm.meta.get(LAYER_CHAIN)
    if chain is None:
        raise PassError("pipeline_split: gm.meta has no 'layer_chain'; run annotate_blocks on the captured graph "
                        "first (stages are cut along the layer chain it finds)")
    return chain


def assign_stages(gm: fx.GraphModule, mapping: Mapping[str | fx.Node, int], *,
                  n_stages: int | None = None) -> StageAssignment:
    """Complete and validate an explicit node -> stage mapping.

    Compute nodes left out are placed:

    * one that reads graph inputs only (``sym_size`` of the token ids, an ``arange``, the
      flattened targets) on the earliest stage that uses it, so it is never sent (one no node
      uses, such as export's check of a tensor's metadata, on the stage of its inputs);
    * any other on the stage of the latest placed node before it in graph order (or of its
      latest input, if later): embeddings before the first mapped node land on stage 0, the
      final norm, head and loss after the last one on its stage.

    ``getitem`` of a multi-output node always joins its producer. Parameters are tagged with
    their first user's stage, graph inputs with the earliest stage reading them. Raises
    :class:`PassError` naming the node if a stage is out of range or stages decrease along a
    data dependency.
    """
    given = {(k.name if isinstance(k, fx.Node) else k): int(v) for k, v in mapping.items()}
    names = {n.name for n in gm.graph.nodes}
    unknown = sorted(set(given) - names)
    if unknown:
        raise PassError(f"pipeline_split: mapping names nodes not in the graph: {unknown[:5]}")
    n = n_stages if n_stages is not None else max(given.values(), default=0) + 1
    for name, s in given.items():
        if not 0 <= s < n:
            raise PassError(f"pipeline_split: node {name!r} is assigned stage {s}, outside 0..{n - 1}")

    stage: dict[str, int] = {}
    deferred: list[fx.Node] = []  # placeholder-only nodes: placed from their users, in reverse order
    only_inputs: dict[fx.Node, bool] = {}
    current = 0  # stage of the latest placed node in graph order
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        if node.name in given:
            current = stage[node.name] = given[node.name]
        elif _reads_only_placeholders(node, only_inputs) and not is_size(node):
            # Sizes stay early: later stages rebuild them from their own inputs, whereas a
            # size placed late would make that stage read the graph input it is taken from.
            deferred.append(node)
        elif _is_tuple_getitem(node):
            stage[node.name] = stage[node.args[0].name]
        else:
            inputs = [stage[a.name] for a in _compute_inputs(node) if a.name in stage]
            current = stage[node.name] = max([current, *inputs])
    unused = []  # placed after their inputs: an assertion on a tensor must not pull it to stage 0
    for node in reversed(deferred):
        users = [stage[u.name] for u in node.users if u.name in stage]
        if users:
            stage[node.name] = min(users)
        else:
            unused.append(node)
    for node in reversed(unused):
        stage[node.name] = max((stage[a.name] for a in _compute_inputs(node) if a.name in stage), default=0)
    # A multi-output node's getitems run where it does, so only single tensors cross stages.
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS and _is_tuple_getitem(node):
            stage[node.name] = stage[node.args[0].name]
    order = node_order(gm)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            users = sorted(node.users, key=order.__getitem__)
            users_stages = [stage[u.name] for u in users if u.name in stage]
            if node.op == "placeholder":
                stage[node.name] = min(users_stages, default=0)
            else:  # a parameter "lives" with its first user
                stage[node.name] = users_stages[0] if users_stages else 0
    result = StageAssignment(n_stages=n, stage_of=stage)
    validate_assignment(gm, result)
    return result


def validate_assignment(gm: fx.GraphModule, assignment: StageAssignment) -> None:
    """Raise :class:`PassError` naming the first node whose stage is below one of its inputs'."""
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        if node.name not in assignment.stage_of:
            raise PassError(f"pipeline_split: node {node.name!r} has no stage; assign every compute node")
        s = assignment.stage_of[node.name]
        if not 0 <= s < assignment.n_stages:
            raise PassError(f"pipeline_split: node {node.name!r} is on stage {s}, outside "
                            f"0..{assignment.n_stages - 1}")
        for a in _compute_inputs(node):
            t = assignment.stage_of.get(a.name, 0)
            if t > s:
                where = module_path(node) or "top level"
                raise PassError(
                    f"pipeline_split: node {node.name!r} ({where}) is on stage {s} but reads {a.name!r} from "
                    f"later stage {t}; stages must not decrease along data dependencies: move {node.name!r} "
                    f"to stage >= {t} or {a.name!r} to stage <= {s}")


def stage_rank_chunk(stage: int, pp: int, n_stages: int | None = None) -> tuple[int, int]:
    """(rank, chunk) of a virtual stage with ``pp`` pipeline ranks: ``(s % pp, s // pp)``.

    With ``n_stages = pp * v`` each rank runs ``v`` chunks (Megatron interleaving): on 2 ranks
    stages 0..3 are rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1.
    """
    if pp < 1 or (n_stages is not None and (n_stages % pp or not 0 <= stage < n_stages)):
        raise PassError(f"pipeline_split: stage {stage} of {n_stages} cannot be placed on pp={pp} ranks; "
                        f"n_stages must be a multiple of pp (n_stages = pp * chunks)")
    return stage % pp, stage // pp




def tag_pipeline_stages(gm: fx.GraphModule, assignment: StageAssignment) -> fx.GraphModule:
    """Write ``node.meta[PIPELINE_STAGE]`` (int) on every node (the output: the last stage)."""
    for node in gm.graph.nodes:
        node.meta[PIPELINE_STAGE] = assignment.stage_of.get(node.name, assignment.n_stages - 1)
    return gm


def _compute_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op in COMPUTE_OPS]


def _reads_only_placeholders(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """True if the node depends on graph inputs only: no parameter, no computed activation."""
    if node not in memo:
        memo[node] = all(a.op == "placeholder" or (a.op in COMPUTE_OPS and _reads_only_placeholders(a, memo))
                         for a in node.all_input_nodes)
    return memo[node]


def _is_tuple_getitem(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].op in COMPUTE_OPS)


def is_size(node: fx.Node) -> bool:
    """A node producing an int or SymInt (``sym_size``), from shapes or from export's value."""
    meta = node.meta.get(SHAPE)
    if meta is not None:
        return meta.value is not None
    return isinstance(node.meta.get("val"), (int, torch.SymInt)) and not isinstance(node.meta.get("val"), bool)


def node_order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(gm.graph.nodes)}
