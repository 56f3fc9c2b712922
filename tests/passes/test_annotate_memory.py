"""annotate_memory on tiny hand-built modules: saved bytes, model-state formulas, peak, errors.

Every expected number below is computed by hand in the comment next to it (fp32 = 4 bytes).
"""
import pytest
import sympy
import torch.nn.functional as F
from torch import nn

from partitioner.errors import ConfigError
from passes.analysis.annotate_memory import annotate_memory
from passes.capture.capture import capture_model
from passes.ir.meta import MEMORY, MEMORY_SUMMARY, InputSpec, dim_symbol

B = dim_symbol("batch")


class LinearRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return F.relu(self.fc(x))


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def _sum_loss(model, x):
    return model(x).sum()


def _annotate(module, *, symbolic=(), batch=4, **kwargs):
    gm = capture_model(module, inputs=(InputSpec(name="x", shape=("batch", 8)),), dims={"batch": batch},
                       loss=_sum_loss, symbolic=symbolic)
    return annotate_memory(gm, **kwargs)


def _nodes(gm):
    return {n.name: n for n in gm.graph.nodes}


def test_linear_relu_saves_input_and_relu_output():
    gm = _annotate(LinearRelu())
    nodes, summary = _nodes(gm), gm.meta[MEMORY_SUMMARY]
    # addmm keeps x (4x8 floats = 128 B) for the weight gradient; relu keeps its output (4x16 = 256 B);
    # the linear output is used only by relu, which does not need it.
    assert summary.input_bytes == 128
    assert summary.activation_bytes == 256
    assert nodes["x"].meta[MEMORY].kept_bytes == 128
    assert nodes["relu"].meta[MEMORY].kept_bytes == 256
    assert nodes["linear"].meta[MEMORY].kept_bytes == 0
    assert nodes["linear"].meta[MEMORY].output_bytes == 256
    assert [(s.owner, s.nbytes) for s in nodes["linear"].meta[MEMORY].saved] == [("x", 128)]
    assert [(s.owner, s.nbytes) for s in nodes["relu"].meta[MEMORY].saved] == [("relu", 256)]
    # Parameters are model state, never saved activations.
    assert all(s.owner not in ("fc_weight", "fc_bias") for n in gm.graph.nodes for s in n.meta[MEMORY].saved)


def test_shared_storage_counted_once():
    gm = _annotate(TwoLayer())
    nodes, summary = _nodes(gm), gm.meta[MEMORY_SUMMARY]
    # relu's output (4x16 = 256 B) is saved by relu and by the second linear: one storage.
    assert summary.activation_bytes == 256
    assert [s.owner for s in nodes["linear_1"].meta[MEMORY].saved] == ["relu"]
    assert nodes["relu"].meta[MEMORY].kept_bytes == 256


def test_symbolic_batch():
    gm = _annotate(TwoLayer(), symbolic=("batch",))
    summary = gm.meta[MEMORY_SUMMARY]
    assert summary.activation_bytes == 64 * B  # 16 floats per row
    assert summary.input_bytes == 32 * B  # 8 floats per row
    assert summary.param_bytes == 4 * (8 * 16 + 16 + 16 * 4 + 4)


def test_dropout_noise_is_internal_to_dropout():
    gm = _annotate(Drop())
    nodes = _nodes(gm)
    # CPU eager dropout computes x * noise and keeps the fp32 noise (4x8 floats = 128 B), owned by
    # the dropout node itself; the linear output is not kept.
    assert [(s.owner, s.nbytes) for s in nodes["dropout"].meta[MEMORY].saved] == [("dropout", 128)]
    assert nodes["dropout"].meta[MEMORY].kept_bytes == 128
    assert nodes["linear"].meta[MEMORY].kept_bytes == 0


N_TWO_LAYER = 8 * 16 + 16 + 16 * 4 + 4  # 212 parameter elements in 4 tensors


