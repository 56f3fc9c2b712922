"""``dry_run``: the whole job's real runtime, one rank program at a time, on fake tensors and a fake group.

::

    report = dry_run("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16", "dgx-h100",
                     training=Training(global_batch=16), fix="dp=4,tp=2,pp=2", nodes=2)
    print(report.text())          # one line per representative rank; report.ok

What happens, in this one process:

1. plan (or take ``plan``), capture the model on the meta device (no weights) and lower the plan
   once with the job's one lowering (:func:`partitioner.compile.build.lower_plan`: every rank
   program, the static communication check included);
2. pick one representative rank per distinct rank program: the ranks of data-parallel replica 0,
   one per (stage rank, tp rank, cp rank); replica ``k`` of the same position runs the same program
   (under ZeRO with shards of the same sizes), so each representative *stands for* the ranks
   ``rank + k * cp * tp`` of every replica ``k``;
3. for each representative: initialise torch's ``fake`` process-group backend as that rank of the
   full world size, build the mesh (:meth:`runtime.dist.mesh.Mesh.for_config`), give its program
   fake parameters (:class:`FakeTensorMode`: real shapes and dtypes, no memory), run one
   :meth:`runtime.exec.parallel_model.ParallelModel.train_step` on a fake global batch, and tear
   the group down. Every collective and point-to-point call the rank makes through
   ``torch.distributed`` is recorded (:class:`Collective`: op, group ranks, shape, dtype, peer);
4. check the recorded sequences across representatives: every group whose members are all
   representatives (tp, cp and pipeline groups of replica 0; the mesh's world group) must see the
   same sequence from each member, and each message sent must be received with the same shape
   and dtype (:attr:`DryRunReport.mismatches`); the same collective with another size or dtype on
   two members, and a send without its receive (or the reverse), are named as what NCCL refuses;
5. compare each representative's step calls with the communication check's prediction
   (:func:`compare_static`, the vocabularies mapped in :func:`as_check_calls`); calls the check
   does not model are notes (:attr:`RankRun.static_notes`), differences mismatches;
6. measure each representative's peak memory (:class:`LiveBytes`: fake storages alive, rounded by
   :func:`allocator_bytes`) against the plan's per-rank peak; above :data:`MEMORY_TOLERANCE` the
   report lists the largest tensors alive at the peak. A difference is reported, not a failure;
   a peak above the device's memory is (:attr:`RankRun.fits`: the job would run out of memory
   there). The search's own per-device estimate (``plan.predicted.peak_memory_bytes``, what a plan
   made without a captured graph states) is set beside the largest dry-run peak.
   Host memory is not counted: an offloaded optimizer's masters, state and gradient buffers (and
   what its host step makes from them alone), and the host copies of offloaded activations
   (:func:`runtime.kernels.offload.watch_host_copies`).

The strict group also refuses, while the rank runs, a collective carrying a tensor off the job's
device (``job_device``; a CPU tensor in a CUDA job): :class:`StrictGroupError` names the rank and
the call.

Two things of the fake world need help, both here and none in the runtime:

* the project's custom collective ops (tp, cp, ZeRO-3) have fake kernels that only compute
  shapes, so under ``FakeTensorMode`` their real kernels, which issue the collectives, would not
  run: :class:`_RunRealKernels` sends them to their real kernels (on fake tensors);
* a host read of a tensor value (``float(loss)``, ``.item()``, the gradient norm, Adam's step
  count) has no value to read: it reads ``1`` (``1.0``; ``False`` for a flag: no overflow) and is
  counted (:attr:`RankRun.host_reads`); a result whose shape depends on values (``nonzero``) gets
  its largest shape (every element non-zero) and is counted alike.

The tensors are fake tensors on the CPU device: on this CPU build of torch, autograd aborts the
process on a fake CUDA tensor (``AccumulateGrad`` asks for a CUDA device guard, which a CPU build
does not have). What a CUDA run needs beyond that is listed in the module's ``CUDA_SEAMS``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner.api.planning import plan as make_plan
from partitioner.compile.build import analysed_training_step, lower_plan
from partitioner.cost.cluster import Cluster
from partitioner.cost.device_memory import memory_budget
from partitioner.inputs.knobs import check_fix
from partitioner.inputs.model_spec import ModelSpec, meta_copy
from partitioner.inputs.models import as_spec
from partitioner.inputs.training import Training
from partitioner.search.memory_check import replay_ranks
from passes.checks.communication_check import rank_calls
from passes.ir.config import ParallelConfig, TORCH_DTYPES
from passes.ir.errors import ConfigError
from passes.ir.ops import qualname
from passes.ir.plan import Plan
from passes.ir.program import RankProgram, global_rank, mesh_coords
from passes.lowering.lower import Lowering
from passes.lowering.manager import PassContext
from runtime.dist.mesh import Mesh
from runtime.exec.parallel_model import ParallelModel
from runtime.kernels.collectives import unregister_group
from runtime.kernels.offload import watch_host_copies
from runtime.observe.progress import terminal_bar

CUDA_SEAMS = (
    "autograd on fake CUDA tensors needs a CUDA build of torch (a CPU build aborts in AccumulateGrad)",
    "runtime/dist/mesh.py:103 Mesh.device is cuda only for the nccl backend (torch.cuda.current_device())",
    "runtime/dist/comm.py:60 check_device refuses CPU tensors only on nccl groups",
    "runtime/dist/comm.py:134 broadcast_object picks cuda only for nccl groups",
    "runtime/optim/mixed_precision.py:53,117 pinned host buffers, torch.cuda.current_stream().synchronize()",
    "runtime/kernels/offload.py:101-161 torch.cuda.Stream / Event / record_stream, pin_memory=True",
    "runtime/observe/measure.py:243-265 torch.cuda.reset_peak_memory_stats / max_memory_allocated",
)
"""Where the runtime calls CUDA directly (``file:line``): what a dry run on fake CUDA tensors has to
pass through (a device handle, stream and event creation, memory statistics)."""


# ---------------------------------------------------------------------------------------------
# What a rank does, and the report

@dataclass(frozen=True, slots=True)
class Collective:
    """One communication call as the process group saw it."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``, ``send``,
    ``recv``, ``barrier``, ``all_gather_object``, ``broadcast_object``."""
    group: tuple[int, ...]
    """The global ranks of the group it ran on."""
    shape: tuple[int, ...]
    dtype: str
    peer: int | None = None
    """The other global rank of a send or receive."""
    group_id: str = ""
    """The group's name (two groups over the same ranks are two communicators)."""
    numel: int = 0
    """Elements of the whole buffer, as the communication check counts them: an all-reduce's or a
    broadcast's tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's input,
    a message's tensor."""
    reduce: str = ""
    """An all-reduce's reduction (``sum``, ``max``, ...)."""
    batch: int = -1
    """Point to point: the ``batch_isend_irecv`` call it was posted in (its index in the rank's log)."""

    def text(self) -> str:
        where = f" peer {self.peer}" if self.peer is not None else ""
        return f"{self.op} {list(self.shape)} {self.dtype.replace('torch.', '')} on {_ranks_text(self.group)}{where}"

    def key(self) -> tuple:
        """What the members of one group must agree on."""
        return (self.op, self.shape, self.dtype)


