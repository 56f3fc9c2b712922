"""Description of the machines a plan runs on: devices, links between them, host memory.

A :class:`Cluster` is ``nodes`` identical nodes of ``devices_per_node`` identical
:class:`Device` s. Devices in one node talk over ``intra_node`` (NVLink/NVSwitch, PCIe, or
loopback for CPU processes); nodes talk over ``inter_node`` NICs (InfiniBand, RoCE, Ethernet).
Ranks are laid out node-major: ``rank = node * devices_per_node + local_rank``.

Sizes are bytes, rates bytes per second (per direction), compute FLOP/s, times seconds.
Files and dicts may write them with units (``"80GiB"``, ``"1.5TB"``, ``"200Gb/s"``,
``"312TFLOP/s"``, ``"5us"``); the dataclasses always hold plain numbers. The schema is
documented in ``docs/cluster_schema.md``; presets live in ``partitioner/cost/presets/``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from passes.ir.errors import ClusterSpecError

LINK_KINDS = ("nvlink", "nvswitch", "pcie", "infiniband", "roce", "ethernet", "loopback")
BACKENDS = ("nccl", "gloo")
DTYPES = ("fp32", "tf32", "bf16", "fp16")
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "tf32",
                  "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def _dtype_key(dtype: Any) -> str:
    """The field name of ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``, or a torch name)."""
    key = _DTYPE_ALIASES.get(str(dtype).removeprefix("torch."))
    if key is None:
        raise ClusterSpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return key


PRESET_DIR = Path(__file__).parent / "presets"
CLUSTER_FILE_ENV = "PARTITIONER_CLUSTER_FILE"
"""An explicit cluster file for ``local_cluster`` and ``detect_cluster``: used as it is (it must
exist), no calibration."""

# ---------------------------------------------------------------------------------------------
# Quantities with units
# ---------------------------------------------------------------------------------------------

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_SI = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_PREFIX = r"([kKMGTP]i?)?"
# Bytes are "B", bits "b" (network rates are quoted in bits: 200Gb/s = 25GB/s).
_PATTERNS = {
    "bytes": (re.compile(f"^{_NUM}{_PREFIX}B$"), "'80GiB' (2**30 bytes each), '80GB' (10**9) or '1.5TB'"),
    "bytes_per_s": (re.compile(f"^{_NUM}{_PREFIX}([Bb])(?:/s|ps)$"), "'300GB/s' or '200Gb/s' (bits)"),
    "flops_per_s": (re.compile(f"^{_NUM}([kKMGTP])?FLOP(?:/s|S)$", re.IGNORECASE), "'312TFLOP/s'"),
    "seconds": (re.compile(f"^{_NUM}(s|ms|us|µs|ns)$"), "'5us', '1.5ms' or '0.002s'"),
}
# Divisors rather than factors: 50 / 1e6 prints as 5e-05, 50 * 1e-6 as 4.9999999999999996e-05.
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


def _prefix_factor(prefix: str | None) -> float:
    prefix = prefix or ""
    return _BIN[prefix[0].upper() + "i"] if prefix.endswith("i") else _SI[prefix]


def parse_quantity(value: Any, kind: str, where: str) -> float:
    """``value`` (a number, or a string with a unit) as a plain float of ``kind``.

    ``kind`` is one of ``bytes``, ``bytes_per_s``, ``flops_per_s``, ``seconds``; ``where`` names
    the field (``"Device.memory_bytes"``) for the error message.
    """
    pattern, example = _PATTERNS[kind]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ClusterSpecError(f"{where}: expected a number or a string such as {example}, "
                               f"got {value!r} of type {type(value).__name__}")
    if not isinstance(value, str):
        return float(value)
    text = value.strip()
    try:
        float(text)
    except ValueError:
        pass
    else:  # a quoted number: we will not guess its unit
        raise ClusterSpecError(f"{where}: {value!r} is a string without a unit; write a plain number "
                               f"(not quoted) or add a unit, e.g. {example}")
    m = pattern.match(text)
    if m is None and text.startswith("-") and pattern.match(text[1:].strip()):
        raise ClusterSpecError(f"{where} cannot be negative, got {value!r}; write e.g. {example}")
    if m is None:
        raise ClusterSpecError(f"{where}: cannot read {value!r}; write a plain number or e.g. {example}")
    number = float(m.group(1))
    if kind == "seconds":
        return number / _PER_SECOND[m.group(2)]
    if kind == "flops_per_s":
        return number * _SI[(m.group(2) or "").upper()]
    factor = _prefix_factor(m.group(2))
    if kind == "bytes_per_s" and m.group(3) == "b":
        factor /= 8  # bits to bytes
    return number * factor


def _positive(where: str, value: float, fix: str, *, allow_zero: bool = False) -> None:
    if not math.isfinite(value):  # YAML's .nan / .inf would pass every comparison below or poison the costs
        raise ClusterSpecError(f"{where} must be a finite number, got {value!r}; {fix}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterSpecError(f"{where} must be {bound}, got {value!r}; {fix}")


def _normalize(obj: Any, name: str, kind: str, fix: str, *, allow_zero: bool = False) -> None:
    """Parse field ``name`` of a frozen dataclass in place and check its sign."""
    where = f"{type(obj).__name__}.{name}"
    value = parse_quantity(getattr(obj, name), kind, where)
    _positive(where, value, fix, allow_zero=allow_zero)
    if kind == "bytes":
        if not float(value).is_integer():
            raise ClusterSpecError(f"{where}: {value!r} is not a whole number of bytes")
        value = int(value)
    object.__setattr__(obj, name, value)


def _count(obj: Any, name: str, fix: str) -> None:
    value = getattr(obj, name)
    where = f"{type(obj).__name__}.{name}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterSpecError(f"{where} must be a whole number, got {value!r}; {fix}")
    _positive(where, value, fix)


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ClusterSpecError(f"{type(obj).__name__}.{name}: unknown value {value!r}; "
                               f"choose one of {', '.join(choices)}")


def _from_dict(cls: type, data: Any, where: str, nested: dict[str, type] | None = None):
    """Build ``cls`` from a mapping, refusing unknown keys and converting nested mappings."""
    if not isinstance(data, dict):
        shown = repr(data) if len(repr(data)) <= 80 else repr(data)[:77] + "..."
        raise ClusterSpecError(f"{where}: expected a mapping of {cls.__name__} fields, got {shown} "
                               f"({type(data).__name__}); write one 'field: value' per line")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ClusterSpecError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                               f"{cls.__name__} takes {', '.join(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ClusterSpecError(f"{where}: missing key(s) {', '.join(missing)} of {cls.__name__}")
    kwargs = dict(data)
    for key, sub in (nested or {}).items():
        if key in kwargs:
            kwargs[key] = sub.from_dict(kwargs[key], where=f"{where}.{key}")
    try:
        return cls(**kwargs)
    except ClusterSpecError as e:
        if "." not in where:  # top level: the class name in the message says enough
            raise
        raise ClusterSpecError(f"{where}: {e}") from None  # which of the three links, say


# ---------------------------------------------------------------------------------------------
# Dataclasses
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True, slots=True)
class PeakFlops:
    """Dense (no sparsity) peak throughput of one device per dtype, in FLOP/s."""

    fp32: float
    """Plain fp32 (non tensor-core) FLOP/s."""
    bf16: float
    """bfloat16 tensor-core FLOP/s with fp32 accumulation."""
    tf32: float | None = None
    """TF32 tensor-core FLOP/s; defaults to ``fp32`` (devices without TF32 units)."""
    fp16: float | None = None
    """float16 tensor-core FLOP/s; defaults to ``bf16``."""

    def __post_init__(self) -> None:
        fix = "give the dense datasheet value in FLOP/s, e.g. '312TFLOP/s'"
        if self.tf32 is None:
            object.__setattr__(self, "tf32", self.fp32)
        if self.fp16 is None:
            object.__setattr__(self, "fp16", self.bf16)
        for name in DTYPES:
            _normalize(self, name, "flops_per_s", fix)

    def for_dtype(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``, or a torch name)."""
        return getattr(self, _dtype_key(dtype))

    @classmethod
    def from_dict(cls, data: Any, where: str = "peak_flops") -> PeakFlops:
        return _from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in DTYPES}


