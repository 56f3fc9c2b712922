"""``partitioner analyze``: capture a model, run the analysis passes, and sum up what they found.

Sizes are sympy expressions: integers when batch and sequence are numbers, polynomials in the
names the user gave (``--batch B --seq S``) otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sympy
from torch import fx

from passes.ir.config import TORCH_DTYPES
from passes.ir.optimizers import optimizer_model
from passes.ir.errors import ConfigError
from partitioner.inputs.model_spec import ModelSpec
from partitioner.inputs.models import as_spec, build_model
from passes.capture.capture import module_path
from passes.ir.meta import (
    BLOCK,
    FLOP_SUMMARY,
    FLOPS,
    MEMORY,
    MEMORY_SUMMARY,
    SHAPE,
    dim_symbol,
)
from ir_dumps.writer import DumpWriter
from partitioner.compile.build import run_analysis_passes, capture_training_step

DTYPES = TORCH_DTYPES  # the training dtypes, by name (passes.ir.config)


@dataclass(frozen=True, kw_only=True)
class LayerStats:
    """Totals of one top-level layer (``blocks.3``, ``lm_head``, ...)."""
    name: str
    param_bytes: sympy.Expr
    fwd_flops: sympy.Expr
    activation_bytes: sympy.Expr


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """What the analysis passes found for one training step (bytes, FLOPs)."""
    model: str
    dims: dict[str, int | str]
    dtype: str
    optimizer: str
    param_count: sympy.Expr
    param_bytes: sympy.Expr
    grad_bytes: sympy.Expr
    optimizer_bytes: sympy.Expr
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    activation_bytes: sympy.Expr
    peak_bytes: sympy.Expr
    peak_phase: str
    layers: tuple[LayerStats, ...]
    graph: fx.GraphModule

    def to_json(self) -> dict:
        """The documented JSON keys; integers when concrete, sympy strings when symbolic."""
        keys = ("param_count", "param_bytes", "grad_bytes", "optimizer_bytes", "fwd_flops", "bwd_flops",
                "activation_bytes", "peak_bytes")
        out: dict = {"model": self.model, "dims": self.dims, "dtype": self.dtype, "optimizer": self.optimizer}
        out.update({k: json_number(getattr(self, k)) for k in keys})
        out["peak_phase"] = self.peak_phase
        out["layers"] = [{"name": layer.name, "param_bytes": json_number(layer.param_bytes),
                          "fwd_flops": json_number(layer.fwd_flops),
                          "activation_bytes": json_number(layer.activation_bytes)} for layer in self.layers]
        return out


def json_number(expr: sympy.Expr) -> int | str:
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else str(expr)


def analyze(model: ModelSpec | str, *, batch: int | str | None = None, seq: int | str | None = None,
            dtype: str = "fp32", optimizer: str = "adamw", dump_dir: str | Path | None = None) -> Analysis:
    """Capture ``model`` and analyze it: a spec string (a zoo spec built on the meta device, or
    ``path/to/file.py:factory``) or a ModelSpec (a module of your own with its inputs and loss),
    read as :func:`partitioner.inputs.models.as_spec` does.

    ``batch``/``seq``: a number fixes the dim; a name keeps it symbolic under that name.
    ``dtype``: fp32, or bf16/fp16 meaning mixed precision with fp32 master weights.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    optimizer_model(optimizer)  # refused here, before the capture, naming the choices
    if isinstance(model, str) and not model.partition(":")[0].strip().endswith(".py"):
        spec = build_model(model, device="meta", dtype=DTYPES[dtype])
    else:
        spec = as_spec(model, device="meta")
    dims, symbolic, rename = _resolve_dims(spec, {"batch": batch, "seq": seq})
    gm = capture_training_step(spec, dims=dims, symbolic=symbolic)

    writer = DumpWriter(dump_dir, model=spec.name) if dump_dir else None
    gm = run_analysis_passes(gm, optimizer=optimizer, dtype=dtype, writer=writer)

    def named(expr) -> sympy.Expr:
        return sympy.expand(sympy.sympify(expr).xreplace(rename))

    mem = gm.meta[MEMORY_SUMMARY]
    flops = gm.meta[FLOP_SUMMARY]
    return Analysis(
        model=spec.name, dims={k: (v if k not in symbolic else _user_name(k, rename)) for k, v in dims.items()},
        dtype=dtype, optimizer=optimizer,
        param_count=mem.param_count, param_bytes=mem.param_bytes, grad_bytes=mem.grad_bytes,
        optimizer_bytes=mem.optimizer_bytes, fwd_flops=named(flops.fwd), bwd_flops=named(flops.bwd),
        activation_bytes=named(mem.activation_bytes), peak_bytes=named(mem.peak_bytes), peak_phase=mem.peak_phase,
        layers=tuple(LayerStats(name=layer.name, param_bytes=layer.param_bytes, fwd_flops=named(layer.fwd_flops),
                                activation_bytes=named(layer.activation_bytes)) for layer in per_layer(gm)),
        graph=gm,
    )


