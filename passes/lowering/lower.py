"""The lowering: an analysed training step and a :class:`ParallelConfig` become rank programs.

One function, :func:`lower`, of named steps; it is what the dumps show and what the runtime
runs (there is no other)::

    whole graph   context_parallel      (cp > 1: every cp rank's program, sequence-sharded; shapes, FLOPs again)
                  tag_tensor_parallel   (tp > 1: column/row/vocab per node, one sharding per param)
                  checkpoint_policy     (checkpointing: which blocks recompute)
                  offload_policy        (activation offload without checkpointing)
                  tag_pipeline_stages   (the stage of every node, from the chain boundaries)
    split         split_pipeline_stages (one module per stage, with its I/O contract)
    per stage,    apply_tensor_parallel (this tp rank's shards and collectives)
    per tp rank   restrict_checkpoint_plan, apply_checkpoint (the stage's regions, outlined)
                  [annotate_shapes, annotate_flops, offload_policy]  (offload under checkpointing)
                  apply_offload         (begin/saver/end brackets, last)
                  annotate_shapes, annotate_flops, annotate_memory   (re-analysis of the program)
    assemble      RankProgram per global rank: its stages' programs, comms, schedule

Why this order (the rules are :data:`passes.lowering.pipelines.ORDER`, checked by every manager):
tagging on the whole graph sees every use of a parameter (the tied embedding and LM head end up
on the first and last stage) and gives both copies one sharding; splitting before the tp rewrite
keeps the shapes the split's contracts need; the checkpointed regions are outlined after the tp
rewrite so that they contain its collectives; offload brackets go in last.

``instrument_for(name)`` gives the :class:`passes.lowering.manager.Instrument` of each pipeline
(``"whole_graph"`` and ``"stage<s>_tp<r>"``), e.g. an IR dump writer; the runtime passes none.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import sympy
import torch
from torch import fx

from passes.ir.config import TORCH_DTYPES, ParallelConfig, dtype_name
from passes.ir.meta import CONTEXT_PARALLEL, EXPERT_PARALLEL, MOE_LAYERS
from passes.ir.module_attrs import install, remove
from passes.ir.graph_modules import copy_graph_module
from passes.ir.moe_ops import DATA_OPS, EP_OPS
from passes.ir.cp_ops import CP_OPS
from passes.ir.cost import CostHooks
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import (CAPTURE, CHECKPOINT_PLAN, LAYER_CHAIN, OFFLOAD_PLAN, PIPELINE_STAGE, REMAT, STAGE_IO,
                            TENSOR_PARALLEL_PLAN, TENSOR_REMAT,
                            InputSpec, PipelineSplit, StageAssignment, StageIO, dim_symbol)
from passes.ir.ops import TP_OPS, op_name
from passes.ir.program import Comm, RankProgram, TiedParam, global_rank, local_shape, mesh_coords
from passes.ir.schedule import build as build_schedule
from passes.ir.zero3_ops import shard_numel
from passes.lowering.manager import Instrument, PassContext, pipeline_text
from passes.policies.pipeline_stages import chain_starts
from passes.rewrites.pipeline_split import split_pipeline_stages
from passes.lowering.pipelines import cp_group, data_group, ep_group, manager, stage_passes, whole_graph_passes
from passes.rewrites.expert_parallel import check_expert_parallel
from passes.rewrites.sequence_parallel import sequence_size, shard_stage_io
from passes.analysis.weight_decay import no_weight_decay_names

# graph-level decisions of the whole graph that each stage program inherits
_INHERITED = (TENSOR_PARALLEL_PLAN, CHECKPOINT_PLAN, OFFLOAD_PLAN, LAYER_CHAIN, CONTEXT_PARALLEL)


@dataclass(frozen=True, kw_only=True)
class PipelineRecord:
    """One pipeline the lowering ran: its name (the dump subdirectory of a stage program) and text."""

    name: str
    text: str


@dataclass(kw_only=True)
class Lowering:
    """What :func:`lower` made: the tagged whole graph, the split, and the program of each
    (stage, tp rank) it was asked for. :meth:`rank_program` assembles one rank's share."""

    config: ParallelConfig
    graph: fx.GraphModule = field(repr=False)
    split: PipelineSplit = field(repr=False)
    programs: dict[tuple[int, int], fx.GraphModule] = field(repr=False)
    io: tuple[StageIO, ...] = field(repr=False)
    """Every stage's contract as a tp rank runs it (:func:`rank_io`)."""
    pipelines: tuple[PipelineRecord, ...] = ()
    tp_group: str = "tp"
    _made: dict = field(default_factory=dict, repr=False, compare=False)
    """What every rank program shares, made once (a 1,536-rank plan asks 1,536 times): the
    parameters without weight decay, the tied parameters, the canonical names, the collective
    nodes of each stage program, the groups along the data axis."""

    def rank_program(self, rank: int, *, first: int = 0) -> RankProgram:
        """The program of global ``rank`` (the mesh spans ``first .. first + world_size - 1``)."""
        c = self.config
        if not first <= rank < first + c.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh ranks {first}..{first + c.world_size - 1} of "
                              f"dp*tp*pp = {c.world_size}")
        pp_index, dp_index, tp_index = mesh_coords(rank, dp=c.dp_cp, tp=c.tp, first=first)
        mine = c.rank_stages(pp_index)
        missing = [s for s in mine if (s, tp_index) not in self.programs]
        if missing:
            raise ConfigError(f"rank {rank} runs stages {list(mine)} on tp rank {tp_index}, but the lowering made "
                              f"no program of stage(s) {missing} for it; lower with programs= that include them")
        modules = {s: self.programs[(s, tp_index)] for s in mine}
        ep_index = dp_index % c.ep
        experts: tuple[str, ...] = ()
        stacked: tuple[str, ...] = ()
        if c.ep > 1:
            plans = {s: m.meta[EXPERT_PARALLEL] for s, m in modules.items() if EXPERT_PARALLEL in m.meta}
            if ep_index:  # the program holds ep rank 0's experts in its slots: this rank holds others
                modules = {s: _with_experts(m, self.split.modules[s], plans[s].renames(ep_index),
                                            plans[s].slices(ep_index)) if s in plans
                           else m for s, m in modules.items()}
            experts = tuple(sorted({n for p in plans.values() for n in p.expert_params(ep_index)}))
            stacked = tuple(sorted({n for p in plans.values() for n in p.slices(ep_index)}))
        plan = self.graph.meta.get(TENSOR_PARALLEL_PLAN)
        cp_plan = self.graph.meta.get(CONTEXT_PARALLEL)
        sp_grads = sorted({g for m in modules.values() if TENSOR_PARALLEL_PLAN in m.meta
                           for g in m.meta[TENSOR_PARALLEL_PLAN].sequence_parallel_grads})
        info = self.graph.meta[CAPTURE]
        canonical, no_weight_decay, tied, actions = self._shared(plan)
        return RankProgram(
            rank=rank, first=first, config=c, pp_index=pp_index, dp_index=dp_index, tp_index=tp_index, stages=mine,
            modules=modules, io=self.io, tied=tied, canonical_names=canonical, tp_plan=plan,
            tp_group=self.tp_group, cp_plan=cp_plan,
            comms=tuple(_comms(self.split, modules, mine, c, pp_index, dp_index, tp_index, first, self.tp_group,
                               made=self._made, nodes_of=self._collective_nodes)),
            actions=actions[pp_index], inputs=info.inputs, sp_grad_params=tuple(sp_grads),
            no_weight_decay=no_weight_decay, expert_params=experts, stacked_experts=stacked,
            ep_group=ep_group(self.tp_group), data_group=data_group(self.tp_group))

    def _collective_nodes(self, module: fx.GraphModule) -> list[tuple[str, str, str]]:
        """:func:`_collective_nodes` of a program this lowering holds, made once (another module,
        e.g. a copy holding other experts, is read each time)."""
        held = self._made.setdefault("held", {})
        if len(held) != len(self.programs):
            held.clear()
            held.update({id(m): key for key, m in self.programs.items()})
        key = held.get(id(module))
        if key is None or self.programs[key] is not module:
            return _collective_nodes(module)
        if ("collective nodes", key) not in self._made:
            self._made[("collective nodes", key)] = _collective_nodes(module)
        return self._made[("collective nodes", key)]

    def _shared(self, plan):
        """(canonical names, names without weight decay, tied parameters, each pipeline rank's
        actions): the same for every rank program, made once."""
        if "shared" not in self._made:
            canonical = self.graph.meta[CAPTURE].canonical_names()
            for key, aliases in self.split.aliases.items():
                canon = canonical.get(key, key)
                canonical.update({a: canon for a in aliases})
            actions = {p: tuple(a) for p, a in self.schedule.items()}
            self._made["shared"] = (canonical, self._no_weight_decay(canonical), self._tied(plan), actions)
        return self._made["shared"]

    @functools.cached_property
    def schedule(self) -> dict:
        """Every pipeline rank's action list (built once: each rank program takes its own)."""
        c = self.config
        return build_schedule(c.schedule, c.pp, c.num_micro_batches, c.virtual_pp)

    def digest(self) -> str:
        """A hash of what every rank will run: the config and, for each (stage, tp rank) program
        lowered, the generated code of it and of its submodules (checkpointed regions), the
        nodes whose outputs a selective region keeps and each per-tensor decision's actions.
        Processes that lower the same programs of one plan must get the same string
        (:func:`passes.checks.communication_check.check_lowered_ranks` compares them)."""
        h = hashlib.sha256(repr(self.config).encode())
        for key in sorted(self.programs):
            h.update(repr(key).encode())
            for name, module in self.programs[key].named_modules():
                if isinstance(module, fx.GraphModule):
                    h.update(name.encode())
                    h.update(module.code.encode())
                    h.update(" ".join(n.name for n in module.graph.nodes
                                      if REMAT in n.meta and n.meta[REMAT].cached).encode())
                    h.update(" ".join(f"{n.name}:{n.meta[TENSOR_REMAT].action}" for n in module.graph.nodes
                                      if TENSOR_REMAT in n.meta).encode())
        return h.hexdigest()[:16]

    def _no_weight_decay(self, canonical: Mapping[str, str]) -> frozenset[str]:
        names = no_weight_decay_names(self.graph)
        canon = {canonical.get(n, n) for n in names}
        return frozenset(names | {a for a, c in canonical.items() if c in canon})

    def _tied(self, plan) -> dict[str, TiedParam]:
        out = {}
        for name, stages in sorted(self.split.tied.items()):
            module = self.split.modules[stages[0]]
            alias = next(a for a in self.split.aliases[name] if _has_param(module, a))
            full = module.get_parameter(alias)
            sharding = plan.params.get(name) if plan is not None else None
            shape = local_shape(full.shape, sharding, self.config.tp)
            if self.config.zero_stage == 3:  # every copy is its dp shard
                shape = (shard_numel(math.prod(shape), self.config.shard_degree),)
            out[name] = TiedParam(name=name, stages=tuple(stages), aliases=tuple(self.split.aliases[name]),
                                  local_shape=shape, dtype=full.dtype)
        return out


