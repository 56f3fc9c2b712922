"""The graph modules the passes build generate their Python code when they are first run or read,
not at every construction, copy and rewrite.

``fx.GraphModule`` generates and compiles its ``forward`` whenever its graph is set: a lowering
builds, deep-copies and rewrites stage programs many times before one runs (code generation was
5% of the test suite's CPU). :func:`graph_module` builds PyTorch's ``_LazyGraphModule`` instead:
``recompile()`` only marks the code stale, and the code is made on the first call or read of
``.code``. :func:`compiled` makes it now, for what inspects ``forward`` without calling the
module (exporters, tracers)."""
from __future__ import annotations

from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule


def graph_module(root: nn.Module | dict, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose code is made when first needed."""
    return _LazyGraphModule(root, graph, class_name=class_name)


def compiled(module: nn.Module) -> nn.Module:
    """``module`` with the code of every graph module in it made (in place); returns it."""
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            _LazyGraphModule.force_recompile(sub)
    return module
