"""Every ``node.meta`` / ``gm.meta`` key this project writes, and the dataclass stored under it.

One key per owning pass, one frozen dataclass per key. Sizes are sympy expressions: integers
when the input dims are concrete, polynomials in the named dims (``batch``, ``seq``) otherwise.

Node keys (``node.meta[KEY]``):

====================  ======================  =======================================================
key                   written by              value
====================  ======================  =======================================================
``SHAPE``             ``annotate_shapes``     :class:`ShapeMeta`: shape/dtype of each tensor output
``FLOPS``             ``annotate_flops``      :class:`FlopMeta`: forward and backward FLOPs
``MEMORY``            ``annotate_memory``     :class:`MemoryMeta`: bytes allocated, kept for backward
====================  ======================  =======================================================

Graph keys (``gm.meta[KEY]``):

====================  ======================  =======================================================
``CAPTURE``           ``capture_model``       :class:`CaptureInfo`: inputs, named dims, origin
``FLOP_SUMMARY``      ``annotate_flops``      :class:`FlopSummary`: totals over the graph
``MEMORY_SUMMARY``    ``annotate_memory``     :class:`MemorySummary`: model state, activations, peak
====================  ======================  =======================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

# Node keys
SHAPE = "shape"
FLOPS = "flops"
MEMORY = "memory"
# Graph keys
CAPTURE = "capture"
FLOP_SUMMARY = "flop_summary"
MEMORY_SUMMARY = "memory_summary"

# torch.export writes these; we read them, never write them.
EXPORT_VAL = "val"
EXPORT_MODULE_STACK = "nn_module_stack"


def dim_symbol(name: str) -> sympy.Symbol:
    """The sympy symbol of a named input dim (positive integer)."""
    return sympy.Symbol(name, positive=True, integer=True)


Size = sympy.Expr  # an element count or byte count; sympy.Integer when concrete


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One tensor input of a captured graph.

    ``shape`` entries are ints or names of symbolic dims (e.g. ``"batch"``, ``"seq"``); the same
    name in two inputs is the same dim. Integer inputs (token ids, labels) take values in
    ``[0, high)``.
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None

    def dim_names(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))


@dataclass(frozen=True, kw_only=True)
class CaptureInfo:
    """How a graph was captured: ``gm.meta[CAPTURE]``.

    ``dims`` maps every named dim to the value used as its example (its *hint*); ``symbolic``
    lists the dims kept symbolic (the rest were specialized to their hint).
    """

    model: str  # spec string or class name of the user's module
    inputs: tuple[InputSpec, ...]
    dims: tuple[tuple[str, int], ...]
    symbolic: tuple[str, ...]
    device: str  # device type the graph's programs run on ("cpu", "cuda")
    dtype: torch.dtype  # floating dtype of parameters and activations

    def hint(self, name: str) -> int:
        return dict(self.dims)[name]

    def symbols(self) -> dict[sympy.Symbol, int]:
        """Each symbolic dim's symbol and its hint value."""
        return {dim_symbol(n): v for n, v in self.dims if n in self.symbolic}


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor; ``shape`` entries are sympy expressions."""

    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sympy.expand(self.numel * itemsize)


@dataclass(frozen=True, kw_only=True)
class ShapeMeta:
    """``node.meta[SHAPE]``: the tensors a node produces, flattened in output order.

    ``value`` is set instead for nodes that produce a size (``sym_size``) or a Python scalar.
    """

    tensors: tuple[TensorMeta, ...] = ()
    value: sympy.Expr | None = None

    @property
    def tensor(self) -> TensorMeta:
        """The single tensor output (raises if the node has none or several)."""
        if len(self.tensors) != 1:
            raise ValueError(f"node has {len(self.tensors)} tensor outputs, expected 1")
        return self.tensors[0]


@dataclass(frozen=True, kw_only=True)
class FlopMeta:
    """``node.meta[FLOPS]``: floating-point operations of one node, forward and backward.

    Only matmul-class work is counted (matmul, linear, convolution, attention), as
    ``torch.utils.flop_counter`` does: one multiply-add is 2 FLOPs. ``kind`` names the
    formula used ("matmul", "conv", "attention", or "none").
    """

    fwd: sympy.Expr
    bwd: sympy.Expr
    kind: str = "none"


@dataclass(frozen=True, kw_only=True)
class FlopSummary:
    """``gm.meta[FLOP_SUMMARY]``: FLOPs of one forward and one backward of the whole graph."""

    fwd: sympy.Expr
    bwd: sympy.Expr


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    """A storage autograd keeps alive for a node's backward.

    ``owner`` is the node whose output the storage is (a graph input, an earlier activation, or
    this node itself for tensors made inside the op, such as a dropout mask); ``nbytes`` counts
    the whole storage (views of one storage count once).
    """

    owner: str
    nbytes: sympy.Expr


@dataclass(frozen=True, kw_only=True)
class MemoryMeta:
    """``node.meta[MEMORY]``: bytes tied to one node.

    * ``output_bytes``: new storage the node's forward allocates (0 for views).
    * ``saved``: storages autograd saves for this node's backward (what it really saves).
    * ``kept_bytes``: bytes of this node's own outputs (or internals) that some backward keeps
      alive; summed over nodes this is the activation memory of one forward, with no storage
      counted twice.
    * ``param_bytes``/``grad_bytes``/``optimizer_bytes``: for parameter nodes (``get_attr``).
    """

    output_bytes: sympy.Expr = sympy.Integer(0)
    saved: tuple[SavedTensor, ...] = ()
    kept_bytes: sympy.Expr = sympy.Integer(0)
    param_bytes: sympy.Expr = sympy.Integer(0)
    grad_bytes: sympy.Expr = sympy.Integer(0)
    optimizer_bytes: sympy.Expr = sympy.Integer(0)


@dataclass(frozen=True, kw_only=True)
class MemorySummary:
    """``gm.meta[MEMORY_SUMMARY]``: memory of one training step of the whole graph (bytes).

    ``peak_bytes`` comes from a liveness analysis over forward, backward and the optimizer step;
    ``peak_phase`` and ``peak_node`` say where it happens (at the dims' hint values).
    """

    param_count: sympy.Expr
    param_bytes: sympy.Expr
    grad_bytes: sympy.Expr
    optimizer_bytes: sympy.Expr
    activation_bytes: sympy.Expr
    input_bytes: sympy.Expr
    peak_bytes: sympy.Expr
    peak_phase: str
    peak_node: str
    optimizer: str
    mixed_precision: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
