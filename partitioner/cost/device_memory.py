"""What a plan's tensors may use of a device: its memory less what the process holds besides them.

The planner's peaks (the search's per-layer model, the replay of the rank programs) count the
plan's tensors as the caching allocator holds them. A GPU process holds more, and a plan that
fills the datasheet's memory runs out of it at its first step:

* **reserved** (``Device.reserved_bytes``): the CUDA context with the kernel images it loads,
  and cuBLAS' workspaces. We take 512 MiB for the context, an estimate for a PyTorch process with
  lazy module loading (CUDA >= 11.7, PyTorch's default) that ``scripts/gpu_calibrate.py`` measures
  where a GPU is lent (the memory in use outside the allocator after a matmul and a collective),
  plus 32 MiB of cuBLAS workspace: PyTorch's default on Hopper (``CUBLAS_WORKSPACE_CONFIG``
  ``:4096:8``, ``aten/src/ATen/cuda/CublasHandlePool.cpp``; 8.125 MiB on earlier GPUs, plus 1 MiB
  for cuBLASLt), allocated through the allocator but outside the plan's tensors.
* **communicators** (``Device.communicator_bytes`` each, ``ParallelConfig.communicators`` of
  them): NCCL's buffers. Each connection to a peer holds a buffer per protocol at NCCL's
  defaults (``NCCL_BUFFSIZE`` 4 MiB for Simple, about 4.7 MiB for LL128 and 0.5 MiB for LL), per
  channel; 16 channels of ring connections alone are 147 MiB, tree connections come on top. We
  take 256 MiB per communicator, an estimate the GPU check also measures.
* **slack** (``Device.allocator_slack``): blocks the caching allocator keeps split or cached for
  sizes that come back, and segments it cannot release, beyond the peak of live tensors: the
  usable bytes are divided by ``1 + slack``. We take 5%, a margin chosen rather than measured
  (the dry run's replay rounds every block as the allocator does; what fragmentation adds depends
  on the order of allocations, and ``expandable_segments`` removes most of it).

CPU ranks on gloo hold none of these in the budget they plan with (their host memory is the
budget; the fidelity bench measures their peaks within 1% of the replay's), so every default
is 0 there. A cluster file sets each field to override the default (docs/cluster_schema.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from partitioner.cost.cluster import Cluster, backend_default

MiB = 2**20

GPU_RESERVED_BYTES = 512 * MiB + 32 * MiB
"""The CUDA context (an estimate, see the module docstring) and cuBLAS' workspace on Hopper."""
GPU_COMMUNICATOR_BYTES = 256 * MiB
"""One NCCL communicator's buffers (an estimate from NCCL's default buffer sizes)."""
GPU_ALLOCATOR_SLACK = 0.05
"""The caching allocator's holding beyond the live peak, as a share of it (a chosen margin)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBudget:
    """One device's memory as a plan may use it, bytes."""

    device_bytes: float
    """What the device has (``Device.memory_bytes``)."""
    reserved_bytes: float
    """Held by the process outside the plan's tensors (CUDA context, cuBLAS workspaces)."""
    communicator_bytes: float
    """NCCL's buffers, over every communicator of the rank."""
    communicators: int
    """Process groups of more than one rank the rank joins."""
    slack: float
    """The allocator's share beyond the live peak (``usable_bytes`` = what is left ÷ (1 + slack))."""

    @property
    def usable_bytes(self) -> float:
        """Bytes the plan's peak of live tensors may reach."""
        return max(0.0, self.device_bytes - self.reserved_bytes - self.communicator_bytes) / (1.0 + self.slack)

    def headroom(self, peak_bytes: float) -> float:
        """Bytes left between a peak of ``peak_bytes`` and :attr:`usable_bytes` (negative: over)."""
        return self.usable_bytes - peak_bytes

    def to_dict(self) -> dict[str, float]:
        """The numbers a plan reports (``Prediction.memory_budget``)."""
        return {"device_bytes": self.device_bytes, "reserved_bytes": self.reserved_bytes,
                "communicator_bytes": self.communicator_bytes, "communicators": self.communicators,
                "slack": self.slack, "usable_bytes": self.usable_bytes}

    def describe(self) -> str:
        """One line: what is held back and why."""
        gib = 2**30
        return (f"{self.usable_bytes / gib:.2f} GiB usable of {self.device_bytes / gib:.2f} GiB: "
                f"{self.reserved_bytes / gib:.2f} GiB CUDA context and workspaces, "
                f"{self.communicator_bytes / gib:.2f} GiB for {self.communicators} NCCL communicator(s), "
                f"{self.slack:.0%} allocator slack")


def memory_budget(cluster: Cluster, communicators: int) -> MemoryBudget:
    """The budget of one device of ``cluster`` for a rank that joins ``communicators`` process
    groups of more than one rank (``ParallelConfig.communicators``)."""
    device = cluster.device
    per_comm = backend_default(cluster, device.communicator_bytes, GPU_COMMUNICATOR_BYTES)
    return MemoryBudget(device_bytes=float(device.memory_bytes),
                        reserved_bytes=float(backend_default(cluster, device.reserved_bytes, GPU_RESERVED_BYTES)),
                        communicator_bytes=float(communicators * per_comm), communicators=communicators,
                        slack=float(backend_default(cluster, device.allocator_slack, GPU_ALLOCATOR_SLACK)))
