"""Activation offload at run time: two ``torch.library`` ops that bracket one node of a graph so
the activations it saves for backward wait in host memory between forward and backward.

Graph pattern (what :mod:`passes.apply_offload` inserts around a node ``N`` that saves
offloaded activations)::

    partitioner.offload_begin([%x_view], [%w, %b], True, 7)   # offload, keep, internals, region
    %n = aten.linear.default(%x_view, %w, %b)                 # the saver, unchanged
    partitioner.offload_end(7)

``offload_begin`` pushes ``torch.autograd.graph`` saved-tensor hooks; ``offload_end`` pops
them, so exactly the tensors ``N`` saves go through :func:`_pack`. For each saved tensor the
hook decides by storage:

* on the storage of a tensor in ``offload``: moved to host;
* on the storage of a tensor in ``keep`` (parameters, buffers, activations not chosen): kept
  on the device, untouched;
* on a storage made inside ``N`` (a dropout mask, layer-norm statistics, ``N``'s own output):
  moved to host when ``internals`` is true, kept otherwise.

A moved storage is copied whole (views of one storage share one host copy, whichever saver
saved them), the device storage is released by autograd, and in backward the first
:func:`_unpack` copies it back and rebuilds each saved view with its size, stride and offset,
so backward reads the same bits: the rewrite is exact. The reloaded device copy is shared by
all savers of the storage and dropped after the last of them unpacked.

Host memory
    On CUDA the host copy is pinned memory written with ``non_blocking`` copies on a side
    stream (the device storage is kept alive for that stream with ``record_stream``), and the
    reload is issued on the side stream that the compute stream then waits for. On CPU the host
    *is* device memory; the copy is still made (a clone into a separate storage) so the same
    path runs and is tested, and the original storage is released exactly as on a GPU.

Counters: :func:`offload_counters` (bytes and storages moved each way, per region); reset with
:func:`reset_offload_counters`. Ordering: the two ops are side-effectful (kept by dead-code
elimination) and rely on graph order: a pass that reorders nodes must keep each ``begin``,
saver, ``end`` triple adjacent; :func:`check_offload_regions` verifies it.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef

from partitioner.errors import PassError

__all__ = ["OffloadCounters", "offload_counters", "reset_offload_counters", "check_offload_regions",
           "OFFLOAD_BEGIN", "OFFLOAD_END"]


SOURCES_KEPT = 65536
"""Most recent offloaded storages whose weak references the counters keep."""


@dataclass
class OffloadCounters:
    """What the hooks moved since the last reset (bytes are whole storages)."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    offloaded_storages: int = 0
    reloaded_storages: int = 0
    kept_tensors: int = 0  # saved tensors inside a region left on the device (weights, not chosen)
    by_region: dict[int, int] = field(default_factory=dict)  # region -> bytes offloaded
    # Weak references to the last device storages that were offloaded: expired once autograd and
    # the graph dropped them, which is what shows the bytes really left device memory. Bounded,
    # so a long training run does not collect one per offloaded tensor forever.
    sources: deque[StorageWeakRef] = field(default_factory=lambda: deque(maxlen=SOURCES_KEPT), repr=False)


_COUNTERS = OffloadCounters()
_LOCK = threading.Lock()


def offload_counters() -> OffloadCounters:
    """The live counters (a mutable object; copy it to keep a snapshot)."""
    return _COUNTERS


def reset_offload_counters() -> None:
    """Zero every counter."""
    global _COUNTERS
    _COUNTERS = OffloadCounters()


# ---------------------------------------------------------------------------------------------
# Host copies of storages.

