"""Pass manager: run graph passes in order, check what each needs and promises, report each step.

A :class:`Pass` is a named function ``fn(gm, ctx) -> gm`` with the meta keys it ``requires``
before it runs and ``provides`` after, and the ``options`` it was made with (recorded, so a
pipeline prints as text: ``tag_tensor_parallel{degree=2},checkpoint_policy{policy=full}``).
:class:`PassManager` runs a list of them and

* refuses, when it is built, an order that breaks a declared :class:`PassOrder` (e.g. the offload
  policy must run after the checkpoint policy);
* before each pass checks its ``requires`` (a missing key raises :class:`PassError` naming the
  pass that should have provided it);
* after each pass (``check=True``) runs ``gm.graph.lint()`` and checks ``provides``: a graph key
  must be in ``gm.meta``, a node key on every node that should carry it (see
  :data:`NODE_KEY_COVERAGE`);
* wraps any exception raised inside a pass in :class:`PassError` with the pass name, the node
  being processed when known, and the passes that already ran;
* times each pass (wall seconds) and hands the graph after it to an :class:`Instrument` (the
  IR dump writer of :mod:`ir_dumps.writer` is one), so that dumping is the caller's choice and
  this module imports nothing of it.

The pipelines themselves (which passes, in which order, with which options) are
:mod:`passes.lowering.pipelines`.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Callable, Iterator, Protocol, Sequence

from torch import fx

from passes.ir.config import DType
from passes.ir.errors import PassError
from passes.ir.meta import KEYS

PassFn = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]

# Derived from the one table of keys (passes.ir.meta.KEYS): where each lives, who writes it, and
# which nodes must carry a node key once a pass provides it. Shapes and memory describe every
# value (inputs and parameters included); FLOPs only make sense for nodes that compute. The
# output node produces no value of its own, so it never has to carry a key.
GRAPH_KEYS = frozenset(k for k, spec in KEYS.items() if spec.scope == "graph")
KNOWN_PROVIDERS: dict[str, str] = {k: spec.owner for k, spec in KEYS.items()}
_COVERAGE: dict[str, Callable[[fx.Node], bool]] = {
    "values": lambda node: node.op != "output",
    "computes": lambda node: node.op in ("call_function", "call_method", "call_module"),
}
NODE_KEY_COVERAGE: dict[str, Callable[[fx.Node], bool]] = {
    k: _COVERAGE[spec.covers] for k, spec in KEYS.items() if spec.scope == "node" and spec.covers is not None}


@dataclass(frozen=True, kw_only=True)
class PassContext:
    """Options every pass may read; passed as the second argument of each pass function."""

    optimizer: str = "adamw"
    """Optimizer whose state the memory pass counts ("adamw", "adam", "sgd", ...)."""
    dtype: DType = "fp32"
    """The training dtype (``bf16``/``fp16``: 16-bit weights plus fp32 master copies, see
    :func:`passes.ir.config.is_mixed`)."""


@dataclass(frozen=True, kw_only=True)
class Pass:
    """A graph pass: ``fn(gm, ctx)`` returns the (possibly new) GraphModule.

    ``requires``: meta keys that must exist before it runs; ``provides``: keys it guarantees
    after. Graph keys (:data:`GRAPH_KEYS`) refer to ``gm.meta``, the others to ``node.meta``.
    ``options``: what the pass was configured with, as ``(name, value)`` pairs (see :meth:`spec`).
    """

    name: str
    fn: PassFn
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()

    def spec(self) -> str:
        """``name{key=value,...}`` (just ``name`` without options): the pass in a pipeline's text."""
        if not self.options:
            return self.name
        return self.name + "{" + ",".join(f"{k}={_option_text(v)}" for k, v in self.options) + "}"


def _option_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + " ".join(_option_text(v) for v in value) + "]"
    return str(value)


def pipeline_text(passes: Sequence[Pass]) -> str:
    """The pipeline as text: each pass's :meth:`Pass.spec`, comma separated."""
    return ",".join(p.spec() for p in passes)


@dataclass(frozen=True, kw_only=True)
class PassOrder:
    """An ordering rule: wherever both run, pass ``then`` runs only after pass ``first`` has (``why``
    says why); either may run again later (a re-analysis)."""

    first: str
    then: str
    why: str


