"""The pipelines of the compiler: which passes run, in which order, with which options.

Every pass is registered here once (:data:`REGISTRY`: its function, the meta it requires and
provides, the options it takes), and every pipeline is built from that registry, so a pipeline
prints as text and the text builds the same pipeline again (:func:`parse_pipeline`)::

    annotate_shapes,annotate_blocks,annotate_flops,annotate_memory{optimizer=adamw,dtype=fp32}

Three pipelines make the lowering (:func:`passes.lowering.lower.lower` runs them):

1. :func:`analysis_passes`: shapes, blocks, FLOPs, memory of the captured graph;
2. :func:`whole_graph_passes`: with context parallelism first its rewrite (the graph becomes
   every cp rank's program, sequence-sharded; its shapes and FLOPs are annotated again), then the *tag* passes a
   config asks for — tensor-parallel sharding, checkpoint regions, activation offload (without
   checkpointing), pipeline stages — which decide and write meta but leave the graph as it is;
3. :func:`stage_passes`: per (pipeline stage, tp rank), after the split: the *apply* passes that
   rewrite that stage's program (its tp shard, its checkpointed regions, its offload brackets;
   under ``checkpointing="tensor"`` its per-tensor decision, made on this program and run by
   its forward) and the re-analysis of the result.

Ordering rules are declared once, in :data:`ORDER`, and every manager built here checks them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import fx

from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_memory import annotate_memory
from passes.analysis.annotate_moe import annotate_moe
from passes.analysis.annotate_shapes import annotate_shapes
from passes.rewrites.apply_checkpoint import apply_checkpoint
from passes.rewrites.apply_offload import apply_offload
from passes.rewrites.apply_tensor_parallel import apply_tensor_parallel
from passes.rewrites.apply_tensor_remat import apply_tensor_remat
from passes.policies.checkpoint_policy import checkpoint_policy, restrict_checkpoint_plan
from passes.rewrites.context_parallel import apply_context_parallel
from passes.rewrites.expert_parallel import apply_expert_parallel
from passes.rewrites.moe_aux_loss import average_aux_loss
from passes.ir.meta import CONTEXT_PARALLEL
from passes.ir.config import ParallelConfig
from passes.ir.cost import CostHooks
from passes.ir.errors import PassError
from passes.ir.meta import (BLOCK, CAPTURE, CHECKPOINT, CHECKPOINT_PLAN, FLOP_SUMMARY, FLOPS, LAYER_CHAIN, MEMORY,
                            MEMORY_SUMMARY, OFFLOAD_PLAN, PIPELINE_STAGE, SHAPE, TENSOR_PARALLEL,
                            TENSOR_PARALLEL_PLAN, TENSOR_REMAT_PLAN)
from passes.ir.meta import EXPERT_PARALLEL, MOE, MOE_LAYERS, ZERO3_PLAN
from passes.lowering.manager import Pass, PassContext, PassManager, PassOrder, adapt
from passes.policies.offload_policy import offload_policy
from passes.policies.pipeline_stages import tag_pipeline_stages_by_chain
from passes.rewrites.shard_parameters import shard_parameters
from passes.capture.specialize_dims import specialize_dims
from passes.rewrites.split_backward import split_backward
from passes.policies.tensor_parallel_patterns import tag_tensor_parallel
from passes.policies.tensor_remat_policy import tensor_remat_policy

ORDER = (
    PassOrder(first="context_parallel", then="annotate_shapes",
              why="the rewrite drops the analysis of the uncut graph: the sequence-sharded program is analysed again"),
    PassOrder(first="context_parallel", then="checkpoint_policy",
              why="regions are chosen on the program that runs (sequence-sharded, with its cp attention)"),
    PassOrder(first="context_parallel", then="tag_pipeline_stages",
              why="stages are cut on the rewritten graph, so boundary tensors are sequence shards"),
    PassOrder(first="annotate_shapes", then="annotate_flops", why="FLOPs are counted from the shapes"),
    PassOrder(first="annotate_blocks", then="annotate_moe", why="an MoE block is looked for within one block of the chain"),
    PassOrder(first="annotate_moe", then="annotate_flops",
              why="experts' FLOPs are counted under routing from the MoE marks"),
    PassOrder(first="annotate_blocks", then="checkpoint_policy", why="checkpoint regions are the blocks"),
    PassOrder(first="annotate_blocks", then="tag_pipeline_stages", why="stages are cut along the layer chain"),
    PassOrder(first="annotate_flops", then="checkpoint_policy", why="recompute is costed in FLOPs"),
    PassOrder(first="checkpoint_policy", then="offload_policy",
              why="offload is decided after checkpointing (on a checkpointed graph it moves what the regions keep)"),
    PassOrder(first="apply_checkpoint", then="offload_policy",
              why="with checkpointing, offload is decided on the checkpointed stage"),
    PassOrder(first="apply_expert_parallel", then="apply_checkpoint",
              why="checkpointed regions contain the ep collectives, recomputed in the same order on every ep rank"),
    PassOrder(first="apply_expert_parallel", then="specialize_dims",
              why="the ep rewrite matches the experts on the split's shapes, before they are made concrete"),
    PassOrder(first="average_aux_loss", then="apply_checkpoint",
              why="checkpointed regions contain the data-axis averages, recomputed alike on every rank"),
    PassOrder(first="apply_tensor_parallel", then="apply_checkpoint",
              why="checkpointed regions contain the tp collectives, recomputed in the same order on every tp rank"),
    PassOrder(first="apply_tensor_parallel", then="apply_offload",
              why="offload brackets the savers of the sharded program"),
    PassOrder(first="apply_checkpoint", then="apply_offload",
              why="apply_offload runs last: its begin/saver/end triples must stay adjacent"),
    PassOrder(first="apply_checkpoint", then="split_backward",
              why="the aliases of a parameter read in a region and outside are placed in both graphs"),
    PassOrder(first="apply_checkpoint", then="shard_parameters",
              why="a checkpointed region gathers its block's parameters itself, so that its recompute gathers again"),
    PassOrder(first="apply_tensor_parallel", then="shard_parameters",
              why="ZeRO-3 shards this tp rank's slice of each parameter over dp"),
    PassOrder(first="specialize_dims", then="tensor_remat_policy",
              why="the per-tensor decision is made on the shapes that run (its budget is bytes of this program)"),
    PassOrder(first="annotate_flops", then="tensor_remat_policy", why="recompute is costed in FLOPs"),
    PassOrder(first="split_backward", then="apply_offload",
              why="apply_offload runs last: its begin/saver/end triples must stay adjacent"),
)
"""Every ordering rule between passes (checked by every manager this module builds)."""


@dataclass(frozen=True, kw_only=True)
class PassDef:
    """A registered pass: ``make(**options)`` gives its function; ``options`` the names it takes."""

    name: str
    make: Callable[..., Callable[[fx.GraphModule, PassContext], fx.GraphModule]]
    requires: tuple[str, ...]
    provides: tuple[str, ...]
    options: tuple[str, ...] = ()

    def build(self, **options: Any) -> Pass:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise PassError(f"pass {self.name!r} takes no option(s) {', '.join(unknown)}; its options are "
                            f"{', '.join(self.options) or '(none)'}")
        shown = tuple((k, v) for k, v in options.items() if k != "cost")
        return Pass(name=self.name, fn=self.make(**options), requires=self.requires, provides=self.provides,
                    options=shown)


def _plain(fn: Callable[..., fx.GraphModule]) -> Callable[..., Callable]:
    return lambda **options: adapt(fn, **options)


REGISTRY: dict[str, PassDef] = {d.name: d for d in (
    PassDef(name="annotate_shapes", make=_plain(annotate_shapes), requires=(CAPTURE,), provides=(SHAPE,)),
    PassDef(name="annotate_blocks", make=_plain(annotate_blocks), requires=(CAPTURE,), provides=(BLOCK, LAYER_CHAIN)),
    PassDef(name="annotate_moe", make=_plain(annotate_moe), requires=(CAPTURE, BLOCK), provides=(MOE_LAYERS,),
            options=("imbalance",)),
    PassDef(name="annotate_flops", make=_plain(annotate_flops), requires=(CAPTURE, SHAPE),
            provides=(FLOPS, FLOP_SUMMARY)),
    PassDef(name="annotate_memory", make=_plain(annotate_memory), requires=(CAPTURE, SHAPE),
            provides=(MEMORY, MEMORY_SUMMARY), options=("optimizer", "dtype", "batch")),
    PassDef(name="context_parallel", make=_plain(apply_context_parallel), requires=(CAPTURE,),
            provides=(CONTEXT_PARALLEL,), options=("degree", "group", "mode", "tp")),
    PassDef(name="tag_tensor_parallel", make=_plain(tag_tensor_parallel), requires=(CAPTURE, SHAPE),
            provides=(TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN), options=("degree",)),
    PassDef(name="checkpoint_policy", make=_plain(checkpoint_policy), requires=(CAPTURE, SHAPE, LAYER_CHAIN, FLOPS),
            provides=(CHECKPOINT, CHECKPOINT_PLAN), options=("policy", "budget_bytes", "stage_starts")),
    PassDef(name="offload_policy", make=_plain(offload_policy), requires=(CAPTURE, SHAPE, FLOPS),
            provides=(OFFLOAD_PLAN,), options=("selection", "target_bytes", "optimizer_on_host", "cost")),
    PassDef(name="tag_pipeline_stages", make=_plain(tag_pipeline_stages_by_chain), requires=(CAPTURE, SHAPE, BLOCK),
            provides=(PIPELINE_STAGE,), options=("starts",)),
    PassDef(name="apply_tensor_parallel", make=_plain(apply_tensor_parallel), requires=(TENSOR_PARALLEL_PLAN,),
            provides=(TENSOR_PARALLEL_PLAN,), options=("rank", "group", "sequence_parallel")),
    PassDef(name="apply_expert_parallel", make=_plain(apply_expert_parallel), requires=(MOE_LAYERS,),
            provides=(EXPERT_PARALLEL,), options=("degree", "group")),
    PassDef(name="average_aux_loss", make=_plain(average_aux_loss), requires=(MOE_LAYERS,), provides=(),
            options=("degree", "group")),
    PassDef(name="restrict_checkpoint_plan", make=_plain(restrict_checkpoint_plan), requires=(CHECKPOINT_PLAN,),
            provides=(CHECKPOINT_PLAN,), options=("stage",)),
    PassDef(name="apply_checkpoint", make=_plain(apply_checkpoint), requires=(CHECKPOINT_PLAN,),
            provides=(CHECKPOINT_PLAN,)),
    PassDef(name="tensor_remat_policy", make=_plain(tensor_remat_policy), requires=(CAPTURE, SHAPE, FLOPS),
            provides=(TENSOR_REMAT_PLAN,), options=("budget_bytes", "fraction", "time_limit_s")),
    # the node marks (TENSOR_REMAT) sit on the decided nodes only; the plan says they were written
    PassDef(name="apply_tensor_remat", make=_plain(apply_tensor_remat), requires=(TENSOR_REMAT_PLAN,), provides=()),
    PassDef(name="apply_offload", make=_plain(apply_offload), requires=(OFFLOAD_PLAN,), provides=(OFFLOAD_PLAN,)),
    PassDef(name="specialize_dims", make=_plain(specialize_dims), requires=(CAPTURE,), provides=(CAPTURE,),
            options=("batch",)),
    PassDef(name="split_backward", make=_plain(split_backward), requires=(CAPTURE,), provides=(),
            options=("grad_inputs",)),
    PassDef(name="shard_parameters", make=_plain(shard_parameters), requires=(CAPTURE,), provides=(ZERO3_PLAN,),
            options=("degree", "group", "stage", "reshard_after_forward")),
)}


def make_pass(name: str, **options: Any) -> Pass:
    """The registered pass ``name`` with ``options``."""
    if name not in REGISTRY:
        raise PassError(f"unknown pass {name!r}; registered passes: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name].build(**options)


def manager(passes: Sequence[Pass], *, check: bool = True, instrument=None) -> PassManager:
    """A :class:`PassManager` over ``passes`` that enforces :data:`ORDER`."""
    return PassManager(passes, check=check, order=ORDER, instrument=instrument)


# --------------------------------------------------------------------------------------- pipelines
def analysis_passes(ctx: PassContext | None = None, *, memory: bool = True,
                    memory_batch: int | None = None) -> list[Pass]:
    """Shapes, layer chain, FLOPs and (with ``memory``) memory, with ``ctx``'s optimizer and
    precision; ``memory_batch``: count memory at that batch, concretely (see ``annotate_memory``)."""
    ctx = ctx or PassContext()
    out = [make_pass("annotate_shapes"), make_pass("annotate_blocks"), make_pass("annotate_moe"),
           make_pass("annotate_flops")]
    if memory:
        options = {} if memory_batch is None else {"batch": memory_batch}
        out.append(make_pass("annotate_memory", optimizer=ctx.optimizer, dtype=ctx.dtype,
                             **options))
    return out


def reanalysis_passes(ctx: PassContext | None = None) -> list[Pass]:
    """The analysis again on a rewritten stage program: shapes, FLOPs, memory (blocks and MoE marks
    travel with the nodes; nodes a rewrite inserted belong to none)."""
    return [p for p in analysis_passes(ctx) if p.name not in ("annotate_blocks", "annotate_moe")]


def whole_graph_passes(config: ParallelConfig, *, cost: CostHooks | None, starts: tuple[int, ...],
                       tp_group: str = "tp") -> list[Pass]:
    """The passes ``config`` asks for over the analysed whole graph: with ``cp > 1`` the
    context-parallel rewrite and its shapes and FLOPs again (what the tag passes read); then
    the tag passes: tp sharding, checkpoint regions, activation offload
    (decided here only without checkpointing; with it, per stage after the regions are
    outlined), and the pipeline stages (``starts``: chain index of each stage after the first)."""
    out = []
    if config.cp > 1:
        out.append(make_pass("context_parallel", degree=config.cp, group=cp_group(tp_group), mode=config.cp_mode,
                             tp=config.tp))
        # what the tag passes read; memory is counted on each stage program after its rewrite
        # (the checkpoint policy observes saved tensors itself), not on this intermediate graph
        out += [make_pass("annotate_shapes"), make_pass("annotate_flops")]
    if config.tp > 1:
        out.append(make_pass("tag_tensor_parallel", degree=config.tp))
    if config.checkpointing == "dag" and starts:
        # every stage saves its share of its own activations (the budget per stage, not only in total)
        out.append(make_pass("checkpoint_policy", policy="dag", stage_starts=tuple(starts)))
    elif config.checkpointing not in ("none", "tensor"):  # tensor: decided per stage program
        out.append(make_pass("checkpoint_policy", policy=config.checkpointing))
    if config.offload == "activations" and config.checkpointing == "none":
        out.append(make_pass("offload_policy", selection="all", optimizer_on_host=False, cost=_need(cost)))
    out.append(make_pass("tag_pipeline_stages", starts=starts))
    return out


def stage_passes(config: ParallelConfig, *, stage: int, tp_rank: int, tp_group: str, cost: CostHooks | None,
                 ctx: PassContext | None = None, grad_inputs: tuple[str, ...] = (), moe: bool = False) -> list[Pass]:
    """The passes that make the program of ``stage`` on tp rank ``tp_rank`` from its split module.

    After the tp and ep rewrites (which read the split's symbolic shapes) the program is described at
    the plan's micro-batch (``specialize_dims``): every later analysis is of what runs.
    ``grad_inputs``: the stage's received inputs that carry a gradient (split backward needs them).
    ``moe``: the model has mixture-of-experts blocks (their load-balancing losses average over the
    data axis; ``ep > 1`` spreads their experts).
    """
    out = []
    if config.tp > 1:
        out.append(make_pass("apply_tensor_parallel", rank=tp_rank, group=tp_group,
                             sequence_parallel=config.sequence_parallel))
    if config.ep > 1:
        out.append(make_pass("apply_expert_parallel", degree=config.ep, group=ep_group(tp_group)))
    if moe and config.dp_cp > 1:
        out.append(make_pass("average_aux_loss", degree=config.dp_cp, group=data_group(tp_group)))
    out.append(make_pass("specialize_dims", batch=config.micro_batch_size))
    if config.checkpointing == "tensor":
        # decided on this program as it runs: its shapes, its FLOPs, its own backward
        out += [make_pass("annotate_shapes"), make_pass("annotate_flops"), make_pass("tensor_remat_policy"),
                make_pass("apply_tensor_remat")]
    elif config.checkpointing != "none":
        # the regions' nodes get this program's shapes from the re-analysis, which runs them
        out += [make_pass("restrict_checkpoint_plan", stage=stage), make_pass("apply_checkpoint")]
        if config.offload == "activations":
            # the regions' calls save their inputs for the recompute: offload decides on this graph
            out += [make_pass("annotate_shapes"), make_pass("annotate_flops"),
                    make_pass("offload_policy", selection="all", optimizer_on_host=False, cost=_need(cost))]
    if config.split_backward:
        out.append(make_pass("split_backward", grad_inputs=tuple(grad_inputs)))
    if config.zero_stage == 3:
        out.append(make_pass("shard_parameters", degree=config.shard_degree, group=zero3_group(tp_group), stage=stage,
                             reshard_after_forward=config.reshard_after_forward))
    if config.offload == "activations":
        out.append(make_pass("apply_offload"))
    return out + reanalysis_passes(ctx)


def cp_group(tp_group: str) -> str:
    """The name context-parallel ops look their cp group up by, beside the tp group's name."""
    return f"{tp_group}.cp"


def ep_group(tp_group: str) -> str:
    """The name expert-parallel ops look their ep group up by, beside the tp group's name."""
    return f"{tp_group}.ep"


def data_group(tp_group: str) -> str:
    """The name ops over the whole data axis (dp x cp ranks) look their group up by."""
    return f"{tp_group}.data"


def zero3_group(tp_group: str) -> str:
    """The name ZeRO-3's gathers look their dp group up by, beside the tp group's name."""
    return f"{tp_group}.dp"


def _need(cost: CostHooks | None) -> CostHooks:
    if cost is None:
        raise PassError("offload_policy needs the cost hooks of the cluster the plan is for (cost=...): "
                        "lower(..., cost=partitioner.cost.cost_model.cost_hooks(cluster))")
    return cost


# --------------------------------------------------------------------------------------- text form
_ITEM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\{([^}]*)\})?\s*(?:,|$)")


