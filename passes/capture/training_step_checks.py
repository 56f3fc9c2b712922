"""What a training step must be before anything is planned: checks of the user's model and loss
around its capture.

* The model has trainable parameters (a step of a model without any trains nothing).
* The loss is a floating scalar: a loss of shape ``(batch,)`` captures and analyses fine, then
  backward fails on every rank; it is refused at capture with the shape it has.
* Python side effects in ``forward`` (a ``print``, appending to a list or counting calls on a
  module) run while the model is captured — export traces ``forward`` up to three times — and
  never while it trains, since the ranks run the captured graph. They are found by watching
  ``print``, plain attribute assignments on the model's modules and the lists, dicts and sets
  they hold during the capture, and reported by one warning (:class:`SideEffectWarning`) naming
  what changed. (A global list appended to is not seen.)
"""
from __future__ import annotations

import builtins
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import fx, nn

from passes.ir.errors import CaptureError, ConfigError
from passes.ir.meta import CAPTURE


class SideEffectWarning(UserWarning):
    """``forward`` has Python side effects that run during capture only."""


def check_trainable(module: nn.Module, name: str) -> None:
    """Refuse a model without parameters that require grad."""
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(f"{name}: the model has no trainable parameters (none requires grad); a training step would "
                          f"change nothing: unfreeze some (p.requires_grad_(True)) or pass the model you train")


def _dim_name(d, gm: fx.GraphModule) -> str:
    """A dim of a captured shape as the user named it (``batch``), by its example size."""
    if isinstance(d, int):
        return str(d)
    info = gm.meta.get(CAPTURE)
    hint = getattr(getattr(d, "node", None), "hint", None)
    names = [k for k, v in (info.dims if info is not None else ()) if v == hint and k in info.symbolic]
    return names[0] if len(names) == 1 else str(d)


def check_loss(gm: fx.GraphModule, name: str) -> None:
    """Refuse a captured step whose output (the loss) is not one floating scalar."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0]
    value = values[0] if isinstance(values, (tuple, list)) and len(values) == 1 else values
    meta = value.meta.get("val") if isinstance(value, fx.Node) else None
    if isinstance(values, (tuple, list)) and len(values) != 1:
        raise CaptureError(f"{name}: loss_fn returned {len(values)} values; return one scalar loss tensor "
                           f"(e.g. the mean cross entropy)")
    if not isinstance(meta, torch.Tensor):
        raise CaptureError(f"{name}: loss_fn returned {type(meta).__name__}, not a tensor; return one scalar loss "
                           f"tensor (e.g. torch.nn.functional.cross_entropy(logits, labels))")
    if meta.dim() != 0:
        shape = tuple(_dim_name(d, gm) for d in meta.shape)
        raise CaptureError(f"{name}: the loss has shape ({', '.join(shape)}), not a scalar; reduce it in loss_fn "
                           f"(e.g. .mean() over the batch) so that backward starts from one number")
    if not meta.is_floating_point():
        raise CaptureError(f"{name}: the loss is {meta.dtype}, not a floating-point scalar; return a float loss")


class _Recorder:
    """What the captured code did to the model's Python state."""

    def __init__(self):
        self.printed = 0
        self.changed: set[str] = set()


def _watched_type(base: type, recorder: _Recorder, label: str) -> type:
    """A subclass of ``base`` (list, dict, set) whose mutating methods record ``label``."""
    mutators = {list: ("append", "extend", "insert", "pop", "remove", "clear", "__setitem__", "__delitem__",
                       "__iadd__", "sort", "reverse"),
                dict: ("__setitem__", "__delitem__", "update", "pop", "popitem", "clear", "setdefault"),
                set: ("add", "discard", "remove", "pop", "clear", "update", "__ior__")}[base]

    def wrap(name):
        method = getattr(base, name)

        def recorded(self, *args, **kwargs):
            recorder.changed.add(label)
            return method(self, *args, **kwargs)
        return recorded

    return type(f"Watched{base.__name__}", (base,), {name: wrap(name) for name in mutators})


@contextmanager
def watch_side_effects(module: nn.Module, name: str) -> Iterator[None]:
    """Warn once if the code run inside (a capture) printed, assigned plain attributes of the
    model's modules, or mutated lists, dicts or sets they hold. (Export restores the module's
    state after tracing, so the effects must be seen as they happen: ``print`` and
    ``nn.Module.__setattr__`` are wrapped, and the containers swapped for recording copies,
    the originals put back after.)"""
    recorder = _Recorder()
    modules = {id(m): path for path, m in module.named_modules()}
    swapped: list[tuple[nn.Module, str, object]] = []
    for path, m in module.named_modules():
        for key, value in list(vars(m).items()):
            if not key.startswith("_") and type(value) in (list, dict, set):
                label = f"{path + '.' if path else ''}{key}"
                object.__setattr__(m, key, _watched_type(type(value), recorder, label)(value))
                swapped.append((m, key, value))
    real_print, real_setattr = builtins.print, nn.Module.__setattr__

    def counting_print(*args, **kwargs):
        recorder.printed += 1
        return real_print(*args, **kwargs)

    def recording_setattr(self, key, value):
        if (id(self) in modules and not key.startswith("_") and key != "training"
                and not isinstance(value, (nn.Module, torch.Tensor))):
            path = modules[id(self)]
            recorder.changed.add(f"{path + '.' if path else ''}{key}")
        real_setattr(self, key, value)

    builtins.print, nn.Module.__setattr__ = counting_print, recording_setattr
    try:
        yield
    finally:
        builtins.print, nn.Module.__setattr__ = real_print, real_setattr
        for m, key, value in swapped:
            object.__setattr__(m, key, value)
    changed = sorted(recorder.changed)
    found = ([f"print() ran {recorder.printed} time(s)"] if recorder.printed else []) + (
        [f"module attribute(s) changed: {', '.join(changed[:5])}" + (" ..." if len(changed) > 5 else "")]
        if changed else [])
    if found:
        warnings.warn(f"{name}: forward has Python side effects that run only while the model is captured, never "
                      f"during training (the ranks run the captured graph): {'; '.join(found)}. Move logging and "
                      f"counters out of forward (e.g. into the training loop)", SideEffectWarning, stacklevel=4)
