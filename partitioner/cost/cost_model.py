"""Cost-model primitives of the planner: pure functions of a :class:`Cluster` and sizes.

Times are seconds, sizes bytes, compute FLOPs. Nothing here looks at a graph: the search
combines these primitives with the facts the analysis passes wrote.

* Links: :func:`group_link` picks the link a process group communicates over.
* Collectives, α-β model: :func:`all_reduce_time` (ring or tree, as NCCL picks:
  :func:`all_reduce_algorithm`), ring :func:`all_gather_time`, :func:`reduce_scatter_time`,
  :func:`all_to_all_time`, :func:`send_recv_time`.
* Compute: :func:`compute_time` (with the device's :func:`efficiency_curve`),
  :func:`memory_bound_time` (at :func:`memory_bound_rate`), :func:`roofline_time`.
* Context parallelism: :func:`ring_attention_pairs`, :func:`ring_exposed_time`,
  :func:`ulysses_all_to_all_time`.
* Pipelines: :func:`bubble_fraction`, :func:`pipeline_bubble_time`, :func:`pipeline_step_time`,
  :func:`in_flight_microbatches`.
* Model state under ZeRO: :func:`model_state_bytes`.
* :class:`StepTimeTerms`: the named terms of one training step.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from partitioner.cost.cluster import Cluster, CollectiveFit, Device, EfficiencyCurve, Link
from passes.ir.config import DTYPES as TRAINING_DTYPES
from passes.ir.optimizers import optimizer_model
from passes.ir.schedule import Kind, compute as compute_order, compute_makespan, peak_in_flight
from passes.ir.config import SCHEDULES, is_mixed
from passes.ir.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# Which link a group uses
# ---------------------------------------------------------------------------------------------


def strided_ranks(size: int, stride: int = 1, start: int = 0) -> tuple[int, ...]:
    """``(start, start + stride, ..., start + (size - 1) * stride)``: the ranks of a mesh axis."""
    if size < 1 or stride < 1 or start < 0:
        raise ConfigError(f"a group needs size >= 1, stride >= 1 and start >= 0; got size={size}, "
                          f"stride={stride}, start={start}")
    return tuple(start + i * stride for i in range(size))


def group_link(cluster: Cluster, ranks: Sequence[int] | None = None, *,
               size: int | None = None, stride: int = 1, start: int = 0) -> Link:
    """The effective link of a process group: give ``ranks``, or ``size`` (and ``stride``, ``start``).

    Model (ranks node-major, ``node = rank // devices_per_node``):

    * all members in one node: ``cluster.intra_node``, unchanged;
    * members on several nodes, at most ``k`` on any one node: the node's NICs
      (``inter_node.count * inter_node.bandwidth``) are assumed shared evenly by the
      ``devices_per_node / k`` sibling groups that run the same collective at the same time (every
      device of a mesh belongs to one group of each axis). A ring of this group therefore gets
      ``nics * nic_rate * k / devices_per_node`` bytes/s, capped by the intra-node link when
      ``k > 1`` (the ring also has intra-node hops). Latency and kind are the inter-node link's.

    E.g. on DGX A100 (8 GPUs, 8x 25 GB/s NICs): a data-parallel group with one GPU per node gets
    25 GB/s; a group of all 16 GPUs of two nodes gets min(300, 200) = 200 GB/s.
    """
    if ranks is None:
        if size is None:
            raise ConfigError("group_link needs the group's ranks, or its size (with stride and start)")
        return _strided_group_link(cluster, size, stride, start)
    return _group_link(cluster, tuple(ranks))


@functools.lru_cache(maxsize=4096)
def _strided_group_link(cluster: Cluster, size: int, stride: int, start: int) -> Link:
    # the search asks for the same few mesh axes of one cluster for every candidate it costs
    return _group_link(cluster, strided_ranks(size, stride, start))


def _group_link(cluster: Cluster, ranks: tuple[int, ...]) -> Link:
    if not ranks or len(set(ranks)) != len(ranks):
        raise ConfigError(f"a group needs distinct ranks, got {ranks}")
    per_node = Counter(cluster.node_of(r) for r in ranks)
    if len(per_node) == 1:
        return cluster.intra_node
    k = max(per_node.values())
    inter, intra = cluster.inter_node, cluster.intra_node

    def shared(nic: Link, hop: Link) -> tuple[float, float]:  # (bandwidth, latency) of the group's ring
        bandwidth = inter.count * nic.bandwidth_bytes_per_s * k / cluster.devices_per_node
        if k > 1:
            bandwidth = min(bandwidth, hop.bandwidth_bytes_per_s)
        return bandwidth, max(nic.latency_s, hop.latency_s if k > 1 else 0.0)

    bandwidth, latency = shared(inter, intra)
    # a collective measured on its own is shared the same way, from its own inter- and intra-node fits
    fits = tuple(CollectiveFit(op=f.op, **dict(zip(("bandwidth_bytes_per_s", "latency_s"),
                                                    shared(inter.for_collective(f.op), intra.for_collective(f.op)))))
                 for f in inter.collectives)
    return Link(kind=inter.kind, bandwidth_bytes_per_s=bandwidth, latency_s=latency, collectives=fits)


# ---------------------------------------------------------------------------------------------
# Collectives: alpha-beta model, ring and tree algorithms
# ---------------------------------------------------------------------------------------------


def _check_collective(nbytes: float, n: int) -> None:
    if n < 1:
        raise ConfigError(f"a collective needs a group of at least 1 rank, got n={n}")
    if nbytes < 0:
        raise ConfigError(f"a collective moves >= 0 bytes, got {nbytes}")


def ring_all_reduce_bytes_per_rank(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of an ``nbytes`` buffer: 2(n−1)/n·bytes."""
    _check_collective(nbytes, n)
    return 2 * (n - 1) / n * nbytes


TREE_LINK_KINDS = ("infiniband", "roce", "ethernet")
"""Links over which NCCL runs its tree all-reduce: between nodes. Inside a node NCCL's "tree" is
a chain (as many hops as a ring), so a group on NVLink/NVSwitch, PCIe or loopback uses the ring."""
TREE_BANDWIDTH_FACTOR = 0.92
"""Bus-bandwidth factor of NCCL's tree all-reduce against the ring's (NCCL's tuning model,
``src/graph/tuning.cc``: the tree's bus bandwidth is 0.92 of the link's)."""


def ring_all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n−1)/n·bytes/β + 2(n−1)·α seconds.

    A reduce-scatter then an all-gather, each n−1 steps; 0 for n = 1.
    """
    _check_collective(nbytes, n)
    if n == 1:
        return 0.0
    return ring_all_reduce_bytes_per_rank(nbytes, n) / link.bandwidth_bytes_per_s + 2 * (n - 1) * link.latency_s


def tree_all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Double-binary-tree all-reduce (NCCL's "tree"): 2·bytes/(0.92·β) + 2·⌈log2 n⌉·α seconds.

    A reduce up the tree and a broadcast down it, each ⌈log2 n⌉ hops deep; each half of the
    buffer goes through one of the two trees, so every rank sends and receives about the whole
    buffer twice, at :data:`TREE_BANDWIDTH_FACTOR` of the link's bandwidth. 0 for n = 1.
    """
    _check_collective(nbytes, n)
    if n == 1:
        return 0.0
    depth = math.ceil(math.log2(n))
    return 2 * nbytes / (TREE_BANDWIDTH_FACTOR * link.bandwidth_bytes_per_s) + 2 * depth * link.latency_s


