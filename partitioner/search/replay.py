"""Per-rank predictions of a training plan: peak memory (bytes) and step time (seconds).

MEMORY is derived from the exact liveness analysis of the rank's own stage modules, not from the
planner's per-layer estimate. For each stage module (tp-sharded, checkpointed or offloaded as the
runtime runs it; :func:`passes.lowering.lower.lower`) :func:`stage_events` records
the alloc/free timeline of :func:`passes.analysis.annotate_memory.annotate_memory` at ONE micro-batch's dims
(the analysis runs as the planner runs it, with an observer,
:class:`passes.analysis.liveness.MemoryObserver`, that records its events). :func:`predict_rank` then replays those timelines along the rank's schedule
(:func:`passes.ir.schedule.build`), keyed per micro-batch, with what the runtime adds
around them (:mod:`runtime.exec.stage_executor`, :mod:`runtime.optim.grad_sync`)::

    step start     params + optimizer state (AdamW: its 2 fp32 moments, plus an fp32 master copy
                   under bf16/fp16, and a 4-byte step per tensor; ZeRO-1/2: the fp32 master chunk
                   and its 2 states; offload="optimizer": none, it is on the host) + last step's
                   gradients + the global batch
    RECV_F         a receive buffer per boundary tensor (kept until SEND_B: the leaf of backward)
    FORWARD        the stage's forward events (activations saved for backward stay live)
    SEND_F         the output is held by the pending isend until its micro-batch's output
                   gradient comes back (RECV_B, taken at the start of its backward: the next stage
                   had received it), else until the ALL_REDUCE action waits
    BACKWARD       the stage's backward events; a parameter's first gradient of the step stays
                   (``.grad``), later micro-batches' are added in place (allocated, then freed);
                   the gradient of each received input is made and held for its SEND_B
    last backward  data parallel: the gradient bucket (a flat copy of every gradient) is
                   launched from the hook of the stage's last gradient
    ALL_REDUCE     pending sends released; tied-weight sums; bucket views replace the gradients
    BACKWARD/ZeRO  ZeRO-1: at the last backward each bucket's flat fp32 copy replaces its
                   gradients and this rank's chunk arrives. ZeRO-2: every backward's gradients
                   fill buckets that are launched (fp32 flat copy, gradients freed) as they
                   complete, at most MAX_IN_FLIGHT in flight (runtime.optim.grad_sync)
    STEP           AdamW's per-parameter temporaries (annotate_memory's optimizer phase; under
                   bf16/fp16 after every gradient's fp32 copy for the masters), or
                   ZeRO: the chunk's temporaries and the all-gathers of the updated chunks (at
                   most MAX_IN_FLIGHT buckets); offload="optimizer": the host AdamW's
                   temporaries (counted on a CPU device only: there the host is the same memory;
                   the masters, moments and gradient buffers on the host are not device memory)

ZeRO-3 (``zero=3``): the parameters are the rank's dp shards, so model state is the shards,
their ``.grad`` and AdamW's moments of them (no bucket, chunk or master copy). annotate_memory
sees each ``zero3_gather`` output as an activation its readers save; :func:`_with_zero3` turns
those into gather events that :class:`_Zero3Gathers` places as the runtime does: a site's
buffers from its gather (a prefetched site one site earlier), its parameters freed after their
last forward reader, gathered again at the first saver's backward (or a region's recompute) and
held until the site's reduce-scatter, whose fp32 flat, padded copies and shard it adds.

Activation offload: annotate_memory does not see the saves inside an offload region, so an
offloaded storage leaves the device after its last forward use; :func:`stage_events` adds the
copies the offload hooks make (the reloaded copy in backward, and on CPU the "host"
clone from the save to the last backward, in the same memory; see :func:`_with_offload_copies`).

The rank's peak is the largest live total of that replay. Everything is in bytes of tensor
storages, which is what :class:`runtime.observe.measure.LiveBytes` counts on CPU.

TIME is the planner's :func:`partitioner.search.search.search` with every knob pinned, evaluated on a
cluster (``local_cluster(world_size)`` reads the calibrated file); the step time is the same on
every rank (ranks wait for each other at the end of a step).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping

import torch
from torch import fx

from passes.ir.graph_modules import copy_graph_module
from passes.ir.errors import ConfigError
from torch.multiprocessing.reductions import StorageWeakRef

from passes.analysis.liveness import MemoryObserver
from passes.analysis.saved_tensors import _hint
from passes.analysis.annotate_memory import annotate_memory
from passes.ir.meta import CAPTURE, MEMORY_SUMMARY
from passes.ir.offload_ops import OFFLOAD_BEGIN
from passes.ir.zero3_ops import ZERO3_PREFETCH, ZERO3_GATHER, GatherSchedule, Zero3Plan, keeps_gathered
from passes.ir.meta import ZERO3_PLAN
from passes.ir.meta import dim_symbol
from passes.ir.schedule import build as build_schedule
from passes.ir.schedule.actions import Kind
from passes.rewrites.split_backward import copied_weight_gradients, held_gradient_meta, weight_half_nodes
from partitioner.search.search import search
from passes.ir.grad_buckets import MAX_IN_FLIGHT, BucketMachine, GradSlot, Launch, bucket_layout
from partitioner.compile.build import rank_program
from partitioner.cost.cluster import Cluster
from passes.ir.config import KNOBS, DType, ParallelConfig, is_mixed
from passes.ir.optimizers import optimizer_model

_STEP_BYTES = 4  # AdamW's 0-dim float32 ``step`` per parameter tensor


@dataclass(frozen=True, slots=True)
class Event:
    """One alloc (``+``) or free (``-``) of ``key`` (``bytes`` at the micro-batch's dims)."""
    phase: str
    op: str
    key: Hashable
    bytes: int


@dataclass(frozen=True, kw_only=True)
class StageEvents:
    """The liveness timeline of one stage module for one micro-batch (bytes).

    ``forward``/``backward``: activation and gradient events (model state and graph inputs are
    left out: the rank replay places them). ``param_grads``: the gradient buffers that become a
    parameter's ``.grad``, each with the parameter's qualified name in the stage module. ``optimizer_bytes``: the optimizer's largest temporaries.
    ``param_bytes``: parameter storages of the module (bytes), for checks.
    """

    forward: tuple[Event, ...]
    backward: tuple[Event, ...]
    param_grads: Mapping[Hashable, str]
    optimizer_bytes: int
    param_bytes: int
    activation_bytes: int
    """Saved activations kept between forward and backward (annotate_memory's ``activation_bytes``)."""

@dataclass(frozen=True, kw_only=True)
class RankPrediction:
    """Predicted peak bytes and step seconds of one rank; ``peak_action`` says where the peak is."""
    rank: int
    peak_bytes: int
    step_time_s: float
    peak_action: str
    param_bytes: int
    """Parameter storages held by this rank (bytes)."""
    state_bytes: int = 0
    """Parameters and optimizer state held through the step (bytes; ZeRO-1: the dp shard's)."""
    parts: Mapping[str, int] = field(default_factory=dict)
    """Live bytes by category at the peak (``state``, ``grads``, ``activations``, ``buffers``)."""

@dataclass(frozen=True, kw_only=True)
class MemoryPrediction:
    """Result of :func:`predict_memory` (bytes)."""
    peak_bytes: int
    where: str
    """The action (``0B1``: backward of stage 0, micro-batch 1; ``STEP``...) at the peak."""
    parts: Mapping[str, int]
    param_bytes: int
    state_bytes: int


# ---------------------------------------------------------------------------------------------
# One stage: recorded liveness of annotate_memory at one micro-batch's dims


class _Recorder(MemoryObserver):
    """Records the memory pass's simulated step (:class:`passes.analysis.liveness.MemoryObserver`):
    its alloc/free events by phase (``@`` markers where each node's events start), the buffers
    that become a parameter's ``.grad``, and the saved storages the offload regions move to host."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.param_grads: dict = {}
        self.moved: list = []  # (region, storage, bytes at the dims) of each storage offloaded
        self._phase = "forward"

    def at(self, phase: str, node: str) -> None:
        self._phase = phase
        self.events.append(Event(phase, "@", node, 0))

    def alloc(self, key, hint_bytes: int) -> None:
        self.events.append(Event(self._phase, "+", key, hint_bytes))

    def free(self, key) -> None:
        self.events.append(Event(self._phase, "-", key, 0))

    def param_grad(self, key, param: str) -> None:
        self.param_grads[key] = param

    def offloaded(self, region: int, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.moved.append((region, StorageWeakRef(storage), _hint(storage.nbytes())))


def stage_events(module: fx.GraphModule, dims: Mapping[str, int], *, optimizer: str = "adamw",
                 dtype: DType = "fp32") -> StageEvents:
    """Record the liveness timeline of ``module`` (a stage program with ``meta[CAPTURE]`` listing
    its own inputs, as :func:`passes.lowering.lower.lower` sets it) for one
    micro-batch of named ``dims`` (e.g. ``{"batch": 2, "seq": 8}``). ``module`` is not changed.
    ``dtype``: the plan's training dtype (16-bit: the optimizer temporaries are fp32, the masters')."""

    gm = copy_graph_module(module)
    info = gm.meta.get(CAPTURE)
    if info is None:
        raise ConfigError("fidelity: the stage module has no meta['capture']; lower it with "
                          "passes.lowering.lower.lower, which gives each stage its own inputs")
    missing = [n for n, _ in info.dims if n in info.symbolic and n not in dims]
    if missing:
        raise ConfigError(f"fidelity: dims {missing} of the stage are not given; pass dims={{...}} with them")
    gm.meta[CAPTURE] = dataclasses.replace(info, dims=tuple((n, int(dims.get(n, v))) for n, v in info.dims))
    zero3 = gm.meta.get(ZERO3_PLAN)
    if zero3 is not None:
        _unique_region_names(gm)  # each region's gather is told apart from the stage's by its marker
    rec = _Recorder()
    annotate_memory(gm, optimizer=optimizer, dtype=dtype, observer=rec)
    summary = gm.meta[MEMORY_SUMMARY]
    events = _with_offload_copies(gm, rec.events, rec.moved, device=info.device)
    if zero3 is not None:
        events = _with_zero3(gm, events, zero3)
    fwd, bwd, opt_live, opt_peak = [], [], 0, 0
    model_state = set()
    sizes: dict = {}
    for e in events:
        if e.op == "@":
            continue
        if e.op == "+":
            sizes[e.key] = e.bytes
        if e.phase == "forward" and _is_model_state(e.key):
            model_state.add(e.key)
            continue
        if e.key in model_state:
            continue
        if e.phase == "forward":
            fwd.append(e)
        elif e.phase == "backward":
            bwd.append(e)
        else:  # optimizer temporaries: only their largest live total matters
            opt_live += sizes[e.key] if e.op == "+" else -sizes[e.key]
            opt_peak = max(opt_peak, opt_live)
    fwd = [dataclasses.replace(e, bytes=sizes[e.key]) if e.op in "+-" else e for e in fwd]
    bwd = [dataclasses.replace(e, bytes=sizes[e.key]) if e.op in "+-" else e for e in bwd]
    hints = {k: v for k, v in gm.meta[CAPTURE].symbols().items()}
    return StageEvents(forward=tuple(fwd), backward=tuple(bwd), param_grads=dict(rec.param_grads),
                       optimizer_bytes=opt_peak, param_bytes=_int(summary.param_bytes, hints),
                       activation_bytes=_int(summary.activation_bytes, hints))


def _with_offload_copies(gm: fx.GraphModule, events: list, offloaded: list, *, device: str) -> list:
    """``events`` with the copies the offload hooks make of offloaded storages.

    annotate_memory sees none of the saves made inside an offload region (the region's hooks sit
    on top of its own), so an offloaded storage dies on the device after its last forward use,
    which is what offload does. What it does not see, per offloaded storage (views share one):

    * the reloaded device copy, made by the first unpack (the backward of its LAST saver in
      forward order; on CUDA earlier when prefetched: at the first unpack of the host copy made
      after it) and dropped after the backward of its FIRST saver (the last unpack; the
      unpacked views keep it alive until that backward is over);
    * on CPU, the "host" copy too (a clone in the same memory): made by the pack in its first
      saver's forward (after the saver's outputs, before the saver's inputs die) and kept by
      autograd's saved variables until that same last backward.

    The saver of region ``r`` is the node right after ``offload_begin(..., r)``.
    """
    if not offloaded:
        return [e for e in events]

    nodes = list(gm.graph.nodes)
    saver = {n.args[3]: nodes[i + 1].name for i, n in enumerate(nodes) if n.target is OFFLOAD_BEGIN}
    savers: dict = {}  # storage -> (bytes, [saver names in forward order])
    for region, ref, nbytes in offloaded:
        _, names = savers.setdefault(ref, (nbytes, []))
        if saver[region] not in names:
            names.append(saver[region])
    fwd_order = {e.key: k for k, e in enumerate(events) if e.op == "@" and e.phase == "forward"}
    bwd_seen = {e.key for e in events if e.op == "@" and e.phase == "backward"}
    before: dict[tuple[str, str], list[Event]] = {}  # (phase, node) -> events after its allocations
    after: dict[tuple[str, str], list[Event]] = {}  # (phase, node) -> events at the end of its block
    start: dict[tuple[str, str], list[Event]] = {}  # (phase, node) -> events right after its marker
    bwd_order = {e.key: k for k, e in enumerate(events) if e.op == "@" and e.phase == "backward"}
    ordered = [(nbytes, sorted(names, key=lambda x: fwd_order.get(x, 0))) for nbytes, names in savers.values()]
    unpacked_at = [next((x for x in reversed(names) if x in bwd_seen), None) for _, names in ordered]
    for n, (nbytes, names) in enumerate(ordered):
        first = names[0]
        running = [x for x in names if x in bwd_seen]
        if device != "cuda":
            before.setdefault(("forward", first), []).append(Event("forward", "+", ("offload_host", n), nbytes))
        if running:
            at = running[-1]
            # CUDA prefetch (runtime/kernels/offload.py): the first unpack of the next host copy
            # made starts this one's reload, when that comes first in backward
            nxt = unpacked_at[n + 1] if device == "cuda" and n + 1 < len(ordered) else None
            if nxt is not None and bwd_order.get(nxt, 1 << 30) < bwd_order.get(at, 1 << 30):
                at = nxt
            start.setdefault(("backward", at), []).append(
                Event("backward", "+", ("offload_reload", n), nbytes))
            end = [Event("backward", "-", ("offload_reload", n), 0)]
            if device != "cuda":
                end.append(Event("backward", "-", ("offload_host", n), 0))
            after.setdefault(("backward", running[0]), []).extend(end)
        elif device != "cuda":  # never unpacked: autograd drops it with the graph, after backward
            after.setdefault(("backward", "(end)"), []).append(Event("backward", "-", ("offload_host", n), 0))
    out: list[Event] = []
    block: tuple[str, str] | None = None
    pending: list[Event] = []  # this block's "before" events, not yet placed

    # each list is placed once: a node can be marked twice (the loss output starts backward)
    def close() -> None:
        out.extend(pending)
        pending.clear()
        if block is not None:
            out.extend(after.pop(block, ()))

    for e in events:
        if e.op == "@":
            close()
            block = (e.phase, e.key)
            out.append(e)
            out.extend(start.pop(block, ()))
            pending.extend(before.pop(block, ()))
            continue
        if e.op == "-" and pending:  # the node's allocations are done: the pack has run
            out.extend(pending)
            pending.clear()
        out.append(e)
    close()
    for rest in after.values():  # never reached by a marker: released after the backward
        out.extend(rest)
    return out


# ZeRO-3 events of a stage's timeline: the replay (:class:`_Zero3Gathers`) places the gathered
# buffers, whose lifetime depends on the gathers issued before (prefetch), across micro-batches.
Z3_FORWARD = "z3_forward"  # key (stage, site): the site's forward gather
Z3_FREE = "z3_free"  # key ((stage, site), j): the last forward reader of parameter j is done
Z3_USE = "z3_use"  # key (stage, site): a backward use (a saver's unpack, a region's recompute)
Z3_RELEASE = "z3_release"  # key (stage, site): the site's reduce-scatter starts (its backward is over)
Z3_DONE = "z3_done"  # key (stage, site): the reduce-scatter returned its shards
Z3_OPS = (Z3_FORWARD, Z3_FREE, Z3_USE, Z3_RELEASE, Z3_DONE)


def _unique_region_names(gm: fx.GraphModule) -> None:
    """Give the nodes of each checkpointed region (a GraphModule child) names no node of the
    stage graph has (``region/name``): the timeline's markers name nodes, and a region's own
    ``zero3_gather`` is otherwise named as the stage graph's."""
    for region, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            for node in child.graph.nodes:
                node.name = f"{region}/{node.name}"


