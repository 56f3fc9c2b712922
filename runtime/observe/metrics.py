"""Per-step training metrics: what one step did, and where it is written.

:class:`StepMetrics` is one optimizer step of the whole job (the same values on every rank):
loss, global gradient norm, learning rate, step time, tokens per second, MFU and the peak memory
of every rank. :func:`gather_step_metrics` builds it from a rank's
:class:`runtime.observe.measure.StepMeasurement` (a collective over the mesh: one small all-gather per
step). :class:`MetricsLogger` writes it on rank 0: one JSON line per step (flushed, so a killed
run keeps its lines), a compact line on stdout (a tqdm progress bar when stdout is a terminal),
and TensorBoard scalars when the ``tensorboard`` package is installed.

MFU has the planner's definition (``partitioner.search.search`` makes ``Prediction.mfu``): model FLOPs
of a step (forward + backward, no recompute) over ``step time x devices x the devices' peak
FLOP/s in the plan's dtype``. The measured MFU is that prediction scaled by predicted over
measured step time, so the two use the same FLOP count and the same peak.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

import torch

from passes.ir.meta import InputSpec
from passes.ir.plan import Prediction, format_bytes
from runtime.dist import comm


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One training step of the job (seconds, bytes); the same on every rank."""

    step: int
    """Index of the step (0 = the first of the run, or the checkpoint's step after a load)."""
    loss: float
    """Mean loss of the global batch."""
    grad_norm: float | None
    """Global L2 norm of the gradients before clipping; ``None`` when the model does not report it."""
    lr: float | None
    """Learning rate of parameter group 0 that the step used; ``None`` when not reported."""
    step_time_s: float
    """Wall seconds of the step: the slowest rank's."""
    tokens: int
    """Tokens of the global batch (batch x seq for token models, else samples)."""
    tokens_per_s: float
    mfu: float | None
    """Measured model FLOPs utilisation (see the module docstring); ``None`` without a prediction."""
    peak_memory_bytes: tuple[int | None, ...]
    """Peak memory of each rank during the step (index = rank in the mesh): on CUDA
    ``torch.cuda.max_memory_allocated`` since the step began; on CPU the live-bytes tracker's peak
    on the steps it tracked (:class:`runtime.observe.measure.StepTimer`, the first few), ``None`` on the others."""
    skipped: bool
    """The optimizer skipped the step (fp16 overflow, or a non-finite loss when told to skip)."""

    @property
    def max_peak_memory_bytes(self) -> int | None:
        """The largest per-rank peak, or ``None`` when no rank tracked this step."""
        known = [b for b in self.peak_memory_bytes if b is not None]
        return max(known) if known else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``peak_memory_bytes`` as a list). A non-finite loss
        or norm stays a float: ``json.dumps`` writes it as ``NaN``/``Infinity``, which Python's
        ``json`` reads back."""
        d = asdict(self)
        d["peak_memory_bytes"] = list(self.peak_memory_bytes)
        return d

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepMetrics:
        """The inverse of :meth:`to_json` (e.g. for one line of a metrics JSONL file)."""
        return cls(**{**data, "peak_memory_bytes": tuple(data["peak_memory_bytes"])})


# ---------------------------------------------------------------------------------------------
# Building a step's metrics

def dim_sizes(inputs: Sequence[InputSpec], batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
              ) -> dict[str, int]:
    """Size of every named dim (``"batch"``, ``"seq"``, ...) as ``batch``'s tensors have it; the
    tensors are the graph inputs in ``inputs`` order, or a mapping from their names."""
    sizes: dict[str, int] = {}
    if isinstance(batch, Mapping):
        batch = [batch.get(spec.name) for spec in inputs]
    for spec, t in zip(inputs, batch):
        shape = getattr(t, "shape", ())
        for axis, d in enumerate(spec.shape):
            if isinstance(d, str) and axis < len(shape):
                sizes.setdefault(d, int(shape[axis]))
    return sizes


def step_tokens(sizes: Mapping[str, int]) -> int:
    """Tokens of one global batch from its named dim sizes: ``batch x seq`` when there is a
    ``seq`` dim, else ``batch`` (samples)."""
    return int(sizes.get("batch", 0)) * int(sizes.get("seq", 1))  # a malformed batch is refused by the step


def measured_mfu(predicted: Prediction, step_time_s: float) -> float | None:
    """MFU of a step that took ``step_time_s`` seconds, by the definition of ``predicted.mfu``
    (same model FLOPs, devices and peak FLOP/s); ``None`` when either time is not positive."""
    if step_time_s <= 0 or predicted.step_time_s <= 0 or not math.isfinite(predicted.mfu):
        return None
    return predicted.mfu * predicted.step_time_s / step_time_s


def _maybe_float(x: Any) -> float | None:
    return None if x is None else float(x)


def gather_step_metrics(model: Any, measurement: Any, *, tokens: int, predicted: Prediction | None,
                        skipped: bool) -> StepMetrics:
    """This step's :class:`StepMetrics` on every rank of ``model.mesh.group`` (call on all of them).

    ``model``: a :class:`runtime.exec.parallel_model.ParallelModel` (its ``last_grad_norm`` and
    ``last_lr``); ``measurement``: this rank's
    :class:`runtime.observe.measure.StepMeasurement` of the step; ``tokens``: tokens of the global batch.
    One all-gather of two numbers per rank: the peak memory (bytes) and the wall time (seconds),
    whose maximum is the step time.
    """
    gathered = comm.all_gather_object((measurement.peak_memory_bytes, float(measurement.wall_s)),
                                      model.mesh.group)
    seconds = max(w for _, w in gathered)
    return StepMetrics(
        step=int(measurement.step), loss=float(measurement.loss),
        grad_norm=_maybe_float(model.last_grad_norm), lr=_maybe_float(model.last_lr),
        step_time_s=seconds, tokens=int(tokens), tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        mfu=measured_mfu(predicted, seconds) if predicted is not None else None,
        peak_memory_bytes=tuple(None if p is None else int(p) for p, _ in gathered), skipped=bool(skipped))


# ---------------------------------------------------------------------------------------------
# Writing them

def _count(x: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{suffix}"
    return f"{x:.1f}"


def compact_fields(m: StepMetrics) -> str:
    """The compact text of a step without its index: ``loss 3.2145 | gnorm 1.234 | lr 3.00e-04 |
    12.30k tok/s | MFU 1.23% | mem 1.23 GiB | 0.123 s`` (``-`` for what is unknown; ``mem``: the
    largest peak over the ranks), then ``| skipped`` on a skipped step."""
    gnorm = "-" if m.grad_norm is None else f"{m.grad_norm:.4g}"
    lr = "-" if m.lr is None else f"{m.lr:.2e}"
    mfu = "-" if m.mfu is None else f"{m.mfu * 100:.3g}%"  # 3 digits: small models run far below 1%
    peak = m.max_peak_memory_bytes
    mem = "-" if peak is None else format_bytes(peak)
    text = (f"loss {m.loss:.4f} | gnorm {gnorm} | lr {lr} | {_count(m.tokens_per_s)} tok/s | MFU {mfu} | "
            f"mem {mem} | {m.step_time_s:.3f} s")
    return text + (" | skipped" if m.skipped else "")


def format_line(m: StepMetrics, total_steps: int | None = None) -> str:
    """One plain line for a step: ``step 3/100 | `` (or ``step 3 | ``) then :func:`compact_fields`."""
    step = f"step {m.step}" if total_steps is None else f"step {m.step}/{total_steps}"
    return f"{step} | {compact_fields(m)}"


TENSORBOARD_MISSING = ("metrics: tensorboard is not installed, so no TensorBoard scalars are written "
                       "(pip install tensorboard); the JSONL and the printed lines are unaffected")


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (which ``torch.utils.tensorboard`` needs) is importable."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules, or a broken install
        return False


class MetricsLogger:
    """Writes each step's :class:`StepMetrics`; create it on rank 0 only (``None`` on the others).

    ``jsonl``: a file that gets one JSON object per step (appended, flushed after each line);
    ``tensorboard_dir``: TensorBoard scalars via ``torch.utils.tensorboard.SummaryWriter`` when
    ``tensorboard`` is installed (otherwise skipped with one ``RuntimeWarning``); ``echo``: print
    each step to ``stream`` (default stdout): a tqdm progress bar with the fields as postfix when
    the stream is a terminal and tqdm is installed, else one :func:`format_line` per step;
    ``total_steps``: the bar's length and the ``/N`` of the lines.
    """

    def __init__(self, *, jsonl: str | Path | None = None, tensorboard_dir: str | Path | None = None,
                 echo: bool = True, total_steps: int | None = None, stream: IO[str] | None = None):
        self.total_steps = total_steps
        self.echo = echo
        self.stream = stream if stream is not None else sys.stdout
        self.jsonl_path = Path(jsonl) if jsonl is not None else None
        self._jsonl: IO[str] | None = None
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        self.tensorboard: Any = None
        if tensorboard_dir is not None:
            if tensorboard_available():
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(log_dir=str(tensorboard_dir))
            else:
                warnings.warn(TENSORBOARD_MISSING, RuntimeWarning, stacklevel=2)
        self._bar: Any = None
        if echo and _isatty(self.stream) and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, file=self.stream, unit="step", dynamic_ncols=True)

    def log(self, m: StepMetrics) -> None:
        """Write one step everywhere this logger writes."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(m.to_json()) + "\n")
            self._jsonl.flush()
        if self.tensorboard is not None:
            self._scalars(m)
        if not self.echo:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(compact_fields(m), refresh=False)
            self._bar.update(1)
        else:
            print(format_line(m, self.total_steps), file=self.stream, flush=True)

    def _scalars(self, m: StepMetrics) -> None:
        w, step = self.tensorboard, m.step
        w.add_scalar("train/loss", m.loss, step)
        for name, value in (("train/grad_norm", m.grad_norm), ("train/lr", m.lr), ("perf/mfu", m.mfu),
                            ("memory/peak_bytes_max", m.max_peak_memory_bytes)):
            if value is not None:
                w.add_scalar(name, value, step)
        w.add_scalar("perf/tokens_per_s", m.tokens_per_s, step)
        w.add_scalar("perf/step_time_s", m.step_time_s, step)
        w.add_scalar("train/skipped", float(m.skipped), step)
        for rank, peak in enumerate(m.peak_memory_bytes):
            if peak is not None:
                w.add_scalar(f"memory/peak_bytes/rank{rank}", peak, step)

    def close(self) -> None:
        """Close the bar, the JSONL file and the TensorBoard writer (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