class _HostStorage:
    """One device storage moved to host; shared by every saved view of it."""

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, region: int, *, count: bool = True):
        self.device = device
        self.nbytes = storage.nbytes()
        self.region = region
        self.users = 0  # packed views not yet unpacked
        self._reloaded: torch.UntypedStorage | None = None
        self._event = None
        src = _bytes_view(storage, device)
        if device.type == "cuda":
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            stream = _side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the producer's kernel is done
            with torch.cuda.stream(stream):
                self.host.copy_(src, non_blocking=True)
            src.record_stream(stream)  # keep the device storage until the copy has read it
            self._event = torch.cuda.Event()
            self._event.record(stream)
        else:
            # CPU: host and "device" are one memory; clone anyway so the path is exercised.
            self.host = src.clone()
        if count:
            _COUNTERS.offloaded_bytes += self.nbytes
            _COUNTERS.offloaded_storages += 1
            _COUNTERS.by_region[region] = _COUNTERS.by_region.get(region, 0) + self.nbytes
            _COUNTERS.sources.append(StorageWeakRef(storage))

    def reload(self) -> torch.UntypedStorage:
        """The storage back on its device (copied once for all savers still to unpack)."""
        if self._reloaded is None:
            if self.device.type == "cuda":
                stream = _side_stream(self.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(self._event)
                    back = self.host.to(self.device, non_blocking=True)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                back.record_stream(torch.cuda.current_stream(self.device))
            else:
                back = self.host.clone()
            self._reloaded = back.untyped_storage()
            _COUNTERS.reloaded_bytes += self.nbytes
            _COUNTERS.reloaded_storages += 1
        return self._reloaded

    def release(self) -> None:
        """One saver unpacked: drop the device copy after the last one."""
        self.users = max(self.users - 1, 0)
        if self.users == 0:
            self._reloaded = None


@dataclass(frozen=True)
class _Packed:
    """A saved tensor moved to host: its storage's host copy and how to view it again."""

    host: _HostStorage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


_STREAMS: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


# Host copies of device storages still alive, for sharing one copy among the savers of a storage.
# Values are weak: a host copy lives as long as some packed tensor refers to it.
_LIVE: dict[StorageWeakRef, "weakref.ref[_HostStorage]"] = {}


class _Region:
    """The hooks of one bracketed node: which storages go to host."""

    def __init__(self, offload: Sequence[torch.Tensor], keep: Sequence[torch.Tensor], internals: bool,
                 region: int):
        self.offload = {StorageWeakRef(t.untyped_storage()) for t in offload}
        self.keep = {StorageWeakRef(t.untyped_storage()) for t in keep}
        self.internals = internals
        self.region = region

    def pack(self, t: torch.Tensor):
        ref = StorageWeakRef(t.untyped_storage())
        if ref in self.offload or (self.internals and ref not in self.keep):
            host = self._host_copy(t, ref)
            host.users += 1
            return _Packed(host, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset(),
                           t.requires_grad)
        _COUNTERS.kept_tensors += 1
        return t

    def _host_copy(self, t: torch.Tensor, ref: StorageWeakRef) -> _HostStorage:
        if is_fake(t):
            # a fake run (the memory analysis): not shared with real storages, not counted, and
            # not registered (fake storages outlive the run in caches, and a registry full of
            # them slowed every later real pack)
            return _HostStorage(t.untyped_storage(), t.device, self.region, count=False)
        with _LOCK:
            for dead in [k for k, v in _LIVE.items() if v() is None or k.expired()]:
                del _LIVE[dead]
            found = _LIVE.get(ref)
            host = found() if found is not None else None
            if host is None:
                host = _HostStorage(t.untyped_storage(), t.device, self.region)
                _LIVE[ref] = weakref.ref(host)
            return host


def _unpack(packed):
    if not isinstance(packed, _Packed):
        return packed
    storage = packed.host.reload()
    out = torch.empty(0, dtype=packed.dtype, device=packed.host.device).set_(
        storage, packed.offset, packed.size, packed.stride)
    packed.host.release()
    return out


# Stack of open regions (one per thread): begin pushes hooks, end pops them.
_OPEN = threading.local()


def _open_regions() -> list[int]:
    if not hasattr(_OPEN, "stack"):
        _OPEN.stack = []
    return _OPEN.stack


def _begin(offload: Sequence[torch.Tensor], keep: Sequence[torch.Tensor], internals: bool, region: int) -> None:
    reg = _Region(offload, keep, internals, region)
    torch._C._autograd._push_saved_tensors_default_hooks(reg.pack, _unpack)
    _open_regions().append(region)


def _end(region: int) -> None:
    stack = _open_regions()
    if not stack or stack[-1] != region:
        raise PassError(f"offload_end({region}) without a matching offload_begin (open regions: {stack}); "
                        f"a pass reordered the offload ops: keep begin, saver, end adjacent")
    stack.pop()
    torch._C._autograd._pop_saved_tensors_default_hooks()


# ---------------------------------------------------------------------------------------------
# The ops. ``mutates_args=()`` and no output: they act through autograd's hook stack, so they
# are registered as side-effectful for fx's dead-code elimination.

@torch.library.custom_op("partitioner::offload_begin", mutates_args=())
def offload_begin(offload: list[torch.Tensor], keep: list[torch.Tensor], internals: bool, region: int) -> None:
    """Start an offload region: tensors the next node saves on ``offload``'s storages (and,
    with ``internals``, on storages it makes itself) are moved to host until backward."""
    _begin(offload, keep, internals, region)


@offload_begin.register_fake
def _(offload, keep, internals, region):
    _begin(offload, keep, internals, region)


@torch.library.custom_op("partitioner::offload_end", mutates_args=())
def offload_end(region: int) -> None:
    """End the offload region ``region`` opened by ``offload_begin``."""
    _end(region)


@offload_end.register_fake
def _(region):
    _end(region)


OFFLOAD_BEGIN = torch.ops.partitioner.offload_begin.default
OFFLOAD_END = torch.ops.partitioner.offload_end.default
fx.node.has_side_effect(OFFLOAD_BEGIN)
fx.node.has_side_effect(OFFLOAD_END)


def check_offload_regions(gm: fx.GraphModule) -> int:
    """Check that every ``offload_begin`` is followed by exactly one node and then its
    ``offload_end``; returns the number of regions. Raises :class:`PassError` otherwise."""
    nodes = list(gm.graph.nodes)
    count = 0
    for i, node in enumerate(nodes):
        if node.target is OFFLOAD_BEGIN:
            region = node.args[3]
            ok = (i + 2 < len(nodes) and nodes[i + 2].target is OFFLOAD_END and nodes[i + 2].args[0] == region
                  and nodes[i + 1].target not in (OFFLOAD_BEGIN, OFFLOAD_END))
            if not ok:
                raise PassError(f"offload region {region} (node {node.name!r}) is not 'begin, saver, end' in graph "
                                f"order; a pass moved nodes after apply_offload: run apply_offload last")
            count += 1
        elif node.target is OFFLOAD_END and (i < 2 or nodes[i - 2].target is not OFFLOAD_BEGIN):
            raise PassError(f"offload_end {node.name!r} has no offload_begin two nodes before it")
    return count