def _with_zero3(gm: fx.GraphModule, events: list, plan: Zero3Plan) -> list:
    """``events`` with ZeRO-3's gathered parameters as :mod:`runtime.kernels.zero3` holds them.

    annotate_memory sees each ``zero3_gather`` output as an activation that its readers save
    until their backward. The runtime packs those saves as tokens instead, so here:

    * forward: the gather's allocations become one ``Z3_FORWARD`` (the replay allocates the
      site's padded buffers there, or earlier when prefetched), and each buffer is freed
      (``Z3_FREE``) after its parameter's last forward reader, saved or not;
    * backward: a ``Z3_USE`` at each saver's backward (an unpack gathers the whole site again
      unless it is held) and in place of a region's recomputed gather outputs; their own frees
      are dropped (the held site lives until its reduce-scatter);
    * the gather's backward (its ``zero3_reduce_scatter``): ``Z3_RELEASE`` first (the held site
      is dropped), then, before annotate_memory's shard gradients (which are the pieces of the
      site's one fp32 shard), the site's fp32 ``[degree, S]`` flat and each gradient's padded
      copy (see ``copies``), freed at the end of the block, where ``Z3_DONE`` is.
    """
    sites: dict[str, tuple[int, int]] = {}  # gather node name -> (stage, site)
    nodes: dict[fx.Node, tuple[int, int]] = {}
    graphs = [gm] + [c for _, c in gm.named_children() if isinstance(c, fx.GraphModule)]
    for g in graphs:
        for node in g.graph.nodes:
            if node.op == "call_function" and node.target is ZERO3_GATHER:
                key = (int(node.args[4]), int(node.args[5]))
                sites[node.name], nodes[node] = key, key
    by_key = {(s.stage, s.site): s for s in plan.sites}
    savers: dict[str, list[tuple[int, int]]] = {}
    for site in plan.sites:
        for name in site.savers:
            savers.setdefault(name, []).append((site.stage, site.site))

    def gathered(key):
        st = key[1] if isinstance(key, tuple) and len(key) == 2 and key[0] == "re" else key
        return st if getattr(st, "owner", None) in nodes and getattr(st, "kind", None) == "activation" else None

    # each gathered storage: its site, its parameter's index there, the forward marker of its last reader
    fwd_markers = [e.key for e in events if e.op == "@" and e.phase == "forward"]  # [0]: "(model state)"
    index: dict[object, tuple[tuple[int, int], int]] = {}
    frees: dict[int, list[tuple[tuple[int, int], int]]] = {}
    for e in events:
        st = gathered(e.key)
        if e.op != "+" or st is None or st in index:
            continue
        key = nodes[st.owner]
        j = sum(1 for k, _ in index.values() if k == key)
        index[st] = (key, j)
        if fwd_markers[st.index + 1] != st.owner.name:
            raise ConfigError(f"fidelity: the memory analysis' forward markers do not follow its node order "
                              f"(marker {st.index + 1} is {fwd_markers[st.index + 1]!r}, not {st.owner.name!r}); "
                              f"the ZeRO-3 replay needs one marker per node")
        frees.setdefault(st.last_use + 1, []).append((key, j))

    def copies(key: tuple[int, int]) -> tuple[list[tuple[Hashable, int]], list[tuple[Hashable, int]]]:
        """The fp32 buffers the site's reduce-scatter makes before its shards (bytes): the
        ``[degree, S]`` flat (at degree 1 in fp32 it is the shard itself, i.e. the gradients)
        and, for a 16-bit site, the fp32 shard before its pieces are cast; then each
        gradient's zero-padded copy, one after the other (two live while the name is rebound)."""
        params = [plan.param(n) for n in by_key[key].params]
        d, total = plan.degree, sum(p.shard_numel for p in params)
        half = params[0].dtype != torch.float32
        whole = [(("z3_rs_flat", key), 4 * d * total)] if d > 1 or half else []
        pads = [(("z3_rs_padded", key, j), 4 * d * p.shard_numel) for j, p in enumerate(params)]
        shard = [(("z3_rs_shard", key), 4 * total)] if d > 1 and half else []
        return whole + pads, shard

    out: list[Event] = []
    phase, marker = "forward", -1
    scatter: list = []  # the reduce-scatter block being placed: [key, its buffers made yet, live buffers]
    used: set = set()  # sites a region's recompute already asked for in this block

    def close() -> None:
        if phase == "forward" and marker in frees:
            out.extend(Event("forward", Z3_FREE, kj, 0) for kj in frees[marker])
        if scatter:
            key, _, live = scatter
            out.extend(Event("backward", "-", k, 0) for k in live)
            out.append(Event("backward", Z3_DONE, key, 0))
            scatter.clear()

    for e in events:
        if e.op == "@":
            close()
            phase, used = e.phase, set()
            marker = marker + 1 if e.phase == "forward" else marker
            out.append(e)
            if e.phase == "forward" and e.key in sites:
                out.append(Event("forward", Z3_FORWARD, sites[e.key], 0))
            elif e.phase == "backward":
                out.extend(Event("backward", Z3_USE, key, 0) for key in savers.get(e.key, ()))
                if e.key in sites:
                    out.append(Event("backward", Z3_RELEASE, sites[e.key], 0))
                    scatter.extend([sites[e.key], False, []])
            continue
        st = gathered(e.key)
        if st is not None:  # the gathered buffers are the replay's
            if e.op == "+" and e.key is not st and index[st][0] not in used:  # a region's recompute
                used.add(index[st][0])
                out.append(Event("backward", Z3_USE, index[st][0], 0))
            continue
        if scatter and e.op == "+" and not scatter[1]:  # the first shard gradient: the buffers before it
            key, _, live = scatter
            before, shard = copies(key)
            for k, nbytes in before:
                out.append(Event("backward", "+", k, nbytes))
                if k[0] == "z3_rs_padded" and k[2] > 0:  # the previous gradient's copy dies as the name is rebound
                    out.append(Event("backward", "-", ("z3_rs_padded", key, k[2] - 1), 0))
            out.extend(Event("backward", "+", k, nbytes) for k, nbytes in shard)
            live.extend(k for k, _ in before if k[0] != "z3_rs_padded")
            live.extend(k for k, _ in shard)
            if any(k[0] == "z3_rs_padded" for k, _ in before):
                live.append(next(k for k, _ in reversed(before) if k[0] == "z3_rs_padded"))
            scatter[1] = True
        out.append(e)
    close()
    return out


