"""Check, before anything runs, that a plan's rank programs issue matching communication.

A collective that one member of a group calls and another does not, or calls with another size,
hangs the job or (same size, other tensor) silently mixes tensors; a send without its receive
hangs a pipeline. This pass derives, from every :class:`~passes.ir.program.RankProgram` of a
plan, the ordered communication calls the runtime issues in one training step
(:meth:`runtime.exec.parallel_model.ParallelModel.train_step`), and matches them across ranks. It is
pure: no process group, no tensor runs. In a job each process lowers only its own rank's
programs; the ranks gather each other's calls (:class:`LoweredRank`, one all-gather) and every
rank checks them all (:func:`check_lowered_ranks`) before the plan's first collective.

What one rank issues, in the order its action list runs (``F``: forward, ``B``/``I``: backward
(with split backward, ``I`` is where the backward collectives run), ``W``: weight gradients,
local compute)::

    F s,i        the tp/sp collectives of stage s's graph in graph order (checkpointed regions
                 inlined); vocab_parallel_cross_entropy is three all-reduces; the context-
                 parallel ops' calls on the cp group: ring attention cp-1 ring shifts of its
                 K/V block, Ulysses one all-to-all per tensor, the loss's all-reduces
    B s,i / I    the backward collectives of those ops (passes.ir.ops: copy_to_tp's all-reduce,
                 the sequence ops' gathers and scatters) in reverse graph order, as autograd
                 runs them; a checkpointed region's recompute repeats its forward collectives
    W s,i        a checkpointed region holding trainable parameters recomputes its forward
                 again (the weight gradients unpack what it saved), the last region first
    SEND/RECV    one message per boundary tensor (runtime.exec.stage_executor): the sender's shape and
                 dtype from its stage graph, the receiver's from its StageIO contract
    ALL_REDUCE   the dp gradient buckets (passes.ir.grad_buckets.bucket_layout, the layout the
                 runtime builds): all-reduce, ZeRO-1 reduce-scatter, ZeRO-2 one reduce-scatter
                 per completed round, launched as the buckets complete (overlap: inside B, where
                 the bucket's last parameter gets its gradient, right after the backward of its
                 first reader in graph order; I leaves them to W) or at the end;
                 the tied-weight all-reduces; the sequence-parallel partial-gradient all-reduce
    STEP         (fp16: the overflow flag) the global gradient norm over the mesh; ZeRO's
                 all-gather of every bucket's updated chunks
    end          the loss all-reduce over the mesh

Each call is a :class:`CommCall`: its group (global ranks), op, element count (of the whole
buffer: an all-reduce's tensor, a reduce-scatter's input, an all-gather's output), dtype and a
label naming where it comes from. Symbolic dims are evaluated at the programs' micro-batch dims
(the capture's, made concrete by ``specialize_dims``).

Matching (:func:`check_communication`): every group's members must issue the same calls (op,
count, dtype and origin) in the same order; every send must have exactly one receive (same
message: direction, sending stage, micro-batch, tensor) with the same shape and dtype. A
mismatch raises :class:`CommunicationMismatchError` naming the group, the ranks and the calls,
with a call x rank grid, the first disagreement marked. Deadlock freedom of the action lists
themselves is :func:`passes.ir.schedule.validate.check_batches`' (run when they are built).

At scale (1,536 ranks) the calls are not derived rank by rank: a rank's calls name their groups
by reference (``"tp"``, ``"dp"``, ``("to", q)``: :class:`_MeshGroups`), so the ranks whose
programs are the same objects with the same schedule (data-parallel replicas) share one
derivation (:func:`_program_key`), and a group's members are compared once per distinct
(program, references) among them. What is matched is what the rank-by-rank check matches
(:func:`check_calls`, which a job's gathered calls go through), with the same messages.

Autograd runs a stage's backward nodes in reverse creation (graph) order. What requires grad is
propagated from the received boundary tensors (their contracts), the parameters and the graph,
not read from the stage's shape meta, whose analysis sees received tensors as plain inputs. A
checkpointed region (torch's non-reentrant checkpoint) recomputes at the backward of its last
node that saved tensors (``node.meta[MEMORY].saved`` or ``.offloaded``) and stops right after it (early stop):
the collectives after that node run once. The tests record a real ``train_step`` on torch's
fake process group and compare. Not modelled: a ZeRO-2 bucket whose parameters are accumulated
unequally often is taken to complete a round each time all of them have.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping, Protocol, Sequence

import sympy
import torch
import torch.utils.checkpoint
from torch import fx, nn

from passes.ir.errors import CommunicationMismatchError, ConfigError, PassError
from passes.ir.grad_buckets import (
    DEFAULT_BUCKET_BYTES,
    MODE_OF_ZERO_STAGE,
    BucketMachine,
    BucketSpec,
    GradSlot,
    Launch,
    Retire,
    bucket_layout,
    unique_params,
)
from passes.ir.meta import CAPTURE, MEMORY, SHAPE, TensorMeta, dim_symbol
from passes.ir.ops import SCHEMAS, TP_OPS, op_name
from passes.ir.program import RankProgram, global_rank, mesh_coords
from passes.ir.zero3_ops import ZERO3_PREFETCH, GatherSchedule, keeps_gathered
from passes.ir.meta import ZERO3_PLAN

CallOp = Literal["all_reduce(sum)", "all_reduce(max)", "reduce_scatter(sum)", "all_gather", "all_to_all",
                 "ring_shift", "send", "recv"]

_WHAT_TO_DO = ("This is a bug of the lowering (passes/lowering/lower.py and the passes it runs) or a rank program edited by "
               "hand, not something a knob fixes: nothing was launched. Report it with this message and the plan's "
               "config ({config}).")


@dataclass(frozen=True, slots=True)
class CommCall:
    """One communication call of a rank.

    ``group``: the global ranks of the group (a send or receive: ``(sender, receiver)``);
    ``channel``: which of the mesh's process groups over them carries it (``"tp"``, ``"cp"``,
    ``"ep"``, ``"expert_dp"`` (the ranks holding the same experts), ``"dp"``, ``"pipeline"``,
    ``"world"``, ``"p2p"``): two groups over the same ranks (dp and the whole
    mesh when dp is every rank) are two communicators, whose calls never match each other.
    ``numel``: elements of the whole buffer (see the module docstring). ``label``: where it comes
    from (``1B0 grad of copy_to_tp %copy_to_tp_default``, ``dp bucket 2``); it names no rank, so
    the members of a group have equal labels for the same call. ``shape``/``message``: of a send
    or receive, the tensor's shape and ``(direction, sending stage, micro-batch, tensor index)``.
    """

    group: tuple[int, ...]
    op: CallOp
    numel: int
    dtype: torch.dtype
    label: str
    channel: Literal["tp", "cp", "ep", "expert_dp", "dp", "pipeline", "world", "p2p"] = "p2p"
    shape: tuple[int, ...] = ()
    message: tuple[str, int, int, int] | None = None

    @property
    def is_p2p(self) -> bool:
        return self.op in ("send", "recv")

    @property
    def signature(self) -> tuple:
        """What the members of a group must agree on."""
        return (self.op, self.numel, self.dtype, self.label)

    def __str__(self) -> str:
        size = f"{list(self.shape)}" if self.is_p2p else f"{self.numel}"
        return f"{self.op} {size} {_dtype(self.dtype)} ({self.label})"


@dataclass(frozen=True, slots=True)
class RankCalls:
    """Every communication call of global rank ``rank`` in one training step, in issue order."""

    rank: int
    calls: tuple[CommCall, ...]

    def on(self, group: tuple[int, ...], channel: str) -> list[CommCall]:
        """This rank's collectives over ``group`` on ``channel``, in order."""
        return [c for c in self.calls if (c.group, c.channel) == (group, channel) and not c.is_p2p]


@dataclass(frozen=True, slots=True)
class CommunicationSummary:
    """What a passing check saw: ranks, collective groups, collective calls and p2p messages
    (summed over ranks), and the wall seconds it took."""

    ranks: int
    groups: int
    collectives: int
    messages: int
    seconds: float


class _Lowering(Protocol):  # passes.lowering.lower.Lowering, without importing the lowering here
    config: object

    def rank_program(self, rank: int, *, first: int = 0) -> RankProgram: ...


# ------------------------------------------------------------------------------------------------
# One rank's calls

