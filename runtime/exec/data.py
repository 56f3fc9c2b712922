"""Data per rank: each rank reads only the samples, and the fields, its stages consume.

The global order of samples is a pure function of ``(seed, epoch)``; global step ``k`` takes
positions ``[k*B, (k+1)*B)`` of the endless sequence of epochs (``B`` = global batch), and dp rank
``d`` of ``dp`` keeps the contiguous share ``[d*n, (d+1)*n)`` of them (``n = B // dp``), the rows
:meth:`runtime.exec.parallel_model.ParallelModel.train_local` expects::

    epoch 0 permutation | epoch 1 permutation | ...      (one torch.Generator each)
    step 0: [0, B)   step 1: [B, 2B)   ...               (steps run across epoch ends)
    step k, dp rank d: [k*B + d*n, k*B + (d+1)*n)

So a job resumed at step ``k`` (state: seed and next step) or re-planned with another ``dp``
continues the same global sequence. :class:`RankLoader` turns a rank's indices into the tensors
of the graph inputs its stages read (``ParallelModel.consumed_inputs``): the first pipeline stage
the model inputs, the last the labels, middle stages nothing (they never index the dataset, only
probe ``dataset[0]`` once for the named dims of the receive shapes).

Samples must have fixed shapes: every sample's fields have the shapes of ``dataset[0]``'s.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Dataset, Sampler

from passes.ir.errors import ConfigError
from passes.ir.meta import InputSpec

BATCH = "batch"
"""The named dim samples are stacked along."""

BYTE_VOCAB = 256
"""Vocabulary of byte-level tokens."""


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch``'s permutation: a hash of ``(seed, epoch)`` to 32 bits (torch's
    CPU generator keeps only the low 32 bits of a seed, so ``seed * 2**32 + epoch`` would ignore
    ``seed``)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class ShardedSampler(Sampler[list[int]]):
    """This dp rank's sample indices of every global step (see the module docstring).

    ``num_samples``: the dataset's length; ``global_batch``: samples per step over all dp ranks
    (a multiple of ``dp``); ``step``: the next step :meth:`take` returns. Iterating yields the
    index lists of steps ``step, step+1, ...`` forever without moving ``step`` (so it can serve
    as a ``batch_sampler`` of a ``torch.utils.data.DataLoader``); :meth:`take` returns the next
    one and moves on. ``state_dict()`` is JSON-able.
    """

    def __init__(self, num_samples: int, global_batch: int, *, dp: int = 1, dp_index: int = 0, seed: int = 0,
                 step: int = 0):
        if num_samples < 1:
            raise ConfigError("sampler: the dataset is empty; give it at least one sample")
        if global_batch < 1 or dp < 1 or global_batch % dp:
            raise ConfigError(f"sampler: global batch {global_batch} does not split over dp={dp}; use a global "
                              f"batch that is a multiple of dp")
        if not 0 <= dp_index < dp:
            raise ConfigError(f"sampler: dp_index {dp_index} is outside dp={dp}")
        self.num_samples, self.global_batch, self.dp, self.dp_index = num_samples, global_batch, dp, dp_index
        self.seed, self.step = seed, step
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def per_rank(self) -> int:
        """Samples of one step on this dp rank."""
        return self.global_batch // self.dp

    def _order(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (a permutation of the dataset's indices)."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # steps go forward: keep this epoch and the one before
                self._orders.pop(min(self._orders))
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._orders[epoch] = torch.randperm(self.num_samples, generator=gen)
        return self._orders[epoch]

    def _positions(self, start: int, count: int) -> list[int]:
        """Sample indices at positions ``[start, start+count)`` of the endless epoch sequence."""
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out += self._order(epoch)[offset:offset + take].tolist()
            pos += take
        return out

    def global_indices(self, step: int) -> list[int]:
        """All ``global_batch`` sample indices of ``step``, in dp-rank order."""
        return self._positions(step * self.global_batch, self.global_batch)

    def indices(self, step: int) -> list[int]:
        """This dp rank's contiguous share of ``step``'s samples."""
        n = self.per_rank
        return self._positions(step * self.global_batch + self.dp_index * n, n)

    def take(self) -> list[int]:
        """The indices of the next step; moves :attr:`step` on by one."""
        out = self.indices(self.step)
        self.step += 1
        return out

    def __iter__(self) -> Iterator[list[int]]:
        step = self.step
        while True:
            yield self.indices(step)
            step += 1

    def epoch(self, step: int | None = None) -> float:
        """Passes over the dataset done before ``step`` (default: the next one), fractional."""
        return (self.step if step is None else step) * self.global_batch / self.num_samples

    def state_dict(self) -> dict[str, int]:
        """JSON-able state: seed and next step (with the sizes they refer to)."""
        return {"seed": self.seed, "step": self.step, "global_batch": self.global_batch,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (of any dp). A different global batch continues at the same
        sample position, which must fall on one of this global batch's step boundaries."""
        if int(state["num_samples"]) != self.num_samples:
            raise ConfigError(f"sampler: the saved state is for a dataset of {state['num_samples']} samples, this "
                              f"one has {self.num_samples}; resume on the same data")
        position = int(state["step"]) * int(state["global_batch"])
        if position % self.global_batch:
            raise ConfigError(f"sampler: the saved state stopped after {position} samples, not a multiple of the "
                              f"global batch {self.global_batch}; resume with global batch {state['global_batch']}")
        self.seed, self.step = int(state["seed"]), position // self.global_batch
        self._orders.clear()


