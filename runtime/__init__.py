"""The runtime: executes rank programs (:class:`passes.ir.program.RankProgram`) on gloo or NCCL.

It runs no pass and captures nothing; what it shares with the compiler comes from :mod:`passes.ir`.
Importing it registers the real kernels of our custom ops (:mod:`runtime.kernels`). A training
script takes what it needs from here: ``from runtime import TokenFileDataset, MetricsLogger``.
"""
import runtime.kernels  # noqa: F401

_LAZY = {
    "TokenFileDataset": "runtime.exec.data",
    "ShardedSampler": "runtime.exec.data",
    "MetricsLogger": "runtime.observe.metrics",
    "warmup_cosine": "runtime.optim.lr_schedules",
    "Mesh": "runtime.dist.mesh",
    "spawn": "runtime.dist.launch",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    """What a training script needs of the runtime (data, metrics, schedules, the mesh, local
    ranks), loaded on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
