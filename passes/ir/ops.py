"""The ``partitioner::*`` custom ops the transform passes insert: schemas, fake kernels and autograd.

Defining an op here (``torch.library.define``) with its *fake* kernel (output shapes, so the
analysis passes run on rewritten graphs) and its *autograd* formula makes it a node the IR can
name, dump and differentiate. The *real* kernels (collectives over process groups, the dropout
mask, host copies) are process state and live in :mod:`runtime.kernels`, which registers them
with ``torch.library.register_kernel``; a graph of these ops runs for real only where the runtime
is imported.

Tensor parallelism (Megatron's f and g, Shoeybi et al. 2019); every op takes its tp group by
*name* (a custom op cannot take a ``ProcessGroup``), which the runtime resolves:

====================  ===================  ===================
op                    forward              backward
====================  ===================  ===================
``copy_to_tp``        identity             all-reduce (sum)
``reduce_from_tp``    all-reduce (sum)     identity
``all_reduce``        all-reduce (op)      (not differentiable; used inside others)
====================  ===================  ===================

Sequence parallelism (Korthikanti et al. 2022) over a sequence dim ``dim`` split in ``tp`` equal
contiguous chunks (rank ``r`` holds chunk ``r``):

========================  ============================  ============================
op                        forward                       backward
========================  ============================  ============================
``reduce_scatter_seq``    reduce-scatter (sum) on dim   all-gather on dim
``all_gather_seq``        all-gather on dim             reduce-scatter (sum) on dim
``scatter_to_seq``        keep this rank's chunk        all-gather on dim
``gather_from_seq``       all-gather on dim             keep this rank's chunk
========================  ============================  ============================

``vocab_parallel_cross_entropy(logits [N, V/tp], target [N], vocab_start, ignore_index, group)``
returns ``(loss [N], softmax [N, V/tp])``; its backward is local (softmax minus one-hot).

``sharded_dropout(x, p, dim, rank, degree, sections)`` returns ``(y, mask)``: dropout of a tp
shard with the mask one device draws for the whole tensor (:mod:`passes.rewrites.sharded_dropout`);
backward ``grad * mask / (1 - p)``.

``split_point(x)`` is an identity (a copy) that marks where a stage's parameters first meet its
data (after an embedding lookup) for split-backward schedules: :mod:`passes.rewrites.split_backward`
inserts it, :mod:`runtime.exec.split_backward` finds its autograd node. Its kernel is here, not in the
runtime: it computes nothing process-specific.

The offload ops (``offload_begin``/``offload_end``) are in :mod:`passes.ir.offload_ops`.
"""
from __future__ import annotations

import torch
from torch import Tensor

NAMESPACE = "partitioner"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

SCHEMAS = {
    "all_reduce": "(Tensor x, str group, str op='sum') -> Tensor",
    "copy_to_tp": "(Tensor x, str group) -> Tensor",
    "reduce_from_tp": "(Tensor x, str group) -> Tensor",
    "vocab_parallel_cross_entropy":
        "(Tensor logits, Tensor target, int vocab_start, int ignore_index, str group) -> (Tensor, Tensor)",
    "reduce_scatter_seq": "(Tensor x, int dim, int tp, str group) -> Tensor",
    "all_gather_seq": "(Tensor x, int dim, int tp, str group) -> Tensor",
    "scatter_to_seq": "(Tensor x, int dim, int tp, str group) -> Tensor",
    "gather_from_seq": "(Tensor x, int dim, int tp, str group) -> Tensor",
    "sharded_dropout": "(Tensor x, float p, int dim, int rank, int degree, int[] sections) -> (Tensor, Tensor)",
    "split_point": "(Tensor x) -> Tensor",
}
"""Op name -> schema (without the name), as ``torch.library.define`` takes it."""

TP_OPS = ("copy_to_tp", "reduce_from_tp", "vocab_parallel_cross_entropy", "reduce_scatter_seq", "all_gather_seq",
          "scatter_to_seq", "gather_from_seq")
"""The ops that communicate over a tp group (what a rank program lists as its tp collectives)."""
REDUCE_OPS = ("sum", "max")

for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)

ops = torch.ops.partitioner


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


# --- fake kernels: output shapes and dtypes ------------------------------------------------------
@torch.library.register_fake(qualname("all_reduce"), lib=_LIB)
def _(x, group, op="sum"):
    return torch.empty_like(x)


@torch.library.register_fake(qualname("copy_to_tp"), lib=_LIB)
def _(x, group):
    return torch.empty_like(x)


@torch.library.register_fake(qualname("reduce_from_tp"), lib=_LIB)
def _(x, group):
    return torch.empty_like(x)


@torch.library.register_fake(qualname("vocab_parallel_cross_entropy"), lib=_LIB)
def _(logits, target, vocab_start, ignore_index, group):
    return logits.new_empty(logits.shape[:1]), torch.empty_like(logits)


def dim_scaled_fake(scale_up: bool):
    """The fake kernel of an op ``(x, dim, degree, group)`` whose dim ``dim`` grows (a gather) or
    shrinks (a scatter) by ``degree`` (the sequence-parallel ops; the expert-parallel dispatch and combine)."""
    def fake(x, dim, tp, group):
        shape = list(x.shape)
        shape[dim] = shape[dim] * tp if scale_up else shape[dim] // tp
        return x.new_empty(shape)
    return fake


