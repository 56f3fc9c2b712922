"""Models by name: ``NAME:key=value,...`` strings that build a model of the zoo, a Hugging Face
model from a config, or a user's own model from ``path/to/file.py:factory``; and
:func:`as_spec`, which makes a :class:`~partitioner.inputs.model_spec.ModelSpec` of any form a
user gives a model.
"""
from __future__ import annotations

import difflib
import importlib.util
import inspect
import traceback
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

import partitioner.zoo  # noqa: F401  (registers the builders)
from partitioner.inputs.model_spec import LossFn, ModelSpec
from partitioner.inputs.spec_keys import check_values, describe_table
from partitioner.zoo.registry import REGISTRY, TABLES, Builder
from passes.ir.errors import ConfigError, ModelSpecError
from passes.ir.meta import InputSpec


def key_rules(name: str) -> str | None:
    """The keys of zoo model ``name`` with their rules and defaults, in one line (None: no table)."""
    if name not in TABLES:
        return None
    table, defaults = TABLES[name]
    return describe_table(table, defaults)


def check_spec(spec: str) -> None:
    """Refuse a zoo spec string before any work: malformed items, an unknown model or key, and
    values that break the model's key table (:func:`check_spec_values`). File specs pass."""
    if not isinstance(spec, str) or spec.partition(":")[0].strip().endswith(".py"):
        return
    name, kwargs = parse_spec(spec)
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, sorted(REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelSpecError(
            f"unknown model {name!r} in spec {spec!r}; {hint}known models: {', '.join(sorted(REGISTRY))}, "
            f"or path/to/file.py:factory")
    _check_keys(name, REGISTRY[name][0], kwargs)
    check_spec_values(name, kwargs)


def check_dim(spec: str, dim: str, value: int, *, spelled: str) -> None:
    """Raise :class:`ModelSpecError` when named dim ``dim`` = ``value`` exceeds what zoo spec
    ``spec`` was built for (``--seq 64`` on ``gpt:seq=32``, which has 32 learned positions).
    Specs of files and models without a bound pass."""
    if not isinstance(spec, str) or spec.partition(":")[0].endswith(".py"):
        return
    name, kwargs = parse_spec(spec)
    if name not in TABLES:
        return
    table, defaults = TABLES[name]
    key = table.limits.get(dim)
    bound = kwargs.get(key, defaults.get(key)) if key is not None else None
    if isinstance(bound, int) and isinstance(value, int) and value > bound:
        raise ModelSpecError(f"{spelled} {value} is longer than the {bound} positions of {spec!r} ({key}={bound}); "
                             f"use {spelled} <= {bound} or build the model with {key}={value}")


def check_spec_values(name: str, kwargs: dict[str, object]) -> None:
    """Raise :class:`ModelSpecError` when a value of ``kwargs`` breaks the key table of ``name``
    (type, range, choices, or a rule across keys such as ``hidden`` divisible by ``heads``)."""
    if name in TABLES:
        table, defaults = TABLES[name]
        check_values(name, table, kwargs, defaults)


def known_models() -> dict[str, str]:
    return {k: h for k, (_, h) in sorted(REGISTRY.items())}


def parse_spec(spec: str) -> tuple[str, dict[str, int | float | str | bool]]:
    """Split ``NAME:key=value,...`` into the name and typed keyword values."""
    if not spec or not spec.strip():
        raise ModelSpecError("empty model spec; write NAME:key=value,... e.g. gpt:layers=2,hidden=128")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise ModelSpecError(f"model spec {spec!r} has no model name before ':'; e.g. gpt:layers=2,hidden=128")
    kwargs: dict[str, int | float | str | bool] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key or not raw:
            raise ModelSpecError(
                f"malformed item {item!r} in model spec {spec!r}; each item must be key=value, "
                f"e.g. gpt:layers=2,hidden=128")
        if key.strip() in kwargs:
            raise ModelSpecError(f"key {key.strip()!r} is given twice in model spec {spec!r}; keep one")
        kwargs[key.strip()] = _parse_value(raw.strip())
    return name, kwargs


def format_spec(name: str, kwargs: dict[str, int | float | str | bool]) -> str:
    """The spec string ``parse_spec`` reads back as ``(name, kwargs)``."""
    if not kwargs:
        return name
    items = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kwargs.items())
    return f"{name}:{items}"


def model_keys(name: str) -> tuple[str, ...] | None:
    """The spec keys a zoo model takes, or ``None`` when its builder accepts any (``hf-*``)."""
    if name not in REGISTRY:
        raise ModelSpecError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}")
    params = inspect.signature(REGISTRY[name][0]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params)


def _check_keys(name: str, builder: Builder, kwargs: dict[str, object]) -> None:
    # Checked here rather than by catching TypeError, which would also swallow bugs in builders.
    keys = model_keys(name)
    if keys is None:
        return
    for key in kwargs:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ModelSpecError(f"unknown key {key!r} for model {name!r}; {hint}its keys are: {', '.join(keys)}")


