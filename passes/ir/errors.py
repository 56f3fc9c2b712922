"""Error types of the partitioner. Every message names the cause and what to do about it.

This module imports nothing from the project so that every package can raise these.
"""


class PartitionerError(Exception):
    """Base class of every error this project raises on purpose."""


class ModelSpecError(PartitionerError, ValueError):
    """A model spec string (``NAME:key=value,...``) is malformed or names an unknown model."""


class CaptureError(PartitionerError):
    """A model could not be captured into an fx graph."""


class AnalysisError(PartitionerError):
    """An analysis pass could not compute its facts for a node."""


class PassError(PartitionerError):
    """A pass failed or broke a declared condition; the message names the pass and the node."""


class ConfigError(PartitionerError, ValueError):
    """An option (dtype, optimizer, dims, ...) has a value we do not support."""


class ClusterSpecError(ConfigError):
    """A cluster description (preset, YAML/JSON file or dict) is malformed or out of range."""


class InfeasiblePlanError(PartitionerError):
    """No parallel plan fits the devices' memory; the message says the smallest need and the knobs tried."""


class CheckpointError(PartitionerError):
    """A checkpoint directory is missing, incomplete (no completion marker: its save was killed) or
    could not be written; the message names the directory and what to load or do instead."""


class NonFiniteError(PartitionerError, FloatingPointError):
    """A training step produced a NaN or inf loss or gradient (the message names the step)."""


class CommunicationMismatchError(PartitionerError):
    """The rank programs of a plan would issue collectives or point-to-point messages that do not
    match (a hang or silently mixed tensors at run time); found before anything runs, the message
    names the group, the ranks and the calls that disagree, with a call x rank grid."""
