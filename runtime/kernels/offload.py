"""Real kernels of the activation offload ops (:mod:`passes.ir.offload_ops`: the schemas, the
saved-tensor hook mechanism and the fake kernels).

The kernels open and close an :class:`passes.ir.offload_ops.OffloadRegion` whose host copies
are :class:`_HostStorage`:

Host memory
    On CUDA the host copy is pinned memory written with ``non_blocking`` copies on a side
    stream (the device storage is kept alive for that stream with ``record_stream``), and the
    reload is issued on the side stream that the compute stream then waits for. On CPU the host
    *is* device memory; the copy is still made (a clone into a separate storage) so the same
    path runs and is tested, and the original storage is released exactly as on a GPU.
Sharing
    A storage saved by several savers (views of one storage) is copied once: live host copies
    are found by the storage's weak reference. The reloaded device copy is shared by all savers
    of the storage and dropped after the last of them unpacked.
Prefetch
    Backward unpacks in reverse forward order, so when it first unpacks a host copy it next
    needs the copy made just before it in the same forward (a lower or equal region). On CUDA
    that reload is started then, on the side stream, and the compute stream waits for it only
    when it is unpacked: each reload is hidden behind the backward of the savers after it (the
    first one of a backward, with nothing after it, is not). On CPU nothing can overlap (the
    copy runs on the rank's thread, into the same memory), so there is no prefetch: the reload
    happens at the unpack (``PREFETCH_ON_CPU`` turns it on, for tests of the order only).

Counters: :func:`offload_counters` (bytes and storages moved each way, per region); reset with
:func:`reset_offload_counters`.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from passes.ir.offload_ops import OffloadRegion, Packed, begin_region, bytes_view, end_region
from passes.ir.ops import qualname

__all__ = ["OffloadCounters", "offload_counters", "reset_offload_counters"]


PREFETCH_ON_CPU = False
"""Prefetch reloads on a CPU device too (no overlap there; tests use it to check the order)."""

SOURCES_KEPT = 65536
"""Most recent offloaded storages whose weak references the counters keep."""


@dataclass
class OffloadCounters:
    """What the hooks moved since the last reset (bytes are whole storages)."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    offloaded_storages: int = 0
    reloaded_storages: int = 0
    prefetched_storages: int = 0  # reloads started ahead of their unpack
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

_HOST_WATCHERS: list = []
"""Callables told each host copy as it is made (:func:`watch_host_copies`)."""


@contextlib.contextmanager
def watch_host_copies(on_copy) -> Iterator[None]:
    """While open, ``on_copy(tensor)`` is told every host copy a saved tensor gets, right after it
    is made: a memory count that cannot tell host from device by the tensor's device (on CPU the
    two are one memory) learns which storages are host memory from it."""
    _HOST_WATCHERS.append(on_copy)
    try:
        yield
    finally:
        _HOST_WATCHERS.remove(on_copy)


class _HostStorage:
    """One device storage moved to host; shared by every saved view of it."""

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, region: int):
        self.device = device
        self.nbytes = storage.nbytes()
        self.region = region
        self.users = 0  # packed views not yet unpacked
        self._reloaded: torch.UntypedStorage | None = None
        self._event = None
        self._ready = None  # CUDA: the reload's event, waited for by the unpack
        self.prev: weakref.ref | None = None  # the host copy made just before this one (same forward)
        self._chained = False  # whether an unpack of this copy has started the previous one's reload
        src = bytes_view(storage, device)
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
        for watcher in _HOST_WATCHERS:
            watcher(self.host)
        _COUNTERS.offloaded_bytes += self.nbytes
        _COUNTERS.offloaded_storages += 1
        _COUNTERS.by_region[region] = _COUNTERS.by_region.get(region, 0) + self.nbytes
        _COUNTERS.sources.append(StorageWeakRef(storage))

    def _start_reload(self) -> None:
        """Copy the host copy back to the device (CUDA: issued on the side stream, not waited)."""
        if self.device.type == "cuda":
            stream = _side_stream(self.device)
            with torch.cuda.stream(stream):
                stream.wait_event(self._event)
                back = self.host.to(self.device, non_blocking=True)
            back.record_stream(torch.cuda.current_stream(self.device))  # freed only after its users
            self._ready = torch.cuda.Event()
            self._ready.record(stream)
        else:
            back = self.host.clone()
        self._reloaded = back.untyped_storage()
        _COUNTERS.reloaded_bytes += self.nbytes
        _COUNTERS.reloaded_storages += 1

    def reload(self) -> torch.UntypedStorage:
        """The storage back on its device (copied once for all savers still to unpack); starts
        the reload of the host copy backward needs next (see Prefetch in the module docstring)."""
        if self._reloaded is None:
            self._start_reload()
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
        if not self._chained and (self.device.type == "cuda" or PREFETCH_ON_CPU):
            self._chained = True  # its first unpack (prefetched or not) starts the next reload
            before = self.prev() if self.prev is not None else None
            if before is not None and before._reloaded is None and before.users > 0:
                before._start_reload()
                _COUNTERS.prefetched_storages += 1
        return self._reloaded

    def release(self) -> None:
        """One saver unpacked: drop the device copy after the last one."""
        self.users = max(self.users - 1, 0)
        if self.users == 0:
            self._reloaded = None


_STREAMS: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


# Host copies of device storages still alive, for sharing one copy among the savers of a storage.
# Values are weak: a host copy lives as long as some packed tensor refers to it.
_LIVE: dict[StorageWeakRef, "weakref.ref[_HostStorage]"] = {}


def _host_copy(t: torch.Tensor, ref: StorageWeakRef, region: int) -> _HostStorage:
    """The live host copy of ``t``'s storage, made now if there is none."""
    with _LOCK:
        for dead in [k for k, v in _LIVE.items() if v() is None or k.expired()]:
            del _LIVE[dead]
        found = _LIVE.get(ref)
        host = found() if found is not None else None
        if host is None:
            host = _HostStorage(t.untyped_storage(), t.device, region)
            _LIVE[ref] = weakref.ref(host)
            last = _LAST[0]() if _LAST[0] is not None else None
            if last is not None and last.region <= region:  # the same forward, in order
                host.prev = weakref.ref(last)
            _LAST[0] = weakref.ref(host)
        return host


_LAST: list = [None]  # weak reference to the host copy made last (a one-slot box)


class _CountingRegion(OffloadRegion):
    def pack(self, t: torch.Tensor):
        packed = super().pack(t)
        if not isinstance(packed, Packed):
            _COUNTERS.kept_tensors += 1
        return packed


@torch.library.register_kernel(qualname("offload_begin"), None)
def _offload_begin(offload: list[torch.Tensor], keep: list[torch.Tensor], internals: bool, region: int) -> None:
    begin_region(_CountingRegion(offload, keep, internals, region, _host_copy))


@torch.library.register_kernel(qualname("offload_end"), None)
def _offload_end(region: int) -> None:
    end_region(region)
