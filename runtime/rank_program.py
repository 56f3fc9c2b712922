"""The program of ONE rank of a dp x tp x pp plan: its stage modules, tp-sharded and rewritten
for checkpointing / offload, and every communication it takes part in, built from the captured
graph without running (or even knowing) the other ranks.

Order of the passes, and why::

    whole graph:  tag_tensor_parallel  (decides column/row/vocab per node, one sharding per param)
                  [annotate_flops -> checkpoint_policy | offload_policy]   (tags only, by node name)
                  split_pipeline_stages (layer-balanced; node names and meta are copied per stage)
    per stage:    apply_tensor_parallel(rank=tp_index)   (this tp rank's shards, tp collectives)
                  apply_offload | apply_checkpoint        (on the rewritten stage)

* Tagging TP on the whole graph sees every use of a parameter (the tied embedding / LM head,
  which end up on the first and last stage) and so gives both copies the same sharding; tags
  travel with the nodes into the stages. Boundary tensors between layers are replicated (a
  shard never crosses a layer norm), so StageIO contracts are those of the unsharded split.
* Splitting *before* the TP rewrite keeps ``find_layers`` and the split's shapes intact: the
  rewrite drops SHAPE meta (it described the unsharded graph) and inserts nodes without module
  paths, both of which the split needs.
* Checkpointing is decided on the whole graph (its fake run needs the graph's own inputs) and
  applied per stage, after the TP rewrite, so the checkpointed regions contain the tp
  collectives (recomputed in backward, in the same order on every tp rank) instead of hiding
  nodes from the rewrite. A region is widened to the nodes the rewrite inserted inside it.
  Regions are whole blocks, and stages are cut at block boundaries, so no region spans stages.
* Offload: the policy runs on the whole graph; ``apply_offload`` runs per stage on a stage
  whose capture info lists its own inputs (received tensors and graph inputs).

Rank layout is :class:`runtime.mesh.Mesh`'s: ``rank = first + pp*(dp*tp) + dp*tp + tp`` (tp fastest).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import sympy
import torch
from torch import fx

import runtime.tp_collectives  # noqa: F401  (registers torch.ops.partitioner.*)
from partitioner.errors import ConfigError
from passes.meta import (CAPTURE, CHECKPOINT_PLAN, OFFLOAD_PLAN, PIPELINE_STAGE, TENSOR_PARALLEL_PLAN,
                         InputSpec, PipelineSplit, StageIO, TensorParallelPlan, dim_symbol)
from passes.pipeline_split import assign_stages_by_layers, balanced_boundaries, find_layers, split_pipeline_stages

CHECKPOINTING = ("none", "full", "selective")
OFFLOAD = ("none", "activations", "auto")
_TP_OPS = ("copy_to_tp", "reduce_from_tp", "vocab_parallel_cross_entropy", "reduce_scatter_seq", "all_gather_seq",
           "scatter_to_seq", "gather_from_seq")


@dataclass(frozen=True)
class Comm:
    """One communication of a rank program.

    ``kind``: ``"send"``/``"recv"`` (pipeline P2P of ``tensors`` between ``stage`` and
    ``peer_stage``, the peer being global rank ``ranks[0]``), ``"tp"`` (a tp collective of the
    stage's graph: ``op`` is the op name, ``node`` the graph node), ``"dp_all_reduce"`` (the
    gradient average) or ``"tied_all_reduce"`` (the gradient sum of a tied weight's copies,
    ``tensors`` its aliases). ``ranks``: the global ranks involved, this rank included for
    collectives; ``group``: the registered tp group name for ``"tp"``.
    """

    kind: str
    ranks: tuple[int, ...]
    stage: int | None = None
    peer_stage: int | None = None
    tensors: tuple[str, ...] = ()
    op: str = ""
    node: str = ""
    group: str = ""


@dataclass(frozen=True)
class RankProgram:
    """What rank ``rank`` runs (see the module docstring).

    ``modules[s]``: the program of each stage this rank holds (global stage index); parameters
    under their original names, sharded ones as this tp rank's slices. ``io``: every stage's
    contract (the executor needs its neighbours'). ``split``: the unsharded split (for the
    tied-weight records and, in tests, reference parameters). ``tp_plan``: how each parameter
    is sharded. ``comms``: every communication this rank takes part in.
    """

    rank: int
    dp: int
    tp: int
    pp: int
    virtual_pp: int
    pp_index: int
    dp_index: int
    tp_index: int
    stages: tuple[int, ...]
    modules: Mapping[int, fx.GraphModule] = field(repr=False)
    io: tuple[StageIO, ...] = field(repr=False)
    split: PipelineSplit = field(repr=False)
    tp_plan: TensorParallelPlan | None = field(repr=False)
    tp_group: str
    comms: tuple[Comm, ...] = field(repr=False)
    checkpointing: str = "none"
    offload: str = "none"
    sp_grad_params: tuple[str, ...] = ()  # sequence parallelism: replicated params whose grads sum over tp

    def comms_of(self, kind: str) -> list[Comm]:
        return [c for c in self.comms if c.kind == kind]


def global_rank(pp_index: int, dp_index: int, tp_index: int, *, dp: int, tp: int, first: int = 0) -> int:
    """Global rank at mesh coordinates (tp fastest, then dp, then pp), as :class:`runtime.mesh.Mesh`."""
    return first + pp_index * dp * tp + dp_index * tp + tp_index


def build_rank_program(gm: fx.GraphModule, *, dp: int, tp: int, pp: int, virtual_pp: int = 1, rank: int,
                       first: int = 0, checkpointing: str = "none", offload: str = "none",
                       tp_group: str = "tp", sequence_parallel: bool = False,
                       stage_boundaries: Sequence[int] | None = None) -> RankProgram:
    """Rank ``rank``'s program of a dp x tp x pp plan over the captured training step ``gm``.

    ``gm`` (from ``capture_for_pipeline``: shapes annotated) is deep-copied, never changed.
    ``rank`` is global; the mesh spans ``first .. first + dp*tp*pp - 1``. ``checkpointing``:
    one of :data:`CHECKPOINTING`; ``offload``: ``"activations"`` (every kept activation),
    ``"auto"`` (those whose transfer hides behind compute) or ``"none"``. ``tp_group``: the name
    under which the caller registers this rank's tp process group in
    :mod:`runtime.tp_collectives` (the stage programs' collectives look it up at run time).
    ``stage_boundaries``: the layer (block) index where each of the virtual stages
    ``1 .. pp*virtual_pp - 1`` starts (a plan's stage split); default: layer counts balanced.
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("virtual_pp", virtual_pp)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"rank_program: {name} must be an int >= 1, got {value!r}")
    if checkpointing not in CHECKPOINTING:
        raise ConfigError(f"rank_program: checkpointing={checkpointing!r}; use one of {CHECKPOINTING}")
    if offload not in OFFLOAD:
        raise ConfigError(f"rank_program: offload={offload!r}; use one of {OFFLOAD}")
    size = dp * tp * pp
    if not first <= rank < first + size:
        raise ConfigError(f"rank_program: rank {rank} is outside the mesh ranks {first}..{first + size - 1}")
    pp_index, rest = divmod(rank - first, dp * tp)
    dp_index, tp_index = divmod(rest, tp)

    gm = copy.deepcopy(gm)
    if tp > 1:
        from passes.tensor_parallel_patterns import tag_tensor_parallel
        tag_tensor_parallel(gm, degree=tp)
    if checkpointing != "none" or offload != "none":
        from passes.annotate_flops import annotate_flops
        annotate_flops(gm)
    if checkpointing != "none":
        from passes.checkpoint_policy import checkpoint_policy
        checkpoint_policy(gm, policy=checkpointing)
    # With checkpointing, offload is chosen on each stage after its regions are rewritten: what
    # is left to move is what the regions keep (their inputs) and what runs outside them.
    offload_policy_name = "all" if offload == "activations" else "auto"
    if offload != "none" and checkpointing == "none":
        from passes.offload_policy import offload_policy
        offload_policy(gm, policy=offload_policy_name, optimizer_on_host=False)

    n_stages = pp * virtual_pp
    n_layers = len(find_layers(gm))
    if n_stages > max(n_layers, 1):
        raise ConfigError(f"rank_program: pp * virtual_pp = {n_stages} stages but the model has {n_layers} "
                          f"layers; use at most {n_layers} stages")
    if stage_boundaries is not None:
        boundaries = tuple(int(b) for b in stage_boundaries)
        if len(boundaries) != n_stages - 1:
            raise ConfigError(f"rank_program: {len(boundaries)} stage boundaries given for {n_stages} stages "
                              f"(pp * virtual_pp); give {n_stages - 1} layer indexes, or none to balance layers")
    else:
        boundaries = balanced_boundaries(n_layers, n_stages) if n_stages > 1 else ()
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, boundaries))
    stage_of = {n.name: n.meta.get(PIPELINE_STAGE) for n in gm.graph.nodes}
    mine = tuple(s for s in range(n_stages) if s % pp == pp_index)
    tp_plan = gm.meta.get(TENSOR_PARALLEL_PLAN)

    modules: dict[int, fx.GraphModule] = {}
    sp_grads: set[str] = set()
    for s in mine:
        stage = split.modules[s]
        stage.meta[CAPTURE] = _stage_capture(gm, split.io[s])
        if tp > 1:
            from passes.apply_tensor_parallel import apply_tensor_parallel
            stage.meta[TENSOR_PARALLEL_PLAN] = tp_plan
            stage = apply_tensor_parallel(stage, rank=tp_index, group=tp_group, sequence_parallel=sequence_parallel)
            sp_grads.update(stage.meta[TENSOR_PARALLEL_PLAN].sequence_parallel_grads)
            stage.meta[CAPTURE] = _stage_capture(gm, split.io[s])
        if offload != "none" and checkpointing == "none":
            from passes.apply_offload import apply_offload
            stage.meta[OFFLOAD_PLAN] = gm.meta[OFFLOAD_PLAN]
            apply_offload(stage)
        if checkpointing != "none":
            from passes.apply_checkpoint import apply_checkpoint
            stage.meta[CHECKPOINT_PLAN] = _stage_checkpoint_plan(gm, stage, s, stage_of)
            if offload != "none" and tp > 1:  # the tp rewrite dropped the shapes the offload policy reads
                from passes.annotate_shapes import annotate_shapes
                annotate_shapes(stage)
            apply_checkpoint(stage)
            if offload != "none":
                stage = _offload_checkpointed(stage, offload_policy_name)
        stage.meta[PIPELINE_STAGE] = s
        modules[s] = stage

    comms = _comms(split, modules, mine, pp=pp, dp=dp, tp=tp, pp_index=pp_index, dp_index=dp_index,
                   tp_index=tp_index, first=first, tp_group=tp_group)
    return RankProgram(rank=rank, dp=dp, tp=tp, pp=pp, virtual_pp=virtual_pp, pp_index=pp_index,
                       dp_index=dp_index, tp_index=tp_index, stages=mine, modules=modules, io=split.io,
                       split=split, tp_plan=tp_plan, tp_group=tp_group, comms=tuple(comms),
                       checkpointing=checkpointing, offload=offload, sp_grad_params=tuple(sorted(sp_grads)))


