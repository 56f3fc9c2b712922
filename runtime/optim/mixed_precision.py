"""16-bit training with fp32 master weights: the optimizer and fp16's loss scaling.

A bf16 or fp16 plan runs stage programs captured in that dtype: parameters, gradients and
activations are 16-bit on the device (2 + 2 bytes per parameter). The optimizer keeps what must
not be 16-bit, in fp32: a master copy of every parameter and AdamW's two moments (12 bytes per
parameter, 1/dp of that under ZeRO), as Micikevicius et al. 2018 and ZeRO (Rajbhandari et al.
2020, 16 bytes per parameter) count. One step: each gradient to fp32, AdamW on the masters,
each master cast back into its 16-bit parameter.

* :class:`MasterWeightOptimizer`: that optimizer (AdamW or any torch optimizer,
  :mod:`runtime.optim.optimizers`), with the masters and the optimizer state on the device or
  (``on_host``: ZeRO-Offload style, :mod:`runtime.optim.optimizer_offload`) in host memory. For fp32
  parameters with ``on_host`` the masters are plain host copies.
* :class:`DynamicLossScaler`: fp16 has 5 exponent bits, so small gradients underflow. The loss
  is multiplied by ``scale`` before backward (:class:`runtime.exec.stage_executor.StageExecutor`'s
  ``loss_scale``), the fp32 gradients divided by it after the sync; a step whose gradients hold
  an inf or NaN on any rank is skipped on every rank and the scale halved; after
  ``growth_interval`` good steps it doubles (the policy of ``torch.amp.GradScaler``). bf16 keeps
  fp32's exponent range and needs no scaling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from passes.ir.errors import ConfigError
from runtime.dist import comm
from runtime.optim.optimizers import OptimizerFactory, as_factory, build, init_state_exact, param_groups


class MasterWeightOptimizer:
    """A torch optimizer stepping fp32 master copies of ``params`` (on the device, or in host
    memory with ``on_host``) and writing each result back into its parameter, cast to the
    parameter's dtype.

    ``factory``: builds the optimizer from parameter groups (:mod:`runtime.optim.optimizers`; default
    AdamW); ``no_decay[i]``: parameter i goes to the ``no_decay`` group. :meth:`prepare_grads`
    makes the masters' fp32 gradients from the parameters' (what :meth:`step` does first; a loss
    scaler unscales and clipping scales them in between), :meth:`apply` steps and writes back.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, factory: OptimizerFactory | None = None,
                 no_decay: Sequence[bool] | None = None, on_host: bool = False):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("MasterWeightOptimizer got no parameters that require grad")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ConfigError("MasterWeightOptimizer got a parameter twice (tied weights): pass each once")
        self.on_host = on_host
        self._pin = on_host and any(p.is_cuda for p in self.params) and torch.cuda.is_available()
        # fp32 masters; always a separate storage, so a parameter never aliases its master
        self.masters = [self._empty(p).copy_(p.detach()).requires_grad_(True) for p in self.params]
        # on the host the fp32 gradients have buffers of their own for the whole run (as
        # ZeRO-Offload keeps them); on the device they are made for the step and freed after it
        self.host_grads = [self._empty(p) for p in self.params] if on_host else None
        flags = list(no_decay) if no_decay is not None else [p.dim() < 2 for p in self.params]
        self.optimizer = build(factory or as_factory(None), param_groups(self.masters, flags))
        init_state_exact(self.optimizer)  # the Adam family's state from the start (host memory stays put)
        self.bytes_to_host = 0  # gradients moved device -> host (on_host), bytes
        self.bytes_to_device = 0  # parameters moved host -> device (on_host), bytes
        self._prepared = False

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (what a learning-rate scheduler steps)."""
        return self.optimizer.param_groups

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        if self.on_host:
            return torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin)
        return torch.empty(p.shape, dtype=torch.float32, device=p.device)

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state: fp32 masters plus every state tensor of the optimizer."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors(grads=False))

    def state_tensors(self, *, grads: bool = True):
        """Every tensor this optimizer keeps across steps: the masters, the optimizer's state and
        (with ``grads``) the host gradient buffers."""
        yield from self.masters
        for state in self.optimizer.state.values():
            yield from (t for t in state.values() if isinstance(t, torch.Tensor))
        if grads and self.host_grads is not None:
            yield from self.host_grads

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (the masters' are made afresh each step)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for m in self.masters:
            m.grad = None
        self._prepared = False

    @torch.no_grad()
    def prepare_grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient as its master's fp32 gradient; returns those gradients
        (idempotent until :meth:`apply`)."""
        if self._prepared:
            return [m.grad for m in self.masters if m.grad is not None]
        moved = 0
        for k, (p, m) in enumerate(zip(self.params, self.masters)):
            if p.grad is None:
                m.grad = None  # the optimizer skips parameters without a gradient
                continue
            g = self.host_grads[k] if self.host_grads is not None else self._empty(p)
            g.copy_(p.grad, non_blocking=self._pin)
            m.grad = g
            moved += p.grad.numel() * p.grad.element_size()
        if self._pin:
            torch.cuda.current_stream().synchronize()  # the host step reads the gradients
        if self.on_host:
            self.bytes_to_host += moved
        self._prepared = True
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def apply(self) -> None:
        """The optimizer on the masters, then each master into its parameter; frees the fp32
        gradients."""
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            if m.grad is None:
                continue
            p.copy_(m, non_blocking=self._pin)  # cast to the parameter's dtype
            if self.on_host:
                self.bytes_to_device += p.numel() * p.element_size()
            else:
                m.grad = None  # the device's fp32 gradient copies live for the step only
        self._prepared = False

    @torch.no_grad()
    def publish(self) -> None:
        """Every master into its parameter (after the masters were loaded from a checkpoint)."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def step(self) -> None:
        """Gradients to fp32 masters, the optimizer, masters back into the parameters."""
        self.prepare_grads()
        self.apply()

    def master_of(self) -> dict[int, torch.Tensor]:
        """Each parameter's fp32 master (by the parameter's ``id``)."""
        return {id(p): m.detach() for p, m in zip(self.params, self.masters)}


@dataclass
class DynamicLossScaler:
    """fp16 loss scaling (see the module docstring): ``scale`` now, halved on an overflow,
    doubled after ``growth_interval`` steps without one. ``skipped``: steps skipped so far."""

    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    backoff: float = 0.5
    growth: float = 2.0
    good_steps: int = 0
    skipped: int = 0

    @torch.no_grad()
    def unscale_local(self, grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Divide the fp32 ``grads`` by the scale in place; 1.0 (a 0-dim tensor on ``device``)
        when one of them holds a non-finite value, else 0.0."""
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            g.mul_(1.0 / self.scale)
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        return bad

    def unscale(self, grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device) -> bool:
        """:meth:`unscale_local`, then ``True`` when any rank of ``group`` found a non-finite value
        (every rank of the job must skip the same step)."""
        bad = self.unscale_local(grads, device)
        comm.all_reduce(bad, group, op="max")
        return bool(bad.item())

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow, grow after a run of good steps."""
        if overflow:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