def rank_calls(program: RankProgram, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               overlap_grad_sync: bool = True, zero3_prefetch: int = ZERO3_PREFETCH) -> RankCalls:
    """The communication calls ``program`` issues in one training step (see the module
    docstring). ``bucket_bytes`` (bytes) and ``overlap_grad_sync``: as the
    :class:`~runtime.exec.parallel_model.ParallelModel` that runs it takes them (``zero3_prefetch``: sites)."""
    model = _RankModel(program, bucket_bytes, overlap_grad_sync, zero3_prefetch)
    return RankCalls(program.rank, _resolve(model.calls(), model.groups))


def _resolve(template: Sequence[CommCall], groups: Mapping[object, tuple[int, ...]]) -> tuple[CommCall, ...]:
    """A rank's calls from a template's (:meth:`_RankModel.calls`): each group reference replaced
    by the rank's group (``groups``: :meth:`_MeshGroups.of`)."""
    return tuple(CommCall(groups[c.group], c.op, c.numel, c.dtype, c.label, c.channel, c.shape, c.message)
                 for c in template)


class _MeshGroups:
    """The groups of a mesh's ranks by what they are to the rank: ``"tp"``, ``"dp"`` (the data
    axis: dp x cp), ``"cp"``, ``"ep"``, ``"expert_dp"`` (the ranks holding the same experts),
    ``"zero3_shard"``/``"zero3_replica"`` (ZeRO-3's shard group and, HSDP, the replicas across),
    ``"pipeline"`` (the rank's pipeline), ``"pipeline_ends"`` (its first and last rank),
    ``"world"``, ``("to", q)``/``("from", q)`` (a message to / from the rank's peer on pipeline
    rank ``q``: ``(sender, receiver)``). A rank's calls are computed with these references
    (:class:`_RankModel`), so the ranks running the same program (data-parallel replicas) share
    one computation; a group along the data axis is made once for all its members."""

    def __init__(self, config, first: int = 0):
        self.c, self.first = config, first
        self._axes: dict[tuple, tuple[int, ...]] = {}
        self.world = tuple(range(first, first + config.world_size))

    def _rank(self, p: int, d: int, t: int) -> int:
        return global_rank(p, d, t, dp=self.c.dp_cp, tp=self.c.tp, first=self.first)

    def _axis(self, p: int, t: int, start: int, stop: int, step: int = 1) -> tuple[int, ...]:
        key = (p, t, start, stop, step)
        group = self._axes.get(key)
        if group is None:
            group = self._axes[key] = tuple(self._rank(p, d, t) for d in range(start, stop, step))
        return group

    def of(self, rank: int) -> dict[object, tuple[int, ...]]:
        """Every group reference of global ``rank`` -> its global ranks."""
        c = self.c
        p, d, t = mesh_coords(rank, dp=c.dp_cp, tp=c.tp, first=self.first)
        degree = c.shard_degree
        replica, ep_first, shard_first = d - d % c.cp, d - d % c.ep, d // degree * degree
        pipeline = tuple(self._rank(j, d, t) for j in range(c.pp))
        out: dict[object, tuple[int, ...]] = {
            "tp": tuple(self._rank(p, d, j) for j in range(c.tp)),
            "dp": self._axis(p, t, 0, c.dp_cp),
            "cp": self._axis(p, t, replica, replica + c.cp),
            "ep": self._axis(p, t, ep_first, ep_first + c.ep),
            "expert_dp": self._axis(p, t, d % c.ep, c.dp_cp, c.ep),
            # HSDP: the shard group of consecutive dp ranks, the replicas across
            "zero3_shard": self._axis(p, t, shard_first, shard_first + degree),
            "zero3_replica": self._axis(p, t, d % degree, c.dp_cp, degree),
            "pipeline": pipeline,
            "pipeline_ends": (pipeline[0], pipeline[-1]),
            "world": self.world,
        }
        for q, peer in enumerate(pipeline):
            out[("to", q)] = (rank, peer)
            out[("from", q)] = (peer, rank)
        return out


class _RankModel:
    """Walks one rank's actions as the runtime runs them (see :func:`rank_calls`)."""

    def __init__(self, program: RankProgram, bucket_bytes: int, overlap: bool, zero3_prefetch: int = ZERO3_PREFETCH,
                 mesh_groups: _MeshGroups | None = None):
        self.p, self.c = program, program.config
        c = self.c
        self.pp_index, self.dp_index, self.tp_index = mesh_coords(program.rank, dp=c.dp_cp, tp=c.tp, first=program.first)
        # the calls name their groups by reference (_MeshGroups); groups: this rank's, whose sizes decide some calls
        self.groups = (mesh_groups or _MeshGroups(c, program.first)).of(program.rank)
        self.tp_group, self.dp_group, self.cp_group, self.ep_group, self.expert_dp_group, self.world = (
            "tp", "dp", "cp", "ep", "expert_dp", "world")
        self.dims = {dim_symbol(k): v for k, v in _dims(program).items()}
        self._sizes: dict[object, int] = {}
        self.bucket_bytes, self.overlap = bucket_bytes, overlap
        self.zero3 = _Zero3Calls(self, zero3_prefetch)
        self.stage_calls = {s: _StageCollectives(s, m, self) for s, m in program.modules.items()}
        io = program.io
        # boundary[s]: names stage s sends stage s + 1, in the receiver's input order (as the executor)
        self.boundary = {s: [i.name for i in io[s + 1].inputs if i.kind == "recv"] for s in range(len(io) - 1)}

    def numel(self, meta: TensorMeta) -> int:
        n = 1
        for d in self.shape(meta):
            n *= d
        return n

    def shape(self, meta: TensorMeta) -> tuple[int, ...]:
        return tuple(self._size(d, meta) for d in meta.shape)

    def _size(self, d, meta: TensorMeta) -> int:
        if isinstance(d, (int, sympy.Integer)):
            return int(d)
        value = self._sizes.get(d)  # subs costs about a millisecond: each expression once
        if value is None:
            e = sympy.sympify(d).subs(self.dims)
            if not e.is_Integer:
                raise ConfigError(f"communication_check: shape {tuple(meta.shape)} has dims "
                                  f"{sorted(map(str, e.free_symbols))} the programs' micro-batch dims "
                                  f"{sorted(map(str, self.dims))} do not give")
            value = self._sizes[d] = int(e)
        return value

    # --------------------------------------------------------------------------------------
    def calls(self) -> list[CommCall]:
        out: list[CommCall] = []
        grads = _GradSync(self)
        for a in self.p.actions:
            kind = a.kind.value  # by value: split-backward kinds (I, W) need no import to be known
            done: set[int] = set()  # the members whose gradient this B action accumulated mid-backward
            if kind == "F":
                out += self.stage_calls[a.stage].forward(f"{a.stage}F{a.microbatch}")
            elif kind == "B":  # a parameter's gradient hook fires where backward makes its gradient
                out += self.stage_calls[a.stage].backward(
                    f"{a.stage}B{a.microbatch}", on_grad=lambda key, s=a.stage, done=done: grads.param(s, key, done))
            elif kind == "I":  # the backward collectives run where the input gradients are made
                out += self.stage_calls[a.stage].backward(f"{a.stage}I{a.microbatch}")
            elif kind == "W":  # checkpointed regions recompute again for the weight gradients
                out += self.stage_calls[a.stage].weight(f"{a.stage}W{a.microbatch}")
            elif kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                out += self.p2p(a)
            elif kind == "ALL_REDUCE":
                out += grads.finish()
            elif kind == "STEP":
                self.zero3.reset()
                out += grads.step()
            if kind in ("B", "W"):  # weight gradients accumulate: buckets may launch (overlap, ZeRO-2)
                out += grads.accumulated(a.stage, done)
        if len(self.groups["world"]) > 1:
            out.append(CommCall(self.world, "all_reduce(sum)", 1, torch.float64, "loss of the step", "world"))
        return out

    def p2p(self, a) -> list[CommCall]:
        """The messages of one SEND/RECV action (runtime.exec.stage_executor's, tensor by tensor)."""
        io, s, i, kind = self.p.io, a.stage, a.microbatch, a.kind.value
        me, to, frm = self.p.rank, ("to", a.peer), ("from", a.peer)  # group references (_MeshGroups)
        out = []
        if kind == "RECV_F":
            metas = {x.name: x.meta for x in io[s].inputs}
            for j, name in enumerate(self.boundary[s - 1]):
                out.append(self._msg("recv", frm, metas[name], ("F", s - 1, i, j), f"{a}: {name}"))
        elif kind == "SEND_F":
            made = self.stage_calls[s].output_meta()
            missing = [n for n in self.boundary[s] if n not in made]
            if missing:
                raise ConfigError(f"communication_check: rank {me}'s stage {s} sends {missing} to stage {s + 1}, "
                                  f"but its program has no such outputs (it has {sorted(made)}); lower the plan again")
            for j, name in enumerate(self.boundary[s]):
                out.append(self._msg("send", to, made[name], ("F", s, i, j), f"{a}: {name}"))
        elif kind == "RECV_B":
            metas = {x.name: x.meta for x in io[s + 1].inputs}
            names = [n for n in self.boundary[s] if metas[n].requires_grad]
            for j, name in enumerate(names):
                out.append(self._msg("recv", frm, metas[name], ("B", s + 1, i, j), f"{a}: grad of {name}"))
        else:  # SEND_B: the grad of each received input that requires one (zeros when none reached it)
            metas = {x.name: x.meta for x in io[s].inputs}
            names = [n for n in self.boundary[s - 1] if metas[n].requires_grad]
            for j, name in enumerate(names):
                out.append(self._msg("send", to, metas[name], ("B", s, i, j), f"{a}: grad of {name}"))
        return out

    def _msg(self, op, group, meta: TensorMeta, message, label) -> CommCall:
        shape = self.shape(meta)
        return CommCall(group, op, self.numel(meta), meta.dtype, label, shape=shape, message=message)