@dataclass(slots=True)
class RankRun:
    """One representative rank's dry run."""

    rank: int
    stands_for: tuple[int, ...]
    """Every global rank that runs this rank's program (its data-parallel replicas)."""
    pp_index: int
    tp_index: int
    cp_index: int
    ok: bool = False
    error: str | None = None
    """The exception it raised, as ``Type: message`` (its first lines)."""
    traceback: str | None = None
    collectives: list[Collective] = field(default_factory=list)
    host_reads: int = 0
    """Tensor values the rank read on the host (each read 1, or False: fake tensors hold no values)."""
    seconds: float = 0.0
    step_starts: list[int] = field(default_factory=list)
    """Where each training step's calls begin in :attr:`collectives` (the calls before the first
    one were made while the mesh and the model were built)."""
    static: list[str] = field(default_factory=list)
    """Where its recorded calls differ from the communication check's prediction (:func:`compare_static`)."""
    static_notes: list[str] = field(default_factory=list)
    """Calls it made that the communication check does not model, and why that is right."""
    static_calls: int = 0
    """Calls of its steps compared with the prediction."""
    peak_bytes: int = 0
    """Its peak of device bytes during the run, as the CUDA caching allocator would hold them
    (:class:`LiveBytes`)."""
    predicted_bytes: float | None = None
    """The plan's peak for this rank (``plan.predicted.rank_peak_memory_bytes``), when it has one."""
    device_bytes: float | None = None
    """What the plan's tensors may use of the job's device, when known: its memory less the CUDA
    context, NCCL's buffers and the allocator's slack (``partitioner.cost.device_memory``)."""
    peak_tensors: list[str] = field(default_factory=list)
    """When the two differ by more than :data:`MEMORY_TOLERANCE`: the largest tensors alive at the
    dry run's peak, each with the op that made it."""

    @property
    def fits(self) -> bool:
        """Whether its peak fits in what the device leaves the plan (True when either is unknown)."""
        return self.device_bytes is None or self.peak_bytes <= self.device_bytes

    @property
    def memory_difference(self) -> float | None:
        """(dry-run peak - predicted) / predicted, or ``None`` without a prediction."""
        if not self.predicted_bytes or not self.peak_bytes:
            return None
        return (self.peak_bytes - self.predicted_bytes) / self.predicted_bytes


@dataclass(slots=True)
class DryRunReport:
    """What :func:`dry_run` saw: the plan, one :class:`RankRun` per representative rank, and the
    disagreements between the recorded sequences of the members of a group."""

    plan: Plan
    world_size: int
    ranks: list[RankRun]
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self.ranks) and not self.mismatches and not self.static_mismatches
                and all(r.fits for r in self.ranks))

    @property
    def static_mismatches(self) -> list[str]:
        """Where a rank's recorded calls differ from the communication check's prediction."""
        return [m for r in self.ranks for m in r.static]

    def failed(self) -> list[RankRun]:
        return [r for r in self.ranks if not r.ok]

    def text(self) -> str:
        c = self.plan.config
        lines = [f"dry run of {self.plan.model} under {c.text()}: {self.world_size} ranks, "
                 f"{len(self.ranks)} distinct rank programs ({self.seconds:.1f} s)"]
        for r in self.ranks:
            status = "OK" if r.ok else f"FAILED: {r.error}"
            static = (f"{r.static_calls} calls as the communication check predicts" if r.ok and not r.static
                      else f"{len(r.static)} differences from the communication check" if r.ok else "")
            lines.append(f"  rank {r.rank} (pp={r.pp_index} tp={r.tp_index} cp={r.cp_index}) for ranks "
                         f"{_ranks_text(r.stands_for)}: {status}; {len(r.collectives)} collectives"
                         f"{' (' + static + ')' if static else ''}, {r.host_reads} host reads, {r.seconds:.2f} s")
        if any(r.peak_bytes for r in self.ranks):
            lines.append("  memory: peak bytes of each rank, the dry run's (storages alive, rounded as the CUDA caching "
                         "allocator holds them) and the plan's (the replay of the rank's program)")
            lines.append(f"    {'rank':>6}  {'dry run':>12}  {'plan':>12}  {'difference':>10}")
            for r in self.ranks:
                d = r.memory_difference
                plan_text = f"{r.predicted_bytes / 2**20:.1f} MiB" if r.predicted_bytes else "-"
                lines.append(f"    {r.rank:>6}  {r.peak_bytes / 2**20:>8.1f} MiB  {plan_text:>12}  "
                             f"{'-' if d is None else f'{100 * d:+.1f}%':>10}")
            largest = max(self.ranks, key=lambda r: r.peak_bytes)
            estimate = self.plan.predicted.peak_memory_bytes
            if estimate and abs(largest.peak_bytes - estimate) > MEMORY_TOLERANCE * estimate:
                lines.append(f"  the search's estimate of the peak per device, {estimate / 2**30:.2f} GiB, is "
                             f"{100 * (largest.peak_bytes - estimate) / estimate:+.1f}% off the largest dry-run peak "
                             f"(rank {largest.rank}, {largest.peak_bytes / 2**30:.2f} GiB)")
            for r in self.ranks:
                if not r.fits:
                    lines.append(f"  OUT OF MEMORY: rank {r.rank} (for ranks {_ranks_text(r.stands_for)}) peaks at "
                                 f"{r.peak_bytes / 2**30:.2f} GiB; the device leaves the plan {r.device_bytes / 2**30:.2f} GiB "
                                 f"(its memory less the CUDA context, NCCL's buffers and the allocator's slack)")
            for r in self.ranks:
                if r.peak_tensors:
                    lines.append(f"  rank {r.rank}'s peak differs from the plan's by more than "
                                 f"{100 * MEMORY_TOLERANCE:.0f}%; its largest tensors alive then (by the op that made them):")
                    lines += [f"    {t}" for t in r.peak_tensors]
        for m in self.mismatches:
            lines.append(f"  MISMATCH: {m}")
        for m in self.static_mismatches:
            lines.append(f"  STATIC MISMATCH: {m}")
        notes = sorted({n.split(": ", 1)[-1] if n.startswith("step ") else n.split(" (")[0] + " (start-up)"
                        for r in self.ranks for n in r.static_notes})
        for n in notes:
            lines.append(f"  not compared: {n}")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    return "(" + ", ".join(map(str, ranks)) + ")"


