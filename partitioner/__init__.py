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
    "auto_parallelize": "partitioner.api.auto",
    "plan": "partitioner.api.planning",
    "analyze": "partitioner.compile.analysis",
    "Cluster": "partitioner.cost.cluster",
    "local_cluster": "partitioner.calibration.job_cluster",
    "detect_cluster": "partitioner.calibration.job_cluster",
    "ParallelConfig": "passes.ir.config",
    "Plan": "passes.ir.plan",
    "ModelSpec": "partitioner.inputs.model_spec",
    "Training": "partitioner.inputs.training",
    "Job": "partitioner.inputs.job",
    "InputSpec": "passes.ir.meta",
    "build_model": "partitioner.inputs.models",
    "capture_for_pipeline": "partitioner.compile.build",
    "build_parallel_model": "partitioner.compile.build",
}
__all__ = [*_LAZY, "AnalysisError", "CaptureError", "ConfigError", "ModelSpecError", "PartitionerError", "PassError"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
