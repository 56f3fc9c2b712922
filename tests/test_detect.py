"""GPU cluster detection from device properties, the launcher's env and `nvidia-smi topo -m` (no CUDA needed)."""
import pytest

from partitioner.cost.cluster import Cluster, Link
from partitioner.calibration.detect import (
    DEFAULT_INTER_NODE, GPU_TABLE, GpuProperties, describe, gpu_cluster, gpu_device, job_shape, match_gpu,
    parse_nvidia_smi_topo,
)
from passes.ir.errors import ClusterSpecError

MiB, GiB, T, G = 2**20, 2**30, 1e12, 1e9


def gpu(name, mib, sms, cc):
    """Properties as torch reports them (memory in MiB as nvidia-smi and torch's repr print it)."""
    return GpuProperties(name=name, total_memory_bytes=mib * MiB, multi_processor_count=sms, major=cc[0], minor=cc[1])


A100_40 = gpu("NVIDIA A100-SXM4-40GB", 40536, 108, (8, 0))
A100_80 = gpu("NVIDIA A100-SXM4-80GB", 81050, 108, (8, 0))
H100 = gpu("NVIDIA H100 80GB HBM3", 81008, 132, (9, 0))  # 79.1 GiB
H100_PCIE = gpu("NVIDIA H100 PCIe", 81008, 114, (9, 0))
H200 = gpu("NVIDIA H200", 143156, 132, (9, 0))  # 139.8 GiB
B200 = gpu("NVIDIA B200", 182631, 148, (10, 0))
L4 = gpu("NVIDIA L4", 23034, 58, (8, 9))
L40S = gpu("NVIDIA L40S", 45589, 142, (8, 9))
UNKNOWN = gpu("NVIDIA GeForce RTX 9090", 32768, 200, (12, 0))


@pytest.mark.parametrize("props,name,fp32,bf16,hbm", [
    (A100_40, "A100-SXM4-40GB", 19.5 * T, 312 * T, 1555 * G),
    (A100_80, "A100-SXM4-80GB", 19.5 * T, 312 * T, 2039 * G),
    (H100, "H100-SXM5-80GB", 67 * T, 989 * T, 3350 * G),
    (H100_PCIE, "H100-PCIE-80GB", 51 * T, 756 * T, 2000 * G),
    (H200, "H200-SXM-141GB", 67 * T, 989 * T, 4800 * G),
    (B200, "B200-SXM-180GB", 75 * T, 2250 * T, 7700 * G),
    (L4, "L4-24GB", 30.3 * T, 121 * T, 300 * G),
    (L40S, "L40S-48GB", 91.6 * T, 362.05 * T, 864 * G),
])
def test_known_gpus_get_datasheet_peaks_and_reported_memory(props, name, fp32, bf16, hbm):
    assert match_gpu(props).name == name
    d = gpu_device(props)
    assert d.name == name
    assert d.memory_bytes == props.total_memory_bytes  # what torch reports, not the datasheet's 80 GB
    assert d.peak_flops.for_dtype("torch.float32") == pytest.approx(fp32)
    assert d.peak_flops.for_dtype("bf16") == pytest.approx(bf16)
    assert d.memory_bandwidth_bytes_per_s == pytest.approx(hbm)


@pytest.mark.parametrize("props,name", [
    (H100, "H100-SXM5-80GB"), (H100_PCIE, "H100-PCIE-80GB"),
    (gpu("NVIDIA H100 PCIe", 81008, 132, (9, 0)), None),  # a PCIe name with the SXM's SMs: neither
    (gpu("NVIDIA H100 80GB HBM3", 81008, 114, (9, 0)), None),  # the PCIe's SMs without its name
    (gpu("NVIDIA H100 NVL", 95830, 132, (9, 0)), None),  # not the SXM part, not in the table
    (gpu("NVIDIA A100 80GB PCIe", 81920, 108, (8, 0)), "A100-PCIE-80GB"),
    (gpu("NVIDIA GH200 480GB", 97871, 132, (9, 0)), None),  # GH200 is not an H200
    (gpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 39936, 42, (8, 0)), None),  # a MIG slice
])
def test_disambiguation_by_name_words_memory_and_sms(props, name):
    if name is None:
        with pytest.raises(ClusterSpecError, match="not in partitioner.calibration.detect.GPU_TABLE"):
            match_gpu(props)
    else:
        assert match_gpu(props).name == name


