"""Two nodes: a job that two torchrun launchers start together (c10d rendezvous, 2 ranks each)
forms one world of 4 ranks and trains as one device does.

Both launchers run on this machine against one rendezvous endpoint, as two machines would run
them against ``<host0>:29500``. Each rank is :mod:`tests.two_node_job` (the ``partitioner
train`` loop, writing its placement and full-precision losses). The plan dp=2, pp=2 puts the
pipeline stages on different nodes (ranks 0,1 stage 0, ranks 2,3 stage 1; a node holds two
consecutive ranks), so every activation and gradient crosses between the launchers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from partitioner.cost.cluster import CLUSTER_FILE_ENV, Cluster
from partitioner.cli.demo import reference_losses
from runtime.dist.launch import free_port
from tests.two_node_job import LAUNCHER_ENV, RankRecord

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
FIX = "dp=2,pp=2"
GLOBAL_BATCH, STEPS = 8, 4
NODES, PER_NODE = 2, 2
TIMEOUT_S = 300.0
"""Seconds for the whole job: 4 ranks importing torch and capturing on a loaded machine."""
STOP_GRACE_S = 10.0
"""Seconds a launcher told to stop (SIGTERM) has to stop its ranks before everything is killed."""
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None,
                                reason="torch.distributed.run (torchrun) is not available")


def _launch(node_rank: int, endpoint: str, job_id: str, cluster: Path, out: Path, log: Path,
            files: contextlib.ExitStack) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node_rank),
           "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", job_id, "--max-restarts", "0",
           "-m", "tests.two_node_job", "--model", MODEL, "--global-batch", str(GLOBAL_BATCH),
           "--steps", str(STEPS), "--fix", FIX, "--cluster", str(cluster), "--out", str(out)]
    env = {**os.environ, LAUNCHER_ENV: str(node_rank), "OMP_NUM_THREADS": "1"}
    # Output to files: a full pipe would block the launcher.
    stdout, stderr = (files.enter_context(open(log.with_suffix(ext), "w"))  # noqa: SIM115 - the ExitStack closes
                      for ext in (".out", ".err"))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (from /proc): torchrun starts each rank in a session of
    its own, so killing the launcher's process group would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _stop(proc: subprocess.Popen) -> None:
    """End a launcher still running and its ranks: SIGTERM (torchrun then stops its ranks), and
    SIGKILL for whatever is left after a few seconds."""
    if proc.poll() is not None:
        return
    below = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in (proc.pid, *below):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _run_job(cluster: Path, out: Path, logs: Path) -> tuple[list[int | None], str]:
    """Start both launchers and wait for both (at most :data:`TIMEOUT_S` seconds): their exit codes
    (None: killed at the deadline) and their output. Both process trees are killed as soon as
    either launcher fails (the other would only wait for its lost peers) or the time runs out."""
    endpoint, job_id = f"127.0.0.1:{free_port()}", f"two-node-{uuid.uuid4().hex[:8]}"
    logs.mkdir(parents=True, exist_ok=True)
    deadline, note = time.monotonic() + TIMEOUT_S, ""
    with contextlib.ExitStack() as files:
        procs = [_launch(n, endpoint, job_id, cluster, out, logs / f"launcher{n}", files) for n in range(NODES)]
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    note = "a launcher failed; killed the other"
                    break
                if time.monotonic() > deadline:
                    note = f"launchers still running after {TIMEOUT_S:.0f} s; killed both"
                    break
                time.sleep(0.2)
            codes = [p.poll() for p in procs]
        finally:
            for p in procs:
                _stop(p)
    text = "\n".join(f"--- launcher {n}: exit {codes[n]}\nstdout:\n{_tail(logs / f'launcher{n}.out')}\n"
                     f"stderr:\n{_tail(logs / f'launcher{n}.err')}" for n in range(NODES))
    return codes, f"{text}\n{note}".rstrip()


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:]


def test_two_launchers_form_one_world_and_train_as_one_device(tmp_path):
    # The cost model sees the job as it is: 2 nodes of 2 ranks (the rates are the test preset's).
    base = Cluster.from_file(os.environ[CLUSTER_FILE_ENV])
    cluster = dataclasses.replace(base, nodes=NODES, devices_per_node=PER_NODE).to_file(tmp_path / "cluster.json")
    out = tmp_path / "ranks"
    codes, log = _run_job(cluster, out, tmp_path / "logs")
    assert codes == [0] * NODES, f"both launchers must exit 0, got {codes}\n{log}"

    records = {r.rank: r for r in map(RankRecord.read, sorted(out.glob("rank*.json")))}
    world = NODES * PER_NODE
    assert sorted(records) == list(range(world)), f"ranks reported: {sorted(records)}\n{log}"
    assert {r.world_size for r in records.values()} == {world}, log
    # Each launcher is one node: two ranks with local ranks 0, 1, one node rank of its own, and
    # the global ranks node-major (rank = node rank * ranks per node + local rank).
    by_launcher = {n: sorted(r.rank for r in records.values() if r.launcher == n) for n in range(NODES)}
    assert all(len(ranks) == PER_NODE for ranks in by_launcher.values()), f"{by_launcher}\n{log}"
    for n, ranks in by_launcher.items():
        assert sorted(records[r].local_rank for r in ranks) == list(range(PER_NODE)), log
        assert len({records[r].group_rank for r in ranks}) == 1, f"launcher {n} ranks on several nodes\n{log}"
    assert sorted(records[ranks[0]].group_rank for ranks in by_launcher.values()) == list(range(NODES)), log
    for r in records.values():
        assert r.rank == r.group_rank * PER_NODE + r.local_rank, f"rank {r.rank}: {r}\n{log}"
    # The plan crosses the nodes: each pipeline spans both launchers, each dp group stays on one.
    for r in records.values():
        assert {records[p].launcher for p in r.pp_ranks} == set(range(NODES)), f"rank {r.rank}: {r.pp_ranks}"
        assert len({records[p].launcher for p in r.dp_ranks}) == 1, f"rank {r.rank}: {r.dp_ranks}"

    ref = reference_losses(MODEL, STEPS, GLOBAL_BATCH)
    for r in records.values():
        assert len(r.losses) == STEPS, f"rank {r.rank}: {r.losses}"
        assert r.losses == pytest.approx(ref, rel=1e-5), f"rank {r.rank}: {r.losses} vs one device {ref}\n{log}"