# ---------------------------------------------------------------------------------------------
# Which ranks run which program

def representatives(config: ParallelConfig, *, first: int = 0) -> dict[int, tuple[int, ...]]:
    """Representative global rank -> every rank running its program: one per (pipeline rank, tp
    rank, cp rank), taken from data-parallel replica 0; replica ``k`` is ``rank + k * cp * tp``."""
    c = config
    out: dict[int, tuple[int, ...]] = {}
    for rank in range(first, first + c.world_size):
        pp_index, dp_index, tp_index = mesh_coords(rank, dp=c.dp_cp, tp=c.tp, first=first)
        replica, cp_index = divmod(dp_index, c.cp)
        rep = first + pp_index * c.dp_cp * c.tp + cp_index * c.tp + tp_index
        out.setdefault(rep, ())
        out[rep] += (rank,)
    return out


# ---------------------------------------------------------------------------------------------
# Recording what the fake group sees

def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _group_id(group: Any) -> str:
    g = dist.GroupMember.WORLD if group is None else group
    return getattr(g, "group_name", "") or ""


def _numel(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel()
    if isinstance(t, (list, tuple)):
        return sum(_numel(x) for x in t)
    return 0


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
               dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.AVG: "avg"}


def _reduce_name(op: Any) -> str:
    for known, name in _REDUCE_OPS.items():
        if op == known:
            return name
    return str(op)


def _tensor_meta(t: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(t, torch.Tensor):
        return tuple(int(s) for s in t.shape), str(t.dtype)
    if isinstance(t, (list, tuple)) and t and isinstance(t[0], torch.Tensor):
        return (len(t), *(int(s) for s in t[0].shape)), str(t[0].dtype)
    return (), "object"


_RECORDED = {
    # name in torch.distributed -> (recorded op, which argument is the tensor); which argument is
    # the whole buffer (numel): _WHOLE
    "all_reduce": ("all_reduce", 0),
    "all_gather": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 1),
    "reduce_scatter": ("reduce_scatter", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "broadcast": ("broadcast", 0),
    "all_to_all_single": ("all_to_all", 1),
    "barrier": ("barrier", None),
    "all_gather_object": ("all_gather_object", None),
    "broadcast_object_list": ("broadcast_object", None),
}
_WHOLE = {"all_reduce": 0, "all_gather": 0, "all_gather_into_tensor": 0, "reduce_scatter": 1,
          "reduce_scatter_tensor": 1, "broadcast": 0, "all_to_all_single": 1}
"""Which argument of the call holds the whole buffer, in the communication check's sense."""


@contextlib.contextmanager
def recording(log: list[Collective], *, check: Callable[[Collective, Any], None] | None = None) -> Iterator[None]:
    """Record into ``log`` every collective and point-to-point call made through ``torch.distributed``
    while the context is open (the functions are wrapped on the module, where
    :mod:`runtime.dist.comm` looks them up). ``check(call, tensors)`` may refuse a call (raise)
    before it is posted (``call``: its record, already in ``log``; ``tensors``: every tensor it
    carries)."""
    originals: dict[str, Callable] = {}

    def wrap(name: str, op: str, arg: int | None):
        original = getattr(dist, name)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            tensor = (kwargs.get("tensor", args[arg] if arg is not None and len(args) > arg else None)
                      if arg is not None else None)
            if name == "all_reduce" and tensor is None:
                tensor = kwargs.get("tensor")
            whole = args[_WHOLE[name]] if name in _WHOLE and len(args) > _WHOLE[name] else None
            if whole is None and name in _WHOLE:
                whole = tensor
            reduce = _reduce_name(kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)) \
                if name == "all_reduce" else ""
            shape, dtype = _tensor_meta(tensor)
            call = Collective(op, _group_ranks(group), shape, dtype, group_id=_group_id(group), numel=_numel(whole),
                              reduce=reduce)
            log.append(call)
            if check is not None:
                check(call, [*_tensors(args), *_tensors(list(kwargs.values()))])
            return original(*args, **kwargs)
        return recorded

    def batch_isend_irecv(p2p_op_list):
        batch = len(log)
        for p in p2p_op_list:
            op = "recv" if p.op.__name__ in ("irecv", "recv") else "send"
            shape, dtype = _tensor_meta(p.tensor)
            call = Collective(op, _group_ranks(p.group), shape, dtype, peer=p.peer, group_id=_group_id(p.group),
                              numel=_numel(p.tensor), batch=batch)
            log.append(call)
            if check is not None:
                check(call, [p.tensor])
        return originals["batch_isend_irecv"](p2p_op_list)

    for name, (op, arg) in _RECORDED.items():
        originals[name] = getattr(dist, name)
        setattr(dist, name, wrap(name, op, arg))
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# ---------------------------------------------------------------------------------------------
# Fake tensors: the project's collective ops run their real kernels; host reads read 0