def lower(gm: fx.GraphModule, config: ParallelConfig, *, cost: CostHooks | None,
          programs: Iterable[tuple[int, int]] | None = None, tp_group: str = "tp",
          instrument_for: Callable[[str], Instrument | None] | None = None,
          ctx: PassContext | None = None) -> Lowering:
    """Lower the analysed training step ``gm`` (capture, then :func:`passes.lowering.pipelines.analysis_passes`)
    under ``config``; ``gm`` is deep-copied, never changed.

    ``cost``: the cost hooks of the cluster the plan is for (the offload policy needs them; None
    is refused when it does). ``programs``: the (stage, tp rank) programs to make (default:
    all; a rank of a job makes only its own). ``tp_group``: the name the programs' collectives
    look their tp group up by. ``ctx``: the optimizer and precision the re-analysis counts.
    Raises :class:`ConfigError` for a config the model cannot take, :class:`PassError` from passes.
    """
    for key in (CAPTURE, LAYER_CHAIN):
        if key not in gm.meta:
            raise PassError(f"lower: gm.meta has no {key!r}; capture the model and run the analysis passes "
                            f"(passes.lowering.pipelines.analysis_passes) first")
    ctx = ctx or PassContext(dtype=config.dtype)
    blocks = gm.meta[LAYER_CHAIN].n_blocks
    config.validate(blocks=blocks)
    captured = gm.meta[CAPTURE].dtype
    if captured != TORCH_DTYPES[config.dtype]:
        # the stage programs run in the dtype they were captured in: a bf16 plan needs a bf16 graph
        raise ConfigError(f"lower: the plan trains in {config.dtype} but the graph was captured in {captured}; "
                          f"capture the model cast to {config.dtype} (ModelSpec.cast, as auto_parallelize does with "
                          f"Training(dtype=...)) or plan with dtype={dtype_name(captured)}")
    if config.n_stages > 1 and blocks == 0:
        raise ConfigError("pp*virtual_pp > 1 needs repeated blocks to cut stages between, and the model has none "
                          "(no module path like 'blocks.0'); use pp=1")
    wanted = sorted(set(programs) if programs is not None else
                    {(s, t) for s in range(config.n_stages) for t in range(config.tp)})
    for s, t in wanted:
        if not (0 <= s < config.n_stages and 0 <= t < config.tp):
            raise ConfigError(f"lower: no program (stage {s}, tp rank {t}) in a plan of {config.n_stages} stages "
                              f"and tp={config.tp}")
    instrument_for = instrument_for or (lambda name: None)
    layers = gm.meta.get(MOE_LAYERS)
    moe = layers is not None and bool(layers.blocks)
    if config.ep > 1:
        check_expert_parallel(layers, config.ep)

    whole_passes = _whole_passes(gm, config, cost=cost, tp_group=tp_group)
    instrument = instrument_for("whole_graph")
    whole = manager(whole_passes, instrument=instrument)
    if instrument is None:
        gm = _whole_graph(gm, whole_passes, ctx)
    else:  # dumped pass by pass: run as one pipeline
        gm = whole.run(copy_graph_module(gm), ctx)
    records = [PipelineRecord(name="whole_graph", text=whole.text())]

    assignment = StageAssignment(n_stages=config.n_stages, stage_of={
        n.name: n.meta[PIPELINE_STAGE] for n in gm.graph.nodes if n.op != "output"})
    split = split_pipeline_stages(gm, assignment)
    io = rank_io(gm, split, config)
    made: dict[tuple[int, int], fx.GraphModule] = {}
    for s, t in wanted:
        stage = split.modules[s]
        if config.tp > 1 or config.zero_stage == 3 or config.ep > 1 or sum(1 for w in wanted if w[0] == s) > 1:
            # several programs start from one split module, ZeRO-3 replaces its parameters, or ep
            # drops the other ranks' experts (which their programs take from the split)
            stage = copy_graph_module(stage)
        stage.meta[CAPTURE] = stage_capture(gm, split.io[s])
        stage.meta[STAGE_IO] = split.io[s]
        stage.meta.update({k: gm.meta[k] for k in _INHERITED if k in gm.meta})
        if moe:  # the MoE blocks (by node name) for the ep rewrite and the aux-loss averages
            stage.meta[MOE_LAYERS] = layers
        name = f"stage{s}_tp{t}"
        grad_inputs = tuple(inp.name for inp in split.io[s].inputs if inp.kind == "recv" and inp.meta.requires_grad)
        pm = manager(stage_passes(config, stage=s, tp_rank=t, tp_group=tp_group, cost=cost, ctx=ctx,
                                  grad_inputs=grad_inputs, moe=moe),
                     instrument=instrument_for(name))
        made[(s, t)] = pm.run(stage, ctx)
        made[(s, t)].meta.pop(STAGE_IO, None)
        records.append(PipelineRecord(name=name, text=pm.text()))
    return Lowering(config=config, graph=gm, split=split, programs=made, pipelines=tuple(records), tp_group=tp_group,
                    io=io)


