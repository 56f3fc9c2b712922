"""Model specs: ``NAME:key=value,...`` strings that build a model of the zoo, a Hugging Face
model from a config, or a user's own model from ``path/to/file.py:factory``.

A :class:`ModelSpec` bundles the module with its inputs (named symbolic dims) and its loss, so
that capture sees one training step: ``loss = spec.loss(module, *inputs)``.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from passes.ir.errors import ConfigError, ModelSpecError
from passes.ir.meta import InputSpec
from partitioner.spec_keys import SpecTable, check_values, describe_table

LossFn = Callable[..., torch.Tensor]


@dataclass(kw_only=True)
class ModelSpec:
    """A model ready to capture.

    * ``module``: the user's ``nn.Module`` (on any device, ``meta`` included).
    * ``inputs``: every tensor the training step takes, model inputs and targets alike.
    * ``loss``: ``loss(module, *inputs) -> scalar tensor``; the step that capture records.
    * ``dims``: default value of every named dim (e.g. ``{"batch": 2, "seq": 64}``).
    """

    name: str
    module: nn.Module
    inputs: tuple[InputSpec, ...]
    loss: LossFn
    dims: dict[str, int] = field(default_factory=dict)

    def cast(self, dtype: torch.dtype) -> ModelSpec:
        """This model trained in ``dtype``: the module's floating parameters and buffers are cast
        in place (as ``module.to(dtype)``) and the floating inputs declared in ``dtype``; integer
        inputs (token ids, labels) keep theirs. Returns the spec with the retyped inputs."""
        self.module.to(dtype=dtype)
        inputs = tuple(dataclasses.replace(i, dtype=dtype) if i.dtype.is_floating_point else i for i in self.inputs)
        return dataclasses.replace(self, inputs=inputs)

    def example_inputs(self, dims: dict[str, int] | None = None, *, device: str | torch.device = "cpu",
                       seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Random tensors matching ``inputs`` with named dims set from ``dims`` (or defaults)."""
        values = {**self.dims, **(dims or {})}
        gen = torch.Generator().manual_seed(seed)
        out = []
        for spec in self.inputs:
            shape = []
            for d in spec.shape:
                if isinstance(d, str):
                    if d not in values:
                        raise ModelSpecError(f"input {spec.name!r} needs a value for dim {d!r}; pass dims={{{d!r}: N}}")
                    shape.append(values[d])
                else:
                    shape.append(d)
            if spec.dtype.is_floating_point:
                t = torch.randn(shape, generator=gen, dtype=spec.dtype)
            else:
                t = torch.randint(0, spec.high or 2, shape, generator=gen, dtype=spec.dtype)
            out.append(t.to(device))
        return tuple(out)


Builder = Callable[..., ModelSpec]
_REGISTRY: dict[str, tuple[Builder, str]] = {}
_TABLES: dict[str, tuple[SpecTable, dict[str, object]]] = {}  # name -> (rules of its keys, their defaults)


def register(name: str, help: str, *, keys: SpecTable | None = None,
             defaults: dict[str, object] | None = None) -> Callable[[Builder], Builder]:
    """Register a zoo builder under ``name``; its keyword arguments are the spec keys.

    ``keys``: the type and range of every key (:mod:`partitioner.spec_keys`), checked before the
    builder runs; ``defaults``: the keys' defaults when the builder's signature does not give
    them (builders taking ``**kwargs``)."""

    def deco(fn: Builder) -> Builder:
        _REGISTRY[name] = (fn, help)
        if keys is not None:
            params = inspect.signature(fn).parameters.values()
            found = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
            _TABLES[name] = (keys, {**found, **(defaults or {})})
        return fn

    return deco


def key_rules(name: str) -> str | None:
    """The keys of zoo model ``name`` with their rules and defaults, in one line (None: no table)."""
    _load_zoo()
    if name not in _TABLES:
        return None
    table, defaults = _TABLES[name]
    return describe_table(table, defaults)


