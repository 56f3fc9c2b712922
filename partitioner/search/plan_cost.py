"""The cost model applied to one candidate plan: its stage split, per-device memory and step time.

Per micro-batch of ``b`` samples, per layer (numbers per sample come from the ModelProfile):

* compute, a roofline per node: each matmul-class node (``LayerProfile.kernels``) takes the
  larger of its FLOPs·b/tp at the efficiency curve's rate for that kernel size and dtype and its
  bytes (activations·b/tp plus its weight shard) at the device memory bandwidth
  (``cost_model.roofline_time``); its backward is two such kernels of half its backward FLOPs.
  Every other node (norms, softmax, elementwise ops, dropout, loss) is memory bound: the layer's
  ``memory_bound_bytes``·b/tp plus ``replicated_memory_bound_bytes``·b (÷tp with sequence
  parallelism) at the memory-bound rate (``cost_model.memory_bound_rate``: the memory bandwidth
  unless the calibration fitted the rate of the device's elementwise ops), twice that in backward. Plus the framework's per-op
  overhead (``Device.kernel_overhead_s``) for the layer's ``ops`` forward operators and twice as
  many backward ones (``cost_model.op_overhead_time``; independent of ``b`` and ``tp``);
* tensor parallel: ``tp_all_reduces`` all-reduces of the boundary tensor ``b·s·h`` in forward and
  as many in backward over the TP group link (sequence parallel: reduce-scatter + all-gather,
  the same bytes);
* recompute: ``full`` checkpointing reruns the layer's forward (compute and TP communication);
  ``selective`` reruns the attention core only (its attention kernels on the roofline, and for
  an unfused attention the memory-bound nodes on its [s, s] scores); ``dag`` reruns, in the
  share of blocks it checkpoints, the memory-bound ops, overheads and TP communication, plus the
  matmul-class kernels whose outputs it does not keep (``LayerProfile.dag_recompute_flops``).

A stage's time per micro-batch is the sum over its layers. The step is ``m · T_max`` plus the
bubble (:func:`_bubble_time`): ``(Σ_s T_s − T_max)/v``, the fill and drain through every other
stage (``(p−1)/v · T_max`` when the stages are balanced, as ``cost_model.pipeline_step_time``;
exact for GPipe with unequal stages, an upper bound for 1F1B); zero-bubble schedules: their
simulated idle slots times ``T_max``, with W taking the share of the slowest stage's backward
that its weight gradients are (``_LayerCost.weight_grad``),
plus pipeline send/recv of the boundary tensor (scattered over TP ranks, as Megatron does):
``2·t_p2p·m·v``, each rank's own messages (charging the ``p−1`` fill/drain messages as well
over-predicted deep pipelines on measured runs; the fill is in the bubble), plus the exposed data-parallel gradient reduction: gradients accumulate
over micro-batches and the reduction (all-reduce for ZeRO 0, reduce-scatter for ZeRO 1) of the
last micro-batch overlaps that micro-batch's backward on the stage (bucketed), the rest is
exposed; ZeRO 1 and 2 then all-gather the updated weights (exposed); ZeRO-3 gathers each
layer's parameters before its forward and its backward and reduce-scatters its gradients, one
collective per layer each (:func:`zero3_exposed_time`); ZeRO 2 keeps only a grad
shard so it reduce-scatters after EVERY micro-batch (each hidden behind its backward); plus the optimizer step (memory bound, or on the host with
``offload="optimizer"``, and ``Device.optimizer_tensor_s`` per tensor it steps:
:func:`optimizer_tensors`); ZeRO ≥ 1 adds flattening the grads into the bucket and copying the
gathered parameters back (``4·grad bytes`` memory bound). With ``pp > 1`` and tied weights (a
GPT's word embedding and LM head) the first and the last stage all-reduce those gradients after
their last backward (``tied_comm``, over the pair's link). Every step also pays ``framework``:
``Device.step_overhead_s`` of host work and two all-reduces of a scalar over all ranks (the
global gradient norm's and the loss's, ``2·⌈log2 world⌉`` latencies each).

The gradient reduction and ZeRO-1/2's all-gather are one collective per gradient bucket
(:func:`gradient_buckets`, the runtime's layout: tied copies and sequence-parallel norms in late
buckets of their own), each paying the latency. The collectives over data-parallel ranks and
between stages (those, ZeRO-3's gathers and reduce-scatters, the tied sync, the loss all-reduce)
pay the link's α times ``Cluster.sync_latency_scale`` where the calibration fitted one
(:meth:`PlanContext.sync_link`): on CPU ranks sharing cores they cost several times, per hop, the
tensor- and context-parallel collectives inside forward and backward, which pay the link's α.
Each synchronising call after the last backward (:func:`step_end_calls`: the buckets the
reduction finishes, ZeRO-1/2's updated-chunk gathers, the tied and sequence-parallel sums, the
gradient norm, the loss) also waits ``Cluster.step_end_wait_s`` once (ranks on shared cores
arrive at it one after the other), in ``dp_comm``, ``tied_comm`` or ``framework``; 0 on the presets.

What compute hides still costs it on a GPU: while a collective runs, NCCL holds
``Device.comm_compute_share`` of the device (an SM per channel), so the compute beside it runs
at the rest; the term ``overlap`` charges that share of every hidden collective's seconds (the
reduction behind the last backward, ZeRO-2's per micro-batch, ZeRO-3's gathers and
reduce-scatters: :func:`overlapped`).

Host devices (``host_to_device.kind == "loopback"``: CPU ranks on gloo): nothing overlaps on a
rank's one thread, so the dp reduction is fully exposed (no backward hides it), and activation
offload's copies are added to the stage's time per micro-batch (so they also lengthen the
bubble). A copy costs ``bytes`` at the host link plus, per saved tensor
(``LayerProfile.saved_tensors``) and direction, the link's α and ``Device.offload_call_s`` (the
hook and the op's dispatch).

Shared cores (``Cluster.compute_slots_per_node``, written by the calibration of CPU ranks): when
a node has more ranks than ranks that can compute at once, the schedule's compute is simulated
with the ranks computing at once sharing the node's slots (:mod:`partitioner.cost.core_sharing`),
and what that adds to the same simulation on free cores is the term ``contention``
(:func:`_contention_time`): all-rank data and tensor parallelism pay for their ranks computing
together, a pipeline's idle ranks give their cores to the busy ones, and the phases in which
every pipeline rank computes slow the critical path itself.

Per-device memory of a stage: model state of its layers (``cost_model.model_state_bytes``,
ZeRO-sharded over dp, parameters divided by tp; norms are counted as sharded too, a small
over-count of the saving), plus saved activations of the micro-batches in flight
(``cost_model.in_flight_microbatches``), plus communication buffers (two 25 MiB gradient
buckets for dp, send/recv buffers for pp, one all-reduce buffer for tp). Activation terms:

* TP shards the activations except the [b, s, h] ones (norm inputs, residuals, dropout masks),
  which sequence parallelism shards as well (Korthikanti et al. 2022);
* ``selective`` drops the [s, s] attention-score tensors (0 with fused attention, which keeps
  none: selective then saves nothing and is only tried when pinned);
* ``full`` keeps each layer's input (the boundary tensor) per micro-batch in flight, plus one
  whole layer's activations for the layer being recomputed;
* ``dag`` keeps the share of each layer's activations the profile's dag decision keeps
  (``LayerProfile.dag_activation_bytes``), plus one whole layer's for the layer being recomputed;
* ``offload="activations"`` keeps at most two micro-batches' activations on the device (the one
  computing and one being copied); the copies out and back cost ``2·bytes`` at the slower of the
  host-to-device link and the device's share of host-memory bandwidth
  (:data:`HOST_MEMORY_BYTES_PER_S`) plus two messages per saved tensor (α and
  ``Device.offload_call_s`` each); on a GPU the copies out are hidden behind the stage's forward
  and the reloads, each prefetched while the layers after it run backward, behind its backward
  (and recompute): only what is longer is charged.

Context parallelism (``cp > 1``; :mod:`passes.rewrites.context_parallel`): every activation holds
``b·S/cp`` tokens, so every per-sample number above counts ``b/cp`` samples — FLOPs (attention's
too: the load-balanced layout gives each rank 1/cp of them), bytes moved, saved activations,
the pipeline message — while parameters, gradients and optimizer state are replicated over the
cp ranks (not divided). Gradients are averaged, and ZeRO shards, over the ``dp·cp`` ranks that
hold the same parameters (cp innermost: one all-reduce or reduce-scatter over ``dp·cp`` ranks on
that group's link). Attention's exchanges (``PlanContext._cp_attention``, term ``cp_comm``) go
over the cp group's link (a node's when the group fits in one; its cross-node share otherwise):
ring attention sends K/V blocks round the ring ``cp−1`` times per forward and again per backward,
each step hidden behind the block's compute where it is shorter (``max(compute, comm)`` per
step), and its fp32 dK/dV blocks ``cp`` times per backward (exposed); the ring kernel computes in
fp32 (:data:`RING_COMPUTE_DTYPE`) with unfused score blocks, and holds a few fp32 ``[b, H, c, c]``
score blocks (``c = S/(2·cp)``) while it runs (``buffers``). Ulysses all-to-alls q, k, v and the
output forward and back in backward, ``(cp−1)/cp`` of each tensor, exposed, and saves the
head-sharded q, k, v besides. The loss adds two scalar all-reduces over the cp group. Recompute
(full or selective checkpointing) reruns the exchanges of the forward it repeats. With tp, a
rank attends with its ``H/tp`` heads: the exchanged tensors and the ring's blocks divide by tp,
and the cp group's ranks lie ``tp`` apart (inside a node while ``tp·cp`` fits in one).

Stage boundaries (non-interleaved): the chain ``embedding, blocks, head`` is split into ``pp``
contiguous stages minimising the slowest stage's time subject to each stage's memory limit
(parametric search over the possible bottleneck times with a greedy feasibility check, which is
exact for contiguous chains with additive per-stage costs). Interleaved: ``L/(p·v)`` blocks per
chunk, embedding on stage 0, head on stage p−1.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

from partitioner.cost.cluster import GPU_COMM_COMPUTE_SHARE, Cluster, backend_default
from partitioner.cost.device_memory import MemoryBudget, memory_budget
from partitioner.cost.core_sharing import RankWork, rank_counts, shared_makespan
from partitioner.cost.cost_model import (
    StepTimeTerms,
    all_gather_time,
    all_reduce_time,
    compute_time,
    ring_attention_pairs,
    ring_exposed_time,
    ulysses_all_to_all_time,
    group_link,
    in_flight_microbatches,
    pipeline_state_arrays,
    _bubble_slots,
    _compute_order,
    memory_bound_time,
    model_state_bytes,
    op_overhead_time,
    reduce_scatter_time,
    roofline_time,
    send_recv_time,
)
from partitioner.search.profile import LayerProfile, ModelProfile
from passes.ir.config import ParallelConfig, is_mixed
from passes.ir.grad_buckets import DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES
from passes.ir.plan import StagePlan
from passes.ir.zero3_ops import ZERO3_PREFETCH

HOST_MEMORY_BYTES_PER_S = 100e9
"""Usable host-memory bandwidth of one node, shared by its devices: bounds the CPU optimizer step
and activation offload copies (an assumption; the cluster file has no such field yet)."""

RING_COMPUTE_DTYPE = "fp32"
"""The dtype ring attention's kernel computes in (``runtime.kernels.context_parallel``: q, K, V
cast to float32, scores, running log-sum-exp and dK/dV in float32, matmuls without TF32): its
FLOPs are timed at this peak. A fused low-precision ring kernel would make it the training dtype."""
RING_SCORE_PASSES_FWD = 9
"""fp32 score-block passes per (query, key) chunk pair in the ring's forward: the QKᵀ output, the
scale (read+write), logsumexp (read), ``s - lse`` and ``exp`` (read+write each), PV's read."""
RING_SCORE_PASSES_BWD = 16
"""As :data:`RING_SCORE_PASSES_FWD` in backward: the scores again (1 + 2 + 2 + 2), ``dO·Vᵀ``
written, ``p·(dP − δ)`` (3), and the reads of pᵀ·dO, dS·K and dSᵀ·Q (3)."""
RING_OPS_PER_PAIR_FWD, RING_OPS_PER_STEP_FWD = 10, 6
RING_OPS_PER_PAIR_BWD, RING_OPS_PER_STEP_BWD = 16, 12
"""Dispatched ops of the ring kernel per chunk pair and per ring step (framework overhead)."""
RING_WORKING_BLOCKS = 4
"""fp32 ``[b, H, c, c]`` score blocks alive at once in the ring's backward (p, dP, dS, a temporary)."""


