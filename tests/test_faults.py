"""Faults: a rank killed (SIGKILL) mid-step ends the whole ``partitioner train`` job within twice
the timeout, every survivor exiting non-zero and naming the dead rank and its own last action;
a job whose size does not match the plan is refused at start with the numbers.

The ranks are started here as plain processes with the env:// variables torchrun sets (no
torchrun agent: it would kill the survivors before they can report)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from partitioner.cli.demo import EXIT_PEER_FAILED, EXIT_RANK_FAILED
from runtime.dist.faults import RankIdentity, describe_failure, parse_fault
from runtime.dist.launch import free_port
from passes.ir.schedule.actions import Action, Kind

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,dropout=0.0"
FIX = "dp=2,pp=2,schedule=1f1b,num_micro_batches=2,offload=none,checkpointing=none"
TIMEOUT_S = 10.0
WORLD, VICTIM = 4, 2


def _launch(world: int, extra_env: dict[str, str], *args: str) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **extra_env}
        procs.append(subprocess.Popen([sys.executable, "-m", "partitioner", "train", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("how, victim_exit", [("kill", -9), ("raise", EXIT_RANK_FAILED)])
def test_failed_rank_ends_job_within_twice_the_timeout_and_is_named(how, victim_exit):
    fault = f"rank={VICTIM},step=2,action=1" + (",raise=1" if how == "raise" else "")
    procs = _launch(WORLD, {"PARTITIONER_FAULT": fault},
                    "--model", MODEL, "--global-batch", "8", "--steps", "200", "--fix", FIX,
                    "--timeout", str(TIMEOUT_S), "--dtype", "bf16")
    try:
        deadline = time.monotonic() + 240  # start-up (4 processes importing torch) on a loaded machine
        while procs[VICTIM].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert procs[VICTIM].returncode == victim_exit, f"the victim should have failed ({how}) at step 2"
        killed_at = time.monotonic()
        for p in procs:
            p.wait(timeout=max(1.0, killed_at + 2 * TIMEOUT_S - time.monotonic()))
        elapsed = time.monotonic() - killed_at
    finally:
        _kill_all(procs)
    outs = [p.communicate() for p in procs]
    print(f"survivors exited {elapsed:.1f} s after the kill (timeout {TIMEOUT_S:.0f} s)")
    assert elapsed < 2 * TIMEOUT_S
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        if rank == VICTIM:
            continue
        assert p.returncode == EXIT_PEER_FAILED, f"rank {rank}: exit {p.returncode}\n{err[-2000:]}"
        assert re.search(rf"rank {rank}: peer rank {VICTIM} failed during \S+; exiting", err), err[-2000:]
    assert "step   2/200" in outs[0][0] and "step   3/200" not in outs[0][0]  # died inside step 3
    assert re.search(r"^plan: .* bf16: ", outs[0][0], re.M), outs[0][0][:500]  # train --dtype reached the plan
    if how == "raise":
        assert re.search(rf"rank {VICTIM}: failed during \S+; exiting \(InjectedFault", outs[VICTIM][1])


def test_world_size_not_matching_plan_is_refused_at_start():
    start = time.monotonic()
    procs = _launch(1, {}, "--model", MODEL, "--global-batch", "8", "--steps", "1", "--fix", FIX)
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        _kill_all(procs)
    assert procs[0].returncode == 2, err
    assert "plan needs 4 ranks (dp=2 tp=1 pp=2 cp=1) but the job has 1" in err
    assert "step" not in out
    print(f"refused in {time.monotonic() - start:.1f} s")


def test_failure_message_names_action_peer_when_no_process_is_known_dead():
    action = Action(Kind.RECV_B, stage=0, microbatch=1, peer=1)
    me = RankIdentity(rank=0, host="elsewhere", pid=1)
    text = describe_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), rank=0, last_action=action,
                            identities=[me], pp_ranks=(0, 2))
    assert text.startswith(f"rank 0: peer rank 2 (the other end of {action}) failed during {action}; exiting")
    assert "Connection closed by peer" in text
    assert parse_fault("rank=2,step=1") == {"rank": 2, "step": 1, "action": 0, "raise": 0}


HEARTBEAT_STOP = r"""
import os, sys, threading, time
import torch.distributed as dist
from runtime.dist import heartbeat

class SlowStore:  # the beat thread's store call is still running when stop() is called
    def set(self, key, value):
        if threading.current_thread().name.startswith("partitioner-heartbeat"):
            time.sleep(0.5)

dist.init_process_group("gloo", rank=0, world_size=1)
heartbeat._connect = lambda timeout_s: SlowStore()
hb = heartbeat.start(0, "job")
time.sleep(0.2)  # the thread is inside set()
heartbeat.stop()
print("alive after stop:", hb._thread.is_alive(), "current:", heartbeat.current())
dist.destroy_process_group()
"""


def test_stopping_the_heartbeat_waits_for_its_thread_to_leave_the_store():
    """A process that exits while the beat thread is inside a store call can abort in C++
    ("terminate called without an active exception"): stop() returns only once the thread has
    ended."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", HEARTBEAT_STOP], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "alive after stop: False current: None" in out.stdout, out.stdout + out.stderr
