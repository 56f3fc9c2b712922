"""A batch checked against the captured contract before any rank program runs.

:func:`check_batch` runs on every rank before the step's first collective, so a bad batch
fails on every rank alike (given the same global batch) with one :class:`ConfigError` that names
the input, the expected shape (with its named dims), the shape it got and the fix, instead of an
``IndexError`` deep in an embedding or a hang in a collective. It checks, in order:

* which inputs the batch holds (a tuple in the inputs' order, or a mapping from their names,
  the Hugging Face habit);
* each input's rank and fixed sizes, and that a named dim has one size in every input;
* the ``batch`` dim against the rows the step takes (the global batch, or a dp rank's share);
* the named dims against the captured graph's ranges (:class:`passes.ir.meta.InputBounds`:
  export's guards, position tables: ``seq`` no longer than the model's positions);
* dtypes (token ids must be integers of the captured dtype; floating inputs any float);
* integer inputs' values against the declared ``InputSpec.high`` and the graph's bounds
  (ids below the embedding's rows, labels below the classes or the loss's ``ignore_index``).
"""
from __future__ import annotations

from typing import Collection, Mapping, Sequence

import torch

from passes.ir.errors import ConfigError
from passes.ir.meta import InputBounds, InputSpec

Batch = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def check_batch(inputs: Sequence[InputSpec], batch: Batch, *, batch_size: int | None,
                bounds: InputBounds | None = None, names: Collection[str] | None = None,
                dims: Mapping[str, int] | None = None, where: str = "train_step",
                batch_rule: str = "the global batch") -> dict[str, torch.Tensor]:
    """The tensors of ``batch`` by input name, in ``inputs`` order, after checking them (see the
    module docstring); raises :class:`ConfigError` at the first violation.

    ``batch``: a sequence of every input's tensor in order, or a mapping name -> tensor holding
    exactly ``names`` (default: every input). ``batch_size``: the size the ``batch`` dim must
    have (``None``: any; ``batch_rule`` says what it is in messages). ``bounds``: the captured
    graph's :class:`InputBounds`. ``dims``: sizes of named dims the caller already knows (they
    must agree). ``where``: the caller's name, first in every message.
    """
    bounds = bounds or InputBounds()
    specs = {i.name: i for i in inputs}
    tensors = _by_name(inputs, batch, names, where)
    known: dict[str, tuple[int, str]] = {k: (int(v), "the dims given") for k, v in (dims or {}).items()}
    if batch_size is not None:
        known.setdefault("batch", (int(batch_size), batch_rule))

    def fail(name: str, problem: str, fix: str) -> ConfigError:
        spec, t = specs[name], tensors[name]
        got = f"{tuple(t.shape)} {_dtype(t.dtype)}" if isinstance(t, torch.Tensor) else type(t).__name__
        return ConfigError(f"{where}: input {name!r} {problem}; expected shape {_expected(spec, known, bounds)} "
                           f"{_dtype(spec.dtype)}, got {got}. Fix: {fix}")

    for name, t in tensors.items():
        spec = specs[name]
        if not isinstance(t, torch.Tensor):
            raise fail(name, f"is a {type(t).__name__}, not a tensor", "give a torch.Tensor (torch.as_tensor(...))")
        if t.dim() != len(spec.shape):
            raise fail(name, f"has {t.dim()} dims, the model takes {len(spec.shape)}",
                       f"give {name} {len(spec.shape)} dims in the order {_plain(spec)}")
        for axis, (d, size) in enumerate(zip(spec.shape, t.shape)):
            size = int(size)
            if isinstance(d, int):
                if size != d:
                    raise fail(name, f"has size {size} along dim {axis}, the model takes {d}",
                               f"give dim {axis} of {name} the size {d} the model was built for")
                continue
            if d in known and known[d][0] != size:
                value, source = known[d]
                if d == "batch" and source == batch_rule:
                    raise fail(name, f"has batch={size} samples but {batch_rule} is {value}",
                               f"pass {value} samples ({batch_rule}) on every rank")
                raise fail(name, f"has {d}={size} but {d}={value} in {source}",
                           f"give every input the same {d}")
            known.setdefault(d, (size, f"input {name!r}"))
            bound = bounds.dim(d) if d != "batch" else None  # the batch bound is a micro-batch's
            if bound is not None and (size < bound.low or (bound.high is not None and size > bound.high)):
                raise fail(name, f"has {d}={size} outside the model's {_range(bound)} ({bound.reason})",
                           _dim_fix(d, size, bound))
    for name, t in tensors.items():
        spec = specs[name]
        if spec.dtype.is_floating_point != t.dtype.is_floating_point or (
                not spec.dtype.is_floating_point and t.dtype != spec.dtype):
            kind = "token ids / labels" if not spec.dtype.is_floating_point else "a floating input"
            raise fail(name, f"is {_dtype(t.dtype)}, but it is {kind} the model takes as {_dtype(spec.dtype)}",
                       f"cast it: {name}.to({spec.dtype})")
        if not spec.dtype.is_floating_point:
            _check_values(name, t, spec, bounds, fail)
    return tensors


