"""A compiler-style graph partitioner for parallel training in PyTorch.

Heavy submodules load lazily so that ``import partitioner`` stays cheap and the packages
``passes``/``runtime``/``ir_dumps`` can import our error types without a cycle.
"""
from passes.ir.errors import (  # noqa: F401
    AnalysisError,
    CaptureError,
    ConfigError,
    ModelSpecError,
    PartitionerError,
    PassError,
)

_LAZY = {
    "build_model": "partitioner.inputs.models",
    "ModelSpec": "partitioner.inputs.model_spec",
    "analyze": "partitioner.api.analysis",
    "plan": "partitioner.api.planning",
    "Plan": "passes.ir.plan",
    "Cluster": "partitioner.cost.cluster",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
