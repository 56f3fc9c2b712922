"""The optimizers the project models, and what each keeps per parameter: one table for the
memory analysis (:mod:`passes.analysis.step_simulation`), the cost model
(:mod:`partitioner.cost.cost_model`) and the front doors' ``optimizer=`` check.
"""
from __future__ import annotations

from dataclasses import dataclass

from passes.ir.errors import ConfigError

STATE_BYTES = 4
"""Bytes of one element of optimizer state: torch.optim keeps moments and momentum in fp32
(the parameter's dtype, and fp32 master weights under mixed precision)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerModel:
    """Memory of one optimizer, as ``torch.optim`` implements it.

    * ``state_tensors``: per-element state tensors per parameter (Adam: ``exp_avg`` and
      ``exp_avg_sq``; SGD with momentum: ``momentum_buffer``; plain SGD: none). Each has the
      parameter's dtype (fp32 with mixed precision).
    * ``step_tensor``: a 0-dim fp32 ``step`` per parameter (Adam/AdamW), counted because
      ``MemTracker`` counts it.
    * ``sqrt_temporaries``: the update computes ``exp_avg_sq.sqrt() / c`` — two parameter-sized
      temporaries live at once in the single-tensor (CPU) implementation, one buffer the size of
      all parameters in the ``foreach`` (CUDA) implementation; none in the fused kernel, which
      updates each element in place (:meth:`temporaries`).
    * ``fused``: a run by this name builds torch's fused kernel (``fused=True``) where every
      parameter it steps is a floating-point tensor on a device of :data:`FUSED_DEVICES`.
    """

    name: str
    state_tensors: int
    step_tensor: bool
    sqrt_temporaries: bool
    torch_class: str
    """The ``torch.optim`` class a run by this name builds (``optimizer="sgd"``: ``torch.optim.SGD``)."""
    torch_kwargs: tuple[tuple[str, float], ...] = ()
    """Keyword arguments it is built with besides torch's defaults (SGD with momentum: 0.9)."""
    fused: bool = False
    """Built with torch's fused kernel where the parameters allow it (see above)."""

    def implementation(self, device: str) -> str:
        """What runs the step on a ``device`` type: ``fused``, ``foreach`` (torch's default on
        CUDA) or ``single-tensor`` (its default elsewhere)."""
        if self.fused and device in FUSED_DEVICES:
            return "fused"
        return "foreach" if device == "cuda" else "single-tensor"

    def temporaries(self, device: str) -> bool:
        """Whether the step on a ``device`` type makes the ``sqrt_temporaries``."""
        return self.sqrt_temporaries and self.implementation(device) != "fused"

    @property
    def state_bytes_per_element(self) -> int:
        """Bytes of optimizer state per parameter element (fp32 moments or momentum)."""
        return self.state_tensors * STATE_BYTES


OPTIMIZERS: dict[str, OptimizerModel] = {
    # "sgd" is SGD without momentum (torch's default): no state, in-place update, no temporaries.
    "sgd": OptimizerModel(name="sgd", state_tensors=0, step_tensor=False, sqrt_temporaries=False, torch_class="SGD"),
    "sgd_momentum": OptimizerModel(name="sgd_momentum", state_tensors=1, step_tensor=False, sqrt_temporaries=False,
                                   torch_class="SGD", torch_kwargs=(("momentum", 0.9),)),
    # Adam and AdamW run torch's fused kernel (as torchtitan's default configuration does): one
    # pass over each tensor's elements, no temporaries; on CPU 5 to 8x faster than the default
    # single-tensor loop (1.6 against 7.6 ms on 100 small tensors, 0.12 against 0.92 s on GPT-2 small). The "_unfused" names are torch's default implementation
    # (single-tensor on CPU, foreach on CUDA), what a factory that does not ask for fused builds.
    "adam": OptimizerModel(name="adam", state_tensors=2, step_tensor=True, sqrt_temporaries=True, torch_class="Adam",
                           fused=True),
    "adamw": OptimizerModel(name="adamw", state_tensors=2, step_tensor=True, sqrt_temporaries=True,
                            torch_class="AdamW", fused=True),
    "adam_unfused": OptimizerModel(name="adam_unfused", state_tensors=2, step_tensor=True, sqrt_temporaries=True,
                                   torch_class="Adam"),
    "adamw_unfused": OptimizerModel(name="adamw_unfused", state_tensors=2, step_tensor=True, sqrt_temporaries=True,
                                    torch_class="AdamW"),
}
"""Every optimizer a run can name (``Training(optimizer="sgd")``, ``--optimizer sgd``), under that name."""

FUSED_DEVICES = ("cpu", "cuda")
"""Device types on which a ``fused`` optimizer is built with torch's fused kernel; elsewhere (the
meta device, others) torch's default implementation runs."""


def optimizer_model(name: str) -> OptimizerModel:
    """The :class:`OptimizerModel` of ``name``, or a :class:`ConfigError` naming the choices."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]