_NAMESPACE = qualname("all_reduce").split("::")[0]
_DEVICE_KEYS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}


def _device_of(args: Sequence[Any]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (list, tuple)):
            found = _device_of(a)
            if found:
                return found
    return ""


@functools.cache
def _has_real_kernel(name: str) -> bool:
    """Whether the op has a kernel for real tensors (``torch.library.register_kernel(..., None)``
    registers it for every backend: CompositeExplicitAutograd)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")


class _RunRealKernels(TorchDispatchMode):
    """Above a :class:`FakeTensorMode`: the project's custom ops (whose fake kernels only compute
    shapes) run their real kernels on the fake tensors, so the collectives they issue happen; a
    read of a tensor's value on the host gets ``1`` of its type (``False`` for a bool) and is counted."""

    def __init__(self):
        super().__init__()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads += 1
            dtype = args[0].dtype
            return False if dtype is torch.bool else (1.0 if dtype.is_floating_point else 1)
        if func is torch.ops.aten.nonzero.default:  # as if every element were non-zero: the largest result
            self.host_reads += 1
            x = args[0]
            return torch.zeros((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if getattr(func, "namespace", None) == _NAMESPACE:
            key = _DEVICE_KEYS.get(_device_of(args))
            if key is not None and _has_real_kernel(func.name()):
                return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
        return func(*args, **kwargs)


class _FakeMode(FakeTensorMode):
    """The fake mode of a rank's run: :class:`FakeTensorMode` that does not try its dispatch
    cache on the process group's ops (``c10d``). It never caches them, but each call leaves a
    bypass entry under a key of its own in the process-wide cache (7,405 per rank of the pinned
    GPT-3 175B plan, kept to the end), and the key of a call over a list of tensors costs about
    as much as the call."""

    def _cached_dispatch_impl(self, func, types, args, kwargs):
        if getattr(func, "namespace", None) == "c10d":
            return self._dispatch_impl(func, types, args, kwargs)
        return super()._cached_dispatch_impl(func, types, args, kwargs)


# ---------------------------------------------------------------------------------------------
# Memory: bytes of the fake tensors' storages alive, as the caching allocator would hold them

MEMORY_TOLERANCE = 0.05
"""Above this relative difference from the plan's peak, the report lists the tensors alive at the peak."""
_BLOCK = 512
_LARGE = 2**20
_SEGMENT = 2 * 2**20


def allocator_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator holds for a storage of ``nbytes``: every block rounded up to
    512 bytes; a large one (over 1 MiB) up to a whole number of 2 MiB (the size of the segments
    it carves large blocks from). Not modelled: the 20 MiB segments of 1-10 MiB requests, free
    space left in segments (fragmentation), the CUDA context, NCCL's and cuBLAS' workspaces."""
    if nbytes <= 0:
        return 0
    if nbytes > _LARGE:
        return -(-nbytes // _SEGMENT) * _SEGMENT
    return -(-nbytes // _BLOCK) * _BLOCK


class LiveBytes(TorchDispatchMode):
    """Between a :class:`FakeTensorMode` and the modes above it: every op's output storages are
    tracked (weakly: a storage no tensor holds any more is freed) with :func:`allocator_bytes`,
    and the peak of their sum kept, with the storages alive at that peak (each with the op that
    made it, its shape and dtype). Views share their base's storage and count once.

    Host memory is not the device's: the storages :meth:`on_host` names (an offloaded optimizer's
    masters, state and gradient buffers) count 0 bytes, and so does what an op makes from host
    storages alone (the host optimizer step's temporaries). Every tensor of the dry run is on the
    CPU device (see the module docstring), so where a storage lives is told, not read."""

    def __init__(self):
        super().__init__()
        self._ref = StorageWeakRef
        # storage pointer -> (weak reference, bytes, what made it); the weak reference keeps the
        # pointer from being reused by another storage while the entry is here
        self.live: dict[int, tuple[Any, int, str]] = {}
        self.total = 0  # bytes of self.live, some of whose storages may have died since the last sweep
        self.peak = 0
        self.at_peak: list[tuple[Any, int, str]] = []  # self.live's entries at the peak
        self.host: set[int] = set()  # pointers of live host storages (their entries count 0 bytes)
        # (storage pointer, (peak, at_peak) before it): the last allocation, when it raised the peak
        self._raised: tuple[int, tuple[int, list]] | None = None

    def on_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` live in host memory: their storages count 0 bytes from now on, and the peak
        starts again from what is alive now (they were counted as they were made)."""
        for t in tensors:
            storage = t.untyped_storage()
            self._as_host(storage._cdata, self._ref(storage))
        self._sweep()
        self.peak, self.at_peak = self.total, list(self.live.values())

    def host_copy(self, t: torch.Tensor) -> None:
        """``t`` was just made as a host copy (an offloaded activation's,
        :func:`runtime.kernels.offload.watch_host_copies`): it counts 0 bytes, and a peak its
        allocation made is undone (nothing else was allocated since)."""
        storage = t.untyped_storage()
        key = storage._cdata
        old = self.live.get(key)
        if old is None or key in self.host:
            return
        if self._raised is not None and self._raised[0] == key:  # the peak was this allocation's
            self.peak, self.at_peak = self._raised[1]
            self._raised = None
        self._as_host(key, old[0])

    def _as_host(self, key: int, ref: Any) -> None:
        """The storage under ``key`` (weakly ``ref``) is host memory: 0 bytes from now on."""
        old = self.live.get(key)
        if old is not None:
            self.total -= old[1]
        self.live[key] = (ref, 0, "host")
        self.host.add(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE:  # a fake tensor's device, asked for tens of thousands of times a step
            return out
        host = bool(self.host) and self._all_host((args, kwargs))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, func, host=host)
        return out

    def _all_host(self, args) -> bool:
        tensors = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(t.untyped_storage()._cdata in self.host for t in tensors)

    def _track(self, t: torch.Tensor, func, *, host: bool = False) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        old = self.live.get(key)
        if old is not None:
            if not _expired(key):
                return  # a view, or the input returned
            self.total -= self.live.pop(key)[1]
            self.host.discard(key)
        if host:
            self._as_host(key, self._ref(storage))
            return
        size = allocator_bytes(storage.nbytes())
        self.live[key] = (self._ref(storage), size, f"{func.__name__ if hasattr(func, '__name__') else func} -> "
                                                    f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}")
        self.total += size
        self._raised = None
        if self.total > self.peak:
            self._sweep()
            if self.total > self.peak:
                self._raised = (key, (self.peak, self.at_peak))
                self.peak = self.total
                # a long ramp makes a new peak at each allocation: copy the entries, read them at the end
                self.at_peak = list(self.live.values())

    def _sweep(self) -> None:
        dead = [k for k in self.live if _expired(k)]
        for k in dead:
            self.total -= self.live.pop(k)[1]
            self.host.discard(k)

    def largest(self, n: int = 8) -> list[str]:
        """The ``n`` largest storages alive at the peak: ``bytes MiB: op -> shape dtype``."""
        device = [e for e in self.at_peak if e[1] > 0]  # host storages count nothing
        return [f"{b / 2**20:.2f} MiB: {what}" for _, b, what in sorted(device, key=lambda x: -x[1])[:n]]


_DEVICE = torch.ops.prim.device.default
_expired = torch.UntypedStorage._expired
"""Whether the storage at a pointer (held by a :class:`StorageWeakRef`) has been freed."""


def _fake_modules(modules: dict[int, nn.Module], device: torch.device) -> dict[int, nn.Module]:
    """``modules`` (copies: weights tied across them stay tied, in place) with every parameter and
    buffer replaced by a fake tensor of the same shape, dtype and strides on ``device`` (call
    under the fake mode, with copies made outside it)."""
    copies = modules
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for module in copies.values():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = fake(p)
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = fake(b)
    return copies


def _fake_batch(spec: ModelSpec, global_batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A global batch of fake tensors of the model's input shapes (call under the fake mode)."""
    dims = {**spec.dims, "batch": global_batch}
    out = []
    for inp in spec.inputs:
        shape = [dims[d] if isinstance(d, str) else int(d) for d in inp.shape]
        out.append(torch.zeros(shape, dtype=inp.dtype, device=device))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# One rank

def _fake_group(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def run_rank(program: RankProgram, spec: ModelSpec, *, stands_for: Sequence[int] = (), training: Training,
             device: torch.device = torch.device("cpu"), job_device: str | None = None, steps: int = 1,
             edit: Callable[[ParallelModel], None] | None = None) -> RankRun:
    """Run ``program`` (one rank's, of a world of ``program.config.world_size``) as that rank on a
    fake process group for ``steps`` training steps of fake tensors; returns what it did.
    ``job_device``: the device type the job's collectives must carry (default ``device``'s; a
    real job's is ``cuda``): a call with a tensor elsewhere fails the rank, as NCCL refuses it
    (:class:`StrictGroupError`). ``edit(model)``: called on the built :class:`ParallelModel`
    before its first step (tests plant bugs with it)."""
    c = program.config
    pp_index, dp_index, tp_index = mesh_coords(program.rank, dp=c.dp_cp, tp=c.tp, first=program.first)
    run = RankRun(program.rank, tuple(stands_for) or (program.rank,), pp_index, tp_index, dp_index % c.cp)
    start = time.perf_counter()
    host = _RunRealKernels()
    memory = LiveBytes()
    modules = copy.deepcopy(dict(program.modules))  # one copy (tied weights stay tied), outside the fake mode
    model = None
    try:
        with torch.random.fork_rng(devices=[]), _FakeMode(allow_non_fake_inputs=True), memory, host, \
                recording(run.collectives, check=functools.partial(_strict_device, run, job_device or device.type)), \
                watch_host_copies(memory.host_copy):
            _fake_group(program.rank, program.first + c.world_size)
            mesh = Mesh.for_config(c)
            mine = dataclasses.replace(program, modules=_fake_modules(modules, device))
            model = ParallelModel(mine, mesh, optimizer=training.optimizer_factory(), clip_grad_norm=training.clip_grad_norm,
                                  nonfinite=training.nonfinite)
            if getattr(model.optimizer, "on_host", False):  # an offloaded optimizer: its state is host memory
                memory.on_host(model.optimizer.state_tensors())
            if edit is not None:
                edit(model)
            batch = _fake_batch(spec, c.global_batch, device)
            for _ in range(steps):
                run.step_starts.append(len(run.collectives))
                model.train_step(batch)
        run.ok = True
    except Exception as exc:  # noqa: BLE001  (the report names the rank and the error)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        run.error = f"{type(exc).__name__}: {first}"
        run.traceback = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _unregister_groups(program)
        _release(model)
    run.host_reads = host.host_reads
    run.peak_bytes = memory.peak
    run.peak_tensors = memory.largest()
    run.seconds = time.perf_counter() - start
    return run


class StrictGroupError(RuntimeError):
    """A call the dry run's strict fake group refuses, as NCCL would."""


def _strict_device(run: RankRun, job_device: str, call: Collective, tensors: Sequence[torch.Tensor]) -> None:
    """NCCL carries tensors of the job's device only: a tensor elsewhere (a CPU tensor in a CUDA
    job) is refused, naming the rank and the call (its index in the rank's log)."""
    for t in tensors:
        if t.device.type != job_device:
            raise StrictGroupError(
                f"rank {run.rank} call {len(run.collectives) - 1} ({call.text()}): a {t.device.type} tensor of shape "
                f"{list(t.shape)} in a collective of a {job_device} job; NCCL refuses it: move it to the mesh's device")


def _release(model: ParallelModel | None) -> None:
    """Drop the gradient hooks of a rank's model: a parameter's hook holds its bucket sync, which
    holds the parameter, a cycle through autograd that the garbage collector does not break, so
    each rank's fake model (and its fake mode) would stay alive to the end of the dry run."""
    for sync in (getattr(model, "grad_buckets", None), getattr(model, "expert_buckets", None)):
        if sync is not None:
            sync.remove_hooks()


def _unregister_groups(program: RankProgram) -> None:
    unregister_group(program.tp_group)
    if program.cp_plan is not None:
        unregister_group(program.cp_plan.group)


# ---------------------------------------------------------------------------------------------
# The recorded calls against the communication check's

# recorded op (torch.distributed's) -> the check's op (CommCall.op); an all-reduce's takes its reduction
_CHECK_OP = {"all_reduce": "all_reduce({reduce})", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter(sum)",
             "all_to_all": "all_to_all", "send": "send", "recv": "recv"}
_UNMODELLED = {
    "broadcast": "a broadcast (parameters or state from one rank: start-up and checkpoint loading, not a step's)",
    "barrier": "a barrier (the runtime's synchronisation points; it moves no tensor)",
    "all_gather_object": "an object all-gather (host-side bookkeeping: fault identities, metrics, checkpoint errors)",
    "broadcast_object": "an object broadcast (host-side bookkeeping: plan and checkpoint metadata)",
}
"""Recorded calls the communication check does not model, and why: reported as notes, not mismatches."""


def as_check_calls(calls: Sequence[Collective], *, rank: int, cp_group: tuple[int, ...] = ()
                   ) -> tuple[list[tuple[int, tuple]], list[tuple[int, tuple]], list[tuple[int, Collective]]]:
    """``calls`` (one rank's, recorded) in the communication check's vocabulary (the one place the
    two are mapped): ``(collectives, messages, unmodelled)``, each item ``(index in calls, what)``.
    A collective is ``(group, op, numel, dtype)`` as :class:`~passes.checks.communication_check.CommCall`
    has them; a send or receive is ``(group, op, numel, dtype)`` with group ``(sender, receiver)``;
    a context-parallel ring shift (one batch on the cp group: receive from the previous rank, send
    to the next) is one ``ring_shift`` collective of the cp group, of the sent tensor's size."""
    collectives: list[tuple[int, tuple]] = []
    messages: list[tuple[int, tuple]] = []
    unmodelled: list[tuple[int, Collective]] = []
    batches: dict[int, list[tuple[int, Collective]]] = {}
    for k, c in enumerate(calls):
        if c.op in ("send", "recv"):
            batches.setdefault(c.batch, []).append((k, c))
    for k, c in enumerate(calls):
        dtype = TORCH_DTYPE_OF.get(c.dtype, c.dtype)
        if c.op in ("send", "recv"):
            batch = batches[c.batch]
            ring = cp_group and c.group == cp_group and len(batch) == 2 and {x.op for _, x in batch} == {"send", "recv"}
            if ring:
                if c.op == "send":
                    collectives.append((k, (cp_group, "ring_shift", c.numel, dtype)))
                continue
            group = (rank, c.peer) if c.op == "send" else (c.peer, rank)
            messages.append((k, (group, c.op, c.numel, dtype)))
        elif c.op in _CHECK_OP:
            collectives.append((k, (c.group, _CHECK_OP[c.op].format(reduce=c.reduce or "sum"), c.numel, dtype)))
        else:
            unmodelled.append((k, c))
    return collectives, messages, unmodelled


TORCH_DTYPE_OF = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                      torch.int32, torch.int8, torch.uint8, torch.bool)}


def _what(item: tuple | None, label: str = "") -> str:
    if item is None:
        return "nothing (its calls end here)"
    group, op, numel, dtype = item
    return (f"{op} of {numel} {str(dtype).replace('torch.', '')} on {_ranks_text(group)}"
            + (f" ({label})" if label else ""))


def compare_static(run: RankRun, program: RankProgram) -> None:
    """Set ``run.static`` (and ``static_notes``, ``static_calls``): each training step's recorded
    calls against :func:`passes.checks.communication_check.rank_calls` of ``program`` (what
    ``check_before_launch`` matches across ranks). Collectives are compared in issue order (all
    groups together: NCCL needs one order), messages in order per (sender, receiver) pair (a
    step's batch posts its receives first; per pair the order is kept). The first difference of
    each is named: the rank, the call's index in the rank's log and in the step, and both sides."""
    c = program.config
    predicted = rank_calls(program).calls
    pred_coll = [(x.group, x.op, x.numel, x.dtype) for x in predicted if not x.is_p2p]
    pred_labels = [x.label for x in predicted if not x.is_p2p]
    pred_msgs: dict[tuple, list[tuple[tuple, str]]] = {}
    for x in predicted:
        if x.is_p2p:
            pred_msgs.setdefault(x.group, []).append(((x.group, x.op, x.numel, x.dtype), x.label))
    pp_index, dp_index, tp_index = mesh_coords(program.rank, dp=c.dp_cp, tp=c.tp, first=program.first)
    replica = dp_index - dp_index % c.cp
    cp_group = tuple(global_rank(pp_index, replica + j, tp_index, dp=c.dp_cp, tp=c.tp, first=program.first)
                     for j in range(c.cp)) if c.cp > 1 else ()
    built = run.step_starts[0] if run.step_starts else len(run.collectives)
    if built:
        ops = sorted({x.op for x in run.collectives[:built]})
        run.static_notes.append(f"{built} calls while the mesh and the model were built ({', '.join(ops)}): "
                                f"start-up, not a training step's; the check models a step")
    bounds = [*run.step_starts, len(run.collectives)]
    for step, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        coll, msgs, other = as_check_calls(run.collectives[lo:hi], rank=program.rank, cp_group=cp_group)
        run.static_calls += len(coll) + len(msgs)
        for k, x in other:
            run.static_notes.append(f"step {step} call {lo + k}: {x.text()}: {_UNMODELLED.get(x.op, 'not modelled')}; "
                                    f"the communication check does not model it")
        for j in range(max(len(coll), len(pred_coll))):
            got = coll[j][1] if j < len(coll) else None
            want = pred_coll[j] if j < len(pred_coll) else None
            if got != want:
                where = f"call {lo + coll[j][0]} of its log" if j < len(coll) else "after its last call"
                run.static.append(f"rank {program.rank} step {step}: collective {j} ({where}) runs "
                                  f"{_what(got)}; the communication check predicts "
                                  f"{_what(want, pred_labels[j] if want is not None else '')} "
                                  f"({len(coll)} run, {len(pred_coll)} predicted)")
                break
        by_pair: dict[tuple, list[tuple[int, tuple]]] = {}
        for k, x in msgs:
            by_pair.setdefault(x[0], []).append((k, x))
        for pair in sorted(set(by_pair) | set(pred_msgs)):
            got_list, want_list = by_pair.get(pair, []), pred_msgs.get(pair, [])
            for j in range(max(len(got_list), len(want_list))):
                got = got_list[j][1] if j < len(got_list) else None
                want, label = want_list[j] if j < len(want_list) else (None, "")
                if got != want:
                    where = f"call {lo + got_list[j][0]} of its log" if j < len(got_list) else "after its last one"
                    run.static.append(f"rank {program.rank} step {step}: message {j} {pair[0]} -> {pair[1]} ({where}) "
                                      f"runs {_what(got)}; the communication check predicts {_what(want, label)} "
                                      f"({len(got_list)} run, {len(want_list)} predicted)")
                    break


# ---------------------------------------------------------------------------------------------
# Across ranks

def check_sequences(runs: Sequence[RankRun]) -> list[str]:
    """Disagreements between the recorded calls of the representatives that share a group, and
    messages without their match. A group is checked when every one of its ranks is a rank that
    ran or one it stands for (a data-parallel replica runs its representative's calls); two or
    more representatives in it must issue the same sequence (op, shape, dtype) on it."""
    done = {r.rank: r for r in runs if r.ok}
    covered = {m for r in done.values() for m in r.stands_for}
    problems: list[str] = []
    groups: set[tuple[str, tuple[int, ...]]] = set()
    # messages match in order within one communicator: two groups over the same ranks (the
    # zero-bubble V schedule's forward and backward streams) are two orders, as on NCCL
    sends: dict[tuple[int, int, tuple[int, ...], str], list[tuple[int, Collective]]] = {}
    recvs: dict[tuple[int, int, tuple[int, ...], str], list[tuple[int, Collective]]] = {}
    for rank, run in done.items():
        for k, call in enumerate(run.collectives):
            if call.op == "send":
                sends.setdefault((rank, call.peer, call.group, call.group_id), []).append((k, call))
            elif call.op == "recv":
                recvs.setdefault((call.peer, rank, call.group, call.group_id), []).append((k, call))
            else:
                groups.add((call.group_id, call.group))
    for key in sorted(groups, key=lambda k: (k[1], k[0])):
        ranks = key[1]
        reps = [r for r in ranks if r in done]
        if len(reps) < 2 or not set(ranks) <= covered:
            continue
        members = {r: [c for c in done[r].collectives if (c.group_id, c.group) == key and c.peer is None]
                   for r in reps}
        problems += _compare(ranks, reps, members, {r: done[r].collectives for r in reps})
    for pair in sorted(set(sends) | set(recvs), key=lambda k: (k[0], k[1], k[3])):
        src, dst, group, _ = pair
        if src not in done or dst not in done:
            continue
        sent, got = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(sent), len(got))):
            a = sent[k][1].key()[1:] if k < len(sent) else None
            b = got[k][1].key()[1:] if k < len(got) else None
            if a is not None and b is None:  # NCCL: the send waits forever
                problems.append(f"rank {src} call {sent[k][0]}: send {_msg(a)} to rank {dst} on {_ranks_text(group)} "
                                f"has no matching receive on rank {dst} by the end of the step (message {k}; "
                                f"{len(sent)} sent, {len(got)} received)")
                break
            if a is None and b is not None:
                problems.append(f"rank {dst} call {got[k][0]}: receive {_msg(b)} from rank {src} on "
                                f"{_ranks_text(group)} has no matching send on rank {src} by the end of the step "
                                f"(message {k}; {len(sent)} sent, {len(got)} received)")
                break
            if a != b:
                problems.append(f"messages rank {src} -> rank {dst} on {_ranks_text(group)}: message {k} is "
                                f"{_msg(a)} as sent and {_msg(b)} as received ({len(sent)} sent, {len(got)} received)")
                break
    return problems