_PREFIX_MEMO: "weakref.WeakKeyDictionary[fx.GraphModule, dict]" = weakref.WeakKeyDictionary()
"""The last few whole-graph prefixes of each analysed graph: the context-parallel rewrite (its
shapes run symbolically), the checkpoint policy and the activation offload policy (each observes
the whole graph's saved tensors; the offload policy's key holds the cluster costs it reads) cost
far more than a copy, and the plans and rank programs that share them start from the same
graph (the planner's replay makes a plan's rank programs one by one; every rank of a job that
shares a process, as in the tests, lowers the same whole graph). A job's ranks share one: its first
rank makes it and the others take it (:func:`whole_graph_prefix`, :func:`remember_whole_graph_prefix`)."""
_PREFIX_PASSES = ("context_parallel", "annotate_shapes", "annotate_flops", "tag_tensor_parallel", "checkpoint_policy",
                  "offload_policy")
_COSTLY = ("context_parallel", "checkpoint_policy", "offload_policy")  # each runs the whole graph on fake tensors
_MEMO_ENTRIES = 4  # per analysed graph, the least recently used dropped


def _prefix_length(passes: list) -> int:
    """How many leading passes of ``passes`` make the remembered prefix (0: none costly, not remembered)."""
    n = 0
    while n < len(passes) and passes[n].name in _PREFIX_PASSES:
        n += 1
    return n if any(p.name in _COSTLY for p in passes[:n]) else 0


