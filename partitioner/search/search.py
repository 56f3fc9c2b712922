"""Plan search: the fastest dp × tp × pp × cp × micro-batching × schedule × ZeRO × checkpointing ×
offload plan whose every device fits in memory, under the cost model of ``cost_model``.

Rank layout (Megatron order): tensor-parallel ranks are adjacent (``tp`` innermost, so a TP group
stays in one node when ``tp <= devices_per_node``), then context-parallel, then data-parallel,
then pipeline stages: ``rank = stage * dp * cp * tp + (dp_rank * cp + cp_rank) * tp + tp_rank``.

The cost of one candidate (its stage split, memory and step time) is :mod:`partitioner.search.plan_cost`;
the search enumerates and prunes the candidates and returns the best as a :class:`Plan`.

Pruning: tp divides the heads and (unless fixed) divides the devices of a node, so every TP
group stays inside one node; pp ≤ layers; cp > 1 for a model whose attention the cp rewrite
cuts (:attr:`ModelProfile.context_parallel`), with ``2·cp`` dividing the sequence and (unless
fixed) the tp·cp ranks inside one node, Ulysses only when tp·cp divides the heads, sequence
parallelism only when the model names a sequence dim that tp·cp divides (the lowering's rule,
:func:`passes.rewrites.sequence_parallel.sequence_parallel_refusal`); ``tensor`` checkpointing only when
the profile priced it (asked for when pinned: its MILP runs over the whole graph); a cp > 1
candidate whose micro-batch divides by cp is left out when its cp = 1 twin (``dp·cp`` replicas of
``mbs/cp`` samples: the same tokens per rank, kernels and model state, no exchanges) is a
candidate, so the cp candidates left give a rank a share of the micro-batch that is not whole
samples (what data parallelism cannot); micro-batch sizes
are divisors of the per-replica batch up to :data:`MAX_MICRO_BATCH`; interleaved needs
``layers % (p·v) == 0`` and ``m % p == 0``. Candidates are evaluated in order of a lower bound on
their step time (perfect balance, no dp/optimizer cost) and the search stops once that bound
exceeds the best plans found (branch and bound), so the result equals exhaustive search.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from typing import Callable, Sequence

from partitioner.cost.cluster import Cluster
from partitioner.cost.cost_model import bubble_fraction
from partitioner.inputs.knobs import check_fix, fix_text
from partitioner.search.plan_cost import Evaluated, PlanContext, evaluate, lower_bound, state_lower_bound
from partitioner.search.profile import ModelProfile
from passes.ir.config import (CHECKPOINTING, CP_MODES, KNOBS, OFFLOAD, SCHEDULES, ZERO_STAGES, ParallelConfig,
                              compile_refusals, expert_parallel_refusals, knob_conflicts)
from passes.ir.errors import ConfigError, InfeasiblePlanError
from passes.ir.meta import InputSpec
from passes.ir.plan import Alternative, Plan, Prediction, format_bytes
from passes.rewrites.sequence_parallel import SEQ_DIM, sequence_parallel_refusal

MAX_MICRO_BATCH = 16
"""Largest micro-batch size tried unless fixed (larger ones gain little kernel efficiency)."""
MAX_VIRTUAL_PP = 8
N_ALTERNATIVES = 4
N_CHECKED = 3
"""Fastest candidates whose memory ``check`` may drop before the search gives up."""


_OFFLOAD_ORDER = ("none", "optimizer", "activations")  # the tie-break's order: cheaper to run first


def _key(c: ParallelConfig) -> tuple:
    """Stable tie-break: simpler plans first (less parallelism, no offload, no recompute)."""
    return (_OFFLOAD_ORDER.index(c.offload), CHECKPOINTING.index(c.checkpointing), c.zero_stage,
            not c.reshard_after_forward, c.sequence_parallel, c.pp, c.tp, c.cp, CP_MODES.index(c.cp_mode), c.ep,
            SCHEDULES.index(c.schedule), c.virtual_pp, -c.micro_batch_size)


# ---------------------------------------------------------------------------------------------
# Enumeration
# ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Refusals:
    """Why candidates were left out, each rule once, with how deep in the enumeration it struck:
    when nothing is left, the deepest rules are the ones that removed the last candidates."""

    def __init__(self) -> None:
        self.found: dict[str, int] = {}

    def add(self, depth: int, text: str) -> None:
        self.found[text] = max(depth, self.found.get(text, depth))

    def deepest(self, n: int = 3) -> list[str]:
        order = sorted(self.found.items(), key=lambda kv: -kv[1])  # stable: first seen first among equals
        return [text for text, _ in order[:n]]


def _pinned_problems(fix: dict, world: int, L: int, heads: int, global_batch: int,
                     profile: ModelProfile | None = None) -> list[str]:
    """The rules that pinned knobs break whatever the other knobs are (each names the rule and the values)."""
    out = []
    dp, tp, pp, v = fix.get("dp"), fix.get("tp"), fix.get("pp"), fix.get("virtual_pp")
    cp = fix.get("cp")
    if cp is not None and cp > 1:
        out += _cp_problems(fix, profile, cp)
    ep = fix.get("ep")
    if ep is not None:
        out += expert_parallel_refusals(ep, tp=fix.get("tp"), zero_stage=fix.get("zero_stage"),
                                        offload=fix.get("offload"))
    if ep is not None and ep > 1 and profile is not None:
        if profile.ep_refusal:
            out.append(f"ep={ep}: {profile.ep_refusal}; use ep=1")
        elif profile.experts % ep:
            out.append(f"ep={ep} does not divide the model's {profile.experts} experts per MoE block; use an ep "
                       f"dividing {profile.experts}")
    sched, m, mbs = fix.get("schedule"), fix.get("num_micro_batches"), fix.get("micro_batch_size")
    if pp is not None and pp > L:
        out.append(f"pp={pp} needs at least {pp} blocks, the model has {L}; use pp <= {L}")
    elif pp is not None and v is not None and pp * v > L:
        out.append(f"pp*virtual_pp = {pp * v} stages but the model has {L} blocks; every stage needs one: use "
                   f"pp*virtual_pp <= {L}")
    if tp is not None and heads and heads % tp:
        out.append(f"tp={tp} must divide the model's {heads} attention heads; use tp among "
                   f"{', '.join(map(str, _divisors(heads)))}")
    axes = {k: fix[k] for k in ("tp", "pp", "dp", "cp") if k in fix}
    used = 1
    for value in axes.values():
        used *= value
    # dp, tp and pp pinned leave cp the rest of the devices: refused here when cp cannot take them
    rest_to_cp = (cp is None and (tp or 1) == 1 and profile is not None and profile.context_parallel
                  and world % used == 0)
    if len(axes) == 4 and used != world:
        out.append(f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} = {used} but the cluster has {world} devices; choose knobs "
                   f"whose product is {world}")
    elif len(axes) == 3 and cp is None and used != world and not rest_to_cp:
        out.append(f"dp*tp*pp = {dp}*{tp}*{pp} = {used} but the cluster has {world} devices; choose knobs whose "
                   f"product is {world}")
    elif axes and used > world:
        out.append(f"{' with '.join(f'{k}={x}' for k, x in axes.items())} needs {used} devices, the cluster has "
                   f"{world}; pin fewer or smaller axes")
    elif axes and world % used:
        out.append(f"{' with '.join(f'{k}={x}' for k, x in axes.items())} uses {used} devices, which does not divide "
                   f"the cluster's {world}; the devices must split evenly into dp*cp*tp*pp")
    if dp is not None and global_batch % dp:
        out.append(f"dp={dp} does not divide the global batch {global_batch}; use a global batch that is a "
                   f"multiple of {dp}")
    per_sample = (dp or 1) * (m or 1) * (mbs or 1)
    if dp is not None and m is not None and mbs is not None and per_sample != global_batch:
        out.append(f"dp*num_micro_batches*micro_batch_size = {dp}*{m}*{mbs} = {per_sample} but the global batch "
                   f"is {global_batch}; leave one of them out or change the batch")
    elif (m is not None or mbs is not None) and global_batch % per_sample:
        pinned = "*".join(k for k in ("dp", "num_micro_batches", "micro_batch_size") if k in fix)
        out.append(f"the global batch {global_batch} is not divisible by {pinned} = {per_sample}; use a multiple "
                   f"of {per_sample}")
    if sched == "zbv" and v is not None and v != 2:
        out.append(f"zbv runs exactly two model chunks per rank (a V), got virtual_pp={v}: set virtual_pp=2")
    elif v is not None and v > 1 and sched is not None and sched not in ("interleaved", "zbv"):
        out.append(f"{sched} does not take virtual_pp > 1 (virtual_pp={v}; only interleaved and zbv run several "
                   f"model chunks per rank): set schedule=interleaved or virtual_pp=1")
    if sched == "interleaved" and v == 1:
        out.append("interleaved needs virtual_pp >= 2 (one chunk per rank is 1f1b): set virtual_pp=2 or more, "
                   "or schedule=1f1b")
    if v is not None and v > MAX_VIRTUAL_PP:
        out.append(f"virtual_pp={v} is above the {MAX_VIRTUAL_PP} chunks per rank the search tries; use at most "
                   f"{MAX_VIRTUAL_PP}")
    if sched in ("gpipe", "interleaved", "zb1p", "zbv") and pp == 1:
        out.append(f"schedule {sched} needs pp >= 2 (one stage runs 1f1b): set pp=2 or more, or schedule=1f1b")
    if fix.get("sequence_parallel") and tp == 1:
        out.append("sequence_parallel=true needs tp > 1 (it shards what tensor parallelism replicates): set tp >= 2 "
                   "or sequence_parallel=false")
    elif fix.get("sequence_parallel") and profile is not None:
        # the lowering's rule, with the degrees pinned so far (an unpinned one is checked per candidate)
        why = profile.sequence_parallel_refusal(tp or 1, cp or 1)
        if why:
            out.append(why)
    if fix.get("offload") == "optimizer" and fix.get("zero_stage"):
        out.append(f"offload='optimizer' keeps the whole optimizer state on the host, zero_stage="
                   f"{fix['zero_stage']} shards it over dp: choose one (zero_stage=0 or offload='none')")
    if fix.get("checkpointing") == "dag" and profile is not None and profile.blocks \
            and profile.blocks[0].dag_activation_bytes is None:
        why = profile.blocks[0].dag_refusal or "no checkpoint regions in its blocks"
        out.append(f"checkpointing='dag' cannot be priced on this model: {why}; pin none, selective or full")
    if fix.get("checkpointing") == "tensor" and profile is not None and profile.blocks \
            and profile.blocks[0].tensor_activation_bytes is None:
        out.append(_tensor_problem(profile))
    if fix.get("compile"):  # what it does not run with among the pinned knobs (the others: per candidate)
        out += compile_refusals(schedule=fix.get("schedule", "1f1b"), offload=fix.get("offload", "none"),
                                checkpointing=fix.get("checkpointing", "none"), cp=fix.get("cp", 1),
                                ep=fix.get("ep", 1))
    return out


def check_pinned_inputs(fix: dict, inputs: Sequence[InputSpec], *, where: str = "fix") -> None:
    """Refuse, before any capture or profile, what the pinned knobs ask of a model whose inputs
    (named dims) rule it out: ``sequence_parallel=true`` without a named sequence dim (the
    lowering's rule, :func:`passes.rewrites.sequence_parallel.sequence_parallel_refusal`). Raises
    :class:`ConfigError` naming the cause and the fix."""
    if not fix.get("sequence_parallel"):
        return
    named = {d for i in inputs for d in i.dim_names()}
    if SEQ_DIM not in named:
        shapes = ", ".join(f"{i.name} {i.shape}" for i in inputs)
        raise ConfigError(f"{where}: sequence_parallel=true is pinned, but {sequence_parallel_refusal(None)} "
                          f"(inputs: {shapes})")


def _tensor_problem(profile: ModelProfile) -> str:
    """Why a pinned ``checkpointing='tensor'`` cannot be priced from ``profile``, and the way out."""
    if not profile.tensor_remat_asked:  # the profile skipped the whole-graph MILP: ask for it
        return ("checkpointing='tensor' is pinned but this profile was made without pricing it; profile with "
                "tensor_remat=True (profile_graph, profile_spec) or add it with "
                "partitioner.search.profile.with_tensor_remat(profile, graph)")
    why = profile.blocks[0].tensor_refusal or "its blocks own no activations"
    return f"checkpointing='tensor' cannot be priced on this model: {why}; pin none, selective or full"


def _zero_options(opts, dp: int, tp: int, devices_per_node: int, cp: int = 1) -> list[tuple[int, int | None, bool]]:
    """The (zero_stage, hsdp_shard, reshard_after_forward) triples tried for ``dp`` replicas of
    ``tp`` ranks, each replica ``cp`` context-parallel ranks: ZeRO 0-3 (sharded over the dp * cp
    ranks that hold the same parameters); under ZeRO-3, HSDP with a shard group of one node's dp
    ranks when dp spans several nodes (not with cp, which HSDP does not lay out yet), and the
    gathered parameters freed after forward or kept for backward."""
    out = []
    node = devices_per_node // tp if tp <= devices_per_node else 0
    for zero in opts("zero_stage", [0, 1, 2, 3] if dp * cp > 1 else [0]):
        shards = [None] + ([node] if zero == 3 and cp == 1 and 1 < node < dp and dp % node == 0 else [])
        reshard = opts("reshard_after_forward", [True, False] if zero == 3 else [True])
        out += [(zero, h, r) for h in opts("hsdp_shard", shards) for r in reshard]
    return out


def _schedules(fix: dict, pp: int, L: int, m: int, why: _Refusals) -> list[tuple[str, int]]:
    """The (schedule, virtual_pp) pairs the search tries for ``pp`` stages and ``m`` micro-batches;
    a pinned pair that breaks a rule is recorded in ``why``."""
    if pp == 1:
        pairs = [("1f1b", 1)]
    else:
        pairs = ([("gpipe", 1), ("1f1b", 1)] + [("interleaved", v) for v in range(2, MAX_VIRTUAL_PP + 1)]
                 + [("zb1p", 1), ("zbv", 2)])
    pinned = [(s, v) for s, v in pairs if fix.get("schedule", s) == s and fix.get("virtual_pp", v) == v]
    out = []
    for sched, v in pinned:
        if pp * v > L:
            why.add(6, f"the {sched} schedule with pp={pp}, virtual_pp={v} has {pp * v} stages, more than the "
                       f"model's {L} blocks")
        elif sched == "interleaved" and m % pp:
            why.add(6, f"the interleaved schedule needs num_micro_batches ({m}) divisible by pp ({pp}); use a "
                       f"multiple of {pp} micro-batches")
        else:
            out.append((sched, v))
    if not pinned and pp == 1:  # (other empty pins are refused before the enumeration)
        asked = fix_text({k: fix[k] for k in ("schedule", "virtual_pp") if k in fix})
        why.add(5, f"{asked} needs pp >= 2 (a single stage runs 1f1b, one chunk per rank)")
    return out


def _cp_problems(fix: dict, profile: ModelProfile | None, cp: int) -> list[str]:
    """Why a pinned ``cp > 1`` cannot run on this model or with the other pinned knobs."""
    out = []
    if profile is not None and not profile.context_parallel:
        why = (profile.attention.cp_refusal if profile.attention is not None and profile.attention.cp_refusal
               else "its blocks have no scaled_dot_product_attention" if profile.seq else
               "the model's inputs have no dim named 'seq' to cut")
        out.append(f"cp={cp} cuts the sequence over cp ranks, which this model does not allow: {why}; use cp=1")
        return out
    if fix.get("hsdp_shard") is not None:
        out.append(f"cp={cp} with hsdp_shard={fix['hsdp_shard']}: HSDP's shard groups are not laid out over the "
                   f"dp x cp ranks yet; use hsdp_shard=none")
    if profile is not None and profile.seq % (2 * cp):
        out.append(f"cp={cp} cuts the sequence ({profile.seq} tokens) into 2*cp = {2 * cp} chunks (load-balanced "
                   f"causal layout); use a cp with 2*cp dividing {profile.seq}")
    tp = fix.get("tp", 1)
    if profile is not None and fix.get("cp_mode") == "ulysses" and profile.heads % (cp * tp):
        out.append(f"cp_mode=ulysses gives each of tp*cp = {tp}*{cp} ranks its share of the {profile.heads} "
                   f"attention heads; use a tp*cp dividing {profile.heads} or cp_mode=ring")
    return out


def _cp_options(fix: dict, profile: ModelProfile, cluster: Cluster, rest: int, tp: int,
                why: _Refusals) -> list[int]:
    """The cp degrees tried when ``rest`` devices are left by tp and pp (dp takes ``rest / cp``).

    Unless pinned: 1, and when the model allows it (a ``seq`` dim, attention the cp rewrite can
    cut: :attr:`ModelProfile.context_parallel`), every divisor of ``rest`` whose ``2*cp`` chunks
    divide the sequence and whose cp group stays inside one node with its tp ranks (``tp*cp``
    devices: its ring steps and all-to-alls on the node's link, as tp groups are kept; a pinned
    cp may span nodes)."""
    if "cp" in fix:
        cp = fix["cp"]
        if rest % cp:
            why.add(2, f"cp={cp} does not divide the {rest} devices left by tp={tp} and the pipeline")
            return []
        return [cp]
    if not profile.context_parallel:
        return [1]
    return [d for d in _divisors(rest)
            if d == 1 or (cluster.devices_per_node % (tp * d) == 0 and profile.seq % (2 * d) == 0)]


def _ep_options(fix: dict, profile: ModelProfile, data: int, why: _Refusals) -> list[int]:
    """The ep degrees tried over ``data`` = dp * cp ranks: pinned, or 1 and, where the model's MoE
    blocks can be spread (:attr:`ModelProfile.ep_refusal`), every divisor of ``data`` that divides
    the experts. The config refuses the knobs ep does not run with yet (tp, ZeRO, offload)."""
    if "ep" in fix:
        ep = fix["ep"]
        if data % ep:
            why.add(5, f"ep={ep} does not divide the dp*cp = {data} data ranks it is taken from")
            return []
        return [ep]
    if profile.ep_refusal:
        return [1]
    return [d for d in _divisors(data) if profile.experts % d == 0]


def _sp_options(profile: ModelProfile, tp: int, cp: int) -> list[bool]:
    """Sequence parallelism's values tried with ``tp`` x ``cp`` ranks: True only where the lowering
    runs it (tp > 1 and :meth:`ModelProfile.sequence_parallel_refusal` has no objection: a named
    sequence dim that ``tp * cp`` divides)."""
    if tp > 1 and not profile.sequence_parallel_refusal(tp, cp):
        return [False, True]
    return [False]


def _cp_modes(fix: dict, profile: ModelProfile, cp: int, tp: int, why: _Refusals) -> list[str]:
    """The cp modes tried for ``cp``: ring, and Ulysses when the heads divide by ``tp*cp`` (cp=1:
    the pinned mode or ring; the mode does nothing there)."""
    if cp == 1:
        return [fix.get("cp_mode", "ring")]
    modes = [m for m in CP_MODES if fix.get("cp_mode", m) == m]
    if "ulysses" in modes and profile.heads % (tp * cp):
        modes.remove("ulysses")
        if "cp_mode" in fix:
            why.add(5, f"cp_mode=ulysses with tp={tp}, cp={cp} needs the {profile.heads} attention heads "
                       f"divisible by tp*cp")
    return modes


def candidates(profile: ModelProfile, cluster: Cluster, global_batch: int,
               fix: dict | None = None) -> list[ParallelConfig]:
    """Every candidate plan the search considers (after pruning), in a stable order.

    ``fix`` is checked first (:func:`partitioner.inputs.knobs.check_fix`). Raises :class:`ConfigError`
    naming the rule when the pinned knobs leave no candidate (``dp*tp*pp = 4 but the cluster has
    8 devices``, ``pp=8 needs at least 8 blocks, the model has 2``, ...)."""
    fix = check_fix(fix)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be an integer >= 1 (samples per step), got {global_batch!r}")
    world, L = cluster.world_size, len(profile.blocks)
    problems = _pinned_problems(fix, world, L, profile.heads, global_batch, profile)
    if problems:
        raise ConfigError(f"no candidate plan for fix {fix_text(fix)} on {world} devices: {'; '.join(problems)}")

    def opts(name, values):
        if name in fix:
            return [fix[name]]
        return values

    # compiled stage programs only when pinned: the cost model prices a plan's step as eager
    (compiled,) = opts("compile", [False])

    # CPU ranks (a loopback host link): their "host" memory is their own, so offloading to it
    # frees nothing and adds copies; offered only when pinned
    offloads = ["none"] if cluster.host_to_device.kind == "loopback" else list(OFFLOAD)

    out = []
    why = _Refusals()  # why configs were left out, with the depth of the rule
    data_axis: dict[tuple[int, int, int], list[tuple[str, int]]] = {}  # (tp, cp, dp) -> its (cp_mode, ep) options
    has_scores = any(layer.attention_score_bytes for layer in profile.layers)
    ckpts = ["none", "selective", "full"] if has_scores else ["none", "full"]
    if profile.blocks and profile.blocks[0].dag_activation_bytes is not None:
        ckpts.append("dag")
    if profile.blocks and profile.blocks[0].tensor_activation_bytes is not None:
        ckpts.append("tensor")
    tps = [t for t in _divisors(world) if profile.heads % t == 0 and cluster.devices_per_node % t == 0]
    pairs = []
    for tp in opts("tp", tps):
        for pp in opts("pp", [p for p in _divisors(world // tp) if p <= L]):
            if world % (tp * pp):
                why.add(1, f"tp*pp = {tp}*{pp} = {tp * pp} does not divide the cluster's {world} devices")
                continue
            pairs.append((tp, pp))
    for tp, pp in pairs:
        for cp in _cp_options(fix, profile, cluster, world // (tp * pp), tp, why):
            dp = world // (tp * pp * cp)
            if "dp" in fix and fix["dp"] != dp:
                why.add(2, f"dp*cp*tp*pp = {fix['dp']}*{cp}*{tp}*{pp} = {fix['dp'] * cp * tp * pp} but the cluster "
                           f"has {world} devices")
                continue
            if global_batch % dp:
                why.add(3, f"dp={dp} (the devices left by tp={tp}, pp={pp}) does not divide the global batch "
                           f"{global_batch}")
                continue
            per_replica = global_batch // dp
            mbs_values = [b for b in _divisors(per_replica) if b <= MAX_MICRO_BATCH]
            if "num_micro_batches" in fix and "micro_batch_size" not in fix:
                mbs_values = [per_replica // fix["num_micro_batches"]] if per_replica % fix["num_micro_batches"] == 0 else []
                if not mbs_values:
                    why.add(4, f"num_micro_batches={fix['num_micro_batches']} does not divide the {per_replica} "
                               f"samples of each of dp={dp} replicas (global batch {global_batch})")
            for mbs in opts("micro_batch_size", mbs_values):
                if per_replica % mbs:
                    why.add(4, f"micro_batch_size={mbs} does not divide the {per_replica} samples of each of dp={dp} "
                               f"replicas (global batch {global_batch})")
                    continue
                m = per_replica // mbs
                if cp > 1 and mbs % cp == 0 and not {"cp", "dp", "micro_batch_size"} & set(fix):
                    continue  # its cp=1 twin (dp*cp replicas of mbs/cp samples) is a candidate: same work, no exchanges
                if "num_micro_batches" in fix and fix["num_micro_batches"] != m:
                    why.add(4, f"micro_batch_size={mbs} * num_micro_batches={fix['num_micro_batches']} != the "
                               f"{per_replica} samples of each of dp={dp} replicas (global batch {global_batch})")
                    continue
                for sched, v in _schedules(fix, pp, L, m, why):
                    for zero, hsdp, reshard in _zero_options(opts, dp, tp, cluster.devices_per_node, cp):
                        for sp in opts("sequence_parallel", _sp_options(profile, tp, cp)):
                            for ckpt in opts("checkpointing", ckpts):
                                for off in opts("offload", offloads):
                                    # the rules between these knobs, once per combination (not per config)
                                    conflicts = knob_conflicts(zero_stage=zero, offload=off, schedule=sched,
                                                               checkpointing=ckpt)
                                    if conflicts:
                                        why.add(7, "; ".join(conflicts))
                                        continue
                                    if (tp, cp, dp) not in data_axis:
                                        data_axis[(tp, cp, dp)] = list(itertools.product(
                                            _cp_modes(fix, profile, cp, tp, why), _ep_options(fix, profile, dp * cp, why)))
                                    for mode, ep in data_axis[(tp, cp, dp)]:
                                        try:  # only configs the lowering and the runtime carry out are offered
                                            out.append(ParallelConfig(
                                                dp=dp, tp=tp, pp=pp, cp=cp, cp_mode=mode, ep=ep, virtual_pp=v,
                                                micro_batch_size=mbs, num_micro_batches=m, schedule=sched,
                                                zero_stage=zero, hsdp_shard=hsdp, reshard_after_forward=reshard,
                                                sequence_parallel=sp, checkpointing=ckpt, offload=off,
                                                compile=compiled, dtype=profile.dtype))
                                        except ConfigError as exc:
                                            why.add(7, str(exc).removeprefix("invalid parallel config: "))
    if not out:
        reasons = why.deepest() or [(f"dp must divide the global batch, tp the heads ({profile.heads}) and fit in a "
                                     f"node of {cluster.devices_per_node} unless pinned")]
        raise ConfigError(f"no candidate plan for fix {fix_text(fix)} on {world} devices, global batch "
                          f"{global_batch}, {profile.heads} heads, {L} blocks: {'; '.join(reasons)}; "
                          f"change or unpin these knobs")
    return out


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunnerUp:
    """The fastest candidate that fits but was not chosen, and by how much it lost."""

    knobs: dict[str, object]
    """Its values of :data:`KNOBS`."""
    step_time_s: float
    """Its predicted seconds per step."""
    loss_s: float
    """Its predicted step time minus the chosen plan's, seconds (>= 0)."""
    loss_fraction: float
    """``loss_s`` over the chosen plan's step time (0.05 = 5% slower)."""


def runner_up(chosen: Plan) -> RunnerUp | None:
    """The runner-up of a plan :func:`plan` returned, or None when no other candidate fits.

    :func:`plan` lists the slower feasible candidates first and then only faster ones that do not
    fit, so the runner-up is the fastest alternative that is not faster than the chosen plan."""
    best = chosen.predicted.step_time_s
    slower = [a for a in chosen.alternatives if a.step_time_s >= best]
    if not slower:
        return None
    alt = min(slower, key=lambda a: a.step_time_s)
    return RunnerUp(knobs=dict(alt.knobs), step_time_s=alt.step_time_s, loss_s=alt.step_time_s - best,
                    loss_fraction=(alt.step_time_s - best) / best if best > 0 else 0.0)


def search(profile: ModelProfile, cluster: Cluster, *, global_batch: int, fix: dict | None = None,
         optimizer: str = "adamw", check: Callable[[Plan], Plan] | None = None,
         price_dag: Callable[[], ModelProfile] | None = None) -> Plan:
    """The fastest plan for ``profile`` on ``cluster`` that fits every device's memory.

    ``global_batch``: samples per step (``dp · micro_batch_size · num_micro_batches``).
    ``fix``: pin any of :data:`passes.ir.plan.KNOBS` (e.g. ``{"tp": 8, "pp": 4}``); a pinned
    ``tp`` may exceed the devices of one node. With every knob pinned this evaluates that plan.
    Deterministic: ties go to the simpler plan (:meth:`ParallelConfig.key`).
    ``check``: re-measures a plan's memory exactly (:func:`partitioner.search.memory_check.replay_check`);
    the fastest candidates are checked in order and the first whose checked peak fits the device
    is returned with the checked numbers; a candidate that does not fit is dropped.
    ``price_dag``: ``profile`` has not priced ``checkpointing="dag"`` (``ModelProfile.dag_asked``)
    and this returns it priced; called, and the search made again, only where a dag plan can win:
    nothing fits, a candidate faster than the best does not fit (or its exact replay does not), or
    memory moved some candidate's stage split off its fastest. Otherwise every dag plan is a
    layout that fits without checkpointing, split alike, plus recompute: slower than the best.
    Raises :class:`InfeasiblePlanError` when no candidate fits.
    """
    if price_dag is not None and profile.dag_asked:
        price_dag = None
    again = functools.partial(search, cluster=cluster, global_batch=global_batch, fix=fix, optimizer=optimizer,
                              check=check)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be an integer >= 1 (samples per step), got {global_batch!r}")
    ctx = PlanContext(profile, cluster, global_batch, optimizer)
    cands = candidates(profile, cluster, global_batch, fix)  # never empty: it names the rule instead
    ordered = sorted(((lower_bound(ctx, c), _key(c), c) for c in cands), key=lambda t: t[:2])
    feasible: list[Evaluated] = []
    infeasible: list[Evaluated] = []
    too_big = []  # (bound, key, config) of candidates whose model state alone exceeds the device
    stop = len(ordered)  # where the search stopped: the candidates from here on were not evaluated
    for k, (bound, key, c) in enumerate(ordered):
        if len(feasible) > N_ALTERNATIVES and bound > feasible[N_ALTERNATIVES].step_time:
            stop = k
            break
        if state_lower_bound(ctx, c) > ctx.cap_for(c):
            too_big.append((bound, key, c))
            continue
        e = evaluate(ctx, c)
        if e.feasible:
            bisect.insort(feasible, e, key=lambda x: (x.step_time, _key(x.config)))
        else:
            infeasible.append(e)
    if not feasible and price_dag is not None:
        return again(price_dag())
    if not feasible:
        need, who = _min_memory(ctx, cands)
        err = InfeasiblePlanError(
            f"no plan fits {format_bytes(cluster.device.memory_bytes)} per device: the smallest need is "
            f"{format_bytes(need)} per device ({_short(who)}), of {ctx.budget_for(who.communicators).describe()}; tried {_tried(cands)}. Use devices with more "
            f"memory, more devices, or a smaller global batch")
        err.min_bytes = need  # for callers and tests: the exact number behind the message
        raise err
    best, chosen, dropped = _first_that_fits(ctx, feasible, check)
    if price_dag is not None and (best is None or dropped or any(e.memory_shaped for e in feasible)
                                  or _fastest_infeasible(ctx, infeasible, too_big, best.step_time, 1)):
        return again(price_dag())
    if best is None:
        shown = ", ".join(f"{_short(e.config)}: {format_bytes(e.peak)}" for e in dropped)
        raise InfeasiblePlanError(
            f"the exact memory replay of the {len(dropped)} fastest plans exceeds "
            f"{format_bytes(cluster.device.memory_bytes)} per device ({shown}); use devices with more memory, "
            f"more devices, a smaller global batch, or fix checkpointing=full")
    infeasible += dropped  # the candidates before ``best`` in ``feasible``
    slower = feasible[feasible.index(best) + 1:]
    shown = slower[:N_ALTERNATIVES - 1]
    # and the fastest plan of every other ZeRO stage, so the choice of stage is explained even
    # when variants of the chosen one (HSDP, resharding, micro-batching) fill the list
    for zero in ZERO_STAGES:
        if zero == best.config.zero_stage:
            continue
        other = _fastest_of_stage(ctx, zero, next((e for e in slower if e.config.zero_stage == zero), None),
                                  ordered[stop:])
        if other is not None and other not in shown:
            shown.append(other)
    shown.sort(key=lambda e: (e.step_time, _key(e.config)))
    alts = [Alternative(knobs=e.config.knobs(), step_time_s=e.step_time, peak_memory_bytes=e.peak,
                        reason=f"slower by {(e.step_time / best.step_time - 1) * 100:.1f}%")
            for e in shown]
    faster = _fastest_infeasible(ctx, infeasible, too_big, best.step_time, 2)
    alts += [Alternative(knobs=e.config.knobs(), step_time_s=e.step_time, peak_memory_bytes=e.peak,
                         reason=_memory_reason(ctx, e)) for e in faster]
    return dataclasses.replace(chosen, alternatives=tuple(alts))


def _fastest_of_stage(ctx: PlanContext, zero: int, fastest: Evaluated | None, rest: list) -> Evaluated | None:
    """The fastest feasible candidate of ZeRO stage ``zero``: ``fastest`` (the search's, or None),
    or one of ``rest`` (``(lower bound, key, config)`` in bound order, not evaluated by the
    search) that its bound leaves in the running and that turns out faster."""
    for bound, _, c in rest:
        if fastest is not None and bound > fastest.step_time:
            break
        if c.zero_stage != zero or state_lower_bound(ctx, c) > ctx.cap_for(c):
            continue
        e = evaluate(ctx, c)
        if e.feasible and (fastest is None or (e.step_time, _key(c)) < (fastest.step_time, _key(fastest.config))):
            fastest = e
    return fastest


def _fastest_infeasible(ctx: PlanContext, evaluated: list[Evaluated], too_big: list, below: float,
                        n: int) -> list[Evaluated]:
    """The ``n`` fastest candidates that do not fit and step in under ``below`` seconds: of those
    evaluated, and of ``too_big`` (``(lower bound, key, config)`` in bound order, not evaluated by
    the search) as many as their bounds leave in the running."""
    order = lambda e: (e.step_time, _key(e.config))  # noqa: E731
    out = sorted((e for e in evaluated if e.step_time < below), key=order)
    for bound, _, c in too_big:
        if bound >= below or (len(out) >= n and bound > out[n - 1].step_time):
            break
        e = evaluate(ctx, c)
        if e.step_time < below:
            bisect.insort(out, e, key=order)
    return out[:n]


def _first_that_fits(ctx: PlanContext, feasible: list[Evaluated], check: Callable[[Plan], Plan] | None):
    """(evaluated, plan, dropped): the fastest candidate whose ``check``ed peak fits the device
    (its plan carries the checked numbers), and the faster ones the check dropped (their peak
    replaced by the checked one). Without ``check`` the fastest is taken as it is."""
    if check is None:
        return feasible[0], _to_plan(ctx, feasible[0], ()), []
    dropped = []
    for e in feasible[:N_CHECKED]:
        plan_ = check(_to_plan(ctx, e, ()))
        if plan_.predicted.peak_memory_bytes <= ctx.cap_for(e.config):
            return e, plan_, dropped
        dropped.append(dataclasses.replace(e, peak=plan_.predicted.peak_memory_bytes))
    return None, None, dropped


def min_memory(profile: ModelProfile, cluster: Cluster, *, global_batch: int, fix: dict | None = None,
               optimizer: str = "adamw") -> tuple[float, ParallelConfig]:
    """Smallest per-device peak bytes over every candidate (each with its time-balanced stage
    split, memory ignored) and the candidate that needs it; ``fix`` restricts the candidates."""
    ctx = PlanContext(profile, cluster, global_batch, optimizer)
    cands = candidates(profile, cluster, global_batch, fix)
    return _min_memory(ctx, cands)


def _min_memory(ctx: PlanContext, cands: list[ParallelConfig]) -> tuple[float, ParallelConfig]:
    best = None
    for c in cands:
        e = evaluate(ctx, c, limit=None)
        if best is None or (e.peak, _key(c)) < (best[0], _key(best[1])):
            best = (e.peak, c)
    return best


def _memory_reason(ctx: PlanContext, e: Evaluated) -> str:
    if e.peak > ctx.cap_for(e.config):
        return f"needs {format_bytes(e.peak)} of {format_bytes(ctx.cap_for(e.config))}"
    return f"needs more than {format_bytes(ctx.host_cap)} of host memory per device"


def _short(c: ParallelConfig) -> str:
    return " ".join(f"{k}={v}" for k, v in c.knobs().items())


def _tried(cands: list[ParallelConfig]) -> str:
    parts = []
    for k in KNOBS:
        values = sorted({getattr(c, k) for c in cands}, key=str)
        parts.append(f"{k} in {{{', '.join(map(str, values))}}}")
    return "; ".join(parts)


def _to_plan(ctx: PlanContext, e: Evaluated, alts: tuple[Alternative, ...]) -> Plan:
    c = e.config
    world = ctx.cluster.world_size
    model_flops = (ctx.profile.fwd_flops + ctx.profile.bwd_flops) * ctx.global_batch
    per_device = model_flops / e.step_time / world
    pred = Prediction(step_time_s=e.step_time, tflops_per_device=per_device / 1e12,
                      mfu=per_device / ctx.cluster.device.peak_flops.for_dtype(ctx.dtype),
                      peak_memory_bytes=e.peak,
                      bubble_fraction=bubble_fraction(c.schedule, c.pp, c.num_micro_batches, c.virtual_pp),
                      terms=e.terms.to_dict(), memory_budget=ctx.budget_for(c.communicators).to_dict())
    # the plan's stage split travels in its config: chunk k of pipeline rank s is virtual stage k*pp + s
    starts = {c.rank_stages(st.index)[k]: r[0] for st in e.stages for k, r in enumerate(st.layers)}
    config = c.replace(stage_boundaries=tuple(starts[vs] for vs in range(1, c.n_stages)))
    return Plan(model=ctx.profile.model, cluster=f"{ctx.cluster.name} x {ctx.cluster.nodes}",
                global_batch=ctx.global_batch, config=config, stages=e.stages, predicted=pred, alternatives=alts)


def feasible_plans(profile: ModelProfile, cluster: Cluster, *, global_batch: int, fix: dict | None = None,
                   optimizer: str = "adamw") -> list[Plan]:
    """Every candidate of :func:`candidates` that fits every device's memory under the cost
    model's estimate, as a :class:`Plan` (stage split, predicted seconds per step, peak bytes),
    fastest predicted step first, ties broken as :func:`plan` breaks them.

    Unlike :func:`plan` there is no branch and bound (every candidate is evaluated) and no exact
    memory replay, so without a ``check`` the first plan is the one :func:`plan` returns (its
    ``alternatives`` aside). Meant for judging the search against measurements of many plans.
    Raises :class:`ConfigError` as :func:`candidates` does; an empty list when nothing fits."""
    ctx = PlanContext(profile, cluster, global_batch, optimizer)
    evaluated = [e for e in (evaluate(ctx, c) for c in candidates(profile, cluster, global_batch, fix)) if e.feasible]
    evaluated.sort(key=lambda e: (e.step_time, _key(e.config)))
    return [_to_plan(ctx, e, ()) for e in evaluated]
