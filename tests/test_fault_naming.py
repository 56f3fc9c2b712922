"""A rank that stops answering is named: one rank of a 4-rank torchrun job is stopped with SIGSTOP
mid-training (its sockets stay open, so its peers only time out); every other rank exits within
twice the timeout, naming the stopped rank by its heartbeat (runtime.heartbeat) rather than "a
peer among ranks [...]". And the one-line form of an error the command line prints."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
TIMEOUT_S = 15.0
WORLD, VICTIM = 4, 2


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (exited, not yet reaped by torchrun)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    pytest.fail(f"training never reached {text!r}:\n{path.read_text(errors='replace')[-3000:]}")


def test_stopped_rank_is_named_by_every_other_rank_within_twice_the_timeout(tmp_path):
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "-m", "partitioner", "train", "--model", MODEL, "--global-batch", "8", "--steps", "100000",
           "--timeout", str(TIMEOUT_S), "--fix", "dp=2,pp=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out, "w") as fo, open(err, "w") as fe:
        launcher = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, start_new_session=True)
    ranks: dict[int, int] = {}
    try:
        _wait_for(out, "step   3/100000", launcher, timeout_s=300)  # start-up of 4 ranks on a loaded machine
        ranks = {r: pid for pid in _children(launcher.pid) if (r := _rank_of(pid)) is not None}
        assert sorted(ranks) == list(range(WORLD)), ranks
        os.kill(ranks[VICTIM], signal.SIGSTOP)
        stopped = time.monotonic()
        exited: dict[int, float] = {}
        while len(exited) < WORLD - 1 and time.monotonic() - stopped < 3 * TIMEOUT_S:
            for r, pid in ranks.items():
                if r != VICTIM and r not in exited and not _running(pid):
                    exited[r] = time.monotonic() - stopped
            time.sleep(0.05)
    finally:
        for r, pid in ranks.items():
            for sig in ((signal.SIGCONT, signal.SIGKILL) if r == VICTIM else (signal.SIGKILL,)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    text = err.read_text(errors="replace")
    print(f"other ranks exited {sorted(exited.items())} s after the stop (timeout {TIMEOUT_S:.0f} s)")
    print("\n".join(line for line in text.splitlines() if line.startswith("rank ")))
    assert sorted(exited) == [r for r in range(WORLD) if r != VICTIM], f"still running: {exited}\n{text[-3000:]}"
    assert max(exited.values()) < 2 * TIMEOUT_S, exited
    for r in exited:
        named = rf"rank {r}: peer rank {VICTIM} stopped answering: no heartbeat for [\d.]+ s \(\S+, pid {ranks[VICTIM]}\)"
        assert re.search(named, text), f"rank {r} did not name rank {VICTIM}:\n{text[-3000:]}"
    assert "a peer among ranks" not in text
    assert "Traceback" not in "\n".join(line for line in text.splitlines() if line.startswith("rank "))


def test_error_line_names_the_error_and_the_frame_it_came_from():
    from passes.ir.errors import ConfigError
    from runtime.faults import error_line

    def refuse():
        raise ConfigError("dp must be >= 1, got 0; pin dp=1 or more\nsecond line")

    try:
        try:
            refuse()
        except ConfigError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as exc:
        line = error_line(exc)
    assert re.fullmatch(r"RuntimeError: wrapped \(tests/test_fault_naming\.py:\d+ in refuse\)", line), line