@pytest.mark.parametrize("optimizer, opt_bytes", [
    ("sgd", 0),  # no momentum: no state
    ("sgd_momentum", 4 * N_TWO_LAYER),  # momentum_buffer
    ("adam", 8 * N_TWO_LAYER + 4 * 4),  # exp_avg + exp_avg_sq, and a 4-byte step per tensor
    ("adamw", 8 * N_TWO_LAYER + 4 * 4),
])
def test_model_state_fp32(optimizer, opt_bytes):
    gm = _annotate(TwoLayer(), optimizer=optimizer)
    s = gm.meta[MEMORY_SUMMARY]
    assert s.param_count == N_TWO_LAYER
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (4 * N_TWO_LAYER, 4 * N_TWO_LAYER, opt_bytes)
    nodes = _nodes(gm)
    assert nodes["up_weight"].meta[MEMORY].param_bytes == 4 * 8 * 16
    assert nodes["up_bias"].meta[MEMORY].grad_bytes == 4 * 16
    assert sum(n.meta[MEMORY].optimizer_bytes for n in gm.graph.nodes) == opt_bytes


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_adam_is_16_bytes_per_parameter(dtype):
    gm = _annotate(TwoLayer(), optimizer="adam", dtype=dtype)
    s = gm.meta[MEMORY_SUMMARY]
    # bf16 param 2 + bf16 grad 2 + fp32 master 4 + fp32 Adam moments 8 = 16 bytes per element,
    # plus the 4-byte step tensor of each of the 4 parameters.
    assert (s.param_bytes, s.grad_bytes) == (2 * N_TWO_LAYER, 2 * N_TWO_LAYER)
    assert s.optimizer_bytes == 12 * N_TWO_LAYER + 16
    assert s.param_bytes + s.grad_bytes + s.optimizer_bytes == 16 * N_TWO_LAYER + 16
    assert s.dtype == dtype
    assert any(n.startswith(f"dtype {dtype}: model state uses 2-byte") for n in s.notes)  # an fp32 graph


def test_tied_parameters_counted_once():
    gm = _annotate(Tied())
    s = gm.meta[MEMORY_SUMMARY]
    assert s.param_count == 64
    assert s.param_bytes == 256 and s.grad_bytes == 256
    assert sum(n.meta[MEMORY].param_bytes for n in gm.graph.nodes) == 256


def test_peak_by_hand_linear_relu_sgd():
    gm = _annotate(LinearRelu(), optimizer="sgd")
    s = gm.meta[MEMORY_SUMMARY]
    # Live throughout: W 512 + b 64 + x 128 = 704; the loss (4) from the end of forward.
    # Forward peak: linear out 256 + relu out 256 -> 1216.
    # Backward: sum's gradient is an expanded view of the 4-byte seed; relu's backward makes the
    # 256-byte input gradient and frees its saved output; linear's backward then makes the
    # weight (512) and bias (64) gradients while that 256-byte gradient is live:
    # 704 + 4 + 256 + 576 = 1540. Plain SGD updates in place: no optimizer temporaries.
    assert s.peak_bytes == 1540
    assert (s.peak_phase, s.peak_node) == ("backward", "linear")


def test_peak_fused_adamw_updates_in_place():
    gm = _annotate(LinearRelu(), optimizer="adamw", batch=2)
    s = gm.meta[MEMORY_SUMMARY]
    # The fused kernel makes no temporaries: the peak is the backward's biggest point,
    # 704 - 64 + 4 + 128 + 576 + state (2 * 576 + 2 steps * 4 = 1160) = 2508 (below).
    assert s.peak_bytes == 2508
    assert s.peak_phase == "backward"
    assert "fused implementation (cpu)" in " ".join(s.notes)


def test_peak_unfused_adamw_adds_update_temporaries():
    gm = _annotate(LinearRelu(), optimizer="adamw_unfused", batch=2)
    s = gm.meta[MEMORY_SUMMARY]
    # After backward: W 512 + b 64 + grads 576 + state (2 * 576 + 2 steps * 4 = 1160) + x 64 + loss 4
    # = 2380; updating W holds sqrt(v) and sqrt(v)/c (2 * 512) -> 3404; the biggest point of the
    # backward is 704 - 64 + 4 + 128 + 576 + 1160 = 2508, so the optimizer step is the peak.
    assert s.peak_bytes == 3404
    assert (s.peak_phase, s.peak_node) == ("optimizer", "fc_weight")


def test_every_node_annotated_and_sizes_are_sympy():
    gm = _annotate(TwoLayer())
    for node in gm.graph.nodes:
        meta = node.meta[MEMORY]
        assert isinstance(meta.kept_bytes, sympy.Expr) and isinstance(meta.output_bytes, sympy.Expr)
    assert isinstance(gm.meta[MEMORY_SUMMARY].peak_bytes, sympy.Expr)


def test_unknown_optimizer_names_choices():
    gm = capture_model(TwoLayer(), inputs=(InputSpec(name="x", shape=("batch", 8)),), dims={"batch": 2},
                       loss=_sum_loss)
    with pytest.raises(ConfigError, match="adamw.*|sgd"):
        annotate_memory(gm, optimizer="lion")
    with pytest.raises(ConfigError, match="sgd_momentum"):
        annotate_memory(gm, optimizer="lion")
