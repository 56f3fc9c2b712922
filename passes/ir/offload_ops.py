"""Activation offload ops: ``offload_begin``/``offload_end`` bracket one node so the tensors it
saves for backward wait in host memory between forward and backward.

Graph pattern (what :mod:`passes.rewrites.apply_offload` inserts around a node ``N`` that saves
offloaded activations)::

    partitioner.offload_begin([%x_view], [%w, %b], True, 7)   # offload, keep, internals, region
    %n = aten.linear.default(%x_view, %w, %b)                 # the saver, unchanged
    partitioner.offload_end(7)

``offload_begin`` pushes ``torch.autograd.graph`` saved-tensor hooks (an :class:`OffloadRegion`);
``offload_end`` pops them, so exactly the tensors ``N`` saves go through
:meth:`OffloadRegion.pack`. For each saved tensor the hook decides by storage:

* on the storage of a tensor in ``offload``: moved to host;
* on the storage of a tensor in ``keep`` (parameters, buffers, activations not chosen): kept on
  the device, untouched;
* on a storage made inside ``N`` (a dropout mask, layer-norm statistics, ``N``'s own output):
  moved to host when ``internals`` is true, kept otherwise.

A moved storage is copied whole by a *host copy* (views of one storage share one copy), and in
backward the first :func:`unpack` of it reloads the storage and rebuilds each saved view with its
size, stride and offset, so backward reads the same bits: the rewrite is exact.

Here are the schemas, the mechanism and the fake kernels: a fake run (the memory analysis) moves
fake storages with :class:`CloneHost`. The real kernels, whose host copies are pinned memory and
side streams on CUDA and shared between savers, are :mod:`runtime.kernels.offload`.

Ordering: the two ops are side-effectful (kept by dead-code elimination) and rely on graph order:
a pass that reorders nodes must keep each ``begin``, saver, ``end`` triple adjacent;
:func:`check_offload_regions` verifies it.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes.ir.errors import PassError
from passes.ir.ops import _LIB, qualname

_LIB.define("offload_begin(Tensor[] offload, Tensor[] keep, bool internals, int region) -> ()")
_LIB.define("offload_end(int region) -> ()")

OFFLOAD_BEGIN = torch.ops.partitioner.offload_begin.default
OFFLOAD_END = torch.ops.partitioner.offload_end.default
fx.node.has_side_effect(OFFLOAD_BEGIN)
fx.node.has_side_effect(OFFLOAD_END)


class HostCopy(Protocol):
    """One device storage moved to host, shared by every saved view of it."""

    device: torch.device
    nbytes: int
    users: int  # packed views not yet unpacked

    def reload(self) -> torch.UntypedStorage:
        """The storage back on its device (copied once for all savers still to unpack)."""

    def release(self) -> None:
        """One saver unpacked: drop the device copy after the last one."""


HostCopyFactory = Callable[[torch.Tensor, StorageWeakRef, int], HostCopy]
"""``(saved tensor, its storage's weak ref, region) -> host copy`` of the tensor's whole storage."""


@dataclass(frozen=True)
class Packed:
    """A saved tensor moved to host: its storage's host copy and how to view it again."""

    host: HostCopy
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool


def bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor over the whole ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class CloneHost:
    """A host copy that is a clone in the same memory: what fake runs use (on fake tensors it
    allocates nothing real)."""

    def __init__(self, storage: torch.UntypedStorage, device: torch.device):
        self.device = device
        self.nbytes = storage.nbytes()
        self.users = 0
        self.host = bytes_view(storage, device).clone()
        self._reloaded: torch.UntypedStorage | None = None

    def reload(self) -> torch.UntypedStorage:
        if self._reloaded is None:
            self._reloaded = self.host.clone().untyped_storage()
        return self._reloaded

    def release(self) -> None:
        self.users = max(self.users - 1, 0)
        if self.users == 0:
            self._reloaded = None


def clone_host(t: torch.Tensor, ref: StorageWeakRef, region: int) -> CloneHost:
    return CloneHost(t.untyped_storage(), t.device)


class OffloadRegion:
    """The hooks of one bracketed node: which storages go to host, and how they are copied."""

    def __init__(self, offload: Sequence[torch.Tensor], keep: Sequence[torch.Tensor], internals: bool,
                 region: int, host_copy: HostCopyFactory):
        self.offload = {StorageWeakRef(t.untyped_storage()) for t in offload}
        self.keep = {StorageWeakRef(t.untyped_storage()) for t in keep}
        self.internals = internals
        self.region = region
        self.host_copy = host_copy
        self.kept = 0  # saved tensors left on the device (weights, activations not chosen)
        self.outer_pack: Callable[[torch.Tensor], Any] | None = None  # set by begin_region under watch_packs

    def pack(self, t: torch.Tensor):
        ref = StorageWeakRef(t.untyped_storage())
        watcher = _watcher()
        if ref in self.offload or (self.internals and ref not in self.keep):
            host = self.host_copy(t, ref, self.region)
            host.users += 1
            if watcher is not None:
                watcher(self.region, t)
            return Packed(host, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.requires_grad)
        self.kept += 1
        if watcher is not None and self.outer_pack is not None:
            self.outer_pack(t)  # an observation of saved tensors outside the region sees what stays
        return t


def unpack(packed):
    """The saved tensor back (reloaded to its device when it was moved)."""
    if not isinstance(packed, Packed):
        return packed
    storage = packed.host.reload()
    out = torch.empty(0, dtype=packed.dtype, device=packed.host.device).set_(
        storage, packed.offset, packed.size, packed.stride)
    packed.host.release()
    return out


_OPEN = threading.local()  # stack of open regions, one per thread: begin pushes hooks, end pops them


def open_regions() -> list[OffloadRegion]:
    """The regions open on this thread, innermost last."""
    if not hasattr(_OPEN, "stack"):
        _OPEN.stack = []
    return _OPEN.stack


_WATCH = threading.local()  # the watcher of watch_packs, one per thread


def _watcher() -> Callable[[int, torch.Tensor], None] | None:
    return getattr(_WATCH, "on_offload", None)


@contextlib.contextmanager
def watch_packs(on_offload: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """While open (on this thread), every region tells ``on_offload(region, tensor)`` each saved
    tensor it moves to the host, and hands each one it keeps on the device to the saved-tensor
    hooks that were innermost when the region began (region hooks replace outer ones, so without
    this an observation of saved tensors outside the region would not see them)."""
    previous = _watcher()
    _WATCH.on_offload = on_offload
    try:
        yield
    finally:
        _WATCH.on_offload = previous


def begin_region(region: OffloadRegion) -> None:
    """Push ``region``'s saved-tensor hooks (what an ``offload_begin`` kernel does)."""
    if _watcher() is not None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        region.outer_pack = top[0] if top is not None else None
    torch._C._autograd._push_saved_tensors_default_hooks(region.pack, unpack)
    open_regions().append(region)


def end_region(region: int) -> OffloadRegion:
    """Pop the hooks of region number ``region`` (what an ``offload_end`` kernel does)."""
    stack = open_regions()
    if not stack or stack[-1].region != region:
        raise PassError(f"offload_end({region}) without a matching offload_begin (open regions: "
                        f"{[r.region for r in stack]}); a pass reordered the offload ops: keep begin, saver, end "
                        f"adjacent")
    torch._C._autograd._pop_saved_tensors_default_hooks()
    return stack.pop()


@torch.library.register_fake(qualname("offload_begin"), lib=_LIB)
def _(offload, keep, internals, region):
    begin_region(OffloadRegion(offload, keep, internals, region, clone_host))


@torch.library.register_fake(qualname("offload_end"), lib=_LIB)
def _(region):
    end_region(region)


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
