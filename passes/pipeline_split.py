"""Transform: cut a captured training step into one ``fx.GraphModule`` per pipeline stage.

Policy and mechanism are separate: a :class:`StageAssignment` (built here from layer boundaries,
or from an explicit node -> stage mapping, later by the search) says where each node runs;
:func:`split_pipeline_stages` tags ``node.meta[PIPELINE_STAGE]`` and carves the stage programs.

What a stage program looks like (stage ``s`` of ``n``)::

    def forward(self, <recv'd boundary tensors and graph inputs and sizes, in StageIO order>):
        get_attr <each parameter the stage reads, under its ORIGINAL name>
        sym_size.int(<a boundary tensor>, d)      # sizes rebuilt locally, never sent
        ... the stage's nodes, copied with their meta ...
        return (<boundary tensors sent on, graph outputs>,)   # always a tuple

Design choices (each recorded in :class:`PipelineSplit` so a runtime can follow it):

* **Skip connections** (a tensor used more than one stage after the one that made it) are by
  default *relayed*: it is an output of its producer and an input and output of every stage
  in between, so every send is between neighbouring stages ``s -> s + 1`` (with interleaving,
  rank ``s % pp`` to the next rank in the ring), which is what GPipe/1F1B runtimes schedule.
  In backward a relaying stage passes the gradient through (its output *is* its input).
  ``skip="direct"`` instead sends it once from producer to every consumer stage (fewer bytes,
  non-neighbour p2p). ``PipelineSplit.skip`` records the choice.
* **Sizes** (``sym_size`` and other SymInt nodes) never cross a boundary as tensors. A stage
  that needs a size made elsewhere rebuilds it with ``sym_size.int`` from one of its input
  tensors that has a dim equal to it (the hidden state carries batch and seq); a concrete size
  is inlined as an int; failing both, it becomes a ``size`` input (``StageInput.value`` is its
  expression in the named dims), which the runtime evaluates from the micro-batch's dims.
* **Graph inputs** (token ids, targets) are not relayed: each stage that reads one takes it as
  a graph input (``StageInput.source is None``) fed by the runtime's data loader.
* **Parameters** are never boundary tensors. Each stage holds the parameters it reads under
  their original names. A parameter read on several stages (tied embeddings: ``wte.weight`` on
  stage 0 and ``lm_head.weight`` on the last) gets its own copy per stage, and
  ``PipelineSplit.tied`` names the stages whose gradients the runtime must all-reduce.
  Parameters read on one stage only are shared with the original module, not copied.
* **Multi-output nodes** (``split``): their ``getitem`` nodes always run on the producer's
  stage, so only single tensors cross.

Virtual stages: ``n_stages = pp * v`` stages; stage ``s`` runs on rank ``s % pp`` as chunk
``s // pp`` (Megatron interleaving), see :func:`stage_rank_chunk`.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import sympy
import torch
from torch import fx, nn

from passes.ir.errors import PassError
from passes.ir.meta import module_path
from passes.ir.meta import (
    BLOCK, LAYER_CHAIN, PIPELINE_STAGE, SHAPE, LayerChain, PipelineSplit, StageAssignment, StageInput, StageIO, StageOutput,
    TensorMeta,
)

SKIP_POLICIES = ("relay", "direct")
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


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
        if node.op not in _COMPUTE_OPS or (_reads_only_placeholders(node, memo) and not _is_size(node)):
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
      flattened targets) on the earliest stage that uses it, so it is never sent;
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
        if node.op not in _COMPUTE_OPS:
            continue
        if node.name in given:
            current = stage[node.name] = given[node.name]
        elif _reads_only_placeholders(node, only_inputs) and not _is_size(node):
            # Sizes stay early: later stages rebuild them from their own inputs, whereas a
            # size placed late would make that stage read the graph input it is taken from.
            deferred.append(node)
        elif _is_tuple_getitem(node):
            stage[node.name] = stage[node.args[0].name]
        else:
            inputs = [stage[a.name] for a in _compute_inputs(node) if a.name in stage]
            current = stage[node.name] = max([current, *inputs])
    for node in reversed(deferred):
        users = [stage[u.name] for u in node.users if u.name in stage]
        stage[node.name] = min(users, default=0)
    # A multi-output node's getitems run where it does, so only single tensors cross stages.
    for node in gm.graph.nodes:
        if node.op in _COMPUTE_OPS and _is_tuple_getitem(node):
            stage[node.name] = stage[node.args[0].name]
    order = _order(gm)
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
        if node.op not in _COMPUTE_OPS:
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


# --------------------------------------------------------------------------------------------
# Mechanism: the split
# --------------------------------------------------------------------------------------------
def tag_pipeline_stages(gm: fx.GraphModule, assignment: StageAssignment) -> fx.GraphModule:
    """Write ``node.meta[PIPELINE_STAGE]`` (int) on every node (the output: the last stage)."""
    for node in gm.graph.nodes:
        node.meta[PIPELINE_STAGE] = assignment.stage_of.get(node.name, assignment.n_stages - 1)
    return gm


def split_pipeline_stages(gm: fx.GraphModule, assignment: StageAssignment | Mapping[str | fx.Node, int], *,
                          skip: str = "relay") -> PipelineSplit:
    """One GraphModule per stage, with its send/recv list; tags the original graph's nodes.

    ``gm`` must carry ``node.meta[SHAPE]`` (run ``annotate_shapes``): boundary tensors take
    their static (possibly symbolic) shape and dtype from it. ``skip`` is ``"relay"`` (default:
    skip connections hop through every stage in between) or ``"direct"`` (sent from producer to
    each consumer stage). The original graph is not changed apart from the tags.
    """
    if skip not in SKIP_POLICIES:
        raise PassError(f"pipeline_split: skip={skip!r}; use one of {SKIP_POLICIES}")
    if not isinstance(assignment, StageAssignment):
        assignment = assign_stages(gm, assignment)
    validate_assignment(gm, assignment)
    tag_pipeline_stages(gm, assignment)
    n = assignment.n_stages
    stage_of = assignment.stage_of
    order = _order(gm)
    output_node = next(node for node in gm.graph.nodes if node.op == "output")

    # Which values each stage reads, split by kind.
    computed: list[list[fx.Node]] = [[] for _ in range(n)]
    reads: list[set[fx.Node]] = [set() for _ in range(n)]
    for node in gm.graph.nodes:
        if node.op in _COMPUTE_OPS:
            s = stage_of[node.name]
            computed[s].append(node)
            reads[s].update(node.all_input_nodes)
    consumers: dict[fx.Node, set[int]] = {}  # boundary tensor -> later stages that read it
    sizes: list[set[fx.Node]] = [set() for _ in range(n)]  # remote size values per stage
    for s in range(n):
        for a in reads[s]:
            if a.op not in _COMPUTE_OPS or stage_of[a.name] == s:
                continue
            if _is_size(a):
                sizes[s].add(a)
            else:
                _tensor_meta(a)  # raises unless it is one tensor
                consumers.setdefault(a, set()).add(s)

    results = output_node.args[0]
    graph_outputs = list(results) if isinstance(results, (tuple, list)) else [results]
    for i, out in enumerate(graph_outputs):
        if not isinstance(out, fx.Node) or out.op not in _COMPUTE_OPS:
            raise PassError(f"pipeline_split: graph output {i} ({out}) is not computed by the graph; "
                            f"only computed outputs (the loss) are supported")

    # Send/recv lists: inputs[s] / outputs[s] as node -> source / destinations.
    recv: list[dict[fx.Node, int]] = [{} for _ in range(n)]
    send: list[dict[fx.Node, list[int]]] = [{} for _ in range(n)]
    for a, users in consumers.items():
        t = stage_of[a.name]
        if skip == "direct":
            send[t][a] = sorted(users)
            for s in users:
                recv[s][a] = t
        else:
            for s in range(t + 1, max(users) + 1):
                recv[s][a] = s - 1
                send[s - 1][a] = [s]

    modules, ios = [], []
    tensors = _attr_owners(gm)
    holders: dict[int, set[int]] = {}  # id(parameter) -> stages that read it
    for s in range(n):
        for a in reads[s]:
            if a.op == "get_attr":
                holders.setdefault(id(_fetch_attr(gm, a.target)), set()).add(s)
    for s in range(n):
        module, io = _build_stage(gm, s, computed[s], reads[s], recv[s], send[s], sizes[s], graph_outputs,
                                  stage_of, order, holders, tensors)
        modules.append(module)
        ios.append(io)

    tied, aliases = {}, {}
    for pid, stages in holders.items():
        names = tensors[pid]
        if len(stages) > 1 and isinstance(_fetch_attr(gm, names[0]), nn.Parameter):
            tied[names[0]] = tuple(sorted(stages))
            aliases[names[0]] = tuple(names)
    return PipelineSplit(assignment=assignment, modules=tuple(modules), io=tuple(ios), tied=tied,
                         aliases=aliases, skip=skip)


def _build_stage(gm, s, nodes, reads, recv, send, sizes, graph_outputs, stage_of, order, holders, aliases):
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    inputs: list[StageInput] = []

    # Received tensors first (as a pipeline runtime passes activations), then graph inputs.
    placeholders = (sorted(recv, key=order.__getitem__)
                    + sorted((a for a in reads if a.op == "placeholder"), key=order.__getitem__))
    # Remote sizes: inlined when concrete, else rebuilt from an input tensor's dim, else an input.
    rebuilt: dict[fx.Node, tuple[fx.Node, int]] = {}
    size_inputs: list[fx.Node] = []
    for a in sorted(sizes, key=order.__getitem__):
        value = a.meta[SHAPE].value
        if value.is_Integer:
            env[a] = int(value)
        elif (found := _find_dim(placeholders, value)) is not None:
            rebuilt[a] = found
        else:
            size_inputs.append(a)

    for a in placeholders:
        ph = graph.placeholder(a.name)
        ph.meta = dict(a.meta)
        env[a] = ph
        inputs.append(StageInput(name=a.name, source=recv.get(a), meta=_tensor_meta(a)))
    for a in size_inputs:
        ph = graph.placeholder(a.name)
        ph.meta[SHAPE] = a.meta[SHAPE]
        env[a] = ph
        inputs.append(StageInput(name=a.name, source=None, meta=None, value=a.meta[SHAPE].value))

    root = nn.Module()
    copies: dict[int, torch.Tensor] = {}  # id(original tensor) -> this stage's copy
    for a in sorted((a for a in reads if a.op == "get_attr"), key=order.__getitem__):
        orig = _fetch_attr(gm, a.target)
        if len(holders.get(id(orig), ())) > 1:
            # Read on several stages (tied): each stage trains its own copy; ties inside one
            # stage stay ties because every alias on this stage gets the same copy.
            if id(orig) not in copies:
                clone = orig.detach().clone()
                copies[id(orig)] = nn.Parameter(clone, orig.requires_grad) if isinstance(orig, nn.Parameter) else clone
            orig = copies[id(orig)]
        target = _stage_alias(a, nodes, aliases.get(id(_fetch_attr(gm, a.target)), [a.target]))
        _install(root, target, orig)
        env[a] = graph.get_attr(target)
        env[a].meta = dict(a.meta)
    for a, (tensor, d) in rebuilt.items():
        node = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], d), name=a.name)
        node.meta[SHAPE] = a.meta[SHAPE]
        env[a] = node

    for node in nodes:
        env[node] = graph.node_copy(node, lambda x: env[x])

    outputs: list[StageOutput] = []
    result = []
    for a in sorted(send, key=order.__getitem__):
        outputs.append(StageOutput(name=a.name, meta=_tensor_meta(a), dests=tuple(send[a])))
        result.append(env[a])
    for i, out in enumerate(graph_outputs):
        if stage_of[out.name] == s:
            outputs.append(StageOutput(name=out.name, meta=_tensor_meta(out), dests=(), graph_output=i))
            result.append(env[out])
    graph.output(tuple(result))
    graph.lint()
    module = fx.GraphModule(root, graph, class_name=f"PipelineStage{s}")
    module.meta[PIPELINE_STAGE] = s
    return module, StageIO(stage=s, inputs=tuple(inputs), outputs=tuple(outputs))


# --------------------------------------------------------------------------------------------
def _compute_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op in _COMPUTE_OPS]


def _reads_only_placeholders(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """True if the node depends on graph inputs only: no parameter, no computed activation."""
    if node not in memo:
        memo[node] = all(a.op == "placeholder" or (a.op in _COMPUTE_OPS and _reads_only_placeholders(a, memo))
                         for a in node.all_input_nodes)
    return memo[node]


def _is_tuple_getitem(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].op in _COMPUTE_OPS)


def _is_size(node: fx.Node) -> bool:
    """A node producing an int or SymInt (``sym_size``), from shapes or from export's value."""
    meta = node.meta.get(SHAPE)
    if meta is not None:
        return meta.value is not None
    return isinstance(node.meta.get("val"), (int, torch.SymInt)) and not isinstance(node.meta.get("val"), bool)