@dataclass(kw_only=True, frozen=True, slots=True)
class EfficiencyCurve:
    """Fraction of peak FLOP/s a kernel of ``f`` FLOPs reaches: ``peak_efficiency · f / (f + f_half)``.

    ``f_half = peak_flops_per_s · half_saturation_s`` is the size at which a kernel reaches half
    of ``peak_efficiency``; tying it to time makes one curve fit fast and slow devices. The
    resulting time ``(f + f_half) / (peak · peak_efficiency)`` is the ideal time plus a fixed
    ``half_saturation_s / peak_efficiency`` seconds per kernel (launch, tails, small tiles).
    The defaults are the cost model's GPU assumption (``cost_model.DEFAULT_EFFICIENCY``); a
    device's measured curve is :attr:`Device.efficiency`.
    """

    peak_efficiency: float = 0.75
    """Best fraction of the peak FLOP/s that large matmuls reach, in (0, 1] (0.7–0.8 is typical
    on GPUs against the datasheet; ~1 on a CPU against its measured matmul rate)."""
    half_saturation_s: float = 5e-6
    """Seconds of peak-rate work at which efficiency is half of ``peak_efficiency`` (>= 0; files
    may write ``"5us"``)."""

    def __post_init__(self) -> None:
        value = self.peak_efficiency
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ClusterSpecError(f"EfficiencyCurve.peak_efficiency must be in (0, 1], got {value!r}")
        _normalize(self, "half_saturation_s", "seconds", "give the half-saturation time, e.g. '5us'",
                   allow_zero=True)

    def efficiency(self, flops: float, peak_flops_per_s: float) -> float:
        """Fraction of ``peak_flops_per_s`` reached by one kernel of ``flops`` FLOPs."""
        if flops <= 0:
            return 0.0
        return self.peak_efficiency * flops / (flops + peak_flops_per_s * self.half_saturation_s)

    @classmethod
    def from_dict(cls, data: Any, where: str = "efficiency") -> EfficiencyCurve:
        return _from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return {"peak_efficiency": self.peak_efficiency, "half_saturation_s": self.half_saturation_s}


