"""The model a user trains, ready to capture: a :class:`ModelSpec` bundles the module with its
inputs (named symbolic dims) and its loss, so that capture sees one training step:
``loss = spec.loss(module, *inputs)``. :mod:`partitioner.inputs.models` makes one from any form a
user gives a model (a zoo spec string, ``path/to/file.py:factory``, a module).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from passes.ir.errors import ModelSpecError
from passes.ir.meta import InputSpec

LossFn = Callable[..., torch.Tensor]


@dataclass(kw_only=True)
class ModelSpec:
    """A model ready to capture.

    * ``module``: the user's ``nn.Module`` (on any device, ``meta`` included).
    * ``inputs``: every tensor the training step takes, model inputs and targets alike.
    * ``loss``: ``loss(module, *inputs) -> scalar tensor``; the step that capture records.
    * ``dims``: default value of every named dim (e.g. ``{"batch": 2, "seq": 64}``): the sizes
      capture traces with (the dims stay symbolic); ``batch`` defaults to 2.
    * ``name``: what plans and dumps call the model (default: the module's class name).

    A module of your own goes to every front door as one::

        ModelSpec(module=model, inputs=(InputSpec(name="x", shape=("batch", 32)),),
                  loss=lambda m, x: m(x).pow(2).mean())
    """

    module: nn.Module
    inputs: tuple[InputSpec, ...]
    loss: LossFn
    dims: dict[str, int] = field(default_factory=dict)
    name: str = ""
    source: str = field(default="", repr=False, compare=False)
    """The zoo spec string :func:`partitioner.inputs.models.build_model` built the module from
    (empty for a module of your own): a capture of its meta module is a function of it alone,
    which :func:`partitioner.compile.build.capture_training_step` remembers."""

    def __post_init__(self) -> None:
        # checked here, where every front door builds one, so a wrong field is named before any work
        if not isinstance(self.module, nn.Module):
            raise ModelSpecError(f"{self.name}: ModelSpec.module is {type(self.module).__name__}, not a torch.nn.Module; "
                                 f"pass the model itself (module=MyModel())")
        if not self.name:
            self.name = type(self.module).__name__
        if isinstance(self.inputs, list):
            self.inputs = tuple(self.inputs)
        if not isinstance(self.inputs, tuple) or not all(isinstance(i, InputSpec) for i in self.inputs):
            raise ModelSpecError(f"{self.name}: ModelSpec.inputs must be a tuple of InputSpec (one per tensor the step "
                                 f"takes, e.g. InputSpec(name='x', shape=('batch', 128))), got {type(self.inputs).__name__}")
        if not callable(self.loss):
            raise ModelSpecError(f"{self.name}: ModelSpec.loss is {type(self.loss).__name__}, not callable; pass "
                                 f"loss(module, *inputs) -> scalar tensor")
        if "batch" not in self.dims and any("batch" in i.dim_names() for i in self.inputs):
            self.dims = {"batch": 2, **self.dims}  # capture traces at an example size; batch stays symbolic

    def cast(self, dtype: torch.dtype) -> ModelSpec:
        """This model trained in ``dtype``: the module's floating parameters and buffers are cast
        in place (as ``module.to(dtype)``) and the floating inputs declared in ``dtype``; integer
        inputs (token ids, labels) keep theirs. Returns the spec with the retyped inputs."""
        self.module.to(dtype=dtype)
        inputs = tuple(dataclasses.replace(i, dtype=dtype) if i.dtype.is_floating_point else i for i in self.inputs)
        return dataclasses.replace(self, inputs=inputs)

    def example_inputs(self, dims: dict[str, int] | None = None, *, device: str | torch.device = "cpu",
                       seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Random tensors matching ``inputs`` with named dims set from ``dims`` (or defaults)."""
        values = {**self.dims, **(dims or {})}
        gen = torch.Generator().manual_seed(seed)
        out = []
        for spec in self.inputs:
            shape = []
            for d in spec.shape:
                if isinstance(d, str):
                    if d not in values:
                        raise ModelSpecError(f"input {spec.name!r} needs a value for dim {d!r}; pass dims={{{d!r}: N}}")
                    shape.append(values[d])
                else:
                    shape.append(d)
            if spec.dtype.is_floating_point:
                t = torch.randn(shape, generator=gen, dtype=spec.dtype)
            else:
                t = torch.randint(0, spec.high or 2, shape, generator=gen, dtype=spec.dtype)
            out.append(t.to(device))
        return tuple(out)


def meta_copy(spec: ModelSpec) -> ModelSpec:
    """The same model on the meta device (no weights): what analysis and profiling read. Tied
    weights stay tied (one parameter under several names), so they are counted once."""
    module = copy.deepcopy(spec.module)  # deepcopy keeps ties; ``.to("meta")`` below does not
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    module = module.to("meta")  # one new meta parameter per owning module: the ties break here
    for names in aliases.values():
        shared = module.get_parameter(names[0])
        for alias in names[1:]:
            owner, _, leaf = alias.rpartition(".")
            setattr(module.get_submodule(owner), leaf, shared)
    return ModelSpec(name=spec.name, module=module, inputs=spec.inputs, loss=spec.loss, dims=dict(spec.dims))
