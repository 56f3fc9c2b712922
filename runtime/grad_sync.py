"""Gradient synchronisation and the optimizer step of one rank.

* :class:`TiedSync`: a weight read on several stages (the tied embedding / LM head) has one copy
  per stage; the gradients of the copies are summed (locally for copies on this rank, then an
  all-reduce over the pipeline's first and last ranks when they are the holders, as for a GPT,
  else over the whole pipeline group with zeros from non-holders) and written back to every
  copy, so identical copies with identical optimizer states stay identical.
* :class:`BucketedGradSync`: data-parallel gradient average in flat buckets of about
  ``bucket_bytes`` (fewer, larger messages), overlapped with backward. A
  ``register_post_accumulate_grad_hook`` per parameter counts its gradient accumulations; when
  every parameter of a bucket has received the last one of the step (its stages' backward count:
  with gradient accumulation over micro-batches only the last backward triggers), the bucket's
  async all-reduce (or, for ZeRO-2, reduce-scatter) starts while backward goes on. ``finish``
  launches what backward did not reach, waits every handle and averages. Tied copies sit in
  buckets of their own that start after :class:`TiedSync` (their sum must be complete first).
  Buckets are filled in reverse parameter order, the order backward produces gradients.
* :class:`ZeroAdamW`: ZeRO stage 1: every dp rank keeps the AdamW state of one contiguous shard
  of the flattened parameters, steps it, and all-gathers the updated shards. AdamW is elementwise,
  so this gives the same parameters as an unsharded AdamW. Gradients are still all-reduced in full
  (ZeRO-2, :class:`Zero2AdamW`, reduce-scatters them instead).
* :class:`Zero2AdamW`: ZeRO stage 2: the gradients are reduce-scattered bucket by bucket, so
  each dp rank keeps only its 1/dp chunk of every (padded) bucket and frees the full gradients;
  it steps the AdamW state of that chunk and all-gathers the updated parameters.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from passes.ir.errors import ConfigError
from runtime import comm

DEFAULT_BUCKET_BYTES = 25 * 2**20
# As DDP: the first bucket (the last layers' gradients, ready first) is small, so that
# communication starts early in backward instead of after 25 MiB of gradients.
FIRST_BUCKET_BYTES = 2**20


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of ``modules``, each once, in a deterministic order."""
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def fill_missing_grads(params: Sequence[nn.Parameter]) -> None:
    """Zero gradients for parameters backward did not reach, so every rank sends the same buckets."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


@dataclass
class TiedCopies:
    """The copies of one tied weight on this rank and the group to sum their gradients over
    (``None`` when every copy is on this rank). A rank of the group holding no copy (a middle
    stage, when the group is the whole pipeline) contributes zeros of ``shape``/``dtype``."""

    name: str
    copies: list[nn.Parameter]
    group: dist.ProcessGroup | None
    shape: tuple[int, ...]
    dtype: torch.dtype


class TiedSync:
    """Sum the gradients of every tied weight's copies across stages (see the module docstring)."""

    def __init__(self, tied: Sequence[TiedCopies], device: torch.device | str = "cpu"):
        self.tied = list(tied)
        self.device = device

    def __call__(self) -> None:
        for t in self.tied:
            total = torch.zeros(t.shape, dtype=t.dtype, device=self.device)
            for p in t.copies:
                total += p.grad
            if t.group is not None:
                comm.all_reduce(total, t.group)
            for p in t.copies:
                p.grad.copy_(total)