@dataclass(kw_only=True, frozen=True, slots=True)
class DeviceEfficiency:
    """A device's measured matmul :class:`EfficiencyCurve` per dtype, relative to its
    ``Device.peak_flops`` of that dtype (what ``partitioner calibrate`` fits from square matmuls:
    ``calibration.measure.fit_efficiency``). A dtype left out (``None``) is priced with the cost
    model's default curve; ``tf32`` defaults to ``fp32``'s curve and ``fp16`` to ``bf16``'s, as
    :class:`PeakFlops` does for the peaks."""

    fp32: EfficiencyCurve | None = None
    bf16: EfficiencyCurve | None = None
    tf32: EfficiencyCurve | None = None
    fp16: EfficiencyCurve | None = None

    def __post_init__(self) -> None:
        for name in DTYPES:
            value = getattr(self, name)
            if isinstance(value, dict):
                try:
                    object.__setattr__(self, name, EfficiencyCurve.from_dict(value, "efficiency"))
                except ClusterSpecError as e:
                    raise ClusterSpecError(f"{name}: {e}") from None
            elif value is not None and not isinstance(value, EfficiencyCurve):
                raise ClusterSpecError(f"DeviceEfficiency.{name} must be a mapping with peak_efficiency and "
                                       f"half_saturation_s, got {value!r}")
        if self.tf32 is None:
            object.__setattr__(self, "tf32", self.fp32)
        if self.fp16 is None:
            object.__setattr__(self, "fp16", self.bf16)
        if all(getattr(self, name) is None for name in DTYPES):
            raise ClusterSpecError("DeviceEfficiency needs a curve for at least one dtype "
                                   f"({', '.join(DTYPES)}); leave it out to use the default curve")

    def for_dtype(self, dtype: str) -> EfficiencyCurve | None:
        """The curve measured for ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``, or a torch
        name); ``None`` when none was."""
        return getattr(self, _dtype_key(dtype))

    @classmethod
    def from_dict(cls, data: Any, where: str = "efficiency") -> DeviceEfficiency:
        return _from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return {name: getattr(self, name).to_dict() for name in DTYPES if getattr(self, name) is not None}


GPU_COMM_COMPUTE_SHARE = 0.15
"""The default ``Device.comm_compute_share`` under NCCL, an estimate: a collective's kernel runs
one thread block per channel, each holding an SM until the collective ends (NCCL picks the
channel count from the topology: 16 channels are 15% of an A100's 108 SMs and 12% of an H100's
132; an all-gather profiled on an H100 in NVIDIA's developer forum held 24), besides the device
memory bandwidth it streams. Kernels that need every SM at once (a matmul of exactly one wave of
tiles) lose more: the tiles that no longer fit run in a second wave."""


def backend_default(cluster: Cluster, value, gpu_default):
    """A device field that may be left unset (``None``), resolved for ``cluster``: its value when
    set, else ``gpu_default`` under NCCL and 0 on gloo (CPU ranks hold nothing back and overlap
    nothing)."""
    if value is not None:
        return value
    return gpu_default if cluster.backend == "nccl" else 0


