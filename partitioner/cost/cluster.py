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

import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from passes.ir.errors import ClusterSpecError
from passes.ir.launcher_env import under_launcher

LINK_KINDS = ("nvlink", "nvswitch", "pcie", "infiniband", "roce", "ethernet", "loopback")
BACKENDS = ("nccl", "gloo")
DTYPES = ("fp32", "tf32", "bf16", "fp16")
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "tf32",
                  "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}

PRESET_DIR = Path(__file__).parent / "presets"
CLUSTER_FILE_ENV = "PARTITIONER_CLUSTER_FILE"
"""An explicit cluster file for ``Cluster.local``: used as it is (it must exist), no calibration."""
CACHE_DIR_ENV = "PARTITIONER_CACHE_DIR"
"""Overrides where calibrations are cached (default: the user cache directory, see :func:`cache_dir`)."""
DEFAULT_LOCAL_FILE = Path("~/.cache/partitioner/local-cluster.yaml")
"""Where ``calibrate`` wrote before calibrations were cached per machine; no longer read."""
CALIBRATION_VERSION = 6
"""Part of every cache key: raise it when what a calibration measures or fits changes, so that
an older cached file is not read as a current one."""

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
        key = _DTYPE_ALIASES.get(str(dtype).removeprefix("torch."))
        if key is None:
            raise ClusterSpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return getattr(self, key)

    @classmethod
    def from_dict(cls, data: Any, where: str = "peak_flops") -> PeakFlops:
        return _from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in DTYPES}


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

    def __post_init__(self) -> None:
        _normalize(self, "memory_bytes", "bytes", "give the device memory, e.g. '80GiB'")
        _normalize(self, "memory_bandwidth_bytes_per_s", "bytes_per_s",
                   "give the memory bandwidth, e.g. '2039GB/s'")
        if isinstance(self.peak_flops, dict):
            object.__setattr__(self, "peak_flops", PeakFlops.from_dict(self.peak_flops, "Device.peak_flops"))
        if not isinstance(self.peak_flops, PeakFlops):
            raise ClusterSpecError(f"Device.peak_flops must be a mapping of dtype to FLOP/s, got {self.peak_flops!r}")
        for name in ("kernel_overhead_s", "step_overhead_s", "offload_call_s", "optimizer_bytes_per_s",
                     "optimizer_tensor_s"):
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
                                                          "optimizer_bytes_per_s", "optimizer_tensor_s")
                   if getattr(self, name)}}


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

    def __post_init__(self) -> None:
        _choice(self, "kind", LINK_KINDS)
        _normalize(self, "bandwidth_bytes_per_s", "bytes_per_s",
                   "give the one-direction bandwidth, e.g. '300GB/s' or '200Gb/s'")
        _normalize(self, "latency_s", "seconds", "give the latency, e.g. '5us'", allow_zero=True)
        _count(self, "count", "give the number of parallel links (NICs per node), at least 1")

    @property
    def aggregate_bytes_per_s(self) -> float:
        """``count * bandwidth_bytes_per_s``: all links of this kind of one node together."""
        return self.count * self.bandwidth_bytes_per_s

    @classmethod
    def from_dict(cls, data: Any, where: str = "link") -> Link:
        return _from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "latency_s": self.latency_s, "count": self.count}


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
        for name, what in (("p2p_latency_s", "seconds"), ("sync_latency_scale", "(a multiplier)")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not (value >= 0 and math.isfinite(value))):
                raise ClusterSpecError(f"Cluster.{name} must be >= 0 {what} or None, got {value!r}")
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

    @classmethod
    def detect(cls, world_size: int | None = None) -> Cluster:
        """The cluster this job runs on, as far as this process can see it: the default of
        ``auto_parallelize`` and ``partitioner train`` (see :func:`partitioner.cost.detect.detect_cluster`).

        The job's shape from the process group or the launcher (nodes = world / local world);
        GPUs from their properties (a table of datasheet peaks, NVLink or PCIe between them, the
        node preset's inter-node link); CPU ranks from this machine's calibration, measured by the
        job's own ranks the first time. ``$PARTITIONER_CLUSTER_FILE`` overrides the description
        (the job's shape still applies). ``world_size``: the job's ranks when no launcher says.
        """
        from partitioner.cost.detect import detect_cluster

        return detect_cluster(world_size)

    @classmethod
    def local(cls, world_size: int, backend: str = "gloo") -> Cluster:
        """This machine as one node of ``world_size`` ranks.

        Reads the file named by ``$PARTITIONER_CLUSTER_FILE`` when set (it must exist). Otherwise,
        for gloo, this machine's cached calibration (:func:`cached_local_cluster`), measured the
        first time it is needed; for nccl, this machine's GPUs as :meth:`detect` sees them (an
        error without CUDA: the CPU calibration says nothing about GPUs).
        """
        env = os.environ.get(CLUSTER_FILE_ENV)
        if env:
            base = cls.from_file(env)  # an explicit request: a missing file is an error
        elif backend == "gloo":
            base = cached_local_cluster(world_size)
        else:  # the calibration measures CPU processes on gloo: it says nothing about GPUs
            import torch

            from partitioner.cost.detect import detect_cluster

            if not torch.cuda.is_available():
                raise ClusterSpecError(
                    f"Cluster.local({world_size}, backend={backend!r}): no CUDA device is visible to this process; "
                    f"plan CPU ranks with backend='gloo', or GPUs elsewhere with a preset "
                    f"({', '.join(cls.presets())}) or a cluster file")
            return dataclasses.replace(detect_cluster(world_size), nodes=1, devices_per_node=world_size)
        return dataclasses.replace(base, nodes=1, devices_per_node=world_size, backend=backend)


