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
  after each pass plus ``manifest.json`` (see :mod:`ir_dumps.writer`); ``run(..., first_index=k)``
  continues an earlier run's dumps in the same directory from number ``k``.

Two pipelines are built here: :func:`default_analysis_pipeline` (shapes -> FLOPs -> memory) and
:func:`transform_pipeline` (the tag passes of a plan, then the rewrites that keep one graph,
then the analysis again on the rewritten graph). :func:`run_transforms` runs both with one
numbering and dumps the per-stage, tp-rank-0 programs that the rank-program builder makes from
the tagged graph (the TP rewrite and the pipeline split give one graph per rank and stage, so
they are dumps of :func:`runtime.rank_program.build_rank_program`, not passes).
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
from passes.meta import (CAPTURE, CHECKPOINT, CHECKPOINT_PLAN, FLOP_SUMMARY, FLOPS, MEMORY, MEMORY_SUMMARY,
                         OFFLOAD_PLAN, PIPELINE_STAGE, SHAPE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN)

PassFn = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]

# Keys that live in gm.meta; every other key is a node key.
GRAPH_KEYS = frozenset({CAPTURE, FLOP_SUMMARY, MEMORY_SUMMARY, CHECKPOINT_PLAN, OFFLOAD_PLAN,
                        TENSOR_PARALLEL_PLAN})


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
    CHECKPOINT: "checkpoint_policy",
    CHECKPOINT_PLAN: "checkpoint_policy",
    OFFLOAD_PLAN: "offload_policy",
    TENSOR_PARALLEL: "tag_tensor_parallel",
    TENSOR_PARALLEL_PLAN: "tag_tensor_parallel",
    PIPELINE_STAGE: "tag_pipeline_stages",
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

    def run(self, gm: fx.GraphModule, ctx: PassContext | None = None, *, first_index: int = 0) -> fx.GraphModule:
        """Run every pass on ``gm``; returns the final GraphModule. Raises :class:`PassError`.

        ``first_index=0`` starts fresh dumps (``00_input`` first); ``first_index=k > 0`` continues
        the dumps already in the directory: the first pass is dumped as number ``k``, earlier
        files and manifest entries (numbers below ``k``) are kept, later ones replaced.
        """
        from ir_dumps.writer import clear_dumps, write_graph_dumps, write_manifest

        ctx = ctx or PassContext()
        dump_dir = self.dump_dir or ctx.dump_dir
        entries = []
        records: list[PassRecord] = []
        if dump_dir is not None and first_index > 0:
            entries = _earlier_entries(Path(dump_dir), first_index)
        elif dump_dir is not None:
            clear_dumps(dump_dir)
            entries.append(write_graph_dumps(gm, dump_dir, index=0, pass_name="input"))
        offset = first_index - 1 if first_index > 0 else 0
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
                    entries.append(write_graph_dumps(gm, dump_dir, index=offset + i + 1, pass_name=p.name,
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


def _earlier_entries(dump_dir: Path, first_index: int) -> list:
    """Manifest entries numbered below ``first_index``; dump files from ``first_index`` on are
    removed (a shorter continuation must not leave stale files)."""
    import json
    import re

    from ir_dumps.writer import MANIFEST, DumpEntry

    kept = []
    manifest = dump_dir / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text(encoding="utf-8"))
        kept = [DumpEntry.from_json(e) for e in data.get("passes", []) if int(e["index"]) < first_index]
    if dump_dir.is_dir():
        for path in dump_dir.iterdir():
            m = re.match(r"^(\d{2,})_[A-Za-z0-9_.-]+\.(txt|json|dot)$", path.name)
            if m and int(m.group(1)) >= first_index:
                path.unlink()
    return kept


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



# ------------------------------------------------------------------------------ transforms
CHECKPOINTING = ("none", "full", "selective", "solver")
OFFLOADING = ("none", "auto", "all")


@dataclass(frozen=True, kw_only=True)
class TransformOptions:
    """What the plan asks the transform passes to do (see :func:`transform_pipeline`)."""

    checkpointing: str = "none"
    """Checkpoint policy (:data:`passes.checkpoint_policy.POLICIES`); "none" runs no checkpoint pass."""
    budget_bytes: int | None = None
    """Bytes of saved activations the "solver" policy must fit (required by it, ignored otherwise)."""
    offload: str = "none"
    """Activation offload policy of :func:`passes.offload_policy.offload_policy` ("none": no pass)."""
    tp: int = 1
    """Tensor-parallel degree; > 1 adds ``tag_tensor_parallel``."""
    pp: int = 1
    """Pipeline stages; > 1 adds ``tag_pipeline_stages`` (layer-balanced boundaries)."""

    def __post_init__(self) -> None:
        from partitioner.errors import ConfigError

        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError(f"checkpointing={self.checkpointing!r}; use one of {', '.join(CHECKPOINTING)}")
        if self.checkpointing == "solver" and self.budget_bytes is None:
            raise ConfigError("checkpointing='solver' needs budget_bytes (bytes of saved activations)")
        if self.offload not in OFFLOADING:
            raise ConfigError(f"offload={self.offload!r}; use one of {', '.join(OFFLOADING)}")
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


def transform_pipeline(*, checkpointing: str = "none", budget_bytes: int | None = None, offload: str = "none",
                       tp: int = 1, pp: int = 1, reanalyze: bool = True, dump_dir: Path | str | None = None,
                       check: bool = True) -> PassManager:
    """A manager over the transform passes a plan asks for, in this order:

    1. tags (decide, write meta, leave the graph as is): ``tag_tensor_parallel`` (``tp > 1``),
       ``checkpoint_policy``, ``offload_policy``, ``tag_pipeline_stages`` (``pp > 1``);
    2. rewrites that keep one graph: ``apply_checkpoint``, ``apply_offload`` (with both,
       ``offload_policy`` runs between them, on the re-analysed checkpointed graph, and offloads
       what the regions keep: their inputs);
    3. ``reanalyze`` (with ``reanalyze`` and a rewrite): shapes, FLOPs and memory of the rewritten
       graph (a checkpoint call counts its region's recompute, see ``annotate_flops`` and
       ``annotate_memory``).

    The input must carry the analysis facts (run :func:`default_analysis_pipeline` first; the
    requires checks say so otherwise). The TP rewrite and the pipeline split make one graph per
    rank and stage: they are done from the tagged graph by the rank-program builder (see
    :func:`run_transforms`), not here. Raises ``ConfigError`` for an invalid combination.
    """
    opts = TransformOptions(checkpointing=checkpointing, budget_bytes=budget_bytes, offload=offload, tp=tp, pp=pp)
    passes: list[Pass] = []
    if opts.tp > 1:
        passes.append(Pass(name="tag_tensor_parallel", fn=_tag_tensor_parallel(opts.tp), requires=(CAPTURE, SHAPE),
                           provides=(TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN)))
    if opts.checkpointing != "none":
        passes.append(Pass(name="checkpoint_policy", fn=_checkpoint_policy(opts.checkpointing, opts.budget_bytes),
                           requires=(CAPTURE, SHAPE, FLOPS), provides=(CHECKPOINT, CHECKPOINT_PLAN)))
    # With checkpointing, offload is decided on the checkpointed graph (after apply_checkpoint):
    # what a region keeps is its inputs, which its call saves.
    both = opts.checkpointing != "none" and opts.offload != "none"
    offload_tag = Pass(name="offload_policy", fn=_offload_policy(opts.offload),
                       requires=(CAPTURE, SHAPE, FLOPS), provides=(OFFLOAD_PLAN,))
    if opts.offload != "none" and not both:
        passes.append(offload_tag)
    if opts.pp > 1:
        passes.append(Pass(name="tag_pipeline_stages", fn=_tag_pipeline_stages(opts.pp), requires=(CAPTURE, SHAPE),
                           provides=(PIPELINE_STAGE,)))
    rewrites = []
    if opts.checkpointing != "none":
        from passes.apply_checkpoint import apply_checkpoint
        rewrites.append(Pass(name="apply_checkpoint", fn=apply_checkpoint, requires=(CHECKPOINT_PLAN,),
                             provides=(CHECKPOINT_PLAN,)))
    if both:
        rewrites.append(Pass(name="analyze_checkpointed", fn=_reanalyze, requires=(CAPTURE,),
                             provides=(SHAPE, FLOPS, FLOP_SUMMARY, MEMORY, MEMORY_SUMMARY)))
        rewrites.append(offload_tag)
    if opts.offload != "none":
        from passes.apply_offload import apply_offload
        rewrites.append(Pass(name="apply_offload", fn=apply_offload, requires=(OFFLOAD_PLAN,), provides=(OFFLOAD_PLAN,)))
    passes.extend(rewrites)
    if rewrites and reanalyze:
        passes.append(Pass(name="reanalyze", fn=_reanalyze, requires=(CAPTURE,),
                           provides=(SHAPE, FLOPS, FLOP_SUMMARY, MEMORY, MEMORY_SUMMARY)))
    return PassManager(passes, dump_dir=dump_dir, check=check)


def _tag_tensor_parallel(degree: int) -> PassFn:
    def tag_tensor_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        from passes.tensor_parallel_patterns import tag_tensor_parallel as tag
        return tag(gm, degree=degree)
    return tag_tensor_parallel


def _checkpoint_policy(policy: str, budget_bytes: int | None) -> PassFn:
    def checkpoint_policy(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        from passes.checkpoint_policy import checkpoint_policy as decide
        return decide(gm, policy=policy, budget_bytes=budget_bytes)
    return checkpoint_policy


def _offload_policy(policy: str) -> PassFn:
    def offload_policy(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        from passes.offload_policy import offload_policy as decide
        # the optimizer-on-host choice needs a memory summary; without one keep the state on device
        on_host = None if MEMORY_SUMMARY in gm.meta else False
        return decide(gm, policy=policy, optimizer_on_host=on_host)
    return offload_policy


def _tag_pipeline_stages(pp: int) -> PassFn:
    def tag_pipeline_stages(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        from passes.pipeline_split import assign_stages_by_layers, balanced_boundaries, find_layers
        from passes.pipeline_split import tag_pipeline_stages as tag
        boundaries = balanced_boundaries(len(find_layers(gm)), pp)
        return tag(gm, assign_stages_by_layers(gm, boundaries))
    return tag_pipeline_stages


def _reanalyze(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The analysis passes again, on a rewritten graph (its new nodes have no facts yet)."""
    for p in default_analysis_pipeline(check=False):
        gm = p.fn(gm, ctx)
    return gm


def run_transforms(gm: fx.GraphModule, ctx: PassContext | None = None, *, dump_dir: Path | str | None = None,
                   stage_programs: bool = True, **options) -> fx.GraphModule:
    """Analysis, then :func:`transform_pipeline` (``options`` are its keywords), numbered as one
    run of dumps in ``dump_dir``; returns the transformed graph (``gm`` is edited in place).

    With ``stage_programs`` and ``tp > 1`` or ``pp > 1``, also dumps the program of every
    pipeline stage on tp rank 0 (dp 1) as ``NN_stage<s>_tp0.{txt,json,dot}``, numbered after the
    last pass, built by :func:`runtime.rank_program.build_rank_program` from the analysed graph
    (the TP rewrite and the split per stage, then that stage's checkpoint / offload rewrite).
    """
    import copy

    ctx = ctx or PassContext()
    dump_dir = dump_dir if dump_dir is not None else ctx.dump_dir
    analysis = default_analysis_pipeline(dump_dir=dump_dir)
    gm = analysis.run(gm, ctx)
    tp, pp = options.get("tp", 1), options.get("pp", 1)
    analysed = copy.deepcopy(gm) if dump_dir is not None and stage_programs and (tp > 1 or pp > 1) else None
    transforms = transform_pipeline(dump_dir=dump_dir, **options)
    gm = transforms.run(gm, ctx, first_index=len(analysis) + 1)
    if analysed is not None:
        dump_stage_programs(analysed, dump_dir, first_index=len(analysis) + len(transforms) + 1,
                            checkpointing=options.get("checkpointing", "none"),
                            offload=options.get("offload", "none"), tp=tp, pp=pp)
    return gm


def dump_stage_programs(gm: fx.GraphModule, dump_dir: Path | str, *, first_index: int, checkpointing: str = "none",
                        offload: str = "none", tp: int = 1, pp: int = 1, tp_rank: int = 0) -> list[Path]:
    """Dump the program of each pipeline stage on tp rank ``tp_rank`` (dp 1) as
    ``NN_stage<s>_tp<r>.{txt,json,dot}`` from ``first_index`` on, and add them to the manifest;
    returns the text files. ``gm`` is the analysed, untransformed graph (not changed)."""
    from ir_dumps.writer import write_graph_dumps, write_manifest
    from partitioner.errors import ConfigError
    from runtime.rank_program import build_rank_program, global_rank

    offload_mode = {"none": "none", "all": "activations", "auto": "auto"}[offload]
    if checkpointing == "solver":
        raise ConfigError("stage programs: the rank-program builder takes checkpointing none/full/selective, "
                          "not 'solver'; dump them with one of those or pass stage_programs=False")
    dump_dir = Path(dump_dir)
    entries = _earlier_entries(dump_dir, first_index)
    files = []
    for stage in range(pp):
        start = time.perf_counter()
        program = build_rank_program(gm, dp=1, tp=tp, pp=pp, rank=global_rank(stage, 0, tp_rank, dp=1, tp=tp),
                                     checkpointing=checkpointing, offload=offload_mode)
        name = f"stage{stage}_tp{tp_rank}"
        module = program.modules[stage]
        # the text dump prints graph facts as dataclasses; the stage number is in the file name
        stage_tag = module.meta.pop(PIPELINE_STAGE, None)
        try:
            entries.append(write_graph_dumps(module, dump_dir, index=first_index + stage, pass_name=name,
                                             seconds=time.perf_counter() - start))
        finally:
            if stage_tag is not None:
                module.meta[PIPELINE_STAGE] = stage_tag
        files.append(dump_dir / entries[-1].file("txt"))
    info = gm.meta.get(CAPTURE)
    write_manifest(dump_dir, entries, model=getattr(info, "model", ""))
    return files