@dataclass(kw_only=True, frozen=True, slots=True)
class Device:
    """One accelerator (or one CPU process for ``local-cpu``)."""

    name: str
    """Model name, e.g. ``"A100-SXM4-80GB"``; shown in reports only."""
    memory_bytes: int
    """Device memory in bytes (``"80GiB"`` in files)."""
    memory_bandwidth_bytes_per_s: float
    """Device memory (HBM/DRAM) bandwidth in bytes/s, for memory-bound ops."""
    peak_flops: PeakFlops
    """Dense peak FLOP/s per dtype."""
    kernel_overhead_s: float = 0.0
    """Seconds of framework overhead per dispatched operator (dispatcher, Python, kernel launch):
    the planner charges it for every forward operator of the captured graph and twice as many
    backward ones (``cost_model.op_overhead_time``); 0 for the presets, fitted by
    ``partitioner.calibration.refit`` where it dominates (small models on CPU)."""
    step_overhead_s: float = 0.0
    """Host seconds per training step outside forward, backward, communication and the optimizer
    (splitting the batch into micro-batches, ``zero_grad``, the schedule's bookkeeping); 0 for the
    presets, fitted by ``partitioner.calibration.refit`` from a run's measured ``other_s``."""
    offload_call_s: float = 0.0
    """Seconds per offloaded saved tensor per copy, beyond moving its bytes (the saved-tensor hook,
    the offload op's dispatch, the copy's launch); 0 for the presets, fitted by
    ``partitioner.calibration.refit`` from runs with activation offload."""
    optimizer_bytes_per_s: float = 0.0
    """Bytes/s the optimizer step streams (moments, masters, gradients, parameters); 0: the memory
    bandwidth (the presets). Fitted by ``partitioner.calibration.refit`` from measured optimizer seconds: a
    CPU rank's single-tensor AdamW is dispatch-bound, far below its memcpy rate, which still
    times the graph's memory-bound nodes."""
    optimizer_tensor_s: float = 0.0
    """Seconds the optimizer step spends per tensor it steps, beyond the bytes it streams (torch's
    single-tensor AdamW loop on CPU: about 45 us a tensor, so a rank stepping 50 small tensors
    takes milliseconds whatever their size, and a ZeRO-1/2 rank stepping a few flat segments does
    not); 0 for the presets, fitted by ``partitioner.calibration.refit`` with ``optimizer_bytes_per_s``."""
    efficiency: DeviceEfficiency | None = None
    """The device's measured matmul efficiency curve per dtype (peak efficiency, a fraction of
    ``peak_flops``; half-saturation, seconds), which the cost model prices its kernels with
    (``cost_model.efficiency_curve``). ``None`` (the presets): the cost model's default curve
    (0.75, 5 us: a GPU against its datasheet). Written by ``partitioner calibrate``."""
    reserved_bytes: int | None = None
    """Device memory one training process holds outside the caching allocator's tensors and
    NCCL's buffers: the CUDA context with the kernels it loads, and cuBLAS' workspaces. ``None``:
    the default of the cluster's backend (:mod:`partitioner.cost.device_memory`: a GPU's figure
    under NCCL, 0 for CPU ranks on gloo)."""
    communicator_bytes: int | None = None
    """Device memory of one NCCL communicator's buffers (one per process group of more than one
    rank, ``ParallelConfig.communicators``); ``None``: the backend's default, as above."""
    allocator_slack: float | None = None
    """Share of the plan's peak the caching allocator holds beyond it (blocks split and cached for
    sizes that come back, segments it cannot release): the budget is divided by ``1 + slack``.
    ``None``: the backend's default, as above."""
    comm_compute_share: float | None = None
    """Share of the device's compute a collective takes while it runs beside kernels (NCCL holds
    an SM per channel for the collective's whole duration): compute that overlaps a collective
    runs at ``1 - share`` of its rate (``StepTimeTerms.overlap``). ``None``: the backend's default
    (:data:`GPU_COMM_COMPUTE_SHARE` under NCCL; 0 on gloo, where nothing overlaps a rank's thread)."""
    memory_bound_bytes_per_s: float = 0.0
    """Bytes/s (read plus write) the graph's memory-bound nodes (elementwise ops, norms, softmax,
    dropout, the loss) stream at (``cost_model.memory_bound_rate``); 0 (the presets): the memory
    bandwidth. A CPU rank's one thread runs its transcendental and normalising ops well below its
    memcpy rate; fitted by ``partitioner.calibration.refit`` within
    ``refit.MEMORY_BOUND_BOUNDS`` of ``memory_bandwidth_bytes_per_s``."""

    def __post_init__(self) -> None:
        _normalize(self, "memory_bytes", "bytes", "give the device memory, e.g. '80GiB'")
        _normalize(self, "memory_bandwidth_bytes_per_s", "bytes_per_s",
                   "give the memory bandwidth, e.g. '2039GB/s'")
        if isinstance(self.peak_flops, dict):
            object.__setattr__(self, "peak_flops", PeakFlops.from_dict(self.peak_flops, "Device.peak_flops"))
        if not isinstance(self.peak_flops, PeakFlops):
            raise ClusterSpecError(f"Device.peak_flops must be a mapping of dtype to FLOP/s, got {self.peak_flops!r}")
        if isinstance(self.efficiency, dict):
            object.__setattr__(self, "efficiency", DeviceEfficiency.from_dict(self.efficiency, "Device.efficiency"))
        if self.efficiency is not None and not isinstance(self.efficiency, DeviceEfficiency):
            raise ClusterSpecError(f"Device.efficiency must be a mapping of dtype to {{peak_efficiency, "
                                   f"half_saturation_s}}, got {self.efficiency!r}")
        for name, fix in (("reserved_bytes", "give the memory a process holds outside its tensors, e.g. '600MiB'"),
                          ("communicator_bytes", "give one NCCL communicator's buffers, e.g. '256MiB'")):
            if getattr(self, name) is not None:
                _normalize(self, name, "bytes", fix, allow_zero=True)
        for name, example in (("allocator_slack", "0.05 for 5% of the peak"),
                              ("comm_compute_share", "0.15 for 16 of an A100's 108 SMs")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < 1):
                raise ClusterSpecError(f"Device.{name} must be a fraction in [0, 1), got {value!r}; "
                                       f"e.g. {example}, or leave it out for the backend's default")
        for name in ("kernel_overhead_s", "step_overhead_s", "offload_call_s", "optimizer_bytes_per_s",
                     "optimizer_tensor_s", "memory_bound_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ClusterSpecError(f"Device.{name} must be a plain number, got {value!r} of type "
                                       f"{type(value).__name__}; leave it out (0) or give a measured value")
            if not (value >= 0 and math.isfinite(value)):
                raise ClusterSpecError(f"Device.{name} must be >= 0 seconds, got {getattr(self, name)!r}; "
                                       f"leave it out (0) or give a measured overhead")

    @classmethod
    def from_dict(cls, data: Any, where: str = "device") -> Device:
        return _from_dict(cls, data, where, {"peak_flops": PeakFlops})

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_bytes": self.memory_bytes,
                "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
                "peak_flops": self.peak_flops.to_dict(),
                **{name: getattr(self, name) for name in ("kernel_overhead_s", "step_overhead_s", "offload_call_s",
                                                          "optimizer_bytes_per_s", "optimizer_tensor_s",
                                                          "memory_bound_bytes_per_s")
                   if getattr(self, name)},
                **{name: getattr(self, name) for name in ("reserved_bytes", "communicator_bytes", "allocator_slack",
                                                          "comm_compute_share")
                   if getattr(self, name) is not None},
                **({"efficiency": self.efficiency.to_dict()} if self.efficiency is not None else {})}


