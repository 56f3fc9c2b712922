"""The error types every layer raises, re-exported for users (``from partitioner.errors import ConfigError``).

They are defined in :mod:`passes.ir.errors`, the leaf every package may import.
"""
from passes.ir.errors import (  # noqa: F401
    AnalysisError, CaptureError, CheckpointError, ClusterSpecError, ConfigError, InfeasiblePlanError, ModelSpecError,
    NonFiniteError, PartitionerError, PassError,
)
