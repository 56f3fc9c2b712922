"""Front end: capture one training step of an ``nn.Module`` into a ``torch.fx.GraphModule``.

We use ``torch.export.export(strict=False)``: it handles Hugging Face models (which plain
``symbolic_trace`` cannot), keeps dims symbolic, and gives ATen-level nodes whose autograd
behaviour is exactly eager's. The exported program is then made into a plain GraphModule:

* the loss wrapper's ``model.`` prefix is removed, so parameters keep the user's names;
* placeholders are named after the :class:`InputSpec` names and called positionally;
* export's guard call is dropped (capture records the dims itself) and device arguments
  baked in from a ``meta``-device model are pointed at the device the program will run on.

``gm.meta[CAPTURE]`` records the inputs, named dims and which of them stay symbolic.
"""
from __future__ import annotations

import linecache
import logging
import os
import re
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.fx import config as fx_config

from passes.capture.input_bounds import input_bounds
from passes.ir.errors import CaptureError
from passes.ir.meta import CAPTURE, CAPTURE_WRAPPER, EXPORT_MODULE_STACK, CaptureInfo, InputSpec, module_path  # noqa: F401

_WRAPPER_ATTR = CAPTURE_WRAPPER  # the loss wrapper's attribute holding the user's model
_TORCH_DIR = os.path.dirname(torch.__file__)
_EXPORT_ATTEMPTS = 3  # the first export, then up to two with export's suggested dim ranges applied