def test_unknown_gpu_says_what_was_found_and_what_to_pass():
    with pytest.raises(ClusterSpecError) as e:
        gpu_device(UNKNOWN)
    msg = str(e.value)
    for part in ("NVIDIA GeForce RTX 9090", "32.0 GiB", "200 SMs", "12.0", "dgx-h100", "dgx-a100-80gb", "calibrat",
                 "PARTITIONER_CLUSTER_FILE"):
        assert part in msg, part


@pytest.mark.parametrize("spec", [s for s in GPU_TABLE if s.preset], ids=lambda s: s.name)
def test_table_agrees_with_presets(spec):
    preset = Cluster.preset(spec.preset)
    assert spec.name == preset.device.name
    assert spec.peak_flops.to_dict() == pytest.approx(preset.device.peak_flops.to_dict())
    assert spec.memory_bandwidth_bytes_per_s == pytest.approx(preset.device.memory_bandwidth_bytes_per_s)
    assert spec.nvlink_bytes_per_s == pytest.approx(preset.intra_node.bandwidth_bytes_per_s)
    assert spec.pcie_bytes_per_s == pytest.approx(preset.host_to_device.bandwidth_bytes_per_s)
    assert spec.memory_gib[0] <= preset.device.memory_bytes / GiB * 0.98 < spec.memory_gib[1]  # ~2% goes unreported


@pytest.mark.parametrize("props,env,kind,nodes,per_node,link,link_bw,inter", [
    (A100_80, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, "nvlink", 2, 8, "nvswitch", 300 * G, "infiniband"),
    (H100, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, "nvlink", 2, 8, "nvswitch", 450 * G, "infiniband"),
    (H200, {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}, "nvlink", 4, 8, "nvswitch", 450 * G, "infiniband"),
    (B200, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, "nvlink", 1, 8, "nvlink", 900 * G, "ethernet"),
    (H100_PCIE, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "nvlink", 1, 2, "nvlink", 300 * G, "ethernet"),
    (L4, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "pcie", 2, 4, "pcie", 32 * G, "ethernet"),
    (H100, {}, "pcie", 1, 1, "pcie", 64 * G, "infiniband"),
])
def test_gpu_cluster_from_properties_env_and_link(props, env, kind, nodes, per_node, link, link_bw, inter):
    c = gpu_cluster(props, job_shape(env), intra_node_kind=kind, host_memory_bytes=2 * 2**40)
    assert (c.nodes, c.devices_per_node, c.world_size, c.backend) == (nodes, per_node, nodes * per_node, "nccl")
    assert c.name == f"detected: {nodes} x {per_node} {match_gpu(props).name}" and "\n" not in c.name
    assert c.device == gpu_device(props)
    assert (c.intra_node.kind, c.intra_node.bandwidth_bytes_per_s) == (link, pytest.approx(link_bw))
    assert c.intra_node.latency_s == pytest.approx(3e-6 if link != "pcie" else 5e-6)
    assert c.inter_node.kind == inter
    if inter == "ethernet":  # no preset for the GPU: the conservative guess
        assert c.inter_node == DEFAULT_INTER_NODE and c.inter_node.bandwidth_bytes_per_s == pytest.approx(12.5 * G)
    else:
        assert c.inter_node == Cluster.preset(match_gpu(props).preset).inter_node
    assert c.host_to_device.kind == "pcie" and c.host_memory_bytes == 2 * 2**40


def test_given_inter_node_wins_and_nvlink_needs_nvlink():
    ib = Link(kind="infiniband", bandwidth_bytes_per_s="200Gb/s", latency_s="4us", count=4)
    c = gpu_cluster(L40S, job_shape({}), intra_node_kind="pcie", inter_node=ib, host_memory_bytes=GiB)
    assert c.inter_node == ib
    for kind in ("nvlink", "infiniband"):  # an L40S has no NVLink; only nvlink/pcie are intra-node kinds
        with pytest.raises(ClusterSpecError, match="L40S" if kind == "nvlink" else "nvlink' or 'pcie"):
            gpu_cluster(L40S, job_shape({}), intra_node_kind=kind, host_memory_bytes=GiB)


def test_from_torch_without_cuda_says_to_pass_a_cluster(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ClusterSpecError, match="no CUDA device.*preset"):
        GpuProperties.from_torch(0)