def sample_fields(sample: Any, inputs: Sequence[InputSpec]) -> dict[str, torch.Tensor]:
    """A sample as ``{input name: tensor}``: a dict by name, or a tuple/list in input order."""
    names = [i.name for i in inputs]
    if isinstance(sample, Mapping):
        missing = [n for n in names if n not in sample]
        if missing:
            raise ConfigError(f"data: samples have fields {sorted(sample)}, the model takes {names} (missing "
                              f"{missing}); name the dataset's fields after the model's inputs (TokenFileDataset: "
                              f"names={tuple(names)})")
        fields = {n: sample[n] for n in names}
    elif isinstance(sample, (tuple, list)):
        if len(sample) != len(names):
            raise ConfigError(f"data: samples are tuples of {len(sample)} tensors, the model takes {len(names)}: "
                              f"{names}; give one tensor per input, in that order")
        fields = dict(zip(names, sample))
    else:
        raise ConfigError(f"data: a sample is a {type(sample).__name__}; give a dict name -> tensor or a tuple of "
                          f"tensors in input order ({names})")
    for name, t in fields.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"data: field {name!r} of a sample is a {type(t).__name__}, not a tensor")
    return fields


def _sample_dims(spec: InputSpec) -> tuple[int | str, ...]:
    """The input's shape without its batch dim: one sample's shape."""
    return tuple(d for d in spec.shape if d != BATCH)


def probe_dataset(dataset: Dataset, inputs: Sequence[InputSpec]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Check ``dataset[0]`` against the graph ``inputs`` and read it: the per-sample shape of
    every field and the named dims other than batch (e.g. ``{"seq": 64}``). Raises
    :class:`ConfigError` for a field missing, of the wrong rank or fixed size, dims that disagree
    between fields, or a declared ``dataset.vocab_size`` above an integer input's ``high``."""
    specs = {i.name: i for i in inputs}
    probe = sample_fields(dataset[0], inputs)
    dims: dict[str, int] = {}
    for name, t in probe.items():
        want = _sample_dims(specs[name])
        if len(want) != t.dim() or any(isinstance(d, int) and d != size for d, size in zip(want, t.shape)):
            raise ConfigError(f"data: field {name!r} of a sample has shape {tuple(t.shape)}; the input is "
                              f"{specs[name].shape}, so one sample is {want}")
        for d, size in zip(want, t.shape):
            if isinstance(d, str) and dims.setdefault(d, int(size)) != size:
                raise ConfigError(f"data: dim {d!r} is {dims[d]} in one field of a sample and {size} in "
                                  f"{name!r}; the fields must agree")
    vocab = getattr(dataset, "vocab_size", None)
    for name, t in probe.items():
        high = specs[name].high
        if vocab is not None and not t.is_floating_point() and high is not None and high < vocab:
            raise ConfigError(f"data: the dataset's token ids go up to {vocab - 1} but input {name!r} takes "
                              f"ids below {high}; build the model with a vocab of at least {vocab} "
                              f"(e.g. vocab={vocab}), or use a tokenizer with a smaller vocabulary")
    return {n: tuple(t.shape) for n, t in probe.items()}, dims


class RankLoader:
    """This rank's rows of every step: ``next() -> (rows, dims)``.

    ``rows``: ``{name: tensor}`` for the names in ``consumed`` only, the samples of this dp rank's
    share stacked along each input's batch dim; ``dims``: the named dims other than batch (e.g.
    ``{"seq": 64}``), read once from a probe of ``dataset[0]``, so a rank that consumes nothing
    knows them without indexing the dataset again. ``inputs``: the InputSpecs of every graph
    input (``ParallelModel.inputs``).

    Samples must have fixed shapes (those of ``dataset[0]``); a later sample of another shape
    raises :class:`ConfigError`. A dataset may declare ``vocab_size`` (ids are in
    ``[0, vocab_size)``): integer inputs with a ``high`` below it are refused at start; every
    integer input is also checked against its ``high`` as it is loaded.

    ``loaded_bytes``: bytes of the tensors kept over all steps; ``last_step_bytes``: those of
    the last step (the probe is not counted: it is not kept).
    """

    def __init__(self, dataset: Dataset, sampler: ShardedSampler, consumed: Sequence[str],
                 inputs: Sequence[InputSpec]):
        self.dataset, self.sampler = dataset, sampler
        self.inputs = {i.name: i for i in inputs}
        unknown = [n for n in consumed if n not in self.inputs]
        if unknown:
            raise ConfigError(f"data: this rank consumes {unknown}, which are not graph inputs {list(self.inputs)}")
        self.consumed = tuple(consumed)
        self.sample_shapes, self.dims = probe_dataset(dataset, inputs)
        self.loaded_bytes = 0
        self.last_step_bytes = 0

    def next(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The next step's rows of the consumed inputs, and the named dims (see the class)."""
        step = self.sampler.step
        indices = self.sampler.take()
        rows: dict[str, torch.Tensor] = {}
        if self.consumed:
            per_name: dict[str, list[torch.Tensor]] = {n: [] for n in self.consumed}
            specs = [self.inputs[n] for n in self.inputs]
            for i in indices:
                fields = sample_fields(self.dataset[i], specs)
                for n in self.consumed:
                    t = fields[n]
                    if tuple(t.shape) != self.sample_shapes[n]:
                        raise ConfigError(f"data: sample {i} has {n!r} of shape {tuple(t.shape)}, sample 0 "
                                          f"{self.sample_shapes[n]}; samples must have fixed shapes (pad or "
                                          f"cut them to one length)")
                    per_name[n].append(t)
            for n, ts in per_name.items():
                rows[n] = torch.stack(ts, dim=list(self.inputs[n].shape).index(BATCH))
                self._check_range(n, rows[n], step)
        self.last_step_bytes = sum(t.numel() * t.element_size() for t in rows.values())
        self.loaded_bytes += self.last_step_bytes
        return rows, dict(self.dims)

    def _check_range(self, name: str, t: torch.Tensor, step: int) -> None:
        high = self.inputs[name].high
        if t.is_floating_point() or high is None or t.numel() == 0:
            return
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= high:
            raise ConfigError(f"data: step {step} has {name!r} values in [{lo}, {hi}], the input takes [0, {high}); "
                              f"build the model with a vocab of at least {hi + 1} or fix the data")

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, int]]]:
        while True:
            yield self.next()