class ZeroAdamW:
    """AdamW whose state is sharded over the dp group (ZeRO-1); same results as ``torch.optim.AdamW``.

    Call :meth:`step` after the gradients are averaged over dp (every rank holds full gradients).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, rank: int, size: int,
                 **adamw_kwargs):
        self.params = list(params)
        self.group, self.rank, self.size = group, rank, size
        total = sum(p.numel() for p in self.params)
        self.shard_numel = -(-total // size)  # padded: every shard the same length for all_gather
        self.padded = self.shard_numel * size
        flat = self._flatten([p.detach() for p in self.params])
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(flat[lo:lo + self.shard_numel].clone())
        self.optimizer = torch.optim.AdamW([self.shard], **adamw_kwargs)

    def _flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.padded - flat.numel()))

    @torch.no_grad()
    def step(self) -> None:
        lo = self.rank * self.shard_numel
        self.shard.grad = self._flatten([p.grad for p in self.params])[lo:lo + self.shard_numel].clone()
        self.optimizer.step()
        if self.size > 1:
            shards = [torch.empty_like(self.shard) for _ in range(self.size)]
            comm.all_gather(shards, self.shard.detach(), self.group)
            flat = torch.cat(shards)
        else:
            flat = self.shard.detach()
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (exp_avg and exp_avg_sq of its shard)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


# ------------------------------------------------------------------------------------------------
# Overlapped buckets and ZeRO-2


def expected_accumulations(stage_params: Mapping[int, Sequence[nn.Parameter]],
                           backward_counts: Mapping[int, int]) -> dict[int, int]:
    """Gradient accumulations per parameter (by ``id``) in one step: the backward actions of
    every local stage that holds it (a parameter shared by two stages on this rank counts both)."""
    out: dict[int, int] = {}
    for s, params in stage_params.items():
        for p in {id(p): p for p in params}.values():
            out[id(p)] = out.get(id(p), 0) + backward_counts.get(s, 0)
    return out


@dataclass(eq=False)
class GradBucket:
    """Parameters whose gradients travel in one flat message; ``numel`` is padded to a multiple
    of the group size when sharded (reduce-scatter needs equal chunks)."""

    params: list[nn.Parameter]
    numel: int
    late: bool  # tied copies: launched by ``finish`` after the tied sum
    pending: int = 0  # parameters still waiting for their last accumulation this step
    flat: torch.Tensor | None = None
    out: torch.Tensor | None = None  # this rank's reduced chunk (sharded mode)
    work: object | None = None


@dataclass(frozen=True)
class LaunchEvent:
    """One bucket's collective start: ``perf_counter`` seconds, and whether a backward hook
    (overlap) or ``finish`` (after backward) started it."""

    bucket: int
    time_s: float
    from_hook: bool


class BucketedGradSync:
    """Data-parallel gradient average over ``group`` (``size`` ranks) in flat buckets, started by
    backward hooks (``overlap``) or after backward; ``shard=True`` reduce-scatters (ZeRO-2).

    ``late``: parameters (tied copies) that go in trailing buckets started by :meth:`finish` after
    the ``before_late`` callback (the tied sum). ``accumulations``: gradient accumulations per
    parameter per step (:func:`expected_accumulations`); a parameter missing there never
    triggers a launch from its hook. Every rank of ``group`` must build it from the same shapes
    in the same order, and backward must reach parameters in the same order on every rank (the
    same program): the collectives are matched by issue order.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int, *,
                 rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, late: Sequence[nn.Parameter] = (),
                 overlap: bool = True, shard: bool = False, accumulations: Mapping[int, int] | None = None):
        self.group, self.size, self.rank, self.shard = group, size, rank, shard
        late_ids = {id(p) for p in late}
        self.params = list(params)
        early = [p for p in reversed(self.params) if id(p) not in late_ids]
        tail = [p for p in reversed(self.params) if id(p) in late_ids]
        self.buckets = self._fill(early, bucket_bytes, False) + self._fill(tail, bucket_bytes, True)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.accumulations = dict(accumulations or {})
        self._seen: dict[int, int] = {}
        self.events: list[LaunchEvent] = []  # this step's launches so far
        self.last_events: list[LaunchEvent] = []  # the last finished step's (tests check the overlap)
        self.overlap = overlap and (size > 1 or shard)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in early] if self.overlap else []
        self.reset()

    def _fill(self, params: Sequence[nn.Parameter], bucket_bytes: int, late: bool) -> list[GradBucket]:
        groups: list[list[nn.Parameter]] = []
        filled = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if len(groups) == 1 and not late else bucket_bytes
            if not groups or filled + nbytes > cap or p.dtype != groups[-1][0].dtype:
                groups.append([])
                filled = 0
            groups[-1].append(p)
            filled += nbytes
        out = []
        for ps in groups:
            n = sum(p.numel() for p in ps)
            out.append(GradBucket(ps, -(-n // self.size) * self.size if self.shard else n, late))
        return out

    def reset(self) -> None:
        """Forget the current step's progress (called by :meth:`finish` and before each step)."""
        self._seen.clear()
        self.events = []
        for b in self.buckets:
            b.pending, b.flat, b.out, b.work = len(b.params), None, None, None

    # ------------------------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        expected = self.accumulations.get(id(p))
        if expected is None:
            return
        bucket = self._bucket_of[id(p)]
        seen = self._seen[id(p)] = self._seen.get(id(p), 0) + 1
        if bucket.work is not None:
            raise ConfigError(f"grad_sync: a parameter of shape {tuple(p.shape)} got gradient accumulation {seen} "
                              f"after its bucket was sent ({expected} expected per step); the backward-count "
                              f"given to BucketedGradSync is wrong: pass overlap_grad_sync=False to work around")
        if seen == expected:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket, from_hook=True)

    def _launch(self, b: GradBucket, *, from_hook: bool) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if b.numel > flat.numel():
            flat = torch.nn.functional.pad(flat, (0, b.numel - flat.numel()))
        b.flat = flat
        if self.shard:
            chunks = list(flat.chunk(self.size))
            b.out = torch.empty_like(chunks[0])
            if self.size > 1:
                b.work = comm.reduce_scatter(b.out, chunks, self.group, async_op=True)
            else:
                b.out.copy_(chunks[0])
                b.work = _DONE
            for p in b.params:  # ZeRO-2: this rank keeps only its reduced chunk
                p.grad = None
        else:
            b.work = comm.all_reduce(flat, self.group, async_op=True) if self.size > 1 else _DONE
        self.events.append(LaunchEvent(self.buckets.index(b), time.perf_counter(), from_hook))

    @torch.no_grad()
    def finish(self, before_late: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Launch every bucket backward did not (first the early ones, then ``before_late()``,
        then the late ones), wait all and average. All-reduce mode: ``p.grad`` holds the average
        (a view into the bucket). Sharded mode: returns this rank's averaged flat gradient chunk
        (the concatenation of its chunk of every bucket) and leaves ``p.grad`` None."""
        for b in self.buckets:
            if not b.late and b.work is None:
                self._launch(b, from_hook=False)
        if before_late is not None:
            before_late()
        for b in self.buckets:
            if b.late:
                self._launch(b, from_hook=False)
        chunks = []
        for b in self.buckets:
            comm.wait(b.work, self.group)
            if self.shard:
                chunks.append(b.out.div_(self.size))
                continue
            if self.size > 1:
                b.flat /= self.size
            offset = 0
            for p in b.params:
                p.grad = b.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.last_events = list(self.events)
        self.reset()
        return torch.cat(chunks) if self.shard else None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Done:
    """The handle of a collective over one rank: nothing to wait for."""

    def wait(self, timeout=None) -> bool:
        return True


_DONE = _Done()


class Zero2AdamW:
    """ZeRO-2 AdamW over the dp group of ``sync`` (a sharded :class:`BucketedGradSync`): this
    rank's AdamW state and gradients cover only its chunk of every bucket (1/dp of the padded
    flat parameters); same results as ``torch.optim.AdamW``.

    The step: ``sync.finish`` (called by the gradient-sync action) hands over the averaged chunk;
    :meth:`step` steps the chunk and all-gathers every bucket's updated chunks into the params.
    """

    def __init__(self, sync: BucketedGradSync, **adamw_kwargs):
        if not sync.shard:
            raise ConfigError("grad_sync: Zero2AdamW needs a BucketedGradSync built with shard=True")
        self.sync = sync
        self.params = sync.params
        self.rank, self.size, self.group = sync.rank, sync.size, sync.group
        with torch.no_grad():
            chunks = [self._flat(b, [p.detach() for p in b.params]).chunk(self.size)[self.rank] for b in sync.buckets]
        self.master = nn.Parameter(torch.cat(chunks).clone())
        self.optimizer = torch.optim.AdamW([self.master], **adamw_kwargs)
        self.grad_chunk: torch.Tensor | None = None

    @staticmethod
    def _flat(b: GradBucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, b.numel - flat.numel()))

    def set_grad(self, chunk: torch.Tensor) -> None:
        """The averaged gradient chunk from :meth:`BucketedGradSync.finish`."""
        self.master.grad = chunk

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        gathered, offset = [], 0
        for b in self.sync.buckets:
            n = b.numel // self.size
            mine = self.master.detach()[offset:offset + n]
            offset += n
            if self.size > 1:
                parts = [torch.empty_like(mine) for _ in range(self.size)]
                gathered.append((b, parts, comm.all_gather(parts, mine, self.group, async_op=True)))
            else:
                gathered.append((b, [mine], _DONE))
        for b, parts, work in gathered:
            comm.wait(work, self.group)
            flat, pos = torch.cat(parts), 0
            for p in b.params:
                p.copy_(flat[pos:pos + p.numel()].view_as(p))
                pos += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.master.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (exp_avg and exp_avg_sq of its chunk)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)

    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds after the sync (its chunk; full grads are freed)."""
        held = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        g = self.master.grad
        return held + (g.numel() * g.element_size() if g is not None else 0)


def zero_stage(zero: bool | int) -> int:
    """The ZeRO stage asked for: ``False``/0 none, ``True``/1 optimizer state, 2 also gradients."""
    stage = int(zero) if isinstance(zero, (bool, int)) else -1
    if stage not in (0, 1, 2):
        raise ConfigError(f"grad_sync: zero={zero!r} is not a ZeRO stage we run; use 0, 1 (or True) or 2")
    return stage