def all_reduce_algorithm(nbytes: float, n: int, link: Link) -> str:
    """``"tree"`` or ``"ring"``: the faster of the two for this message, group size and link,
    as NCCL's tuner picks (the tree only between nodes, :data:`TREE_LINK_KINDS`). The tree's
    latency grows as log2 n and the ring's as n, the ring moves fewer bytes: small messages on
    many ranks take the tree, large ones the ring (:func:`tree_ring_switch_bytes`)."""
    if n <= 2 or link.kind not in TREE_LINK_KINDS:
        return "ring"
    return "tree" if tree_all_reduce_time(nbytes, n, link) < ring_all_reduce_time(nbytes, n, link) else "ring"


def tree_ring_switch_bytes(n: int, link: Link) -> float:
    """Message bytes at which the tree and the ring all-reduce take the same time over ``n``
    ranks on ``link`` (0 where the ring always wins): the tree below it, the ring above.

    Equating the two: bytes·(2/0.92 − 2(n−1)/n)/β = 2α·((n−1) − ⌈log2 n⌉).
    """
    if n <= 2 or link.kind not in TREE_LINK_KINDS:
        return 0.0
    saved_latency = 2 * link.latency_s * ((n - 1) - math.ceil(math.log2(n)))
    extra_per_byte = (2 / TREE_BANDWIDTH_FACTOR - 2 * (n - 1) / n) / link.bandwidth_bytes_per_s
    return max(0.0, saved_latency / extra_per_byte)


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """All-reduce of an ``nbytes`` buffer over ``n`` ranks with the algorithm NCCL would pick
    (:func:`all_reduce_algorithm`): the ring (2(n−1)/n·bytes/β + 2(n−1)·α) inside a node and for
    large messages, the tree (2·bytes/(0.92·β) + 2·⌈log2 n⌉·α) for small ones between nodes.
    0 for n = 1.
    """
    if all_reduce_algorithm(nbytes, n, link) == "tree":
        return tree_all_reduce_time(nbytes, n, link)
    return ring_all_reduce_time(nbytes, n, link)