class _TrainingStep(nn.Module):
    """``forward(*inputs) = loss(model, *inputs)``, or the model's forward when no loss is given."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor] | None):
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self._loss is None:
            return self.model(*inputs)
        return self._loss(self.model, *inputs)


def capture_model(
    module: nn.Module,
    *,
    inputs: Sequence[InputSpec],
    dims: dict[str, int],
    loss: Callable[..., torch.Tensor] | None = None,
    symbolic: Iterable[str] = (),
    name: str | None = None,
    device: str | None = None,
) -> fx.GraphModule:
    """Capture ``loss(module, *inputs)`` (or ``module(*inputs)``) as a GraphModule.

    ``dims`` gives every named dim a value: for dims listed in ``symbolic`` it is only the
    example (hint) and must be at least 2; the others are fixed to it. ``device`` is where the
    program will run (default: the module's device, or ``cpu`` for a ``meta`` module).
    Raises :class:`CaptureError` naming the module path, the source line and a fix.
    """
    symbolic = tuple(sorted(set(symbolic)))
    _check_dims(inputs, dims, symbolic)
    model_device = _module_device(module)
    run_device = device or ("cpu" if model_device.type == "meta" else model_device.type)
    dtype = _float_dtype(module)
    example = tuple(_example(spec, dims, model_device) for spec in inputs)
    dynamic = _dynamic_shapes(inputs, symbolic)

    wrapper = _TrainingStep(module, loss)
    exported = None
    for attempt in range(_EXPORT_ATTEMPTS):
        with _module_path_tracker(wrapper) as current_path:
            try:
                with _quiet_shape_logs(), _without_stack_traces():
                    exported = torch.export.export(wrapper, example, dynamic_shapes=dynamic, strict=False)
                break
            except Exception as exc:  # noqa: BLE001 - every failure becomes one readable error
                refined = _refine_ranges(exc, dynamic) if attempt + 1 < _EXPORT_ATTEMPTS else None
                if refined is None:
                    raise _capture_error(exc, current_path(), type(module).__name__) from exc
                dynamic = refined  # e.g. seq <= max positions: still symbolic, so export again
    assert exported is not None

    gm = exported.module()
    _to_plain_graph_module(gm, inputs, run_device)
    gm.meta[CAPTURE] = CaptureInfo(
        model=name or type(module).__name__,
        inputs=tuple(inputs),
        dims=tuple(sorted(dims.items())),
        symbolic=symbolic,
        device=run_device,
        dtype=dtype,
        tied=_tied_names(module),
        bounds=input_bounds(gm, inputs, dims=dims, symbolic=symbolic),
    )
    global _CAPTURES
    _CAPTURES += 1
    return gm


_CAPTURES = 0


def capture_count() -> int:
    """How many captures this process has made (``auto_parallelize`` captures on rank 0 only)."""
    return _CAPTURES


def _tied_names(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Every parameter the module lists under several names, as its names (the first is the one
    ``named_parameters()`` gives, the canonical name)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(ns) for ns in names.values() if len(ns) > 1)


def capture_spec(spec, *, dims: dict[str, int] | None = None, symbolic: Iterable[str] = (),
                 device: str | None = None) -> fx.GraphModule:
    """Capture a :class:`partitioner.inputs.model_spec.ModelSpec` (its loss included)."""
    all_dims = {**spec.dims, **(dims or {})}
    return capture_model(spec.module, inputs=spec.inputs, dims=all_dims, loss=spec.loss,
                         symbolic=symbolic, name=spec.name, device=device)


# ---------------------------------------------------------------------------------------------
def _check_dims(inputs: Sequence[InputSpec], dims: dict[str, int], symbolic: tuple[str, ...]) -> None:
    names = {d for spec in inputs for d in spec.dim_names()}
    missing = sorted(names - dims.keys())
    if missing:
        raise CaptureError(f"no value for dim(s) {missing}; give each named dim a value, e.g. dims={{'batch': 2}}")
    unknown = sorted(set(symbolic) - names)
    if unknown:
        raise CaptureError(f"symbolic dim(s) {unknown} appear in no input (inputs use {sorted(names)})")
    for d in symbolic:
        if dims[d] < 2:
            raise CaptureError(f"symbolic dim {d!r} has example value {dims[d]}; use 2 or more "
                               f"(export specializes sizes 0 and 1)")


def _module_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _float_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def _example(spec: InputSpec, dims: dict[str, int], device: torch.device) -> torch.Tensor:
    shape = [dims[d] if isinstance(d, str) else d for d in spec.shape]
    if spec.dtype.is_floating_point:
        return torch.zeros(shape, dtype=spec.dtype, device=device)
    return torch.zeros(shape, dtype=spec.dtype, device=device)


def _dynamic_shapes(inputs: Sequence[InputSpec], symbolic: tuple[str, ...]):
    if not symbolic:
        return None
    from torch.export import Dim

    dim_objs = {d: Dim(d, min=2) for d in symbolic}
    per_input = []
    for spec in inputs:
        per_input.append({i: dim_objs[d] for i, d in enumerate(spec.shape) if isinstance(d, str) and d in dim_objs}
                         or None)
    return {"inputs": tuple(per_input)}  # matches _TrainingStep.forward(*inputs)


def _refine_ranges(exc: Exception, dynamic):
    """Dynamic shapes with export's suggested *range* fixes applied, or None.

    A model may bound a symbolic dim (HF BERT slices a position buffer, so ``seq <= 64``); export
    then rejects ``Dim(min=2)`` although the dim stays symbolic. We accept fixes that only bound a
    dim, never ones that fix it to a number or tie it to another dim (those change what the
    caller asked for, so they are reported as errors).
    """
    msg = str(exc)
    if dynamic is None or "Suggested fixes:" not in msg:
        return None
    fixes = [line.strip() for line in msg.split("Suggested fixes:", 1)[1].splitlines() if line.strip()]
    fixes = [f for f in fixes if not f.startswith("The error above")]
    if not fixes or not all(re.fullmatch(r"(\w+) = Dim\('\1'(, (min|max)=\d+)+\)", f) for f in fixes):
        return None
    for f in fixes:  # a range of one value is a specialization in disguise
        bounds = dict(re.findall(r"(min|max)=(\d+)", f))
        if bounds.get("min") is not None and bounds.get("min") == bounds.get("max"):
            return None
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    return refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + "\n".join(fixes), dynamic)


def _strip_wrapper_prefix(path: str) -> str:
    prefix = _WRAPPER_ATTR + "."
    if path == _WRAPPER_ATTR:
        return ""
    return path[len(prefix):] if path.startswith(prefix) else path


def _to_plain_graph_module(gm: fx.GraphModule, inputs: Sequence[InputSpec], run_device: str) -> None:
    """Rewrite export's unlifted module into a plain, positionally called GraphModule in place."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()  # plain positional signature, no pytree flattening
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")

    # Hoist the wrapped model's children and tensors to the root so names are the user's.
    inner = getattr(gm, _WRAPPER_ATTR, None)
    if isinstance(inner, nn.Module):
        delattr(gm, _WRAPPER_ATTR)
        for child_name, child in inner.named_children():
            gm.add_module(child_name, child)
        for pname, p in inner._parameters.items():
            if p is not None:
                gm.register_parameter(pname, p)
        for bname, b in inner._buffers.items():
            if b is not None:
                gm.register_buffer(bname, b)
        for node in graph.nodes:
            if node.op == "get_attr":
                node.target = _strip_wrapper_prefix(node.target)
                new_name = node.target.replace(".", "_")
                if node.name != new_name:
                    node._rename(new_name)

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise CaptureError(f"captured graph has {len(placeholders)} inputs but {len(inputs)} were declared; "
                           f"inputs that the model never reads must be removed from its InputSpecs")
    for node, spec in zip(placeholders, inputs):
        node.target = spec.name
        node._rename(spec.name)

    # export returns a flat tuple; a step with one result (the loss) returns it bare.
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    if isinstance(results, (tuple, list)) and len(results) == 1:
        output.args = (results[0],)

    meta_device = torch.device("meta")
    for node in graph.nodes:
        if node.kwargs.get("device") == meta_device:
            node.kwargs = {**node.kwargs, "device": torch.device(run_device)}
        if any(a == meta_device for a in node.args if isinstance(a, torch.device)):  # aten.to.device(x, meta, ...)
            node.args = tuple(torch.device(run_device) if a == meta_device else a for a in node.args)
    if run_device == "cpu":
        _count_integer_histc_in_float(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _count_integer_histc_in_float(graph: fx.Graph) -> None:
    """``aten.histc`` of an integer tensor: CUDA counts it, the CPU kernel refuses it. Mixture-of-
    experts layers (transformers' grouped experts) count tokens per expert with the integer form on
    any device but cpu, so a model built on the meta device (the planner's profile) captures it.
    On cpu the count runs on a float32 copy and comes back in the input's dtype, as transformers
    does on cpu: the same counts. The rewritten nodes carry no export value (the shape analysis
    runs them itself)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.histc.default:
            continue
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if val is None or val.dtype.is_floating_point:
            continue
        with graph.inserting_before(node):
            as_float = graph.call_function(torch.ops.aten._to_copy.default, (source,), {"dtype": torch.float32})
        node.args = (as_float, *node.args[1:])
        node.meta.pop("val", None)
        with graph.inserting_after(node):
            back = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": val.dtype})
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


@contextmanager
def _quiet_shape_logs() -> Iterator[None]:
    """Silence torch's shape-env warnings (they print whole graphs); CaptureError says it shorter."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def _without_stack_traces() -> Iterator[None]:
    """Export without a Python stack trace on every node (``node.meta["stack_trace"]``): nothing
    here reads them (a CaptureError names the source line from the exception itself), and taking
    one per node is about a fifth of a capture's CPU."""
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


@contextmanager
def _module_path_tracker(root: nn.Module) -> Iterator[Callable[[], str]]:
    """Track the module whose forward is running, so a failure can name its path."""
    names = {id(m): _strip_wrapper_prefix(n) for n, m in root.named_modules()}
    stack: list[str] = []

    def pre(mod, args):
        stack.append(names.get(id(mod), type(mod).__name__))

    def post(mod, args, out):
        if stack:
            stack.pop()

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    failed_at: list[str] = []

    def current() -> str:
        return failed_at[0] if failed_at else (stack[-1] if stack else "")

    try:
        yield current
    finally:
        if stack:
            failed_at.append(stack[-1])
        h1.remove()
        h2.remove()


_FIXES = [
    ("data-dependent", "the model branches on a tensor's value; compute the branch from shapes or "
                       "constants, or use torch.cond"),
    ("GuardOnDataDependent", "the model branches on a tensor's value; compute the branch from shapes or "
                             "constants, or use torch.cond"),
    (".item()", "the model reads a tensor's value with .item(); keep it a tensor or make it a constant"),
    ("Constraints violated", "a dim marked symbolic was fixed to one value by the model; drop it from "
                             "symbolic=(...) or write its size as a number in the InputSpec"),
    ("specialized", "a dim marked symbolic was fixed to one value by the model; drop it from "
                    "symbolic=(...) or write its size as a number in the InputSpec"),
    ("DynamicCache", "the model returns a key/value cache; build it with use_cache=False"),
]


def _capture_error(exc: Exception, path: str, model_name: str) -> CaptureError:
    text = f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0][:300].split(" For more information")[0].rstrip(".")
    where = _user_frame(exc)
    fix = next((f for key, f in _FIXES if key in text),
               "make this code traceable by torch.export (no Python control flow on tensor values, "
               "no unsupported ops), or wrap it in a leaf module")
    loc = f" at {where}" if where else ""
    module = f"module {path!r}" if path else f"model {model_name}"
    return CaptureError(f"cannot capture {module}{loc}: {first}{_constraint_details(text)}. Fix: {fix}.")


def _constraint_details(text: str) -> str:
    """Export's explanation of a dim constraint failure: its '- ...' lines and suggested fixes."""
    if "Constraints violated" not in text:
        return ""
    head, _, fixes = text.partition("Suggested fixes:")
    # Keep the first sentence of each reason; the rest is advice about torch's own APIs.
    reasons = [line.strip()[2:].split(". ")[0] for line in head.splitlines() if line.strip().startswith("- ")]
    suggested = [f.strip() for f in fixes.split("\n\n")[0].splitlines() if f.strip()]
    out = "".join(f"; {r}" for r in reasons[:3])
    if suggested:
        out += f" (export suggests: {'; '.join(suggested[:3])})"
    return out


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and this file: 'file:line (`source`)'."""
    best = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        fname = frame.filename
        if fname.startswith(_TORCH_DIR) or fname == __file__ or "importlib" in fname:
            continue
        line = (frame.line or linecache.getline(fname, frame.lineno)).strip()
        best = f"{fname}:{frame.lineno}" + (f" (`{line}`)" if line else "")
    if not best and exc.__cause__ is not None:
        return _user_frame(exc.__cause__)
    return best


if sys.version_info < (3, 11):  # pragma: no cover
    raise RuntimeError("Python 3.11 or newer is required")