class TokenFileDataset(Dataset):
    """A text file as fixed windows of ``seq + 1`` tokens: sample ``i`` is tokens
    ``[i*seq, i*seq + seq + 1)`` as ``{names[0]: window[:-1], names[1]: window[1:]}`` (int64),
    so every token after the first is a target once.

    ``tokenizer=None``: byte-level tokens (the file's bytes, vocabulary 256), read from the file
    per sample (a rank that indexes nothing reads nothing). ``tokenizer="NAME"``: a Hugging Face
    tokenizer (``transformers.AutoTokenizer.from_pretrained(NAME)``: a hub name in the local cache
    or a directory), which tokenizes the whole text once, on first use. ``vocab_size``: ids are
    in ``[0, vocab_size)`` (checked against the model by :class:`RankLoader`).
    """

    def __init__(self, path: str | Path, seq: int, *, tokenizer: str | None = None,
                 names: tuple[str, str] = ("input_ids", "labels")):
        self.path, self.seq, self.names = Path(path), int(seq), tuple(names)
        if self.seq < 1:
            raise ConfigError(f"data: sequence length {seq} must be at least 1")
        if not self.path.is_file():
            raise ConfigError(f"data: {self.path} is not a file; give a text file to train on")
        self.tokenizer_name = tokenizer
        self._ids: torch.Tensor | None = None  # HF tokens, made on first use
        if tokenizer is None:
            self.vocab_size = BYTE_VOCAB
            self._num_tokens = self.path.stat().st_size
        else:
            self._tokenizer = _load_tokenizer(tokenizer)
            self.vocab_size = len(self._tokenizer)
            self._num_tokens = None
        if len(self) < 1:
            raise ConfigError(f"data: {self.path} has {self.num_tokens} tokens, fewer than one window of seq+1 = "
                              f"{self.seq + 1}; give a longer text or a shorter seq")

    @property
    def num_tokens(self) -> int:
        if self._num_tokens is None:
            self._num_tokens = int(self._tokens().numel())
        return self._num_tokens

    def _tokens(self) -> torch.Tensor:
        if self._ids is None:
            text = self.path.read_text(encoding="utf-8")
            ids = self._tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                                  verbose=False)["input_ids"]
            self._ids = torch.tensor(ids, dtype=torch.int64)
        return self._ids

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq)

    def _window(self, i: int) -> torch.Tensor:
        start = i * self.seq
        if self.tokenizer_name is not None:
            return self._tokens()[start:start + self.seq + 1]
        with self.path.open("rb") as f:
            f.seek(start)
            data = f.read(self.seq + 1)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        w = self._window(i)
        return {self.names[0]: w[:-1].clone(), self.names[1]: w[1:].clone()}

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of token ids (byte-level: UTF-8, undecodable bytes replaced)."""
        ids = [int(i) for i in ids]
        if self.tokenizer_name is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._tokenizer.decode(ids)


def _load_tokenizer(name: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"data: tokenizer {name!r} needs the transformers package (pip install transformers); "
                          f"or leave the tokenizer out for byte-level tokens") from None
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data: cannot load tokenizer {name!r} ({type(exc).__name__}: {str(exc)[:200]}); give a "
                          f"directory with tokenizer files or a hub name already in the local cache (this "
                          f"machine may be offline), or leave the tokenizer out for byte-level tokens") from None


__all__ = ["ShardedSampler", "RankLoader", "TokenFileDataset", "sample_fields", "probe_dataset", "BYTE_VOCAB"]