# ---------------------------------------------------------------------------------------------
# The per-machine calibration cache
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where calibrations are cached: ``$PARTITIONER_CACHE_DIR``, else ``$XDG_CACHE_HOME/partitioner``,
    else ``~/.cache/partitioner``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    # the XDG base-directory rule (platformdirs is not a dependency): a relative
    # $XDG_CACHE_HOME is invalid and ignored
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path("~/.cache").expanduser()
    return base / "partitioner"


@dataclass(kw_only=True, frozen=True, slots=True)
class MachineKey:
    """What a local calibration depends on: two setups that differ in any field are measured
    separately (a copied home directory, a new torch, another world size)."""

    cpu: str
    """CPU model name (``/proc/cpuinfo``)."""
    cores: int
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    torch_version: str
    """``torch.__version__``: kernels and dispatch overheads change between releases."""
    world_size: int
    """Local gloo ranks the calibration was measured for."""
    threads_per_rank: int
    """torch threads per rank (``calibrate.rank_threads``)."""
    version: int = CALIBRATION_VERSION
    """:data:`CALIBRATION_VERSION` when it was written."""

    @classmethod
    def this_machine(cls, world_size: int) -> MachineKey:
        """The key of this machine for ``world_size`` local ranks."""
        import torch

        from partitioner.calibration.calibrate import cpu_count, cpu_name, rank_threads

        return cls(cpu=cpu_name(), cores=cpu_count(), torch_version=torch.__version__,
                   world_size=world_size, threads_per_rank=rank_threads(world_size))

    def file_name(self) -> str:
        """``local-w<ranks>-t<threads>-c<cores>-torch<version>-<hash>.yaml``: readable, and the
        hash of every field (the CPU name too) makes it unique."""
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        torch_tag = re.sub(r"[^0-9A-Za-z.]+", "_", self.torch_version)
        return f"local-w{self.world_size}-t{self.threads_per_rank}-c{self.cores}-torch{torch_tag}-{digest}.yaml"


def local_cache_file(world_size: int) -> Path:
    """The cached calibration of this machine for ``world_size`` gloo ranks (it may not exist yet)."""
    return cache_dir() / MachineKey.this_machine(world_size).file_name()