def check_pass_order(names: Sequence[str], rules: Sequence[PassOrder]) -> None:
    """Raise :class:`PassError` for the first rule ``names`` (passes in run order) breaks."""
    for rule in rules:
        firsts = [i for i, n in enumerate(names) if n == rule.first]
        thens = [i for i, n in enumerate(names) if n == rule.then]
        if firsts and thens and min(thens) < min(firsts):
            raise PassError(f"pass order: {rule.then!r} (position {min(thens)}) runs before {rule.first!r} "
                            f"(position {min(firsts)}), but {rule.why}; move {rule.then!r} after {rule.first!r}")


@dataclass(frozen=True, kw_only=True)
class PassRecord:
    """What one pass run did: its wall time (seconds) and the node count after it."""

    name: str
    seconds: float
    nodes: int


class Instrument(Protocol):
    """Sees the graph a manager runs: before the first pass and after each (e.g. to dump it)."""

    def on_input(self, gm: fx.GraphModule) -> None:
        """The graph as the pipeline received it."""

    def on_pass(self, p: Pass, gm: fx.GraphModule, seconds: float) -> None:
        """The graph after pass ``p``, which took ``seconds``."""


class PassManager:
    """Runs passes in order with checks; see the module docstring.

    ``check=False`` skips the lint and ``provides`` checks after each pass (``requires`` is
    always checked: it is cheap and turns a confusing failure inside a pass into a message
    naming the missing pass). ``order``: ordering rules to refuse at construction.
    ``instrument``: sees the input and the graph after every pass.
    """

    def __init__(self, passes: Sequence[Pass], *, check: bool = True, order: Sequence[PassOrder] = (),
                 instrument: Instrument | None = None):
        passes = list(passes)
        for p in passes:
            if not isinstance(p, Pass):
                raise TypeError(f"PassManager takes Pass objects, got {type(p).__name__}; wrap functions "
                                f"as Pass(name=..., fn=...)")
        names = [p.name for p in passes]
        check_pass_order(names, order)
        self.passes: tuple[Pass, ...] = tuple(passes)
        self.check = check
        self.instrument = instrument
        self.records: tuple[PassRecord, ...] = ()  # of the latest run
        self._names = names

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def __getitem__(self, index: int) -> Pass:
        return self.passes[index]

    def text(self) -> str:
        """The pipeline as text (:func:`pipeline_text`)."""
        return pipeline_text(self.passes)

    def run(self, gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
        """Run every pass on ``gm``; returns the final GraphModule. Raises :class:`PassError`."""
        ctx = ctx or PassContext()
        records: list[PassRecord] = []
        if self.instrument is not None:
            self.instrument.on_input(gm)
        try:
            for i, p in enumerate(self.passes):
                done = [r.name for r in records]
                self._check_requires(gm, p, i)
                start = time.perf_counter()
                try:
                    result = p.fn(gm, ctx)
                except Exception as exc:  # noqa: BLE001 - every failure gets the pass's context
                    raise _wrap(exc, p.name, done, getattr(self.instrument, "root", None)) from exc
                seconds = time.perf_counter() - start
                if not isinstance(result, fx.GraphModule):
                    raise PassError(f"pass {p.name!r} returned {type(result).__name__}, not a GraphModule; "
                                    f"a pass must return the graph module (return gm at its end). "
                                    f"{_ran(done)}")
                gm = result
                if self.check:
                    self._check_after(gm, p, done)
                records.append(PassRecord(name=p.name, seconds=seconds, nodes=len(gm.graph.nodes)))
                if self.instrument is not None:
                    self.instrument.on_pass(p, gm, seconds)
        finally:
            self.records = tuple(records)
        return gm

    # ------------------------------------------------------------------------------------ checks
    def _check_requires(self, gm: fx.GraphModule, p: Pass, index: int) -> None:
        for key in p.requires:
            missing = _missing(gm, key)
            if missing is None:
                continue
            raise PassError(f"pass {p.name!r} requires meta {key!r}, but {missing}. "
                            f"{self._provider_hint(key, index)} {_ran(self._names[:index])}")

    def _provider_hint(self, key: str, index: int) -> str:
        earlier = [q.name for q in self.passes[:index] if key in q.provides]
        later = [q.name for q in self.passes[index + 1:] if key in q.provides]
        here = self._names[index]
        if earlier:
            return (f"Pass {earlier[-1]!r} provides it; a pass after it must have dropped it or added "
                    f"nodes without it.")
        if later:
            return f"Pass {later[0]!r} provides it but runs later: move it before {here!r}."
        provider = KNOWN_PROVIDERS.get(key)
        if provider:
            return f"Run {provider} before {here!r} (no pass in this pipeline provides {key!r})."
        return f"No pass in this pipeline provides {key!r}; add one before {here!r}."

    def _check_after(self, gm: fx.GraphModule, p: Pass, done: list[str]) -> None:
        try:
            gm.graph.lint()
        except Exception as exc:  # noqa: BLE001 - lint raises plain RuntimeError/AssertionError
            raise PassError(f"pass {p.name!r} left an invalid graph: {type(exc).__name__}: "
                            f"{_first_line(exc)}. {_ran(done)}") from exc
        for key in p.provides:
            missing = _missing(gm, key)
            if missing is not None:
                raise PassError(f"pass {p.name!r} declares it provides meta {key!r}, but {missing}; "
                                f"write it in the pass or drop it from provides. {_ran(done)}")


def _missing(gm: fx.GraphModule, key: str) -> str | None:
    """Why ``key`` is not satisfied on ``gm`` (None when it is)."""
    if key in GRAPH_KEYS:
        return None if key in gm.meta else f"gm.meta has no {key!r}"
    if key in gm.meta:  # an unknown key a pass chose to keep at graph level
        return None
    should = NODE_KEY_COVERAGE.get(key, _COVERAGE["values"])
    lacking = [n.name for n in gm.graph.nodes if should(n) and key not in n.meta]
    if not lacking:
        return None
    more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
    return f"node {lacking[0]!r}{more} has no node.meta[{key!r}]"


def _ran(done: Sequence[str]) -> str:
    return f"Passes already run: {', '.join(done) if done else '(none)'}."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _wrap(exc: Exception, name: str, done: list[str], dumps: Any = None) -> PassError:
    node = _node_in_traceback(exc.__traceback__)
    # AnalysisError messages name their node already; repeating it would only add noise.
    at = f" at node {node.name!r} ({node.format_node()})" if node is not None and f"'{node.name}'" not in str(exc) else ""
    where = f" Dumps of the passes before it are in {dumps}." if dumps is not None and done else ""
    err = PassError(f"pass {name!r} failed{at}: {type(exc).__name__}: {_first_line(exc)}. {_ran(done)}{where}")
    err.pass_name = name  # type: ignore[attr-defined]
    err.node = node.name if node is not None else None  # type: ignore[attr-defined]
    err.previous = tuple(done)  # type: ignore[attr-defined]
    return err


def _node_in_traceback(tb: TracebackType | None) -> fx.Node | None:
    """The fx node the innermost frame of a pass was working on, when a frame names one.

    Passes conventionally loop ``for node in gm.graph.nodes`` (or ``n``); the innermost frame with
    such a local is the best guess at what failed. The manager's own frame has neither name.
    """
    found = None
    while tb is not None:
        for var in ("node", "n"):
            value = tb.tb_frame.f_locals.get(var)
            if isinstance(value, fx.Node):
                found = value
                break
        tb = tb.tb_next
    return found


def adapt(fn: Callable[..., fx.GraphModule], **options: Any) -> PassFn:
    """``fn(gm, ctx, **options)`` as a pass function, passing also the :class:`PassContext` fields
    ``fn`` takes as keywords (e.g. ``optimizer``, ``dtype`` for the memory pass)."""
    params = inspect.signature(fn).parameters
    option_names = [f.name for f in fields(PassContext) if f.name in params and f.name not in options]

    def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        return fn(gm, ctx, **{k: getattr(ctx, k) for k in option_names}, **options)

    run.__name__ = getattr(fn, "__name__", "pass")
    run.__doc__ = fn.__doc__
    return run


_adapt = adapt  # the name the tests of the manager use
