"""Analysis: bytes of one training step — model state, saved activations, and the peak.

Three facts, all sympy expressions in the named dims (integers when the capture is concrete):

1. **Model state** per parameter (``get_attr`` of a ``Parameter``; tied parameters once):
   parameter, gradient and optimizer-state bytes from :data:`passes.ir.optimizers.OPTIMIZERS`.
2. **Saved activations**: what autograd really keeps. The graph runs forward on fake tensors
   inside ``torch.autograd.graph.saved_tensors_hooks``; every packed tensor is attributed to the
   node running at that moment (its *saver*). Storages are deduplicated (views count once) and
   each is charged to its *owner*: the node whose output first had the storage, or the saver
   itself for tensors made inside an op (dropout mask, layer-norm mean/rstd, attention
   logsumexp, the log-softmax of a cross entropy). Parameters and buffers are not activations;
   graph inputs that are saved (token ids, targets) are counted separately as input bytes.
3. **Peak** of one steady-state step (optimizer state exists, gradients were set to ``None``):
   a liveness simulation (:class:`passes.analysis.liveness.Timeline`) over

   * forward, in node order: each node's new output storages and internal saved tensors are
     allocated; a storage nobody saves is freed after its last use (over all its views);
   * backward, in reverse node order, for nodes the loss's gradient reaches: each input that
     requires grad gets a gradient buffer of its size, except where the op passes the output
     gradient through unchanged (views, reshape/flatten/clone, same-shape add); a second
     gradient for the same tensor is added in place (a transient buffer). The output's gradient
     is freed after the node's backward, and so are the saved storages whose earliest saver
     (the last to run backward) it is. Parameter gradients accumulate and stay;
   * optimizer step: parameters + gradients + state, plus the update's temporaries (see
     :class:`passes.ir.optimizers.OptimizerModel`).

   ``peak_phase``/``peak_node`` say where the peak is at the dims' hint values; ``peak_bytes``
   is the ``sympy.Max`` of the live totals at the step's local maxima that are the largest
   somewhere on a grid of dims values around the hints (see :mod:`passes.analysis.liveness`), so it is
   the simulated peak at the hints and across that grid, not only at the hints (a single
   expression for a concrete capture).

Checkpointed regions (``checkpoint(%submodule, *inputs)`` calls from ``apply_checkpoint``): the fake
run interprets the submodule node by node without checkpointing, so its nodes join the node order
just before the call and every save is seen. A storage made inside a region and saved only by
nodes of that region is not kept after forward (freed after its last use there); the region's
inputs are kept until the end of the region's backward (``torch.utils.checkpoint`` holds them).
At the call's backward the region's forward is replayed: its storages are allocated again
(unsaved ones freed after their last use in the region, saved ones at their saver's backward),
then the region's nodes run backward as in an unchecked graph. ``activation_bytes`` is then what
stays saved between forward and backward with the regions checkpointed.

A per-tensor recompute decision (``node.meta[TENSOR_REMAT]``, from
``passes.policies.tensor_remat_policy.mark_recomputed``) is replayed as :class:`passes.rewrites.tensor_remat.TensorRemat`
runs it (``passes.analysis.step_simulation.tensor_remat_events``): the storages of recomputed nodes are
freed after their last use in forward; at the backward of the node that first needs them they
are made again (sources before readers; a source whose last use was a recompute there goes right
after it), and dropped after their last use; storages a recompute reads stay until it has run.
``activation_bytes`` is then what the decision keeps after forward.

Not modelled: scratch tensors an op allocates and frees inside itself without saving them, and
allocator rounding/fragmentation (sizes are exact storage bytes, as MemTracker counts on CPU).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
from torch import fx

from passes.capture.fake_execution import capture_info
from passes.ir.config import DType, is_mixed
from passes.ir.meta import CAPTURE, MEMORY, MEMORY_SUMMARY, MemoryMeta, MemorySummary, SavedTensor
from passes.analysis.saved_tensors import _ForwardRun, observe_saved_tensors  # noqa: F401  (shared with other passes)
from passes.ir.optimizers import optimizer_model
from passes.analysis.liveness import MemoryObserver
from passes.analysis.step_simulation import (_model_state, _ModelState,  # noqa: F401
                                             _simulate_step, tensor_remat_events)

_ZERO = sympy.Integer(0)


def annotate_memory(gm: fx.GraphModule, ctx: Any = None, *, optimizer: str = "adamw",
                    dtype: DType = "fp32", batch: int | None = None,
                    observer: MemoryObserver | None = None) -> fx.GraphModule:
    """Write :class:`MemoryMeta` (bytes) under ``node.meta[MEMORY]`` for every node and the
    step's :class:`MemorySummary` (bytes) under ``gm.meta[MEMORY_SUMMARY]``; returns ``gm``.

    ``optimizer`` is one of :data:`passes.ir.optimizers.OPTIMIZERS`; ``dtype`` is the training dtype:
    ``bf16``/``fp16`` model 16-bit parameters and gradients (2 bytes each per element) with fp32 master weights (4) and fp32 optimizer
    state (Adam: 8), i.e. 16 bytes per parameter element for Adam. Activation bytes always come
    from the graph's own dtypes: capture a bf16 model to get bf16 activations. ``batch``: count
    one step of ``batch`` samples with every other named dim at its hint (concrete numbers,
    several times faster than the symbolic analysis; ``batch=1`` is what the planner's per-sample
    profile reads); ``None``: symbolic in the capture's symbolic dims. ``observer``: told every
    event of the simulated step (:class:`passes.analysis.liveness.MemoryObserver`).
    """
    if batch is not None:
        info = capture_info(gm)
        dims = tuple((n, batch if n == "batch" else v) for n, v in info.dims)
        gm.meta[CAPTURE] = dataclasses.replace(info, dims=dims, symbolic=())
        try:
            return annotate_memory(gm, ctx, optimizer=optimizer, dtype=dtype, observer=observer)
        finally:
            gm.meta[CAPTURE] = info
    opt = optimizer_model(optimizer)
    info = capture_info(gm)
    run = observe_saved_tensors(gm, observer=observer)
    state = _model_state(run, opt, dtype)
    _write_node_meta(run, state)
    remat = tensor_remat_events(gm, run)
    peak = _simulate_step(run, state, opt, device=info.device, hints=info.symbols(), remat=remat, observer=observer)

    kept = [s for s in run.storages.values() if s.kept and s.kind in ("activation", "internal")] if remat is None \
        else list(remat.release)  # a per-tensor recompute decision: what its saved nodes keep or hold
    activation = sympy.expand(sympy.Add(*[s.size for s in kept]))
    inputs = sympy.expand(sympy.Add(*[s.size for s in run.storages.values() if s.kept and s.kind == "input"]))
    notes = [
        f"optimizer {optimizer}: {opt.implementation(info.device)} implementation "
        f"({info.device}); steady state (state exists, gradients set to None before the step)",
        "peak_phase/peak_node located at the dims' hints " + ", ".join(f"{n}={v}" for n, v in info.dims)
        + f" ({peak.hint_bytes} bytes); peak_bytes is the Max over the step's points that are the "
        "largest somewhere on a grid of dims values (hint * 2**k, k = -3, -2.5, ..., 6); see passes.analysis.liveness",
    ]
    if is_mixed(dtype) and info.dtype == torch.float32:
        notes.append(f"dtype {dtype}: model state uses 2-byte params/grads, but activations are "
                     "those of the fp32 graph; capture a bf16 model for 2-byte activations")
    gm.meta[MEMORY_SUMMARY] = MemorySummary(
        param_count=state.total("numel"),
        param_bytes=state.total("param"),
        grad_bytes=state.total("grad"),
        optimizer_bytes=state.total("opt"),
        buffer_bytes=sympy.expand(sympy.Add(*[s.size for s in run.storages.values() if s.kind == "buffer"])),
        activation_bytes=activation,
        input_bytes=inputs,
        peak_bytes=peak.bytes,
        peak_phase=peak.phase,
        peak_node=peak.node,
        optimizer=optimizer,
        dtype=dtype,
        notes=tuple(notes),
    )
    return gm


# ---------------------------------------------------------------------------------------------
# Node meta.

def _write_node_meta(run: _ForwardRun, state: _ModelState) -> None:
    kept: dict[fx.Node, list[sympy.Expr]] = {}
    for st in run.storages.values():
        if st.kept and st.kind in ("activation", "internal", "input"):
            kept.setdefault(st.owner, []).append(st.size)
    for node in run.order:
        new = [st.size for st in run.node_storages.get(node, ()) if st.kind == "activation" and st.owner is node]
        saved = tuple(SavedTensor(owner=st.owner.name, nbytes=st.size) for st in run.saved_by.get(node, ()))
        offloaded = tuple(SavedTensor(owner=owner.name, nbytes=size) for owner, size in run.offloaded_by.get(node, ()))
        meta = MemoryMeta(output_bytes=_sum(new), saved=saved, offloaded=offloaded, kept_bytes=_sum(kept.get(node, [])))
        params = [st for st, first in state.first_node.items() if first is node]
        if params:
            meta = dataclasses.replace(meta, param_bytes=_sum([state.param[st][0] for st in params]),
                                       grad_bytes=_sum([state.grad[st][0] for st in params if st in state.grad]),
                                       optimizer_bytes=_sum([state.opt[st][0] for st in params if st in state.opt]))
        node.meta[MEMORY] = meta


def _sum(exprs: list[sympy.Expr]) -> sympy.Expr:
    return sympy.expand(sympy.Add(*exprs)) if exprs else _ZERO