# ------------------------------------------------------------------------------------------------
# Stage graphs: the tp / sp collectives

# op -> (forward calls, backward calls); each call (collective, which tensor's numel is the
# whole buffer: "out", or "out*tp" for the ops whose output is one rank's chunk)
_TP_CALLS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "copy_to_tp": ((), (("all_reduce(sum)", "out"),)),
    "reduce_from_tp": ((("all_reduce(sum)", "out"),), ()),
    "all_reduce": ((("all_reduce(op)", "out"),), ()),
    "reduce_scatter_seq": ((("reduce_scatter(sum)", "out*tp"),), (("all_gather", "out*tp"),)),
    "all_gather_seq": ((("all_gather", "out"),), (("reduce_scatter(sum)", "out"),)),
    "scatter_to_seq": ((), (("all_gather", "out*tp"),)),
    "gather_from_seq": ((("all_gather", "out"),), ()),
    # its kernel: all-reduce max of the rows' max, sum of exp, the target logit (fp32); backward local
    "vocab_parallel_cross_entropy": ((("all_reduce(max)", "rows"), ("all_reduce(sum)", "rows"),
                                      ("all_reduce(sum)", "rows")), ()),
}
_COMMUNICATING = set(TP_OPS) | {"all_reduce"}

# Context-parallel ops (runtime.kernels.context_parallel), calls on the cp group per node:
# (forward, backward), each call (collective, what its buffer is). A ring shift sends one block
# to the next rank and receives the previous rank's; every member makes the same shifts in the
# same order, so they are matched as calls of the group.
_CP_CALLS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "seq_to_heads": ((("all_to_all", "in"),), (("all_to_all", "in"),)),
    "heads_to_seq": ((("all_to_all", "in"),), (("all_to_all", "in"),)),
    "reduce_from_cp": ((("all_reduce(sum)", "out"),), ()),
    # forward: K and V stacked, cp - 1 steps; backward: K/V again (cp - 1 steps, interleaved with)
    # their fp32 gradients travelling (cp steps)
    "ring_attention": ((("ring_shift", "kv"),), (("ring_shift", "kv"), ("ring_shift", "dkv"))),
}
# Expert-parallel ops (runtime.kernels.expert_parallel) on the ep group, and the load-balancing
# averages on the data axis (the dp group's communicator): (forward, backward) calls per node,
# each (collective, which tensor is the whole buffer: "out" the node's, "in" its input's)
_EP_CALLS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "ep_dispatch": ((("all_gather", "out"),), (("reduce_scatter(sum)", "out"),)),
    "ep_combine": ((("reduce_scatter(sum)", "in"),), (("all_gather", "in"),)),
    "data_mean": ((("all_reduce(sum)", "out"),), (("all_reduce(sum)", "out"),)),
}
_TAGS = {"cp": "cp", "ep": "ep", "data": "dp"}
"""The leading word of an event's label -> the channel its call goes on (untagged: tp)."""
_ZERO3_EVENTS = ("zero3_forward", "zero3_backward", "zero3_reduce_scatter")
_GRAD = "grad"
"""The event of a parameter's gradient accumulation in a stage's backward events (its key: id(param))."""


class _Zero3Calls:
    """ZeRO-3's dp collectives of one rank: the gathers :class:`GatherSchedule` issues (one
    all-gather per site) and each site's reduce-scatter (fp32; HSDP: then an all-reduce across
    the replica groups), as :mod:`runtime.kernels.zero3` issues them."""

    def __init__(self, rank: "_RankModel", prefetch: int):
        self.r = rank
        plans = {s: m.meta[ZERO3_PLAN] for s, m in rank.p.modules.items() if ZERO3_PLAN in m.meta}
        c = rank.c
        self.on = bool(plans) and c.dp_cp > 1
        # HSDP: the shard group of consecutive dp ranks, the replicas across (group references)
        self.shard_group, self.replica_group = "zero3_shard", "zero3_replica"
        self.replicas = len(rank.groups["zero3_replica"])
        self.sites = {(site.stage, site.site): (site, plans[s]) for s, plan in plans.items() for site in plan.sites}
        self.savers: dict[int, dict[str, list[tuple[int, int]]]] = {}
        for (stage, _), (site, _) in sorted(self.sites.items()):
            for name in site.savers:
                self.savers.setdefault(stage, {}).setdefault(name, []).append((stage, site.site))
        self.schedule = GatherSchedule([site for site, _ in self.sites.values()], prefetch,
                                       keep=keeps_gathered(plans.values()))

    def calls(self, event: str, key: tuple[int, int], where: str) -> list[CommCall]:
        if event == "zero3_reduce_scatter":
            self.schedule.released(key)
            return self._per_site(key, "reduce_scatter(sum)", where, "grads of")
        issue = (self.schedule.forward if event == "zero3_forward" else self.schedule.backward)(key)
        return [c for k in issue for c in self._per_site(k, "all_gather", where, "gather of")]

    def _per_site(self, key, op: str, where: str, what: str) -> list[CommCall]:
        """One collective per site: every parameter's shard back to back (the runtime's layout)."""
        if not self.on:
            return []
        site, plan = self.sites[key]
        records = [plan.param(name) for name in site.params]
        n = sum(r.shard_numel for r in records)
        label = f"{where} zero3 {what} site {key[1]} ({len(records)} params)"
        out = []
        if op.startswith("reduce"):
            if plan.degree > 1:
                out.append(CommCall(self.shard_group, op, n * plan.degree, torch.float32, label, "dp"))
            if self.replicas > 1:
                out.append(CommCall(self.replica_group, "all_reduce(sum)", n, torch.float32,
                                    label + " across replicas", "dp"))
        elif plan.degree > 1:
            out.append(CommCall(self.shard_group, op, n * plan.degree, records[0].dtype, label, "dp"))
        return out

    def reset(self) -> None:
        self.schedule.reset()
assert _COMMUNICATING <= set(_TP_CALLS) <= set(SCHEMAS), "every communicating op needs its calls described here"


