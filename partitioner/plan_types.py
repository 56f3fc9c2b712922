"""A parallel training plan: how to split one model over a cluster, and what it should cost.

The search (:mod:`partitioner.search`) produces it; transform passes and the runtime read it.
``Plan.to_json()`` / ``Plan.from_json()`` round-trip exactly (floats are written with ``repr``).
Sizes are bytes, times seconds.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from partitioner.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_STAGES = (0, 1, 2)
CHECKPOINTING = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer", "activations")
MEMORY_TERMS = ("parameters", "gradients", "optimizer", "activations", "buffers")

def format_bytes(n: float) -> str:
    """``n`` bytes for messages: GiB with 2 decimals from 0.1 GiB up, else MiB or KiB."""
    if n >= 0.1 * 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 0.1 * 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"


KNOBS = ("dp", "tp", "pp", "virtual_pp", "micro_batch_size", "num_micro_batches", "schedule", "zero_stage",
         "sequence_parallel", "checkpointing", "offload")
"""Fields of :class:`Plan` that :func:`partitioner.search.plan` chooses (and ``fix`` may pin)."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage (the layers one device of a pipeline rank runs)."""

    index: int
    """Stage (pipeline rank) index, 0 = first."""
    layers: tuple[tuple[int, int], ...]
    """Half-open ranges ``[start, stop)`` of the layer chain (0 = embedding, 1..L = blocks,
    L+1 = head); one range per model chunk (several under the interleaved schedule)."""
    layer_names: tuple[str, ...]
    """First and last layer name of each chunk, for reading."""
    param_bytes: float
    """Bytes of the stage's parameters on one device (after tensor-parallel sharding)."""
    peak_memory_bytes: float
    """Peak bytes one device of this stage needs: the sum of ``memory``."""
    memory: dict[str, float]
    """The peak by term: ``parameters``, ``gradients``, ``optimizer``, ``activations``, ``buffers``."""
    time_s: float
    """Forward + backward (+ recompute) seconds of one micro-batch through this stage, with its
    tensor-parallel communication."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model predicts for one training step of the plan."""

    step_time_s: float
    tflops_per_device: float
    """Model FLOPs (forward + backward, no recompute) per second per device, in TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation: model FLOP/s over the devices' datasheet peak."""
    peak_memory_bytes: float
    """Largest per-device peak over the stages."""
    bubble_fraction: float
    """Pipeline idle fraction of the schedule: (p−1)/v / (m + (p−1)/v)."""
    terms: dict[str, float]
    """``StepTimeTerms.to_dict()``: seconds by cause, and ``total``."""


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A candidate the search considered and did not pick."""

    knobs: dict[str, object]
    """Its values of :data:`KNOBS`."""
    step_time_s: float
    peak_memory_bytes: float
    reason: str
    """Why it lost, one line: ``"slower by 12.0%"`` or ``"needs 91.0 GiB of 80.0 GiB"``."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete parallel plan. ``dp * tp * pp`` is the world size;
    ``dp * micro_batch_size * num_micro_batches`` is the global batch."""

    model: str
    """Spec string of the model planned."""
    cluster: str
    """Cluster name and node count, e.g. ``"dgx-a100-80gb x 192"``."""
    global_batch: int
    dp: int
    tp: int
    pp: int
    virtual_pp: int = 1
    """Model chunks per pipeline stage (interleaved schedule); 1 otherwise."""
    micro_batch_size: int
    num_micro_batches: int
    schedule: str
    """``gpipe``, ``1f1b`` or ``interleaved``."""
    zero_stage: int = 0
    """ZeRO stage over the data-parallel group: 0, 1 (optimizer states), 2 (+ gradients)."""
    sequence_parallel: bool = False
    """Shard the tensor-parallel-replicated activations (norms, dropout) along the sequence."""
    checkpointing: str = "none"
    """Activation checkpointing: ``none``, ``selective`` (recompute attention scores), ``full``
    (keep only each layer's input, recompute its forward in backward)."""
    offload: str = "none"
    """``none``, ``optimizer`` (optimizer states and step on the host) or ``activations``
    (saved activations to host memory between forward and backward)."""
    stages: tuple[StagePlan, ...] = ()
    predicted: Prediction
    alternatives: tuple[Alternative, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"Plan.schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"Plan.zero_stage {self.zero_stage!r}; choose one of {ZERO_STAGES}")
        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError(f"Plan.checkpointing {self.checkpointing!r}; choose one of {', '.join(CHECKPOINTING)}")
        if self.offload not in OFFLOAD:
            raise ConfigError(f"Plan.offload {self.offload!r}; choose one of {', '.join(OFFLOAD)}")
        if self.dp * self.micro_batch_size * self.num_micro_batches != self.global_batch:
            raise ConfigError(f"Plan: dp*micro_batch_size*num_micro_batches = {self.dp}*{self.micro_batch_size}*"
                              f"{self.num_micro_batches} != global_batch {self.global_batch}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def knobs(self) -> dict[str, object]:
        """The chosen values of :data:`KNOBS` (what ``fix=`` takes to reproduce this plan)."""
        return {k: getattr(self, k) for k in KNOBS}

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; :meth:`from_json` reads it back to an equal Plan."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        data["stages"] = tuple(
            StagePlan(**{**s, "layers": tuple(tuple(r) for r in s["layers"]), "layer_names": tuple(s["layer_names"])})
            for s in data.get("stages", ()))
        data["predicted"] = Prediction(**data["predicted"])
        data["alternatives"] = tuple(Alternative(**a) for a in data.get("alternatives", ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """One line: knobs and the prediction."""
        p = self.predicted
        v = f" v={self.virtual_pp}" if self.virtual_pp > 1 else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{v} mbs={self.micro_batch_size} m={self.num_micro_batches} "
                f"{self.schedule} zero={self.zero_stage} sp={self.sequence_parallel} ckpt={self.checkpointing} "
                f"offload={self.offload}: step {p.step_time_s:.3f} s, {p.tflops_per_device:.1f} TFLOP/s/device, "
                f"MFU {p.mfu:.1%}, peak {p.peak_memory_bytes / 2**30:.1f} GiB, bubble {p.bubble_fraction:.1%}")


