"""A lowering's stage programs as bytes, so that one data-parallel rank lowers and the others take them.

Every rank of a job's data axis (its dp x cp ranks) at one (pipeline rank, tp rank) runs the same
(stage, tp rank) programs: what differs between them (an ep rank's experts, its data) is applied
later, by :meth:`passes.lowering.lower.Lowering.rank_program`. So the first of them lowers
(:func:`passes.lowering.lower.lower`), :func:`pack_programs` packs its programs, and each other one
rebuilds them (:func:`take_programs`) instead of running the stage passes again (their fake runs,
copies, shards and re-analyses)::

    first data-axis rank                            each other data-axis rank
    lower(graph, config, programs=mine)             lower(graph, config, programs=())   whole graph + split only
    pack_programs(lowering, mine)   ── bytes ──>    take_programs(...)                  programs rebuilt around
                                                                                        its own whole graph

A program's tensors come back as the receiver's own, never the sender's values: a tensor that is
the whole graph's travels as its name; one the lowering made from the whole graph's (a tp shard, a
ZeRO-3 shard, an ep rank's rows of a stacked expert weight, a copy) as a recipe (:class:`Derived`)
that the receiver runs on its own whole graph (the sender checks that the recipe gives exactly
its tensor); a small one that neither describes travels by value, and a large one makes the
programs unshareable (:class:`PassError`: each rank lowers alone). The receiver checks its rebuilt
programs against the sender's digest.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import fx, nn

from passes.ir.config import ParallelConfig
from passes.ir.cost import CostHooks
from passes.ir.errors import PassError
from passes.ir.graph_modules import graph_module
from passes.ir.graph_transfer import GraphPayload, pack_graph, unpack_graph
from passes.ir.meta import TENSOR_PARALLEL_PLAN, ZERO3_PLAN, ParamSharding, TensorParallelPlan
from passes.ir.program import local_shape, shard_tensor
from passes.ir.zero3_ops import shard_of
from passes.lowering.lower import Lowering, lower
from passes.lowering.manager import PassContext

BY_VALUE_BYTES = 64 * 1024
"""The largest tensor of a program that travels by value when no recipe makes it (bytes)."""

_PLAIN = frozenset(k for k in vars(graph_module(nn.Module(), fx.Graph())) if not k.startswith("_"))
_SOURCES = "zero3_sources"  # passes.rewrites.shard_parameters: each parameter's full tensor, for the runtime


@dataclass(frozen=True)
class Derived:
    """How the lowering made a tensor of a stage program from the whole graph's ``kind``
    (``"parameter"`` or ``"buffer"``) ``name``: this tp rank's shard of it (``tp``: sharding,
    rank, degree; :func:`passes.ir.program.shard_tensor`), then its first ``rows`` rows (an ep
    rank's experts of a stacked weight), then dp rank 0's flat ZeRO-3 shard (``zero3``: the
    degree); with none of them, a copy. ``shape`` and ``dtype``: what comes out."""

    name: str
    kind: str
    tp: tuple[ParamSharding, int, int] | None
    rows: int | None
    zero3: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    def make(self, whole: fx.GraphModule) -> torch.Tensor:
        """The tensor, made from ``whole``'s (a new tensor: never a view of the whole graph's)."""
        try:
            src = (whole.get_parameter if self.kind == "parameter" else whole.get_buffer)(self.name).detach()
        except AttributeError as exc:
            raise PassError(f"shared programs: the whole graph has no {self.kind} {self.name!r}") from exc
        out = shard_tensor(src, *self.tp) if self.tp is not None else src
        if self.rows is not None:
            out = out[:self.rows]
        if self.zero3 is not None:
            out = shard_of(out, self.zero3, 0)
        elif self.tp is None or self.rows is not None:
            out = out.clone()
        if tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise PassError(f"shared programs: {self.name!r} came out as {tuple(out.shape)} {out.dtype}, the "
                            f"lowering made {self.shape} {self.dtype}")
        return out


@dataclass(frozen=True)
class SharedPrograms:
    """The (stage, tp rank) programs of one lowering (:func:`pack_programs`): each packed around
    the whole graph, with the recipes of its ZeRO-3 full tensors; the stage pipelines' records;
    the config they are of and the digest the receiver's must equal."""

    config: str
    programs: tuple[tuple[tuple[int, int], GraphPayload, dict[str, Derived] | None], ...]
    pipelines: tuple
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p, _ in self.programs)


def pack_programs(lowering: Lowering, programs: Iterable[tuple[int, int]]) -> SharedPrograms:
    """The ``programs`` of ``lowering`` as :class:`SharedPrograms`. Raises :class:`PassError` when
    one cannot travel (a tensor no recipe makes and too large to send, an attribute or submodule
    that does not pickle)."""
    keys = sorted(programs)
    missing = [k for k in keys if k not in lowering.programs]
    if missing:
        raise PassError(f"pack_programs: the lowering made no program {missing}")
    whole = lowering.graph
    packed = tuple((key, *_pack_program(lowering.programs[key], whole)) for key in keys)
    names = {f"stage{s}_tp{t}" for s, t in keys}
    mine = dataclasses.replace(lowering, programs={k: lowering.programs[k] for k in keys})
    return SharedPrograms(config=repr(lowering.config), programs=packed,
                          pipelines=tuple(r for r in lowering.pipelines if r.name in names), digest=mine.digest())


