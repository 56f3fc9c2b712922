"""A small, real text corpus that needs no download: Python's own standard-library sources.

The text is the Zen of Python (``this``) followed by the sources of the ``json`` and ``email``
packages as they ship with the interpreter, read as bytes; tokens are those bytes (vocabulary
256), so no tokenizer is needed. The corpus is the same on every machine with the same Python
version, and :func:`batch` is a pure function of (step, batch size, sequence length): every rank
of a job draws the same global batch without exchanging anything.
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

VOCAB = 256
"""Byte-level tokens: the vocabulary of every model trained on this corpus."""

_PACKAGES = ("json", "email")


def _zen() -> str:
    import this  # noqa: F401  (prints the Zen once on first import; its text is rot13-encoded)

    return codecs.decode(this.s, "rot13")


@lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """The whole corpus as bytes (~250 KB with CPython 3.11)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        parts = [_zen().encode()]
    for name in _PACKAGES:
        root = Path(__import__(name).__file__).parent
        for path in sorted(root.glob("*.py")):
            parts.append(path.read_bytes())
    return b"\n\n".join(parts)


@lru_cache(maxsize=1)
def tokens() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values in ``[0, 256)``."""
    return torch.tensor(list(corpus_bytes()), dtype=torch.int64)


@dataclass(frozen=True, kw_only=True)
class CorpusInfo:
    """What the corpus is, for logs and measurements.json."""

    sources: tuple[str, ...]
    num_bytes: int


def info() -> CorpusInfo:
    return CorpusInfo(sources=("this (Zen of Python)", *(f"stdlib {n}/*.py" for n in _PACKAGES)),
                      num_bytes=len(corpus_bytes()))


def batch(step: int, batch_size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``, each ``[batch_size, seq]`` int64: next-byte prediction windows.

    Window ``j`` of step ``step`` starts at a fixed stride through the corpus
    (``(step * batch_size + j) * stride``, wrapping), so consecutive steps read new text and the
    result depends on nothing but the arguments.
    """
    data = tokens()
    n = data.numel() - seq - 1
    if n <= 0:
        raise ValueError(f"corpus of {data.numel()} bytes is shorter than seq+1 = {seq + 1}")
    stride = 4099  # prime, > any seq used here: windows rarely overlap and cover the corpus
    starts = [((step * batch_size + j) * stride) % n for j in range(batch_size)]
    windows = torch.stack([data[s:s + seq + 1] for s in starts])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


if __name__ == "__main__":
    print(json.dumps({"sources": info().sources, "bytes": info().num_bytes}))
