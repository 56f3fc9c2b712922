"""The zoo's registry: each builder registers under its name, with the rules of its keys.

:mod:`partitioner.inputs.models` reads it to parse, check and build ``NAME:key=value,...`` specs.
"""
from __future__ import annotations

import inspect
from typing import Callable

from partitioner.inputs.model_spec import ModelSpec
from partitioner.inputs.spec_keys import SpecTable

Builder = Callable[..., ModelSpec]
REGISTRY: dict[str, tuple[Builder, str]] = {}
TABLES: dict[str, tuple[SpecTable, dict[str, object]]] = {}  # name -> (rules of its keys, their defaults)
MIXED_LAYERS: set[str] = set()
"""Models whose layers are not all alike (dense layers before the MoE ones, attention among
short convolutions): the planner's profile captures every layer instead of replicating a sample."""


def register(name: str, help: str, *, keys: SpecTable | None = None,
             defaults: dict[str, object] | None = None, mixed_layers: bool = False) -> Callable[[Builder], Builder]:
    """Register a zoo builder under ``name``; its keyword arguments are the spec keys.

    ``keys``: the type and range of every key (:mod:`partitioner.inputs.spec_keys`), checked before the
    builder runs; ``defaults``: the keys' defaults when the builder's signature does not give
    them (builders taking ``**kwargs``); ``mixed_layers``: its layers differ (:data:`MIXED_LAYERS`)."""

    def deco(fn: Builder) -> Builder:
        REGISTRY[name] = (fn, help)
        if mixed_layers:
            MIXED_LAYERS.add(name)
        if keys is not None:
            params = inspect.signature(fn).parameters.values()
            found = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
            TABLES[name] = (keys, {**found, **(defaults or {})})
        return fn

    return deco
