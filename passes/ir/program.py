"""The rank-program contract: what the lowering hands the runtime for one rank of a plan.

A :class:`RankProgram` is everything one rank executes: its stage programs (fx GraphModules,
already tensor-parallel sharded and rewritten for checkpointing and offload), the I/O contract
of every stage (:class:`passes.ir.meta.StageIO`), every communication it takes part in
(:class:`Comm`), its schedule (the action list of :mod:`passes.ir.schedule`), how each
parameter is sharded, and the :class:`~passes.ir.config.ParallelConfig` it was lowered from.
The runtime builds process groups, kernels and optimizers around it and runs it; it never
rewrites it.

Rank layout (tensor parallel fastest, then data parallel, then pipeline)::

    rank = first + pp_index * (dp * tp) + dp_index * tp + tp_index

where ``dp`` is the data axis: a config's ``dp * cp`` ranks (:attr:`ParallelConfig.dp_cp`), the
``cp`` consecutive ones of a replica forming a context-parallel group
(``dp_index = replica * cp + cp_index``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch
from torch import fx

from passes.ir.config import ParallelConfig
from passes.ir.cp_ops import ContextParallelPlan
from passes.ir.meta import InputSpec, ParamSharding, StageIO, TensorParallelPlan
from passes.ir.schedule.actions import Action

CommKind = Literal["send", "recv", "tp", "cp", "ep", "data", "dp_all_reduce", "tied_all_reduce"]


def global_rank(pp_index: int, dp_index: int, tp_index: int, *, dp: int, tp: int, first: int = 0) -> int:
    """Global rank at mesh coordinates (tp fastest, then dp, then pp); ``dp``: the data axis
    (a config's ``dp_cp``)."""
    return first + pp_index * dp * tp + dp_index * tp + tp_index


def mesh_coords(rank: int, *, dp: int, tp: int, first: int = 0) -> tuple[int, int, int]:
    """``(pp_index, dp_index, tp_index)`` of global ``rank`` (``dp``: the data axis, ``dp_cp``)."""
    pp_index, rest = divmod(rank - first, dp * tp)
    dp_index, tp_index = divmod(rest, tp)
    return pp_index, dp_index, tp_index


@dataclass(frozen=True)
class Comm:
    """One communication of a rank program.

    ``kind``: ``"send"``/``"recv"`` (pipeline P2P of ``tensors`` between ``stage`` and
    ``peer_stage``, the peer being global rank ``ranks[0]``), ``"tp"`` (a tp collective of the
    stage's graph: ``op`` is the op name, ``node`` the graph node), ``"dp_all_reduce"`` (the
    gradient average) or ``"tied_all_reduce"`` (the gradient sum of a tied weight's copies,
    ``tensors`` its aliases). ``ranks``: the global ranks involved, this rank included for
    collectives; ``group``: the tp group name for ``"tp"``, the cp group name for ``"cp"`` (a
    context-parallel op of the stage's graph: ring attention, Ulysses all-to-all, loss all-reduce),
    the ep group name for ``"ep"`` (an expert-parallel dispatch or combine) and the data axis'
    for ``"data"`` (a load-balancing loss's token averages).
    """

    kind: CommKind
    ranks: tuple[int, ...]
    stage: int | None = None
    peer_stage: int | None = None
    tensors: tuple[str, ...] = ()
    op: str = ""
    node: str = ""
    group: str = ""


@dataclass(frozen=True, kw_only=True)
class TiedParam:
    """A parameter read on several stages (tied embedding and LM head): the stages holding a
    copy, every name it goes by, and the shape and dtype of this rank's copy (its tp shard)."""

    name: str
    stages: tuple[int, ...]
    aliases: tuple[str, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype

    def copies(self, modules: Mapping[int, torch.nn.Module]) -> list[torch.nn.Parameter]:
        """Its copies among ``modules`` (stage -> program: a rank's stages), each parameter once:
        what the rank sums over the tied weight's holders, in trailing gradient buckets."""
        out: dict[int, torch.nn.Parameter] = {}
        for s in self.stages:
            if s in modules:
                for alias in self.aliases:
                    try:
                        q = modules[s].get_parameter(alias)
                    except AttributeError:
                        continue
                    out[id(q)] = q
        return list(out.values())


@dataclass(frozen=True, kw_only=True)
class RankProgram:
    """What global rank ``rank`` runs under ``config`` (see the module docstring).

    ``modules[s]``: the program of each stage this rank holds (global stage index), parameters
    under their original names, sharded ones as this tp rank's slices. ``io``: every stage's
    contract (the executor needs its neighbours'). ``tied``: tied parameters by canonical name.
    ``canonical_names``: alias -> canonical name of every tied parameter of the model (what
    checkpoints are keyed by). ``tp_plan``: how each parameter is sharded (``None`` without tp).
    ``tp_group``: the name the stage programs' collectives look their group up by.
    ``cp_plan``: with context parallelism, what the rewrite did (its cp group's name, and the graph
    inputs the runtime feeds as this rank's sequence shard); ``None`` without.
    ``actions``: this rank's schedule. ``inputs``: the graph inputs with their named dims.
    ``sp_grad_params``: with sequence parallelism, the replicated parameters whose gradients are
    partial per tp rank and are summed over the tp group before the data-parallel sync.
    ``no_weight_decay``: names (every alias) of the parameters the default optimizer groups
    leave without weight decay (:mod:`passes.analysis.weight_decay`).
    ``expert_params``: with ``ep > 1``, the routed experts' parameters this rank holds (their
    gradients average over the ranks holding the same experts: :attr:`ep_index` is the rank's
    place in its ep group); ``stacked_experts``: those of them that are stacked ``[experts, ...]``
    weights of which the rank holds its ep group's share of rows (rows ``ep_index * n ..`` of
    ``n * ep``); ``ep_group``/``data_group``: the names the ep ops and the ops over the
    whole data axis look their groups up by.
    """

    rank: int
    first: int = 0
    config: ParallelConfig
    pp_index: int
    dp_index: int
    tp_index: int
    stages: tuple[int, ...]
    modules: Mapping[int, fx.GraphModule] = field(repr=False)
    io: tuple[StageIO, ...] = field(repr=False)
    tied: Mapping[str, TiedParam] = field(repr=False, default_factory=dict)
    canonical_names: Mapping[str, str] = field(repr=False, default_factory=dict)
    tp_plan: TensorParallelPlan | None = field(repr=False, default=None)
    tp_group: str = "tp"
    cp_plan: ContextParallelPlan | None = field(repr=False, default=None)
    comms: tuple[Comm, ...] = field(repr=False, default=())
    actions: tuple[Action, ...] = field(repr=False, default=())
    inputs: tuple[InputSpec, ...] = ()
    sp_grad_params: tuple[str, ...] = ()
    no_weight_decay: frozenset[str] = frozenset()
    expert_params: tuple[str, ...] = ()
    stacked_experts: tuple[str, ...] = ()
    ep_group: str = "tp.ep"
    data_group: str = "tp.data"

    # knobs of the config, read through
    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def dp_cp(self) -> int:
        """Ranks on the data axis (the gradient-averaging group): ``dp * cp``."""
        return self.config.dp_cp

    @property
    def cp_index(self) -> int:
        """This rank's place in its context-parallel group."""
        return self.dp_index % self.config.cp

    @property
    def ep_index(self) -> int:
        """This rank's place in its expert-parallel group (ep consecutive ranks of the data axis)."""
        return self.dp_index % self.config.ep

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def virtual_pp(self) -> int:
        return self.config.virtual_pp

    @property
    def n_stages(self) -> int:
        return len(self.io)

    def comms_of(self, kind: str) -> list[Comm]:
        return [c for c in self.comms if c.kind == kind]

    def rank_of(self, pp_index: int, dp_index: int | None = None, tp_index: int | None = None) -> int:
        """Global rank at these coordinates (this rank's dp/tp index by default)."""
        return global_rank(pp_index, self.dp_index if dp_index is None else dp_index,
                           self.tp_index if tp_index is None else tp_index, dp=self.dp_cp, tp=self.tp, first=self.first)


# --- shard specs: how a parameter is split over the tp ranks ----------------------------------------
def shard_tensor(t: torch.Tensor, sharding: ParamSharding, rank: int, degree: int) -> torch.Tensor:
    """This rank's slice of ``t`` (a copy): along ``sharding.dim``, the ``rank``-th of ``degree``
    equal pieces of every section; the whole tensor (copied) when replicated."""
    if sharding.dim is None:
        return t.detach().clone()
    pieces, offset = [], 0
    for size in sharding.sections or (t.shape[sharding.dim],):
        chunk = size // degree
        pieces.append(t.detach().narrow(sharding.dim, offset + rank * chunk, chunk))
        offset += size
    return torch.cat(pieces, dim=sharding.dim).clone()


def unshard_tensor(shards: Sequence[torch.Tensor], sharding: ParamSharding) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's slice, in rank order
    (rank 0's copy for a replicated one)."""
    if sharding.dim is None:
        return shards[0]
    degree = len(shards)
    out, offset = [], 0
    for size in sharding.sections:
        chunk = size // degree
        out.extend(s.narrow(sharding.dim, offset // degree, chunk) for s in shards)
        offset += size
    return torch.cat(out, dim=sharding.dim)


def local_shape(shape: Sequence[int], sharding: ParamSharding | None, degree: int) -> tuple[int, ...]:
    """The shape of one tp rank's slice of a tensor of ``shape``."""
    out = list(shape)
    if sharding is not None and sharding.dim is not None and degree > 1:
        out[sharding.dim] //= degree
    return tuple(out)