def _prefix_key(gm: fx.GraphModule, passes: list, ctx: PassContext) -> tuple:
    # what the prefix depends on: its passes and options, the context, and the graph as it is
    # now (its node count: a caller that edits the analysed graph in place gets a new prefix)
    return (tuple((p.name, p.options) for p in passes), dataclasses.astuple(ctx), len(gm.graph.nodes), id(gm.graph))


def _remember(gm: fx.GraphModule, key: tuple, prefix: fx.GraphModule) -> None:
    memo = _PREFIX_MEMO.setdefault(gm, {})
    memo.pop(key, None)
    while len(memo) >= _MEMO_ENTRIES:
        memo.pop(next(iter(memo)))
    memo[key] = prefix  # the most recently used last


def _whole_graph(gm: fx.GraphModule, passes: list, ctx: PassContext) -> fx.GraphModule:
    """``passes`` run on a copy of ``gm``, their leading rewrite and policy passes
    (:data:`_PREFIX_PASSES`) taken from :data:`_PREFIX_MEMO` when this graph went through the same
    ones before (the offload policy's options hold the cluster costs it reads); what follows (the
    stage tags) runs each time."""
    n = _prefix_length(passes)
    if not n:
        return manager(passes).run(copy_graph_module(gm), ctx)
    return manager(passes[n:]).run(copy_graph_module(_prefix(gm, passes[:n], ctx)), ctx)


