"""Per-step, per-rank measurements of a :class:`runtime.exec.parallel_model.ParallelModel` run.

:class:`StepTimer` instruments one rank's :class:`runtime.exec.stage_executor.StageExecutor` without
editing it: it replaces the executor's bound action handlers (``_forward``, ``_backward``,
``_recv_f``, ...) and its receive/send waits on the *instance* (``run`` looks them up on ``self``
each step), and wraps the ``grad_sync``/``step`` callbacks at the ``train_step`` level. What one
step's :class:`StepMeasurement` splits the wall time into (seconds):

* ``compute_s``: inside forward/backward actions, minus the time those actions spend waiting on
  their receives; ``compute_by_stage_s`` splits it by global stage index;
* ``recv_wait_s``: waiting for point-to-point receives (pipeline bubble + transfer: a receive
  waited on is idle time unless the peer is late only by the transfer itself);
* ``send_wait_s`` + ``p2p_post_s``: waiting for sends to finish, and posting isend/irecv;
* ``collective_s``: the ``ALL_REDUCE`` action (tied-weight and data-parallel gradient sync),
  and inside the ``STEP`` action the global gradient norm's all-reduce (``GRAD_NORM``, which waits
  for the mesh's last rank) and a ZeRO-1/2 optimizer's all-gather of the updated parameters
  (``ALL_GATHER``);
* ``optimizer_s``: the rest of the ``STEP`` action: the optimizer itself;
* ``other_s``: the rest of the step (micro-batch slicing, ``zero_grad``, the loss all-reduce at
  the end of ``train_step``, which waits for the last stage, Python overhead).

Peak memory per step (bytes): ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the peak of
live tensor storage bytes seen by :class:`LiveBytes` (a dispatch mode that counts each
storage's ``nbytes`` once when an op first returns it and subtracts it when the storage is freed;
parameters, gradients and optimizer state made before tracking started are added as a
baseline). Both exclude the allocator's caching and the framework's own memory, like the
planner's predictions.
"""
from __future__ import annotations

import json
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from passes.ir.schedule.actions import Action
from runtime.kernels.zero3 import MEASURED_KERNELS
from runtime.optim.mixed_precision import MasterWeightOptimizer


@dataclass(frozen=True, kw_only=True)
class StepMeasurement:
    """One training step on one rank (seconds, bytes); see the module docstring for the terms."""

    step: int
    rank: int
    loss: float
    wall_s: float
    compute_s: float
    compute_by_stage_s: dict[int, float]
    recv_wait_s: float
    send_wait_s: float
    p2p_post_s: float
    collective_s: float
    optimizer_s: float
    other_s: float
    peak_memory_bytes: int | None
    """``None`` when memory was not tracked this step."""
    started_at: float = 0.0
    """Wall-clock time (``time.time()``, seconds) at which the step started: aligns the ranks'
    timelines (one host's clock; across hosts only as well as their clocks agree)."""
    timeline: tuple[tuple[str, float, float], ...] = ()
    """Every schedule action of the step as (action text, start, end) in seconds from the step's
    start: compute (``F``/``B``), posts (``RECV_F``/``SEND_F``/...), ``wait`` (a receive waited
    on inside a compute action), ``ALL_REDUCE`` and ``STEP``."""
    collectives: tuple[tuple[str, float, float, float, bool], ...] = ()
    """ZeRO-3's collectives of the step as (``AG s.k`` / ``RS s.k`` for stage s, site k, issued,
    waited on from, done, prefetched) in seconds from the step's start: a gather from its issue
    (ahead, when prefetched) to its end, compute waiting on it from the third number; a
    reduce-scatter runs where it is issued."""


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages on CPU (see the module docstring).

    Storages keep their Python identity in torch >= 2.0, so a weakref callback on
    ``untyped_storage()`` fires when the storage itself is freed.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = (), *, host: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = 0
        self._seen: dict[int, weakref.ref] = {}
        for t in existing:  # parameters, gradients, optimizer state: live before the step starts
            self._track(t)
        for t in host:  # host memory (an offloaded optimizer's): known, never counted
            self._track(t, count=False)
        self.peak = self.live

    def _track(self, t: torch.Tensor, *, count: bool = True) -> None:
        if t.device.type != "cpu" or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self._seen and self._seen[key]() is storage:
            return  # a view, or an in-place op's result: bytes already counted
        nbytes = storage.nbytes() if count else 0
        self._seen[key] = weakref.ref(storage, lambda _r, k=key, n=nbytes: self._free(k, n))
        self.live += nbytes

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inner = MEASURED_KERNELS.get(func)
        if inner is not None:  # a kernel whose own allocations count: run it with the mode on
            with self:
                out = inner(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.live)
        return out


