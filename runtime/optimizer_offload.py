"""Optimizer-state offload: AdamW whose state and step live in host memory (ZeRO-Offload style).

Per parameter the host keeps an fp32 master copy and AdamW's ``exp_avg``/``exp_avg_sq`` (and
``step``); the device keeps only the parameter and, after backward, its gradient. One step:

1. copy each gradient to host (as fp32);
2. run ``torch.optim.AdamW`` on the host masters — the same implementation a device optimizer
   runs, so on a CPU "device" the result is bit-identical to ``torch.optim.AdamW`` there;
3. copy the masters back into the device parameters (cast to their dtype).

On CUDA the host buffers are pinned and the copies ``non_blocking``, with one synchronization
before the host step reads the gradients and none after (the copies back are ordered on the
compute stream). On CPU the copies are real clones into separate storages, so the path runs.
``bytes_to_host``/``bytes_to_device`` count what crossed the link.
"""
from __future__ import annotations

from typing import Iterable

import torch

from passes.ir.errors import ConfigError


class HostOffloadedAdamW:
    """AdamW with its state and update on the host; the device parameters are updated in place.

    Takes ``torch.optim.AdamW``'s hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``amsgrad``, ``maximize``); ``foreach``/``fused`` are passed through to the host optimizer.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("HostOffloadedAdamW got no parameters that require grad")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ConfigError("HostOffloadedAdamW got a parameter twice (tied weights): pass each once")
        pin = any(p.is_cuda for p in self.params) and torch.cuda.is_available()
        # fp32 master copies in (pinned) host memory; clone so CPU parameters get their own storage
        self.masters = [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).copy_(p.detach())
                        .requires_grad_(True) for p in self.params]
        self.host_optimizer = torch.optim.AdamW(self.masters, **adamw_kwargs)
        self.bytes_to_host = 0  # gradients moved device -> host, bytes
        self.bytes_to_device = 0  # parameters moved host -> device, bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of host state: fp32 masters plus every optimizer state tensor."""
        total = sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.host_optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device gradients (the host ones are overwritten each step)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Gradients to host, AdamW on host, parameters back to the device."""
        copies = []
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None  # AdamW skips parameters without a gradient, as on the device
                continue
            host = torch.empty(m.shape, dtype=torch.float32, pin_memory=m.is_pinned())
            host.copy_(p.grad, non_blocking=p.grad.is_cuda)
            m.grad = host
            copies.append(p.grad.numel() * p.grad.element_size())
        if any(p.is_cuda for p in self.params):
            torch.cuda.current_stream().synchronize()  # the host step reads the gradients
        self.bytes_to_host += sum(copies)
        self.host_optimizer.step()
        for p, m in zip(self.params, self.masters):
            if m.grad is None:
                continue
            # clone on CPU so the device parameter never shares the master's storage
            p.copy_(m if p.is_cuda else m.detach().clone(), non_blocking=p.is_cuda)
            self.bytes_to_device += p.numel() * p.element_size()
