"""The rules of a model spec's keys: one table per zoo model, checked before anything is built.

Each key of a spec (``gpt:layers=4,hidden=64``) has a :class:`Key` (its type and range); rules
across keys (``hidden`` divisible by ``heads``) are :class:`Divisible` and :class:`EvenQuotient`.
:func:`check_values` applies a table to the values a spec gives (over the builder's defaults)
and raises :class:`ModelSpecError` naming the model, the key, the value, the rule and a fix.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from passes.ir.errors import ModelSpecError

Value = int | float | str | bool
KeyKind = Literal["int", "float", "str", "bool", "ints"]
"""``ints``: one integer or dash-separated integers (``2-2-2``; a spec's items are split on commas)."""


@dataclass(frozen=True, kw_only=True)
class Key:
    """The type and range of one spec key; bounds are inclusive (``ge``/``le``) or strict (``gt``/``lt``)."""

    kind: KeyKind
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    """For ``kind="str"``: the values allowed (empty: any string)."""

    def describe(self) -> str:
        """The rule in words, e.g. ``an integer >= 1`` or ``a number in [0, 1)``."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "str":
            return f"one of {', '.join(self.choices)}" if self.choices else "a string"
        noun = {"int": "an integer", "float": "a number", "ints": "an integer or dash-separated integers"}[self.kind]
        low = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None)
        high = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"{noun} in {low}, {high}"
        if low:
            return f"{noun} {'>=' if self.ge is not None else '>'} {low[1:]}"
        if high:
            return f"{noun} {'<=' if self.le is not None else '<'} {high[:-1]}"
        return noun

    def problem(self, value: Value) -> str | None:
        """What is wrong with ``value`` under this rule (None: it is fine)."""
        if self.kind == "bool":
            return None if isinstance(value, bool) else "type"
        if self.kind == "str":
            if not isinstance(value, str):
                return "type"
            return "choice" if self.choices and value not in self.choices else None
        if self.kind == "ints":
            numbers = _int_list(value)
            if numbers is None:
                return "type"
            return next(("range" for n in numbers if not self._in_range(n)), None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "type"
        if self.kind == "int" and not isinstance(value, int):
            return "type"
        if not math.isfinite(value) or not self._in_range(value):
            return "range"
        return None

    def _in_range(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))


@dataclass(frozen=True)
class Divisible:
    """``key`` must be divisible by ``by`` (e.g. ``hidden`` by ``heads``)."""

    key: str
    by: str
    says: Literal["divisible by", "a multiple of"] = "divisible by"

    def problem(self, model: str, values: Mapping[str, Value]) -> str | None:
        a, b = values.get(self.key), values.get(self.by)
        if not isinstance(a, int) or not isinstance(b, int) or b < 1 or a % b == 0:
            return None
        return (f"{model}: {self.key}={a} must be {self.says} {self.by}={b} ({a} is not divisible by {b}): "
                f"pick {self.by} among {_divisors_text(a)}, or change {self.key}")


@dataclass(frozen=True)
class EvenQuotient:
    """``key / by`` must be even (e.g. the head dim ``hidden / heads`` under RoPE)."""

    key: str
    by: str
    what: str
    why: str

    def problem(self, model: str, values: Mapping[str, Value]) -> str | None:
        a, b = values.get(self.key), values.get(self.by)
        if not isinstance(a, int) or not isinstance(b, int) or b < 1 or a % b or (a // b) % 2 == 0:
            return None
        good = [d for d in range(1, a + 1) if a % d == 0 and (a // d) % 2 == 0]
        choice = f"pick {self.by} among {', '.join(map(str, good[:8]))}" if good else f"make {self.key} even"
        return f"{model}: {self.what} {self.key}/{self.by} = {a // b} must be even {self.why}: {choice}"


Rule = Divisible | EvenQuotient


@dataclass(frozen=True)
class SpecTable:
    """Every key of one model with its rule, and the rules across keys.

    ``open``: keys outside the table are allowed (the builder checks them: ``hf-*`` configs).
    """

    keys: Mapping[str, Key]
    rules: tuple[Rule, ...] = ()
    open: bool = False
    limits: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Named dims a key bounds: ``{"seq": "seq"}`` for learned positions (a longer sequence has
    no position embedding)."""


def check_values(model: str, table: SpecTable, given: Mapping[str, Value], defaults: Mapping[str, Value]) -> None:
    """Raise :class:`ModelSpecError` for the first value of ``given`` that breaks ``table``.

    ``defaults``: the builder's default of every key, so cross-key rules see the values that
    would be built (``gpt:heads=3`` breaks ``hidden``'s default 128)."""
    for key, value in given.items():
        rule = table.keys.get(key)
        if rule is None:
            continue  # unknown keys are the caller's (it lists the known ones)
        wrong = rule.problem(value)
        if wrong is None:
            continue
        example = defaults.get(key)
        if wrong == "choice":
            uses = " or ".join(f"{key}={c}" for c in rule.choices)
            raise ModelSpecError(f"{model}: {key}={value!r} is not supported; use {uses}")
        hint = f"; e.g. {key}={_show(example)} (the default)" if example is not None else ""
        raise ModelSpecError(f"{model}: {key} must be {rule.describe()}, got {value!r}{hint}")
    values = {**defaults, **given}
    for cross in table.rules:
        message = cross.problem(model, values)
        if message is not None:
            raise ModelSpecError(message)


def describe_table(table: SpecTable, defaults: Mapping[str, Value]) -> str:
    """``layers (an integer >= 1, default 2), ...``: one line for ``partitioner models``."""
    parts = []
    for key, rule in table.keys.items():
        default = defaults.get(key)
        parts.append(f"{key} ({rule.describe()}" + (f", default {_show(default)})" if default is not None else ")"))
    return ", ".join(parts) + (", or any config field" if table.open else "")


def _int_list(value: Value) -> list[int] | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [value]
    if not isinstance(value, str):
        return None
    try:
        return [int(v) for v in value.split("-")]
    except ValueError:
        return None


def _divisors_text(n: int, shown: int = 6) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    text = ", ".join(map(str, divisors[:shown]))
    return text + ", ..." if len(divisors) > shown else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(v: Value) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# --------------------------------------------------------------------------------------------
# Building blocks of the zoo's tables
# --------------------------------------------------------------------------------------------

COUNT = Key(kind="int", ge=1)
"""A positive count (layers, hidden, heads, vocab, positions, batch)."""
DROPOUT = Key(kind="float", ge=0, lt=1)
"""A probability of dropping: 1 would drop everything."""
