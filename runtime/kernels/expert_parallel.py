"""Real kernels of the expert-parallel ops (:mod:`passes.ir.moe_ops`: schemas, fake kernels,
autograd): the ep group's token all-gather and reduce-scatter, and the mean over the data axis,
through the group registry of :mod:`runtime.kernels.collectives`."""
from __future__ import annotations

import torch
from torch import Tensor

import passes.ir.moe_ops  # noqa: F401  (defines the ops)
from passes.ir.errors import ConfigError
from passes.ir.ops import qualname
from runtime.kernels.collectives import get_group


def _group(group: str, degree: int, what: str):
    g = get_group(group)
    if g.size != degree:
        raise ConfigError(f"{what} built for {degree} ranks runs on group {group!r} of {g.size} ranks; lower the "
                          f"program for the mesh it runs on")
    return g


def _dispatch(x: Tensor, dim: int, degree: int, group: str) -> Tensor:
    return _group(group, degree, "ep_dispatch").all_gather(x.contiguous(), dim)


def _combine(x: Tensor, dim: int, degree: int, group: str) -> Tensor:
    if x.shape[dim] % degree:
        raise ConfigError(f"ep_combine: dim {dim} of shape {tuple(x.shape)} does not split over {degree} ep ranks")
    return _group(group, degree, "ep_combine").reduce_scatter(x.contiguous(), dim)


def _data_mean(x: Tensor, degree: int, group: str) -> Tensor:
    return _group(group, degree, "data_mean").all_reduce(x.contiguous(), "sum") / degree


def _local(x: Tensor, degree: int, group: str) -> Tensor:
    g = _group(group, degree, "ep_local")
    return x.chunk(degree, dim=-1)[g.rank].clone(memory_format=torch.contiguous_format)


def _local_backward(grad: Tensor, degree: int, group: str) -> Tensor:
    g = _group(group, degree, "ep_local")
    n = grad.shape[-1]
    out = grad.new_zeros((*grad.shape[:-1], n * degree))
    out[..., g.rank * n:(g.rank + 1) * n] = grad
    return out


def _route(ids: Tensor, experts: int, degree: int, group: str) -> tuple[Tensor, Tensor]:
    g = _group(group, degree, "ep_route")
    n = experts // degree
    local = ids - g.rank * n
    owned = (local >= 0) & (local < n)
    return torch.where(owned, local, torch.zeros_like(local)), owned


for _name, _fn in (("ep_route", _route), ("ep_dispatch", _dispatch), ("ep_combine", _combine), ("data_mean", _data_mean),
                   ("ep_local", _local), ("ep_local_backward", _local_backward)):
    torch.library.register_kernel(qualname(_name), None, _fn)