class _StageCollectives:
    """The tp collectives of one stage program, forward and backward, per micro-batch."""

    def __init__(self, stage: int, module: fx.GraphModule, rank: _RankModel):
        self.stage, self.module, self.rank = stage, module, rank
        self._grad_table: dict[int, dict[fx.Node, list]] = {}
        # what requires grad at run time: received boundary tensors as their contract says
        # (the stage's own analysis sees them as plain inputs), parameters, and what they reach
        inputs = [i.kind == "recv" and bool(i.meta.requires_grad) for i in rank.p.io[stage].inputs]
        flags = _requires_grad(module, inputs)
        self._fwd = self._walk(module, "", flags, backward=False)
        self._bwd = self._walk(module, "", flags, backward=True)
        self._flags = flags
        self._weight: list | None = None  # made when a split backward's W first asks

    def forward(self, where: str) -> list[CommCall]:
        return self._calls(self._fwd, where)

    def backward(self, where: str, on_grad: Callable[[int], list[CommCall]] | None = None) -> list[CommCall]:
        """The backward's calls; ``on_grad(id(parameter))``, where given, is called where the
        parameter's gradient is accumulated (its post-accumulate hook) and its calls inserted there."""
        return self._calls(self._bwd, where, on_grad)

    def weight(self, where: str) -> list[CommCall]:
        """The calls of a split backward's weight half (W, :func:`runtime.exec.split_backward.backward_weight`):
        the weight gradients unpack what the region saved, so each checkpointed region holding
        trainable parameters recomputes its forward again, the last region first (autograd runs
        the later nodes first)."""
        if self._weight is None:
            self._weight = []
            for node in reversed(_calls(self.module)):
                sub = _region(self.module, node)
                if sub is None or not self._flags.get(node, True) or not any(p.requires_grad for p in sub[1].parameters()):
                    continue
                inner = _requires_grad(sub[1], _region_inputs(node, self._flags))
                self._weight += self._region_recompute(sub[1], sub[0] + "/", inner)[1]
        return self._calls(self._weight, where)

    def _calls(self, events, where: str, on_grad: Callable[[int], list[CommCall]] | None = None) -> list[CommCall]:
        out = []
        # a parameter read in several places: autograd sums its gradients and accumulates once,
        # after the backward of its last use in backward order
        last = {n: k for k, (op, n, _, _) in enumerate(events) if op == _GRAD}
        for k, (op, n, dt, what) in enumerate(events):
            if op == _GRAD:
                if on_grad is not None and last[n] == k:
                    out += on_grad(n)
            elif op in _ZERO3_EVENTS:
                out += self.rank.zero3.calls(op, n, where)
            elif what.split(" ", 1)[0] in _TAGS:
                tag, rest = what.split(" ", 1)
                group = {"cp": self.rank.cp_group, "ep": self.rank.ep_group, "data": self.rank.dp_group}[tag]
                out.append(CommCall(group, op, n, dt, f"{where} {rest}", _TAGS[tag]))
            else:
                out.append(CommCall(self.rank.tp_group, op, n, dt, f"{where} {what}", "tp"))
        return out

    def output_meta(self) -> dict[str, TensorMeta]:
        """Each output of the stage by its contract name: the graph's own shape meta (what is sent)
        where it has one, else the contract's."""
        io = self.rank.p.io[self.stage]
        out = {o.name: o.meta for o in io.outputs}
        node = next((n for n in self.module.graph.nodes if n.op == "output"), None)
        values = node.args[0] if node is not None else ()
        values = values if isinstance(values, (tuple, list)) else (values,)
        for o, v in zip(io.outputs, values):
            meta = v.meta.get(SHAPE) if isinstance(v, fx.Node) else None
            if meta is not None and len(meta.tensors) == 1:
                out[o.name] = meta.tensors[0]
        return out

    def _walk(self, gm: fx.GraphModule, region: str, flags, *, backward: bool):
        """The collectives of ``gm``'s nodes: in node order (forward) or reversed (backward)."""
        nodes = _calls(gm)
        out: list[tuple[str, int, torch.dtype, str]] = []
        savers = self.rank.zero3.savers.get(self.stage, {}) if not region else {}
        for node in (reversed(nodes) if backward else nodes):
            if backward and node.name in savers:  # its backward unpacks a gathered parameter: gathered again
                out += [("zero3_backward", key, None, "") for key in savers[node.name]]
            out += self._node(gm, node, region, flags, backward=backward)
            if backward:
                out += self._grads(gm, node)
        return out

    def _grads(self, gm: fx.GraphModule, node: fx.Node):
        """The gradient accumulations that follow ``node``'s backward: each trainable parameter
        whose first reader in ``gm`` (in graph order) is ``node``. Autograd runs a parameter's
        AccumulateGrad (and its post-accumulate hook: a gradient bucket may launch) as soon as its
        gradient is complete, before any other backward node, so right after the backward of the
        last reader in backward order."""
        table = self._grad_table.get(id(gm))
        if table is None:
            table = self._grad_table[id(gm)] = {}
            position = _position(gm)
            for n in gm.graph.nodes:
                if n.op != "get_attr":
                    continue
                try:
                    param = gm.get_parameter(n.target)
                except AttributeError:
                    continue  # buffers, constants, submodules
                readers = [u for u in n.users if u.op in ("call_function", "call_module")]
                if param.requires_grad and readers:
                    table.setdefault(min(readers, key=position), []).append((_GRAD, id(param), None, ""))
        return table.get(node, [])

    def _node(self, gm: fx.GraphModule, node: fx.Node, region: str, flags, *, backward: bool):
        sub = _region(gm, node)
        if sub is not None:
            name = f"{region}{sub[0]}/"
            inner = _requires_grad(sub[1], _region_inputs(node, flags))
            if not backward:
                return self._walk(sub[1], name, inner, backward=False)
            return self._region_backward(sub[1], name, inner) if flags.get(node, True) else []
        op = op_name(node.target) if node.op == "call_function" else None
        if op == "zero3_gather":  # ZeRO-3: forward gather, or (backward) its gradients' reduce-scatter
            key = (int(node.args[4]), int(node.args[5]))
            return [("zero3_reduce_scatter" if backward else "zero3_forward", key, None, "")]
        if op in _CP_CALLS and not (backward and not flags.get(node, True)):
            return self._cp_calls(node, op, region, backward)
        if op in _EP_CALLS:
            if backward and not flags.get(node, True):
                return []
            tag = "data" if op == "data_mean" else "ep"
            what = f"{tag} {'grad of ' if backward else ''}{op} %{region}{node.name}"
            return [(collective, self.rank.numel(meta), meta.dtype, what)
                    for collective, size in _EP_CALLS[op][1 if backward else 0]
                    for meta in [self._meta(node.args[0] if size == "in" else node, op, region)]]
        if op is None or op not in _TP_CALLS or (backward and not flags.get(node, True)):
            return []
        return [self._call(node, op, collective, size, region, backward)
                for collective, size in _TP_CALLS[op][1 if backward else 0]]

    def _cp_calls(self, node: fx.Node, op: str, region: str, backward: bool):
        """The cp group's calls of a context-parallel node (events tagged ``cp``)."""
        degree = self.rank.c.cp
        if degree == 1:
            return []
        what = f"cp {'grad of ' if backward else ''}{op} %{region}{node.name}"
        if op == "ring_attention":
            k = self._meta(node.args[1], op, region)
            n = 2 * self.rank.numel(k)  # K and V stacked
            if not backward:
                return [("ring_shift", n, k.dtype, f"{what} K/V")] * (degree - 1)
            out = []
            for step in range(degree):  # the kernel's loop: the next K/V block, then the gradients' shift
                if step < degree - 1:
                    out.append(("ring_shift", n, k.dtype, f"{what} K/V"))
                out.append(("ring_shift", n, torch.float32, f"{what} dK/dV"))
            return out
        out = []
        for collective, size in _CP_CALLS[op][1 if backward else 0]:
            meta = self._meta(node.args[0] if size == "in" else node, op, region)
            out.append((collective, self.rank.numel(meta), meta.dtype, what))
        return out

    def _meta(self, node, op: str, region: str) -> TensorMeta:
        meta = node.meta.get(SHAPE) if isinstance(node, fx.Node) else None
        if meta is None or not meta.tensors:
            raise PassError(f"communication_check: the {op} node {region}{getattr(node, 'name', node)} has no shape "
                            f"meta (node.meta[{SHAPE!r}]); lower the program with passes.lowering.lower.lower, whose "
                            f"re-analysis annotates every node")
        return meta.tensors[0]

    def _region_backward(self, gm: fx.GraphModule, region: str, flags):
        """A checkpointed region's backward as torch's non-reentrant checkpoint runs it: the
        backward of its last nodes, then, at the first node whose saved tensors are needed
        (the last one that saved any), the recompute of its forward, which stops right after
        that node (torch's early stop), then the backward of the rest."""
        nodes = _calls(gm)
        last, recompute = self._region_recompute(gm, region, flags)
        out = list(recompute) if last == len(nodes) else []
        for k in reversed(range(len(nodes))):
            if k == last:
                out += recompute
            out += self._node(gm, nodes[k], region, flags, backward=True)
            out += self._grads(gm, nodes[k])
        return out

    def _region_recompute(self, gm: fx.GraphModule, region: str, flags) -> tuple[int, list]:
        """Where a checkpointed region's recompute stops (the index of its last node that saved
        tensors, :meth:`_region_backward`) and the calls of its forward up to there."""
        nodes = _calls(gm)
        if any(MEMORY not in n.meta for n in nodes):
            last = len(nodes)  # no saved-tensor facts: the whole forward is recomputed first
        else:
            last = max((k for k, n in enumerate(nodes) if n.meta[MEMORY].saved or n.meta[MEMORY].offloaded), default=-1)
        # a gather in the recompute runs inside backward: ZeRO-3 gathers it as backward does
        return last, [("zero3_backward" if op == "zero3_forward" else op, n, dt, _recomputed(what))
                      for node in nodes[:max(last, 0)]
                      for op, n, dt, what in self._node(gm, node, region, flags, backward=False)]

    def _call(self, node: fx.Node, op: str, collective: str, size: str, region: str, backward: bool):
        out = self._meta(node, op, region)
        n, dtype = self.rank.numel(out), out.dtype
        if size == "out*tp":
            n *= int(node.args[2])  # (x, dim, tp, group): the output is this rank's chunk
        elif size == "rows":
            dtype = torch.float32  # the kernel reduces the rows in fp32 whatever the logits' dtype
        if collective == "all_reduce(op)":
            collective = f"all_reduce({node.args[2] if len(node.args) > 2 else node.kwargs.get('op', 'sum')})"
        what = f"{'grad of ' if backward else ''}{op} %{region}{node.name}"
        if size == "rows":
            what += {"all_reduce(max)": " (row max)"}.get(collective, " (row sums)")
        return collective, n, dtype, what


