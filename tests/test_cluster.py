"""Cluster description: presets, units, file round-trips and validation messages."""
import dataclasses
import json
import re

import pytest

from pathlib import Path

from partitioner.calibration.calibrate import TINY_RECIPE
from partitioner.calibration.cache import CACHE_DIR_ENV, MachineKey, cache_dir, local_cache_file
from partitioner.cost.cluster import (CLUSTER_FILE_ENV, Cluster, Device, DeviceEfficiency, EfficiencyCurve, Link, PeakFlops,
                                      parse_quantity)
from partitioner.errors import ClusterSpecError, ConfigError
from partitioner.calibration.job_cluster import local_cluster

GiB = 2**30


@pytest.mark.parametrize("name,memory,bf16,intra,nic_bits", [
    ("dgx-a100-40gb", 40 * GiB, 312e12, 300e9, 200e9),
    ("dgx-a100-80gb", 80 * GiB, 312e12, 300e9, 200e9),
    ("dgx-h100", 80 * GiB, 989e12, 450e9, 400e9),
    ("dgx-h200", 141 * GiB, 989e12, 450e9, 400e9),
])
def test_dgx_presets_match_datasheets(name, memory, bf16, intra, nic_bits):
    c = Cluster.preset(name, nodes=4)
    assert (c.nodes, c.devices_per_node, c.world_size, c.backend) == (4, 8, 32, "nccl")
    assert c.device.memory_bytes == memory
    assert c.device.peak_flops.for_dtype("bf16") == bf16
    assert c.device.peak_flops.for_dtype("torch.bfloat16") == bf16
    assert c.intra_node.bandwidth_bytes_per_s == intra
    assert c.nics_per_node == 8
    assert c.inter_node.bandwidth_bytes_per_s == nic_bits / 8
    assert c.inter_node.aggregate_bytes_per_s == 8 * nic_bits / 8
    assert c.host_to_device.kind == "pcie"


def test_local_cpu_preset_and_local():
    c = Cluster.preset("local-cpu")
    assert (c.backend, c.intra_node.kind) == ("gloo", "loopback")
    assert c.device.peak_flops.tf32 == c.device.peak_flops.fp32  # defaulted


def test_local_reads_an_explicit_cluster_file(tmp_path, monkeypatch):
    calibrated = dataclasses.replace(Cluster.preset("local-cpu"), name="my-box",
                                     intra_node=Link(kind="loopback", bandwidth_bytes_per_s=2e9, latency_s=1e-5))
    path = calibrated.to_file(tmp_path / "local.yaml")
    monkeypatch.setenv("PARTITIONER_CLUSTER_FILE", str(path))
    got = local_cluster(3)
    assert (got.name, got.world_size, got.intra_node.bandwidth_bytes_per_s) == ("my-box", 3, 2e9)

    monkeypatch.setenv("PARTITIONER_CLUSTER_FILE", str(tmp_path / "nope.yaml"))
    with pytest.raises(ClusterSpecError, match="cannot read cluster file .*nope.yaml"):
        local_cluster(2)