def check_spec(spec: str) -> None:
    """Refuse a zoo spec string before any work: malformed items, an unknown model or key, and
    values that break the model's key table (:func:`check_spec_values`). File specs pass."""
    if not isinstance(spec, str) or spec.partition(":")[0].strip().endswith(".py"):
        return
    _load_zoo()
    name, kwargs = parse_spec(spec)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, sorted(_REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelSpecError(
            f"unknown model {name!r} in spec {spec!r}; {hint}known models: {', '.join(sorted(_REGISTRY))}, "
            f"or path/to/file.py:factory")
    _check_keys(name, _REGISTRY[name][0], kwargs)
    check_spec_values(name, kwargs)


def check_dim(spec: str, dim: str, value: int, *, spelled: str) -> None:
    """Raise :class:`ModelSpecError` when named dim ``dim`` = ``value`` exceeds what zoo spec
    ``spec`` was built for (``--seq 64`` on ``gpt:seq=32``, which has 32 learned positions).
    Specs of files and models without a bound pass."""
    if not isinstance(spec, str) or spec.partition(":")[0].endswith(".py"):
        return
    name, kwargs = parse_spec(spec)
    _load_zoo()
    if name not in _TABLES:
        return
    table, defaults = _TABLES[name]
    key = table.limits.get(dim)
    bound = kwargs.get(key, defaults.get(key)) if key is not None else None
    if isinstance(bound, int) and isinstance(value, int) and value > bound:
        raise ModelSpecError(f"{spelled} {value} is longer than the {bound} positions of {spec!r} ({key}={bound}); "
                             f"use {spelled} <= {bound} or build the model with {key}={value}")


def check_spec_values(name: str, kwargs: dict[str, object]) -> None:
    """Raise :class:`ModelSpecError` when a value of ``kwargs`` breaks the key table of ``name``
    (type, range, choices, or a rule across keys such as ``hidden`` divisible by ``heads``)."""
    _load_zoo()
    if name in _TABLES:
        table, defaults = _TABLES[name]
        check_values(name, table, kwargs, defaults)


def known_models() -> dict[str, str]:
    _load_zoo()
    return {k: h for k, (_, h) in sorted(_REGISTRY.items())}


def _load_zoo() -> None:
    import partitioner.zoo  # noqa: F401  (registers the builders)


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
    _load_zoo()
    if name not in _REGISTRY:
        raise ModelSpecError(f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
    params = inspect.signature(_REGISTRY[name][0]).parameters.values()
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
    builder, _ = _REGISTRY[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = builder(**kwargs)
    model.module.to(dtype=dtype)
    model.name = spec
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
    mod_spec.loader.exec_module(module)
    fn = getattr(module, factory, None)
    if fn is None:
        raise ModelSpecError(f"{path} has no function {factory!r}")
    torch.manual_seed(seed)
    result = fn()
    if isinstance(result, dict) and isinstance(result.get("module"), nn.Module):
        unknown = sorted(set(result) - {"module", "inputs", "loss_fn", "dims"})
        if unknown:
            raise ModelSpecError(f"{path}:{factory}() returned a dict with unknown key(s) {unknown}; its keys are "
                                 f"module, inputs, loss_fn, dims")
        result = as_spec(result["module"], inputs=result.get("inputs"), loss_fn=result.get("loss_fn"),
                         dims=result.get("dims"), name=spec)
    if not isinstance(result, ModelSpec):
        raise ModelSpecError(f"{path}:{factory}() returned {type(result).__name__}; it must return a "
                             f"partitioner.model_spec.ModelSpec(module=..., inputs=..., loss=...) or a dict "
                             f"{{'module': nn.Module, 'inputs': (InputSpec, ...), 'loss_fn': f(module, *inputs), "
                             f"'dims': {{'seq': N}}}}")
    result.name = spec
    return result


def as_spec(model: str | ModelSpec | nn.Module, *, inputs: Sequence[InputSpec] | None = None,
            loss_fn: LossFn | None = None, dims: dict[str, int] | None = None,
            name: str | None = None, seed: int = 0, device: str | torch.device = "cpu") -> ModelSpec:
    """A :class:`ModelSpec` from any form a user gives a model: a spec string (a zoo spec or
    ``path/to/file.py:factory``, built on ``device`` with ``seed``), a ModelSpec (as it is), or a
    module with ``inputs`` (named dims), ``loss_fn(module, *inputs)`` and ``dims`` (sizes of the
    named dims other than batch). Every entry point (``plan``, ``analyze``, ``auto_parallelize``,
    the CLI) reads models through this one function."""
    if isinstance(model, str):
        return build_model(model, device=device, seed=seed)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        if inputs is None or loss_fn is None:
            raise ConfigError(f"a bare nn.Module ({type(model).__name__}) needs inputs=(InputSpec(...), ...) with "
                              f"named dims and loss_fn(module, *inputs) -> scalar")
        values = {"batch": 2, **(dims or {})}  # capture traces with example sizes; batch is symbolic anyway
        missing = sorted({d for i in inputs for d in i.shape if isinstance(d, str)} - set(values))
        if missing:
            raise ConfigError(f"give a size for the named dim(s) {missing} of the inputs, "
                              f"e.g. dims={{{missing[0]!r}: 128}}")
        return ModelSpec(name=name or type(model).__name__, module=model, inputs=tuple(inputs), loss=loss_fn,
                         dims=values)
    raise ConfigError(f"model must be a spec string (NAME:key=value,... or path/to/file.py:factory), a ModelSpec "
                      f"or an nn.Module, got {type(model).__name__}")


def meta_copy(spec: ModelSpec) -> ModelSpec:
    """The same model on the meta device (no weights): what analysis and profiling read. Tied
    weights stay tied (one parameter under several names), so they are counted once."""
    module = copy.deepcopy(spec.module)  # deepcopy keeps ties; ``.to("meta")`` below does not
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    module = module.to("meta")  # one new meta parameter per owning module: the ties break here
    for names in aliases.values():
        shared = module.get_parameter(names[0])
        for alias in names[1:]:
            owner, _, leaf = alias.rpartition(".")
            setattr(module.get_submodule(owner), leaf, shared)
    return ModelSpec(name=spec.name, module=module, inputs=spec.inputs, loss=spec.loss, dims=dict(spec.dims))
