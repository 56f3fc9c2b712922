"""A rank that stops answering is named: one rank of a 4-rank torchrun job is stopped with SIGSTOP
mid-training (its sockets stay open, so its peers only time out); every other rank exits within
twice the timeout, naming the stopped rank by its heartbeat (runtime.dist.heartbeat) rather than "a
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
    from runtime.dist.faults import error_line

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


def _refuse_on_odd_ranks():
    import torch.distributed as dist

    from passes.ir.errors import ConfigError
    from runtime.dist.mesh import init_distributed

    init_distributed(backend="gloo", timeout_s=30)
    dist.barrier()  # every rank is connected (a rank still joining when its peer leaves fails in init instead)
    if dist.get_rank() % 2:
        raise ConfigError(f"refused on rank {dist.get_rank() % 2}; pin something else")
    dist.barrier()  # ranks 0 and 2 wait here until the job is stopped
    return "never"


def test_demo_failure_prints_one_line_per_failed_rank(monkeypatch, capsys):
    """A spawned job's failure (``partitioner demo``): one line per failure (the same refusal on
    ranks 1 and 3 in one line), naming the error and its frame; ``--debug``: the tracebacks too."""
    import partitioner.cli.demo
    from partitioner.cli.main import main
    from runtime.dist.launch import spawn

    monkeypatch.setattr(partitioner.cli.demo, "run_demo", lambda **kw: spawn(_refuse_on_odd_ranks, 4, timeout_s=120))
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    # the refusal first; then, if they reported in time, ranks 0 and 2 (their peers went away)
    assert re.fullmatch(r"error: ranks 1, 3: ConfigError: refused on rank 1; pin something else "
                        r"\(tests/test_fault_naming\.py:\d+ in _refuse_on_odd_ranks\)", lines[0]), err
    # (one line each, or one for both when gloo gave them the same text)
    assert all(re.match(r"error: ranks? [02](, [02])?: RuntimeError: .* \(tests/test_fault_naming\.py:\d+ in "
                        r"_refuse_on_odd_ranks\)$", line) for line in lines[1:]) and len(lines) <= 3, err
    assert main(["demo", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.count("Traceback") >= 2 and err.count("error: ranks 1, 3: ConfigError") == 1, err
    assert 'in _refuse_on_odd_ranks\n    raise ConfigError(f"refused on rank' in err, err


def test_train_error_is_one_line_unless_debug(monkeypatch, capsys):
    import partitioner.cli.demo
    from partitioner.cli.main import main

    def broken(**kwargs):
        raise TypeError("'NoneType' object is not iterable")

    monkeypatch.setattr(partitioner.cli.demo, "run_train", broken)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    args = ["train", "--model", MODEL, "--global-batch", "8"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: rank 1: TypeError: 'NoneType' object is not iterable \(tests/test_fault_naming\.py:"
                        r"\d+ in broken\); run with --debug for the full traceback\n", err), err
    with pytest.raises(TypeError):  # --debug: the exception itself, with Python's traceback
        main(args + ["--debug"])
