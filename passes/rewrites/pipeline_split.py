"""Transform: cut a captured training step into one ``fx.GraphModule`` per pipeline stage.

Policy and mechanism are separate: a :class:`StageAssignment` (made by
:mod:`passes.policies.pipeline_stages` from layer boundaries, the search's stage starts or an
explicit node -> stage mapping) says where each node runs; :func:`split_pipeline_stages` tags
``node.meta[PIPELINE_STAGE]`` and carves the stage programs.

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
  tensors that has a dim equal to it (the hidden state carries batch and seq), or a product of
  such dims (``batch * seq``) from theirs; a concrete size is inlined as an int; failing those,
  it becomes a ``size`` input (``StageInput.value`` is its
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
``s // pp`` (Megatron interleaving), see :func:`passes.policies.pipeline_stages.stage_rank_chunk`.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import sympy
import torch
from torch import fx, nn

from passes.ir.errors import PassError
from passes.ir.meta import module_path
from passes.ir.module_attrs import install
from passes.ir.graph_modules import graph_module
from passes.ir.meta import (
    PIPELINE_STAGE, SHAPE, PipelineSplit, StageAssignment, StageInput, StageIO, StageOutput, TensorMeta,
)
from passes.policies.pipeline_stages import (
    COMPUTE_OPS, assign_stages, is_size, node_order, tag_pipeline_stages, validate_assignment,
)

SKIP_POLICIES = ("relay", "direct")


# --------------------------------------------------------------------------------------------
# Mechanism: the split
# --------------------------------------------------------------------------------------------
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
    order = node_order(gm)
    output_node = next(node for node in gm.graph.nodes if node.op == "output")

    # Which values each stage reads, split by kind.
    computed: list[list[fx.Node]] = [[] for _ in range(n)]
    reads: list[set[fx.Node]] = [set() for _ in range(n)]
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            s = stage_of[node.name]
            computed[s].append(node)
            reads[s].update(node.all_input_nodes)
    consumers: dict[fx.Node, set[int]] = {}  # boundary tensor -> later stages that read it
    sizes: list[set[fx.Node]] = [set() for _ in range(n)]  # remote size values per stage
    for s in range(n):
        for a in reads[s]:
            if a.op not in COMPUTE_OPS or stage_of[a.name] == s:
                continue
            if is_size(a):
                sizes[s].add(a)
            else:
                _tensor_meta(a)  # raises unless it is one tensor
                consumers.setdefault(a, set()).add(s)

    results = output_node.args[0]
    graph_outputs = list(results) if isinstance(results, (tuple, list)) else [results]
    for i, out in enumerate(graph_outputs):
        if not isinstance(out, fx.Node) or out.op not in COMPUTE_OPS:
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
        elif (found := _find_dims(placeholders, value)) is not None:
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
        install(root, target, orig)
        env[a] = graph.get_attr(target)
        env[a].meta = dict(a.meta)
    sym_size = torch.ops.aten.sym_size.int
    for a, (coeff, dims) in rebuilt.items():  # an integer times dims, each read off its carrier
        carriers = [(env[t], d) for t, d in dims]
        if coeff == 1 and len(carriers) == 1:
            node = graph.call_function(sym_size, carriers[0], name=a.name)
        else:
            node = coeff if coeff != 1 else graph.call_function(sym_size, carriers.pop(0))
            for k, carrier in enumerate(carriers):
                node = graph.call_function(operator.mul, (node, graph.call_function(sym_size, carrier)),
                                           name=a.name if k == len(carriers) - 1 else None)
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
    module = graph_module(root, graph, class_name=f"PipelineStage{s}")
    module.meta[PIPELINE_STAGE] = s
    return module, StageIO(stage=s, inputs=tuple(inputs), outputs=tuple(outputs))


# --------------------------------------------------------------------------------------------
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


def _find_dims(candidates: Sequence[fx.Node], value: sympy.Expr) -> tuple[int, list[tuple[fx.Node, int]]] | None:
    """``value`` as an integer times named dims, each found on one of ``candidates``: one dim
    equal to it (the hidden state's seq), or a product of such dims (``batch * seq``):
    ``(coefficient, [(tensor, dim), ...])``; None when there is no such carrier."""
    found = _find_dim(candidates, value)
    if found is not None:
        return 1, [found]
    coeff, factors = sympy.expand(value).as_coeff_mul()
    dims = []
    for f in factors:
        base, exp = f.as_base_exp()
        if not (base.is_Symbol and exp.is_Integer and exp > 0) or (carrier := _find_dim(candidates, base)) is None:
            return None
        dims += [carrier] * int(exp)
    return (int(coeff), dims) if dims and coeff.is_Integer else None


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
