"""Run a captured graph on fake tensors, with each named dim a symbol.

Analysis passes use this instead of real data: no weights are allocated (a 175B-parameter graph
runs in seconds), sizes come out as sympy expressions in the named dims, and autograd behaves as
it would on the real device, so what it saves for backward is what eager training saves.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.nn.utils.stateless import _reparametrize_module

from passes.ir.errors import AnalysisError
from passes.ir.meta import CAPTURE, CaptureInfo, dim_symbol


@dataclass
class FakeContext:
    """A fake-tensor mode whose shape environment knows the graph's named dims."""

    mode: FakeTensorMode
    dim_values: dict[str, Any]  # name -> SymInt (symbolic) or int (concrete)
    rename: dict[sympy.Symbol, sympy.Symbol]  # shape-env symbol -> dim symbol

    def to_sympy(self, value: Any) -> sympy.Expr:
        """An int or SymInt as a sympy expression in the named dims."""
        if isinstance(value, torch.SymInt):
            return sympy.expand(value.node.expr.xreplace(self.rename))
        return sympy.Integer(int(value))

    def dim_size(self, dim: int | str) -> Any:
        """A shape entry as a size: an int, a named dim, or an expression of named dims such as
        ``"batch*seq"`` (a stage input that flattens batch and sequence)."""
        if not isinstance(dim, str):
            return dim
        if dim in self.dim_values:
            return self.dim_values[dim]
        expr = sympy.sympify(dim, locals={name: dim_symbol(name) for name in self.dim_values})
        unknown = {str(s) for s in expr.free_symbols} - self.dim_values.keys()
        if unknown:
            raise AnalysisError(f"input size {dim!r} uses unknown dim(s) {sorted(unknown)}; "
                                f"known dims: {sorted(self.dim_values)}")
        return _evaluate(expr, self.dim_values)

    def shape(self, t: torch.Tensor) -> tuple[sympy.Expr, ...]:
        return tuple(self.to_sympy(d) for d in t.shape)

    @property
    def symbolic(self) -> bool:
        """Whether any named dim is a symbol (else every size is an int)."""
        return bool(self.rename)


def _evaluate(expr: sympy.Expr, values: dict[str, Any]) -> Any:
    """``expr`` (integer arithmetic in named dims) with each dim replaced by its int or SymInt."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return values[str(expr)]
    args = [_evaluate(a, values) for a in expr.args]
    if expr.is_Mul:
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if expr.is_Add:
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if isinstance(expr, sympy.floor) and expr.args[0].is_Mul:  # floor(seq/2) -> seq // 2
        num, den = sympy.fraction(expr.args[0])
        return _evaluate(num, values) // _evaluate(den, values)
    if expr.is_Pow and expr.exp.is_Integer and expr.exp > 0:
        return args[0] ** int(expr.exp)
    raise AnalysisError(f"cannot evaluate input size {expr} (only +, *, integer powers and floor division)")


def fake_context(info: CaptureInfo) -> FakeContext:
    """A fresh fake mode with one symbol per symbolic dim of ``info`` (the others concrete)."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    values: dict[str, Any] = {}
    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    for name, hint in info.dims:
        if name in info.symbolic:
            sym = env.create_symbol(hint, source=ConstantSource(f"dim_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
            values[name] = env.create_symintnode(sym, hint=hint)
            rename[sym] = dim_symbol(name)
        else:
            values[name] = hint
    return FakeContext(mode=mode, dim_values=values, rename=rename)


def fake_inputs(ctx: FakeContext, info: CaptureInfo) -> list[torch.Tensor]:
    """One fake tensor per graph input, on the graph's device."""
    with ctx.mode:
        return [torch.empty([ctx.dim_size(d) for d in spec.shape], dtype=spec.dtype, device=info.device)
                for spec in info.inputs]


def fake_attrs(ctx: FakeContext, gm: fx.GraphModule, device: str, *, requires_grad: bool) -> dict[str, torch.Tensor]:
    """Fake stand-ins for every parameter and buffer, keyed by ``get_attr`` target.

    Tied parameters (one tensor under two names) get one shared fake, so autograd sees the tie.
    """
    by_id: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    with ctx.mode:
        for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
            if id(t) not in by_id:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                if isinstance(t, torch.nn.Parameter):
                    fake = torch.nn.Parameter(fake, requires_grad=requires_grad and t.requires_grad)
                by_id[id(t)] = fake
            out[name] = by_id[id(t)]
    return out


class FakeInterpreter(fx.Interpreter):
    """Runs a graph on fake tensors; ``on_node(node, value)`` sees every node's result."""

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, torch.Tensor],
                 on_node: Callable[[fx.Node, Any], None] | None = None, *, symbolic: bool = True):
        super().__init__(gm, garbage_collect_values=False)
        self.attrs = attrs
        self.on_node = on_node
        self.symbolic = symbolic
        self.current: fx.Node | None = None

    def run(self, *args: Any, **kwargs: Any) -> Any:
        # Composite ops (aten.pad, ...) read sizes as plain ints in C++ and would specialize the
        # named dims; with symbolic dims the Python dispatcher runs their SymInt decompositions,
        # as torch.export does. With every size concrete (a rank program at its micro-batch) the
        # C++ kernels run, as in eager, and several times faster.
        # Parameters of submodules (checkpointed regions, stage modules) are swapped for their fakes
        # too; get_attr of a plain tensor is answered from ``attrs`` directly.
        dispatcher = enable_python_dispatcher() if self.symbolic else contextlib.nullcontext()
        with dispatcher, _reparametrize_module(self.module, self.attrs):
            return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        try:
            result = super().run_node(n)
        except AnalysisError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise AnalysisError(f"cannot run node {n.name!r} ({n.format_node()}) on fake tensors: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if self.on_node is not None:
            self.on_node(n, result)
        return result

    def get_attr(self, target, args, kwargs):
        if target in self.attrs:
            return self.attrs[target]
        return super().get_attr(target, args, kwargs)


def capture_info(gm: fx.GraphModule) -> CaptureInfo:
    info = gm.meta.get(CAPTURE)
    if info is None:
        raise AnalysisError("graph has no capture info (gm.meta['capture']); capture it with "
                            "passes.capture.capture.capture_model first")
    return info