def cached_local_cluster(world_size: int) -> Cluster:
    """This machine's calibrated cluster for ``world_size`` gloo ranks, from the cache; on a miss
    it is measured, cached, and one line on stderr says so.

    Inside a job of ``world_size`` ranks (a process group initialised: torchrun, ``spawn``, any
    launcher; every rank calls this) the job's own ranks calibrate
    (:func:`partitioner.calibration.calibrate.calibrate_in_job`) and rank 0's answer, read or measured, is
    every rank's. Outside a job, :func:`partitioner.calibration.calibrate.auto_calibrate` starts the ranks;
    concurrent callers wait for one calibration, not run four."""
    path = local_cache_file(world_size)
    job = _job_world(world_size)
    if job is not None:
        if job != world_size:
            raise ClusterSpecError(
                f"no calibration of this machine for {world_size} rank(s) can be measured inside this job of {job} "
                f"rank(s); plan for the job's own {job} ranks, or run `partitioner calibrate --world-size "
                f"{world_size}` outside the job first")
        return _cached_in_job(path, world_size)
    if path.is_file():
        return read_cached(path, world_size)
    with exclusive_lock(path):
        if path.is_file():  # another process calibrated while this one waited
            return read_cached(path, world_size)
        _refuse_in_daemon(path, world_size)
        from partitioner.calibration.calibrate import auto_calibrate

        _say(f"partitioner: no calibration of this machine for {world_size} gloo rank(s) in {path.parent}; "
             f"measuring it now (about a minute, once)")
        cal = auto_calibrate(world_size, path)
    _say(f"partitioner: calibrated this machine for {world_size} gloo rank(s) in {cal.elapsed_s:.0f} s; "
         f"cached in {path}")
    return cal.cluster


def _job_world(world_size: int) -> int | None:
    """The world size of the job this process is a rank of, else None: its initialised default
    process group, or the launcher's environment (torchrun, ``spawn``), in which case the default
    group is initialised here from env://, as ``auto_parallelize`` would next."""
    launched = under_launcher()
    if "torch.distributed" not in sys.modules and not launched:
        return None  # nothing imported it: no job (and no 2 s import)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if not launched:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world == world_size:
        from runtime.dist.mesh import START_TIMEOUT_S, init_distributed

        init_distributed(timeout_s=START_TIMEOUT_S)
    return world


def _cached_in_job(path: Path, world_size: int) -> Cluster:
    """Rank 0 reads the cache and tells the others; on a miss every rank calibrates together.
    One decision for all ranks: a rank that read a file another had just written would otherwise
    skip the collectives the others are in."""
    import torch.distributed as dist

    from runtime.dist import comm

    rank = dist.get_rank()
    cached = None
    if rank == 0 and path.is_file():
        try:
            cached = ("ok", read_cached(path, world_size).to_dict())
        except ClusterSpecError as e:
            cached = ("error", str(e))
    cached = comm.broadcast_object(cached, src=0)
    if cached is not None:
        if cached[0] == "error":
            raise ClusterSpecError(cached[1])
        return Cluster.from_dict(cached[1])
    from partitioner.calibration.calibrate import calibrate_in_job

    if rank == 0:
        _say(f"partitioner: no calibration of this machine for {world_size} gloo rank(s) in {path.parent}; "
             f"calibrating inside the job with its {world_size} rank(s) (under a minute, once)")
    cal = calibrate_in_job(path)
    if rank == 0:
        _say(f"partitioner: calibrated this machine inside the job in {cal.elapsed_s:.0f} s; cached in {path}")
    return cal.cluster


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def read_cached(path: Path, world_size: int) -> Cluster:
    """The cluster of cache file ``path``; a file that does not read raises
    :class:`ClusterSpecError` naming it and how to rewrite it."""
    try:
        return Cluster.from_file(path)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"the cached calibration {path} is corrupt ({e}); rewrite it with `partitioner "
                               f"calibrate --world-size {world_size}`, or delete it to recalibrate on next use") from None


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of cache file ``path`` (``<path>.lock``; ``filelock``, a torch
    dependency) for the block: one writer at a time."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(path.name + ".lock")):
        yield


def _refuse_in_daemon(path: Path, world_size: int) -> None:
    """A daemonic process (a rank of ``runtime.dist.launch.spawn``) may not start the calibration's
    processes: say what to do instead of failing inside multiprocessing."""
    if multiprocessing.current_process().daemon:
        raise ClusterSpecError(
            f"no cached calibration of this machine for {world_size} rank(s) ({path}), and this process (a "
            f"daemonic process) cannot start the calibration's processes and is not a rank of a {world_size}-rank "
            f"job: call Cluster.local({world_size}) in the launching process or inside the job, or run "
            f"`partitioner calibrate --world-size {world_size}`")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e9`` (no dot) as a float; YAML 1.1 would read it as text."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