def _prefix(gm: fx.GraphModule, passes: list, ctx: PassContext) -> fx.GraphModule:
    key = _prefix_key(gm, passes, ctx)
    memo = _PREFIX_MEMO.get(gm, {})
    if key in memo:
        prefix = memo[key]
    else:
        prefix = manager(passes).run(copy_graph_module(gm), ctx)
    _remember(gm, key, prefix)
    return prefix


def _whole_passes(gm: fx.GraphModule, config: ParallelConfig, *, cost: CostHooks | None, tp_group: str) -> list:
    """The whole-graph passes :func:`lower` runs for ``config`` (stages cut at the chain's starts)."""
    starts = chain_starts(gm.meta[LAYER_CHAIN].n_blocks, config.n_stages, config.stage_boundaries)
    return whole_graph_passes(config, cost=cost, starts=starts, tp_group=tp_group)


def _prefix_passes(gm: fx.GraphModule, config: ParallelConfig, *, cost: CostHooks | None,
                   tp_group: str) -> list:
    passes = _whole_passes(gm, config, cost=cost, tp_group=tp_group)
    return passes[:_prefix_length(passes)]


def whole_graph_prefix(gm: fx.GraphModule, config: ParallelConfig, *, cost: CostHooks | None,
                       tp_group: str = "tp", ctx: PassContext | None = None) -> fx.GraphModule | None:
    """The whole-graph prefix :func:`lower` of ``gm`` under ``config`` starts from (the
    context-parallel rewrite, tensor-parallel tags, checkpoint and offload policies: the costly part that
    every rank program of a plan shares), made or remembered in this process; None when the
    plan's lowering has no costly whole-graph pass. What one rank of a job makes and ships to the
    others (:func:`remember_whole_graph_prefix`). Do not change it: the memo holds it."""
    passes = _prefix_passes(gm, config, cost=cost, tp_group=tp_group)
    return _prefix(gm, passes, ctx or PassContext(dtype=config.dtype)) if passes else None


