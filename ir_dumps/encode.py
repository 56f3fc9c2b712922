"""Turn graph facts into deterministic text and JSON values, shared by every dump format.

Rules that make dumps byte-identical from run to run:

* only *our* facts are dumped: values in ``node.meta`` / ``gm.meta`` that are dataclasses defined
  in this project (``passes.ir.meta`` and friends); torch.export's own entries (fake tensors, stack
  traces with file paths) are left out;
* sympy expressions print with ``str()`` (sympy orders terms canonically); integers become ints;
* no ``repr`` that could carry a memory address reaches the output (``at 0x...`` is stripped).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Iterator

import sympy
import torch
from torch import fx
from torch.fx.node import _get_qualified_name

from passes.ir import meta as meta_keys
from passes.ir.meta import module_path

# Packages whose dataclasses count as project facts worth dumping.
_PROJECT_PACKAGES = ("passes", "partitioner", "runtime", "ir_dumps")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _meta_key_order() -> tuple[str, ...]:
    """Keys of ``passes.ir.meta`` in the order that module defines them (shape, flops, memory, ...)."""
    keys = []
    for name, value in vars(meta_keys).items():
        if name.isupper() and isinstance(value, str) and not name.startswith("EXPORT_"):
            keys.append(value)
    return tuple(keys)


KNOWN_KEY_ORDER = _meta_key_order()


def is_fact(value: Any) -> bool:
    """True for a dataclass instance defined in one of this project's packages."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return False
    return type(value).__module__.split(".")[0] in _PROJECT_PACKAGES


def is_plain(value: Any) -> bool:
    """True for a plain scalar a dump prints as ``key=value`` (int, float, str, bool, sympy)."""
    return isinstance(value, (bool, int, float, str, sympy.Basic))


def facts(meta: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The project facts of a meta dict, known keys first (in ``passes.ir.meta`` order), then sorted.

    A fact is a project dataclass, or a plain scalar (:func:`is_plain`) under a key of
    ``passes.ir.meta``; callers that format fields must check ``dataclasses.is_dataclass`` first."""
    # A known key may hold a plain value (the pipeline stage is an int on nodes and on stage
    # modules): still a decision worth dumping, printed as ``key=value``.
    known = [k for k in KNOWN_KEY_ORDER if k in meta and (is_fact(meta[k]) or is_plain(meta[k]))]
    rest = sorted(k for k in meta if k not in KNOWN_KEY_ORDER and isinstance(k, str) and is_fact(meta[k]))
    for key in known + rest:
        yield key, meta[key]


# --------------------------------------------------------------------------------------------- scalars
def scalar_text(value: Any) -> str:
    """One value as short, deterministic text (used by the text and DOT dumps)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, torch.dtype):
        return dtype_text(value)
    if isinstance(value, sympy.Basic):
        return sympy_text(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(scalar_text(v) for v in value) + "]"
    if is_fact(value):
        return ":".join(scalar_text(getattr(value, f.name)) for f in dumped_fields(value))
    return safe_repr(value)


def dumped_fields(fact: Any) -> list[dataclasses.Field]:
    """The fields of ``fact`` the dumps show: all but those marked ``DUMP_IF_SET``
    (:mod:`passes.ir.meta`) while they are None."""
    return [f for f in dataclasses.fields(fact)
            if not (f.metadata.get("dump_if_set") and getattr(fact, f.name) is None)]


def sympy_text(value: sympy.Basic) -> str:
    """``str(value)``; integers and symbols (most sizes) without a trip through sympy's printer."""
    if isinstance(value, sympy.Integer):
        return str(int(value))
    if isinstance(value, sympy.Symbol):
        return value.name
    return str(value)


def dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def safe_repr(value: Any) -> str:
    return _ADDRESS.sub("", repr(value))


def to_json(value: Any) -> Any:
    """A JSON-ready form of a fact or field: numbers stay numbers, sympy becomes a string."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, sympy.Basic):
        if isinstance(value, sympy.Integer):
            return int(value)
        if value.is_Number:
            return float(value) if isinstance(value, sympy.Float) else str(value)
        return sympy_text(value)
    if isinstance(value, torch.dtype):
        return dtype_text(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if is_fact(value):
        return {f.name: to_json(getattr(value, f.name)) for f in dumped_fields(value)}
    return safe_repr(value)


# --------------------------------------------------------------------------------------------- nodes
def target_text(node: fx.Node) -> str:
    """``aten.linear.default``, ``getitem``, a parameter path, or a module path."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    try:
        # fx's own naming: "torch.relu" rather than "torch._VariableFunctionsClass.relu".
        name = _get_qualified_name(target)
    except Exception:  # noqa: BLE001 - odd callables fall back to their repr
        return safe_repr(target)
    for prefix in ("_operator.", "builtins."):
        name = name.removeprefix(prefix)
    return name


def arg_text(arg: Any) -> str:
    """An argument as code: ``%name`` for nodes, literals as Python would print them."""
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, tuple):
        inner = ", ".join(arg_text(a) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    if isinstance(arg, list):
        return "[" + ", ".join(arg_text(a) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {arg_text(v)}" for k, v in arg.items()) + "}"
    if isinstance(arg, torch.dtype):
        return str(arg)
    if isinstance(arg, torch.device):
        return f"device({str(arg)!r})"
    return safe_repr(arg)


def arg_json(arg: Any) -> Any:
    """An argument for JSON: ``"%name"`` for nodes, lists stay lists, literals as strings."""
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (tuple, list)):
        return [arg_json(a) for a in arg]
    if isinstance(arg, dict):
        return {str(k): arg_json(v) for k, v in arg.items()}
    return arg_text(arg)


def node_module(node: fx.Node) -> str:
    """The user module path a node came from ("" when unknown or top level)."""
    return module_path(node)