@dataclass(frozen=True, slots=True)
class _CpAttention:
    """What context parallelism adds to one layer, one micro-batch, one device (zeros without it)."""

    fwd: float = 0.0
    """Compute seconds added to the forward (ring: its fp32 kernel minus the SDPA it replaces)."""
    bwd: float = 0.0
    comm_fwd: float = 0.0
    """Exposed exchange seconds in forward (K/V ring steps or all-to-alls; the loss's all-reduces)."""
    comm_bwd: float = 0.0
    saved_bytes: float = 0.0
    """Saved activations beyond the profile's (Ulysses: the head-sharded q, k, v)."""
    working_bytes: float = 0.0
    recompute: float = 0.0
    """Seconds to rerun the attention core's cp part (selective checkpointing): compute and exchanges."""


@dataclass(frozen=True, slots=True)
class _LayerCost:
    """One layer, one micro-batch, one device: seconds and bytes."""

    fwd: float
    bwd: float
    tp_comm: float
    recompute: float
    act_bytes: float
    """Saved activations of one micro-batch on one device, under the checkpointing policy."""
    full_act_bytes: float
    """Saved activations without checkpointing (the working set while recomputing)."""
    params: float
    """Parameters on one device (tp-sharded)."""
    cp_comm: float = 0.0
    """Context-parallel exchanges not hidden by compute, forward and backward (:class:`_CpAttention`)."""
    working_bytes: float = 0.0
    """Transient bytes of the layer's context-parallel attention while it runs (received blocks,
    fp32 score blocks): held once per device, not per micro-batch."""
    remat_working_bytes: float = 0.0
    """``tensor`` checkpointing: what its recomputes hold at the fullest moment of backward, on top
    of the saved activations (once per device, for the micro-batch whose backward runs)."""
    weight_grad: float = 0.0
    """Seconds of ``bwd`` that compute weight gradients (a split backward's W): the matmul-class
    kernels' weight-gradient halves, and half of the split's extra overhead."""
    ep_comm: float = 0.0
    """Expert-parallel dispatch and combine, forward and backward (:meth:`PlanContext._ep_comm`)."""
    expert_params: float = 0.0
    """Of ``params``, the routed experts' (this rank's ``1/ep`` of them): their gradients average
    over the ``dp * cp / ep`` ranks holding the same experts."""
    held_grad_bytes: float = 0.0
    """A split backward's output gradients of the weight-reading ops, held from a micro-batch's I
    to its W, on one device (0 without a split backward)."""

    @property
    def time(self) -> float:
        return self.fwd + self.bwd + self.tp_comm + self.recompute + self.cp_comm + self.ep_comm


@dataclass(frozen=True, slots=True)
class Evaluated:
    config: ParallelConfig
    feasible: bool
    step_time: float
    peak: float
    stages: tuple[StagePlan, ...]
    terms: StepTimeTerms
    memory_shaped: bool = False
    """Memory moved its stage split off the fastest one (told only when the profile has not priced
    ``checkpointing="dag"``, which could then win: ``search(price_dag=...)``)."""