def _position(gm: fx.GraphModule):
    """A node of ``gm`` -> its index in graph order (a sort key)."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    return order.__getitem__


def _recomputed(what: str) -> str:
    """The label of an event re-run by a checkpointed region's recompute; a cp, ep or data event
    keeps its leading tag, which is what puts its call on its group (:meth:`_StageCollectives._calls`)."""
    tag, _, rest = what.partition(" ")
    return f"{tag} recompute {rest}" if tag in _TAGS else f"recompute {what}"


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]


def _region(gm: fx.GraphModule, node: fx.Node) -> tuple[str, fx.GraphModule] | None:
    """A checkpointed region called by ``node`` (``checkpoint(get_attr region, ...)``) or a
    GraphModule it calls: (its name, the module); else None."""
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        return (node.target, sub) if isinstance(sub, fx.GraphModule) else None
    if node.target is torch.utils.checkpoint.checkpoint and node.args and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "get_attr":
        sub = gm.get_submodule(node.args[0].target)
        return (node.args[0].target, sub) if isinstance(sub, fx.GraphModule) else None
    return None


def _region_inputs(node: fx.Node, flags: Mapping[fx.Node, bool]) -> list[bool]:
    """Whether each placeholder of the region ``node`` calls gets a tensor that requires grad."""
    args = node.args[1:] if node.op == "call_function" else node.args
    return [isinstance(a, fx.Node) and flags.get(a, False) for a in args]


def _requires_grad(gm: fx.GraphModule, inputs: Sequence[bool]) -> dict[fx.Node, bool]:
    """Per node of ``gm``: whether its output requires grad when its placeholders do as
    ``inputs`` say (parameters: as they are; a computed node: some input does, it makes a
    floating-point tensor and it is not one of :data:`_NO_GRAD`; a region: some of its outputs do)."""
    flags: dict[fx.Node, bool] = {}
    given = iter(inputs)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            flags[n] = next(given, False)
        elif n.op == "get_attr":
            try:
                flags[n] = gm.get_parameter(n.target).requires_grad
            except AttributeError:
                flags[n] = False  # buffers, constants, submodules
        elif n.op != "output":
            sub = _region(gm, n)
            if sub is not None:
                inner = _requires_grad(sub[1], _region_inputs(n, flags))
                out = next(m for m in sub[1].graph.nodes if m.op == "output")
                flags[n] = any(inner.get(m, False) for m in out.all_input_nodes)
            else:
                flags[n] = (any(flags.get(a, False) for a in n.all_input_nodes) and _floating(n)
                            and getattr(n.target, "overloadpacket", None) not in _NO_GRAD)
    return flags


_NO_GRAD = {torch.ops.aten.zeros_like, torch.ops.aten.ones_like, torch.ops.aten.empty_like, torch.ops.aten.full_like,
            torch.ops.aten.new_zeros, torch.ops.aten.new_ones, torch.ops.aten.new_empty, torch.ops.aten.new_full,
            torch.ops.aten.detach}
"""Ops whose output carries no gradient whatever their input (they read its shape, not its values):
e.g. a load-balancing loss's count of chosen experts, scattered into ``zeros_like(probs)``."""


def _floating(node: fx.Node) -> bool:
    meta = node.meta.get(SHAPE)
    return meta is None or any(t.dtype.is_floating_point for t in meta.tensors)


def _dims(program: RankProgram) -> dict[str, int]:
    """The named dims of one micro-batch: the stage programs' capture dims (concrete after
    ``specialize_dims``), batch the config's micro-batch size."""
    for m in program.modules.values():
        info = m.meta.get(CAPTURE)
        if info is not None:
            return {**dict(info.dims), "batch": program.config.micro_batch_size}
    return {"batch": program.config.micro_batch_size}


# ------------------------------------------------------------------------------------------------
# Gradient sync and the optimizer step (runtime.exec.parallel_model / runtime.optim.grad_sync)

