"""Devices of a chosen size for memory tests: ``device=dataclasses.replace(d, memory_bytes=n,
**NOTHING_HELD_BACK)`` is a device that leaves a plan exactly ``n`` bytes (no CUDA context,
NCCL buffers or allocator slack held back: ``partitioner.cost.device_memory``), so a test that
sets the budget between two plans' peaks tells them apart by their peaks alone."""

NOTHING_HELD_BACK = {"reserved_bytes": 0, "communicator_bytes": 0, "allocator_slack": 0.0}
