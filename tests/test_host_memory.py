"""A CPU rank keeps freed host memory (``runtime.dist.host_memory``): a large tensor made and
freed every step maps and zero-fills new pages each time under glibc's defaults, and reuses the
same pages once ``keep_freed_host_memory`` has run."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from runtime.dist.host_memory import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory() and keep_freed_host_memory()  # idempotent
w = torch.randn(256, 2048)
def step():  # a step's shape of use: large temporaries made and freed in turn
    logits = torch.randn(1024, 256) @ w
    big = logits.repeat(1, 8)  # 64 MiB: above glibc's largest mmap threshold
    (big.softmax(-1) * 2).sum()
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_are_reused_instead_of_mapped_again():
    pages = 64 * 2**20 // 4096
    default, kept = _faults("default"), _faults("keep")
    assert default > 10 * pages  # every step's three 64 MiB temporaries touched fresh pages
    # the heap grows for a step or two (an aligned request does not fit a freed block of the same
    # size until neighbours merge), then the same pages serve every step
    assert kept <= 4 * pages and kept < default / 3


GROUP_FIRST = """
import os, torch.distributed as dist
from runtime.dist import host_memory
from runtime.dist.mesh import init_distributed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")  # the user's own, before ours
assert not host_memory._done
init_distributed()
print(host_memory._done)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_rank_whose_group_the_caller_made_keeps_freed_memory_too():
    import os

    from runtime.dist.launch import free_port

    out = subprocess.run([sys.executable, "-c", GROUP_FIRST], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PORT": str(free_port())})
    assert out.stdout.strip().splitlines()[-1] == "True"
