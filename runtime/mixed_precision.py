"""16-bit training with fp32 master weights: the optimizer and fp16's loss scaling.

A bf16 or fp16 plan runs stage programs captured in that dtype: parameters, gradients and
activations are 16-bit on the device (2 + 2 bytes per parameter). The optimizer keeps what must
not be 16-bit, in fp32: a master copy of every parameter and AdamW's two moments (12 bytes per
parameter, 1/dp of that under ZeRO), as Micikevicius et al. 2018 and ZeRO (Rajbhandari et al.
2020, 16 bytes per parameter) count. One step: each gradient to fp32, AdamW on the masters,
each master cast back into its 16-bit parameter.

* :class:`MasterWeightAdamW`: that optimizer, with the masters and the AdamW state on the device
  or (``on_host``: ZeRO-Offload style, :mod:`runtime.optimizer_offload`) in host memory. For fp32
  parameters with ``on_host`` the masters are plain host copies.
* :class:`DynamicLossScaler`: fp16 has 5 exponent bits, so small gradients underflow. The loss
  is multiplied by ``scale`` before backward (:class:`runtime.stage_executor.StageExecutor`'s
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
from runtime import comm


ADAMW_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW state (zeros, step 0) where the optimizer has not stepped yet, exactly what
    its first step would allocate (the step then proceeds as from a fresh state): a load has
    tensors to read into, and the state exists from the start rather than appearing in step 0."""
    for group in optimizer.param_groups:
        keys = ADAMW_MOMENT_KEYS if group.get("amsgrad", False) else ADAMW_MOMENT_KEYS[:2]
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                for key in keys:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


class MasterWeightAdamW:
    """AdamW stepping fp32 master copies of ``params`` (on the device, or in host memory with
    ``on_host``) and writing each result back into its parameter, cast to the parameter's dtype.

    Takes ``torch.optim.AdamW``'s hyper-parameters. :meth:`prepare_grads` makes the masters'
    fp32 gradients from the parameters' (what :meth:`step` does first; a loss scaler unscales
    them in between), :meth:`apply` steps and writes back.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, on_host: bool = False, **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("MasterWeightAdamW got no parameters that require grad")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ConfigError("MasterWeightAdamW got a parameter twice (tied weights): pass each once")
        self.on_host = on_host
        self._pin = on_host and any(p.is_cuda for p in self.params) and torch.cuda.is_available()
        # fp32 masters; always a separate storage, so a parameter never aliases its master
        self.masters = [self._empty(p).copy_(p.detach()).requires_grad_(True) for p in self.params]
        # on the host the fp32 gradients have buffers of their own for the whole run (as
        # ZeRO-Offload keeps them); on the device they are made for the step and freed after it
        self.host_grads = [self._empty(p) for p in self.params] if on_host else None
        self.optimizer = torch.optim.AdamW(self.masters, **adamw_kwargs)
        init_adamw_state(self.optimizer)  # all the state from the start (host memory stays put)
        self.bytes_to_host = 0  # gradients moved device -> host (on_host), bytes
        self.bytes_to_device = 0  # parameters moved host -> device (on_host), bytes
        self._prepared = False

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        if self.on_host:
            return torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin)
        return torch.empty(p.shape, dtype=torch.float32, device=p.device)

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state: fp32 masters plus every AdamW state tensor."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors(grads=False))

    def state_tensors(self, *, grads: bool = True):
        """Every tensor this optimizer keeps across steps: the masters, AdamW's state and (with
        ``grads``) the host gradient buffers."""
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
        """Each parameter's gradient as its master's fp32 gradient; returns those gradients."""
        moved = 0
        for k, (p, m) in enumerate(zip(self.params, self.masters)):
            if p.grad is None:
                m.grad = None  # AdamW skips parameters without a gradient
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
        """AdamW on the masters, then each master into its parameter; frees the fp32 gradients."""
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
        """Gradients to fp32 masters, AdamW, masters back into the parameters."""
        if not self._prepared:
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
