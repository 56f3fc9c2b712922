"""runtime.dist.launch.spawn: ranks forked from a fork server still write where their caller writes
now, and see their caller's environment of the moment (not the server's, started earlier); the
collector of a rank skips what it inherited and collects its young generation less often."""
from __future__ import annotations

import os
import sys

from runtime.dist.launch import spawn


def _say(word: str) -> str:
    print(f"rank {os.environ['RANK']} says {word}", flush=True)
    print(f"rank {os.environ['RANK']} warns {word}", file=sys.stderr, flush=True)
    return os.environ.get("LAUNCH_TEST_WORD", "")


def test_ranks_write_to_the_callers_stdout_and_stderr_of_the_moment(capfd, monkeypatch):
    with capfd.disabled():  # the fork server exists from here on, its fds not this test's capture
        spawn(_say, 1, "first", timeout_s=120)
    monkeypatch.setenv("LAUNCH_TEST_WORD", "later")
    assert spawn(_say, 2, "again", timeout_s=120) == ["later", "later"]
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["rank 0 says again", "rank 1 says again"]
    assert sorted(err.splitlines()) == ["rank 0 warns again", "rank 1 warns again"]


_CALLER = """
import os, sys, time
from runtime.dist.launch import spawn

def rank(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(300)  # as a rank waiting in a collective

if __name__ == "__main__":
    spawn(rank, 2, sys.argv[1], timeout_s=600)
"""


def test_the_ranks_of_a_killed_caller_end_with_it(tmp_path):
    """Killing the caller (SIGKILL: no clean-up runs) ends its ranks within seconds, not after
    their collective timeouts (minutes)."""
    import signal
    import subprocess
    import time

    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    folder = tmp_path / "pids"
    folder.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    caller = subprocess.Popen([sys.executable, str(script), str(folder)], env=env)
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [int(p) for p in os.listdir(folder)]
        assert len(ranks) == 2
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 30
    alive = ranks
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in ranks if _running(pid)]
    assert not alive, f"ranks {alive} outlived their killed caller"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _collector() -> tuple[int, int]:
    import gc
    return gc.get_threshold()[0], gc.get_freeze_count()


def test_a_rank_leaves_its_inherited_objects_out_of_collections_and_collects_young_ones_less_often():
    from passes.ir.heap import YOUNG_THRESHOLD

    for young, frozen in spawn(_collector, 2, timeout_s=60):
        assert young == YOUNG_THRESHOLD
        assert frozen > 100_000  # torch and the project, imported by the fork server
