"""annotate_moe: MoE blocks recognised by structure on the zoo ``moe`` model and HF MoE models, the
FLOPs under routing (the hand formula), and nothing on a dense GPT."""

import pytest
import sympy

import partitioner
from partitioner.inputs.models import build_model
from passes.ir.meta import FLOP_SUMMARY, MOE, MOE_LAYERS

L, H, F_, E, K, B, S = 2, 32, 48, 4, 2, 2, 8
ZOO = (f"moe:layers={L},hidden={H},heads=4,vocab=64,seq={S},experts={E},top_k={K},expert_hidden={F_},"
       f"shared_experts=1,aux_loss=0.01,batch={B}")


@pytest.fixture(scope="module")
def zoo():
    return partitioner.analyze(ZOO).graph


def test_zoo_blocks_name_router_experts_top_k_shared_and_aux(zoo):
    layers = zoo.meta[MOE_LAYERS]
    assert len(layers.blocks) == L
    for i, block in enumerate(layers.blocks):
        assert block.layer == f"blocks.{i}" and block.form == "dense"
        assert block.router_weight == f"blocks.{i}.moe.router.weight"
        assert (block.experts, block.top_k, block.expert_hidden) == (E, K, F_)
        assert block.expert_params == tuple(
            tuple(f"blocks.{i}.moe.experts.{e}.{p}.weight" for p in ("down", "gate", "up")) for e in range(E))
        assert block.shared_experts == 1 and block.shared_hidden == F_
        assert block.shared_params == (tuple(f"blocks.{i}.moe.shared.0.{p}.weight" for p in ("down", "gate", "up")),)
        assert len(block.aux_loss) == 1 and block.imbalance == 1.0
        assert len(block.expert_nodes) == 3 * E
        nodes = {n.name: n for n in zoo.graph.nodes}
        assert nodes[block.router].meta[MOE].role == "router"
        assert {nodes[n].meta[MOE].expert for n in block.expert_nodes} == set(range(E))


def test_routed_flops_equal_the_hand_formula(zoo):
    summary = zoo.meta[FLOP_SUMMARY]
    tokens = B * S
    swiglu = 2 * tokens * 3 * H * F_  # one expert on every token, forward
    # dense capture: E experts on every token; routed: each expert gets tokens * K / E
    assert summary.captured_fwd - summary.fwd == L * (E - K) * swiglu
    assert summary.captured_bwd - summary.bwd == L * (E - K) * 2 * swiglu
    print(f"\nzoo moe per step: captured fwd+bwd {summary.captured_fwd + summary.captured_bwd}, "
          f"routed {summary.fwd + summary.bwd}")


def test_imbalance_scales_the_routed_experts():
    from passes.analysis.annotate_flops import annotate_flops
    from passes.analysis.annotate_moe import annotate_moe
    gm = partitioner.analyze(ZOO).graph
    before = gm.meta[FLOP_SUMMARY]
    annotate_flops(annotate_moe(gm, imbalance=1.5))
    after = gm.meta[FLOP_SUMMARY]
    routed = L * K * 2 * B * S * 3 * H * F_
    assert after.fwd - before.fwd == sympy.Rational(1, 2) * routed
    assert gm.meta[MOE_LAYERS].blocks[0].imbalance == 1.5


def test_dense_gpt_has_no_moe_meta():
    gm = partitioner.analyze("gpt:layers=2,hidden=32,heads=4,vocab=64,seq=8").graph
    assert gm.meta[MOE_LAYERS].blocks == () and gm.meta[MOE_LAYERS].aux_loss == ()
    assert not any(MOE in n.meta for n in gm.graph.nodes)
    assert gm.meta[FLOP_SUMMARY].captured_fwd is None


@pytest.mark.parametrize("spec,shared", [
    ("hf-mixtral:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
     "vocab_size=64,num_local_experts=4,num_experts_per_tok=2,intermediate_size=48,seq=8", 0),
    ("hf-qwen2-moe:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
     "vocab_size=64,num_experts=4,num_experts_per_tok=2,moe_intermediate_size=48,"
     "shared_expert_intermediate_size=64,seq=8", 1),
])
def test_hf_moe_blocks(spec, shared):
    pytest.importorskip("transformers")
    # built on CPU: on meta, transformers' aux loss picks an int32 histc fake tensors cannot run
    gm = partitioner.analyze(build_model(spec)).graph
    blocks = gm.meta[MOE_LAYERS].blocks
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        assert block.form == "gathered" and (block.experts, block.top_k, block.expert_hidden) == (4, 2, 48)
        assert block.router_weight == f"model.layers.{i}.mlp.gate.weight"
        assert block.expert_params[3] == (f"model.layers.{i}.mlp.experts.down_proj[3]",
                                          f"model.layers.{i}.mlp.experts.gate_up_proj[3]")
        assert block.shared_experts == shared and block.shared_hidden == (64 if shared else None)
        assert len(block.aux_loss) == 1  # output_router_logits: the routing recomputed for the loss
    # batched_mm runs one row per (token, choice): its bmm FLOPs are already the routed count
    tokens = 2 * 8
    expert_fwd = L * 2 * tokens * 2 * 3 * 32 * 48
    assert gm.meta[FLOP_SUMMARY].captured_fwd is None and gm.meta[FLOP_SUMMARY].fwd > expert_fwd


@pytest.mark.parametrize("spec,experts,expert_hidden,shared", [
    ("hf-lfm2-moe:seq=8", 4, 96, 0),  # sigmoid scores plus an expert bias choose; short-conv layers
    ("hf-deepseek-v3:seq=8", 8, 32, 1),  # the same, within the best expert groups; a shared expert
])
def test_hf_moe_blocks_that_choose_by_biased_scores(spec, experts, expert_hidden, shared):
    """LFM2-MoE and DeepSeek-V3 choose experts by sigmoid scores plus a per-expert bias (DeepSeek-V3
    first keeps the best expert groups, with two more top-k) and weigh them by the plain scores
    gathered at the chosen ids: one block per MoE layer (the first layer is dense), its router the
    final top-k's, no aux-loss term (the bias balances the load)."""
    pytest.importorskip("transformers")
    gm = partitioner.analyze(build_model(spec)).graph
    layers = gm.meta[MOE_LAYERS]
    assert [b.layer for b in layers.blocks] == ["model.layers.1", "model.layers.2"] and layers.aux_loss == ()
    for block in layers.blocks:
        assert block.form == "gathered" and (block.experts, block.top_k, block.expert_hidden) == (experts, 2,
                                                                                                   expert_hidden)
        assert block.router_weight.endswith(".gate.weight") and block.aux_loss == ()
        assert block.shared_experts == shared
        chosen = {n.name: n for n in gm.graph.nodes}[block.topk]
        assert not any("topk" in str(u.target) for u in chosen.users)  # the routing's own top-k