def _ring_time(nbytes: float, n: int, link: Link) -> float:
    """(n−1)/n·bytes/β + (n−1)·α: one pass round a ring of ``n`` ranks; 0 for n = 1."""
    _check_collective(nbytes, n)
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth_bytes_per_s + (n - 1) * link.latency_s


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather whose OUTPUT (the gathered buffer) is ``nbytes``: (n−1)/n·bytes/β + (n−1)·α,
    with the link's measured all-gather α-β when it has one (:meth:`Link.for_collective`)."""
    return _ring_time(nbytes, n, link.for_collective("all_gather"))


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter whose INPUT (the full buffer) is ``nbytes``: (n−1)/n·bytes/β + (n−1)·α,
    with the link's measured reduce-scatter α-β when it has one."""
    return _ring_time(nbytes, n, link.for_collective("reduce_scatter"))


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of an ``nbytes`` buffer per rank (1/n of it stays local): (n−1)/n·bytes/β + (n−1)·α,
    with the link's measured all-to-all α-β when it has one."""
    return _ring_time(nbytes, n, link.for_collective("all_to_all"))


def send_recv_time(nbytes: float, link: Link) -> float:
    """One point-to-point message of ``nbytes``: α + bytes/β."""
    _check_collective(nbytes, 1)
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


DEFAULT_EFFICIENCY = EfficiencyCurve()
"""The curve a device without a measured one is priced with (``Device.efficiency`` is ``None``,
the presets): large matmuls at 0.75 of the datasheet peak, half of that at 5 us of peak-rate work."""


def efficiency_curve(device: Device, dtype: str = "bf16") -> EfficiencyCurve:
    """The efficiency curve of ``device``'s ``dtype`` kernels: its measured one
    (``Device.efficiency``, written by the calibration) when it has one for ``dtype``, else
    :data:`DEFAULT_EFFICIENCY`. The one place the cost model picks a curve."""
    measured = device.efficiency.for_dtype(dtype) if device.efficiency is not None else None
    return measured if measured is not None else DEFAULT_EFFICIENCY


def compute_time(flops: float, device: Device, dtype: str = "bf16",
                 curve: EfficiencyCurve | None = None, *, overhead: bool = True) -> float:
    """Seconds for ONE kernel of ``flops`` FLOPs in ``dtype`` on ``device``; sum over kernels.

    ``flops / (peak · curve.efficiency(flops)) + device.kernel_overhead_s`` (the framework's
    per-op cost, 0 unless calibrated; ``overhead=False`` leaves it out, for callers that count
    the ops themselves with :func:`op_overhead_time`); 0 for no FLOPs. ``curve``: the device's
    (:func:`efficiency_curve`) unless given.
    """
    if flops < 0:
        raise ConfigError(f"flops must be >= 0, got {flops}")
    if flops == 0:
        return 0.0
    peak = device.peak_flops.for_dtype(dtype)
    curve = efficiency_curve(device, dtype) if curve is None else curve
    return flops / (peak * curve.efficiency(flops, peak)) + (device.kernel_overhead_s if overhead else 0.0)


def op_overhead_time(ops: float, device: Device) -> float:
    """Seconds of framework overhead for ``ops`` dispatched operators (every aten op launches
    a kernel or at least passes the dispatcher: ``device.kernel_overhead_s`` each)."""
    return ops * device.kernel_overhead_s


def memory_bound_rate(device: Device) -> float:
    """Bytes/s (read plus write) ``device``'s memory-bound nodes (elementwise ops, norms, softmax,
    dropout, the loss) stream at: ``Device.memory_bound_bytes_per_s`` where the calibration's refit
    fitted one, else the memory bandwidth. The one place the cost model picks that rate."""
    return device.memory_bound_bytes_per_s or device.memory_bandwidth_bytes_per_s


