"""annotate_shapes on small hand-built graphs: concrete and symbolic shapes, dtypes, sizes."""
import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_model
from passes.ir.meta import SHAPE, InputSpec, dim_symbol

B, S = dim_symbol("batch"), dim_symbol("seq")


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def _capture(module, shape, symbolic=(), dtype=torch.float32):
    spec = InputSpec(name="x", shape=shape, dtype=dtype)
    return capture_model(module, inputs=(spec,), dims={"batch": 4, "seq": 6}, symbolic=symbolic)


def _by_name(gm):
    return {n.name: n for n in gm.graph.nodes}


def test_concrete_shapes_and_dtypes():
    gm = annotate_shapes(_capture(TwoLinear(), ("batch", 8)))
    nodes = _by_name(gm)
    assert nodes["x"].meta[SHAPE].tensor.shape == (4, 8)
    assert nodes["linear"].meta[SHAPE].tensor.shape == (4, 32)
    assert nodes["relu"].meta[SHAPE].tensor.dtype == torch.float32
    assert nodes["linear_1"].meta[SHAPE].tensor.shape == (4, 8)
    assert nodes["up_weight"].meta[SHAPE].tensor.requires_grad
    assert not nodes["x"].meta[SHAPE].tensor.requires_grad
    # every node but the output carries shape facts
    assert all(SHAPE in n.meta for n in gm.graph.nodes if n.op != "output")


def test_symbolic_dims_stay_symbolic():
    gm = annotate_shapes(_capture(TwoLinear(), ("batch", "seq", 8), symbolic=("batch", "seq")))
    nodes = _by_name(gm)
    out = nodes["linear_1"].meta[SHAPE].tensor
    assert out.shape == (B, S, 8)
    assert sympy.expand(out.nbytes - 32 * B * S) == 0  # 8 fp32 elements per (batch, seq)
    assert nodes["linear"].meta[SHAPE].tensor.numel == 32 * B * S


def test_multi_output_and_size_nodes():
    class Split(nn.Module):
        def forward(self, x):
            a, b = x.split(x.shape[-1] // 2, dim=-1)
            return (a * b).view(x.shape[0], -1)

    gm = annotate_shapes(_capture(Split(), ("batch", "seq", 8), symbolic=("batch", "seq")))
    split = next(n for n in gm.graph.nodes if "split" in n.name)
    assert [t.shape for t in split.meta[SHAPE].tensors] == [(B, S, 4), (B, S, 4)]
    sizes = [n.meta[SHAPE].value for n in gm.graph.nodes if n.op == "call_function" and "sym_size" in n.name]
    assert B in sizes
    view = next(n for n in gm.graph.nodes if n.name.startswith("view"))
    assert view.meta[SHAPE].tensor.shape == (B, 4 * S)


def test_bf16_dtype_propagates():
    gm = annotate_shapes(_capture(TwoLinear().to(torch.bfloat16), ("batch", 8), dtype=torch.bfloat16))
    assert _by_name(gm)["linear_1"].meta[SHAPE].tensor.dtype == torch.bfloat16
    assert _by_name(gm)["linear_1"].meta[SHAPE].tensor.nbytes == 4 * 8 * 2


@pytest.mark.parametrize("spec", [
    "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8",
    "llama:layers=1,hidden=32,heads=2,vocab=64,seq=8",
    "hf-gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=16,seq=8",
    "resnet",
])
def test_symbolic_shapes_from_export_equal_the_symbolic_fake_run(spec):
    # a fresh capture takes its symbolic shapes from export and requires_grad from a run at the hints
    import copy

    from partitioner.compile.build import capture_training_step
    from partitioner.inputs.models import build_model
    from passes.analysis import annotate_shapes as shapes

    gm = capture_training_step(build_model(spec))
    fast = shapes._from_export(gm, gm.meta["capture"])
    assert fast is not None
    slow_gm = copy.deepcopy(gm)
    fake, results = shapes._run(slow_gm, slow_gm.meta["capture"])
    slow = {n.name: shapes.shape_meta(fake, v) for n, v in results.items()}
    assert {n.name: m for n, m in fast.items()} == slow
    assert any(t.requires_grad for m in fast.values() for t in m.tensors)


def test_a_graph_of_a_signature_seen_recently_gets_its_fake_run_again(monkeypatch):
    """The last few concrete fake runs are remembered by what they depend on: a copy of a graph
    run two graphs ago gets that run (its own nodes), even after the original changed; another
    graph runs anew."""
    import copy

    from passes.analysis import saved_tensors

    made = []
    fake_context = saved_tensors.fake_context
    monkeypatch.setattr(saved_tensors, "fake_context", lambda info: made.append(info) or fake_context(info))
    monkeypatch.setattr(saved_tensors, "_RECENT_RUNS", [])
    first = _capture(TwoLinear(), ("batch", 8))
    twin = copy.deepcopy(first)
    other = _capture(nn.Sequential(nn.Linear(8, 4)), ("batch", 8))
    saved_tensors.fake_forward_run(first)
    saved_tensors.fake_forward_run(other)
    relu = next(n for n in first.graph.nodes if n.name == "relu")
    with first.graph.inserting_after(relu):  # the original changes after its run
        first.graph.call_function(torch.ops.aten.neg.default, (relu,))
    run = saved_tensors.fake_forward_run(twin)
    assert len(made) == 2  # the twin ran nothing
    assert {n for n in twin.graph.nodes if n.op != "output"} <= set(run.values)
    assert all(n.graph is twin.graph for n in run.values)  # the twin's nodes, not the changed original's
    assert {n.name: tuple(v.shape) for n, v in run.values.items() if isinstance(v, torch.Tensor)}["linear"] == (4, 32)
    saved_tensors.fake_forward_run(first)  # changed: a new signature
    assert len(made) == 3
