"""runtime.dist.launch.spawn: ranks forked from a fork server still write where their caller writes
now, and see their caller's environment of the moment (not the server's, started earlier)."""
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
