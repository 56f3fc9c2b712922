"""The knobs ``fix=`` may pin (``--fix tp=8,pp=4``): their names, types and values, checked at the door.

:func:`parse_fix` reads the command-line text, :func:`check_fix` a mapping (or that text); both
return a typed dict or raise :class:`ConfigError` naming the knob, the value, the rule and a fix.
The rules that involve the model or the cluster (layers, heads, devices, the batch) are the
search's (:mod:`partitioner.search.search`); the values each knob takes are spelled in
:mod:`passes.ir.config` and read from there.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from passes.ir.config import CHECKPOINTING, CP_MODES, KNOBS, OFFLOAD, SCHEDULES, ZERO_STAGES
from passes.ir.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Knob:
    """The rule of one knob: a positive count, one of ``choices``, or a flag."""

    name: str
    kind: Literal["count", "optional_count", "choice", "bool"]
    choices: tuple[object, ...] = ()
    meaning: str
    """What the knob counts or picks, for messages."""

    def describe(self) -> str:
        if self.kind == "count":
            return "an integer >= 1"
        if self.kind == "optional_count":
            return "an integer >= 1 or none"
        if self.kind == "bool":
            return "true or false"
        return f"one of {', '.join(map(str, self.choices))}"


KNOB_RULES: dict[str, Knob] = {k.name: k for k in (
    Knob(name="dp", kind="count", meaning="data-parallel replicas"),
    Knob(name="tp", kind="count", meaning="tensor-parallel ranks"),
    Knob(name="pp", kind="count", meaning="pipeline stages"),
    Knob(name="cp", kind="count", meaning="context-parallel ranks (the sequence cut over them)"),
    Knob(name="cp_mode", kind="choice", choices=CP_MODES,
         meaning="how context-parallel attention exchanges (ring: K/V blocks round the cp ring; ulysses: all-to-all)"),
    Knob(name="ep", kind="count",
         meaning="expert-parallel ranks (each MoE block's experts spread over them, taken from dp x cp)"),
    Knob(name="virtual_pp", kind="count", meaning="model chunks per pipeline rank"),
    Knob(name="micro_batch_size", kind="count", meaning="samples per micro-batch"),
    Knob(name="num_micro_batches", kind="count", meaning="micro-batches per step"),
    Knob(name="schedule", kind="choice", choices=SCHEDULES, meaning="pipeline schedule"),
    Knob(name="zero_stage", kind="choice", choices=ZERO_STAGES, meaning="ZeRO stage"),
    Knob(name="hsdp_shard", kind="optional_count", meaning="dp ranks a ZeRO-3 shard group spans (HSDP; none: all of dp)"),
    Knob(name="reshard_after_forward", kind="bool",
         meaning="ZeRO-3 frees a block's gathered parameters after its forward (false: keeps them for its backward)"),
    Knob(name="sequence_parallel", kind="bool", meaning="sequence parallelism"),
    Knob(name="checkpointing", kind="choice", choices=CHECKPOINTING, meaning="activation recomputation"),
    Knob(name="offload", kind="choice", choices=OFFLOAD, meaning="what waits in host memory"),
    Knob(name="compile", kind="bool", meaning="stage programs compiled with torch.compile (off unless pinned)"),
)}
assert tuple(KNOB_RULES) == KNOBS, "every knob of passes.ir.config.KNOBS has a rule here, in its order"

_NOT_KNOBS = {"dtype": "give the training dtype as --dtype (dtype= in Python)",
              "global_batch": "give the samples per step as --global-batch (global_batch= in Python)",
              "stage_boundaries": "the stage boundaries follow from the other knobs and cannot be pinned"}


def parse_fix(text: str, *, where: str = "--fix") -> dict[str, object]:
    """``"tp=8,pp=4,schedule=interleaved"`` -> a checked, typed dict (see :func:`check_fix`).

    Refuses malformed items, unknown knobs, values outside a knob's rule and a knob given twice."""
    if not isinstance(text, str):
        raise ConfigError(f"{where} must be text such as 'tp=2,pp=2', got {type(text).__name__}")
    out: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key or not raw:
            raise ConfigError(f"malformed {where} item {item!r}; write knob=value, e.g. tp=8,pp=4")
        rule = _rule(key, where)
        if key in out:
            raise ConfigError(f"{where}: {key} is given twice ({key}={_show(out[key])}, {key}={raw}); keep one")
        out[key] = _convert(rule, raw, where)
    return out


def check_fix(fix: Mapping[str, object] | str | None, *, where: str = "fix") -> dict[str, object]:
    """The knobs ``fix`` pins, checked: known names, values of the right type in each knob's
    range or choices. Text is read with :func:`parse_fix`; a mapping's text values (``"2"``)
    are read as the command line reads them. Returns a new dict."""
    if fix is None:
        return {}
    if isinstance(fix, str):
        return parse_fix(fix, where="--fix" if where == "fix" else where)
    if not isinstance(fix, Mapping):
        raise ConfigError(f"{where} must be a dict of knobs or text such as 'tp=2,pp=2', got {type(fix).__name__}")
    out: dict[str, object] = {}
    for key, value in fix.items():
        rule = _rule(str(key), where)
        out[key] = _convert(rule, value.strip(), where) if isinstance(value, str) else _check(rule, value, where)
    return out


def _rule(key: str, where: str) -> Knob:
    rule = KNOB_RULES.get(key)
    if rule is not None:
        return rule
    if key in _NOT_KNOBS:
        raise ConfigError(f"{where}: {key} is not a knob; {_NOT_KNOBS[key]}")
    close = difflib.get_close_matches(key, KNOBS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"unknown knob {key!r} in {where}; {hint}knobs: {', '.join(KNOBS)}")


def _convert(rule: Knob, raw: str, where: str) -> object:
    """The value of command-line text ``raw`` under ``rule``, checked."""
    if rule.kind == "bool":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"{where} {rule.name}={raw}: use true or false")
        return raw.lower() in ("true", "1")
    if rule.kind == "optional_count" and raw.lower() == "none":
        return None
    if rule.kind in ("count", "optional_count") or isinstance(rule.choices[0], int):
        try:
            value: object = int(raw)
        except ValueError:
            raise ConfigError(f"{where} {rule.name}={raw}: {rule.name} takes an integer "
                              f"({rule.describe()}: {rule.meaning})") from None
        return _check(rule, value, where)
    return _check(rule, raw, where)


def _check(rule: Knob, value: object, where: str) -> object:
    if rule.kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} {rule.name}={value!r}: use true or false")
        return value
    shown = value if isinstance(value, str) else repr(value)
    if rule.kind == "optional_count" and value is None:
        return value
    if rule.kind in ("count", "optional_count"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where} {rule.name}={value!r}: {rule.name} must be {rule.describe()} "
                              f"({rule.meaning}), got {value!r}; give a positive count or leave {rule.name} out")
        return value
    if value not in rule.choices or isinstance(value, bool) or type(value) is not type(rule.choices[0]):
        raise ConfigError(f"{where} {rule.name}={shown}: {rule.name} {value!r} is not one of "
                          f"{', '.join(map(str, rule.choices))}")
    return value


def _show(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def fix_text(fix: Mapping[str, object]) -> str:
    """``tp=2,pp=4``: a checked fix as the command line writes it (for messages)."""
    return ",".join(f"{k}={_show(v)}" for k, v in fix.items()) or "(nothing pinned)"