def _user_name(dim: str, rename: dict) -> str:
    return str(rename[dim_symbol(dim)])


def _resolve_dims(spec: ModelSpec, requested: dict[str, int | str | None]):
    used = {d for s in spec.inputs for d in s.dim_names()}
    dims = dict(spec.dims)
    symbolic: list[str] = []
    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    for dim, value in requested.items():
        if value is None:
            continue
        if dim not in used:
            raise ConfigError(f"model {spec.name!r} has no {dim!r} dim (its inputs use {sorted(used)}); "
                              f"drop --{dim}")
        if isinstance(value, str) and not value.isdigit():
            if not value.isidentifier():
                raise ConfigError(f"--{dim} {value!r} is neither a number nor a name like B or batch")
            symbolic.append(dim)
            rename[dim_symbol(dim)] = dim_symbol(value)
        else:
            dims[dim] = int(value)
            if dims[dim] < 1:
                raise ConfigError(f"--{dim} must be at least 1, got {value}")
    return dims, tuple(symbolic), rename


def layer_of(node: fx.Node) -> str:
    """The layer a node belongs to: its repeated block (``blocks.3``, from ``annotate_blocks``),
    else its top-level module (``wte``); ``(graph)`` for nodes outside every module (the loss,
    size arithmetic)."""
    block = node.meta.get(BLOCK)
    if block is not None and block.in_block:
        return block.name
    path = module_path(node) or (node.target if node.op == "get_attr" else "")
    parts = path.split(".") if path else []
    if node.op == "get_attr":
        parts = parts[:-1]  # drop the parameter's own name
    if not parts:
        return "(graph)"
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def per_layer(gm: fx.GraphModule) -> list[LayerStats]:
    """Parameter bytes, forward FLOPs and kept activation bytes grouped by top-level layer,
    in the order the forward pass reaches each layer."""
    groups: dict[str, list] = {}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and SHAPE in n.meta]
    for node in sorted(nodes, key=lambda n: n.op == "get_attr"):  # stable: compute order first
        groups.setdefault(layer_of(node), []).append(node)
    if "(graph)" in groups:  # loss and size arithmetic: list after the layers
        groups["(graph)"] = groups.pop("(graph)")
    stats = []
    for name, members in groups.items():
        mem = [n.meta[MEMORY] for n in members if MEMORY in n.meta]
        stats.append(LayerStats(
            name=name,
            param_bytes=sympy.expand(sum((m.param_bytes for m in mem), sympy.Integer(0))),
            fwd_flops=sympy.expand(sum((n.meta[FLOPS].fwd for n in members if FLOPS in n.meta), sympy.Integer(0))),
            activation_bytes=sympy.expand(sum((m.kept_bytes for m in mem), sympy.Integer(0))),
        ))
    return stats
