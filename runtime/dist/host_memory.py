"""Keep freed host memory inside a CPU rank's process, so that a step does not pay the kernel
to map and zero its large tensors again.

glibc's malloc serves a request above its mmap threshold (at most 32 MiB on 64-bit) with a
fresh ``mmap`` and gives it back with ``munmap`` when freed. A training step allocates and frees
the same large tensors every step (a 49k-vocabulary model's logits and their gradient are
200 MB each at 4 x 256 tokens; an embedding's gradient 113 MB), so every step the kernel maps
them again and zero-fills every page at first touch. On 4 gloo ranks of a 2-core machine a
12-layer GPT-2 took about a million minor page faults per rank in three steps, with nearly as
much system time as user time. With mmap off and the heap never trimmed, freed blocks stay in
the process and the next step reuses them: one rank training a 30-layer, 576-wide Llama (4 x 256
tokens, 5 steps) took 1.5 million page faults and 9.4 s of system time instead of 3.3 million
and 17.8 s, and its steps 7.6-9.5 s instead of 9.4-13.6 s. The price is resident memory the
process keeps for its next step: 5.3 GB at its largest against 5.0 GB in the same run (its live
tensors peak at 3.8 GB); a freed block that an aligned request of the same size cannot reuse
(posix_memalign asks for a little more) grows the heap until freed neighbours merge.

Linux with glibc only (``mallopt``); elsewhere nothing changes. Called by
:func:`runtime.dist.mesh.init_distributed` in every rank process that is not on NCCL, also when
the caller initialised the process group itself.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameters (glibc's ``malloc.h``)."""

TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free bytes at the top of the heap before glibc gives them back: the most an ``int`` holds."""

_done = False


def keep_freed_host_memory() -> bool:
    """Serve every allocation of this process from its heap and never trim it (glibc's
    ``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD`` at its maximum). True when applied (now or before);
    False where there is no glibc ``mallopt``."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; musl and other libcs without it were caught above
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done
