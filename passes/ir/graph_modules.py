"""The graph modules the passes build generate their Python code when they are first run or read,
not at every construction, copy and rewrite; and a copy of one shares its immutable metadata.

``fx.GraphModule`` generates and compiles its ``forward`` whenever its graph is set: a lowering
builds, deep-copies and rewrites stage programs many times before one runs (code generation was
5% of the test suite's CPU). :func:`graph_module` builds PyTorch's ``_LazyGraphModule`` instead:
``recompile()`` only marks the code stale, and the code is made on the first call or read of
``.code``. :func:`compiled` makes it now, for what inspects ``forward`` without calling the
module (exporters, tracers).

:func:`copy_graph_module` deep-copies a graph module as ``copy.deepcopy`` does, except for the
sympy expressions its graph-level metadata holds (the memory summary's byte counts, a checkpoint
plan's sizes): they are immutable, and deepcopy rebuilds each one through sympy's constructors,
about a third of the cost of copying an analysed graph."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable, Mapping

import sympy
import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule


def graph_module(root: nn.Module | dict, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose code is made when first needed."""
    return _LazyGraphModule(root, graph, class_name=class_name)


def compiled(module: nn.Module) -> nn.Module:
    """``module`` with the code of every graph module in it made (in place); returns it."""
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            _LazyGraphModule.force_recompile(sub)
    return module


def copy_graph_module(gm: fx.GraphModule, *, share: Iterable[Any] = (),
                      replace: Mapping[int, Any] | None = None) -> fx.GraphModule:
    """``copy.deepcopy(gm)``, sharing the sympy expressions of its (and its submodules') ``meta``
    and the objects of ``share`` (e.g. its parameters, for a copy that only reads them);
    ``replace``: ``id(object)`` -> what the copy holds in its place."""
    memo: dict[int, Any] = {id(obj): obj for obj in share}
    memo.update(replace or {})
    seen: set[int] = set()
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            _share_expressions(sub.meta, memo, seen)
    return copy.deepcopy(gm, memo)


def _share_expressions(value: Any, memo: dict[int, Any], seen: set[int]) -> None:
    """Enter every sympy expression reachable from ``value`` (through dicts, sequences, sets and
    dataclasses) in ``memo`` as its own copy."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, int, float, bool, type(None))) or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, sympy.Basic):
            memo[id(v)] = v
        elif isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(v.keys())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))


def weightless_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers are meta tensors of their shapes and dtypes
    (ties kept: one tensor under several names stays one): what lowering a plan only to measure
    it needs (the memory replay), without copying and sharding a real model's weights."""
    meta: dict[int, Any] = {}
    for sub in gm.modules():
        for t in [*sub._parameters.values(), *sub._buffers.values()]:
            if t is None or id(t) in meta:
                continue
            empty = torch.empty_like(t, device="meta")
            meta[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy_graph_module(gm, replace=meta)