def remember_whole_graph_prefix(gm: fx.GraphModule, config: ParallelConfig, prefix: fx.GraphModule, *,
                                cost: CostHooks | None, tp_group: str = "tp", ctx: PassContext | None = None) -> None:
    """Take ``prefix`` (another process's :func:`whole_graph_prefix` of the same graph and
    config, rebuilt here) as this process's, so that :func:`lower` of ``gm`` under ``config``
    starts from it instead of running those passes again."""
    passes = _prefix_passes(gm, config, cost=cost, tp_group=tp_group)
    if not passes:
        raise PassError("remember_whole_graph_prefix: this plan's lowering has no whole-graph prefix to share")
    _remember(gm, _prefix_key(gm, passes, ctx or PassContext(dtype=config.dtype)), prefix)


def rank_io(gm: fx.GraphModule, split: PipelineSplit, config: ParallelConfig) -> tuple[StageIO, ...]:
    """Every stage's contract as a tp rank runs it: the split's, with the boundary tensors that
    sequence parallelism sends as each tp rank's chunk (:func:`passes.rewrites.sequence_parallel.shard_stage_io`)
    at the chunk's size."""
    if not (config.sequence_parallel and config.tp > 1):
        return split.io
    seq = sequence_size(gm, config.tp)
    return tuple(shard_stage_io(io, config.tp, seq) for io in split.io)


def programs_of(config: ParallelConfig, rank: int, *, first: int = 0) -> tuple[tuple[int, int], ...]:
    """The (stage, tp rank) programs global ``rank`` runs (the mesh spans ``first ..``)."""
    pp_index, _, tp_index = mesh_coords(rank, dp=config.dp_cp, tp=config.tp, first=first)
    return tuple((s, tp_index) for s in config.rank_stages(pp_index))


def pipeline_texts(lowering: Lowering) -> dict[str, str]:
    """Pipeline name -> its text (what a dump manifest records)."""
    return {r.name: r.text for r in lowering.pipelines}


# ---------------------------------------------------------------------------------------------
def stage_capture(gm: fx.GraphModule, io: StageIO):
    """The whole graph's CaptureInfo with the stage's own tensor inputs, so fake runs of the
    stage (re-analysis, apply_offload's observation of saved tensors) feed it what the runtime does."""
    info = gm.meta[CAPTURE]
    by_name = {i.name: i for i in info.inputs}
    names = {dim_symbol(n): n for n, _ in info.dims}
    inputs = []
    for inp in io.inputs:
        if inp.kind == "size":
            continue  # not a tensor: the fake run evaluates it from the dims
        if inp.kind == "graph_input":
            inputs.append(by_name[inp.name])
            continue
        shape = []
        for d in inp.meta.shape:
            d = sympy.sympify(d)
            shape.append(int(d) if d.is_Integer else names.get(d, str(d)))
        inputs.append(InputSpec(name=inp.name, shape=tuple(shape), dtype=inp.meta.dtype))
    return dataclasses.replace(info, inputs=tuple(inputs))