def _is_model_state(key) -> bool:
    # annotate_memory's model-state keys: ("param", st), ("opt", st), and buffer/input storages
    # (allocated before the first forward node). Activation storages are bare _Storage objects too,
    # so they are told apart by kind.
    if isinstance(key, tuple):
        return key[0] in ("param", "opt")
    return getattr(key, "kind", None) in ("buffer", "input", "param")


def _int(expr, hints) -> int:
    import sympy

    value = sympy.sympify(expr).xreplace(hints)
    return int(value)


# ---------------------------------------------------------------------------------------------
# One rank: replay of its schedule


class _Live:
    """Live bytes by key and category, and the largest total seen."""
    def __init__(self) -> None:
        self.size: dict[Hashable, tuple[int, str]] = {}
        self.total = 0
        self.peak = 0
        self.where = ""
        self.parts: dict[str, int] = {}
        self._by: dict[str, int] = {}

    def alloc(self, key: Hashable, nbytes: int, kind: str, where: str) -> None:
        if key in self.size:
            raise ValueError(f"fidelity replay: {key!r} allocated twice")
        self.size[key] = (nbytes, kind)
        self.total += nbytes
        self._by[kind] = self._by.get(kind, 0) + nbytes
        if self.total > self.peak:
            self.peak, self.where, self.parts = self.total, where, dict(self._by)

    def free(self, key: Hashable) -> None:
        nbytes, kind = self.size.pop(key)
        self.total -= nbytes
        self._by[kind] -= nbytes

    def shrink(self, key: Hashable, nbytes: int) -> None:
        """``nbytes`` of ``key``'s now belong to another key (allocated next): no new peak."""
        size, kind = self.size[key]
        self.size[key] = (size - nbytes, kind)
        self.total -= nbytes
        self._by[kind] -= nbytes

    def free_if(self, key: Hashable) -> None:
        if key in self.size:
            self.free(key)

    def bump(self, nbytes: int, kind: str, where: str) -> None:
        """A transient of ``nbytes`` on top of what is live."""
        self.alloc(("bump", where), nbytes, kind, where)
        self.free(("bump", where))


