"""The zoo ``moe`` spec: builds, trains like a plain module, its load-balancing loss is exact, and
``partitioner.analyze`` captures it."""

import pytest
import torch
import torch.nn.functional as F

import partitioner
from partitioner.errors import ModelSpecError
from partitioner.inputs.models import build_model

SPEC = "moe:layers=2,hidden=32,heads=4,vocab=64,seq=8,experts=4,top_k=2,expert_hidden=48,shared_experts=1,aux_loss=0.01"


def test_moe_trains_loss_falls():
    torch.manual_seed(0)
    spec = build_model(SPEC)
    xs = spec.example_inputs()
    opt = torch.optim.AdamW(spec.module.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = spec.loss(spec.module, *xs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_aux_loss_is_exact_against_a_hand_computation():
    torch.manual_seed(1)
    spec = build_model(SPEC + ",activation=gelu")
    model = spec.module.eval()
    idx, targets = spec.example_inputs()
    logits_seen = []
    hooks = [b.moe.router.register_forward_hook(lambda m, i, o: logits_seen.append(o.detach()))
             for b in model.blocks]
    logits, aux = model(idx)
    for h in hooks:
        h.remove()
    expected = 0.0
    for router_logits in logits_seen:  # per layer: E * sum_e f_e * P_e, by loops
        rows = router_logits.reshape(-1, 4).double().softmax(-1).tolist()
        counts, psum = [0] * 4, [0.0] * 4
        for row in rows:
            for e in sorted(range(4), key=lambda e: -row[e])[:2]:
                counts[e] += 1
            for e in range(4):
                psum[e] += row[e]
        expected += 4 * sum(counts[e] / len(rows) * psum[e] / len(rows) for e in range(4))
    assert aux.item() == pytest.approx(expected, rel=1e-5)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    assert spec.loss(model, idx, targets).item() == pytest.approx((ce + 0.01 * aux).item(), rel=1e-6)


def test_moe_layer_is_the_exact_top_k_mixture():
    torch.manual_seed(2)
    moe = build_model(SPEC).module.blocks[0].moe
    x = torch.randn(2, 8, 32)
    out, _ = moe(x)
    probs = moe.router(x).softmax(-1)
    w, i = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for b in range(2):
        for s in range(8):
            for j in range(2):
                ref[b, s] += w[b, s, j] * moe.experts[int(i[b, s, j])](x[b, s])
            ref[b, s] += moe.shared[0](x[b, s])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_analyze_captures_the_spec():
    a = partitioner.analyze(SPEC)
    assert a.fwd_flops > 0 and a.param_count > 0


def test_top_k_above_experts_is_refused():
    with pytest.raises(ModelSpecError, match="top_k=5 exceeds experts=4"):
        build_model("moe:experts=4,top_k=5")


@pytest.mark.parametrize("spec", ["hf-mixtral", "hf-qwen3-moe", "hf-lfm2-moe", "hf-deepseek-v3"])
def test_hf_moe_specs_profile_on_the_meta_device(spec):
    """The planner's profile builds the model on the meta device, where transformers counts tokens
    per expert with an integer histc (the CPU kernel refuses it): the capture counts in float32 on
    cpu, and a bare name takes its layer count from the spec's defaults."""
    from partitioner.search.profile import profile_model
    from partitioner.zoo.registry import MIXED_LAYERS, TABLES

    profile = profile_model(spec, dtype="fp32")
    assert len(profile.blocks) == TABLES[spec][1]["num_hidden_layers"]
    assert profile.param_count > 0 and all(b.fwd_flops > 0 for b in profile.blocks)
    if spec in MIXED_LAYERS:  # captured whole: the dense first layer is not a copy of an MoE one
        assert profile.blocks[0].param_count != profile.blocks[-1].param_count


def test_the_capture_counts_an_integer_histc_in_float_on_cpu():
    from torch import fx

    from passes.capture.capture import _count_integer_histc_in_float

    graph = fx.Graph()
    ids = graph.placeholder("ids")
    ids.meta["val"] = torch.zeros(6, dtype=torch.int32)
    counts = graph.call_function(torch.ops.aten.histc.default, (ids, 4, 0, 3))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (counts, 1)))
    _count_integer_histc_in_float(graph)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    out = gm(torch.tensor([0, 1, 1, 3, 3, 3], dtype=torch.int32))
    assert out.dtype == torch.int32 and out.tolist() == [2, 3, 1, 4]
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten._to_copy.default, torch.ops.aten.histc.default, torch.ops.aten._to_copy.default,
                   torch.ops.aten.add.Tensor]