def test_describe_is_one_line_with_the_facts():
    line = describe(gpu_cluster(H100, job_shape({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}),
                                intra_node_kind="nvlink", host_memory_bytes=GiB))
    assert "\n" not in line
    for part in ("2 node(s) x 8 H100-SXM5-80GB", "79.1 GiB", "bf16 989 TFLOP/s", "nvswitch 450 GB/s",
                 "8 x infiniband 50 GB/s"):
        assert part in line, (part, line)


@pytest.mark.parametrize("env,kwargs,shape", [
    ({}, {}, (1, 1, 1)),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, {}, (16, 8, 2)),
    ({"WORLD_SIZE": "4"}, {}, (4, 4, 1)),  # no local world size: one node
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, {"world_size": 32}, (32, 8, 4)),  # explicit wins
    ({}, {"world_size": 8, "local_world_size": 4}, (8, 4, 2)),
])
def test_job_shape(env, kwargs, shape):
    s = job_shape(env, **kwargs)
    assert (s.world_size, s.local_world_size, s.nodes) == shape


@pytest.mark.parametrize("env,kwargs,match", [
    ({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}, {}, "12 ranks.*8 ranks"),
    ({"WORLD_SIZE": "16"}, {"local_world_size": 6}, "16 ranks.*6 ranks"),
    ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE='two'"),
    ({}, {"world_size": 0}, ">= 1"),
])
def test_job_shape_refuses_uneven_or_bad_worlds(env, kwargs, match):
    with pytest.raises(ClusterSpecError, match=match):
        job_shape(env, **kwargs)


_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""
_NICS = ["PIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS", "NODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS"]
# DGX H100: 8 GPUs, every pair joined by 18 NVLinks through the NVSwitches; 8 NICs (two rows shown per kind).
DGX_H100_TOPO = "\t" + "\t".join([f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(8)]) + \
    "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n" + "".join(
        f"GPU{i}\t" + "\t".join(" X " if j == i else "NV18" for j in range(8)) + "\t"
        + _NICS[i % 2] + f"\t{'0-55,112-167' if i < 4 else '56-111,168-223'}\t{i // 4}\t\tN/A\n" for i in range(8)) + \
    "NIC0\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\n" + _LEGEND
# 4x L4 on PCIe: two behind one switch (PXB), the others across the host bridge (NODE) or socket (SYS).
L4_TOPO = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tPXB\tNODE\tSYS\t0-31,64-95\t0\t\tN/A
GPU1\tPXB\t X \tNODE\tSYS\t0-31,64-95\t0\t\tN/A
GPU2\tNODE\tNODE\t X \tSYS\t0-31,64-95\t0\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \t32-63,96-127\t1\t\tN/A
""" + _LEGEND
# 4x H100 PCIe joined in bridged pairs: NVLink inside a pair, PCIe between pairs.
BRIDGED_TOPO = "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n" + \
    "GPU0\t X \tNV12\tSYS\tSYS\t0-47\t0\nGPU1\tNV12\t X \tSYS\tSYS\t0-47\t0\n" + \
    "GPU2\tSYS\tSYS\t X \tNV12\t48-95\t1\nGPU3\tSYS\tSYS\tNV12\t X \t48-95\t1\n" + _LEGEND


@pytest.mark.parametrize("text,kind", [(DGX_H100_TOPO, "nvlink"), (L4_TOPO, "pcie"), (BRIDGED_TOPO, "pcie"),
                                       ("\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n" + _LEGEND, "pcie")])
def test_parse_nvidia_smi_topo(text, kind):
    assert parse_nvidia_smi_topo(text) == kind


def test_parse_nvidia_smi_topo_refuses_other_text():
    with pytest.raises(ValueError, match="topo -m"):
        parse_nvidia_smi_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_detect_reads_the_launchers_shape_with_a_cluster_file(tmp_path):
    # A CPU job with a cluster file of its own: the file describes the devices, the launcher the shape.
    from partitioner.cost.cluster import CLUSTER_FILE_ENV, PRESET_DIR
    from partitioner.calibration.job_cluster import detect_cluster

    env = {CLUSTER_FILE_ENV: str(PRESET_DIR / "dgx-h100.yaml"), "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    cluster = detect_cluster(env=env)
    assert (cluster.nodes, cluster.devices_per_node) == (2, 8)
    assert cluster.device.name == "H100-SXM5-80GB"
