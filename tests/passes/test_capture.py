"""capture: every zoo and HF model captures with symbolic dims, and the captured step is eager's step
(same loss, same gradients, bit for bit, on inputs of other sizes than the capture's hints);
models that cannot be captured fail with a CaptureError naming module, source line and fix."""
import inspect

import pytest
import torch
from torch import nn

from partitioner.errors import CaptureError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_model, capture_spec
from passes.ir.meta import CAPTURE, SHAPE, InputSpec, dim_symbol

SEQ = ("batch", "seq")
# Dropout stays on where the model has it: the tests reseed before each call, and the captured
# graph draws the same random numbers in the same order as eager.
CASES = [
    ("gpt:layers=2,hidden=64,heads=2,vocab=100,seq=32,dropout=0.1", SEQ),
    ("llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=100,seq=32", SEQ),
    ("bert:layers=2,hidden=64,heads=2,vocab=100,seq=32,dropout=0.1", SEQ),
    ("mlp:layers=2,hidden=32,in_features=16,out_features=4", ("batch",)),
    ("mlp:layers=1,hidden=32,in_features=16,out_features=4,loss=ce", ("batch",)),
    ("resnet:blocks=1-1,widths=8-16,image=16,classes=5", ("batch",)),
    ("hf-gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=100,n_positions=64", SEQ),
    ("hf-llama", SEQ),
    # HF BERT slices a position buffer, so export bounds seq <= max_position_embeddings; capture
    # accepts that range and seq stays symbolic.
    ("hf-bert:hidden_dropout_prob=0.1,attention_probs_dropout_prob=0.1", SEQ),
    # MoE routed by biased sigmoid scores: short convolutions among attention (LFM2-MoE); latent
    # attention, expert groups and a shared expert (DeepSeek-V3)
    ("hf-lfm2-moe", SEQ),
    ("hf-deepseek-v3", SEQ),
]
# Sizes other than every model's default hints (batch=2/8, seq=32): the graph must be symbolic.
RUN_DIMS = {"batch": 3, "seq": 24}


@pytest.fixture(scope="module", params=CASES, ids=[c[0].split(":")[0] + ("-ce" if "loss=ce" in c[0] else "")
                                                   for c in CASES])
def captured(request):
    text, symbolic = request.param
    if text.startswith("hf-"):
        pytest.importorskip("transformers")
    spec = build_model(text)
    gm = capture_spec(spec, symbolic=symbolic)
    return spec, gm, symbolic


def _step(fn, inputs, seed=1234):
    torch.manual_seed(seed)
    return fn(*inputs)


def test_loss_matches_eager(captured):
    spec, gm, _ = captured
    inputs = spec.example_inputs(RUN_DIMS, seed=1)
    with torch.no_grad():
        graph_loss = _step(gm, inputs)
        eager_loss = _step(lambda *x: spec.loss(spec.module, *x), inputs)
    assert graph_loss.shape == ()
    assert torch.equal(graph_loss, eager_loss), (graph_loss.item(), eager_loss.item())


def test_gradients_match_eager(captured):
    spec, gm, _ = captured
    inputs = spec.example_inputs(RUN_DIMS, seed=2)

    def grads(run, module):
        spec.module.zero_grad(set_to_none=True)
        _step(run, inputs).backward()
        return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}

    from_graph = grads(gm, gm)
    from_eager = grads(lambda *x: spec.loss(spec.module, *x), spec.module)
    # Parameters keep the user's names, and every trainable one gets a gradient.
    assert from_graph.keys() == from_eager.keys() == {n for n, p in spec.module.named_parameters()}
    for name, grad in from_eager.items():
        assert torch.allclose(from_graph[name], grad, rtol=1e-6, atol=1e-9), name


def test_capture_takes_no_stack_traces_and_leaves_the_setting_as_it_was(captured):
    # a stack trace per node was a fifth of a capture's CPU; nothing reads them
    _, gm, _ = captured
    traced = [n.name for n in gm.graph.nodes if "runtime_assert" not in (n.meta.get("stack_trace") or "runtime_assert")]
    assert not traced  # export's own runtime asserts, added after tracing, carry torch's frame
    assert torch.fx.config.do_not_emit_stack_traces is False


def test_dims_stay_symbolic(captured):
    spec, gm, symbolic = captured
    assert gm.meta[CAPTURE].symbolic == tuple(sorted(symbolic))
    annotate_shapes(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == [s.name for s in spec.inputs]
    for node, input_spec in zip(placeholders, spec.inputs):
        expected = tuple(dim_symbol(d) if isinstance(d, str) else d for d in input_spec.shape)
        assert node.meta[SHAPE].tensors[0].shape == expected, node.name
    # The loss is a scalar; some activation is sized by every symbolic dim.
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert output.args[0].meta[SHAPE].tensors[0].shape == ()
    syms = {dim_symbol(d) for d in symbolic}
    assert any(syms <= set().union(*(_free_symbols(s) for s in t.shape))
               for n in gm.graph.nodes if n.op == "call_function" and SHAPE in n.meta
               for t in n.meta[SHAPE].tensors)


def _free_symbols(expr):
    return getattr(expr, "free_symbols", set())


def test_batchnorm_running_stats_update_in_graph():
    spec = build_model("resnet:blocks=1,widths=8,image=8,classes=3")
    gm = capture_spec(spec, symbolic=("batch",))
    bn = spec.module.stem[1]
    before = bn.running_mean.clone()
    gm(*spec.example_inputs({"batch": 4}))
    assert not torch.equal(before, bn.running_mean)
    assert int(bn.num_batches_tracked) == 1


# --- bad input ------------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self, branch: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.branch = branch

    def forward(self, x):
        if self.branch and x.sum() > 0:  # data-dependent: export cannot trace this
            return self.lin(x)
        return self.lin(x) * 2


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Branchy(False), _Branchy(True), _Branchy(False)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _line_of(fn, needle):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if needle in line)


def test_data_dependent_branch_names_module_line_and_fix():
    with pytest.raises(CaptureError) as err:
        capture_model(_Blocks(), inputs=(InputSpec(name="x", shape=("batch", 8)),), dims={"batch": 4},
                      symbolic=("batch",))
    msg = str(err.value)
    assert "module 'blocks.1'" in msg
    assert f"{__file__}:{_line_of(_Branchy.forward, 'x.sum() > 0')}" in msg
    assert "x.sum() > 0" in msg
    assert "Fix:" in msg and "torch.cond" in msg


class _FixedBatch(nn.Module):
    def forward(self, x):
        return x.reshape(4, -1).sum()  # hard-codes batch=4


def test_specialized_symbolic_dim_says_which_and_how_to_fix():
    with pytest.raises(CaptureError) as err:
        capture_model(_FixedBatch(), inputs=(InputSpec(name="x", shape=("batch", 8)),), dims={"batch": 4},
                      symbolic=("batch",))
    msg = str(err.value)
    assert "batch" in msg and "constant (4)" in msg
    assert "drop it from symbolic=" in msg


def test_unknown_symbolic_dim_and_tiny_hint_are_rejected():
    spec = build_model("mlp:layers=1,hidden=8,in_features=4,out_features=2")
    with pytest.raises(CaptureError, match=r"symbolic dim\(s\) \['seq'\] appear in no input"):
        capture_spec(spec, symbolic=("seq",))
    with pytest.raises(CaptureError, match="use 2 or more"):
        capture_spec(spec, dims={"batch": 1}, symbolic=("batch",))