class _GradSync:
    """The dp buckets, tied weights and sequence-parallel gradients of one rank, launched as the
    runtime launches them (see :class:`runtime.optim.grad_sync.BucketedGradSync`)."""

    def __init__(self, rank: _RankModel, *, experts: bool = False):
        self.r = rank
        p, c = rank.p, rank.c
        named = _named_parameters(p.modules.values())
        # ep: the experts this rank holds average over the ranks holding the same experts, in
        # buckets of their own (ParallelModel.expert_buckets), finished after the dp buckets
        held = {id(named[n]) for n in p.expert_params if n in named}
        everything = unique_params(p.modules.values())
        self.position = {id(q): k for k, q in enumerate(everything)}  # parameter order (buckets fill it reversed)
        self.is_experts = experts
        self.params = [q for q in everything if (id(q) in held) == experts]
        self.tied = [] if experts else _tied_syncs(rank, p)
        self.sp = [] if experts else [named[n] for n in p.sp_grad_params]
        late = {id(q) for t in self.tied for q in t[3]} | {id(q) for q in self.sp}
        # gradients average over dp x cp (an ep rank's experts: over their replicas)
        self.zero, self.dp = c.zero_stage, c.expert_replicas if experts else c.dp_cp
        self.group, self.channel, self.what = ((rank.expert_dp_group, "expert_dp", "expert bucket") if experts
                                               else (rank.dp_group, "dp", "dp bucket"))
        self.experts = _GradSync(rank, experts=True) if held and not experts else None
        # ZeRO-3 averages in backward (the gathers' reduce-scatters): no buckets
        self.mode = MODE_OF_ZERO_STAGE.get(c.zero_stage, "none")
        shard = self.mode not in ("all_reduce", "none")
        self.buckets: tuple[BucketSpec, ...] = ()
        if (self.dp > 1 or self.zero) and self.mode != "none" and self.params:
            slots = [GradSlot(q.numel(), q.dtype, id(q) in late) for q in self.params]
            self.buckets = bucket_layout(slots, size=self.dp, shard=shard, bucket_bytes=rank.bucket_bytes)
        # which local stages hold each parameter, and its accumulations per step (B and W actions)
        self.holders: dict[int, list[int]] = {}
        mine = {id(q) for q in self.params}
        for s, m in p.modules.items():
            for q in {id(q): q for q in m.parameters() if q.requires_grad and id(q) in mine}.values():
                self.holders.setdefault(id(q), []).append(s)
        counts: dict[int, int] = {}
        for a in p.actions:
            if a.kind.value in ("B", "W"):
                counts[a.stage] = counts.get(a.stage, 0) + 1
        self.expected = {k: sum(counts.get(s, 0) for s in ss) for k, ss in self.holders.items()}
        overlap = rank.overlap and (self.dp > 1 or shard)
        self.member = member = {id(q): i for i, q in enumerate(self.params)}
        self.member_of_stage: dict[int, list[int]] = {}
        for key, stages in self.holders.items():
            for s in stages:
                self.member_of_stage.setdefault(s, []).append(member[key])
        self.machine = BucketMachine(self.buckets, self.mode if self.mode != "none" else "all_reduce",
                                     expected={member[k]: n for k, n in self.expected.items()},
                                     hooked=overlap, overlap=overlap)

    def _calls(self, steps: Sequence[Launch | Retire]) -> list[CommCall]:
        """The collectives of the machine's launches (waits issue none)."""
        out: list[CommCall] = []
        for step in steps:
            if not isinstance(step, Launch) or self.dp == 1:
                continue
            b, k = self.buckets[step.bucket], step.bucket
            if self.mode == "all_reduce":
                out.append(CommCall(self.group, "all_reduce(sum)", b.numel, b.dtype, f"{self.what} {k}", self.channel))
            else:
                out.append(CommCall(self.group, "reduce_scatter(sum)", b.numel, torch.float32,
                                    f"{self.what} {k}" + (f" round {step.round}" if self.mode == "reduce_scatter_each"
                                                          else ""), self.channel))
        return out

    def param(self, stage: int, key: int, done: set[int]) -> list[CommCall]:
        """In a backward action of ``stage``: the parameter ``id(param) == key`` got its gradient
        (its post-accumulate hook fires now, mid-backward); ``done`` collects the members so."""
        m = self.member.get(key)
        if m is None and self.experts is not None:
            return self.experts.param(stage, key, done)
        if not self.buckets or m is None or self._mark(m) in done or m not in self.member_of_stage.get(stage, ()):
            return []
        done.add(self._mark(m))
        return self._calls(self.machine.accumulated(m))

    def _mark(self, m: int) -> object:
        """How member ``m`` is recorded in a ``done`` set the dp and expert buckets share."""
        return ("expert", m) if self.is_experts else m

    def accumulated(self, stage: int, done: set[int]) -> list[CommCall]:
        """The end of a backward (or weight-gradient) action of ``stage``: its parameters not in
        ``done`` (those a backward placed where it makes their gradient) got one gradient, in
        reverse parameter order, the buckets' (a weight-gradient action accumulates in that order:
        :func:`runtime.exec.split_backward.backward_weight`)."""
        pending = [(sync, m) for sync in (self, self.experts) if sync is not None and sync.buckets
                   for m in sync.member_of_stage.get(stage, ()) if sync._mark(m) not in done]
        pending.sort(key=lambda sm: -self.position[id(sm[0].params[sm[1]])])
        out: list[CommCall] = []
        for sync, m in pending:
            out += sync._calls(sync.machine.accumulated(m))
        return out

    def finish(self) -> list[CommCall]:
        """The ALL_REDUCE action (ParallelModel._grad_sync)."""
        if not self.buckets:
            return self._sp() + self._tied()
        out = self._calls(self.machine.finish_early())
        out += self._tied() + self._sp()
        out += self._calls(self.machine.finish_late())
        self.machine.reset()
        return out + (self.experts.finish() if self.experts is not None else [])

    def _tied(self) -> list[CommCall]:
        return [CommCall(group, "all_reduce(sum)", n, dtype, f"tied weight {name}", "pipeline")
                for name, group, (n, dtype), _ in self.tied if group is not None]

    def _sp(self) -> list[CommCall]:
        if not self.sp:
            return []
        return [CommCall(self.r.tp_group, "all_reduce(sum)", sum(q.numel() for q in self.sp), self.sp[0].dtype,
                         f"sequence-parallel grads ({len(self.sp)} params)", "tp")]

    def step(self) -> list[CommCall]:
        """The STEP action (ParallelModel._step, then the optimizer)."""
        out: list[CommCall] = []
        world = self.r.world
        if self.r.c.dtype == "fp16":
            out.append(CommCall(world, "all_reduce(max)", 1, torch.float32, "fp16 overflow flag", "world"))
        if len(self.r.groups[world]) > 1:
            out.append(CommCall(world, "all_reduce(sum)", 1, torch.float64, "global gradient norm", "world"))
        return out + self._publish()

    def _publish(self) -> list[CommCall]:
        """ZeRO-1/2's all-gathers of the updated chunks (ShardedOptimizer.publish): the dp
        buckets', then the expert buckets' over the ranks holding the same experts."""
        out = []
        if self.zero in (1, 2) and self.r.c.offload != "optimizer" and self.dp > 1:
            out = [CommCall(self.group, "all_gather", b.numel, b.dtype, f"{self.what} {k} updated chunks", self.channel)
                   for k, b in enumerate(self.buckets)]
        return out + (self.experts._publish() if self.experts is not None else [])


def _named_parameters(modules: Iterable[fx.GraphModule]) -> dict[str, nn.Parameter]:
    """ParallelModel.named_parameters: by name, without the re-listing of checkpointed regions."""
    out = {}
    for module in modules:
        regions = {n for n, child in module.named_children() if isinstance(child, fx.GraphModule)}
        for name, q in module.named_parameters(remove_duplicate=False):
            if name.split(".", 1)[0] not in regions:
                out[name] = q
    return out


def _tied_syncs(rank: _RankModel, p: RankProgram):
    """ParallelModel._tied_copies: (name, group or None, (numel, dtype), local copies) of every
    tied weight this rank syncs."""
    pp = rank.c.pp
    out = []
    for name, tied in sorted(p.tied.items()):
        holders = sorted({rank.c.stage_rank(s) for s in tied.stages})
        copies = tied.copies(p.modules)
        if len(holders) == 1:
            group = None
        elif holders == [0, pp - 1]:
            group = "pipeline_ends"  # the pipeline's ends (with pp = 2 the pipeline group itself)
        else:
            group = "pipeline"
        whole = group is not None and rank.groups[group] == rank.groups["pipeline"]
        if copies or (whole and len(holders) > 1):
            n = 1
            for d in tied.local_shape:
                n *= int(d)
            out.append((name, group, (n, tied.dtype), copies))
    return out


# ------------------------------------------------------------------------------------------------
# Matching

@dataclass(frozen=True)
class _Problem:
    title: str
    detail: str
    grid: str


def check_communication(programs: Sequence[RankProgram], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        overlap_grad_sync: bool = True, zero3_prefetch: int = ZERO3_PREFETCH) -> CommunicationSummary:
    """Check that the rank programs of one plan (every rank of its mesh) issue matching
    communication (see the module docstring); returns what was checked, or raises
    :class:`CommunicationMismatchError`. ``bucket_bytes`` (bytes), ``overlap_grad_sync``: the
    runtime's gradient-sync settings; ``zero3_prefetch``: its ZeRO-3 prefetch depth. Raises :class:`ConfigError` when ``programs`` is not
    exactly one program per rank of the mesh."""
    start = time.perf_counter()
    by_rank = _by_rank(programs)
    p0 = next(iter(by_rank.values()))
    mesh = _MeshGroups(p0.config, p0.first)
    # a rank's calls are a function of its program and the sizes of its groups, its groups given by
    # reference: the ranks running the same program (data-parallel replicas) share one computation
    templates: dict[tuple, _Template] = {}
    ranks: dict[int, tuple[_Template, dict]] = {}
    for r, p in by_rank.items():
        groups = mesh.of(r)
        key = _program_key(p, groups)
        if key not in templates:
            model = _RankModel(p, bucket_bytes, overlap_grad_sync, zero3_prefetch, mesh_groups=mesh)
            templates[key] = _Template(model.calls())
        ranks[r] = (templates[key], groups)
    problems = _template_collective_problems(ranks) + _template_p2p_problems(ranks, p0.config, p0.first)
    if problems:
        raise CommunicationMismatchError(_message(problems, p0.config))
    groups = {(channel, g[ref]) for t, g in ranks.values() for channel, refs in t.refs.items() for ref in refs}
    return CommunicationSummary(ranks=len(ranks), groups=len(groups),
                                collectives=sum(t.collectives for t, _ in ranks.values()),
                                messages=sum(t.sends for t, _ in ranks.values()), seconds=time.perf_counter() - start)


def _program_key(p: RankProgram, groups: Mapping[object, tuple[int, ...]]) -> tuple:
    """What :class:`_RankModel` reads of a rank's program besides its place in the mesh: two
    ranks with the same key issue the same calls on their own groups. Modules and contracts are
    compared by identity (a lowering hands the replicas of a program the same objects; an edited
    copy is another program), the rest by value; with the sizes of the rank's groups."""
    return (p.config, p.first, tuple((s, id(m)) for s, m in p.modules.items()), id(p.io), p.actions,
            tuple(sorted(p.tied.items())), p.expert_params, p.sp_grad_params,
            tuple((ref, len(g)) for ref, g in groups.items() if isinstance(ref, str)))