def _tensor_meta(node: fx.Node) -> TensorMeta:
    meta = node.meta.get(SHAPE)
    if meta is None:
        raise PassError(f"pipeline_split: node {node.name!r} has no node.meta['{SHAPE}']; run annotate_shapes "
                        f"before splitting")
    if len(meta.tensors) != 1:
        raise PassError(f"pipeline_split: node {node.name!r} crosses a stage boundary but produces "
                        f"{len(meta.tensors)} tensors; only single tensors and sizes can cross (keep it and "
                        f"its users on one stage)")
    return meta.tensors[0]


def _find_dim(candidates: Sequence[fx.Node], value: sympy.Expr) -> tuple[fx.Node, int] | None:
    for node in candidates:
        meta = node.meta.get(SHAPE)
        if meta is None or len(meta.tensors) != 1:
            continue
        for d, size in enumerate(meta.tensors[0].shape):
            if sympy.expand(size - value) == 0:
                return node, d
    return None


def _order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(gm.graph.nodes)}


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attr_owners(gm: fx.GraphModule) -> dict[int, list[str]]:
    """id(tensor) -> every name it has in ``gm`` (tied parameters have several), first first."""
    owners: dict[int, list[str]] = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        owners.setdefault(id(t), []).append(name)
    for node in gm.graph.nodes:  # plain tensor constants that are neither
        if node.op == "get_attr":
            owners.setdefault(id(_fetch_attr(gm, node.target)), [node.target])
    return owners


def _stage_alias(attr: fx.Node, stage_nodes: Sequence[fx.Node], names: Sequence[str]) -> str:
    """The name a stage reads a (possibly tied) tensor under.

    torch.export keeps one ``get_attr`` for a tied parameter (``lm_head.weight`` for both the
    token embedding and the LM head); a stage whose users of it all sit in the module owning
    another alias (the embedding, in ``wte``) reads it under that alias (``wte.weight``).
    """
    if len(names) < 2:
        return attr.target
    here = set(stage_nodes)
    paths = {module_path(u) for u in attr.users if u in here}
    owners = {n for n in names for p in paths if p == n.rpartition(".")[0] or p.startswith(n.rpartition(".")[0] + ".")}
    return owners.pop() if len(owners) == 1 else attr.target


def _install(root: nn.Module, target: str, tensor: torch.Tensor) -> None:
    *path, field = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(field, tensor)
    else:
        module.register_buffer(field, tensor)