# ---- the per-machine calibration cache ---------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """No explicit cluster file, the cache in ``tmp_path``, and first-use calibrations at the
    least effort that runs every measurement."""
    monkeypatch.delenv(CLUSTER_FILE_ENV, raising=False)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr("partitioner.calibration.calibrate.AUTO_RECIPE", TINY_RECIPE)
    return tmp_path / "cache"


def test_local_calibrates_once_then_reads_the_cache(cache, monkeypatch, capfd):
    import partitioner.calibration.job_cluster as job_cluster

    calls = []
    real = job_cluster.auto_calibrate
    monkeypatch.setattr(job_cluster, "auto_calibrate", lambda w, path: calls.append((w, path)) or real(w, path))
    first = local_cluster(2)
    err = capfd.readouterr().err.strip().splitlines()
    path = local_cache_file(2)
    assert path.parent == cache and path.is_file() and calls == [(2, path)]
    said = [line for line in err if line.startswith("partitioner:")]
    assert len(said) == 2, err  # one line before measuring (it takes a while), one after
    assert said[0].startswith("partitioner: no calibration of this machine for 2 gloo rank(s)"), said
    assert re.fullmatch(rf"partitioner: calibrated this machine for 2 gloo rank\(s\) in \d+ s; cached in {re.escape(str(path))}",
                        said[1]), said
    assert (first.name, first.world_size, first.backend) == ("local-calibrated", 2, "gloo")
    key = MachineKey.this_machine(2)
    assert first.compute_slots_per_node == max(1, key.cores // key.threads_per_rank)

    mtime = path.stat().st_mtime_ns
    again = local_cluster(2)
    assert calls == [(2, path)]  # a second calibration would have been recorded here
    assert again == first and path.stat().st_mtime_ns == mtime
    assert "partitioner:" not in capfd.readouterr().err  # nothing printed on a cache hit
    with pytest.raises(ClusterSpecError, match="no CUDA device .* dgx-h100"):  # GPUs: not what it measures
        local_cluster(2, backend="nccl")


def test_cache_key_separates_machines_and_setups(cache, monkeypatch):
    key = MachineKey(cpu="Xeon A", cores=2, torch_version="2.13.0+cpu", world_size=4, threads_per_rank=1)
    names = {key.file_name()} | {dataclasses.replace(key, **change).file_name() for change in (
        {"cpu": "Xeon B"}, {"cores": 8}, {"torch_version": "2.12.0"}, {"world_size": 2}, {"threads_per_rank": 4},
        {"version": key.version + 1})}
    assert len(names) == 7
    assert key.file_name() == MachineKey(**dataclasses.asdict(key)).file_name()  # stable
    assert key.file_name().startswith("local-w4-t1-c2-torch2.13.0_cpu-")
    here = local_cache_file(2)
    assert here.parent == cache and here != local_cache_file(4)
    monkeypatch.setattr("partitioner.calibration.measure.cpu_name", lambda: "Another CPU")
    assert local_cache_file(2) != here


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "partitioner"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # invalid by the XDG rule: ignored
    assert cache_dir() == Path("~/.cache/partitioner").expanduser()
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_a_corrupt_cache_file_is_an_error_naming_it_and_the_fix(cache):
    path = local_cache_file(2)
    path.parent.mkdir(parents=True)
    path.write_text("name: [unclosed\n")
    with pytest.raises(ClusterSpecError) as e:
        local_cluster(2)
    assert f"the cached calibration {path} is corrupt" in str(e.value)
    assert "partitioner calibrate --world-size 2" in str(e.value)
    path.write_text("name: half a file\n")  # valid YAML, not a cluster
    with pytest.raises(ClusterSpecError, match="corrupt.*missing key"):
        local_cluster(2)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ClusterSpecError) as e:
        Cluster.preset("dgx-b300")
    msg = str(e.value)
    assert "unknown cluster preset 'dgx-b300'" in msg
    for name in ("dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "local-cpu"):
        assert name in msg


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    c = dataclasses.replace(Cluster.preset("dgx-h100", nodes=2), compute_slots_per_node=3)
    curve = EfficiencyCurve(peak_efficiency=0.8, half_saturation_s=4e-6)
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, efficiency=DeviceEfficiency(bf16=curve),
                                                          memory_bound_bytes_per_s=1e12))
    path = c.to_file(tmp_path / f"c{suffix}")
    assert Cluster.from_file(path) == c
    assert Cluster.load(path) == c
    assert Cluster.load(str(path), nodes=5) == c.with_nodes(5)
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_units_and_yaml_exponent(tmp_path):
    text = """
name: box
devices_per_node: 2
backend: gloo
device: {name: x, memory_bytes: 1.5TB, memory_bandwidth_bytes_per_s: 1e11,
         peak_flops: {fp32: 1e12, bf16: 2 TFLOP/s}}