class _Template:
    """One program's calls, their groups by reference (:class:`_MeshGroups`), and what the
    matching asks of them, each worked out once for every rank that runs the program."""

    def __init__(self, calls: Sequence[CommCall]):
        self.calls = tuple(calls)
        self.refs: dict[str, set] = {}  # channel -> the references its collectives use
        self.peers: set = set()  # the p2p references
        for c in self.calls:
            if c.is_p2p:
                self.peers.add(c.group)
            else:
                self.refs.setdefault(c.channel, set()).add(c.group)
        self.collectives = sum(1 for c in self.calls if not c.is_p2p)
        self.sends = sum(1 for c in self.calls if c.op == "send")
        self._on: dict[tuple, list[CommCall]] = {}

    def on(self, channel: str, refs: frozenset) -> list[CommCall]:
        """The collectives on ``channel`` over the references ``refs`` (one group of a rank), in order."""
        key = (channel, refs)
        if key not in self._on:
            self._on[key] = [c for c in self.calls if not c.is_p2p and c.channel == channel and c.group in refs]
        return self._on[key]

    def messages(self, ref) -> list[CommCall]:
        key = ("p2p", ref)
        if key not in self._on:
            self._on[key] = [c for c in self.calls if c.is_p2p and c.group == ref]
        return self._on[key]


def _template_collective_problems(ranks: Mapping[int, tuple[_Template, dict]]) -> list[_Problem]:
    """:func:`_collective_problems` over every rank, from the ranks' templates: each group's
    members' calls are compared once per distinct (template, references) among them."""
    members: dict[tuple[str, tuple[int, ...]], dict[int, set]] = {}
    for r, (t, groups) in ranks.items():
        for channel, refs in t.refs.items():
            for ref in refs:
                members.setdefault((channel, groups[ref]), {}).setdefault(r, set()).add(ref)
    verdicts: dict[frozenset, bool] = {}
    problems = []
    for channel, group in sorted(members, key=lambda g: (len(g[1]), g[1], g[0])):
        on = members[(channel, group)]
        views = {r: (ranks[r][0], frozenset(on.get(r, ()))) for r in group}
        distinct = frozenset((id(t), refs) for t, refs in views.values())
        if distinct not in verdicts:
            seqs = {tuple(c.signature for c in t.on(channel, refs)) for t, refs in set(views.values())}
            verdicts[distinct] = len(seqs) == 1
        if not verdicts[distinct]:
            problem = _group_problem(channel, group, {r: t.on(channel, refs) for r, (t, refs) in views.items()})
            if problem is not None:
                problems.append(problem)
    return problems


def _template_p2p_problems(ranks: Mapping[int, tuple[_Template, dict]], config, first: int) -> list[_Problem]:
    """:func:`_p2p_problems` over every rank, from the ranks' templates: a pair's messages are
    matched once per (sender's template, receiver's template, their pipeline ranks)."""
    pairs = {groups[ref] for t, groups in ranks.values() for ref in t.peers}  # (sender, receiver)
    verdicts: dict[tuple, bool] = {}
    problems = []
    for src, dst in sorted(pairs):
        p_src = mesh_coords(src, dp=config.dp_cp, tp=config.tp, first=first)[0]
        p_dst = mesh_coords(dst, dp=config.dp_cp, tp=config.tp, first=first)[0]
        (ts, _), (td, _) = ranks[src], ranks[dst]
        out, got = ts.messages(("to", p_dst)), td.messages(("from", p_src))
        key = (id(ts), p_dst, id(td), p_src)
        if key not in verdicts:
            verdicts[key] = _pair_problem(src, dst, out, got) is None
        if not verdicts[key]:
            problems.append(_pair_problem(src, dst, out, got))
    return problems


def check_calls(calls: Mapping[int, RankCalls], *, config: object, start: float | None = None) -> CommunicationSummary:
    """:func:`check_communication` from every rank's calls (:func:`rank_calls`), e.g. gathered
    from the processes that each lowered their own program; ``config``: the plan's, named in the
    error. ``start``: :func:`time.perf_counter` when the check began (the summary's seconds)."""
    start = time.perf_counter() if start is None else start
    calls = dict(sorted(calls.items()))
    problems = _collective_problems(calls) + _p2p_problems(calls)
    if problems:
        raise CommunicationMismatchError(_message(problems, config))
    groups = {(c.channel, c.group) for rc in calls.values() for c in rc.calls if not c.is_p2p}
    return CommunicationSummary(
        ranks=len(calls), groups=len(groups),
        collectives=sum(1 for rc in calls.values() for c in rc.calls if not c.is_p2p),
        messages=sum(1 for rc in calls.values() for c in rc.calls if c.op == "send"),
        seconds=time.perf_counter() - start)


def check_lowering(lowering: _Lowering, *, first: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   overlap_grad_sync: bool = True, zero3_prefetch: int = ZERO3_PREFETCH) -> CommunicationSummary:
    """:func:`check_communication` of every rank program of ``lowering`` (a
    :class:`passes.lowering.lower.Lowering` of every (stage, tp rank) program), its mesh from ``first``."""
    world = lowering.config.world_size  # type: ignore[attr-defined]
    return check_communication([lowering.rank_program(r, first=first) for r in range(first, first + world)],
                               bucket_bytes=bucket_bytes, overlap_grad_sync=overlap_grad_sync,
                               zero3_prefetch=zero3_prefetch)


@dataclass(frozen=True, slots=True)
class LoweredRank:
    """What the process of one rank lowered, as it tells the others before the first step: each
    process lowers only its own rank's programs, and the ranks check the whole plan from these."""

    rank: int
    plan: str
    """A digest of the plan's config: every rank must have lowered the same plan."""
    programs: tuple[tuple[int, int], ...]
    """The (stage, tp rank) programs it lowered: ranks with the same ones (dp peers) must agree on
    ``digest``."""
    digest: str
    """:meth:`passes.lowering.lower.Lowering.digest` of those programs."""
    calls: RankCalls


def check_lowered_ranks(ranks: Sequence[LoweredRank], *, config: object) -> CommunicationSummary:
    """Check, from every rank's :class:`LoweredRank` of one plan (``config``), that the processes
    lowered the same plan, that ranks running the same programs lowered them alike, and that the
    calls match (:func:`check_calls`). Raises :class:`CommunicationMismatchError` naming the ranks.

    A lowering that depends on something that differs between processes (an address, a hash
    seed) would give ranks different programs whose collectives could still pair up: wrong
    results and no error. The digests catch that between ranks that run the same programs."""
    start = time.perf_counter()
    plans = _ranks_by(ranks, lambda r: r.plan)
    if len(plans) > 1:
        raise CommunicationMismatchError(
            f"the ranks lowered different plans ({_groups(plans)}); nothing was run. Give every rank the same "
            f"plan (one plan.json, or the plan rank 0 chose, as auto_parallelize does)")
    for programs, peers in _ranks_by(ranks, lambda r: r.programs).items():
        digests = _ranks_by(peers, lambda r: r.digest)
        if len(digests) > 1:
            raise CommunicationMismatchError(
                f"the ranks lowered the same plan to different programs ({_groups(digests)}, each lowering "
                f"(stage, tp rank) programs {list(programs)}); nothing was run. The lowering is not deterministic "
                f"across processes (a pass decided by something like an address or a hash seed): lower the "
                f"plan.json in two processes (partitioner lower --plan plan.json --dump-dir A, then --dump-dir B) "
                f"and compare the trees (python -m ir_dumps diff A B)")
    return check_calls({r.rank: r.calls for r in ranks}, config=config, start=start)


def _ranks_by(ranks: Sequence[LoweredRank], key) -> dict:
    out: dict = {}
    for r in ranks:
        out.setdefault(key(r), []).append(r)
    return out


def _groups(by: Mapping[str, list[LoweredRank]]) -> str:
    return "; ".join(f"ranks {sorted(r.rank for r in rs)} lowered {digest}" for digest, rs in by.items())


def _by_rank(programs: Sequence[RankProgram]) -> dict[int, RankProgram]:
    if not programs:
        raise ConfigError("check_communication: no rank programs given; pass every rank's program of the plan")
    p0 = programs[0]
    want = list(range(p0.first, p0.first + p0.config.world_size))
    by_rank: dict[int, RankProgram] = {}
    for p in programs:
        if p.rank in by_rank:
            raise ConfigError(f"check_communication: two programs of rank {p.rank}; pass one per rank")
        by_rank[p.rank] = p
    if sorted(by_rank) != want:
        missing = sorted(set(want) - set(by_rank))
        extra = sorted(set(by_rank) - set(want))
        raise ConfigError(f"check_communication: the plan's mesh is ranks {want[0]}..{want[-1]}; programs "
                          f"missing for {missing}, outside it {extra}; pass exactly one program per rank "
                          f"(Lowering.rank_program of each, or check_lowering)")
    return dict(sorted(by_rank.items()))


