"""Describe the GPU job this process runs in as a :class:`~partitioner.cost.cluster.Cluster`, without a preset.

A planner that runs inside a training job (``torchrun ... train.py``) should not need the user
to name the machine: the GPU says what it is (``torch.cuda.get_device_properties``), the launcher
says how many ranks there are and how many share a node (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``),
and ``nvidia-smi topo -m`` says whether the GPUs of a node talk over NVLink or PCIe. This module
turns those facts into a Cluster:

* :data:`GPU_TABLE` holds datasheet numbers (dense peak FLOP/s, memory bandwidth, NVLink and PCIe
  bandwidth) of the GPUs we know, each with the rule that recognises it from its properties;
* :func:`match_gpu` and :func:`gpu_device` map a :class:`GpuProperties` to its entry and Device;
* :func:`job_shape` reads the job's nodes x ranks from the launcher's environment;
* :func:`parse_nvidia_smi_topo` / :func:`intra_node_kind` find the intra-node link;
* :func:`gpu_cluster` puts them together, :func:`detect_cluster` does all of it in a real job,
  and :func:`describe` prints the result in one line.

Everything but :meth:`GpuProperties.from_torch`, :func:`intra_node_kind` and :func:`detect_cluster`
is a pure function of its arguments, so the tests feed them the properties of GPUs the test
machine does not have.

What detection cannot see is the network between nodes: :func:`gpu_cluster` takes it from its
``inter_node`` argument (a calibration's or a named preset's), else from the preset of the GPU's
DGX node when the table names one, else from a deliberately conservative guess
(:data:`DEFAULT_INTER_NODE`). Link latencies are estimates, like the presets' (calibrate to
replace them). Every node is assumed to hold the GPU this process sees.

Units as in :mod:`partitioner.cost.cluster`: bytes, bytes/s per direction, FLOP/s, seconds.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from partitioner.cost.cluster import Cluster, Device, Link, PeakFlops
from passes.ir.errors import ClusterSpecError
from passes.ir.launcher_env import scrubbed_env

GiB = 2**30
G = 1e9   # giga: GB/s, as the presets' "300GB/s" parse (300 * 1e9)
T = 1e12  # tera: TB/s and TFLOP/s, written as the presets' numbers parse ("3.35TB/s" -> 3.35 * 1e12)
P = 1e15  # peta: PFLOP/s

NVLINK_LATENCY_S = 3e-6
"""Seconds of α for an NVLink/NVSwitch hop: an order-of-magnitude estimate, as in the presets."""
PCIE_LATENCY_S = 5e-6
"""Seconds of α for a PCIe hop (GPU to GPU or host to GPU): an estimate, as in the presets."""
DEFAULT_INTER_NODE = Link(kind="ethernet", bandwidth_bytes_per_s=100 * G / 8, latency_s=10e-6, count=1)
"""The inter-node link when neither the caller nor a preset gives one: ONE 100 Gb/s Ethernet NIC
per node at 10 us, a guess chosen low so that a plan does not lean on a network it may not have.
Pass the real one (from a calibration or a named preset) to :func:`gpu_cluster`."""
TOPO_TIMEOUT_S = 10.0
"""Seconds ``nvidia-smi topo -m`` may take before :func:`intra_node_kind` gives up on it."""


@dataclass(kw_only=True, frozen=True, slots=True)
class GpuProperties:
    """What CUDA reports about one GPU (``torch.cuda.get_device_properties``)."""

    name: str
    """Marketing name as the driver reports it, e.g. ``"NVIDIA H100 80GB HBM3"``."""
    total_memory_bytes: int
    """Device memory in bytes as reported (a little under the datasheet's: 79.1 GiB on an "80GB" H100)."""
    multi_processor_count: int
    """Streaming multiprocessors (SMs) this device exposes (fewer on a MIG slice)."""
    major: int
    """Compute capability, major (9 for Hopper)."""
    minor: int
    """Compute capability, minor."""

    @classmethod
    def from_torch(cls, index: int) -> GpuProperties:
        """The properties of CUDA device ``index``; :class:`ClusterSpecError` when CUDA is unavailable."""
        import torch  # lazily: importing this module must not need torch's CUDA state

        if not torch.cuda.is_available():
            raise ClusterSpecError("no CUDA device is visible to this process, so there is no GPU to detect; "
                                   "pass a cluster preset or file instead (see partitioner.calibration.detect.match_gpu)")
        p = torch.cuda.get_device_properties(index)
        return cls(name=p.name, total_memory_bytes=int(p.total_memory), multi_processor_count=p.multi_processor_count,
                   major=p.major, minor=p.minor)

    def summary(self) -> str:
        """``'NVIDIA H100 80GB HBM3' (79.1 GiB, 132 SMs, compute capability 9.0)``, for messages."""
        return (f"{self.name!r} ({self.total_memory_bytes / GiB:.1f} GiB, {self.multi_processor_count} SMs, "
                f"compute capability {self.major}.{self.minor})")


def _name_tokens(name: str) -> set[str]:
    """The words of a device name, upper case: ``"NVIDIA A100-SXM4-80GB"`` -> NVIDIA, A100, SXM4, 80GB.

    Rules match whole words, not substrings: "L4" is a substring of "L40S" and "H200" of "GH200".
    """
    return {t for t in re.split(r"[^0-9A-Z]+", name.upper()) if t}


@dataclass(kw_only=True, frozen=True, slots=True)
class GpuSpec:
    """One GPU model: the rule that recognises it and its datasheet numbers."""

    name: str
    """Canonical name, the Device's (and the preset's, where one exists), e.g. ``"H100-SXM5-80GB"``."""
    name_words: tuple[str, ...]
    """Words (upper case) the reported name must all contain, e.g. ``("H100",)``."""
    name_excludes: tuple[str, ...]
    """Words the reported name must not contain, e.g. ``("PCIE", "NVL")`` for the SXM part."""
    memory_gib: tuple[float, float]
    """Range of the REPORTED memory in GiB (lower bound inclusive, upper exclusive): tells 40 from 80 GB parts."""
    sms: int
    """SM count the full device reports; a MIG slice reports fewer and so matches no entry."""
    capability: tuple[int, int]
    """Compute capability (major, minor)."""
    peak_flops: PeakFlops
    """Dense (no sparsity) peak FLOP/s per dtype."""
    memory_bandwidth_bytes_per_s: float
    """Device memory (HBM/GDDR) bandwidth, bytes/s."""
    nvlink_bytes_per_s: float | None
    """NVLink bandwidth per GPU per direction, bytes/s, of parts whose board wires every GPU to every
    other over NVLink (SXM on HGX/DGX); ``None`` for PCIe cards."""
    nvlink_bridge_bytes_per_s: float | None
    """NVLink bridge bandwidth per GPU per direction, bytes/s, of PCIe cards that take a bridge
    (it joins two cards, so a node is all-NVLink only when the job uses one bridged pair); ``None`` if none."""
    pcie_bytes_per_s: float
    """Host link (PCIe generation x16) bandwidth per direction, bytes/s."""
    preset: str | None
    """The built-in preset of this GPU's DGX node (``partitioner/cost/presets``), or ``None``."""

    def matches(self, props: GpuProperties) -> bool:
        """Whether ``props`` is this GPU: name words, reported memory range, SM count and capability."""
        words = _name_tokens(props.name)
        lo, hi = self.memory_gib
        return (all(w in words for w in self.name_words) and not any(w in words for w in self.name_excludes)
                and lo <= props.total_memory_bytes / GiB < hi and props.multi_processor_count == self.sms
                and (props.major, props.minor) == self.capability)

    @property
    def has_nvlink(self) -> bool:
        """Whether the part has NVLink to its peers at all (baseboard or bridge)."""
        return bool(self.nvlink_bytes_per_s or self.nvlink_bridge_bytes_per_s)


# The table. Peaks are DENSE: NVIDIA datasheets mark the tensor-core TF32/BF16/FP16 figures "with
# sparsity" (*), the dense rate is half. "Per direction" halves the bidirectional figures datasheets
# quote for NVLink and PCIe (PCIe Gen4 x16: 64 GB/s both ways = 32 GB/s each; Gen5 x16: 128 = 64).
# Reported memory ranges are generous around what torch reports (e.g. 79.1 GiB for 80 GB parts).
_A100_PEAKS = PeakFlops(fp32=19.5 * T, tf32=156 * T, bf16=312 * T, fp16=312 * T)
"""Every A100 (SXM and PCIe, 40 and 80 GB): the same 108 SMs at the same clocks."""
_HOPPER_SXM_PEAKS = PeakFlops(fp32=67 * T, tf32=494.5 * T, bf16=989 * T, fp16=989 * T)
"""H100 SXM and H200: the same GH100 die and clocks (the H200 differs in memory only)."""

GPU_TABLE: tuple[GpuSpec, ...] = (
    # "NVIDIA A100 Tensor Core GPU" datasheet, A100 40GB SXM: FP32 19.5, TF32 156 (312*), BF16/FP16
    # 312 (624*) TFLOP/s; 1,555 GB/s HBM2; NVLink 600 GB/s; PCIe Gen4 64 GB/s. 108 SMs (A100 whitepaper).
    GpuSpec(name="A100-SXM4-40GB", name_words=("A100",), name_excludes=("PCIE",), memory_gib=(30, 45), sms=108,
            capability=(8, 0), peak_flops=_A100_PEAKS,
            memory_bandwidth_bytes_per_s=1555 * G, nvlink_bytes_per_s=300 * G, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=32 * G, preset="dgx-a100-40gb"),
    # Same datasheet, A100 80GB SXM: same compute; 2,039 GB/s HBM2e; NVLink 600 GB/s; PCIe Gen4 64 GB/s.
    GpuSpec(name="A100-SXM4-80GB", name_words=("A100",), name_excludes=("PCIE",), memory_gib=(70, 85), sms=108,
            capability=(8, 0), peak_flops=_A100_PEAKS,
            memory_bandwidth_bytes_per_s=2039 * G, nvlink_bytes_per_s=300 * G, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=32 * G, preset="dgx-a100-80gb"),
    # Same datasheet, A100 40GB PCIe ("NVIDIA A100-PCIE-40GB"): same compute; 1,555 GB/s; NVLink bridge
    # for 2 GPUs 600 GB/s; PCIe Gen4 64 GB/s.
    GpuSpec(name="A100-PCIE-40GB", name_words=("A100", "PCIE"), name_excludes=(), memory_gib=(30, 45), sms=108,
            capability=(8, 0), peak_flops=_A100_PEAKS,
            memory_bandwidth_bytes_per_s=1555 * G, nvlink_bytes_per_s=None, nvlink_bridge_bytes_per_s=300 * G,
            pcie_bytes_per_s=32 * G, preset=None),
    # Same datasheet, A100 80GB PCIe ("NVIDIA A100 80GB PCIe"): same compute; 1,935 GB/s HBM2e; NVLink
    # bridge for 2 GPUs 600 GB/s; PCIe Gen4 64 GB/s.
    GpuSpec(name="A100-PCIE-80GB", name_words=("A100", "PCIE"), name_excludes=(), memory_gib=(70, 85), sms=108,
            capability=(8, 0), peak_flops=_A100_PEAKS,
            memory_bandwidth_bytes_per_s=1935 * G, nvlink_bytes_per_s=None, nvlink_bridge_bytes_per_s=300 * G,
            pcie_bytes_per_s=32 * G, preset=None),
    # "NVIDIA H100 Tensor Core GPU" datasheet, SXM column (reported as "NVIDIA H100 80GB HBM3"): FP32 67,
    # TF32 989*, BF16/FP16 1,979* TFLOP/s (dense: half, 494.5 and 989 as dgx-h100.yaml writes them);
    # 3.35 TB/s HBM3; NVLink 900 GB/s; PCIe Gen5 128 GB/s. 132 SMs (H100 whitepaper).
    GpuSpec(name="H100-SXM5-80GB", name_words=("H100",), name_excludes=("PCIE", "NVL"), memory_gib=(70, 85),
            sms=132, capability=(9, 0),
            peak_flops=_HOPPER_SXM_PEAKS,
            memory_bandwidth_bytes_per_s=3.35 * T, nvlink_bytes_per_s=450 * G, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=64 * G, preset="dgx-h100"),
    # Same datasheet, PCIe column ("NVIDIA H100 PCIe"): FP32 51, TF32 756*, BF16/FP16 1,513* TFLOP/s
    # (dense 378 and 756, rounded down as the SXM's 989); 2 TB/s HBM2e; NVLink bridge 600 GB/s;
    # PCIe Gen5 128 GB/s. 114 SMs (H100 whitepaper), which with the name tells it from the SXM part.
    GpuSpec(name="H100-PCIE-80GB", name_words=("H100", "PCIE"), name_excludes=(), memory_gib=(70, 85), sms=114,
            capability=(9, 0), peak_flops=PeakFlops(fp32=51 * T, tf32=378 * T, bf16=756 * T, fp16=756 * T),
            memory_bandwidth_bytes_per_s=2 * T, nvlink_bytes_per_s=None, nvlink_bridge_bytes_per_s=300 * G,
            pcie_bytes_per_s=64 * G, preset=None),
    # "NVIDIA H200 Tensor Core GPU" datasheet, SXM column ("NVIDIA H200"): compute as the H100 SXM;
    # 141 GB HBM3e at 4.8 TB/s (torch reports ~139.8 GiB); NVLink 900 GB/s; PCIe Gen5 128 GB/s; 132 SMs.
    # Not the H200 NVL (a PCIe card, "NVL" in its name) nor GH200 (another word).
    GpuSpec(name="H200-SXM-141GB", name_words=("H200",), name_excludes=("NVL", "PCIE"), memory_gib=(130, 150),
            sms=132, capability=(9, 0),
            peak_flops=_HOPPER_SXM_PEAKS,
            memory_bandwidth_bytes_per_s=4.8 * T, nvlink_bytes_per_s=450 * G, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=64 * G, preset="dgx-h200"),
    # NVIDIA HGX platform page, "HGX B200" per-GPU column (with sparsity, dense is half): FP16/BF16 4.5
    # PFLOP/s*, TF32 2.2 PFLOP/s*, FP32 75 TFLOP/s; 180 GB HBM3e at 7.7 TB/s (the DGX B200 datasheet's
    # 64 TB/s for 8 GPUs would be 8 TB/s; we take the per-GPU figure); 5th-gen NVLink 1.8 TB/s;
    # PCIe Gen5 128 GB/s. 148 SMs and ~178 GiB as torch reports a B200. No preset: GB200 is another word.
    GpuSpec(name="B200-SXM-180GB", name_words=("B200",), name_excludes=(), memory_gib=(170, 200), sms=148,
            capability=(10, 0), peak_flops=PeakFlops(fp32=75 * T, tf32=1.1 * P, bf16=2.25 * P, fp16=2.25 * P),
            memory_bandwidth_bytes_per_s=7.7 * T, nvlink_bytes_per_s=900 * G, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=64 * G, preset=None),
    # "NVIDIA L4 Tensor Core GPU" datasheet: FP32 30.3, TF32 120*, BF16/FP16 242* TFLOP/s (dense 60 and
    # 121); 24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16 64 GB/s; no NVLink. 58 SMs (7,424 CUDA cores / 128).
    GpuSpec(name="L4-24GB", name_words=("L4",), name_excludes=(), memory_gib=(20, 25), sms=58, capability=(8, 9),
            peak_flops=PeakFlops(fp32=30.3 * T, tf32=60 * T, bf16=121 * T, fp16=121 * T),
            memory_bandwidth_bytes_per_s=300 * G, nvlink_bytes_per_s=None, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=32 * G, preset=None),
    # "NVIDIA L40S" datasheet: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*) TFLOP/s; 48 GB GDDR6
    # at 864 GB/s; PCIe Gen4 x16 64 GB/s; no NVLink. 142 SMs (18,176 CUDA cores / 128; 142 RT cores).
    GpuSpec(name="L40S-48GB", name_words=("L40S",), name_excludes=(), memory_gib=(40, 50), sms=142,
            capability=(8, 9), peak_flops=PeakFlops(fp32=91.6 * T, tf32=183 * T, bf16=362.05 * T, fp16=362.05 * T),
            memory_bandwidth_bytes_per_s=864 * G, nvlink_bytes_per_s=None, nvlink_bridge_bytes_per_s=None,
            pcie_bytes_per_s=32 * G, preset=None),
)


def match_gpu(props: GpuProperties) -> GpuSpec:
    """The :data:`GPU_TABLE` entry of ``props``; :class:`ClusterSpecError` naming what was found and
    what to pass instead when no entry (or, a table bug, more than one) matches."""
    found = [spec for spec in GPU_TABLE if spec.matches(props)]
    if len(found) == 1:
        return found[0]
    if found:
        raise ClusterSpecError(f"GPU {props.summary()} matches several entries of partitioner.calibration.detect.GPU_TABLE "
                               f"({', '.join(s.name for s in found)}); pass a cluster preset or file instead")
    raise ClusterSpecError(
        f"cannot describe GPU {props.summary()}: it is not in partitioner.calibration.detect.GPU_TABLE "
        f"({', '.join(s.name for s in GPU_TABLE)}), or it is a MIG slice of one. Say what the machine is instead: "
        f"a preset, e.g. cluster=\"dgx-h100\" (presets: {', '.join(Cluster.presets())}), or a cluster file, "
        f"written by hand (docs/cluster_schema.md) or measured by `partitioner calibrate`, passed as "
        f"cluster=\"path.yaml\" or PARTITIONER_CLUSTER_FILE=path.yaml")


def gpu_device(props: GpuProperties) -> Device:
    """The Device of ``props``: the table's name, peaks and memory bandwidth, and the memory in bytes
    that CUDA reports (what a plan can allocate, not the datasheet's round number)."""
    spec = match_gpu(props)
    return Device(name=spec.name, memory_bytes=props.total_memory_bytes,
                  memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s, peak_flops=spec.peak_flops)


# ---------------------------------------------------------------------------------------------
# The job's shape
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True, slots=True)
class JobShape:
    """How many ranks a job has and how many share a node; ranks are node-major."""

    world_size: int
    """Ranks in the job."""
    local_world_size: int
    """Ranks (GPUs) per node."""
    nodes: int
    """``world_size // local_world_size``."""


