"""Parameters and buffers at dotted paths of a module: placed (with the submodules on the way
made as plain ``nn.Module``\\ s) and removed, as the rewrites that move tensors between programs
need (the pipeline split, the expert slots of an ep rank)."""
from __future__ import annotations

from torch import nn


def install(root: nn.Module, target: str, tensor, *, persistent: bool = True) -> None:
    """Register ``tensor`` at dotted path ``target`` of ``root``: a parameter if it is an
    ``nn.Parameter``, else a buffer (``persistent`` as ``register_buffer`` takes it)."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def remove(root: nn.Module, target: str) -> None:
    """Drop the attribute at dotted path ``target`` of ``root`` (nothing when it is not there)."""
    path, _, leaf = target.rpartition(".")
    owner = root.get_submodule(path) if path else root
    if hasattr(owner, leaf):
        delattr(owner, leaf)