def memory_bound_time(bytes_moved: float, bandwidth: Device | float) -> float:
    """Seconds of memory-bound nodes that move ``bytes_moved`` bytes (read plus write): at
    :func:`memory_bound_rate` of a ``Device``, or at ``bandwidth`` bytes/s."""
    if bytes_moved < 0:
        raise ConfigError(f"bytes_moved must be >= 0, got {bytes_moved}")
    rate = memory_bound_rate(bandwidth) if isinstance(bandwidth, Device) else bandwidth
    return bytes_moved / rate


def roofline_time(flops: float, bytes_moved: float, device: Device, dtype: str = "bf16",
                  curve: EfficiencyCurve | None = None, *, overhead: bool = True) -> float:
    """Seconds for one matmul-class kernel of ``flops`` FLOPs that reads and writes ``bytes_moved``
    bytes: the larger of its compute time (at the efficiency for its size: ``curve``, else the
    device's, :func:`efficiency_curve`) and its memory time (bytes / ``Device.memory_bandwidth_bytes_per_s``:
    a matmul streams its operands at the memory's rate, not at the memory-bound nodes'), plus
    ``device.kernel_overhead_s`` unless ``overhead=False`` (for callers that count the ops with
    :func:`op_overhead_time`)."""
    compute = compute_time(flops, device, dtype, curve, overhead=False)
    extra = device.kernel_overhead_s if overhead and (flops or bytes_moved) else 0.0
    return max(compute, memory_bound_time(bytes_moved, device.memory_bandwidth_bytes_per_s)) + extra


# ---------------------------------------------------------------------------------------------
# Context parallelism (passes/rewrites/context_parallel.py, runtime/kernels/context_parallel.py)
# ---------------------------------------------------------------------------------------------


def ring_attention_pairs(cp: int, causal: bool) -> int:
    """(query chunk, key chunk) blocks one rank computes in ring attention over ``cp`` ranks, under
    the load-balanced layout (``2·cp`` chunks, rank r holds r and 2cp−1−r): ``2·cp + 1`` for a
    causal mask (2 per received block plus 3 of its own: two masked diagonals and one whole,
    pairs above the diagonal skipped), ``4·cp`` without one. The same on every rank."""
    if cp < 1:
        raise ConfigError(f"ring attention needs cp >= 1, got {cp}")
    return 2 * cp + 1 if causal else 4 * cp


def ring_exposed_time(message_bytes: float, steps: int, link: Link, compute_per_step: float = 0.0) -> float:
    """Seconds of ``steps`` ring steps that compute does not hide: each step every rank sends one
    ``message_bytes`` block to the next rank (α + bytes/β) while ``compute_per_step`` seconds of
    work on the block it holds run, so a step costs ``max(compute, comm)`` and its exposed part is
    ``max(0, comm − compute)``. ``compute_per_step=0``: nothing hides it (a step waited at once)."""
    if steps <= 0:
        return 0.0
    return steps * max(0.0, send_recv_time(message_bytes, link) - compute_per_step)


def ulysses_all_to_all_time(tensor_bytes: Sequence[float], cp: int, link: Link) -> float:
    """Seconds of Ulysses' all-to-alls over ``cp`` ranks, one per tensor of ``tensor_bytes`` bytes
    on each rank (q, k, v before attention, its output after; as many in backward): each moves
    ``(cp−1)/cp`` of its tensor (:func:`all_to_all_time`)."""
    return sum(all_to_all_time(b, cp, link) for b in tensor_bytes)


# ---------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------



def _check_pipeline(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline needs p >= 1 stages, m >= 1 micro-batches, v >= 1 chunks; "
                          f"got p={p}, m={m}, v={v}")
    if schedule == "zbv" and v != 2:
        raise ConfigError(f"schedule 'zbv' runs two model chunks per stage (v=2), got v={v}")
    if schedule not in ("interleaved", "zbv") and v != 1:
        raise ConfigError(f"schedule {schedule!r} has one model chunk per stage (v=1), got v={v}; "
                          f"use schedule='interleaved' for v > 1")


ZERO_BUBBLE_SCHEDULES = ("zb1p", "zbv")

WEIGHT_GRAD_SHARE = 0.5
"""Share of a stage's backward that is the weight half (W) of a split backward: a matmul's
weight gradient costs what its input gradient costs, and matmuls with a weight dominate a
transformer layer's backward."""

FWD_BWD_RATIO = 2.0
"""Backward over forward time assumed when a schedule's bubble is simulated (matmul backward:
two matmuls per forward one)."""