def _parse_value(raw: str) -> int | float | str | bool:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def build_model(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> ModelSpec:
    """Build the model a spec string names, on ``device`` (``"meta"`` allocates no weights).

    ``path/to/file.py:factory`` calls ``factory()`` from that file (``device`` and ``dtype``
    are the factory's own); it must return a :class:`ModelSpec` or a dict of ``module``,
    ``inputs``, ``loss_fn`` and ``dims``.
    """
    head = spec.partition(":")[0]
    if head.endswith(".py"):
        return _build_from_file(spec, seed)
    check_spec(spec)
    name, kwargs = parse_spec(spec)
    builder, _ = REGISTRY[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = builder(**kwargs)
    model.module.to(dtype=dtype)
    model.name = model.source = spec
    return model


def _build_from_file(spec: str, seed: int = 0) -> ModelSpec:
    """``factory()`` of a user's file (seeded with ``seed``): a ModelSpec, or a dict with
    ``module``, ``inputs``, ``loss_fn`` and ``dims`` (read by :func:`as_spec`)."""
    path_str, _, factory = spec.partition(".py:")
    path = Path(path_str + ".py")
    if not factory:
        raise ModelSpecError(f"model spec {spec!r} names a file but no factory; write {path}:make_model")
    if not path.is_file():
        raise ModelSpecError(f"model file {path} does not exist (from spec {spec!r})")
    mod_spec = importlib.util.spec_from_file_location(f"user_model_{path.stem}", path)
    assert mod_spec and mod_spec.loader
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: say where it failed, not our traceback
        raise ModelSpecError(f"{_where(exc, path)}: importing {path} raised {type(exc).__name__}: {exc}; fix the "
                             f"file (run it with python to see the whole traceback)") from exc
    fn = getattr(module, factory, None)
    if fn is None:
        raise ModelSpecError(f"{path} has no function {factory!r}")
    torch.manual_seed(seed)
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - the user's factory: say where it failed
        raise ModelSpecError(f"{_where(exc, path)}: {path}:{factory}() raised {type(exc).__name__}: {exc}; fix "
                             f"the factory (--debug shows the whole traceback)") from exc
    if isinstance(result, dict) and "module" in result and not isinstance(result["module"], nn.Module):
        raise ModelSpecError(f"{path}:{factory}() returned a dict whose 'module' is {type(result['module']).__name__}, "
                             f"not a torch.nn.Module; put the model itself under 'module'")
    if isinstance(result, dict) and isinstance(result.get("module"), nn.Module):
        unknown = sorted(set(result) - {"module", "inputs", "loss_fn", "dims"})
        if unknown:
            raise ModelSpecError(f"{path}:{factory}() returned a dict with unknown key(s) {unknown}; its keys are "
                                 f"module, inputs, loss_fn, dims")
        result = as_spec(result["module"], inputs=result.get("inputs"), loss_fn=result.get("loss_fn"),
                         dims=result.get("dims"), name=spec)
    if not isinstance(result, ModelSpec):
        raise ModelSpecError(f"{path}:{factory}() returned {type(result).__name__}; it must return a "
                             f"partitioner.inputs.model_spec.ModelSpec(module=..., inputs=..., loss=...) or a dict "
                             f"{{'module': nn.Module, 'inputs': (InputSpec, ...), 'loss_fn': f(module, *inputs), "
                             f"'dims': {{'seq': N}}}}")
    result.name = spec
    return result


def _where(exc: BaseException, path: Path) -> str:
    """``file:line`` of the deepest frame of ``exc``'s traceback in the user's file ``path`` (for
    a syntax error, its own line), else the file alone."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{path}:{exc.lineno}"
    target = str(path.resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(Path(f.filename).resolve()) == target]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def as_spec(model: str | ModelSpec | nn.Module, *, inputs: Sequence[InputSpec] | None = None,
            loss_fn: LossFn | None = None, dims: dict[str, int] | None = None,
            name: str | None = None, seed: int = 0, device: str | torch.device = "cpu") -> ModelSpec:
    """A :class:`ModelSpec` from any form a user gives a model: a spec string (a zoo spec or
    ``path/to/file.py:factory``, built on ``device`` with ``seed``), or a ModelSpec (as it is).
    Every entry point (``plan``, ``analyze``, ``auto_parallelize``, the CLI) reads models through
    this one function, with the model alone: a bare module is refused, naming how to wrap it in a
    ModelSpec. ``inputs`` (named dims), ``loss_fn(module, *inputs)`` and ``dims`` (sizes of the
    named dims other than batch) complete a module that a file's factory returned in a dict."""
    if isinstance(model, str):
        return build_model(model, device=device, seed=seed)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        if inputs is None or loss_fn is None:
            kind = type(model).__name__
            raise ConfigError(f"a bare nn.Module ({kind}) does not say its inputs or its loss; wrap it in a ModelSpec: "
                              f"ModelSpec(module=model, inputs=(InputSpec(name='x', shape=('batch', 32)),), "
                              f"loss=lambda m, x: m(x).pow(2).mean(), dims={{'seq': 128}}) (from partitioner import "
                              f"ModelSpec, InputSpec; a size in dims for every named dim other than batch)")
        values = {"batch": 2, **(dims or {})}  # capture traces with example sizes; batch is symbolic anyway
        missing = sorted({d for i in inputs for d in i.shape if isinstance(d, str)} - set(values))
        if missing:
            raise ConfigError(f"give a size for the named dim(s) {missing} of the inputs, "
                              f"e.g. dims={{{missing[0]!r}: 128}}")
        return ModelSpec(name=name or type(model).__name__, module=model, inputs=tuple(inputs), loss=loss_fn,
                         dims=values)
    raise ConfigError(f"model must be a spec string (NAME:key=value,... or path/to/file.py:factory), a ModelSpec "
                      f"or an nn.Module, got {type(model).__name__}")
