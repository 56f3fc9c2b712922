"""Launch ``partitioner train`` as ``world`` local processes (env:// rendezvous, as torchrun would
set it up) for the CLI tests; each process's (exit code, stdout, stderr)."""
from __future__ import annotations

import os
import subprocess
import sys

from runtime.dist.launch import free_port


def launch_train(world: int, args: list[str], *, env_extra: dict | None = None,
                 timeout_s: float = 420.0) -> list[tuple[int, str, str]]:
    """Run ``python -m partitioner train *args`` on ranks 0..world-1; kills what is left on exit."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "partitioner", "train", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def outputs_of_success(results: list[tuple[int, str, str]]) -> list[str]:
    """Every rank's stdout, after asserting that every rank exited 0 (else its output tails)."""
    for code, out, err in results:
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    return [out for _, out, _ in results]