def _steady_micro_batches(p: int, m: int) -> int:
    """The micro-batch count a zero-bubble schedule is simulated at: ``m``, or ``2p`` when larger.
    From ``2p`` micro-batches on, ZB-H1's and ZB-V's idle time (in micro-batch units) and their
    in-flight peaks no longer change with ``m`` (the steady phase only grows; checked in
    tests/test_cost_model.py), and simulating thousands of micro-batches took the search minutes."""
    return min(m, 2 * p)


@functools.lru_cache(maxsize=256)
def _compute_order(schedule: str, p: int, m: int, v: int):
    """The compute order of a schedule (read only: what runs is built and checked by the lowering)."""
    return compute_order(schedule, p, m, v)


@functools.lru_cache(maxsize=1024)
def _simulated_bubble_slots(schedule: str, p: int, m: int, v: int, weight_share: float) -> float:
    """Idle time per stage of a zero-bubble schedule, in forward+backward units: the action lists
    simulated with balanced stages (one chunk's forward 1/v, backward FWD_BWD_RATIO/v)."""
    if schedule == "zb1p" and m >= p > 2:
        # ZB-H1's idle time is (p - 1) times one stage's (Qi et al. 2023: (p-1)(F + I - W)) from
        # p micro-batches on, at any weight share (tested): simulate two stages, not p
        return (p - 1) * _simulated_bubble_slots(schedule, 2, 2, v, weight_share)
    if schedule == "zbv" and m >= 2 * p and p > 2 and weight_share <= 0.5:
        # so is ZB-V's from 2p micro-batches on while W is at most half the backward (tested;
        # with a larger weight half it is not linear in p and is simulated)
        return (p - 1) * _simulated_bubble_slots(schedule, 2, 4, v, weight_share)
    m = _steady_micro_batches(p, m)
    f, b = 1.0 / v, FWD_BWD_RATIO / v
    makespan = compute_makespan(_compute_order(schedule, p, m, v), f, b, b * weight_share)
    work = m * v * (f + b)
    return (makespan - work) / (work / m)


