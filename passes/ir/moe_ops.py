"""Expert-parallel (ep) ops and the plan of where each expert lives.

Under ``ep > 1`` each mixture-of-experts block's routed experts are spread over the ``ep``
consecutive ranks of an ep group (cut from the data axis). The captured block runs every expert
on every token and weighs the unchosen ones 0 (the dense form of :mod:`partitioner.zoo.moe`), so
the exact expert-parallel program is: gather the tokens (and their combine weights) of the ep
group, run this rank's experts on them, and reduce-scatter the weighted sum back to the tokens'
owners (Megatron-Core's all-gather token dispatcher). Every op takes its group by *name*
(resolved by :func:`runtime.kernels.collectives.register_group`) and reads its rank from the
group, so every ep rank runs the same program; only which experts' parameters sit in its slots
differs (:meth:`ExpertParallelPlan.renames`).

=====================================  ==============================  ==============================
op                                     forward                         backward
=====================================  ==============================  ==============================
``ep_dispatch(x, dim, degree, group)`` all-gather on ``dim``           reduce-scatter (sum) on ``dim``
``ep_combine(x, dim, degree, group)``  reduce-scatter (sum) on ``dim`` all-gather on ``dim``
``data_mean(x, degree, group)``        all-reduce, mean                all-reduce, mean
``ep_local(x, degree, group)``         this rank's ``1/degree`` of the  ``ep_local_backward``: the
                                       last dim (its experts' columns)  gradient in those columns, 0
                                                                        elsewhere (no communication)
``ep_route(ids, experts, degree,       (local ids, owned): each id      none (integer ids)
group)``                               made an index into this rank's
                                       experts, 0 where another rank
                                       owns it, and whether it is ours
=====================================  ==============================  ==============================

``ep_local`` picks the combine weights of this rank's experts out of ``[..., experts]`` (rank
``r`` holds experts ``r * experts / degree ..``), reading ``r`` from the group.

A block captured in the gathered form (Hugging Face's stacked ``[experts, ...]`` weights indexed by
the chosen ids, one row per token and choice) keeps rows ``r * experts / degree ..`` of each
stacked weight; ``ep_route`` turns the gathered rows' expert ids into indices of those rows, and
its ``owned`` mask zeroes the combine weight of every row another rank's expert serves.

``data_mean`` makes a load-balancing loss's token averages (``f_e``, ``P_e``) those of the whole
batch of the data axis, so the loss is one device's: every replica then computes the same loss,
and each gradient that reaches the averages is averaged over the replicas (the gradient sync
divides the sum of the replicas' gradients by their number, so each one's share is the mean).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from passes.ir.ops import _LIB, dim_scaled_fake, qualname

SCHEMAS = {
    "ep_dispatch": "(Tensor x, int dim, int degree, str group) -> Tensor",
    "ep_combine": "(Tensor x, int dim, int degree, str group) -> Tensor",
    "data_mean": "(Tensor x, int degree, str group) -> Tensor",
    "ep_local": "(Tensor x, int degree, str group) -> Tensor",
    "ep_local_backward": "(Tensor grad, int degree, str group) -> Tensor",
    "ep_route": "(Tensor ids, int experts, int degree, str group) -> (Tensor, Tensor)",
}
EP_OPS = ("ep_dispatch", "ep_combine")
"""The ops that communicate over an ep group (``ep_local`` reads the group's rank only)."""
DATA_OPS = ("data_mean",)
"""The ops that communicate over the data axis (dp x cp ranks)."""

for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)

ops = torch.ops.partitioner


torch.library.register_fake(qualname("ep_dispatch"), dim_scaled_fake(True), lib=_LIB)
torch.library.register_fake(qualname("ep_combine"), dim_scaled_fake(False), lib=_LIB)


@torch.library.register_fake(qualname("data_mean"), lib=_LIB)
def _(x, degree, group):
    return torch.empty_like(x)


@torch.library.register_fake(qualname("ep_local"), lib=_LIB)
def _(x, degree, group):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // degree))


@torch.library.register_fake(qualname("ep_local_backward"), lib=_LIB)
def _(grad, degree, group):
    return grad.new_empty((*grad.shape[:-1], grad.shape[-1] * degree))


@torch.library.register_fake(qualname("ep_route"), lib=_LIB)
def _(ids, experts, degree, group):
    return torch.empty_like(ids), torch.empty_like(ids, dtype=torch.bool)


def _setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _dispatch_backward(ctx, grad):
    return ops.ep_combine(grad, *ctx.args), None, None, None


def _combine_backward(ctx, grad):
    return ops.ep_dispatch(grad, *ctx.args), None, None, None


def _mean_backward(ctx, grad):
    return ops.data_mean(grad, *ctx.args), None, None


torch.library.register_autograd(qualname("ep_dispatch"), _dispatch_backward, setup_context=_setup, lib=_LIB)
torch.library.register_autograd(qualname("ep_combine"), _combine_backward, setup_context=_setup, lib=_LIB)
torch.library.register_autograd(qualname("data_mean"), _mean_backward, setup_context=_setup, lib=_LIB)


def _local_backward(ctx, grad):
    return ops.ep_local_backward(grad, *ctx.args), None, None


torch.library.register_autograd(qualname("ep_local"), _local_backward, setup_context=_setup, lib=_LIB)


@dataclass(frozen=True, kw_only=True)
class ExpertSlots:
    """One MoE block of a stage program under ep: its router node, its expert count, and the
    parameters of each routed expert (by the model's names, as :class:`passes.ir.meta.MoeBlock`
    lists them). A program holds ``experts / degree`` slots; slot ``j`` of ep rank ``r`` holds
    expert ``r * experts / degree + j``. A block of the gathered form has no per-expert
    parameters: ``stacked`` names its ``[experts, ...]`` weights, of which ep rank ``r`` holds rows
    ``r * experts / degree ..`` under the same names."""

    router: str
    experts: int
    params: tuple[tuple[str, ...], ...] = ()
    stacked: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ExpertParallelPlan:
    """``gm.meta[EXPERT_PARALLEL]`` of a stage program under ``ep > 1`` (written by
    :mod:`passes.rewrites.expert_parallel`). The program is written with ep rank 0's experts in
    its slots; :meth:`renames` gives another ep rank's."""

    degree: int
    group: str
    """The name the ep ops look their group up by."""
    blocks: tuple[ExpertSlots, ...]

    def local(self, block: ExpertSlots, ep_rank: int) -> range:
        """The experts of ``block`` that ep rank ``ep_rank`` holds."""
        n = block.experts // self.degree
        return range(ep_rank * n, (ep_rank + 1) * n)

    def renames(self, ep_rank: int) -> dict[str, str]:
        """Slot parameter name (ep rank 0's expert) -> the parameter ep rank ``ep_rank`` holds there."""
        out = {}
        for b in self.blocks:
            if b.params:
                for j, e in enumerate(self.local(b, ep_rank)):
                    out.update(zip(b.params[j], b.params[e]))
        return out

    def slices(self, ep_rank: int) -> dict[str, range]:
        """Stacked weight name -> the rows (experts) ep rank ``ep_rank`` holds of it."""
        return {name: self.local(b, ep_rank) for b in self.blocks for name in b.stacked}

    def expert_params(self, ep_rank: int) -> tuple[str, ...]:
        """The routed experts' parameter names ep rank ``ep_rank`` holds (their gradients average
        over the ranks holding the same experts, not over the whole data axis)."""
        return tuple(sorted({n for b in self.blocks if b.params for e in self.local(b, ep_rank) for n in b.params[e]}
                            | {n for b in self.blocks for n in b.stacked}))
