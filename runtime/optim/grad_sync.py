"""Gradient synchronisation and the optimizer step of one rank.

* :class:`TiedSync`: a weight read on several stages (the tied embedding / LM head) has one copy
  per stage; the gradients of the copies are summed (locally for copies on this rank, then an
  all-reduce over the pipeline's first and last ranks when they are the holders, as for a GPT,
  else over the whole pipeline group with zeros from non-holders) and written back to every
  copy, so identical copies with identical optimizer states stay identical.
* :class:`BucketedGradSync`: data-parallel gradient sync in flat buckets of about
  ``bucket_bytes`` (fewer, larger messages), overlapped with backward. A
  ``register_post_accumulate_grad_hook`` per parameter tells a bucket when its gradients are
  complete. Three modes, one per ZeRO stage:

  - ``"all_reduce"`` (no ZeRO): a bucket's async all-reduce starts when every parameter of it has
    received the last accumulation of the step (with micro-batches only the last backward
    triggers); ``finish`` averages and makes every ``p.grad`` a view of its bucket.
  - ``"reduce_scatter"`` (ZeRO-1): the same trigger, but a reduce-scatter: each dp rank keeps only
    its 1/dp chunk of the (padded) bucket and the full gradients are freed. Full-size gradients
    live through the accumulation, as ZeRO-1 keeps them.
  - ``"reduce_scatter_each"`` (ZeRO-2): a bucket is reduce-scattered after EVERY backward that
    completes it, its full gradients are freed at once, and the chunk is added into a sharded
    fp32 accumulator: full-size gradients live only while their bucket is in flight (at most
    ``MAX_IN_FLIGHT`` buckets; the oldest is waited for before another starts, and a bucket's
    last launch when its next round begins).

  ``finish`` launches what backward did not reach and waits every handle. Tied copies (and
  sequence-parallel partial gradients) sit in buckets of their own that start after
  :class:`TiedSync` (their sum must be complete first), so they stay full-size until then.
  Buckets are filled in reverse parameter order, the order backward produces gradients.
* :class:`ShardedOptimizer`: ZeRO-1 and ZeRO-2: each dp rank keeps an fp32 master copy of its chunk of
  every bucket and the optimizer state of that chunk, steps it with the averaged gradient chunk, and
  all-gathers the updated chunks (in the parameters' dtype: 16 bits under bf16/fp16) into the
  parameters. An elementwise optimizer (AdamW, Adam, SGD, ...) gives the same parameters as unsharded.
  With expert parallelism the experts a rank holds are sharded the same way over the ranks that
  hold the same experts (their own buckets), stepped by the same optimizer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from passes.ir.errors import ConfigError
# the bucket layout is one pure function of the leaf, shared with the pre-launch communication check
from passes.ir.grad_buckets import (DEFAULT_BUCKET_BYTES, MAX_IN_FLIGHT, MODE_OF_ZERO_STAGE, BucketMachine, GradSlot,
                                    Launch, Retire, SyncMode, bucket_layout)
from runtime.dist import comm
from runtime.optim.optimizers import (
    OptimizerFactory, as_factory, build, check_shardable, init_state_exact, param_groups, state_keys,
)


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
    flat: torch.Tensor | None = None  # all-reduce mode: the bucket, averaged in place
    out: torch.Tensor | None = None  # sharded modes: this rank's summed chunk so far (fp32)
    work: object | None = None  # all-reduce and ZeRO-1: the step's one collective


@dataclass(eq=False)
class _InFlight:
    """A ZeRO-2 reduce-scatter not yet waited for: its handle, its result chunk and the full flat
    copy it reads (kept alive until the wait)."""

    bucket: GradBucket
    work: object
    chunk: torch.Tensor
    flat: torch.Tensor


@dataclass(frozen=True)
class LaunchEvent:
    """One bucket's collective start: ``perf_counter`` seconds, and whether a backward hook
    (overlap) or ``finish`` (after backward) started it."""

    bucket: int
    time_s: float
    from_hook: bool


class BucketedGradSync:
    """Data-parallel gradient sync over ``group`` (``size`` ranks) in flat buckets (see the module
    docstring for the three ``mode``s). When each bucket starts and is waited is
    :class:`passes.ir.grad_buckets.BucketMachine`'s rule; this class moves the tensors.

    ``late``: parameters (tied copies) that go in trailing buckets started by :meth:`finish` after
    the ``before_late`` callback (the tied sum). ``accumulations``: gradient accumulations per
    parameter per step (:func:`expected_accumulations`); in the all-reduce and ZeRO-1 modes a
    parameter missing there never triggers a launch from its hook. ``overlap=False`` starts
    collectives only in :meth:`finish` (ZeRO-2 still reduces after every backward, waiting at
    once). ``divisor``: what the summed gradients are divided by (default ``size``: the average over
    the group; an expert-parallel rank's experts divide by the whole data axis). Every rank of
    ``group`` must build it from the same shapes in the same order, and
    backward must reach parameters in the same order on every rank (the same program): the
    collectives are matched by issue order.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int, *,
                 rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, late: Sequence[nn.Parameter] = (),
                 overlap: bool = True, mode: SyncMode = "all_reduce", accumulations: Mapping[int, int] | None = None,
                 divisor: int | None = None):
        if mode not in MODE_OF_ZERO_STAGE.values():
            raise ConfigError(f"grad_sync: unknown mode {mode!r}; use one of {sorted(MODE_OF_ZERO_STAGE.values())}")
        self.group, self.size, self.rank, self.mode = group, size, rank, mode
        self.divisor = size if divisor is None else divisor
        self.shard = mode != "all_reduce"
        self.each_backward = mode == "reduce_scatter_each"
        late_ids = {id(p) for p in late}
        self.params = list(params)
        layout = bucket_layout([GradSlot(p.numel(), p.dtype, id(p) in late_ids) for p in self.params],
                               size=size, shard=self.shard, bucket_bytes=bucket_bytes)
        self.buckets = [GradBucket([self.params[i] for i in b.members], b.numel, b.late) for b in layout]
        self._member = {id(p): i for i, p in enumerate(self.params)}
        self.accumulations = dict(accumulations or {})
        self.overlap = overlap and (size > 1 or self.shard)
        self.machine = BucketMachine(layout, mode, hooked=self.overlap, overlap=self.overlap,
                                     expected={i: self.accumulations[id(p)] for i, p in enumerate(self.params)
                                               if id(p) in self.accumulations})
        self._in_flight: dict[int, _InFlight] = {}  # launch number -> its ZeRO-2 reduce-scatter
        self.events: list[LaunchEvent] = []  # this step's launches so far
        self.last_events: list[LaunchEvent] = []  # the last finished step's (tests check the overlap)
        early = [p for b in self.buckets if not b.late for p in b.params]
        self.hooked = self.overlap or self.each_backward  # buckets launch from backward's hooks
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in early] if self.hooked else []
        self.reset()

    def reset(self) -> None:
        """Forget the current step's progress (called by :meth:`finish` and before each step)."""
        self.machine.reset()
        self._in_flight = {}
        self.events = []
        for b in self.buckets:
            b.flat, b.out, b.work = None, None, None

    def held_bytes(self) -> int:
        """Gradient bytes this object holds now: ZeRO's summed chunks and the flat copies of the
        buckets in flight (all-reduce mode: the buckets, which ``p.grad`` views after ``finish``)."""
        total = 0
        for b in self.buckets:
            for t in (b.flat, b.out):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total + sum(f.flat.numel() * f.flat.element_size() for f in self._in_flight.values())

    # ------------------------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        try:
            self._do(self.machine.accumulated(self._member[id(p)]))
        except ConfigError as e:
            raise ConfigError(f"{e} (a parameter of shape {tuple(p.shape)})") from None

    def _do(self, steps: Sequence[Launch | Retire]) -> None:
        for step in steps:
            if isinstance(step, Launch):
                self._launch(step)
            else:
                self._retire(step)

    def _flat_grads(self, b: GradBucket, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The bucket's gradients in one flat (padded) tensor of ``dtype`` (default: theirs), each
        copied into its slice: no per-gradient converted copies on the way (16-bit gradients into
        an fp32 flat would otherwise hold twice the flat's bytes at once)."""
        first = b.params[0]
        flat = torch.empty(b.numel, dtype=dtype or first.dtype, device=first.device)
        offset = 0
        for p in b.params:
            n = p.numel()
            if p.grad is None:
                flat[offset:offset + n].zero_()
            else:
                flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        flat[offset:].zero_()
        return flat

    def _launch(self, launch: Launch) -> None:
        b = self.buckets[launch.bucket]
        self.events.append(LaunchEvent(launch.bucket, time.perf_counter(), launch.from_hook))
        if not self.shard:
            b.flat = self._flat_grads(b)
            b.work = comm.all_reduce(b.flat, self.group, async_op=True) if self.size > 1 else _DONE
            return
        flat = self._flat_grads(b, torch.float32)  # the shard sums in fp32 whatever the grads' dtype
        for p in b.params:  # this rank keeps only its reduced chunk
            p.grad = None
        chunks = list(flat.chunk(self.size))
        chunk = torch.empty_like(chunks[0])
        if self.size > 1:
            work = comm.reduce_scatter(chunk, chunks, self.group, async_op=True)
        else:
            chunk.copy_(chunks[0])
            work = _DONE
        if not self.each_backward:  # ZeRO-1: one collective per bucket and step
            b.out, b.work, b.flat = chunk, work, flat
            return
        self._in_flight[launch.launch] = _InFlight(b, work, chunk, flat)

    def _retire(self, retire: Retire) -> None:
        """ZeRO-2: wait one reduce-scatter and add its chunk into the bucket's accumulator."""
        f = self._in_flight.pop(retire.launch)
        comm.wait(f.work, self.group)
        if f.bucket.out is None:
            f.bucket.out = f.chunk
        else:
            f.bucket.out += f.chunk

    @torch.no_grad()
    def finish(self, before_late: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Launch every bucket backward did not complete (first the early ones, then
        ``before_late()``, then the late ones), wait all and average. All-reduce mode: ``p.grad``
        holds the average (a view into the bucket). Sharded modes: returns this rank's averaged
        flat gradient chunk (the concatenation of its chunk of every bucket, fp32) and leaves
        ``p.grad`` None."""
        self._do(self.machine.finish_early())
        if before_late is not None:
            before_late()
        self._do(self.machine.finish_late())
        chunks = []
        for b in self.buckets:
            if self.shard:
                if b.work is not None:
                    comm.wait(b.work, self.group)
                    b.flat = None
                chunks.append(b.out.div_(self.divisor))
                continue
            comm.wait(b.work, self.group)
            if self.divisor > 1:
                b.flat /= self.divisor
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


@dataclass(frozen=True)
class Segment:
    """A run of this rank's flat chunk that one optimizer tensor steps: elements
    ``[start, stop)`` of the concatenated chunks, all of one parameter group."""

    start: int
    stop: int
    group: int
    weight: float = 1.0
    """How much the segment's elements count in the global gradient norm (see ParallelModel)."""


@dataclass(frozen=True, eq=False)
class ChunkRange:
    """This rank's part of one bucket of a sharded sync: elements ``[lo, hi)`` of the bucket's
    flat (padded) tensor, at ``offset`` in the rank's concatenated chunk (what the
    :class:`ShardedOptimizer` steps and a ZeRO checkpoint writes)."""

    sync: BucketedGradSync
    bucket: GradBucket
    lo: int
    hi: int
    offset: int

    @property
    def stop(self) -> int:
        return self.offset + self.hi - self.lo


def chunk_ranges(syncs: Sequence[BucketedGradSync]) -> list[ChunkRange]:
    """The :class:`ChunkRange` of every bucket of ``syncs`` in order: one rank's chunk of each
    bucket (1/size of it, at the rank's place in the sync's group), back to back."""
    out, offset = [], 0
    for sync in syncs:
        for b in sync.buckets:
            n = b.numel // sync.size
            out.append(ChunkRange(sync, b, sync.rank * n, (sync.rank + 1) * n, offset))
            offset += n
    return out


class ShardedOptimizer:
    """ZeRO-1/2 over the groups of ``syncs`` (sharded :class:`BucketedGradSync` s: the dp buckets
    and, with expert parallelism, the expert buckets over the ranks holding the same experts):
    this rank's fp32 master weights, optimizer state and gradients cover only its chunk of every
    bucket (1/size of the padded flat parameters of each sync); same results as the unsharded
    optimizer for an elementwise one (:data:`runtime.optim.optimizers.ELEMENTWISE`; others are
    refused). One torch optimizer steps every chunk, so a learning-rate scheduler and the global
    gradient norm see one optimizer whatever the groups.

    The chunk is cut into :class:`Segment` s at every parameter whose group (decay / no decay) or
    norm weight differs from the one before (and at every sync's end); each segment is a leaf
    tensor sharing the master chunk's storage, so the torch optimizer (``factory``) steps the
    chunk in place with per-group settings. The padding past a bucket's last parameter belongs to
    no segment and never changes.

    The step: each ``sync.finish`` (called by the gradient-sync action) hands over its averaged
    chunk, :meth:`set_grad` takes them concatenated; :meth:`step` steps the segments and
    all-gathers every bucket's updated chunks into the params over its sync's group (at most
    ``MAX_IN_FLIGHT`` buckets' gathers at once, so the gathered copies stay small).
    """

    def __init__(self, syncs: BucketedGradSync | Sequence[BucketedGradSync], *, factory: OptimizerFactory | None = None,
                 no_decay: Mapping[int, bool] | None = None, norm_weight: Mapping[int, float] | None = None):
        self.syncs = [syncs] if isinstance(syncs, BucketedGradSync) else list(syncs)
        if not self.syncs or any(not s.shard for s in self.syncs):
            raise ConfigError("grad_sync: ShardedOptimizer needs BucketedGradSyncs in a reduce_scatter mode")
        if len({s.mode for s in self.syncs}) > 1:
            raise ConfigError("grad_sync: the syncs of one ShardedOptimizer must share one ZeRO mode")
        self.params = [p for s in self.syncs for p in s.params]
        self.ranges = chunk_ranges(self.syncs)
        with torch.no_grad():
            chunks = [self._flat(r.bucket, [p.detach().float() for p in r.bucket.params])[r.lo:r.hi]
                      for r in self.ranges]
        self.master = nn.Parameter(torch.cat(chunks).clone() if chunks else torch.zeros(0))
        flags = no_decay if no_decay is not None else {id(p): p.dim() < 2 for p in self.params}
        weights = norm_weight or {}
        self.segments = self._segments(lambda p: (int(bool(flags[id(p)])), float(weights.get(id(p), 1.0))))
        self.pieces = [nn.Parameter(self.master.detach()[s.start:s.stop]) for s in self.segments]  # views
        self._index = {id(pc): k for k, pc in enumerate(self.pieces)}  # piece -> its segment
        groups = [[pc for pc, s in zip(self.pieces, self.segments) if s.group == g] for g in (0, 1)]
        self.optimizer = build(factory or as_factory(None),
                               param_groups(groups[0] + groups[1], [False] * len(groups[0]) + [True] * len(groups[1])))
        check_shardable(self.optimizer, 2 if self.syncs[0].mode == "reduce_scatter_each" else 1)
        init_state_exact(self.optimizer)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (what a learning-rate scheduler steps)."""
        return self.optimizer.param_groups

    def _segments(self, group_of) -> list[Segment]:
        out: list[Segment] = []
        previous = None
        for r in self.ranges:
            pos = 0
            for p in r.bucket.params:
                a, z = max(pos, r.lo), min(pos + p.numel(), r.hi)
                pos += p.numel()
                if a >= z:
                    continue
                start, stop, (g, w) = r.offset + a - r.lo, r.offset + z - r.lo, group_of(p)
                if out and out[-1].stop == start and (out[-1].group, out[-1].weight) == (g, w) and r.sync is previous:
                    out[-1] = Segment(out[-1].start, stop, g, w)
                else:
                    out.append(Segment(start, stop, g, w))
                previous = r.sync
        return out

    def flat_state(self) -> dict[str, torch.Tensor]:
        """The optimizer state as tensors over the whole chunk (segments back in place, zeros in
        the padding) plus the scalar entries (``step``: the same in every segment); empty before
        the first step of an optimizer with lazy state."""
        out: dict[str, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            scalars, tensors = state_keys(self.optimizer, group)
            for piece in group["params"]:
                state = self.optimizer.state.get(piece)
                if not state:
                    continue
                seg = self.segments[self._index[id(piece)]]
                for key in scalars:
                    out.setdefault(key, state[key].detach().clone())
                for key in tensors:
                    flat = out.setdefault(key, torch.zeros_like(self.master.detach()))
                    flat[seg.start:seg.stop].copy_(state[key])
        return out

    def state_layout(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(scalar keys, tensor keys) of the state every segment holds once stepped."""
        scalars, tensors = set(), set()
        for group in self.optimizer.param_groups:
            sc, te = state_keys(self.optimizer, group)
            scalars.update(sc)
            tensors.update(te)
        return tuple(sorted(scalars)), tuple(sorted(tensors))

    @torch.no_grad()
    def load_flat_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Install state given as :meth:`flat_state` returns it (a checkpoint's)."""
        for group in self.optimizer.param_groups:
            scalars, tensors = state_keys(self.optimizer, group)
            for piece in group["params"]:
                seg = self.segments[self._index[id(piece)]]
                state = self.optimizer.state[piece]
                for key in scalars:
                    state[key] = flat[key].detach().clone()
                for key in tensors:
                    state[key] = flat[key][seg.start:seg.stop].detach().clone()

    @staticmethod
    def _flat(b: GradBucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, b.numel - flat.numel()))

    def set_grad(self, chunk: torch.Tensor) -> None:
        """The averaged gradient chunks of :meth:`BucketedGradSync.finish`, concatenated in the
        order of the syncs (each segment's gradient a view of it)."""
        self.master.grad = chunk
        for pc, seg in zip(self.pieces, self.segments):
            pc.grad = chunk[seg.start:seg.stop]

    def _gather_into(self, flat: torch.Tensor, write: Callable[[GradBucket, torch.Tensor], None], *,
                     in_param_dtype: bool = False) -> None:
        """All-gather every bucket's chunk of ``flat`` (this rank's concatenated chunks) over its
        sync's group and hand each bucket's full flat tensor to ``write``; at most
        ``MAX_IN_FLIGHT`` at once. ``in_param_dtype``: gather each chunk cast to its bucket's
        parameter dtype (a 16-bit plan's updated parameters travel in 16 bits)."""
        pending: list[tuple[ChunkRange, list[torch.Tensor], object]] = []

        def drain(keep: int) -> None:
            while len(pending) > keep:
                r, parts, work = pending.pop(0)
                comm.wait(work, r.sync.group)
                write(r.bucket, torch.cat(parts))

        for r in self.ranges:
            mine = flat[r.offset:r.stop]
            if in_param_dtype:
                mine = mine.to(r.bucket.params[0].dtype)
            if r.sync.size > 1:
                parts = [torch.empty_like(mine) for _ in range(r.sync.size)]
                pending.append((r, parts, comm.all_gather(parts, mine, r.sync.group, async_op=True)))
            else:
                pending.append((r, [mine], _DONE))
            drain(MAX_IN_FLIGHT)
        drain(0)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather every bucket's updated master chunks into the parameters (collective over
        each sync's group)."""

        def write(b: GradBucket, full: torch.Tensor) -> None:
            pos = 0
            for p in b.params:
                p.copy_(full[pos:pos + p.numel()].view_as(p))
                pos += p.numel()

        self._gather_into(self.master.detach(), write, in_param_dtype=True)

    @torch.no_grad()
    def full_masters(self) -> dict[int, torch.Tensor]:
        """The fp32 master weight of every parameter (by ``id``), all-gathered from the chunks.
        Collective over each sync's group."""
        out: dict[int, torch.Tensor] = {}

        def write(b: GradBucket, full: torch.Tensor) -> None:
            pos = 0
            for p in b.params:
                out[id(p)] = full[pos:pos + p.numel()].view_as(p).clone()
                pos += p.numel()

        self._gather_into(self.master.detach(), write)
        return out

    @torch.no_grad()
    def full_gradients(self) -> dict[int, torch.Tensor]:
        """The averaged gradient of every parameter (by ``id``), all-gathered from the chunks of
        the last sync. Collective over each sync's group."""
        out: dict[int, torch.Tensor] = {}
        if self.master.grad is None:
            return out

        def write(b: GradBucket, full: torch.Tensor) -> None:
            pos = 0
            for p in b.params:
                out[id(p)] = full[pos:pos + p.numel()].view_as(p).to(p.dtype).clone()
                pos += p.numel()

        self._gather_into(self.master.grad, write)
        return out

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.master.grad = None
        for pc in self.pieces:
            pc.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (e.g. AdamW's exp_avg and exp_avg_sq of its chunk)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)

    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds after the sync (its chunk; full grads are freed)."""
        held = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        g = self.master.grad
        return held + (g.numel() * g.element_size() if g is not None else 0)