intra_node: {kind: pcie, bandwidth_bytes_per_s: 16 GB/s, latency_s: 2us}
inter_node: {kind: ethernet, bandwidth_bytes_per_s: 100Gbps, latency_s: 0.01ms, count: 2}
host_memory_bytes: 512GiB
host_to_device: {kind: pcie, bandwidth_bytes_per_s: 16GB/s, latency_s: 0}
"""
    path = tmp_path / "box.yml"
    path.write_text(text)
    c = Cluster.from_file(path)
    assert c.nodes == 1
    assert c.device.memory_bytes == 1_500_000_000_000
    assert c.device.memory_bandwidth_bytes_per_s == 1e11  # "1e11" without a dot is still a number
    assert c.device.peak_flops.bf16 == 2e12 and c.device.peak_flops.fp16 == 2e12
    assert c.intra_node.latency_s == pytest.approx(2e-6)
    assert c.inter_node.bandwidth_bytes_per_s == 12.5e9 and c.inter_node.latency_s == pytest.approx(1e-5)
    assert c.host_memory_bytes == 512 * GiB


@pytest.mark.parametrize("value,kind,expected", [
    ("80GiB", "bytes", 80 * GiB), ("80GB", "bytes", 80e9), ("1.5TB", "bytes", 1.5e12), (1024, "bytes", 1024),
    ("4KiB", "bytes", 4096), ("200Gb/s", "bytes_per_s", 25e9), ("300GB/s", "bytes_per_s", 300e9),
    ("312TFLOP/s", "flops_per_s", 312e12), ("5us", "seconds", 5e-6),
])
def test_parse_quantity(value, kind, expected):
    assert parse_quantity(value, kind, "x") == pytest.approx(expected)


def _dgx(**changes):
    d = Cluster.preset("dgx-a100-80gb").to_dict()
    for path, value in changes.items():
        *outer, last = path.split("__")
        target = d
        for key in outer:
            target = target[key]
        target[last] = value
    return d


@pytest.mark.parametrize("changes,message", [
    ({"intra_node__bandwidth_bytes_per_s": -5},
     "cluster.intra_node: Link.bandwidth_bytes_per_s must be > 0, got -5.0; give the one-direction bandwidth"),
    ({"devices_per_node": 0}, "Cluster.devices_per_node must be > 0, got 0; a node has at least 1 device"),
    ({"nodes": 1.5}, "Cluster.nodes must be a whole number, got 1.5"),
    ({"inter_node__kind": "myrinet"}, "Link.kind: unknown value 'myrinet'; choose one of nvlink, nvswitch, pcie"),
    ({"device__memory_bytes": "80"}, "cluster.device: Device.memory_bytes: '80' is a string without a unit; "
                                     "write a plain number (not quoted) or add a unit, e.g. '80GiB'"),
    ({"device__memory_bytes": "80 gigs"}, "Device.memory_bytes: cannot read '80 gigs'"),
    ({"backend": "mpi"}, "Cluster.backend: unknown value 'mpi'; choose one of nccl, gloo"),
    ({"inter_node__count": 0}, "cluster.inter_node: Link.count must be > 0, got 0"),
    ({"device__peak_flops__bf16": "312"},
     "cluster.device.peak_flops: PeakFlops.bf16: '312' is a string without a unit"),
    ({"device__flops": 1}, "cluster.device: unknown key(s) 'flops'; Device takes name, memory_bytes"),
    ({"compute_slots_per_node": 0}, "Cluster.compute_slots_per_node must be > 0, got 0; give how many ranks"),
    ({"compute_slots_per_node": True}, "Cluster.compute_slots_per_node must be a whole number, got True"),
    ({"device__efficiency": {"fp32": {"peak_efficiency": 1.5}}},
     "cluster.device: Device.efficiency: fp32: EfficiencyCurve.peak_efficiency must be in (0, 1], got 1.5"),
    ({"device__efficiency": {"fp32": {"half_saturation_s": "-1us"}}},
     "Device.efficiency: fp32: EfficiencyCurve.half_saturation_s cannot be negative"),
    ({"device__efficiency": {"fp33": {}}}, "Device.efficiency: unknown key(s) 'fp33'; DeviceEfficiency takes fp32"),
    ({"device__efficiency": {}}, "DeviceEfficiency needs a curve for at least one dtype"),
    ({"device__memory_bound_bytes_per_s": -1.0}, "Device.memory_bound_bytes_per_s must be >= 0"),
])
def test_validation_messages(changes, message):
    with pytest.raises(ClusterSpecError) as e:
        Cluster.from_dict(_dgx(**changes))
    assert message in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_missing_key_and_file_context(tmp_path):
    d = _dgx()
    del d["host_to_device"]
    with pytest.raises(ClusterSpecError, match="missing key.*host_to_device"):
        Cluster.from_dict(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_dgx(nodes=0)))
    with pytest.raises(ClusterSpecError, match=r"in cluster file .*bad\.json: Cluster\.nodes must be > 0"):
        Cluster.load(path)


def test_constructor_accepts_units_and_validates():
    d = Device(name="g", memory_bytes="16GiB", memory_bandwidth_bytes_per_s="900GB/s",
               peak_flops={"fp32": "10TFLOP/s", "bf16": "100TFLOP/s"})
    assert d.memory_bytes == 16 * GiB and isinstance(d.peak_flops, PeakFlops)
    with pytest.raises(ClusterSpecError, match="unknown dtype 'int8'"):
        d.peak_flops.for_dtype("int8")
    with pytest.raises(ClusterSpecError, match="Link.latency_s must be >= 0"):
        Link(kind="nvlink", bandwidth_bytes_per_s=1e9, latency_s=-1)


def test_docs_example_parses(tmp_path):
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "cluster_schema.md").read_text()
    example = re.search(r"## Example\n\n```yaml\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "c.yaml").write_text(example)
    c = Cluster.from_file(tmp_path / "c.yaml")
    assert c == dataclasses.replace(Cluster.preset("dgx-a100-80gb", nodes=2), name="my-a100-pair")


def _local_two():
    return local_cluster(2)


def test_a_rank_asking_for_another_world_size_says_where_to_calibrate(cache):
    """A rank of a 1-rank job cannot measure 2 ranks with its job, nor start processes (spawned
    ranks are daemonic): it is told what to do instead."""
    from runtime.dist.launch import LaunchError, spawn

    with pytest.raises(LaunchError, match=r"ClusterSpecError: no calibration of this machine for 2 rank\(s\) can be "
                                          r"measured inside this job of 1 rank\(s\); .* run `partitioner calibrate "
                                          r"--world-size 2` outside the job first"):
        spawn(_local_two, 1, timeout_s=120)
    assert not local_cache_file(2).exists()