def _msg(meta) -> str:
    return "missing" if meta is None else f"{list(meta[0])} {meta[1].replace('torch.', '')}"


def _compare(ranks: tuple[int, ...], reps: list[int], members: dict[int, list[Collective]],
             logs: dict[int, list[Collective]]) -> list[str]:
    def done_index(rank: int, call: Collective) -> int:
        return next(i for i, x in enumerate(logs[rank]) if x is call)

    ref_rank = reps[0]
    ref = members[ref_rank]
    for rank in reps[1:]:
        mine = members[rank]
        for k in range(max(len(ref), len(mine))):
            a = ref[k] if k < len(ref) else None
            b = mine[k] if k < len(mine) else None
            if a is not None and b is not None and a.op == b.op and a.key() != b.key():
                # the same collective with another size or dtype: NCCL reads past a buffer or mixes types
                return [f"group {_ranks_text(ranks)}: call {k} ({a.op}) differs in size or dtype, which NCCL "
                        f"refuses: rank {ref_rank} {a.text()} (call {done_index(ref_rank, a)} of its log), rank {rank} "
                        f"{b.text()} (call {done_index(rank, b)} of its log)"]
            if a is None or b is None or a.key() != b.key():
                return [f"group {_ranks_text(ranks)}: call {k} differs: rank {ref_rank} "
                        f"{a.text() if a else 'issues nothing (its calls end here)'}, rank {rank} "
                        f"{b.text() if b else 'issues nothing (its calls end here)'} "
                        f"({len(ref)} vs {len(mine)} calls on the group)"]
    return []


