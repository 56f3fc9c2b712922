"""A parallel training plan: how to split one model over a cluster, and what it should cost.

The search (:mod:`partitioner.search.search`) produces it; the lowering takes its
:class:`~passes.ir.config.ParallelConfig` (``plan.config``), and the report and dumps read the rest.
``Plan.to_json()`` / ``Plan.from_json()`` round-trip exactly (floats are written with ``repr``).
Sizes are bytes, times seconds.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from passes.ir.config import KNOBS, ParallelConfig
from passes.ir.errors import ConfigError

MEMORY_TERMS = ("parameters", "gradients", "optimizer", "activations", "buffers")

def format_bytes(n: float) -> str:
    """``n`` bytes for messages: GiB with 2 decimals from 0.1 GiB up, else MiB or KiB."""
    if n >= 0.1 * 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 0.1 * 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"


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
    """Largest per-device peak over the stages, bytes."""
    bubble_fraction: float
    """Pipeline idle fraction of the schedule: (p−1)/v / (m + (p−1)/v), or for the zero-bubble
    schedules their action lists simulated (``partitioner.cost.cost_model.bubble_fraction``)."""
    terms: dict[str, float]
    """``StepTimeTerms.to_dict()``: seconds by cause, and ``total``."""
    rank_peak_memory_bytes: tuple[float, ...] = ()
    """Peak bytes of each global rank (index = rank) when ``memory_model`` is ``"replay"``."""
    memory_model: Literal["analytic", "replay"] = "analytic"
    """Where the peaks come from: the search's per-layer model, or the exact replay of the rank
    programs (:mod:`partitioner.search.memory_check`) that every returned plan of a captured model gets."""
    memory_budget: dict[str, float] = field(default_factory=dict)
    """What the peak may reach on one device (``partitioner.cost.device_memory.MemoryBudget``):
    ``device_bytes``, less ``reserved_bytes`` (CUDA context, workspaces) and ``communicator_bytes``
    (NCCL's buffers for ``communicators`` groups), divided by ``1 + slack`` (the allocator's share
    beyond the live peak), is ``usable_bytes``. Empty in plans written before it was reported."""

    @property
    def headroom_bytes(self) -> float | None:
        """``usable_bytes`` less the peak: what the plan leaves free on its fullest device."""
        usable = self.memory_budget.get("usable_bytes")
        return None if usable is None else usable - self.peak_memory_bytes


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
    """A complete parallel plan: the :class:`ParallelConfig` to run and what it should cost.

    ``config.world_size`` is the world size; ``config.global_batch`` equals ``global_batch``.
    The knobs read through as attributes (``plan.dp`` is ``plan.config.dp``).
    """

    model: str
    """Spec string of the model planned."""
    cluster: str
    """Cluster name and node count, e.g. ``"dgx-a100-80gb x 192"``."""
    global_batch: int
    config: ParallelConfig
    """What runs: every knob, the dtype and the stage boundaries."""
    stages: tuple[StagePlan, ...] = ()
    predicted: Prediction
    alternatives: tuple[Alternative, ...] = ()
    cluster_spec: dict | None = None
    """The cluster a job planned on (``auto_parallelize``: detected, calibrated or given), as a
    cluster file holds it (``Cluster.to_dict()``); ``None`` for a plan made outside a job
    (``partitioner plan``: ``cluster`` names its preset)."""

    def __post_init__(self) -> None:
        if not isinstance(self.config, ParallelConfig):
            raise ConfigError(f"Plan.config must be a ParallelConfig, got {type(self.config).__name__}")
        if self.config.global_batch != self.global_batch:
            c = self.config
            raise ConfigError(f"Plan: dp*micro_batch_size*num_micro_batches = {c.dp}*{c.micro_batch_size}*"
                              f"{c.num_micro_batches} != global_batch {self.global_batch}")

    def __getattr__(self, name: str):
        # Only reached for names that are not fields: the knobs (and dtype) of the config.
        if name in KNOBS or name in ("dtype", "stage_boundaries"):
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def knobs(self) -> dict[str, object]:
        """The chosen values of :data:`KNOBS` (what ``fix=`` takes to reproduce this plan)."""
        return self.config.knobs()

    def to_dict(self) -> dict:
        out = asdict(self)
        out["config"] = self.config.to_dict()
        if self.cluster_spec is None:
            del out["cluster_spec"]
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; :meth:`from_json` reads it back to an equal Plan."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        if "config" not in data:  # a plan written with the knobs at top level
            knobs = {k: data.pop(k) for k in [*KNOBS, "dtype"] if k in data}
            data["config"] = knobs
        data["config"] = ParallelConfig.from_dict(data["config"])
        data["stages"] = tuple(
            StagePlan(**{**s, "layers": tuple(tuple(r) for r in s["layers"]), "layer_names": tuple(s["layer_names"])})
            for s in data.get("stages", ()))
        predicted = dict(data["predicted"])
        predicted["rank_peak_memory_bytes"] = tuple(predicted.get("rank_peak_memory_bytes", ()))
        data["predicted"] = Prediction(**predicted)
        data["alternatives"] = tuple(Alternative(**a) for a in data.get("alternatives", ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """One line: knobs and the prediction."""
        p, c = self.predicted, self.config
        v = f" v={c.virtual_pp}" if c.virtual_pp > 1 else ""
        v += f" cp={c.cp} {c.cp_mode}" if c.cp > 1 else ""
        v += f" ep={c.ep}" if c.ep > 1 else ""
        v += " compiled" if c.compile else ""
        headroom = "" if p.headroom_bytes is None else f" (headroom {p.headroom_bytes / 2**30:.1f} GiB)"
        return (f"dp={c.dp} tp={c.tp} pp={c.pp}{v} mbs={c.micro_batch_size} m={c.num_micro_batches} "
                f"{c.schedule} zero={c.zero_stage} sp={c.sequence_parallel} ckpt={c.checkpointing} "
                f"offload={c.offload} {c.dtype}: step {p.step_time_s:.3f} s, {p.tflops_per_device:.1f} TFLOP/s/device, "
                f"MFU {p.mfu:.1%}, peak {p.peak_memory_bytes / 2**30:.1f} GiB{headroom}, bubble {p.bubble_fraction:.1%}")