_OLD_PRECISION = "mixed_precision"
"""``annotate_memory``'s option before ``dtype``: old pipeline text (a dump's manifest) still reads,
``true`` as ``bf16`` (the memory counted is that of either 16-bit dtype), ``false`` as ``fp32``."""


def parse_pipeline(text: str, *, cost: CostHooks | None = None) -> list[Pass]:
    """The passes of a pipeline's text (:func:`passes.lowering.manager.pipeline_text`); ``cost`` is given
    to the passes that take it (it has no text form)."""
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if m is None or m.end() == pos:
            raise PassError(f"pipeline text: cannot read {text[pos:]!r}; write name or name{{key=value,...}} "
                            f"separated by commas")
        name, body = m.group(1), m.group(2)
        options = {}
        for item in filter(None, (s.strip() for s in (body or "").split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise PassError(f"pipeline text: option {item!r} of pass {name!r} is not key=value")
            options[key.strip()] = _value(value.strip())
        if name == "annotate_memory" and _OLD_PRECISION in options:  # text written before the dtype option
            options.setdefault("dtype", "bf16" if options.pop(_OLD_PRECISION) else "fp32")
        if name in REGISTRY and "cost" in REGISTRY[name].options:
            options["cost"] = cost
        out.append(make_pass(name, **options))
        pos = m.end()
    return out


def _value(text: str) -> Any:
    if text.startswith("[") and text.endswith("]"):
        return tuple(_value(t) for t in text[1:-1].split())
    if text in ("true", "false"):
        return text == "true"
    if text == "None":
        return None
    try:
        return int(text)
    except ValueError:
        return text