def describe_group(group: tuple[int, ...], channel: str) -> str:
    """``tp group (0, 1)``, ``dp group (0, 2)``, ``pipeline group (0, 4)``, ``world group (0..7)``."""
    if channel == "world":
        return f"world group ({group[0]}..{group[-1]})"
    return f"{channel} group {group}"


def _collective_problems(calls: Mapping[int, RankCalls]) -> list[_Problem]:
    per_group: dict[tuple[str, tuple[int, ...]], dict[int, list[CommCall]]] = {}
    for r, rc in calls.items():
        for c in rc.calls:
            if not c.is_p2p:
                per_group.setdefault((c.channel, c.group), {}).setdefault(r, []).append(c)
    problems = []
    for channel, group in sorted(per_group, key=lambda g: (len(g[1]), g[1], g[0])):
        problem = _group_problem(channel, group, {r: per_group[(channel, group)].get(r, []) for r in group})
        if problem is not None:
            problems.append(problem)
    return problems


def _group_problem(channel: str, group: tuple[int, ...], seqs: Mapping[int, list[CommCall]]) -> _Problem | None:
    """The first disagreement between the members' calls ``seqs`` on one group, or None."""
    n = max(len(s) for s in seqs.values())
    k = next((k for k in range(n) if len({_sig(seqs[r], k) for r in group}) > 1), None)
    if k is None:
        return None
    variants: dict[object, list[int]] = {}
    for r in group:
        variants.setdefault(_sig(seqs[r], k), []).append(r)
    # the call most members make is the reference; the others disagree
    ref = max(variants.values(), key=len)
    lines = []
    for sig, ranks in variants.items():
        call = seqs[ranks[0]][k] if k < len(seqs[ranks[0]]) else None
        what = str(call) if call is not None else "nothing (its calls on this group end here)"
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {what}")
    odd = [r for r in group if r not in ref]
    title = (f"{describe_group(group, channel)}: call {k} differs between its members (rank"
             f"{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} against "
             f"{', '.join(map(str, ref))}); {len(seqs[group[0]])} vs "
             f"{', '.join(str(len(seqs[r])) for r in group[1:])} calls on it")
    columns = {f"rank {r}": [_cell(c) for c in seqs[r]] for r in group}
    return _Problem(title, "\n".join(lines), format_call_grid(columns, k))


def _sig(seq: list[CommCall], k: int):
    return seq[k].signature if k < len(seq) else None


def _p2p_problems(calls: Mapping[int, RankCalls]) -> list[_Problem]:
    sends: dict[tuple[int, int], list[CommCall]] = {}
    recvs: dict[tuple[int, int], list[CommCall]] = {}
    for r, rc in calls.items():
        for c in rc.calls:
            if c.op == "send":
                sends.setdefault(c.group, []).append(c)
            elif c.op == "recv":
                recvs.setdefault(c.group, []).append(c)
    problems = []
    for pair in sorted(set(sends) | set(recvs)):
        problem = _pair_problem(*pair, sends.get(pair, []), recvs.get(pair, []))
        if problem is not None:
            problems.append(problem)
    return problems


def _pair_problem(src: int, dst: int, out: Sequence[CommCall], got: Sequence[CommCall]) -> _Problem | None:
    """The messages rank ``src`` sends rank ``dst`` (``out``) against those ``dst`` receives
    from ``src`` (``got``): each send needs one receive of the same message, shape and dtype."""
    issues: list[tuple[str, int | None, int | None]] = []  # (text, send index, recv index)
    by_msg: dict[tuple, list[int]] = {}
    for j, c in enumerate(got):
        by_msg.setdefault(c.message, []).append(j)
    used: set[int] = set()
    for i, c in enumerate(out):
        match = [j for j in by_msg.get(c.message, []) if j not in used]
        if not match:
            issues.append((f"rank {src} sends {_tensor(c)} to rank {dst}, which never receives it", i, None))
            continue
        j = match[0]
        used.add(j)
        r = got[j]
        if (r.shape, r.dtype) != (c.shape, c.dtype):
            issues.append((f"rank {src} sends {_tensor(c)}, but rank {dst} receives it as {_tensor(r)}", i, j))
    for j, r in enumerate(got):
        if j not in used:
            issues.append((f"rank {dst} receives {_tensor(r)} from rank {src}, which never sends it", None, j))
    if not issues:
        return None
    text, i, j = issues[0]
    columns = {f"rank {src} sends to {dst}": [_cell(c) for c in out],
               f"rank {dst} receives from {src}": [_cell(c) for c in got]}
    marks = {f"rank {src} sends to {dst}": i, f"rank {dst} receives from {src}": j}
    row = min(x for x in (i, j) if x is not None)
    more = f"\n  ({len(issues) - 1} more on this pair)" if len(issues) > 1 else ""
    return _Problem(f"point-to-point rank {src} -> rank {dst}: {len(issues)} unmatched message"
                    f"{'s' if len(issues) > 1 else ''}", "  " + text + more,
                    format_call_grid(columns, row, marks=marks))


def _message(problems: list[_Problem], config: object) -> str:
    first = problems[0]
    head = (f"communication check: the plan's rank programs do not match ({len(problems)} group"
            f"{'s' if len(problems) > 1 else ''} or rank pair{'s' if len(problems) > 1 else ''}); running them "
            f"would hang or mix tensors of different calls.\n\n{first.title}:\n{first.detail}\n\n{first.grid}")
    others = "".join(f"\nalso: {p.title}" for p in problems[1:6])
    if len(problems) > 6:
        others += f"\n... and {len(problems) - 6} more"
    config = config.text() if hasattr(config, "text") else str(config)
    return head + others + "\n\n" + _WHAT_TO_DO.format(config=config)


# ------------------------------------------------------------------------------------------------
# The grid

def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tensor(c: CommCall) -> str:
    return f"{list(c.shape)} {_dtype(c.dtype)} ({c.label})"


def _cell(c: CommCall) -> str:
    size = "x".join(map(str, c.shape)) if c.is_p2p else str(c.numel)
    op = {"all_reduce(sum)": "AR+", "all_reduce(max)": "ARmax", "reduce_scatter(sum)": "RS+", "all_gather": "AG",
          "send": "send", "recv": "recv"}.get(c.op, c.op)
    return f"{op} {size} {_dtype(c.dtype)} {c.label}"


def format_call_grid(columns: Mapping[str, Sequence[str]], row: int, *, marks: Mapping[str, int | None] | None = None,
                     context: int = 4, width: int = 64, note: str = "first disagreement") -> str:
    """A call-index (row) x rank (column) table of the calls in ``columns`` (column title ->
    cell texts, in issue order), rows ``row - context .. row + context`` of it; the cells of
    ``marks`` (title -> row; default every column at ``row``) are written ``[cell]`` (``[end]``
    past a column's last call) and their row gets ``<- note``. Cells are cut to ``width``."""
    marks = dict(marks) if marks is not None else {t: row for t in columns}
    n = max([len(v) for v in columns.values()] + [r + 1 for r in marks.values() if r is not None] + [1])
    lo, hi = max(0, row - context), min(n, row + context + 1)

    def cell(title: str, k: int) -> str:
        cells = columns[title]
        text = cells[k] if k < len(cells) else ""
        text = text if len(text) <= width else text[:width - 3] + "..."
        return f"[{text or 'end'}]" if marks.get(title) == k else text

    label_w = len(f"call {n - 1}")
    titles = list(columns)
    body = [[cell(t, k) for t in titles] for k in range(lo, hi)]
    widths = [max([len(t)] + [len(r[j]) for r in body]) for j, t in enumerate(titles)]
    lines = [" " * label_w + " | " + " | ".join(t.ljust(w) for t, w in zip(titles, widths))]
    if lo > 0:
        lines.append(f"{'...'.ljust(label_w)} | ({lo} earlier calls agree)")
    for k, cells in zip(range(lo, hi), body):
        line = f"call {k}".ljust(label_w) + " | " + " | ".join(c.ljust(w) for c, w in zip(cells, widths))
        if any(m == k for m in marks.values()):
            line += f"   <- {note}"
        lines.append(line.rstrip())
    if hi < n:
        lines.append(f"{'...'.ljust(label_w)} | ({n - hi} later calls)")
    return "\n".join(lines) + "\n"


__all__ = ["CommCall", "RankCalls", "CommunicationSummary", "CommunicationMismatchError", "rank_calls",
           "check_communication", "check_lowering", "describe_group", "format_call_grid"]
