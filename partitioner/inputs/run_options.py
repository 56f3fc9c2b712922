"""The scalar options of a run (``--timeout``, ``--steps``, ``global_batch=``, ...), checked at the door.

One :class:`Option` per option says its type and range; :func:`check_option` raises
:class:`ConfigError` naming the option (as the caller spells it), the value, the rule and a fix.
The command line and :func:`partitioner.api.auto.auto_parallelize` check the same table, so a bad
value is refused before any rank starts work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from passes.ir.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Option:
    """The rule of one option: an integer or a number, at least ``ge`` or above ``gt``."""

    kind: Literal["int", "float"]
    ge: float | None = None
    gt: float | None = None
    unit: str = ""
    """What the value counts (``seconds``, ``steps``, ``samples``), for messages."""
    fix: str = ""
    """What to give instead, for messages."""

    def describe(self) -> str:
        bound = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}" if self.gt is not None else ""
        unit = f" {self.unit}" if self.unit else ""
        noun = "an integer" if self.kind == "int" else "a number"
        return f"{noun} {bound}{unit}".replace("  ", " ").strip()


OPTIONS: dict[str, Option] = {
    "global_batch": Option(kind="int", ge=1, unit="samples", fix="the samples per optimizer step, e.g. 8"),
    "steps": Option(kind="int", ge=1, unit="steps", fix="train at least one step"),
    "timeout": Option(kind="float", gt=0, unit="seconds",
                      fix="how long a collective or receive may wait, e.g. 60"),
    "lr": Option(kind="float", gt=0, fix="a learning rate such as 3e-4"),
    "keep": Option(kind="int", ge=1, unit="checkpoints", fix="keep at least the last one, or leave it out (all)"),
    "save_every": Option(kind="int", ge=1, unit="steps", fix="checkpoint every N >= 1 steps"),
    "warmup": Option(kind="int", ge=0, unit="steps", fix="0 or more warm-up steps"),
    "clip_grad_norm": Option(kind="float", gt=0, fix="a global norm such as 1.0, or leave it out (no clipping)"),
    "nodes": Option(kind="int", ge=1, unit="nodes", fix="at least one node"),
    "world_size": Option(kind="int", ge=1, unit="ranks", fix="at least one rank"),
    "seq": Option(kind="int", ge=1, unit="tokens", fix="a sequence length of at least 1"),
    "batch": Option(kind="int", ge=1, unit="samples", fix="a batch of at least 1"),
}
"""Every scalar option, under its Python name (``--save-every`` is ``save_every``)."""


def check_option(name: str, value: object, *, spelled: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``value`` breaks the rule of option ``name`` (a key of
    :data:`OPTIONS`). ``spelled``: how the caller names it (``--timeout``; default ``name``)."""
    rule = OPTIONS[name]
    shown = spelled or name
    ok_type = not isinstance(value, bool) and (isinstance(value, int) if rule.kind == "int"
                                               else isinstance(value, (int, float)))
    ok = ok_type and math.isfinite(value) and (rule.ge is None or value >= rule.ge) and \
        (rule.gt is None or value > rule.gt)
    if not ok:
        rule_text = rule.describe() if not ok_type else rule.describe().removeprefix("an integer ").removeprefix(
            "a number ")
        raise ConfigError(f"{shown} must be {rule_text}, got {value!r}; give {rule.fix}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