def _bubble_slots(schedule: str, p: int, m: int, v: int, weight_share: float = WEIGHT_GRAD_SHARE) -> float:
    """Idle time of a stage in units of one micro-batch's forward+backward on that stage."""
    _check_pipeline(schedule, p, m, v)
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return _simulated_bubble_slots(schedule, p, m, v, round(weight_share, 3))
    return (p - 1) / v


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Fraction of the pipeline step spent idle (bubble / total time).

    GPipe and 1F1B: (p−1)/(m+p−1). Interleaved with v chunks per stage (Narayanan et al. 2021):
    the bubble time shrinks by v, so ((p−1)/v)/(m+(p−1)/v). Zero-bubble ZB-H1 and ZB-V (Qi et al.
    2023): the schedule's action lists simulated with the backward split into input and weight
    halves (:data:`WEIGHT_GRAD_SHARE`); ZB-H1's bubble is (p−1)(F + I − W), a third of 1F1B's
    when F = I = W. Assumes forward and backward of a micro-batch take the same time on every
    stage and ignores communication.
    """
    bubble = _bubble_slots(schedule, p, m, v)
    return bubble / (m + bubble)


def pipeline_bubble_time(fwd_s: float, bwd_s: float, p: int, m: int, schedule: str, v: int = 1) -> float:
    """Idle seconds per step: (p−1)/v · (fwd_s + bwd_s).

    ``fwd_s``/``bwd_s``: one micro-batch through one whole stage (all its v chunks).
    """
    return _bubble_slots(schedule, p, m, v) * (fwd_s + bwd_s)


def pipeline_step_time(fwd_s: float, bwd_s: float, p: int, m: int, schedule: str, v: int = 1) -> float:
    """Seconds of one pipeline step: (m + (p−1)/v) · (fwd_s + bwd_s), communication excluded."""
    return m * (fwd_s + bwd_s) + pipeline_bubble_time(fwd_s, bwd_s, p, m, schedule, v)


def in_flight_chunks(schedule: str, stage: int, p: int, m: int, v: int = 1) -> int:
    """Peak number of (micro-batch, model chunk) forwards whose activations ``stage`` holds at once.

    GPipe: all m. 1F1B: min(p − stage, m) (warm-up p − stage − 1, plus one). Interleaved
    (Megatron-LM ``forward_backward_pipelining_with_interleaving``): warm-up
    2(p − stage − 1) + (v − 1)·p chunk forwards, plus one, at most m·v; when m == p every
    forward is warm-up (m·v).
    """
    _check_pipeline(schedule, p, m, v)
    if not 0 <= stage < p:
        raise ConfigError(f"stage must be in [0, {p}), got {stage}")
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return _zero_bubble_in_flight(schedule, stage, p, m, v)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    if m == p:
        return m * v
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def _zero_bubble_in_flight(schedule: str, stage: int, p: int, m: int, v: int) -> int:
    return _zero_bubble_peaks(schedule, p, m, v)[stage]


@functools.lru_cache(maxsize=1024)
def _zero_bubble_peaks(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    # Read off the compute order (the messages the lowering adds do not change it): a
    # micro-batch's graph lives from its F until its W. One list serves every stage.
    actions = _compute_order(schedule, p, _steady_micro_batches(p, m), v)
    return tuple(peak_in_flight(actions, stage) for stage in range(p))


@functools.lru_cache(maxsize=8192)
def pipeline_states(schedule: str, stage: int, p: int, m: int, v: int) -> tuple[tuple, ...]:
    """The memory states pipeline rank ``stage`` passes through under ``schedule``: after each of
    its compute actions, ``(graphs, held, weight, grads, messages)`` with ``graphs[k]`` the
    micro-batches of its k-th model chunk (in stage order) whose forward ran and whose backward (a
    split one's weight half, W) has not (each holds what its forward saved), ``held[k]`` those of
    them past their input half (I: each also holds the output gradients of its weight-reading ops
    for W; zero-bubble schedules only), ``weight`` the chunk whose W runs (it makes the chunk's
    weight gradients all at once, beside the accumulated ones) or -1, ``grads[k]`` 1 once a
    backward of chunk k ran (its accumulated gradients exist from then on), and ``messages`` the
    pipeline messages the rank holds: each received input until its backward, and each input
    gradient it sent from then to the step's end. A peak is the largest
    ``Σ graphs[k]·A[k] + Σ held[k]·H[k] + G[weight] + Σ grads[k]·G[k] + messages·M`` over these,
    for a chunk's activations A, held gradients H, weight gradients G and a message M (the last
    state: the step's end, every gradient made, no activation or message left;
    :func:`partitioner.search.replay.predict_memory` replays the same). Of states alike but for
    their messages, the one with the most is kept.

    GPipe's are known without a walk: every forward, then every backward; the fullest states are
    all ``m`` graphs before the first backward, ``m - 1`` with the gradients made, and the end
    (those cover every other state of its walk: tests/test_cost_model.py). The others repeat
    their steady phase as micro-batches are added, and a state's messages grow by the same count
    per micro-batch or not at all: past ``3p`` micro-batches they are walked at ``3p`` and ``4p``
    and each state's messages taken linearly to ``m`` (the same states as the walk at ``m`` for
    the schedules and sizes tests/test_cost_model.py tries; every such ``m`` of a pipeline depth
    shares the two walks)."""
    _check_pipeline(schedule, p, m, v)
    if schedule == "gpipe":
        received = m if stage > 0 else 0  # every input received, or its gradient sent, until the end
        return (((0,), (0,), -1, (1,), 0), ((m - 1,), (0,), -1, (1,), received), ((m,), (0,), -1, (0,), received))
    if m <= 3 * p:
        most = _walk(schedule, stage, p, m, v)
    else:
        short, longer = _walk(schedule, stage, p, 3 * p, v), _walk(schedule, stage, p, 4 * p, v)
        most = {key: n + (m - 4 * p) * (n - short.get(key, n)) // p for key, n in longer.items()}
    return tuple(sorted((*key, n) for key, n in most.items()))


@dataclass(frozen=True, eq=False)
class PipelineStateArrays:
    """:func:`pipeline_states` as arrays, one row a state, for pricing them all at once:
    ``graphs``, ``held`` and ``grads`` [states, chunks], ``weight`` [states, chunks] (1 for the
    chunk whose W runs), ``messages`` [states]."""

    graphs: np.ndarray
    held: np.ndarray
    weight: np.ndarray
    grads: np.ndarray
    messages: np.ndarray


@functools.lru_cache(maxsize=8192)
def pipeline_state_arrays(schedule: str, stage: int, p: int, m: int, v: int) -> PipelineStateArrays:
    """:func:`pipeline_states` of pipeline rank ``stage`` as :class:`PipelineStateArrays`."""
    states = pipeline_states(schedule, stage, p, m, v)
    chunks = len(states[0][0])
    weight = np.zeros((len(states), chunks))
    for row, state in enumerate(states):
        if state[2] >= 0:
            weight[row, state[2]] = 1.0
    return PipelineStateArrays(graphs=np.array([s[0] for s in states], dtype=float),
                               held=np.array([s[1] for s in states], dtype=float), weight=weight,
                               grads=np.array([s[3] for s in states], dtype=float),
                               messages=np.array([s[4] for s in states], dtype=float))


@functools.lru_cache(maxsize=4096)
def _walk(schedule: str, stage: int, p: int, m: int, v: int) -> dict[tuple, int]:
    """:func:`pipeline_states`' states of a walk of the compute order at ``m`` micro-batches, each
    with the most messages it holds (cached: read it, do not change it)."""
    actions = _compute_order(schedule, p, m, v)[stage]
    chunk = {s: k for k, s in enumerate(sorted({a.stage for a in actions}))}
    graphs = [0] * len(chunk)  # each micro-batch's F, I and W (or B) run once per chunk: counts suffice
    held = [0] * len(chunk)
    grads = [0] * len(chunk)
    messages = 0  # received inputs, then the input gradients sent in their place
    most: dict[tuple, int] = {}
    forward, weight_half, input_half = Kind.FORWARD, Kind.BACKWARD_WEIGHT, Kind.BACKWARD_INPUT

    for a in actions:
        k, kind = chunk[a.stage], a.kind
        if kind is forward:
            graphs[k] += 1
            messages += a.stage > 0
        elif kind is input_half:  # the input gradient is sent in place of the input
            held[k] += 1
        else:  # B or W (a compute order holds F, B, I and W only)
            # a whole backward (B) frees its graph as it goes, one gradient at a time; W makes the
            # chunk's weight gradients at once
            key = (tuple(graphs), tuple(held), k if kind is weight_half else -1, tuple(grads))
            if most.get(key, -1) < messages:
                most[key] = messages
            graphs[k] -= 1
            held[k] -= kind is weight_half
            grads[k] = 1
        key = (tuple(graphs), tuple(held), -1, tuple(grads))
        if most.get(key, -1) < messages:
            most[key] = messages
    key = (tuple(graphs), tuple(held), -1, tuple(grads))  # the step's end: every message freed
    most.setdefault(key, 0)
    return most


def in_flight_microbatches(schedule: str, stage: int, p: int, m: int, v: int = 1) -> float:
    """Peak activations held by ``stage``, in micro-batches through the WHOLE stage.

    :func:`in_flight_chunks` / v (one chunk holds 1/v of a stage's activations). For
    interleaved, stage 0 holds p + (p−1)/v: a (1 + (p−1)/(p·v)) factor over 1F1B's p.
    """
    return in_flight_chunks(schedule, stage, p, m, v) / v


# ---------------------------------------------------------------------------------------------
# Model state under ZeRO
# ---------------------------------------------------------------------------------------------



@dataclass(kw_only=True, frozen=True, slots=True)
class ModelStateBytes:
    """Bytes of model state one data-parallel rank holds."""

    params: float
    """Weights used in forward/backward (fp32, or the 16-bit copy under mixed precision)."""
    grads: float
    """Gradients, in the weights' dtype."""
    optimizer: float
    """Optimizer states, including fp32 master weights under mixed precision."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def _bytes_per_param(dtype: str, optimizer: str) -> tuple[int, int, int]:
    if dtype not in TRAINING_DTYPES:  # bf16/fp16 train with fp32 master weights
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(TRAINING_DTYPES)}")
    states = optimizer_model(optimizer).state_bytes_per_element  # fp32 moments
    mixed = is_mixed(dtype)
    weight = 2 if mixed else 4
    master = 4 if mixed else 0
    return weight, weight, states + master


def model_state_bytes(params: float, n_dp: int, zero_stage: int, dtype: str = "bf16",
                      optimizer: str = "adam") -> ModelStateBytes:
    """Model-state bytes per rank for ``params`` parameters over ``n_dp`` data-parallel ranks.

    ``dtype``: the training dtype (bf16/fp16: 16-bit weights and gradients, fp32 master weights).
    Per parameter (Rajbhandari et al. 2020): mixed-precision Adam 2 (16-bit weights) + 2 (grads)
    + 12 (fp32 master, m, v) = 16; fp32 Adam 4 + 4 + 8 = 16; SGD keeps no states (+4 master
    under mixed precision), SGD with momentum +4. ZeRO stage 1 shards the optimizer states,
    stage 2 also the grads, stage 3 also the weights: for mixed Adam 16Ψ, 4Ψ + 12Ψ/N,
    2Ψ + 14Ψ/N, 16Ψ/N.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if n_dp < 1 or params < 0:
        raise ConfigError(f"need n_dp >= 1 and params >= 0, got n_dp={n_dp}, params={params}")
    w, g, o = _bytes_per_param(dtype, optimizer)
    shard = {"params": zero_stage >= 3, "grads": zero_stage >= 2, "optimizer": zero_stage >= 1}
    return ModelStateBytes(
        params=params * w / (n_dp if shard["params"] else 1),
        grads=params * g / (n_dp if shard["grads"] else 1),
        optimizer=params * o / (n_dp if shard["optimizer"] else 1),
    )


# ---------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True, slots=True)
class StepTimeTerms:
    """Seconds of one training step by cause. Put only the EXPOSED (not overlapped) part of a
    term here: ``total`` is their plain sum."""

    compute: float = 0.0
    """Forward and backward kernels of one rank, all micro-batches."""
    tp_comm: float = 0.0
    """Tensor-parallel collectives (all-reduce / all-gather / reduce-scatter of activations)."""
    cp_comm: float = 0.0
    """Context-parallel exchanges that compute does not hide: ring attention's K/V blocks (forward
    and backward) and its dK/dV blocks (backward), or Ulysses' all-to-alls, and the loss's
    all-reduces over the cp group."""
    ep_comm: float = 0.0
    """Expert-parallel dispatch and combine of the MoE blocks (the ep group's token all-gathers and
    reduce-scatters, forward and backward)."""
    pp_comm: float = 0.0
    """Pipeline send/recv of activations and their gradients between stages."""
    dp_comm: float = 0.0
    """Data-parallel gradient all-reduce (or ZeRO reduce-scatter + all-gather)."""
    tied_comm: float = 0.0
    """All-reduce of tied-weight gradients (a GPT's word embedding and LM head) between the first
    and the last pipeline stage, which each hold a copy."""
    bubble: float = 0.0
    """Pipeline idle time."""
    recompute: float = 0.0
    """Extra forwards of activation checkpointing."""
    offload: float = 0.0
    """Host <-> device copies of offloaded tensors."""
    optimizer: float = 0.0
    """The optimizer step."""
    contention: float = 0.0
    """More ranks of a node computing at once than it has compute slots (CPU ranks sharing
    cores, ``Cluster.compute_slots_per_node``): what their shared compute adds to the step."""
    overlap: float = 0.0
    """Compute slowed by the collectives that run beside it on a GPU (the data-parallel
    reduction hidden behind the backward, ZeRO-2's per-micro-batch reduce-scatters, ZeRO-3's
    gathers and reduce-scatters): while a collective runs, NCCL holds ``Device.comm_compute_share``
    of the device, so its hidden seconds cost that share of compute (``plan_cost.overlapped``)."""
    framework: float = 0.0
    """Per-step host work outside the kernels (``Device.step_overhead_s``) and the all-reduce of
    the step's loss over all ranks (which also waits for the last rank to finish)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ConfigError(f"StepTimeTerms.{f.name} must be >= 0 seconds, got {getattr(self, f.name)}")

    @property
    def total(self) -> float:
        """Sum of all terms, seconds."""
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, float]:
        """Every term and ``total``, seconds."""
        return asdict(self) | {"total": self.total}


@dataclass(frozen=True, kw_only=True)
class ClusterCosts:
    """The :class:`passes.ir.cost.CostHooks` of one device of a cluster (see :func:`cost_hooks`)."""

    name: str
    device_memory_bytes: float
    host_memory_bytes: float
    device: Device = field(repr=False)
    host_link: Link = field(repr=False)

    def compute_seconds(self, flops: float, dtype: str) -> float:
        return compute_time(flops, self.device, dtype)

    def host_copy_seconds(self, nbytes: float) -> float:
        return nbytes / self.host_link.bandwidth_bytes_per_s + self.host_link.latency_s


def cost_hooks(cluster: Cluster) -> ClusterCosts:
    """What the policy passes of the lowering need of ``cluster``: one device's compute time,
    its link to host memory, device and (per device) host memory."""
    return ClusterCosts(name=f"{cluster.name} x {cluster.nodes}", device_memory_bytes=cluster.device.memory_bytes,
                        host_memory_bytes=cluster.host_memory_bytes / cluster.devices_per_node,
                        device=cluster.device, host_link=cluster.host_to_device)
