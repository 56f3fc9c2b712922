"""What the policy passes need to know of the hardware: a few costs, given by the caller.

The planner's cluster (:class:`partitioner.cost.cluster.Cluster`) provides them
(:func:`partitioner.cost.cost_model.cost_hooks`); the passes ask through this protocol, so they never
import the planner and never assume a machine of their own.
"""
from __future__ import annotations

from typing import Protocol


class CostHooks(Protocol):
    """Costs of one device of the cluster a plan is lowered for."""

    name: str
    """The cluster the costs come from (recorded with the decisions they made)."""
    device_memory_bytes: float
    """Memory of one device, bytes."""
    host_memory_bytes: float
    """Host memory one device may use, bytes."""

    def compute_seconds(self, flops: float, dtype: str) -> float:
        """Seconds one matmul-class kernel of ``flops`` FLOPs takes in ``dtype`` on one device."""

    def host_copy_seconds(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between the device and host memory, one direction."""