def _by_name(inputs: Sequence[InputSpec], batch: Batch, names: Collection[str] | None,
             where: str) -> dict[str, torch.Tensor]:
    wanted = [i.name for i in inputs if names is None or i.name in names]
    takes = ", ".join(f"{i.name} {_plain(i)} {_dtype(i.dtype)}" for i in inputs if i.name in wanted)
    if isinstance(batch, Mapping):
        keys = list(batch)
        extra = [k for k in keys if k not in wanted]
        missing = [k for k in wanted if k not in batch]
        if extra or missing:
            what = "; ".join(filter(None, (f"no input(s) {missing}" if missing else "",
                                           f"input(s) {extra} the model does not take here" if extra else "")))
            raise ConfigError(f"{where}: the batch has {what}; expected the inputs {takes}. Fix: give a mapping "
                              f"with exactly the keys {wanted}")
        return {k: batch[k] for k in wanted}
    if isinstance(batch, (torch.Tensor, str, bytes)) or not isinstance(batch, Sequence):
        raise ConfigError(f"{where}: the batch is a {type(batch).__name__}; expected a tuple or a dict of the "
                          f"inputs {takes}. Fix: pass (tensor, ...) in that order, or {{name: tensor}}")
    if len(batch) != len(wanted):
        raise ConfigError(f"{where}: the batch has {len(batch)} tensor(s); expected {len(wanted)}: {takes}. "
                          f"Fix: pass every input in that order, or a dict name -> tensor")
    return dict(zip(wanted, batch))


def _check_values(name, t: torch.Tensor, spec: InputSpec, bounds: InputBounds, fail) -> None:
    bound = bounds.value(name)
    high, reason, allowed = None, "", ()
    if spec.high is not None:
        high, reason = spec.high, f"its InputSpec declares values below {spec.high}"
    if bound is not None:
        allowed = bound.allowed
        if high is None or bound.high <= high:  # the graph says why (its table or loss)
            high, reason = bound.high, bound.reason
    if high is None or t.numel() == 0:
        return
    bad = (t < 0) | (t >= high)
    if allowed:
        bad &= ~torch.isin(t, torch.tensor(allowed, dtype=t.dtype, device=t.device))
    if bool(bad.any()):
        values = t[bad]
        lo, hi = int(values.min()), int(values.max())
        extra = f" or {', '.join(map(str, allowed))}" if allowed else ""
        raise fail(name, f"holds values in [{lo}, {hi}] outside [0, {high}){extra}, because {reason}",
                   f"keep {name} in [0, {high}){extra} (tokenize with the model's vocabulary of {high}, or build "
                   f"the model with a larger one)")


def _dim_fix(d: str, size: int, bound) -> str:
    if bound.high is not None and size > bound.high:
        return f"cut {d} to at most {bound.high}, or build the model for {d}={size} (more positions)"
    return f"give {d} a size in {_range(bound)}"


def _range(bound) -> str:
    if bound.high is None:
        return f"{bound.name} >= {bound.low}"
    if bound.low == bound.high:
        return f"{bound.name} = {bound.low}"
    return f"{bound.name} <= {bound.high}" if bound.low <= 1 else f"{bound.low} <= {bound.name} <= {bound.high}"


def _expected(spec: InputSpec, known: Mapping[str, tuple[int, str]], bounds: InputBounds) -> str:
    """``(batch=8, seq<=64)``: the expected shape, named dims with what is known of them."""
    parts = []
    for d in spec.shape:
        if isinstance(d, int):
            parts.append(str(d))
        elif d in known and known[d][1] != f"input {spec.name!r}":
            parts.append(f"{d}={known[d][0]}")
        elif d != "batch" and bounds.dim(d) is not None and bounds.dim(d).high is not None:
            b = bounds.dim(d)
            parts.append(f"{d}={b.high}" if b.low == b.high else f"{d}<={b.high}")
        else:
            parts.append(d)
    return "(" + ", ".join(parts) + ")"


def _plain(spec: InputSpec) -> str:
    return "(" + ", ".join(str(d) for d in spec.shape) + ")"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