def _launch_buckets(live: "_Live", zero: int, buckets: list[int], chunk_bytes: int, hooked_bytes: int,
                    where: str, late_grad: Callable[[tuple], bool]) -> None:
    """The gradient buckets backward's hooks launch (runtime.optim.grad_sync.BucketedGradSync; the
    trailing ones, ``late_grad``, wait for the ALL_REDUCE): ZeRO-1 replaces each bucket's gradients
    with a flat fp32 copy, held beside its reduced chunk until the ALL_REDUCE action waits for it;
    without ZeRO, a flat copy of every gradient the hooks launch (``hooked_bytes``), which the
    gradients become views of."""
    if zero == 1:
        for key in [key for key in live.size if isinstance(key, tuple) and key[0] == "pgrad" and not late_grad(key)]:
            live.free(key)
        live.alloc("zero1_flats", 4 * sum(buckets), "grads", where)
        live.alloc("zero_chunks", chunk_bytes, "grads", where)
    else:
        live.alloc("bucket", hooked_bytes, "grads", where)


def _tensor_bytes(meta, dims_sym) -> int:
    n = 1
    for d in meta.shape:
        n *= int(d.subs(dims_sym)) if hasattr(d, "subs") else int(d)
    return n * torch.empty((), dtype=meta.dtype).element_size()