for _name, _up in (("reduce_scatter_seq", False), ("all_gather_seq", True), ("scatter_to_seq", False),
                   ("gather_from_seq", True)):
    torch.library.register_fake(qualname(_name), dim_scaled_fake(_up), lib=_LIB)


@torch.library.register_fake(qualname("sharded_dropout"), lib=_LIB)
def _(x, p, dim, rank, degree, sections):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


@torch.library.register_fake(qualname("split_point"), lib=_LIB)
def _(x):
    return torch.empty_like(x)


@torch.library.impl(qualname("split_point"), "CompositeExplicitAutograd", lib=_LIB)
def _(x):
    return x.clone()  # a custom op may not return a view of its input


SPLIT_POINT_AUTOGRAD_NAME = f"{NAMESPACE}_split_point"
"""What the name of ``split_point``'s autograd node contains."""


# --- autograd formulas -----------------------------------------------------------------------------
def _group_setup(ctx, inputs, output):
    ctx.group = inputs[1]


def _copy_backward(ctx, grad):
    return ops.all_reduce(grad, ctx.group, "sum"), None


def _reduce_backward(ctx, grad):
    return grad, None


torch.library.register_autograd(qualname("copy_to_tp"), _copy_backward, setup_context=_group_setup, lib=_LIB)
torch.library.register_autograd(qualname("reduce_from_tp"), _reduce_backward, setup_context=_group_setup, lib=_LIB)


def _ce_setup(ctx, inputs, output):
    _, target, vocab_start, ignore_index, _ = inputs
    ctx.save_for_backward(output[1], target)
    ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
    ctx.set_materialize_grads(False)  # the softmax output gets no gradient: no [N, V/tp] of zeros for it


def _ce_backward(ctx, grad_loss, grad_softmax):
    softmax, target = ctx.saved_tensors
    if grad_loss is None:  # the loss took no part in what was differentiated
        return None, None, None, None, None
    local = target - ctx.vocab_start
    mine = (local >= 0) & (local < softmax.shape[1])
    grad = softmax.clone()  # the one [N, V/tp] buffer of the backward (the input gradient), worked in place
    # minus one at each row's target column where this rank holds it (elsewhere -0.0 at column 0,
    # which changes nothing): no data-dependent row list, so no device-to-host sync on a GPU and
    # no graph break when the program is compiled
    column = torch.where(mine, local, torch.zeros_like(local))[:, None]
    grad.scatter_add_(1, column, -mine[:, None].to(grad.dtype))
    scale = torch.where(target == ctx.ignore_index, torch.zeros_like(grad_loss), grad_loss)
    return grad.mul_(scale[:, None]), None, None, None, None


torch.library.register_autograd(qualname("vocab_parallel_cross_entropy"), _ce_backward, setup_context=_ce_setup,
                                lib=_LIB)


def _seq_setup(ctx, inputs, output):
    ctx.dim, ctx.tp, ctx.group = inputs[1], inputs[2], inputs[3]


def _bwd_all_gather(ctx, grad):
    return ops.all_gather_seq(grad, ctx.dim, ctx.tp, ctx.group), None, None, None


def _bwd_reduce_scatter(ctx, grad):
    return ops.reduce_scatter_seq(grad, ctx.dim, ctx.tp, ctx.group), None, None, None


def _bwd_chunk(ctx, grad):
    return ops.scatter_to_seq(grad, ctx.dim, ctx.tp, ctx.group), None, None, None


for _name, _bwd in (("reduce_scatter_seq", _bwd_all_gather), ("all_gather_seq", _bwd_reduce_scatter),
                    ("scatter_to_seq", _bwd_all_gather), ("gather_from_seq", _bwd_chunk)):
    torch.library.register_autograd(qualname(_name), _bwd, setup_context=_seq_setup, lib=_LIB)


def _dropout_setup(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.save_for_backward(output[1])


def _dropout_backward(ctx, grad, _grad_mask):
    (mask,) = ctx.saved_tensors
    scale = 0.0 if ctx.p == 1 else 1 - ctx.p
    noise = mask.to(grad.dtype) if scale == 0.0 else mask.to(grad.dtype).div(scale)
    return (grad * noise if scale else grad * 0.0), None, None, None, None, None


torch.library.register_autograd(qualname("sharded_dropout"), _dropout_backward, setup_context=_dropout_setup,
                                lib=_LIB)
torch.library.register_autograd(qualname("split_point"), lambda ctx, grad: grad, lib=_LIB)


def op_name(target: object) -> str | None:
    """The op name (``"copy_to_tp"``) of a graph node's target if it is one of ours, else None."""
    if getattr(target, "namespace", None) == NAMESPACE:
        return getattr(target, "_opname", None)
    return None


def rank_slice(full: Tensor, dim: int, rank: int, degree: int, sections: list[int]) -> Tensor:
    """Rank ``rank``'s part of ``full`` along ``dim``: its ``1/degree`` of every section (the
    whole dim as one section when ``sections`` is empty), concatenated."""
    pieces, offset = [], 0
    for size in sections or [full.shape[dim]]:
        chunk = size // degree
        pieces.append(full.narrow(dim, offset + rank * chunk, chunk))
        offset += size
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