class PlanContext:
    """Everything fixed while costing candidates of one model on one cluster: profile, cluster, caches of links and layer costs."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, global_batch: int, optimizer: str):
        self.profile = profile
        self.cluster = cluster
        self.tell_shaped = not profile.dag_asked  # Evaluated.memory_shaped
        self.framework_s: float | None = None  # _framework_time's
        self.global_batch = global_batch
        self.optimizer = optimizer
        self.dtype = profile.dtype
        # what a plan's tensors may use of a device: its memory less the CUDA context, NCCL's
        # buffers (one set per communicator the candidate's rank joins) and the allocator's slack
        self._budgets: dict[int, MemoryBudget] = {}
        self.host_cap = cluster.host_memory_bytes / cluster.devices_per_node
        self.host_rate = HOST_MEMORY_BYTES_PER_S / cluster.devices_per_node  # per device, bytes/s
        self.L = len(profile.blocks)
        self.itemsize = 4 if self.dtype == "fp32" else 2
        # device memory IS host memory (CPU ranks): copies and collectives are not overlapped
        self.on_host = cluster.host_to_device.kind == "loopback"
        # what a collective running beside compute takes of it (NCCL's SMs); nothing on a host rank,
        # where the collective and the compute take turns on one thread
        self.comm_share = 0.0 if self.on_host else backend_default(
            cluster, cluster.device.comm_compute_share, GPU_COMM_COMPUTE_SHARE)
        self._links: dict = {}
        self._costs: dict = {}

    def budget_for(self, communicators: int) -> MemoryBudget:
        """The device's :class:`MemoryBudget` for a rank joining ``communicators`` process groups."""
        budget = self._budgets.get(communicators)
        if budget is None:
            budget = self._budgets[communicators] = memory_budget(self.cluster, communicators)
        return budget

    def cap_for(self, c: ParallelConfig) -> float:
        """Bytes candidate ``c``'s peak may reach on one device (:func:`memory_budget`)."""
        return self.budget_for(c.communicators).usable_bytes

    def link(self, size: int, stride: int):
        key = (size, stride)
        if key not in self._links:
            self._links[key] = group_link(self.cluster, size=size, stride=stride)
        return self._links[key]

    def sync_link(self, size: int, stride: int):
        """The link of a collective over data-parallel ranks or between stages (gradient buckets,
        ZeRO's gathers and reduce-scatters, the tied-weight sync, the loss all-reduce): its α times
        the calibrated ``Cluster.sync_latency_scale`` when there is one."""
        link = self.link(size, stride)
        scale = self.cluster.sync_latency_scale
        return link if scale is None else link.with_latency_scale(scale)

    def pp_link(self, c: ParallelConfig):
        return self.link(2, c.dp_cp * c.tp)

    def cp_links(self, cp: int, tp: int):
        """(collective link, ring-step link) of a cp group: ``cp`` consecutive ranks (stride
        ``tp``). The ring's point-to-point step is as slow as its slowest hop: inside a node the
        node's link; across nodes one device's share of the node's NICs (a pair on two nodes)."""
        group = self.link(cp, tp)
        one_node = self.cluster.node_of(0) == self.cluster.node_of((cp - 1) * tp)
        return group, (group if one_node else self.link(2, self.cluster.devices_per_node))

    def layer_costs(self, c: ParallelConfig) -> tuple[_LayerCost, _LayerCost, _LayerCost]:
        """Costs of (embedding, a block, head) for ``c``'s tp, micro-batch, sp, checkpointing, cp."""
        cp = (c.cp, c.cp_mode if c.cp > 1 else "ring")
        key = (c.tp, c.micro_batch_size, c.sequence_parallel, c.checkpointing, c.split_backward, *cp, c.ep)
        if key not in self._costs:
            p = self.profile
            # checkpoint regions are blocks (passes.lowering.lower): embedding and head keep theirs
            ends = (c.tp, c.micro_batch_size, c.sequence_parallel, "none", c.split_backward, *cp, c.ep)
            self._costs[key] = (self._layer_cost(p.embedding, *ends), self._layer_cost(p.blocks[0], *key),
                                self._layer_cost(p.head, *ends, loss=True))
        return self._costs[key]

    def _layer_cost(self, layer: LayerProfile, tp: int, mbs: int, sp: bool, ckpt: str, split: bool = False,
                    cp: int = 1, mode: str = "ring", ep: int = 1, *, loss: bool = False) -> _LayerCost:
        dev = self.cluster.device
        # Context parallelism cuts every activation's sequence over cp ranks: a rank holds
        # mbs·S/cp tokens, so every per-sample number of the profile (FLOPs, bytes moved, saved
        # activations, the boundary tensor) counts ``mbs / cp`` samples. This holds for the
        # attention too: its FLOPs are quadratic in S, and the load-balanced layout gives each
        # rank 1/cp of them (mbs·S/cp queries against S keys). What cp changes beyond that is
        # the attention kernel and its exchanges (:meth:`_cp_attention`).
        b = mbs / cp
        fwd, bwd = self._matmul_times(layer, tp, b, ep)  # a gathered-form expert kernel runs on the ep group's rows
        matmul_fwd = fwd
        wgrad = bwd / 2  # of each matmul-class kernel's two backward kernels, the weight gradient's
        mem_fwd = memory_bound_time(self._memory_bound_bytes(layer, tp, b, sp), dev)
        # an elementwise op's backward reads the output gradient and its saved input and writes
        # the input gradient: about twice its forward's bytes
        fwd += mem_fwd
        bwd += 2 * mem_fwd
        # framework overhead per dispatched op (independent of b and tp); backward twice the forward's
        ops = layer.ops or layer.matmuls  # profiles made before op counting: the matmul kernels
        fwd += op_overhead_time(ops, dev)
        bwd += op_overhead_time(2 * ops, dev)
        if split:  # a split backward runs every weight-reading op's backward a second time (W)
            extra = op_overhead_time(SPLIT_OPS_PER_MATMUL * layer.matmuls, dev)
            bwd += extra
            wgrad += extra / 2  # W's engine pass; I's capture of the output gradients is the other half
        msg = layer.boundary_bytes * b
        link = self.link(tp, 1)
        one = (reduce_scatter_time(msg, tp, link) + all_gather_time(msg, tp, link)) if sp else all_reduce_time(msg, tp, link)
        fwd_comm = layer.tp_all_reduces * one
        repl = layer.replicated_activation_bytes / (tp if sp else 1)
        full = (repl + (layer.activation_bytes - layer.replicated_activation_bytes) / tp) * b
        if sp and tp > 1 and layer.name != "embedding":
            # the input each all-gather makes whole for the column-parallel matmuls is what they
            # save: a whole [b, s, h] per gather, where the profile's own tensor there is one shard
            # (the embedding gathers nothing: its output is reduce-scattered)
            full += layer.tp_all_reduces * layer.boundary_bytes * b * (1 - 1 / tp)
        cpa = _CpAttention()
        if cp > 1 and self.profile.attention is not None and any(k.fused_attention for k in layer.kernels):
            cpa = self._cp_attention(layer, mbs, cp, mode, tp)
        elif cp > 1 and loss:  # the mean loss: a sum and a token count, each all-reduced over the cp group
            cpa = _CpAttention(comm_fwd=2 * all_reduce_time(4.0, cp, self.cp_links(cp, tp)[0]))
        fwd += cpa.fwd
        bwd += cpa.bwd
        remat_working = 0.0
        if ckpt == "full":
            act = layer.boundary_bytes * b / (tp if sp else 1)
            recompute = fwd + fwd_comm + cpa.comm_fwd  # the rerun forward exchanges again
            full += cpa.saved_bytes  # the working set of the block being recomputed
        elif ckpt == "dag" and layer.dag_activation_bytes is not None:
            # the profile's dag decision: a share of the saved bytes kept; a checkpointed block
            # replays its memory-bound ops, its overheads and its exchanges, and of its matmul-class
            # kernels those whose outputs it does not keep
            keep = layer.dag_activation_bytes / layer.activation_bytes if layer.activation_bytes else 1.0
            act = full * keep + cpa.saved_bytes
            share = layer.dag_recompute_flops / layer.fwd_flops if layer.fwd_flops else 0.0
            recompute = (layer.dag_checkpointed * (mem_fwd + op_overhead_time(ops, dev) + fwd_comm + cpa.comm_fwd)
                         + share * (matmul_fwd + cpa.fwd))
            full += cpa.saved_bytes  # the working set of the block being recomputed
        elif ckpt == "tensor" and layer.tensor_activation_bytes is not None:
            # the profile's per-tensor decision: a share of the saved bytes kept; each recomputed
            # op runs again once in backward (its matmul FLOPs, its share of the memory-bound
            # work and op overheads); collectives and cp exchanges are kept, never run again
            keep = layer.tensor_activation_bytes / layer.activation_bytes if layer.activation_bytes else 1.0
            act = full * keep + cpa.saved_bytes
            share = layer.tensor_recompute_flops / layer.fwd_flops if layer.fwd_flops else 0.0
            recompute = (layer.tensor_recomputed_ops * (mem_fwd + op_overhead_time(ops, dev))
                         + share * matmul_fwd)
            # its forward runs node by node through the executor (pack hooks, bookkeeping): about
            # one more op overhead per op (bench/remat_policies.py: the ResNet's 2.3 ms step took
            # 4.6 ms with nothing recomputed, BERT's 2.9 ms 8.3 ms)
            fwd += op_overhead_time(ops, dev)
            remat_working = layer.tensor_working_bytes * b  # what its recomputes hold in backward
        elif ckpt == "selective":  # the attention core reruns: its exchanges too, its extra saves are not kept
            act = full - layer.attention_score_bytes * b / tp
            recompute = self._attention_recompute_time(layer, tp, b) + cpa.recompute
        else:
            act, recompute = full + cpa.saved_bytes, 0.0
            full = act
        ep_comm, experts, params = 0.0, 0.0, layer.param_count / tp
        if ep > 1 and layer.experts:
            # the ep rewrite (passes.rewrites.expert_parallel): this rank's experts run on the ep
            # group's tokens (dense form: its input, which every expert matmul saves once more) or
            # rows (gathered form: every routed kernel's tensors, ep times its own)
            ep_comm = self._ep_comm(layer, b, ep, tp)
            gathered = (ep - 1) * layer.boundary_bytes * b
            if layer.moe_form == "gathered":
                gathered = (ep - 1) * b * sum(k.bytes for k in layer.kernels if k.gathered_expert)
            act += gathered
            full += gathered
            recompute += ep_comm / 2 if ckpt == "full" else 0.0  # the rerun forward dispatches again
            experts = layer.expert_param_count / ep
            params = (layer.param_count - layer.expert_param_count) / tp + experts
        held = 0.0
        if split:
            # tensor parallelism shards the column-parallel outputs; the row-parallel ones (one per
            # all-reduce of the boundary tensor: attention and MLP outputs, the embedding's lookup)
            # are whole on every rank before their reduction; the norms' [.., h] outputs shard with
            # sequence parallelism
            hidden = layer.hidden_held_grad_bytes
            whole = 0.0 if loss else min(layer.held_grad_bytes - hidden, layer.tp_all_reduces * layer.boundary_bytes)
            held = ((layer.held_grad_bytes - hidden - whole) / tp + whole + hidden / (tp if sp else 1)) * b
        return _LayerCost(fwd=fwd, bwd=bwd, tp_comm=2 * fwd_comm, recompute=recompute, act_bytes=act,
                          held_grad_bytes=held,
                          full_act_bytes=full, params=params,
                          cp_comm=cpa.comm_fwd + cpa.comm_bwd, working_bytes=cpa.working_bytes, weight_grad=wgrad,
                          remat_working_bytes=remat_working, ep_comm=ep_comm, expert_params=experts)

    def _ep_comm(self, layer: LayerProfile, b: float, ep: int, tp: int = 1) -> float:
        """Seconds of one block's expert-parallel exchanges for ``b`` samples per rank, forward and
        backward: the dispatch all-gathers the block input and the combine weights of the ep group's
        tokens ([ep*b, s, h] and [ep*b, s, experts]), the combine reduce-scatters the experts'
        partial sum ([ep*b, s, h]); backward runs each as its opposite. The gathered form exchanges
        a row per token and choice (``top_k`` times the tokens) and each row's expert id and
        weight. The ep group is ``ep`` consecutive ranks of the data axis (``tp`` apart)."""
        link = self.sync_link(ep, tp)
        x = layer.boundary_bytes * b * ep  # the gathered (or scattered) buffer
        weights = x * layer.experts / max(1, self.profile.hidden)
        if layer.moe_form == "gathered":  # a row per (token, choice): rows, their ids and weights
            x *= layer.top_k
            weights = 3 * x / max(1, self.profile.hidden)
        one_way = all_gather_time(x, ep, link) + all_gather_time(weights, ep, link) + reduce_scatter_time(x, ep, link)
        return 2 * one_way

    def _cp_attention(self, layer: LayerProfile, mbs: int, cp: int, mode: str, tp: int = 1) -> _CpAttention:
        """What context parallelism adds to one block's attention for a micro-batch of ``mbs``
        samples, per rank, over the sites of the block (``AttentionProfile.sites``). The block's
        SDPA kernels are already costed at ``mbs/cp`` samples by the caller (the right FLOPs and
        bytes for each rank's share). With ``tp > 1`` a rank attends with its ``H/tp`` heads (and
        kv heads), so every tensor, block and FLOP below is divided by ``tp``, and the cp group's
        ranks lie ``tp`` apart.

        **ring** (``runtime.kernels.context_parallel``): the SDPA kernel is replaced by blocks of
        ``c = S/(2cp)`` queries by ``c`` keys computed in *fp32* (:data:`RING_COMPUTE_DTYPE`) with
        unfused score ops; its FLOPs are the SDPA kernel's (the profile's count, divided by cp as
        for every plan, so cp=1, ring and Ulysses compare on one count), timed at the fp32 rate,
        plus the fp32 score blocks' traffic of the pairs it computes (:func:`ring_attention_pairs`)
        and its per-op overhead. Forward: ``cp−1`` steps each send this rank's stacked K/V
        ``[2, b, H_kv, S/cp, D]`` to the next rank while the block it holds is computed (the next
        block is posted before the current one runs): exposed ``max(0, comm − compute)`` per step.
        Backward: ``cp−1`` K/V steps again, overlapped likewise, plus ``cp`` steps of the fp32
        dK/dV blocks, each waited right after the block's compute (exposed whole: the kernel
        waits for it before the next step). On a host device nothing overlaps.

        **ulysses**: SDPA over the whole sequence with ``H/cp`` heads (the same FLOPs and bytes as
        the caller's ``mbs/cp`` samples), plus all-to-alls of q, k, v and the output forward and
        the four back in backward, each moving ``(cp−1)/cp`` of its local tensor, nothing hidden;
        K and V move with their kv heads when those divide by ``tp·cp`` (else repeated to all
        heads, as the rewrite does). The head-sharded q, k, v that SDPA saves are new storages: saved bytes
        beyond the profile's."""
        dev, att, S = self.cluster.device, self.profile.attention, self.profile.seq
        b, item = mbs / cp, self.itemsize
        sites, H, D = att.sites, att.heads, att.head_dim
        link, ring_link = self.cp_links(cp, tp)
        q_bytes = b * S * H * D * item / tp  # one local [b, H/tp, S/cp, D] tensor on a rank
        sdpa = [k for k in layer.kernels if k.fused_attention]
        if mode == "ulysses":
            kvh = att.kv_heads if att.kv_heads % (cp * tp) == 0 else H
            kv_bytes = b * S * kvh * D * item / tp
            moved = (q_bytes, kv_bytes, kv_bytes, q_bytes)
            comm = sites * ulysses_all_to_all_time(moved, cp, link)
            # each exchange also copies its tensor into and out of the [cp, ...] layout
            copies = memory_bound_time(2 * sum(moved), dev) * sites + op_overhead_time(4 * len(moved) * sites, dev)
            saved = sites * (q_bytes + 2 * kv_bytes)
            working = 3 * q_bytes
            return _CpAttention(fwd=copies, bwd=copies, comm_fwd=comm, comm_bwd=comm, saved_bytes=saved,
                                working_bytes=working, recompute=copies + comm)
        kv_bytes = b * S * (att.kv_heads if att.kv_heads % tp == 0 else H) * D * item / tp
        pairs = ring_attention_pairs(cp, att.causal)
        c = S / (2 * cp)
        block = mbs * H * c * c * 4 / tp  # one fp32 [b, H/tp, c, c] score block
        bt = b / tp  # the SDPA kernels' per-sample counts, for a rank's share of samples and heads
        sdpa_fwd = sum(self._kernel_time(k.fwd_flops * bt, k.bytes * bt, k.weight_bytes) for k in sdpa)
        sdpa_bwd = sum(2 * self._kernel_time(k.bwd_flops * bt / 2, k.bytes * bt, k.weight_bytes)
                       for k in sdpa if k.bwd_flops)
        flops_f = sum(k.fwd_flops for k in sdpa) * bt
        flops_b = sum(k.bwd_flops for k in sdpa) * bt

        def matmuls(flops: float, n: int) -> float:  # n equal fp32 matmul kernels
            return n * compute_time(flops / n, dev, RING_COMPUTE_DTYPE, overhead=False) if flops else 0.0

        ring_f = (matmuls(flops_f, 2 * pairs) + memory_bound_time(RING_SCORE_PASSES_FWD * block * pairs, dev)
                  + op_overhead_time(RING_OPS_PER_PAIR_FWD * pairs + RING_OPS_PER_STEP_FWD * cp, dev))
        ring_b = (matmuls(flops_b, 5 * pairs) + memory_bound_time(RING_SCORE_PASSES_BWD * block * pairs, dev)
                  + op_overhead_time(RING_OPS_PER_PAIR_BWD * pairs + RING_OPS_PER_STEP_BWD * cp, dev))
        kv_msg = 2 * kv_bytes  # K and V stacked: one message per step
        dkv_msg = kv_msg * 4 / item  # their gradients travel in fp32
        hide = 0.0 if self.on_host else 1.0
        comm_f = ring_exposed_time(kv_msg, cp - 1, ring_link, hide * ring_f / cp)
        comm_b = ring_exposed_time(kv_msg, cp - 1, ring_link, hide * ring_b / cp) + ring_exposed_time(dkv_msg, cp, ring_link)
        q32, kv32 = q_bytes * 4 / item, kv_bytes * 4 / item
        # backward's peak: score blocks (p, dP, dS), fp32 q/dO/dq, K/V expanded to all heads and
        # their per-step gradients, the travelling dK/dV and the one received
        working = RING_WORKING_BLOCKS * block + 7 * q32 + 4 * kv32
        return _CpAttention(fwd=sites * (ring_f - sdpa_fwd), bwd=sites * (ring_b - sdpa_bwd), comm_fwd=sites * comm_f,
                            comm_bwd=sites * comm_b, working_bytes=working,
                            recompute=sites * (ring_f - sdpa_fwd + comm_f))

    def _kernel_time(self, flops: float, act_bytes: float, weight_bytes: float) -> float:
        """Seconds of one matmul-class kernel on one device: the roofline of its FLOPs and bytes
        (activations and its weight shard), framework overhead left to the op count."""
        return roofline_time(flops, act_bytes + weight_bytes, self.cluster.device, self.dtype, overhead=False)

    def _matmul_times(self, layer: LayerProfile, tp: int, b: int, ep: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds of the layer's matmul-class kernels for a micro-batch of
        ``b`` on one of ``tp`` ranks, each kernel on the roofline. A kernel's FLOPs, activations
        and weights are split over the tp ranks (column/row-parallel shards; the replicated input
        of a column-parallel matmul is a small part of its bytes). Its backward is two kernels
        (input and weight gradient) of half its backward FLOPs, each moving the forward's bytes.
        A gathered-form expert kernel runs on the rows of its ep group's ``ep`` ranks."""
        if not layer.kernels:  # a profile without per-node costs: ``matmuls`` equal kernels
            k = layer.matmuls
            fwd = k * self._kernel_time(layer.fwd_flops * b / tp / k, 0.0, 0.0) if layer.fwd_flops else 0.0
            bwd = 2 * k * self._kernel_time(layer.bwd_flops * b / tp / (2 * k), 0.0, 0.0) if layer.bwd_flops else 0.0
            return fwd, bwd
        fwd = bwd = 0.0
        for kern in layer.kernels:
            rows = b * ep if kern.gathered_expert else b
            moved, weights = kern.bytes * rows / tp, kern.weight_bytes / tp
            fwd += self._kernel_time(kern.fwd_flops * rows / tp, moved, weights)
            if kern.bwd_flops:
                bwd += 2 * self._kernel_time(kern.bwd_flops * rows / tp / 2, moved, weights)
        return fwd, bwd

    @staticmethod
    def _memory_bound_bytes(layer: LayerProfile, tp: int, b: int, sp: bool) -> float:
        """Bytes the layer's non-matmul kernels move in one forward of ``b`` samples on one device:
        tensor parallelism shards the [.., 4h]/vocab-sized tensors; the [.., h] ones (norms,
        residuals, dropout) stay whole on every rank unless sequence parallelism shards them."""
        return (layer.memory_bound_bytes / tp + layer.replicated_memory_bound_bytes / (tp if sp else 1)) * b

    def _attention_recompute_time(self, layer: LayerProfile, tp: int, b: int) -> float:
        """Seconds of selective checkpointing's extra forward: the attention-core kernels again."""
        dev = self.cluster.device
        if not layer.kernels:
            return compute_time(layer.attention_flops * b / tp, dev, self.dtype) if layer.attention_flops else 0.0
        core = [k for k in layer.kernels if k.attention]
        # an unfused core also reruns its mask, softmax and dropout on the [s, s] scores
        scores = memory_bound_time(layer.score_memory_bound_bytes * b / tp, dev)
        return (sum(self._kernel_time(k.fwd_flops * b / tp, k.bytes * b / tp, k.weight_bytes / tp) for k in core)
                + scores + op_overhead_time(len(core), dev))




def optimizer_tensors(profile: ModelProfile, ranges: list[tuple[int, int]], zero_stage: int, shards: int) -> float:
    """Tensors one rank's optimizer steps for a stage of the layers in ``ranges`` (0: embedding,
    1..L: blocks, L+1: head): every parameter tensor, each shard of one under ZeRO-3; under
    ZeRO-1/2 the segments of the rank's flat chunk (:class:`runtime.optim.grad_sync.ShardedOptimizer`
    cuts it where the weight-decay group changes), about the stage's runs over ``shards``."""
    layers = [profile.layers[i] for start, stop in ranges for i in range(start, stop)]
    if zero_stage in (1, 2):
        return max(1.0, sum(layer.param_runs for layer in layers) / shards)
    return float(sum(layer.param_tensors for layer in layers))


def _state_per_param(ctx: PlanContext, c: ParallelConfig, *, experts: bool = False) -> tuple[float, float, float]:
    """Device bytes per (tp-sharded) parameter: (params, grads, optimizer) under ZeRO/offload.
    ZeRO shards over the ``dp * cp`` ranks that hold the same parameters (cp ranks replicate them);
    ``experts``: per parameter of the routed experts a rank holds, which ZeRO-1/2 shard over the
    ``dp * cp / ep`` ranks holding the same experts."""
    shards = c.expert_replicas if experts else c.shard_degree if c.zero_stage == 3 else c.dp_cp
    ms = model_state_bytes(1.0, shards, c.zero_stage, ctx.dtype, ctx.optimizer)
    opt = 0.0 if c.offload == "optimizer" else ms.optimizer
    if c.zero_stage in (1, 2) and not is_mixed(ctx.dtype) and opt:
        opt += 4.0 / shards  # runtime.optim.grad_sync.ShardedOptimizer steps an fp32 copy of its chunk
    grads = ms.grads
    if c.zero_stage == 2 and is_mixed(ctx.dtype):
        grads = 4.0 / shards  # the sharded accumulator sums in fp32 (runtime.optim.grad_sync)
    # ZeRO-3: the optimizer steps the shards themselves, whose gradients are in the parameters' dtype
    return ms.params, grads, opt


def _inflight(c: ParallelConfig, stage: int) -> float:
    n = in_flight_microbatches(c.schedule, stage, c.pp, c.num_micro_batches, c.virtual_pp)
    if c.offload == "activations":
        n = min(n, 2.0 / c.virtual_pp if c.virtual_pp > 1 else 2.0)
    return n


def boundary_message_bytes(ctx: PlanContext, c: ParallelConfig) -> float:
    """Bytes of one pipeline message of one rank (a micro-batch's boundary activations, or
    their gradients): every tp rank sends the whole boundary tensor to its peer of the next
    stage (tensor parallelism replicates it), or under sequence parallelism its sequence chunk
    (:func:`passes.rewrites.sequence_parallel.shard_stage_io`). Under context parallelism each cp rank
    sends its share of the sequence (``1/cp``) to its peer of the next stage."""
    return ctx.profile.blocks[0].boundary_bytes * c.micro_batch_size / (c.tp if c.sequence_parallel else 1) / c.cp


def _buffers(ctx: PlanContext, c: ParallelConfig, grads: float | None = None, messages: int | None = None) -> float:
    """Communication buffers of one device, bytes: pp and tp buffers, plus the dp gradient
    buckets (``min(2 buckets, grads)`` when the stage's full-size ``grads`` bytes are given), plus
    the working set of a block's context-parallel attention (received blocks, fp32 score blocks).
    ``messages``: the received inputs and sent input gradients the stage holds at its peak
    (:func:`partitioner.cost.cost_model.pipeline_states`), beside a forward send and a gradient
    received; without it, one of each of the four kinds of pipeline message."""
    msg = boundary_message_bytes(ctx, c)
    out = ctx.layer_costs(c)[1].working_bytes if c.cp > 1 else 0.0
    if c.dp_cp > 1 and grads is not None:
        out += min(2 * DEFAULT_BUCKET_BYTES, grads)
    if c.pp > 1:
        out += 4 * msg if messages is None else (2 + messages) * msg
    if c.tp > 1:
        out += msg
    return out


def _assignment(ctx: PlanContext, c: ParallelConfig, costs, limit: float | None) -> list[list[tuple[int, int]]] | None:
    """Chain ranges per stage; ``limit`` bytes per device (None: ignore memory)."""
    L, p, v = ctx.L, c.pp, c.virtual_pp
    emb, blk, head = costs
    if v > 1:  # interleaved, zbv: chunks placed as the schedule places its stages
        sizes = chunk_sizes(L, [c.stage_rank(j) for j in range(p * v)], p, emb.time / (blk.time or 1.0),
                            head.time / (blk.time or 1.0))
        chunks = [[] for _ in range(p)]
        start = 1
        for j, n in enumerate(sizes):
            stop = start + n
            chunks[c.stage_rank(j)].append((0 if j == 0 else start, L + 2 if j == p * v - 1 else stop))
            start = stop
        return chunks
    greedy = _greedy(ctx, c, costs)
    if greedy(float("inf"), limit) is None:
        return None
    times = [emb.time, blk.time, head.time]
    cands = _bottlenecks(L, *times)
    lo = bisect.bisect_left(cands, max(sum(times[i] * (L if i == 1 else 1) for i in range(3)) / p, max(times)) * (1 - 1e-12))
    hi = len(cands) - 1
    lo = min(lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(cands[mid], limit) is None:
            lo = mid + 1
        else:
            hi = mid
    return greedy(cands[lo], limit) or greedy(float("inf"), limit)


def chunk_sizes(blocks: int, ranks: list[int], p: int, embedding: float = 0.0, head: float = 0.0) -> list[int]:
    """Blocks per model chunk (virtual stage ``j`` runs on pipeline rank ``ranks[j]``) when the
    chunks of an interleaved or V schedule cannot all hold the same number: each chunk gets
    ``blocks // len(ranks)``, and each remaining block goes to one of the shallowest chunks, a
    middle one before the first and last (they also hold the embedding and the head), that of the
    rank with the least work so far (``embedding`` and ``head``: the first and last chunk's extra
    work, in blocks), the lowest index on a tie. No two chunks differ by more than one block."""
    n = len(ranks)
    sizes = [blocks // n] * n
    load = [0.0] * p
    for j, r in enumerate(ranks):
        load[r] += sizes[j]
    load[ranks[0]] += embedding
    load[ranks[-1]] += head
    for _ in range(blocks - sum(sizes)):
        least = min(sizes)
        pool = [j for j in range(1, n - 1) if sizes[j] == least] or [j for j in range(n) if sizes[j] == least]
        j = min(pool, key=lambda j: (load[ranks[j]], j))
        sizes[j] += 1
        load[ranks[j]] += 1
    return sizes


@functools.lru_cache(maxsize=256)
def _bottlenecks(L: int, emb: float, blk: float, head: float) -> list[float]:
    """Possible bottleneck times of a stage split (seconds, sorted): contiguous sums of the chain
    (n blocks, with or without the ends); the same for every config of the same layer times."""
    return sorted({n * blk + e * emb + h * head for n in range(L + 1) for e in (0, 1) for h in (0, 1) if n + e + h > 0})


def _greedy(ctx: PlanContext, c: ParallelConfig, costs) -> Callable[[float, float | None], list | None]:
    """``fill(T, limit)``: fill stages left to right with as many layers as time ``T`` and memory
    ``limit`` allow (None: the layers do not fit). What does not depend on ``T`` and ``limit`` is
    worked out once here: the binary search over ``T`` fills a config's stages about ten times."""
    L, p = ctx.L, c.pp
    emb, blk, head = costs
    wp, wg, wo = _state_per_param(ctx, c)
    per_param = wp + wg + wo
    per_expert_param = sum(_state_per_param(ctx, c, experts=True)) - per_param  # more where ZeRO shards them over fewer
    shared = ctx.profile.shared_param_count / c.tp
    runs = [(emb, 1, shared if p > 1 else 0.0, emb.time), (blk, L, 0.0, blk.time), (head, 1, shared, head.time)]
    in_flight = [_inflight(c, stage) for stage in range(p)]
    base = _buffers(ctx, c) + _recompute_working_set(c, blk)
    bucket = 2 * DEFAULT_BUCKET_BYTES if c.dp_cp > 1 else 0.0
    return functools.partial(_fill, p=p, runs=runs, per_param=per_param, per_expert_param=per_expert_param,
                             in_flight=in_flight, base=base, bucket=bucket,
                             itemsize=ctx.itemsize if c.dp_cp > 1 else 0.0)


def _fill(T: float, limit: float | None, *, p: int, runs, per_param: float, per_expert_param: float,
          in_flight: list[float], base: float, bucket: float, itemsize: float) -> list | None:
    """:func:`_greedy`'s fill of the stages (``per_expert_param``: the state bytes an expert
    parameter holds beyond ``per_param``; ``itemsize``: gradient bytes per parameter that the dp
    buckets grow by, 0 without dp)."""
    eps = 1e-12 * max(T, 1e-30) if math.isfinite(T) else 0.0
    counts = []
    run, left = 0, runs[0][1]
    for stage in range(p):
        n_in = in_flight[stage]
        t = grads = 0.0
        taken = 0
        mem = base
        while run < 3:
            cost, _, extra, seconds = runs[run]
            w = (cost.params + extra) * per_param + cost.expert_params * per_expert_param + n_in * cost.act_bytes
            g = (cost.params + extra) * itemsize  # gradient bucket growth
            n = left
            if seconds > 0:
                n = min(n, int((T - t + eps) // seconds)) if math.isfinite(T) else n
            if limit is not None and w + g > 0:
                # fits when mem + n·w + min(bucket, grads + n·g) <= limit: either bound suffices
                full = (limit - mem - bucket) // w if w > 0 else float("inf")
                growing = (limit - mem - grads) // (w + g)
                n = min(n, int(max(full, growing)))
            n = max(n, 0)
            t += n * seconds
            mem += n * w
            grads += n * g
            taken += n
            left -= n
            if left > 0:
                break
            run += 1
            left = runs[run][1] if run < 3 else 0
        if taken == 0 and run < 3:
            return None
        counts.append(taken)
    if run < 3:
        return None
    # Stages the greedy left empty (it packs early stages full) take one layer from the nearest
    # earlier stage with several; counts stay contiguous ranges, the caller re-checks memory.
    for st in range(p):
        if counts[st] == 0:
            donors = [i for i in range(st) if counts[i] > 1]
            if not donors:
                return None
            counts[donors[-1]] -= 1
            counts[st] += 1
    ranges, start = [], 0
    for n in counts:
        ranges.append([(start, start + n)])
        start += n
    return ranges


def _stage_numbers(ctx: PlanContext, c: ParallelConfig, costs, ranges: list[tuple[int, int]], stage: int):
    """Time per micro-batch (fwd, bwd, tp, recompute), params on device, memory breakdown."""
    emb, blk, head = costs
    L, p = ctx.L, c.pp
    f = b = tpc = rc = cpc = epc = params = experts = act = w_grad = 0.0
    chunk_act, chunk_held, chunk_params = [], [], []  # per model chunk of the stage (range), bytes and parameters
    shared = ctx.profile.shared_param_count / c.tp
    largest = 0.0  # the most parameters one layer of the stage has (ZeRO-3 gathers a layer at a time)
    kept = 0.0  # parameters of the layers whose backward reads them (the embedding's reads only ids)
    for start, stop in ranges:
        chunk_act.append(0.0)
        chunk_held.append(0.0)
        chunk_params.append(0.0)
        for i in range(start, stop):
            cost = emb if i == 0 else head if i == L + 1 else blk
            largest = max(largest, cost.params + (shared if (i == 0 and p > 1) or i == L + 1 else 0.0))
            if i > 0:
                kept += cost.params + (shared if i == L + 1 else 0.0)
            f += cost.fwd
            b += cost.bwd
            w_grad += cost.weight_grad
            tpc += cost.tp_comm
            rc += cost.recompute
            cpc += cost.cp_comm
            epc += cost.ep_comm
            params += cost.params
            experts += cost.expert_params
            act += cost.act_bytes
            chunk_act[-1] += cost.act_bytes
            chunk_held[-1] += cost.held_grad_bytes
            chunk_params[-1] += cost.params
            if (i == 0 and p > 1) or i == L + 1:
                params += shared
                chunk_params[-1] += shared
    wp, wg, wo = _state_per_param(ctx, c)
    xp, xg, xo = _state_per_param(ctx, c, experts=True)  # the experts' (ZeRO shards them over their replicas)
    memory = {
        "parameters": params * wp + experts * (xp - wp),
        "gradients": params * wg + experts * (xg - wg),
        "optimizer": params * wo + experts * (xo - wo),
        "activations": act * _inflight(c, stage) + _recompute_working_set(c, blk),
        "buffers": _buffers(ctx, c, None if c.zero_stage == 3 else params * ctx.itemsize),
    }
    if p > 1 and (c.offload != "activations" or c.split_backward):
        # each chunk's graph lives until its backward (a split one's: until its W, with its held
        # gradients from its I, and a W makes the chunk's weight gradients at once), and the
        # rank holds pipeline messages (received inputs, input gradients sent): the schedule's
        # fullest moment (:func:`partitioner.cost.cost_model.pipeline_states`). Offloaded
        # activations are not counted off a split backward's: I brings a micro-batch's back and
        # they stay until its W
        states = pipeline_state_arrays(c.schedule, stage, p, c.num_micro_batches, c.virtual_pp)
        held_bytes = states.graphs @ chunk_act + states.held @ chunk_held
        # the accumulated gradients of the chunks whose backward ran, the weight half's at once
        grad_bytes = states.grads @ chunk_params * (memory["gradients"] / (params or 1.0)) \
            + states.weight @ chunk_params * ctx.itemsize
        k = int((held_bytes + grad_bytes + states.messages * boundary_message_bytes(ctx, c)).argmax())
        memory["activations"] = float(held_bytes[k]) + _recompute_working_set(c, blk)
        memory["gradients"] = float(grad_bytes[k])
        memory["buffers"] = _buffers(ctx, c, None if c.zero_stage == 3 else params * ctx.itemsize,
                                     int(states.messages[k]))
    if c.zero_stage == 3:  # the gathered full parameters count as communication buffers
        memory["buffers"] += zero3_gathered_bytes(largest, ctx.itemsize,
                                                  kept_params=None if c.reshard_after_forward else kept)
    return f, b, tpc, rc, cpc, params, act, memory, w_grad, epc, experts


def evaluate(ctx: PlanContext, c: ParallelConfig, *, limit: float | None | str = "device") -> Evaluated:
    """Partition, memory and step time of one candidate; ``limit=None`` splits the stages by time
    only (to say how much memory the candidate needs)."""
    costs = ctx.layer_costs(c)
    cap = ctx.cap_for(c)
    assignment = _assignment(ctx, c, costs, cap if limit == "device" else limit)
    feasible = assignment is not None
    shaped = False
    if assignment is None:  # how much it would need: the time-balanced split, memory ignored
        assignment = _assignment(ctx, c, costs, None)
    elif ctx.tell_shaped and limit == "device" and c.pp > 1 and c.virtual_pp == 1:
        shaped = _assignment(ctx, c, costs, None) != assignment
    dev = ctx.cluster.device
    # ranks the sharded model state is spread over: dp x cp hold the same parameters
    shards = c.shard_degree if c.zero_stage == 3 else c.dp_cp
    ms1 = model_state_bytes(1.0, shards, c.zero_stage, ctx.dtype, ctx.optimizer)
    stages, per_stage, step_end_waits = [], [], []
    for s, ranges in enumerate(assignment):
        f, b, tpc, rc, cpc, params, act, memory, w_grad, epc, experts = _stage_numbers(ctx, c, costs, ranges, s)
        t_mb = f + b + tpc + rc + cpc + epc
        # data parallel: grads of this stage; the last micro-batch's backward hides part of it.
        # Gradients are averaged over the dp x cp ranks holding the same parameters (cp innermost);
        # an ep rank's experts over the dp x cp / ep ranks holding the same experts, in buckets of
        # their own after the others
        grads = params * ctx.itemsize
        shared = grads - experts * ctx.itemsize  # what the dp x cp buckets carry
        link = ctx.sync_link(c.dp_cp, c.tp)
        extra = gradient_buckets(ctx, c, ranges, shared) - 1

        def per_bucket(collective) -> float:  # one call per gradient bucket, each paying the latency
            return collective(shared, c.dp_cp, link) + extra * collective(0.0, c.dp_cp, link)

        # the collectives the stage's ZeRO stage issues (ZeRO-3's are its gathers, priced below)
        rs = ag = ar = 0.0
        if c.zero_stage in (1, 2):
            rs, ag = per_bucket(reduce_scatter_time), per_bucket(all_gather_time)
        elif c.zero_stage == 0:
            ar = per_bucket(all_reduce_time)
        if experts:  # ZeRO-1/2 shard them over the expert replicas: reduce-scatter, then gather the update
            e_bytes, e_link = experts * ctx.itemsize, ctx.sync_link(c.expert_replicas, c.ep)
            if c.zero_stage in (1, 2):
                rs += reduce_scatter_time(e_bytes, c.expert_replicas, e_link)
                ag += all_gather_time(e_bytes, c.expert_replicas, e_link)
            else:
                ar += all_reduce_time(e_bytes, c.expert_replicas, e_link)
        # the fixed wait of each synchronising call after the last backward, in the term of its phase
        waits = {}
        for kind, n in step_end_calls(ctx, c, ranges, grads).items():
            term = STEP_END_TERMS.get(kind, "framework")
            waits[term] = waits.get(term, 0.0) + n * ctx.cluster.step_end_wait_s
        step_end_waits.append(waits)
        # on a host device (gloo on CPU) the bucket's collective shares the rank's one thread
        # with backward: nothing hides it
        hide, share = (0.0 if ctx.on_host else b), ctx.comm_share
        if c.zero_stage == 3:
            layers = sum(stop - start for start, stop in ranges)
            replicas = c.dp_cp // shards  # HSDP: gathers and reduce-scatters inside a shard group, all-reduce across
            dp_exposed, slowed = zero3_exposed_time(params * ctx.itemsize, params * 4, c, ctx.sync_link(shards, c.tp),
                                                    f, b + rc, ctx.on_host, layers=layers,
                                                    replicas=(replicas, ctx.sync_link(replicas, c.tp * shards)),
                                                    share=share)
        elif c.zero_stage == 0:    # one all-reduce after the last micro-batch, hidden behind its backward
            dp_exposed, slowed = overlapped(ar, hide, share)
        elif c.zero_stage == 1:  # reduce-scatter hidden likewise; all-gather of new weights after the step
            dp_exposed, slowed = overlapped(rs, hide, share)
            dp_exposed += ag
        else:                    # sharded grads: a reduce-scatter per micro-batch, each behind its backward
            dp_exposed, slowed = (c.num_micro_batches * t for t in overlapped(rs, hide, share))
            dp_exposed += ag
        dp_exposed += waits.get("dp_comm", 0.0)
        t_opt, opt_bytes = _optimizer_time(ctx, c, params, experts, shards, ms1,
                                           optimizer_tensors(ctx.profile, ranges, c.zero_stage, shards))
        t_off = 0.0
        host = opt_bytes if c.offload == "optimizer" else 0.0
        if c.offload == "activations":
            copy = 2 * act / min(ctx.cluster.host_to_device.bandwidth_bytes_per_s, ctx.host_rate)
            # each saved tensor is one copy out and one back: the link's α and the framework call
            copy += 2 * _saved_tensors(ctx, c, ranges) * (ctx.cluster.host_to_device.latency_s + dev.offload_call_s)
            if ctx.on_host:  # copies and saved-tensor hooks run inside forward/backward: stage time
                t_mb += copy
                t_off = c.num_micro_batches * copy
            else:  # copies out behind the forward (side stream); each reload prefetched behind the
                # backward of the layers after it (runtime/kernels/offload.py)
                t_off = c.num_micro_batches * (max(0.0, copy / 2 - f) + max(0.0, copy / 2 - (b + rc)))
            host = act * in_flight_microbatches(c.schedule, s, c.pp, c.num_micro_batches, c.virtual_pp)
        if host > ctx.host_cap:
            feasible = False
        peak = sum(memory.values())
        names = tuple(f"{_name(ctx, a)}..{_name(ctx, z - 1)}" for a, z in ranges)
        stages.append(StagePlan(index=s, layers=tuple(tuple(r) for r in ranges), layer_names=names,
                                param_bytes=params * ctx.itemsize, peak_memory_bytes=peak, memory=memory,
                                time_s=t_mb))
        per_stage.append((t_mb, f + b, tpc, rc, dp_exposed, t_opt, t_off, cpc, w_grad / b if b > 0 else 0.0, epc, f,
                          slowed))
    p, v, m = c.pp, c.virtual_pp, c.num_micro_batches
    slow = max(range(p), key=lambda i: (per_stage[i][0], -i))
    t_max, comp, tpc, rc = per_stage[slow][:4]
    cpc, epc = per_stage[slow][7], per_stage[slow][9]
    tail = max(range(p), key=lambda i: (sum(per_stage[i][4:7]) + per_stage[i][11], -i))
    terms = StepTimeTerms(
        # a split backward recomputes a checkpointed region for its input half and again for its
        # weight half (runtime.exec.split_backward)
        compute=m * comp, tp_comm=m * tpc, cp_comm=m * cpc, ep_comm=m * epc, recompute=m * rc * (2 if c.split_backward else 1),
        pp_comm=_pp_comm_time(ctx, c),
        # a zero-bubble schedule fills its bubble with W: how much depends on W's share of the
        # slowest stage's backward (matmul-heavy on GPUs, about half; dispatch-bound CPU ranks less)
        bubble=_bubble_time(c, [st[0] for st in per_stage], per_stage[slow][8]),
        dp_comm=per_stage[tail][4], optimizer=per_stage[tail][5], offload=per_stage[tail][6],
        overlap=per_stage[tail][11],
        tied_comm=_tied_sync_time(ctx, c) + max(w.get("tied_comm", 0.0) for w in step_end_waits),
        framework=_framework_time(ctx) + max(w.get("framework", 0.0) for w in step_end_waits))
    terms = dataclasses.replace(terms, contention=_contention_time(ctx, c, per_stage))
    peak = max(s.peak_memory_bytes for s in stages)
    feasible = feasible and peak <= cap
    return Evaluated(config=c, feasible=feasible, step_time=terms.total, peak=peak, stages=tuple(stages), terms=terms,
                     memory_shaped=shaped)


def _optimizer_time(ctx: PlanContext, c: ParallelConfig, params: float, experts: float, shards: int, ms1,
                    tensors: float) -> tuple[float, float]:
    """(seconds, optimizer state bytes) of one rank's optimizer step over a stage of ``params``
    parameters (``experts`` of them the routed experts' it holds) and ``tensors`` tensors, its
    ZeRO stage's state sharded over ``shards`` ranks (``ms1``: the model-state bytes of one
    parameter). Linear in ``params``: the search's bound takes it at the average stage."""
    dev = ctx.cluster.device
    updated = params / (shards if c.zero_stage >= 1 else 1)  # parameters this rank updates
    if c.zero_stage in (1, 2) and experts:  # its experts' share: over their replicas
        updated += experts / c.expert_replicas - experts / shards
    opt_bytes = updated * ms1.optimizer * (shards if c.zero_stage >= 1 else 1)
    opt_rate = dev.optimizer_bytes_per_s or dev.memory_bandwidth_bytes_per_s  # 0: the memory's, not the nodes'
    if c.offload == "optimizer":
        h2d = ctx.cluster.host_to_device.bandwidth_bytes_per_s
        t_opt = (updated * 2 * ctx.itemsize) / h2d + 2 * opt_bytes / ctx.host_rate
    else:
        t_opt = memory_bound_time(2 * opt_bytes + updated * 2 * ctx.itemsize, opt_rate)
    t_opt += tensors * dev.optimizer_tensor_s
    if c.zero_stage in (1, 2):  # flatten the stage's grads into the bucket, copy the gathered params back
        t_opt += memory_bound_time(4 * params * ctx.itemsize, opt_rate)
    return t_opt, opt_bytes


def _pp_comm_time(ctx: PlanContext, c: ParallelConfig) -> float:
    """Seconds of pipeline messages per step: each micro-batch's boundary activations and their
    gradients, per model chunk, on the pipeline link (whatever the stage split)."""
    if c.pp == 1:
        return 0.0
    pp_link = ctx.pp_link(c)
    if ctx.cluster.p2p_latency_s is not None:  # calibrated per-message seconds of pipeline sends
        pp_link = dataclasses.replace(pp_link, latency_s=ctx.cluster.p2p_latency_s)
    return 2 * send_recv_time(boundary_message_bytes(ctx, c), pp_link) * c.num_micro_batches * c.virtual_pp


def _bubble_time(c: ParallelConfig, stage_s: list[float], weight_share: float) -> float:
    """Idle seconds of the slowest pipeline rank per step, from each rank's seconds per
    micro-batch ``stage_s``. GPipe, 1F1B and interleaved: the first micro-batch's forward and the
    last one's backward pass once through every other rank, so ``(Σ stage_s − max) / v`` (exact
    for GPipe, whose step is ``Σ t + (m − 1)·max``; an upper bound for 1F1B and interleaved,
    which can start their slowest rank earlier; ``(p − 1)/v · max`` when balanced). Zero-bubble
    schedules: their simulated idle slots on balanced stages, times the slowest rank's seconds,
    with W the slowest rank's weight-gradient share of its backward."""
    t_max = max(stage_s)
    if c.split_backward:
        return _bubble_slots(c.schedule, c.pp, c.num_micro_batches, c.virtual_pp, weight_share) * t_max
    return (sum(stage_s) - t_max) / c.virtual_pp


def zero3_gathered_bytes(largest_layer_params: float, itemsize: int, prefetch: int = ZERO3_PREFETCH, *,
                         kept_params: float | None = None) -> float:
    """Bytes of full parameters ZeRO-3 holds at once on a device: the running layer's and the
    ``prefetch`` layers gathered ahead (each at most the stage's largest layer), plus, at a
    layer's backward, its full gradients and their fp32 reduce-scatter buffer.
    ``kept_params`` (``reshard_after_forward=False``): the parameters kept gathered from the
    forward to the backward instead (every layer whose backward reads its weights)."""
    grads = largest_layer_params * (itemsize + 4)
    if kept_params is not None:
        return max(kept_params, (1 + prefetch) * largest_layer_params) * itemsize + grads
    return (1 + prefetch) * largest_layer_params * itemsize + grads


def overlapped(comm: float, compute: float, share: float) -> tuple[float, float]:
    """(exposed, slowdown) seconds of a collective of ``comm`` seconds issued beside ``compute``
    seconds of kernels that hide it, while it takes ``share`` of the device
    (``Device.comm_compute_share``): the compute runs at ``1 - share`` while the collective runs,
    so the two end after ``max(comm, compute + share * comm)``. ``exposed`` is what the collective
    outlasts the compute by at full rate, ``slowdown`` the rest of the difference."""
    exposed = max(0.0, comm - compute)
    return exposed, max(comm, compute + share * comm) - compute - exposed


def zero3_exposed_time(param_bytes: float, grad_bytes_fp32: float, c: ParallelConfig, link, fwd: float, bwd: float,
                       on_host: bool, *, layers: int = 1, replicas: tuple[int, object] = (1, None),
                       share: float = 0.0) -> tuple[float, float]:
    """Seconds per step of ZeRO-3 communication that compute does not hide, on one stage of
    ``layers`` layers: per micro-batch an all-gather of each layer's parameters before its forward
    and again before its backward (not again with ``reshard_after_forward=False``: the forward's
    gather is kept), and a reduce-scatter of its gradients (fp32) after it: one collective per
    layer and pass (a gather site of :mod:`runtime.kernels.zero3`), each paying the link's
    latency, the stage's bytes split evenly over them. With prefetch (the runtime's default, one
    site ahead) each layer's gather overlaps the layer before it, except the first layer's of each
    pass; on a host device (gloo on CPU) the collectives share the rank's thread with compute and
    nothing hides. ``link``: the shard group's; HSDP's ``replicas``: (replica groups, their link),
    across which each reduce-scattered shard is all-reduced. Returns (exposed, slowdown) seconds:
    the collectives hidden behind compute slow it by ``share`` of their time (:func:`overlapped`)."""
    degree, n = c.shard_degree, max(layers, 1)
    first = all_gather_time(param_bytes / n, degree, link)  # one layer's gather
    ag = n * first
    rs = n * reduce_scatter_time(grad_bytes_fp32 / n, degree, link)
    if replicas[0] > 1:
        rs += n * all_reduce_time(grad_bytes_fp32 / n / degree, replicas[0], replicas[1])
    again = 1 if c.reshard_after_forward else 0  # gathers of the stage's parameters in backward
    m = c.num_micro_batches
    if on_host:
        return m * ((1 + again) * ag + rs), 0.0
    forward = overlapped(ag - first, fwd, share)
    backward = overlapped(again * (ag - first) + rs, bwd, share)
    return m * ((1 + again) * first + forward[0] + backward[0]), m * (forward[1] + backward[1])


SPLIT_OPS_PER_MATMUL = 12
"""Framework overhead of a split backward (zero-bubble schedules), in dispatched ops per matmul
of the layer: W runs the autograd engine once more per weight-reading op, I walks the graph and
captures each such op's output gradient. Measured with bench/schedule_bubbles.py on the 2-core
development machine: I + W took 8.5 ms more than B per micro-batch through 2 GPT blocks (12
matmuls) at 59 us per dispatched op (its calibrated ``kernel_overhead_s``)."""


def _recompute_working_set(c: ParallelConfig, blk: _LayerCost) -> float:
    """Bytes a recomputed block holds while its backward runs (its activations without
    checkpointing), on top of what the in-flight micro-batches keep: full and dag checkpointing;
    ``tensor``: what its recomputes hold at the fullest moment of backward (the profile's)."""
    if c.checkpointing == "tensor":
        return blk.remat_working_bytes
    return blk.full_act_bytes if c.checkpointing in ("full", "dag") else 0.0


def _saved_tensors(ctx: PlanContext, c: ParallelConfig, ranges) -> int:
    """Saved tensors one micro-batch offloads on a stage (``LayerProfile.saved_tensors``; a block
    under full checkpointing keeps only its input): each costs a copy out and one back, each a
    message on the host link (its α) and a framework call (``Device.offload_call_s``)."""
    def count(i: int) -> int:
        block = 0 < i <= ctx.L
        return 1 if block and c.checkpointing == "full" else ctx.profile.layers[i].saved_tensors
    return sum(count(i) for start, stop in ranges for i in range(start, stop))


def _contention_time(ctx: PlanContext, c: ParallelConfig, per_stage: list[tuple]) -> float:
    """Seconds the step lasts longer because a node's ranks share its compute slots
    (``Cluster.compute_slots_per_node``: CPU ranks on fewer cores than ranks).

    Each pipeline rank's forward, backward (with its recompute; a split backward's weight half
    recomputes again) and, after its last action, its optimizer step and offload copies run as
    the schedule orders them (:func:`partitioner.cost.core_sharing.shared_makespan`), all dp × cp
    × tp ranks of a stage computing at once; the term is that makespan on the node's slots less
    the same on a core per rank. Collectives and messages take no core (a rank waiting in one
    gives its core to the others) and stay in their own terms."""
    slots = ctx.cluster.compute_slots_per_node
    per_node = ctx.cluster.devices_per_node
    if slots is None or slots >= min(per_node, c.world_size):
        return 0.0
    p, v = c.pp, c.virtual_pp
    counts = rank_counts(p, c.dp_cp * c.tp, per_node)
    again = 2 if c.split_backward else 1  # a split backward recomputes for I and again for W
    work = {}
    for r, st in enumerate(per_stage):
        f, b, rc, w_share = st[10], st[1] - st[10], st[3], st[8]
        work[r] = RankWork(forward=f / v, backward=(b + again * rc) / v,
                           weight=(w_share * b + rc) / v if c.split_backward else 0.0, tail=st[5] + st[6], ranks=counts[r])
    order = _compute_order(c.schedule, p, c.num_micro_batches, v)
    return max(0.0, shared_makespan(order, work, slots) - shared_makespan(order, work, None))


def gradient_buckets(ctx: PlanContext, c: ParallelConfig, ranges, grad_bytes: float) -> int:
    """Collectives one gradient reduction of a stage issues (``grad_bytes``: its gradients): one
    per bucket of the runtime's layout (:func:`passes.ir.grad_buckets.bucket_layout`). The first
    bucket holds at most ``FIRST_BUCKET_BYTES``, the others at most ``DEFAULT_BUCKET_BYTES``;
    "late" gradients travel in buckets of their own after the rest: the stage's copy of tied
    weights (the embedding on the first stage, the head on the last) when they lie on two
    stages, and with sequence parallelism the norms' partial gradients. Counted by bytes: a
    parameter is never split, so the runtime may cut one bucket more."""
    late = 0.0
    if c.pp > 1 and ctx.profile.shared_param_count and any(
            start == 0 < stop or start <= ctx.L + 1 < stop for start, stop in ranges):
        late = ctx.profile.shared_param_count / c.tp * ctx.itemsize
    early = max(0.0, grad_bytes - late)
    n = 1 + math.ceil(max(0.0, early - FIRST_BUCKET_BYTES) / DEFAULT_BUCKET_BYTES) if early > 0 else 0
    if late > 0:
        n += math.ceil(late / DEFAULT_BUCKET_BYTES)
    elif c.sequence_parallel and c.tp > 1 and any(start <= ctx.L and stop > 1 for start, stop in ranges):
        n += 1  # the blocks' norm weights: small, one bucket
    return max(n, 1)


STEP_END_TERMS = {"dp bucket": "dp_comm", "dp bucket updated chunks": "dp_comm",
                  "sequence-parallel grads": "dp_comm", "tied weight": "tied_comm"}
"""The step-time term that carries each kind of :func:`step_end_calls`' wait; the scalars'
(:func:`step_end_scalars`): ``framework``."""


def step_end_scalars(world: int, dtype: str) -> dict[str, int]:
    """The all-reduces of a scalar over the mesh every rank issues at a step's end (see
    :func:`step_end_calls`): fp16's overflow flag, the global gradient norm (the STEP action) and
    the loss (after it); none on one rank."""
    if world <= 1:
        return {}
    return {**({"fp16 overflow flag": 1} if dtype == "fp16" else {}), "global gradient norm": 1, "loss": 1}


def step_end_calls(ctx: PlanContext, c: ParallelConfig, ranges, grad_bytes: float) -> dict[str, int]:
    """The synchronising calls a rank of the stage of layers ``ranges`` (``grad_bytes``: its
    gradients, ``StagePlan.param_bytes``) issues after its last
    backward (the runtime's ALL_REDUCE and STEP actions and the loss after them, as
    :func:`passes.checks.communication_check.rank_calls` derives them), by kind: the gradient
    buckets the reduction finishes (ZeRO 0 and 1; ZeRO 2 its last round; :func:`gradient_buckets`),
    the tied-weight all-reduce (first and last stage), the sequence-parallel partial-gradient
    all-reduce, the scalars (:func:`step_end_scalars`) and ZeRO-1/2's all-gather of each bucket's
    updated chunks. ZeRO-3 reduces inside backward: no buckets. Each pays
    ``Cluster.step_end_wait_s`` once; the one place that counts them."""
    calls: dict[str, int] = {}
    if c.dp_cp > 1 and c.zero_stage in (0, 1, 2):
        n = gradient_buckets(ctx, c, ranges, grad_bytes)
        calls["dp bucket"] = n
        if c.zero_stage in (1, 2) and c.offload != "optimizer":
            calls["dp bucket updated chunks"] = n
    holds_tied = any(start == 0 < stop or start <= ctx.L + 1 < stop for start, stop in ranges)
    if c.pp > 1 and ctx.profile.shared_param_count and holds_tied:
        calls["tied weight"] = 1
    if c.sequence_parallel and c.tp > 1 and any(start <= ctx.L and stop > 1 for start, stop in ranges):
        calls["sequence-parallel grads"] = 1
    return calls | step_end_scalars(c.world_size, ctx.dtype)


def _tied_sync_time(ctx: PlanContext, c: ParallelConfig) -> float:
    """Seconds of the all-reduce of tied-weight gradients between the first and the last stage
    (``runtime.optim.grad_sync.TiedSync``), after the last backward: nothing hides it."""
    shared = ctx.profile.shared_param_count
    if c.pp == 1 or not shared:
        return 0.0
    grads = shared / c.tp * ctx.itemsize  # vocab-parallel: each tp rank syncs its shard
    return all_reduce_time(grads, 2, ctx.sync_link(2, c.dp_cp * c.tp * (c.pp - 1)))


def scalar_all_reduce_time(cluster) -> float:
    """Seconds of one all-reduce of a scalar over every rank of ``cluster`` (the step's loss, the
    global gradient norm): latency only, over a tree (``2·⌈log2 n⌉`` hops, as NCCL does for small
    messages) rather than a ring's ``2(n−1)``, on the step-end link (``PlanContext.sync_link``)."""
    world = cluster.world_size
    if world <= 1:
        return 0.0
    link = group_link(cluster, size=world, stride=1)
    scale = cluster.sync_latency_scale
    latency = link.latency_s if scale is None else link.with_latency_scale(scale).latency_s
    return 2 * math.ceil(math.log2(world)) * latency


def _framework_time(ctx: PlanContext) -> float:
    """Seconds per step of host work (``Device.step_overhead_s``) plus the two all-reduces of a
    scalar over every rank that end each step (:func:`scalar_all_reduce_time`): the global
    gradient norm's, before the optimizer (``runtime.optim.grad_norm``; every plan issues it, and
    it is where every rank waits for the mesh's last one), and the loss's after it."""
    if ctx.framework_s is None:  # the same for every candidate: worked out once
        ctx.framework_s = ctx.cluster.device.step_overhead_s + 2 * scalar_all_reduce_time(ctx.cluster)
    return ctx.framework_s


def _name(ctx: PlanContext, i: int) -> str:
    return ctx.profile.layers[i].name


def state_lower_bound(ctx: PlanContext, c: ParallelConfig) -> float:
    """Bytes no stage split of ``c`` brings its fullest device below: the model state (parameters,
    gradients, optimizer state as :func:`evaluate` counts them) of every layer spread evenly over
    the ``pp`` ranks. A candidate above the device's memory is infeasible without evaluating it."""
    emb, blk, head = ctx.layer_costs(c)
    params = total_params(ctx, c)
    experts = emb.expert_params + ctx.L * blk.expert_params + head.expert_params
    per_param = sum(_state_per_param(ctx, c))
    per_expert_param = sum(_state_per_param(ctx, c, experts=True)) - per_param
    return (params * per_param + experts * per_expert_param) / c.pp


def lower_bound(ctx: PlanContext, c: ParallelConfig) -> float:
    """A step time no partition of ``c`` beats: perfect balance, bubble, the terms no split
    changes (pipeline messages, the tied-weight sync, the step's fixed work), and the average
    stage's optimizer step, ZeRO-1/2/3 collectives and activation offload copies beyond what
    hides them (ZeRO-0's all-reduce is not bounded)."""
    emb, blk, head = ctx.layer_costs(c)
    total = emb.time + ctx.L * blk.time + head.time
    per_stage = max(total / c.pp, blk.time * math.ceil(ctx.L / c.pp) if c.virtual_pp > 1 else 0.0)
    pipeline = (c.num_micro_batches + _bubble_slots(c.schedule, c.pp, c.num_micro_batches, c.virtual_pp)) * per_stage
    # The rank whose data-parallel, optimizer and offload work ends the step does at least the
    # average stage's: each term is linear in a stage's parameters, or convex where clipped at zero
    m, pp = c.num_micro_batches, c.pp
    fwd, bwd = (emb.fwd + ctx.L * blk.fwd + head.fwd) / pp, (emb.bwd + ctx.L * blk.bwd + head.bwd) / pp
    redo = (emb.recompute + ctx.L * blk.recompute + head.recompute) / pp
    every = total_params(ctx, c) / pp
    dense = every - (emb.expert_params + ctx.L * blk.expert_params + head.expert_params) / pp
    shards = c.shard_degree if c.zero_stage == 3 else c.dp_cp
    ms1 = model_state_bytes(1.0, shards, c.zero_stage, ctx.dtype, ctx.optimizer)
    tail = _optimizer_time(ctx, c, dense, 0.0, shards, ms1, 0.0)[0]
    if c.zero_stage in (1, 2) and c.dp_cp > 1:
        # the all-gather of the updated parameters, and the reduce-scatters beyond the backward
        # that hides them (one per micro-batch under ZeRO-2); a stage's buckets
        # (:func:`gradient_buckets`) are at least max(1, (bytes - first) / size), convex
        link, grads = ctx.sync_link(c.dp_cp, c.tp), dense * ctx.itemsize
        extra = max(1.0, (grads - FIRST_BUCKET_BYTES) / DEFAULT_BUCKET_BYTES) - 1.0
        rs = reduce_scatter_time(grads, c.dp_cp, link) + extra * reduce_scatter_time(0.0, c.dp_cp, link)
        # what a hidden reduce-scatter adds, exposed or slowing the compute (:func:`overlapped`):
        # max(rs - bwd, share * rs), convex as the bound needs
        tail += all_gather_time(grads, c.dp_cp, link) + extra * all_gather_time(0.0, c.dp_cp, link) \
            + sum(overlapped(rs, 0.0 if ctx.on_host else bwd, ctx.comm_share)) * (m if c.zero_stage == 2 else 1)
    if c.zero_stage == 3 and shards > 1:
        # per micro-batch the stage's gathers (again in backward when resharded) and
        # reduce-scatters beyond its compute (:func:`zero3_exposed_time` without prefetch's
        # first-layer terms and HSDP's all-reduce), over the average stage's layers
        n, link = (ctx.L + 2) / pp, ctx.sync_link(shards, c.tp)
        ag = n * all_gather_time(every * ctx.itemsize / n, shards, link)
        rs = n * reduce_scatter_time(every * 4 / n, shards, link)
        busy = 0.0 if ctx.on_host else fwd + bwd + redo
        tail += m * sum(overlapped((2 if c.reshard_after_forward else 1) * ag + rs, busy, ctx.comm_share))
    if c.offload == "activations":
        # each micro-batch's saved activations copied out and back beyond the compute they hide behind
        act = (emb.act_bytes + ctx.L * blk.act_bytes + head.act_bytes) / pp
        copy = 2 * act / min(ctx.cluster.host_to_device.bandwidth_bytes_per_s, ctx.host_rate)
        tail += m * (copy if ctx.on_host else max(0.0, copy / 2 - fwd) + max(0.0, copy / 2 - bwd - redo))
    return pipeline + tail + _pp_comm_time(ctx, c) + _tied_sync_time(ctx, c) + _framework_time(ctx)


def total_params(ctx: PlanContext, c: ParallelConfig) -> float:
    """Parameters one rank of each pipeline position holds, summed over the positions (a tp
    rank's shards; the experts an ep rank holds; the tied embedding and head once)."""
    emb, blk, head = ctx.layer_costs(c)
    return emb.params + ctx.L * blk.params + head.params + ctx.profile.shared_param_count / c.tp