# --------------------------------------------------------------------------------------------
def _offload_checkpointed(stage: fx.GraphModule, policy: str) -> fx.GraphModule:
    """Offload on a checkpointed stage: a region's call saves its inputs for the recompute
    (``torch.utils.checkpoint`` saves them through autograd, outside its own hooks), so the
    bracket around the call moves exactly those to host; inside the region nothing is saved."""
    from passes.annotate_flops import annotate_flops
    from passes.annotate_shapes import annotate_shapes
    from passes.apply_offload import apply_offload
    from passes.offload_policy import offload_policy

    annotate_flops(annotate_shapes(stage))
    offload_policy(stage, policy=policy, optimizer_on_host=False)
    return apply_offload(stage)


def _stage_capture(gm: fx.GraphModule, io: StageIO):
    """The whole graph's CaptureInfo with the stage's own tensor inputs, so fake runs of the
    stage (apply_offload's observation of saved tensors) feed it what the runtime does."""
    info = gm.meta[CAPTURE]
    by_name = {i.name: i for i in info.inputs}
    names = {dim_symbol(n): n for n, _ in info.dims}
    inputs = []
    for inp in io.inputs:
        if inp.kind == "size":
            continue  # not a tensor: fake runs of such a stage are not supported (offload says so)
        if inp.kind == "graph_input":
            inputs.append(by_name[inp.name])
            continue
        shape = []
        for d in inp.meta.shape:
            d = sympy.sympify(d)
            shape.append(int(d) if d.is_Integer else names.get(d, str(d)))
        inputs.append(InputSpec(name=inp.name, shape=tuple(shape), dtype=inp.meta.dtype))
    return dataclasses.replace(info, inputs=tuple(inputs))