def predict_memory(program, *, schedule: str, num_micro_batches: int, dims: Mapping[str, int],
                   global_batch_bytes: int = 0, zero: int = 0, optimizer: str = "adamw",
                   events: Mapping[int, StageEvents] | None = None, zero3_prefetch: int = ZERO3_PREFETCH) -> MemoryPrediction:
    """Peak live bytes of one rank running ``program`` (a :class:`passes.ir.program.RankProgram`)
    for one step (see the module docstring).

    ``dims``: named dims of ONE micro-batch; ``global_batch_bytes``: storage bytes of the global
    batch tensors every rank slices its micro-batches from; ``zero``: 0, 1 or 2 (ZeRO-1/2 AdamW),
    or 3 (the program's parameters are dp shards, gathered per block: :class:`_Zero3Gathers`).
    ``events``: precomputed :func:`stage_events` per stage (computed here otherwise).
    ``zero3_prefetch``: ZeRO-3 sites gathered ahead of the running one (the runtime's
    ``zero3_prefetch``).
    """

    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"fidelity: zero={zero}; the runtime runs ZeRO stages 0, 1, 2 and 3")
    plans = {s: program.modules[s].meta.get(ZERO3_PLAN) for s in program.stages}
    if (zero == 3) != all(p is not None for p in plans.values()):
        raise ConfigError(f"fidelity: zero={zero} but the stage programs were "
                          f"{'not ' if zero == 3 else ''}lowered with zero_stage=3; replay the program "
                          f"with the zero stage it was lowered for")
    m, pp, v, dp = num_micro_batches, program.pp, program.virtual_pp, program.config.dp_cp
    actions = build_schedule(schedule, pp, m, v)[program.pp_index]
    ev = dict(events) if events is not None else {s: stage_events(program.modules[s], dims, optimizer=optimizer,
                                                                  dtype=program.config.dtype)
                                                  for s in program.stages}
    sym = {dim_symbol(k): val for k, val in dims.items()}
    io = program.io
    n_stages = len(io)
    boundary = {s: [inp for inp in io[s + 1].inputs if inp.kind == "recv"] for s in range(n_stages - 1)}

    # Parameters this rank holds: distinct storages over its stage modules (a tied weight twice
    # when its copies live on two stages of this rank, as unique_params keeps them).
    params, seen = [], set()
    for s in program.stages:
        for p in program.modules[s].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    numel = sum(p.numel() for p in params)
    n_tensors = len(params)
    masters = is_mixed(program.config.dtype)  # runtime.optim.mixed_precision: fp32 masters of 16-bit params
    device = program.modules[program.stages[0]].meta[CAPTURE].device  # what the step runs on (params may be meta)
    # ZeRO-3 has no buckets: each site's gradients are reduce-scattered in backward into the
    # shards, which an unsharded AdamW steps (the parameters are the shards)
    sharded_state = zero in (1, 2)
    sync = (dp > 1 or zero > 0) and zero != 3  # runtime.exec.parallel_model builds gradient buckets
    # ep: the experts' gradients sync in buckets of their own; unsharded over one rank (ep = dp * cp)
    # those start only at the ALL_REDUCE (no hooks), after the other buckets have become the gradients
    experts = set(program.expert_params)
    expert_ids = {id(p) for n, p in _named(program).items() if n in experts}
    late_experts = not sharded_state and program.config.expert_replicas == 1 and bool(experts)
    expert_bytes = sum(p.numel() * p.element_size() for p in params if id(p) in expert_ids)
    # ZeRO-1/2 shard the dp buckets over dp and the expert buckets over the ranks holding the same
    # experts (runtime.optim.grad_sync.ShardedOptimizer over both syncs)
    syncs = ([([p for p in params if id(p) not in expert_ids], dp),
              ([p for p in params if id(p) in expert_ids], program.config.expert_replicas)]
             if sharded_state and expert_ids else [(params, dp)])
    # tied copies and sequence-parallel parameters go in trailing buckets, launched at the ALL_REDUCE
    named = _named(program)
    late_ids = {id(named[n]) for n in program.sp_grad_params if n in named}
    late_ids |= {id(q) for tied in program.tied.values() for q in tied.copies(program.modules)}
    layouts = ([(_bucket_layout(ps, size if sharded_state else 1, shard=sharded_state, late=late_ids), size)
                for ps, size in syncs] if zero != 3 else [])
    buckets = [b.numel for layout, _ in layouts for b in layout if not b.late]  # those backward's hooks launch
    late_buckets = [b.numel for layout, _ in layouts for b in layout if b.late]

    def late_grad(key) -> bool:  # a ("pgrad", stage, event key) of a parameter in a trailing bucket
        return id(program.modules[key[1]].get_parameter(ev[key[1]].param_grads[key[2]])) in late_ids

    def launch_buckets(where: str) -> None:
        _launch_buckets(live, zero, buckets, chunk_bytes, param_bytes - (expert_bytes if late_experts else 0),
                        where, late_grad)
    # this rank's fp32 chunk of every bucket
    chunk_bytes = sum(4 * b.numel // size for layout, size in layouts for b in layout) if sharded_state else 0
    host_optimizer = program.config.offload == "optimizer"  # runtime.optim.optimizer_offload: state on the host
    host_is_device = device == "cpu"  # the capture's device: a weightless copy's parameters are meta
    live = _Live()
    live.alloc("params", param_bytes, "state", "(start)")
    # offload="optimizer": the fp32 masters and AdamW's moments live in host memory, not on the device
    if sharded_state and not host_optimizer:  # fp32 master chunk, exp_avg, exp_avg_sq (runtime.optim.grad_sync.ShardedOptimizer)
        live.alloc("zero_state", 3 * chunk_bytes + _STEP_BYTES, "state", "(start)")
    elif not host_optimizer:  # AdamW's fp32 moments (and MasterWeightOptimizer's fp32 masters)
        live.alloc("opt_state", (12 if masters else 8) * numel + _STEP_BYTES * n_tensors, "state", "(start)")
    state_bytes = live.total
    live.alloc("batch", global_batch_bytes, "buffers", "(start)")
    live.alloc("grads_prev", chunk_bytes if sharded_state else param_bytes, "grads", "(start)")  # last step's, until zero_grad
    live.free("grads_prev")
    z3 = _Zero3Gathers(live, {s: p for s, p in plans.items() if p is not None}, zero3_prefetch) if zero == 3 else None

    last_backward = {}
    for k, a in enumerate(actions):
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            last_backward[a.stage] = k
    # a split backward's input half keeps the micro-batch's graph (every saved activation) and
    # leaves the parameters' gradients to the weight half: those events wait here
    deferred: dict[tuple[int, int], list] = {}
    held_grads = ({s: sum(_tensor_bytes(meta, sym) for meta in held_gradient_meta(program.modules[s]))
                   for s in program.stages} if program.config.split_backward else {})
    kept_for_w = ({s: weight_half_nodes(program.modules[s]) for s in program.stages}
                  if program.config.split_backward else {})
    copied_in_w = ({s: copied_weight_gradients(program.modules[s]) for s in program.stages}
                   if program.config.split_backward else {})
    recompute_in_w = {s: _recompute_peak(ev[s].backward) for s in kept_for_w}
    grads_made: set[int] = set()
    sent: list[Hashable] = []
    returned: set[tuple[int, int]] = set()  # (stage, micro-batch) whose output gradient came back
    bucket_launched = False
    zero2 = ([_Zero2Buckets(live, layout, size, name) for (layout, size), name in zip(layouts, ("dp", "experts"))]
             if zero == 2 else None)
    member = {id(p): (k, i) for k, (ps, _) in enumerate(syncs) for i, p in enumerate(ps)}  # its sync, its place there
    for k, a in enumerate(actions):
        where = f"{a}"
        s, i = a.stage, a.microbatch
        if a.kind == Kind.RECV_F:
            for inp in boundary[s - 1]:
                live.alloc(("recv", s, i, inp.name), _tensor_bytes(inp.meta, sym), "activations", where)
        elif a.kind == Kind.FORWARD:
            for e in ev[s].forward:
                if e.op in Z3_OPS:
                    z3.event(e, i, where)
                else:
                    _apply(live, e, (s, i), "activations", where)
        elif a.kind == Kind.SEND_F:
            sent.append(("out", s, i))
        elif a.kind == Kind.RECV_B:
            if any(inp.meta.requires_grad for inp in boundary[s]):
                returned.add((s, i))
        elif a.kind == Kind.BACKWARD_INPUT:
            _sends_returned(sent, returned, s, i)
            later = deferred.setdefault((s, i), [])
            held = {key for key in live.size if _of(key, s, i)}  # what the forward left: kept until W
            for e in ev[s].backward:
                if e.op in Z3_OPS:
                    raise ConfigError("fidelity: a split backward (zero-bubble schedules) with zero_stage=3 is not run "
                                      "by the runtime; choose schedule=1f1b or interleaved, or zero_stage <= 2")
                if e.key in ev[s].param_grads or (e.op == "-" and (s, i, e.key) in held
                                                  and not _released_by_input_half(e.key, kept_for_w[s])):
                    later.append(e)
                else:
                    _apply(live, e, (s, i), "activations", where)
            # the stage's outputs no backward op saved go once nothing else holds them: the send
            # is complete (its gradient came back) and the executor has let go of them
            if ("out", s, i) not in sent:
                saved = {e.key for e in ev[s].backward if e.op == "-"}
                for key in [k for k in live.size if _of(k, s, i) and _is_output_key(k, ev[s]) and k[2] not in saved]:
                    live.free(key)
            # the output gradients of the ops that read a weight, captured for W
            live.alloc((s, i, "held_grads"), held_grads[s], "activations", where)
            if s > 0:
                for inp in boundary[s - 1]:
                    if inp.meta.requires_grad:
                        live.alloc(("igrad", s, i, inp.name), _tensor_bytes(inp.meta, sym), "activations", where)
                        sent.append(("igrad", s, i, inp.name))
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            first = s not in grads_made
            grads_made.add(s)
            weight_half = a.kind == Kind.BACKWARD_WEIGHT
            if not weight_half:
                _sends_returned(sent, returned, s, i)
            events = deferred.pop((s, i)) if weight_half else ev[s].backward
            kept = set()
            if weight_half:  # W makes every weight gradient of the micro-batch, then accumulates them
                made = sum(e.bytes for e in events if e.key in ev[s].param_grads and e.op == "+")
                live.alloc((s, i, "w_grads"), made, "grads", where)  # (runtime.exec.split_backward)
                # and the graph (what forward saved) lives until W returns: freed below, not as it goes
                kept = {key for key in live.size if _of(key, s, i)}
                # W walks into each checkpointed region again and recomputes it (one at a time)
                if recompute_in_w[s]:
                    live.bump(recompute_in_w[s], "activations", where)
            for e in events:
                key = (s, i, e.key)
                if e.op in Z3_OPS:
                    if e.op == Z3_DONE:  # the shards returned are accumulated into .grad and released
                        for k in [k for k in live.size if isinstance(k, tuple) and k[:3] == ("z3_acc", s, i)]:
                            live.free(k)
                    else:
                        z3.event(e, i, where)
                    continue
                if e.key in ev[s].param_grads:
                    if zero2 is not None:  # every backward's gradients, reduced bucket by bucket
                        param = program.modules[s].get_parameter(ev[s].param_grads[e.key])
                        k_sync, m = member[id(param)]
                        zero2[k_sync].grad(e, ("pgrad", s, i, e.key), m, where)
                    elif first:
                        if weight_half and e.op == "+" and ev[s].param_grads[e.key] not in copied_in_w[s]:
                            live.shrink((s, i, "w_grads"), e.bytes)  # .grad becomes W's gradient itself
                        _apply(live, e, ("pgrad", s), "grads", where)
                    elif z3 is not None and e.op == "+":  # a site's shards live until its reduce-scatter returns
                        live.alloc(("z3_acc", s, i, e.key), e.bytes, "grads", where)
                    elif e.op == "+" and not weight_half:  # W's are counted in its w_grads
                        live.bump(e.bytes, "grads", where)  # accumulated in place, then released
                    continue
                if e.op == "-" and (s, i, e.key) in kept:
                    continue
                _apply(live, e, (s, i), "activations", where)
            launch = sync and zero < 2 and not bucket_launched and all(last_backward[t] <= k for t in last_backward)
            bucket_launched = bucket_launched or launch
            if weight_half:
                if launch:  # the hooks launch the buckets while W still holds its gradients and graph
                    launch_buckets(where)
                live.free((s, i, "w_grads"))
            if s > 0 and not weight_half:  # the gradient of each received input, held until its send completes
                for inp in boundary[s - 1]:
                    if inp.meta.requires_grad:
                        live.alloc(("igrad", s, i, inp.name), _tensor_bytes(inp.meta, sym), "activations", where)
                        sent.append(("igrad", s, i, inp.name))
            # what is still live of this micro-batch: outputs held by a pending send stay
            for key in [key for key in live.size if _of(key, s, i)]:
                if not (("out", s, i) in sent and _is_output_key(key, ev[s])):
                    live.free(key)
            if launch and not weight_half:
                launch_buckets(where)
        elif a.kind == Kind.SEND_B:
            for inp in boundary[s - 1]:
                live.free_if(("recv", s, i, inp.name))
        elif a.kind == Kind.ALL_REDUCE:
            for key in list(live.size):
                if (isinstance(key, tuple) and key and key[0] == "igrad") or _sent_output(key, sent, ev):
                    live.free(key)
            sent.clear()
            if "zero1_flats" in live.size:  # the trailing buckets' flat copies join them, then all are waited
                live.alloc("zero1_late_flats", 4 * sum(late_buckets), "grads", where)
                live.free("zero1_late_flats")
                live.free("zero1_flats")
            if zero2 is not None:
                for z in zero2:  # the dp buckets, then the experts'
                    z.finish(where)
            elif bucket_launched:  # the gradients become views of the bucket (ZeRO-1: are freed)
                pgrads = [key for key in live.size if isinstance(key, tuple) and key[0] == "pgrad"]
                late = {key for key in pgrads if late_experts and ev[key[1]].param_grads.get(key[2]) in experts}
                for key in pgrads:
                    if key not in late:
                        live.free(key)
                if late_experts:  # then the expert buckets' flat copies, which the expert gradients become
                    live.alloc("expert_bucket", expert_bytes, "grads", where)
                    for key in late:
                        live.free(key)
            if sharded_state:  # the chunks are concatenated into the master's gradient
                live.bump(chunk_bytes, "grads", where)
        elif a.kind == Kind.OPTIMIZER_STEP:
            if z3 is not None:
                z3.reset()  # nothing gathered outlives the step (runtime: ParamGatherer.reset)
            if host_optimizer:
                # the gradients go into host buffers of their own (not device memory); AdamW's
                # temporaries on the host are, on a CPU "device", in the same memory
                if host_is_device:
                    live.bump(max((e.optimizer_bytes for e in ev.values()), default=0), "state", where)
            elif sharded_state:
                # AdamW temporaries of the chunk (none in the fused kernel); then the all-gather of
                # the updated chunks, at most MAX_IN_FLIGHT buckets at once, each gathered into its
                # parts and their cat
                live.bump(2 * chunk_bytes if optimizer_model(optimizer).temporaries(device) else 0, "state", where)
                biggest = sorted((_own(b, params) for b in buckets), reverse=True)
                if dp > 1:
                    # 16-bit parameters: each in-flight chunk is first cast from the fp32 master
                    cast = sum(biggest[:MAX_IN_FLIGHT]) // dp if masters else 0
                    live.bump(sum(biggest[:MAX_IN_FLIGHT]) + biggest[0] + cast, "state", where)
            else:  # 16-bit: every gradient's fp32 copy is made before AdamW runs on the masters
                live.bump((4 * numel if masters else 0) + max((e.optimizer_bytes for e in ev.values()), default=0),
                          "state", where)
    return MemoryPrediction(peak_bytes=live.peak, where=live.where, parts=live.parts, param_bytes=param_bytes,
                            state_bytes=state_bytes)


class _Zero3Gathers:
    """ZeRO-3's gathered parameters in the replay, as :class:`runtime.kernels.zero3.ParamGatherer`
    holds them; when to gather is :class:`passes.ir.zero3_ops.GatherSchedule`'s rule, replayed
    over the rank's whole step (prefetches cross blocks and stages as they do at run time).

    An issued site is in flight with one buffer, ``[degree, S]`` for ``S`` elements of shards per
    rank; this rank's shards are copied into its own row, the collective's input. A site
    takes its gather by copying each parameter out of that buffer into a storage of its own (a
    parameter's column block is not contiguous when the site has several: ``reshape`` copies it
    first, ``degree * n`` elements), then both buffers die. In forward the parameters die one by
    one after their last reader (``Z3_FREE``); in backward the site holds them from its first
    use to its reduce-scatter (``Z3_RELEASE``). Under ``reshard_after_forward=False`` a
    re-gathered site holds them from its forward gather to its reduce-scatter instead.
    """

    def __init__(self, live: _Live, plans: Mapping[int, Zero3Plan], prefetch: int) -> None:
        self.live = live
        self.schedule = GatherSchedule([site for p in plans.values() for site in p.sites], prefetch,
                                       keep=keeps_gathered(plans.values()))
        self.sites = {(site.stage, site.site): (plan.degree, [plan.param(n) for n in site.params])
                      for plan in plans.values() for site in plan.sites}
        self.pending: dict[tuple[int, int], Hashable] = {}  # issued, not yet taken: its buffer
        self.forward: dict[tuple[tuple[int, int], int], list[Hashable | None]] = {}  # (site, micro-batch)
        self.held: dict[tuple[int, int], list[Hashable]] = {}
        self.count = 0

    def _key(self, *parts) -> Hashable:
        self.count += 1
        return ("z3", *parts, self.count)

    def _issue(self, keys: list[tuple[int, int]], where: str) -> None:
        for key in keys:
            d, params = self.sites[key]
            total, size = sum(p.shard_numel for p in params), params[0].dtype.itemsize
            buf = self._key("gathered", key)
            self.live.alloc(buf, d * total * size, "gathered", where)
            self.pending[key] = buf

    def _take(self, key: tuple[int, int], where: str) -> list[Hashable]:
        buf = self.pending.pop(key)
        d, params = self.sites[key]
        out = []
        for p in params:
            copy = None
            if d > 1 and len(params) > 1:
                copy = self._key("column", key)
                self.live.alloc(copy, d * p.shard_numel * p.dtype.itemsize, "gathered", where)
            out.append(self._key("param", key))
            self.live.alloc(out[-1], p.numel * p.dtype.itemsize, "gathered", where)
            if copy is not None:
                self.live.free(copy)
        self.live.free(buf)
        return out

    def event(self, e: Event, microbatch: int, where: str) -> None:
        if e.op == Z3_FORWARD:
            kept = e.key in self.held  # reshard_after_forward=False: gathered by an earlier forward
            self._issue(self.schedule.forward(e.key), where)
            taken = [] if kept else self._take(e.key, where)
            if e.key in self.schedule.held and not kept:  # held from here to its reduce-scatter
                self.held[e.key] = taken
            if e.key not in self.held:  # what the forward's last readers free (a held site: its reduce-scatter)
                self.forward[(e.key, microbatch)] = taken
        elif e.op == Z3_FREE:
            key, j = e.key
            params = self.forward.get((key, microbatch))
            if params is None:  # held
                return
            self.live.free(params[j])
            params[j] = None
            if not any(params):
                del self.forward[(key, microbatch)]
        elif e.op == Z3_USE:
            self._issue(self.schedule.backward(e.key), where)
            if e.key not in self.held and e.key in self.pending:
                self.held[e.key] = self._take(e.key, where)
        elif e.op == Z3_RELEASE:
            self.schedule.released(e.key)
            for k in self.held.pop(e.key, ()):
                self.live.free(k)

    def reset(self) -> None:
        for k in self.pending.values():
            self.live.free(k)
        for keys in [*self.held.values(), *self.forward.values()]:
            for k in keys:
                if k is not None:
                    self.live.free(k)
        self.pending.clear()
        self.held.clear()
        self.forward.clear()
        self.schedule.reset()


def _named(program) -> dict[str, torch.nn.Parameter]:
    """The parameters of rank program ``program`` by name (a parameter once, under its first name)."""
    out, seen = {}, set()
    for s in program.stages:
        for name, p in program.modules[s].named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
    return out


def _bucket_layout(params, size: int, *, shard: bool, late: set[int] = frozenset()):
    """The gradient buckets :class:`runtime.optim.grad_sync.BucketedGradSync` makes of ``params``
    (:func:`passes.ir.grad_buckets.bucket_layout`; sharded ones padded to a multiple of ``size``),
    those of ``late`` (``id``: tied copies, sequence-parallel parameters) in trailing buckets."""
    return bucket_layout([GradSlot(p.numel(), p.dtype, id(p) in late) for p in params], size=size, shard=shard)


def _own(numel: int, params) -> int:
    """Bytes of ``numel`` elements in the parameters' dtype."""
    return numel * (params[0].element_size() if params else 4)


class _Zero2Buckets:
    """ZeRO-2 in the replay: :class:`passes.ir.grad_buckets.BucketMachine` says when each bucket
    starts and is waited, as it does for the runtime. A parameter's gradient made by a backward
    joins its bucket's round; a launch makes the bucket's fp32 flat copy while its gradients still
    exist, frees them and makes the reduce-scatter's output chunk; a retired launch frees its flat
    copy, and its chunk becomes the bucket's summed chunk (the first time) or is added into it
    and freed."""

    def __init__(self, live: _Live, layout, dp: int, name: str = "dp") -> None:
        self.live, self.layout, self.dp, self.name = live, layout, dp, name
        self.machine = BucketMachine(layout, "reduce_scatter_each")
        self.pending: dict[int, list[Hashable]] = {}  # bucket -> its gradients made since its last launch
        self.summed: set[int] = set()  # buckets whose summed chunk exists

    def grad(self, e: Event, key: Hashable, member: int, where: str) -> None:
        """One parameter-gradient event of a backward (``member``: the parameter's index in the
        layout): a partial gradient freed once summed ("-") leaves its bucket; a new gradient
        is the parameter's accumulation, on which the machine may launch or retire."""
        k = self.machine.bucket_of[member]
        if e.op != "+":
            if key in self.pending.get(k, ()):
                self.pending[k].remove(key)
                self.live.free(key)
            return
        self.live.alloc(key, e.bytes, "grads", where)
        self.pending.setdefault(k, []).append(key)
        self._do(self.machine.accumulated(member), where)

    def finish(self, where: str) -> None:
        """The ALL_REDUCE action: what backward did not launch, then every wait."""
        self._do(self.machine.finish_early() + self.machine.finish_late(), where)
        self.machine.reset()

    def _do(self, steps, where: str) -> None:
        for step in steps:
            b = self.layout[step.bucket]
            if isinstance(step, Launch):
                self.live.alloc((self.name, "zero2_flat", step.launch), 4 * b.numel, "grads", where)
                for key in self.pending.pop(step.bucket, []):
                    self.live.free(key)
                self.live.alloc((self.name, "zero2_chunk", step.launch), 4 * b.numel // self.dp, "grads", where)
                continue
            self.live.free((self.name, "zero2_flat", step.launch))
            if step.bucket in self.summed:
                self.live.free((self.name, "zero2_chunk", step.launch))  # added into the bucket's summed chunk
            else:
                self.summed.add(step.bucket)  # the first chunk is the summed chunk (kept to the step)


def _recompute_peak(events) -> int:
    """The most bytes of recomputed storages (keys ``("re", storage)``) alive at once in a
    backward: a checkpointed region's recompute, which a split backward's W makes again."""
    live = peak = 0
    for e in events:
        if isinstance(e.key, tuple) and len(e.key) == 2 and e.key[0] == "re":
            live += e.bytes if e.op == "+" else -e.bytes if e.op == "-" else 0
            peak = max(peak, live)
    return peak


def _released_by_input_half(key, kept: set[str]) -> bool:
    """A storage saved for backward only by nodes of the stage's own graph that the weight half
    does not keep (:func:`passes.rewrites.split_backward.weight_half_nodes`): I frees it."""
    savers = getattr(key, "savers", None)
    # a region's nodes live in its own graph module, which carries no capture facts
    return bool(savers) and not getattr(key, "cached", False) and all(
        CAPTURE in n.graph.owning_module.meta and n.name not in kept for n in savers)


def _apply(live: _Live, e: Event, tag: tuple, kind: str, where: str) -> None:
    key = (*tag, e.key)
    if e.op == "+":
        live.alloc(key, e.bytes, kind, where)
    else:
        live.free_if(key)


def _of(key, s: int, i: int) -> bool:
    return isinstance(key, tuple) and len(key) == 3 and key[0] == s and key[1] == i


def _is_output_key(key, events: StageEvents) -> bool:
    return getattr(key[2], "graph_output", False)


def _sends_returned(sent: list, returned: set, s: int, i: int) -> None:
    """Micro-batch ``i``'s output gradient came back to stage ``s``: the next stage had received
    its forward sends, which the runtime then drops (``StageExecutor._release_forward_sends``)."""
    if (s, i) in returned and ("out", s, i) in sent:
        sent.remove(("out", s, i))


def _sent_output(key, sent, ev) -> bool:
    if not (isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], int)):
        return False
    return ("out", key[0], key[1]) in sent and _is_output_key(key, ev[key[0]])