def take_programs(gm: fx.GraphModule, config: ParallelConfig, shared: SharedPrograms, *, cost: CostHooks | None,
                  tp_group: str = "tp", ctx: PassContext | None = None) -> Lowering:
    """The :class:`Lowering` of the analysed graph ``gm`` under ``config`` with the programs of
    ``shared`` (another rank's :func:`pack_programs` of the same plan): this process runs the
    whole-graph passes and the split itself (:func:`lower` of no program: cheap, and the tensors
    are its own) and rebuilds the programs around its whole graph. Raises :class:`PassError`
    when they are not what this rank would have lowered (another config, another digest)."""
    if shared.config != repr(config):
        raise PassError("take_programs: the programs are of another config")
    base = lower(gm, config, cost=cost, programs=(), tp_group=tp_group, ctx=ctx)
    whole = base.graph

    def make(recipe: Derived) -> torch.Tensor:
        return recipe.make(whole)

    made = {}
    for key, payload, sources in shared.programs:
        program = unpack_graph(payload, whole, resolve=make)
        if sources is not None:
            setattr(program, _SOURCES, {name: make(recipe) for name, recipe in sources.items()})
        made[key] = program
    lowering = dataclasses.replace(base, programs=made, pipelines=base.pipelines + tuple(shared.pipelines))
    if lowering.digest() != shared.digest:
        raise PassError(f"take_programs: the rebuilt programs digest to {lowering.digest()}, the sender's to "
                        f"{shared.digest}")
    return lowering


# ---------------------------------------------------------------------------------------------
def _pack_program(program: fx.GraphModule, whole: fx.GraphModule) -> tuple[GraphPayload, dict[str, Derived] | None]:
    for path, sub in program.named_modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        extra = sorted(k for k in vars(sub) if not k.startswith("_") and k not in _PLAIN
                       and not (k == _SOURCES and sub is program))
        hooks = sorted(k for k, v in vars(sub).items() if k.startswith("_") and k.endswith("hooks") and v)
        if extra or hooks or not sub.training:
            raise PassError(f"pack_programs: graph module {path or 'program'!r} holds {extra + hooks or 'eval mode'}, "
                            f"which does not travel")
    tp_plan = program.meta.get(TENSOR_PARALLEL_PLAN)
    zero3 = program.meta.get(ZERO3_PLAN)
    sources = getattr(program, _SOURCES, None)
    sharded = {p.name for p in zero3.params} if zero3 is not None else set()
    whole_ids = {id(t) for t in [*whole.parameters(), *whole.buffers()]}

    source_recipes = None
    if sources is not None:
        source_recipes = {}
        for name, t in sources.items():
            recipe = _recipe(t, name, "parameter", whole, tp_plan, None, tuple(t.shape))
            if recipe is None:
                raise PassError(f"pack_programs: no recipe makes the ZeRO-3 full tensor of {name!r}")
            source_recipes[name] = recipe

    refs: dict[int, Derived] = {}
    seen: set[int] = set()
    tensors = [(n, t, "parameter") for n, t in program.named_parameters(remove_duplicate=False)]
    tensors += [(n, t, "buffer") for n, t in program.named_buffers(remove_duplicate=False)]
    for name, t, kind in tensors:  # a tensor's first name is its own (a region re-lists it after)
        if id(t) in seen or id(t) in whole_ids:
            seen.add(id(t))
            continue
        seen.add(id(t))
        if kind == "parameter" and name in sharded and sources is not None and name in sources:
            recipe = _recipe(t, name, kind, whole, tp_plan, zero3.degree, tuple(sources[name].shape))
        else:
            recipe = _recipe(t, name, kind, whole, tp_plan, None, tuple(t.shape))
        if recipe is not None:
            refs[id(t)] = recipe
        elif t.numel() * t.element_size() > BY_VALUE_BYTES:
            raise PassError(f"pack_programs: no recipe makes {kind} {name!r} ({tuple(t.shape)}) from the whole "
                            f"graph, and it is too large to send")
    return pack_graph(program, whole, refs=refs), source_recipes


def _recipe(t: torch.Tensor, name: str, kind: str, whole: fx.GraphModule, tp_plan: TensorParallelPlan | None,
            zero3: int | None, shape: tuple[int, ...]) -> Derived | None:
    """The :class:`Derived` that makes ``t`` (of ``shape`` before a ZeRO-3 shard of ``zero3``
    ranks) from ``whole``'s ``name``, checked here; None when none does."""
    try:
        src = whole.get_parameter(name) if kind == "parameter" else whole.get_buffer(name)
    except AttributeError:
        return None
    tp = None
    if tp_plan is not None and tp_plan.rank is not None and tp_plan.degree > 1 and name in tp_plan.params:
        tp = (tp_plan.params[name], tp_plan.rank, tp_plan.degree)
    full = local_shape(src.shape, tp[0], tp[2]) if tp is not None else tuple(src.shape)
    rows = None
    if len(shape) == len(full) and shape and shape[0] < full[0] and shape[1:] == full[1:]:
        rows = shape[0]  # an ep rank's experts of a stacked weight
    recipe = Derived(name=name, kind=kind, tp=tp, rows=rows, zero3=zero3, shape=tuple(t.shape), dtype=t.dtype)
    try:
        made = recipe.make(whole)
    except (PassError, RuntimeError, IndexError):
        return None
    return recipe if torch.equal(made, t.detach()) else None


__all__ = ["BY_VALUE_BYTES", "Derived", "SharedPrograms", "pack_programs", "take_programs"]