def _stage_checkpoint_plan(gm: fx.GraphModule, stage: fx.GraphModule, s: int, stage_of: dict):
    """The whole graph's checkpoint plan restricted to the regions of stage ``s``, each widened
    to the nodes a later rewrite (tensor parallelism) inserted between its first and last node."""
    plan = gm.meta[CHECKPOINT_PLAN]
    original = set(stage_of)
    order = [n for n in stage.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    index = {n.name: i for i, n in enumerate(order)}
    regions = []
    for region in plan.regions:
        names = [n for n in region.nodes if stage_of.get(n) == s and n in index]
        if not names or not region.recompute:
            continue
        lo, hi = min(index[n] for n in names), max(index[n] for n in names)
        keep = set(names)
        nodes = [n.name for n in order[lo:hi + 1] if n.name in keep or n.name not in original]
        # inserted nodes right after the region that only read it (reduce_from_tp + bias after a
        # row-parallel linear closing the region)
        inside = set(nodes)
        for n in order[hi + 1:]:
            if n.name in original or not all(a.name in inside or a.op == "get_attr" for a in n.all_input_nodes):
                break
            nodes.append(n.name)
            inside.add(n.name)
        regions.append(dataclasses.replace(region, nodes=tuple(nodes)))
    return dataclasses.replace(plan, regions=tuple(regions))


def _comms(split, modules, mine, *, pp, dp, tp, pp_index, dp_index, tp_index, first, tp_group) -> list[Comm]:
    def rank_of(p, d=dp_index, t=tp_index):
        return global_rank(p, d, t, dp=dp, tp=tp, first=first)

    out: list[Comm] = []
    for s in mine:
        io = split.io[s]
        recv: dict[int, list[str]] = {}
        for inp in io.inputs:
            if inp.kind == "recv":
                recv.setdefault(inp.source, []).append(inp.name)
        for src, names in sorted(recv.items()):
            if src % pp != pp_index:  # a neighbour on this rank hands over in memory
                out.append(Comm("recv", (rank_of(src % pp),), stage=s, peer_stage=src, tensors=tuple(names)))
        sends: dict[int, list[str]] = {}
        for o in io.outputs:
            for d in o.dests:
                sends.setdefault(d, []).append(o.name)
        for dst, names in sorted(sends.items()):
            if dst % pp != pp_index:
                out.append(Comm("send", (rank_of(dst % pp),), stage=s, peer_stage=dst, tensors=tuple(names)))
        tp_ranks = tuple(rank_of(pp_index, dp_index, t) for t in range(tp))
        # the stage's graph and its checkpointed regions' (collectives recomputed there too)
        for sub in modules[s].modules():
            if not isinstance(sub, fx.GraphModule):
                continue
            for node in sub.graph.nodes:
                op = getattr(node.target, "_opname", None) if node.op == "call_function" else None
                if getattr(node.target, "namespace", None) == "partitioner" and op in _TP_OPS:
                    out.append(Comm("tp", tp_ranks, stage=s, op=op, node=node.name, group=tp_group))
    if dp > 1:
        out.append(Comm("dp_all_reduce", tuple(rank_of(pp_index, d) for d in range(dp))))
    for name in sorted(split.tied):
        holders = sorted({st % pp for st in split.tied[name]})
        if pp_index in holders and len(holders) > 1:
            out.append(Comm("tied_all_reduce", tuple(rank_of(h) for h in holders), tensors=split.aliases[name]))
    return out