# ---------------------------------------------------------------------------------------------
# Time: the planner's evaluation of the pinned plan


def predict_step_time(profile, cluster, knobs: Mapping[str, object], *, global_batch: int,
                      optimizer: str = "adamw", check=None):
    """The planner's :class:`passes.ir.plan.Plan` for ``knobs`` (every knob of
    :data:`passes.ir.plan.KNOBS`) on ``cluster``: ``step_time_s`` (seconds) and terms. ``check``:
    the search's memory check (:func:`partitioner.search.memory_check.replay_check`), so the plan carries
    the memory numbers the planner returns for a captured model."""

    # off unless given (knob sets written before HSDP, reshard_after_forward, cp, ep and compile existed)
    knobs = {"hsdp_shard": None, "reshard_after_forward": True, "cp": 1, "cp_mode": "ring", "ep": 1, "compile": False,
             **knobs}
    missing = [k for k in KNOBS if k not in knobs]
    if missing:
        raise ConfigError(f"fidelity: pin every knob to evaluate one plan; missing {missing}")
    big = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=1 << 50))
    return search(profile, big, global_batch=global_batch, fix=dict(knobs), optimizer=optimizer, check=check)


def predict_rank(gm: fx.GraphModule, knobs: Mapping[str, object], rank: int, dims: Mapping[str, int], *,
                 cluster: Cluster, global_batch_bytes: int = 0, step_time_s: float = float("nan"),
                 optimizer: str = "adamw") -> RankPrediction:
    """Predicted peak bytes of rank ``rank`` for the plan ``knobs`` (``dp``, ``tp``, ``pp``,
    ``virtual_pp``, ``schedule``, ``num_micro_batches``, ``zero_stage``, ``checkpointing``,
    ``offload``) over ``gm`` (from :func:`partitioner.compile.build.capture_for_pipeline`), with ONE
    micro-batch of named ``dims``. ``step_time_s``: the planner's step time
    (:func:`predict_step_time`), the same on every rank. The rank program is the one the
    runtime would run (:func:`partitioner.compile.build.rank_program`), lowered for ``cluster`` as
    the job lowers it."""

    config = ParallelConfig(**{k: knobs[k] for k in KNOBS if k in knobs and k != "micro_batch_size"},
                            micro_batch_size=int(dims.get("batch", knobs.get("micro_batch_size", 1))))
    program = rank_program(gm, config, rank, cluster=cluster)
    mem = predict_memory(
        program, schedule=str(knobs["schedule"]), num_micro_batches=int(knobs["num_micro_batches"]), dims=dims,
        global_batch_bytes=global_batch_bytes, zero=int(knobs.get("zero_stage", 0)), optimizer=optimizer)
    return RankPrediction(rank=rank, peak_bytes=int(mem.peak_bytes), step_time_s=step_time_s,
                          peak_action=mem.where, param_bytes=mem.param_bytes, state_bytes=mem.state_bytes,
                          parts=mem.parts)