COLLECTIVE_FIT_OPS = ("all_gather", "reduce_scatter", "all_to_all")
"""Collectives a :class:`Link` may carry a measured α-β fit of its own for (``Link.collectives``);
the link's own α and β are the all-reduce's (and any collective's without a fit)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class CollectiveFit:
    """The α-β of one collective measured on a link, in the cost model's ring form
    (``cost_model.all_gather_time``: ``(n−1)·α + (n−1)/n · bytes/β``)."""

    op: str
    """One of :data:`COLLECTIVE_FIT_OPS`."""
    bandwidth_bytes_per_s: float
    """β: bytes/s per rank, one direction."""
    latency_s: float
    """α: seconds per ring step."""

    def __post_init__(self) -> None:
        _choice(self, "op", COLLECTIVE_FIT_OPS)
        _normalize(self, "bandwidth_bytes_per_s", "bytes_per_s",
                   "give the fitted bandwidth, e.g. '2GB/s', or leave the collective out")
        _normalize(self, "latency_s", "seconds", "give the fitted latency, e.g. '50us'", allow_zero=True)

    def to_dict(self) -> dict:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}


def _collective_fits(value: Any, where: str) -> tuple[CollectiveFit, ...]:
    """``Link.collectives`` as a tuple sorted by op, from a tuple of fits or a file's mapping
    ``{op: {bandwidth_bytes_per_s, latency_s}}``."""
    if isinstance(value, dict):
        fits = []
        for op, data in value.items():
            if op not in COLLECTIVE_FIT_OPS:
                raise ClusterSpecError(f"{where}: unknown collective {op!r}; fits are kept for "
                                       f"{', '.join(COLLECTIVE_FIT_OPS)} (the link's own α-β is the all-reduce's)")
            if not isinstance(data, dict):
                raise ClusterSpecError(f"{where}.{op}: expected a mapping with bandwidth_bytes_per_s and latency_s, "
                                       f"got {data!r}")
            fits.append(_from_dict(CollectiveFit, {"op": op, **data}, f"{where}.{op}"))
        value = tuple(fits)
    if not isinstance(value, (tuple, list)) or not all(isinstance(f, CollectiveFit) for f in value):
        raise ClusterSpecError(f"{where} must map collectives ({', '.join(COLLECTIVE_FIT_OPS)}) to "
                               f"{{bandwidth_bytes_per_s, latency_s}}, got {value!r}")
    ops = [f.op for f in value]
    if len(set(ops)) != len(ops):
        raise ClusterSpecError(f"{where}: more than one fit of {sorted(o for o in ops if ops.count(o) > 1)[0]!r}")
    return tuple(sorted(value, key=lambda f: COLLECTIVE_FIT_OPS.index(f.op)))


@dataclass(kw_only=True, frozen=True, slots=True)
class Link:
    """A kind of connection, costed with the α-β model: time = latency_s + bytes / bandwidth."""

    kind: str
    """One of ``LINK_KINDS``: nvlink, nvswitch, pcie, infiniband, roce, ethernet, loopback."""
    bandwidth_bytes_per_s: float
    """Bytes/s in ONE direction, per device for intra-node and host links, per NIC for
    inter-node links (datasheets often quote both directions added: halve those)."""
    latency_s: float
    """Start-up latency α of one message (one ring step), in seconds."""
    count: int = 1
    """How many such links a node has in parallel. For ``inter_node`` this is the number of NICs
    per node (the node's aggregate bandwidth is ``count * bandwidth_bytes_per_s``); leave 1 for
    intra-node and host links, whose bandwidth is already per device."""
    collectives: tuple[CollectiveFit, ...] = ()
    """Measured α-β of collectives whose time on this link differs from the all-reduce's (gloo's
    all-gather and all-to-all are not rings at the all-reduce's rate): what the cost model prices
    them with (:meth:`for_collective`). Empty (the presets): every collective uses the link's α, β.
    Written by the calibration (``partitioner calibrate``, a job's first run) on CPU ranks; files
    write it as ``{op: {bandwidth_bytes_per_s, latency_s}}``."""

    def __post_init__(self) -> None:
        _choice(self, "kind", LINK_KINDS)
        _normalize(self, "bandwidth_bytes_per_s", "bytes_per_s",
                   "give the one-direction bandwidth, e.g. '300GB/s' or '200Gb/s'")
        _normalize(self, "latency_s", "seconds", "give the latency, e.g. '5us'", allow_zero=True)
        _count(self, "count", "give the number of parallel links (NICs per node), at least 1")
        object.__setattr__(self, "collectives", _collective_fits(self.collectives, "Link.collectives"))

    def for_collective(self, op: str) -> Link:
        """The link ``op`` is priced on: this one with the measured fit's α and β when
        :attr:`collectives` holds one for ``op``, else this one unchanged. The one place where the
        cost model picks a collective's α-β (``cost_model.all_gather_time`` and its siblings)."""
        for fit in self.collectives:
            if fit.op == op:
                return Link(kind=self.kind, bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s, latency_s=fit.latency_s,
                            count=self.count)
        return self

    def with_latency_scale(self, scale: float) -> Link:
        """This link with every α (its own and each collective's) times ``scale``: the calibrated
        ``Cluster.sync_latency_scale`` and the refit's latency scale act on all of them alike."""
        fits = tuple(dataclasses.replace(f, latency_s=f.latency_s * scale) for f in self.collectives)
        return dataclasses.replace(self, latency_s=self.latency_s * scale, collectives=fits)

    @property
    def aggregate_bytes_per_s(self) -> float:
        """``count * bandwidth_bytes_per_s``: all links of this kind of one node together."""
        return self.count * self.bandwidth_bytes_per_s

    @classmethod
    def from_dict(cls, data: Any, where: str = "link") -> Link:
        return _from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "latency_s": self.latency_s, "count": self.count,
                **({"collectives": {f.op: f.to_dict() for f in self.collectives}} if self.collectives else {})}


_LINK_FIELDS = ("intra_node", "inter_node", "host_to_device")


@dataclass(kw_only=True, frozen=True, slots=True)
class Cluster:
    """``nodes`` identical nodes of ``devices_per_node`` identical devices; ranks node-major."""

    name: str
    """Preset name or a label of your own; shown in reports."""
    nodes: int = 1
    """Number of nodes (hosts)."""
    devices_per_node: int
    """Devices (GPUs, or processes for CPU) per node."""
    device: Device
    """The device every rank runs on."""
    intra_node: Link
    """Link between two devices of one node (bandwidth per device, per direction)."""
    inter_node: Link
    """NICs between nodes: bandwidth per NIC per direction, ``count`` = NICs per node."""
    host_memory_bytes: int
    """CPU memory of one node in bytes, the budget for CPU offload (shared by its devices)."""
    host_to_device: Link
    """Link between host memory and one device (PCIe), for offload."""
    backend: str
    """torch.distributed backend: ``nccl`` (GPUs) or ``gloo`` (CPU)."""
    p2p_latency_s: float | None = None
    """Seconds per pipeline point-to-point message in place of the link's α (the runtime's
    isend/irecv post and wait, which small messages see more of than the calibration's large
    ones); ``None`` (the presets): the link's. Fitted by ``partitioner.calibration.refit``."""
    sync_latency_scale: float | None = None
    """Multiplier of the link's α (intra- or inter-node, whichever the group spans) for the
    collectives over data-parallel ranks and between stages: the gradient reduction (per bucket),
    ZeRO's all-gathers, ZeRO-3's per-layer gathers and reduce-scatters, the tied-weight sync and
    the loss all-reduce. On CPU ranks sharing cores they cost several times, per hop, the
    tensor- and context-parallel collectives ranks call in step inside forward and backward,
    which pay the link's α. ``None`` (the presets): 1. Fitted by ``partitioner.calibration.refit``."""
    step_end_wait_s: float = 0.0
    """Seconds every synchronising call at a step's end waits on top of its α-β price, once per
    call (``plan_cost.step_end_calls``: the gradient buckets, ZeRO's updated-chunk gathers, the
    tied-weight and sequence-parallel sums, the gradient norm, the loss): on CPU ranks sharing
    cores each such call waits for the last rank to be scheduled, a fixed cost per call rather
    than one proportional to the link's α. 0 (the presets, GPUs). Fitted by
    ``partitioner.calibration.refit`` within ``refit.STEP_END_WAIT_BOUNDS``."""
    compute_slots_per_node: int | None = None
    """How many of a node's ranks can compute at once at the device's full rate: CPU ranks
    share the node's cores, ``cores // threads per rank`` of them run at a time. With more ranks
    computing than slots, the node's total compute seconds over its slots bound the step
    (``StepTimeTerms.contention``). ``None`` (GPUs, the presets): every device computes on its
    own. Written by ``partitioner calibrate``."""

    def __post_init__(self) -> None:
        _count(self, "nodes", "a cluster has at least 1 node")
        _count(self, "devices_per_node", "a node has at least 1 device")
        if self.compute_slots_per_node is not None:
            _count(self, "compute_slots_per_node", "give how many ranks of a node compute at once "
                   "(cores // threads per rank), or leave it out when every device has its own")
        _normalize(self, "host_memory_bytes", "bytes", "give the CPU memory of one node, e.g. '2TiB'")
        _choice(self, "backend", BACKENDS)
        for name, what in (("p2p_latency_s", "seconds"), ("sync_latency_scale", "(a multiplier)"),
                           ("step_end_wait_s", "seconds")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not (value >= 0 and math.isfinite(value))):
                raise ClusterSpecError(f"Cluster.{name} must be >= 0 {what} or None, got {value!r}")
        if self.step_end_wait_s is None:  # a cluster file's null: none
            object.__setattr__(self, "step_end_wait_s", 0.0)
        if isinstance(self.device, dict):
            object.__setattr__(self, "device", Device.from_dict(self.device, "Cluster.device"))
        for name in _LINK_FIELDS:
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, Link.from_dict(getattr(self, name), f"Cluster.{name}"))
        for name, cls in (("device", Device),) + tuple((n, Link) for n in _LINK_FIELDS):
            if not isinstance(getattr(self, name), cls):
                raise ClusterSpecError(f"Cluster.{name} must be a {cls.__name__} or a mapping, "
                                       f"got {getattr(self, name)!r}")

    # ---- derived facts ----------------------------------------------------------------------

    @property
    def default_dtype(self) -> str:
        """The dtype a plan on this cluster trains in when none is given, at every front door:
        ``bf16`` on GPUs (NCCL), ``fp32`` on CPU ranks (gloo), whose 16-bit matmuls are no faster."""
        return "bf16" if self.backend == "nccl" else "fp32"

    @property
    def world_size(self) -> int:
        """Total number of ranks: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    @property
    def nics_per_node(self) -> int:
        """Inter-node NICs per node (``inter_node.count``)."""
        return self.inter_node.count

    def node_of(self, rank: int) -> int:
        """The node of ``rank`` (node-major layout)."""
        if not 0 <= rank < self.world_size:
            raise ClusterSpecError(f"rank {rank} is outside the cluster's world of {self.world_size} ranks")
        return rank // self.devices_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        """The same cluster with ``nodes`` nodes."""
        return dataclasses.replace(self, nodes=nodes)

    # ---- serialization ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, where: str = "cluster") -> Cluster:
        """Build from a mapping as written in a cluster file (values may carry units)."""
        nested = {"device": Device} | {name: Link for name in _LINK_FIELDS}
        return _from_dict(cls, data, where, nested)

    def to_dict(self) -> dict:
        """Plain-number mapping (bytes, bytes/s, FLOP/s, seconds); ``from_dict`` reads it back."""
        return {"name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "backend": self.backend, "device": self.device.to_dict(),
                "intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict(),
                "host_memory_bytes": self.host_memory_bytes,
                "host_to_device": self.host_to_device.to_dict(),
                **({"p2p_latency_s": self.p2p_latency_s} if self.p2p_latency_s is not None else {}),
                **({"sync_latency_scale": self.sync_latency_scale} if self.sync_latency_scale is not None else {}),
                **({"step_end_wait_s": self.step_end_wait_s} if self.step_end_wait_s else {}),
                **({"compute_slots_per_node": self.compute_slots_per_node}
                   if self.compute_slots_per_node is not None else {})}

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """Read a ``.yaml``/``.yml`` or ``.json`` cluster file."""
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ClusterSpecError(f"cannot read cluster file {path}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ClusterSpecError(f"cluster file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                                   f"{e.start}); give a YAML or JSON cluster file, e.g. a copy of "
                                   f"{PRESET_DIR / 'dgx-a100-80gb.yaml'}") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_Loader)
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            mark = getattr(e, "problem_mark", None)  # one line: the problem and where, not PyYAML's excerpt
            what = f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None and \
                getattr(e, "problem", None) else str(e).splitlines()[0]
            raise ClusterSpecError(f"cluster file {path} is not valid {path.suffix[1:] or 'YAML'}: {what}") from e
        try:
            return cls.from_dict(data)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"in cluster file {path}: {e}") from None

    def to_file(self, path: str | Path) -> Path:
        """Write as JSON when ``path`` ends in ``.json``, else YAML; returns the path."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        text = json.dumps(data, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        path.write_text(text)
        return path

    # ---- presets and local machine ----------------------------------------------------------

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names of the built-in presets."""
        return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> Cluster:
        """A built-in preset (see :meth:`presets`) with ``nodes`` nodes."""
        path = PRESET_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ClusterSpecError(f"unknown cluster preset {name!r}; known presets: {', '.join(cls.presets())}, "
                                   f"or pass the path of a .yaml/.json cluster file")
        return cls.from_file(path).with_nodes(nodes)

    @classmethod
    def load(cls, preset_or_path: str | Path, nodes: int | None = None) -> Cluster:
        """A preset name or a cluster file path; ``nodes`` overrides the node count if given."""
        text = str(preset_or_path)
        is_path = isinstance(preset_or_path, Path) or text.endswith((".yaml", ".yml", ".json")) or os.sep in text
        cluster = cls.from_file(text) if is_path else cls.preset(text)
        return cluster if nodes is None else cluster.with_nodes(nodes)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e9`` (no dot) as a float; YAML 1.1 would read it as text."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
