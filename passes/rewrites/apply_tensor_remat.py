"""Transform (apply half) of ``checkpointing="tensor"``: make the program run its per-tensor
decision.

The graph keeps its nodes and their marks (``node.meta[TENSOR_REMAT]``, from
``tensor_remat_policy``); only its code changes. :class:`passes.rewrites.tensor_remat.TensorRematCodeGen`
makes ``forward`` hand the call to the executor::

    def forward(self, x, y):
        return _run_tensor_remat(self, (x, y, ))
        layer_norm = torch.ops.aten.layer_norm.default(x, ...)     # never reached: the graph's
        ...                                                         # text, as before

so whoever calls the module runs the decision, the runtime needing nothing of it. Every later
analysis (shapes, FLOPs, the memory replay of the marks) reads the same graph.
"""
from __future__ import annotations

from typing import Any

from torch import fx

from passes.ir.errors import PassError
from passes.ir.meta import TENSOR_REMAT, TENSOR_REMAT_PLAN
from passes.rewrites.tensor_remat import TensorRemat, TensorRematCodeGen


def apply_tensor_remat(gm: fx.GraphModule, ctx: Any = None) -> fx.GraphModule:
    """Give ``gm`` the code that runs its marked decision through the executor; returns ``gm``
    (recompiled in place). The decision is checked first (an executor is built from it)."""
    if TENSOR_REMAT_PLAN not in gm.meta or not any(TENSOR_REMAT in n.meta for n in gm.graph.nodes):
        raise PassError("apply_tensor_remat: the graph carries no per-tensor decision; run tensor_remat_policy "
                        "first")
    codegen = gm.graph._codegen  # noqa: SLF001 (fx has no public getter)
    if type(codegen) not in (fx.graph.CodeGen, TensorRematCodeGen):
        raise PassError(f"apply_tensor_remat: the graph's code comes from {type(codegen).__name__} (its own input "
                        f"handling), which this pass would replace; lower a plain fx graph")
    TensorRemat(gm)  # refuses a decision it cannot run (a recompute reading what nothing keeps)
    gm.graph.set_codegen(TensorRematCodeGen())
    gm.recompile()
    return gm