def _env_count(env: Mapping[str, str], key: str) -> int | None:
    text = env.get(key)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ClusterSpecError(f"{key}={text!r} in the environment is not a whole number of ranks") from None


def job_shape(env: Mapping[str, str] | None = None, *, world_size: int | None = None,
              local_world_size: int | None = None) -> JobShape:
    """The job's ranks and nodes from the launcher's environment (``os.environ`` when ``env`` is None).

    ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` are what torchrun sets; explicit arguments win over
    them (e.g. the world size of an initialised process group). Without either, a single process:
    1 rank on 1 node. A world size without a local one is taken as one node. A world that is not
    a whole number of nodes raises :class:`ClusterSpecError`.
    """
    env = os.environ if env is None else env
    world = world_size if world_size is not None else _env_count(env, "WORLD_SIZE")
    local = local_world_size if local_world_size is not None else _env_count(env, "LOCAL_WORLD_SIZE")
    world = 1 if world is None else world
    local = world if local is None else local
    for what, n in (("world size", world), ("local world size", local)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ClusterSpecError(f"the job's {what} must be a whole number >= 1, got {n!r}")
    if world % local:
        raise ClusterSpecError(f"a world of {world} ranks is not a whole number of nodes of {local} ranks "
                               f"(LOCAL_WORLD_SIZE); every node must run the same number of ranks")
    return JobShape(world_size=world, local_world_size=local, nodes=world // local)


# ---------------------------------------------------------------------------------------------
# The link inside a node
# ---------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"^GPU\d+$")
_NV = re.compile(r"^NV\d+$")


def parse_nvidia_smi_topo(text: str) -> str:
    """``"nvlink"`` when every GPU-to-GPU cell of ``nvidia-smi topo -m`` output is an NVLink bond
    (``NV18``, ``NV12``, ...), else ``"pcie"`` (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``).

    All cells, not any: a ring over the node's GPUs is as slow as its slowest hop, so cards joined
    in bridged pairs (NV within a pair, SYS between pairs) are a PCIe node. A single GPU gives ``"pcie"``.
    Raises ``ValueError`` when ``text`` holds no GPU matrix (not ``topo -m`` output).
    """
    rows = [line.split() for line in _ANSI.sub("", text).splitlines()]
    header = next((r for r in rows if r and _GPU.match(r[0]) and not any(c == "X" for c in r)), None)
    gpu_rows = [r for r in rows if r and _GPU.match(r[0]) and "X" in r]
    if header is None or not gpu_rows:
        raise ValueError("no GPU matrix in the text: expected `nvidia-smi topo -m` output")
    n = sum(1 for c in header if _GPU.match(c))  # the GPU columns come first
    cells = [c for r in gpu_rows for c in r[1:1 + n] if c != "X"]
    return "nvlink" if cells and all(_NV.match(c) for c in cells) else "pcie"


def _peer_access_kind(local_world_size: int, spec: GpuSpec | None) -> str:
    """Without ``nvidia-smi``: ``"nvlink"`` for an NVLink baseboard part (SXM) whose local GPUs all
    reach each other peer to peer (HGX boards wire them over NVLink), else ``"pcie"``, since peer
    access alone does not tell NVLink from PCIe."""
    import torch

    n = min(local_world_size, torch.cuda.device_count())
    if spec is None or not spec.nvlink_bytes_per_s or n < 2:
        return "pcie"
    peers = all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)
    return "nvlink" if peers else "pcie"


def _this_spec() -> GpuSpec | None:
    """The table entry of this process's CUDA device, ``None`` when there is none or it is unknown."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return match_gpu(GpuProperties.from_torch(torch.cuda.current_device()))
    except ClusterSpecError:
        return None


def intra_node_kind(local_world_size: int, *, spec: GpuSpec | None = None) -> str:
    """``"nvlink"`` or ``"pcie"``: how this node's GPUs talk, in a real job (asks CUDA and nvidia-smi).

    One rank per node never uses the link: ``"nvlink"`` when the GPU (``spec``, else this process's
    device) has NVLink, else ``"pcie"``. Otherwise ``nvidia-smi topo -m`` (within
    :data:`TOPO_TIMEOUT_S`) through :func:`parse_nvidia_smi_topo`; if that fails in any way, peer
    access between the local devices (:func:`_peer_access_kind`). Tests without CUDA call
    :func:`parse_nvidia_smi_topo` instead.
    """
    if spec is None:
        spec = _this_spec()
    if local_world_size <= 1:
        return "nvlink" if spec is not None and spec.has_nvlink else "pcie"
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=TOPO_TIMEOUT_S,
                             check=True, env=scrubbed_env()).stdout
        return parse_nvidia_smi_topo(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return _peer_access_kind(local_world_size, spec)


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------


def _intra_link(spec: GpuSpec, kind: str, preset: Cluster | None) -> Link:
    if kind == "pcie":
        return Link(kind="pcie", bandwidth_bytes_per_s=spec.pcie_bytes_per_s, latency_s=PCIE_LATENCY_S)
    if kind != "nvlink":
        raise ClusterSpecError(f"intra_node_kind must be 'nvlink' or 'pcie', got {kind!r}")
    if spec.nvlink_bytes_per_s:  # DGX nodes switch their NVLinks: say so as the preset does
        switched = preset is not None and preset.intra_node.kind == "nvswitch"
        return Link(kind="nvswitch" if switched else "nvlink", bandwidth_bytes_per_s=spec.nvlink_bytes_per_s,
                    latency_s=NVLINK_LATENCY_S)
    if spec.nvlink_bridge_bytes_per_s:
        return Link(kind="nvlink", bandwidth_bytes_per_s=spec.nvlink_bridge_bytes_per_s, latency_s=NVLINK_LATENCY_S)
    raise ClusterSpecError(f"intra_node_kind='nvlink', but the {spec.name} has no NVLink; pass 'pcie', "
                           f"or a cluster file that describes this node")


def gpu_cluster(props: GpuProperties, shape: JobShape, *, intra_node_kind: str, inter_node: Link | None = None,
                host_memory_bytes: int | None = None) -> Cluster:
    """The Cluster of a job of ``shape`` on GPUs like ``props``.

    ``intra_node_kind`` (``"nvlink"`` or ``"pcie"``, see :func:`intra_node_kind`) picks the table's
    NVLink (kind ``nvswitch`` where the GPU's DGX preset says so) or PCIe bandwidth per direction.
    ``inter_node`` is what detection cannot see: pass the link of a calibration or a named preset;
    without it, the GPU's DGX preset's NICs where the table names a preset, else
    :data:`DEFAULT_INTER_NODE` (a guess). ``host_memory_bytes``: bytes of CPU memory per node,
    default this host's (``partitioner.calibration.measure.host_memory_bytes``). Latencies are estimates.
    """
    spec = match_gpu(props)
    preset = Cluster.preset(spec.preset) if spec.preset else None
    if inter_node is None:
        inter_node = preset.inter_node if preset is not None else DEFAULT_INTER_NODE
    if host_memory_bytes is None:
        from partitioner.calibration.measure import host_memory_bytes as this_host_memory  # lazily: it imports the runtime

        host_memory_bytes = this_host_memory()
    return Cluster(
        name=f"detected: {shape.nodes} x {shape.local_world_size} {spec.name}", nodes=shape.nodes,
        devices_per_node=shape.local_world_size, backend="nccl", device=gpu_device(props),
        intra_node=_intra_link(spec, intra_node_kind, preset), inter_node=inter_node,
        host_memory_bytes=host_memory_bytes,
        host_to_device=Link(kind="pcie", bandwidth_bytes_per_s=spec.pcie_bytes_per_s, latency_s=PCIE_LATENCY_S))


def _si(value: float, unit: str) -> str:
    """``value`` with an SI prefix and 3 significant digits: ``989 TFLOP/s``, ``1.2 GB/s``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def describe(cluster: Cluster) -> str:
    """``cluster`` in one line: nodes x devices, device, memory GiB, peak FLOP/s, the links."""
    d, intra, inter = cluster.device, cluster.intra_node, cluster.inter_node
    nics = f"{inter.count} x " if inter.count > 1 else ""
    return (f"{cluster.nodes} node(s) x {cluster.devices_per_node} {d.name} ({d.memory_bytes / GiB:.1f} GiB, "
            f"fp32 {_si(d.peak_flops.fp32, 'FLOP/s')}, bf16 {_si(d.peak_flops.bf16, 'FLOP/s')}); intra-node "
            f"{intra.kind} {_si(intra.bandwidth_bytes_per_s, 'B/s')}; inter-node {nics}{inter.kind} "
            f"{_si(inter.bandwidth_bytes_per_s, 'B/s')}")