# ---------------------------------------------------------------------------------------------
# The front door

def dry_run(model: str | ModelSpec, cluster: Cluster | str, *, training: Training, fix: dict | str | None = None,
            plan: Plan | None = None, nodes: int | None = None, steps: int = 1,
            ranks: Sequence[int] | None = None, job_device: str | None = None,
            edit: Callable[[int, ParallelModel], None] | None = None) -> DryRunReport:
    """Plan ``model`` on ``cluster`` (or take ``plan``) and run every distinct rank program of the
    job for ``steps`` training steps in this process, on fake tensors and a fake process group of
    the job's world size (see the module docstring). ``training``, ``fix``, ``plan``, ``nodes``:
    as :func:`partitioner.api.planning.plan` and :func:`partitioner.api.auto.auto_parallelize` take
    them. ``ranks``: run only these representatives (default: all). ``edit(rank, model)``: called
    on each rank's model before its first step. ``job_device``: the device type every collective's
    tensors must be on (default: the fake tensors', ``cpu``; ``cuda`` checks as a CUDA job would,
    so every call of this CPU run is refused). Never raises for a rank's failure: the report
    names it (:attr:`DryRunReport.ok`)."""
    start = time.perf_counter()
    if not isinstance(training, Training):
        raise ConfigError(f"dry_run: training is {type(training).__name__}, not a Training; pass "
                          f"training=Training(global_batch=8, ...) (from partitioner import Training)")
    if plan is not None and fix is not None:
        raise ConfigError("dry_run: fix and plan both given; pass plan=... alone, or fix=... alone to search the rest")
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster, nodes=nodes)
    elif nodes is not None:
        cluster = cluster.with_nodes(nodes)
    pinned = check_fix(fix, where="dry_run: fix")
    if pinned.get("compile") or (plan is not None and plan.config.compile):
        # fake tensors run the programs' ops one by one; a compiled program would run other kernels
        raise ConfigError("dry_run: a plan with compile=true cannot be dry-run yet (the dry run executes the "
                          "uncompiled programs on fake tensors); dry-run it with compile=false: the same "
                          "collectives and the uncompiled memory")
    if plan is None:
        plan = make_plan(model, cluster, training=training, fix=pinned)
    elif plan.global_batch != training.global_batch:
        raise ConfigError(f"dry_run: the plan is for global batch {plan.global_batch}, not {training.global_batch}; "
                          f"pass Training(global_batch={plan.global_batch})")
    config = plan.config
    spec = as_spec(model, device="meta")
    spec = (meta_copy(spec) if isinstance(model, ModelSpec) else spec).cast(TORCH_DTYPES[config.dtype])
    graph = analysed_training_step(spec, device="cpu", optimizer=training.optimizer_name(), dtype=config.dtype)
    lowering: Lowering = lower_plan(graph, config, cluster=cluster, ctx=PassContext(
        optimizer=training.optimizer_name(), dtype=config.dtype))
    reps = representatives(config)
    runs = []
    chosen = {r: m for r, m in reps.items() if ranks is None or r in ranks}
    peaks = dict(enumerate(plan.predicted.rank_peak_memory_bytes))
    if len(peaks) != config.world_size:  # the plan has no replayed peaks (analytic): replay the programs run
        peaks = {r: m.peak_bytes for r, m in replay_ranks(graph, lowering, chosen,
                                                         optimizer=training.optimizer_name()).items()}
    bar = terminal_bar(len(chosen), unit="rank")  # a large model's rank takes minutes here
    for rank, members in chosen.items():
        bar.set_description(f"dry run: rank {rank} (stands for {len(members)})")
        program = lowering.rank_program(rank)
        run = run_rank(program, spec, stands_for=members, training=training, steps=steps, job_device=job_device,
                       edit=None if edit is None else functools.partial(edit, rank))
        if run.ok:
            compare_static(run, program)
        run.predicted_bytes = float(peaks[rank])
        run.device_bytes = memory_budget(cluster, config.communicators).usable_bytes
        difference = run.memory_difference
        if difference is None or abs(difference) <= MEMORY_TOLERANCE:
            run.peak_tensors = []
        runs.append(run)
        bar.update()
    bar.close()
    report = DryRunReport(plan=plan, world_size=config.world_size, ranks=runs)
    report.mismatches = check_sequences(runs)
    report.seconds = time.perf_counter() - start
    return report