class PhaseClock:
    """Wall seconds of each named phase, each measured from the previous ``lap`` (or construction)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (parameters, grads, optimizer state)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


class StepTimer:
    """Instruments a ParallelModel-like object (``executor``, ``params``, ``optimizer``,
    ``mesh``, ``train_step``) and records one :class:`StepMeasurement` per ``measure`` call.

    ``track_memory``: on CPU, the number of first steps whose live bytes are tracked (a dispatch
    mode, which slows every op, so later steps run untracked and time cleanly; the peak is
    reached by the second step, once gradients and optimizer state exist); ``True`` = every
    step, ``False``/0 = none; none under a compiled plan (torch.compile does not compile what runs
    under a dispatch mode). CUDA peaks cost nothing and are read every step. ``last_action`` is the action running or last run, for
    fault messages.
    """

    def __init__(self, model: Any, *, track_memory: bool | int = 2):
        self.model = model
        self.track_memory = track_memory
        self.steps: list[StepMeasurement] = []
        self.last_action: Action | str | None = None
        self._running: list[str] = []  # labelled calls in progress, innermost last
        self._t: dict[str, float] = {}
        self._stage: dict[int, float] = {}
        self._timeline: list[tuple[str, float, float]] = []
        ex = model.executor
        for name, kind in (("_forward", "compute"), ("_backward", "compute"), ("_backward_weight", "compute"),
                           ("_recv_f", "post"),
                           ("_recv_b", "post"), ("_send_f", "post"), ("_send_b", "post")):
            setattr(ex, name, self._wrap_action(getattr(ex, name), kind))
        ex._flush = self._wrap(ex._flush, "post")  # a schedule step's messages, posted as one batch
        ex._take_recvs = self._wrap(ex._take_recvs, "recv_wait")
        ex._wait_sends = self._wrap(ex._wait_sends, "send_wait")
        self._orig_grad_sync = model._grad_sync
        self._orig_step = model._step
        model._grad_sync = self._wrap(model._grad_sync, "collective", label="ALL_REDUCE")
        model._step = self._wrap(model._step, "optimizer", label="STEP", exclude="collective")
        if hasattr(model, "_grad_norm"):
            model._grad_norm = self._wrap(model._grad_norm, "collective", label="GRAD_NORM")
        publish = getattr(getattr(model, "optimizer", None), "publish", None)  # ZeRO-1/2
        if publish is not None:
            model.optimizer.publish = self._wrap(publish, "collective", label="ALL_GATHER")

    def _add(self, key: str, dt: float) -> None:
        self._t[key] = self._t.get(key, 0.0) + dt

    def _wrap(self, fn: Callable, key: str, label: str | None = None, exclude: str | None = None) -> Callable:
        """``fn`` timed into ``key``, less what wrapped calls inside it timed into ``exclude``.
        A labelled call nested in another (``GRAD_NORM`` in ``STEP``) hands ``last_action`` back
        to the outer one when it returns: that one is running again."""
        def run(*args, **kwargs):
            if label is not None:
                self.last_action = label
                self._running.append(label)
            excluded = self._t.get(exclude, 0.0) if exclude else 0.0
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                nested = self._t.get(exclude, 0.0) - excluded if exclude else 0.0
                self._add(key, end - start - nested)
                if label is not None or key == "recv_wait":
                    self._record(label or "wait", start, end)
                if label is not None:
                    self._running.pop()
                    if self._running:
                        self.last_action = self._running[-1]
        return run

    def _record(self, label: str, start: float, end: float) -> None:
        # perf_counter stamps (cheap); made relative to the step start in ``measure``
        self._timeline.append((label, start, end))

    def _wrap_action(self, fn: Callable, key: str) -> Callable:
        def run(action: Action):
            self.last_action = action
            waited = self._t.get("recv_wait", 0.0)
            start = time.perf_counter()
            try:
                return fn(action)
            finally:
                end = time.perf_counter()
                self._record(str(action), start, end)
                dt = end - start
                if key == "compute":
                    dt -= self._t.get("recv_wait", 0.0) - waited  # waits inside F/B are not compute
                    self._stage[action.stage] = self._stage.get(action.stage, 0.0) + dt
                self._add(key, dt)
        return run

    def measure(self, step: int, fn: Callable[[], float]) -> StepMeasurement:
        """Run ``fn`` (one ``train_step``) and record its measurement."""
        self._t, self._stage, self._timeline = {}, {}, []
        cuda = self.model.mesh.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        mode = None
        limit = None if self.track_memory is True else int(self.track_memory)
        # under a dispatch mode torch.compile runs a program eagerly, and for good:
        # dynamo marks a frame it first meets under one as not to compile; so a compiled plan's
        # CPU steps are not counted (its memory is not measured on CPU)
        compiled = getattr(getattr(self.model, "config", None), "compile", False)
        if not cuda and not compiled and (limit is None or len(self.steps) < limit):
            mode = LiveBytes(self._persistent(), host=self._host_resident())
        zero3 = getattr(self.model, "zero3", None)
        if zero3 is not None:
            zero3.spans = []
        started_at, start = time.time(), time.perf_counter()
        try:
            if mode is not None:
                with mode:
                    loss = fn()
            else:
                loss = fn()
        finally:
            spans = zero3.spans if zero3 is not None else []
            if zero3 is not None:
                zero3.spans = None  # recorded only while a step is measured
        wall = time.perf_counter() - start
        peak = (int(torch.cuda.max_memory_allocated()) if cuda else (mode.peak if mode is not None else None))
        t = self._t
        compute = t.get("compute", 0.0)
        parts = compute + sum(t.get(k, 0.0) for k in ("recv_wait", "send_wait", "post", "collective", "optimizer"))
        m = StepMeasurement(
            step=step, rank=self.model.mesh.rank, loss=float(loss), wall_s=wall, compute_s=compute,
            compute_by_stage_s=dict(sorted(self._stage.items())), recv_wait_s=t.get("recv_wait", 0.0),
            send_wait_s=t.get("send_wait", 0.0), p2p_post_s=t.get("post", 0.0),
            collective_s=t.get("collective", 0.0), optimizer_s=t.get("optimizer", 0.0),
            other_s=max(0.0, wall - parts), peak_memory_bytes=peak, started_at=started_at,
            timeline=tuple((label, a - start, b - start) for label, a, b in self._timeline),
            collectives=tuple((f"{'AG' if x.kind == 'gather' else 'RS'} {x.stage}.{x.site}", x.issued_s - start,
                               x.waited_s - start, x.done_s - start, x.prefetched) for x in spans))
        self.steps.append(m)
        return m

    def _host_resident(self) -> Iterator[torch.Tensor]:
        """offload="optimizer": the masters, moments and gradient buffers in host memory (on a
        CPU device the same memory, but not the device's share the plan counts)."""
        opt = self.model.optimizer
        if isinstance(opt, MasterWeightOptimizer) and opt.on_host:
            yield from opt.state_tensors()

    def _persistent(self) -> Iterator[torch.Tensor]:
        for p in self.model.params:
            yield p
            if p.grad is not None:
                yield p.grad
        opt = self.model.optimizer
        if isinstance(opt, MasterWeightOptimizer):
            if not opt.on_host:
                yield from opt.state_tensors()
            return
        # ZeRO (runtime.optim.grad_sync.ShardedOptimizer) has no ``.state``: it holds a flat fp32 master
        # chunk (with its gradient) and an inner AdamW over that chunk, whose state is the chunk's.
        master = getattr(opt, "master", None)
        if isinstance(master, torch.Tensor):
            yield master
            if master.grad is not None:
                yield master.grad
        for o in (opt, getattr(opt, "optimizer", None)):
            state = getattr(o, "state", {})
            for st in (state.values() if isinstance(state, dict) else ()):
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        yield v


@dataclass(frozen=True, kw_only=True)
class RunMeasurements:
    """Every rank's steps plus the plan's predictions: the content of ``measurements.json``."""

    plan_summary: str
    predicted_step_time_s: float
    predicted_peak_memory_bytes: float
    predicted_terms: dict[str, float]
    world_size: int
    steps: list[list[StepMeasurement]]
    """``steps[rank][k]``."""
    notes: list[str] = field(default_factory=list)

    def summary_by_rank(self, skip_first: int = 2) -> dict[int, dict[str, float]]:
        """Per rank: median step wall time (after ``skip_first`` warm-up steps: the first steps
        are memory-tracked, see :class:`StepTimer`) and the largest peak memory of any step,
        as :func:`ir_dumps.report.write_report` takes them (``measured=``)."""
        out = {}
        for rank, steps in enumerate(self.steps):
            kept = steps[skip_first:] or steps
            walls = sorted(s.wall_s for s in kept)
            peaks = [s.peak_memory_bytes for s in steps if s.peak_memory_bytes is not None]
            out[rank] = {"step_time_s": walls[len(walls) // 2],
                         "peak_memory_bytes": float(max(peaks)) if peaks else 0.0}
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["measured"] = {str(k): v for k, v in self.summary_by_rank().items()}
        return d

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def memtracker_step_peak(module: torch.nn.Module, inputs: tuple) -> int:
    """MemTracker's peak (bytes) of one steady-state AdamW step of ``module`` (its forward returns
    the loss) on CPU: a first step creates the optimizer state, gradients are set to None, then
    forward, backward and the optimizer step run tracked (parameters, gradients, optimizer state,
    activations and temporaries, as the memory analysis counts them). The AdamW is the one a run
    named ``adamw`` builds: torch's fused kernel."""
    opt = torch.optim.AdamW(module.parameters(), fused=True)
    module(*inputs).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(module, opt, *inputs)
    with tracker:
        module(*inputs).backward()
        opt.step()
    tracker.reset_mod_stats()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return peak[next(k for k in peak if getattr(k, "name", str(k)) == "Total")]