def _comms(split: PipelineSplit, modules: Mapping[int, fx.GraphModule], mine, c: ParallelConfig, pp_index: int,
           dp_index: int, tp_index: int, first: int, tp_group: str, *, made: dict | None = None,
           nodes_of: Callable[[fx.GraphModule], list[tuple[str, str, str]]] | None = None) -> list[Comm]:
    """``made``: a cache of the data axis' ranks the ranks of one lowering share; ``nodes_of``:
    :func:`_collective_nodes`, or a cached one."""
    dp, tp = c.dp_cp, c.tp  # the data axis: dp x cp ranks average gradients
    made = {} if made is None else made
    nodes_of = nodes_of or _collective_nodes

    def rank_of(p, d=dp_index, t=tp_index):
        return global_rank(p, d, t, dp=dp, tp=tp, first=first)

    data_key = ("data axis", first, pp_index, tp_index)
    if data_key not in made:
        made[data_key] = tuple(rank_of(pp_index, d) for d in range(dp))
    data_ranks = made[data_key]

    out: list[Comm] = []
    for s in mine:
        io = split.io[s]
        recv: dict[int, list[str]] = {}
        for inp in io.inputs:
            if inp.kind == "recv":
                recv.setdefault(inp.source, []).append(inp.name)
        for src, names in sorted(recv.items()):
            if c.stage_rank(src) != pp_index:  # a neighbour on this rank hands over in memory
                out.append(Comm("recv", (rank_of(c.stage_rank(src)),), stage=s, peer_stage=src, tensors=tuple(names)))
        sends: dict[int, list[str]] = {}
        for o in io.outputs:
            for d in o.dests:
                sends.setdefault(d, []).append(o.name)
        for dst, names in sorted(sends.items()):
            if c.stage_rank(dst) != pp_index:
                out.append(Comm("send", (rank_of(c.stage_rank(dst)),), stage=s, peer_stage=dst, tensors=tuple(names)))
        tp_ranks = tuple(rank_of(pp_index, dp_index, t) for t in range(tp))
        replica = dp_index - dp_index % c.cp
        cp_ranks = tuple(rank_of(pp_index, replica + j) for j in range(c.cp))
        ep_first = dp_index - dp_index % c.ep
        ep_ranks = tuple(rank_of(pp_index, ep_first + j) for j in range(c.ep))
        kinds = {"tp": (tp_ranks, tp_group), "cp": (cp_ranks, cp_group(tp_group)),
                 "ep": (ep_ranks, ep_group(tp_group)), "data": (data_ranks, data_group(tp_group))}
        for kind, op, name in nodes_of(modules[s]):
            ranks, group = kinds[kind]
            out.append(Comm(kind, ranks, stage=s, op=op, node=name, group=group))
    if dp > 1:
        out.append(Comm("dp_all_reduce", data_ranks))
    for name in sorted(split.tied):
        holders = sorted({c.stage_rank(st) for st in split.tied[name]})
        if pp_index in holders and len(holders) > 1:
            out.append(Comm("tied_all_reduce", tuple(rank_of(h) for h in holders), tensors=split.aliases[name]))
    return out


def _collective_nodes(module: fx.GraphModule) -> list[tuple[str, str, str]]:
    """(kind, op, node name) of each collective op of a stage program: its graph's and its
    checkpointed regions' (collectives recomputed there too); kind ``tp``, ``cp``, ``ep`` or ``data``."""
    out = []
    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            op = op_name(node.target) if node.op == "call_function" else None
            if op in TP_OPS:
                out.append(("tp", op, node.name))
            elif op in CP_OPS:
                out.append(("cp", op, node.name))
            elif op in EP_OPS:
                out.append(("ep", op, node.name))
            elif op in DATA_OPS:
                out.append(("data", op, node.name))
    return out


def _with_experts(program: fx.GraphModule, split: fx.GraphModule, renames: Mapping[str, str],
                  slices: Mapping[str, range]) -> fx.GraphModule:
    """A copy of stage ``program`` whose expert slots hold the experts ``renames`` names (slot
    parameter -> the expert's, under the model's name) and whose stacked expert weights hold the
    rows ``slices`` names, copied from the stage's ``split`` module, which holds every expert. A
    checkpointed region re-lists the parameters it reads: each module holding a slot holds the
    expert instead, one parameter object for all of them."""
    out = copy_graph_module(program)
    made: dict[str, torch.nn.Parameter] = {}
    for sub in out.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for name, rows in slices.items():
            if not _has_param(sub, name):
                continue
            if name not in made:
                source = split.get_parameter(name)
                made[name] = torch.nn.Parameter(source.detach()[rows.start:rows.stop].clone(),
                                                requires_grad=source.requires_grad)
            remove(sub, name)
            install(sub, name, made[name])
        for slot, name in renames.items():
            try:
                sub.get_parameter(slot)
            except AttributeError:
                continue
            if name not in made:
                source = split.get_parameter(name)
                made[name] = torch.nn.Parameter(source.detach().clone(), requires_grad=source.requires_grad)
            remove(sub, slot)
            install(sub, name, made[name])
        for node in sub.graph.nodes:
            if node.op == "get_attr" and node.target in renames:
                node.target = renames[node.target]
        sub.recompile()
    return out


def _has_param(module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


__all__ = ["Lowering", "PipelineRecord", "lower", "programs_of", "stage_capture", "pipeline_texts", "pipeline_text"]
