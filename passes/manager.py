"""Pass manager: run graph passes in order, check what each needs and promises, dump after each.

A :class:`Pass` is a named function ``fn(gm, ctx) -> gm`` with the meta keys it ``requires``
before it runs and ``provides`` after. :class:`PassManager` runs a list of them and

* before each pass checks its ``requires`` (a missing key raises :class:`PassError` naming the
  pass that should have provided it);
* after each pass (``check=True``) runs ``gm.graph.lint()`` and checks ``provides``: a graph key
  must be in ``gm.meta``, a node key on every node that should carry it (see
  :data:`NODE_KEY_COVERAGE`);
* wraps any exception raised inside a pass in :class:`PassError` with the pass name, the node
  being processed when known, and the passes that already ran;
* times each pass (wall seconds) and, with a dump directory, writes ``NN_<pass>.{txt,json,dot}``
  after each pass plus ``manifest.json`` (see :mod:`ir_dumps.writer`).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterator, Sequence

from torch import fx

from partitioner.errors import PassError
from passes.meta import CAPTURE, FLOP_SUMMARY, FLOPS, MEMORY, MEMORY_SUMMARY, SHAPE

PassFn = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]

# Keys that live in gm.meta; every other key is a node key.
GRAPH_KEYS = frozenset({CAPTURE, FLOP_SUMMARY, MEMORY_SUMMARY})


def _not_output(node: fx.Node) -> bool:
    return node.op != "output"


def _computes(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


# Which nodes must carry a node key once a pass provides it. Shapes and memory describe every
# value (inputs and parameters included); FLOPs only make sense for nodes that compute. The
# output node produces no value of its own, so it never has to carry a key.
NODE_KEY_COVERAGE: dict[str, Callable[[fx.Node], bool]] = {
    SHAPE: _not_output,
    FLOPS: _computes,
    MEMORY: _not_output,
}

# The pass (or function) that normally writes each key, for error messages.
KNOWN_PROVIDERS: dict[str, str] = {
    CAPTURE: "passes.capture.capture_model",
    SHAPE: "annotate_shapes",
    FLOPS: "annotate_flops",
    FLOP_SUMMARY: "annotate_flops",
    MEMORY: "annotate_memory",
    MEMORY_SUMMARY: "annotate_memory",
}


@dataclass(frozen=True, kw_only=True)
class PassContext:
    """Options every pass may read; passed as the second argument of each pass function."""

    optimizer: str = "adamw"
    """Optimizer whose state the memory pass counts ("adamw", "adam", "sgd", ...)."""
    mixed_precision: bool = False
    """Whether training keeps low-precision weights plus fp32 master copies."""
    dump_dir: Path | None = None
    """Where to write IR dumps after each pass (None: no dumps unless the manager has one)."""


@dataclass(frozen=True, kw_only=True)
class Pass:
    """A graph pass: ``fn(gm, ctx)`` returns the (possibly new) GraphModule.

    ``requires``: meta keys that must exist before it runs; ``provides``: keys it guarantees
    after. Graph keys (:data:`GRAPH_KEYS`) refer to ``gm.meta``, the others to ``node.meta``.
    """

    name: str
    fn: PassFn
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PassRecord:
    """What one pass run did: its wall time (seconds) and the node count after it."""

    name: str
    seconds: float
    nodes: int


class PassManager:
    """Runs passes in order with checks and optional dumps; see the module docstring.

    ``dump_dir`` (or ``ctx.dump_dir``) enables dumps; ``check=False`` skips the lint and
    ``provides`` checks after each pass (``requires`` is always checked: it is cheap and turns a
    confusing failure inside a pass into a message naming the missing pass).
    """

    def __init__(self, passes: Sequence[Pass], *, dump_dir: Path | str | None = None, check: bool = True):
        passes = list(passes)
        for p in passes:
            if not isinstance(p, Pass):
                raise TypeError(f"PassManager takes Pass objects, got {type(p).__name__}; wrap functions "
                                f"as Pass(name=..., fn=...)")
        names = [p.name for p in passes]
        self.passes: tuple[Pass, ...] = tuple(passes)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.check = check
        self.records: tuple[PassRecord, ...] = ()  # of the latest run
        self._names = names

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def __getitem__(self, index: int) -> Pass:
        return self.passes[index]

    def run(self, gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
        """Run every pass on ``gm``; returns the final GraphModule. Raises :class:`PassError`."""
        from ir_dumps.writer import clear_dumps, write_graph_dumps, write_manifest

        ctx = ctx or PassContext()
        dump_dir = self.dump_dir or ctx.dump_dir
        entries = []
        records: list[PassRecord] = []
        if dump_dir is not None:
            clear_dumps(dump_dir)
            entries.append(write_graph_dumps(gm, dump_dir, index=0, pass_name="input"))
        try:
            for i, p in enumerate(self.passes):
                done = [r.name for r in records]
                self._check_requires(gm, p, i)
                start = time.perf_counter()
                try:
                    result = p.fn(gm, ctx)
                except Exception as exc:  # noqa: BLE001 - every failure gets the pass's context
                    raise _wrap(exc, p.name, done, dump_dir) from exc
                seconds = time.perf_counter() - start
                if not isinstance(result, fx.GraphModule):
                    raise PassError(f"pass {p.name!r} returned {type(result).__name__}, not a GraphModule; "
                                    f"a pass must return the graph module (return gm at its end). "
                                    f"{_ran(done)}")
                gm = result
                if self.check:
                    self._check_after(gm, p, done)
                records.append(PassRecord(name=p.name, seconds=seconds, nodes=len(gm.graph.nodes)))
                if dump_dir is not None:
                    entries.append(write_graph_dumps(gm, dump_dir, index=i + 1, pass_name=p.name,
                                                     seconds=seconds))
        finally:
            self.records = tuple(records)
            if dump_dir is not None:
                info = gm.meta.get(CAPTURE)
                write_manifest(dump_dir, entries, model=getattr(info, "model", ""))
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
    should = NODE_KEY_COVERAGE.get(key, _not_output)
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


def _wrap(exc: Exception, name: str, done: list[str], dump_dir: Path | None) -> PassError:
    node = _node_in_traceback(exc.__traceback__)
    # AnalysisError messages name their node already; repeating it would only add noise.
    at = f" at node {node.name!r} ({node.format_node()})" if node is not None and f"'{node.name}'" not in str(exc) else ""
    dumps = f" Dumps of the passes before it are in {dump_dir}." if dump_dir is not None and done else ""
    err = PassError(f"pass {name!r} failed{at}: {type(exc).__name__}: {_first_line(exc)}. {_ran(done)}{dumps}")
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


# ------------------------------------------------------------------------------------ pipeline
def _adapt(fn: Callable[..., fx.GraphModule]) -> PassFn:
    """Call ``fn(gm, ctx, **options)`` passing the PassContext fields ``fn`` takes as keywords
    (e.g. ``optimizer``, ``mixed_precision`` for the memory pass)."""
    params = inspect.signature(fn).parameters
    option_names = [f.name for f in fields(PassContext) if f.name in params and f.name != "dump_dir"]

    def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        return fn(gm, ctx, **{k: getattr(ctx, k) for k in option_names})

    run.__name__ = getattr(fn, "__name__", "pass")
    run.__doc__ = fn.__doc__
    return run


def default_analysis_pipeline(*, dump_dir: Path | str | None = None, check: bool = True) -> PassManager:
    """A manager over the analysis passes in order: shapes, then FLOPs, then memory.

    The result iterates over its :class:`Pass` objects, so ``list(default_analysis_pipeline())``
    is the pass list and ``default_analysis_pipeline(dump_dir=d).run(gm, ctx)`` runs them.
    The FLOP and memory passes are imported here (not at module import) so that importing the
    manager stays cheap and a checkout without them still runs the shape analysis.
    """
    from passes.annotate_shapes import annotate_shapes

    pipeline = [Pass(name="annotate_shapes", fn=annotate_shapes, requires=(CAPTURE,), provides=(SHAPE,))]
    try:
        from passes.annotate_flops import annotate_flops
    except ModuleNotFoundError as exc:
        if exc.name != "passes.annotate_flops":
            raise
    else:
        pipeline.append(Pass(name="annotate_flops", fn=_adapt(annotate_flops), requires=(CAPTURE, SHAPE),
                             provides=(FLOPS, FLOP_SUMMARY)))
    try:
        from passes.annotate_memory import annotate_memory
    except ModuleNotFoundError as exc:
        if exc.name != "passes.annotate_memory":
            raise
    else:
        pipeline.append(Pass(name="annotate_memory", fn=_adapt(annotate_memory), requires=(CAPTURE, SHAPE),
                             provides=(MEMORY, MEMORY_SUMMARY)))
    return PassManager(pipeline, dump_dir=dump_dir, check=check)


def run_analysis(gm: fx.GraphModule, ctx: PassContext | None = None, *,
                 dump_dir: Path | str | None = None) -> fx.GraphModule:
    """Run :func:`default_analysis_pipeline` on ``gm`` with checks on; returns ``gm``."""
    return default_analysis_pipeline(dump_dir=dump_dir).run(gm, ctx)

