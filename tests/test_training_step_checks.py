"""A user's model and loss are checked at capture: a loss that is not a scalar and a model with
nothing to train are refused; Python side effects in forward (which run only while capturing)
are warned about once; the zoo's models capture without a warning."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from partitioner.compile.build import capture_training_step
from partitioner.inputs.model_spec import ModelSpec
from partitioner.inputs.models import build_model
from passes.ir.errors import CaptureError, ConfigError
from passes.ir.meta import InputSpec
from passes.capture.training_step_checks import SideEffectWarning


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0
        self.seen: list = []
        self.mode = "quiet"

    def forward(self, x):
        if self.mode == "print":
            print("forward")
        elif self.mode == "count":
            self.calls += 1
        elif self.mode == "append":
            self.seen.append(x.shape)
        return self.fc(x)


def _spec(net: nn.Module, loss) -> ModelSpec:
    return ModelSpec(name="net", module=net, inputs=(InputSpec(name="x", shape=("batch", 8)),), loss=loss,
                     dims={"batch": 2})


def _mean(m, x):
    return m(x).square().mean()


def test_a_loss_that_is_not_a_scalar_is_refused_with_its_shape():
    with pytest.raises(CaptureError, match=r"the loss has shape \(batch, 4\), not a scalar; reduce it"):
        capture_training_step(_spec(Net(), lambda m, x: m(x)))
    with pytest.raises(CaptureError, match="returned 2 values"):
        capture_training_step(_spec(Net(), lambda m, x: (m(x).mean(), m(x).sum())))


def test_a_model_with_nothing_to_train_is_refused():
    net = Net().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters.*requires_grad_"):
        capture_training_step(_spec(net, _mean))


@pytest.mark.parametrize("mode, what", [("print", r"print\(\) ran \d+ time"), ("count", "changed: calls"),
                                        ("append", "changed: seen")])
def test_side_effects_in_forward_are_warned_about_once(mode, what):
    net = Net()
    net.mode = mode
    with pytest.warns(SideEffectWarning, match=f"only while the model is captured.*{what}") as record:
        capture_training_step(_spec(net, _mean))
    assert len([w for w in record if issubclass(w.category, SideEffectWarning)]) == 1


@pytest.mark.parametrize("model", ["gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
                                   "hf-gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,seq=8",
                                   "mlp"])
def test_the_zoo_captures_without_a_side_effect_warning(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)
        capture_training_step(build_model(model))
    quiet = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)
        capture_training_step(_spec(quiet, _mean))
    assert torch.is_tensor(quiet.fc.weight)


def test_a_zoo_model_on_the_meta_device_is_captured_once_per_process():
    """Its capture is a function of the spec string, dtype and dims: the second front door gets a
    copy of the first's graph (its own: a pass that rewrites it leaves the next caller's alone);
    a model with weights, or a module of the user's own, is captured every time."""
    from passes.capture.capture import capture_count

    spec = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
    first = capture_training_step(build_model(spec, device="meta"))
    before = capture_count()
    second = capture_training_step(build_model(spec, device="meta"))
    assert capture_count() == before and second is not first
    assert [(n.op, str(n.target)) for n in second.graph.nodes] == [(n.op, str(n.target)) for n in first.graph.nodes]
    next(n for n in second.graph.nodes if n.op == "call_function").meta["mark"] = True
    assert not any("mark" in n.meta for n in first.graph.nodes)
    capture_training_step(build_model(spec, device="meta", dtype=torch.bfloat16))  # another dtype: captured
    capture_training_step(build_model(spec))  # weights: captured
    assert capture_count() == before + 2
    own = build_model(spec, device="meta")
    capture_training_step(ModelSpec(module=own.module, inputs=own.inputs, loss=own.loss, dims=own.dims, name=spec))
    assert capture_count() == before + 3


def test_a_zoo_model_on_the_meta_device_is_analysed_once_per_optimizer_and_dtype(monkeypatch):
    """The symbolic analysis of a capture is cached like the capture: the second dry run of one
    model gets a copy of the first's analysed graph (the same memory facts, its own objects);
    another optimizer, or a module of the user's own, is analysed again."""
    from partitioner.compile import build
    from passes.ir.meta import MEMORY

    calls = []
    real = build.run_analysis_passes
    monkeypatch.setattr(build, "run_analysis_passes", lambda gm, **kw: calls.append(kw) or real(gm, **kw))
    spec = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
    first = build.analysed_training_step(build_model(spec, device="meta"), device="cpu", optimizer="sgd")
    second = build.analysed_training_step(build_model(spec, device="meta"), device="cpu", optimizer="sgd")
    assert len(calls) == 1 and second is not first
    memory = [(n.name, n.meta[MEMORY]) for n in first.graph.nodes if MEMORY in n.meta]
    assert memory and memory == [(n.name, n.meta[MEMORY]) for n in second.graph.nodes if MEMORY in n.meta]
    assert all(a is not b for a, b in zip(first.graph.nodes, second.graph.nodes))
    build.analysed_training_step(build_model(spec, device="meta"), device="cpu", optimizer="adamw")
    own = build_model(spec, device="meta")
    build.analysed_training_step(ModelSpec(module=own.module, inputs=own.inputs, loss=own.loss, dims=own.dims,
                                           name=spec), device="cpu", optimizer="sgd")
    assert len(calls) == 3
