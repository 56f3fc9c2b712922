"""annotate_flops: hand-computed counts on tiny modules, the GPT formula (concrete and symbolic),
and agreement with torch.utils.flop_counter.FlopCounterMode on every zoo model."""

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from partitioner.errors import AnalysisError
from partitioner.inputs.models import build_model, known_models
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_model, capture_spec
from passes.ir.meta import FLOP_SUMMARY, FLOPS, FlopMeta, InputSpec, dim_symbol

B, S = dim_symbol("batch"), dim_symbol("seq")


def _annotated(module, *shapes, symbolic=(), dims=None):
    inputs = tuple(InputSpec(name=f"x{i}", shape=s) for i, s in enumerate(shapes))
    gm = capture_model(module, inputs=inputs, dims=dims or {"batch": 2, "seq": 6}, symbolic=symbolic)
    return annotate_flops(annotate_shapes(gm))


def _counted(gm):
    """(target name, fwd, bwd, kind) of every node that counts FLOPs, in graph order."""
    return [(str(n.target), n.meta[FLOPS].fwd, n.meta[FLOPS].bwd, n.meta[FLOPS].kind)
            for n in gm.graph.nodes if n.meta[FLOPS].kind != "none"]


# --- hand-computed counts --------------------------------------------------------------------
class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(4, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_linear_counts_weight_grad_only_when_input_needs_no_grad():
    gm = _annotated(TwoLinear(), ("batch", 8), dims={"batch": 3})
    # a: 2*3*8*4 = 192, input is a graph input -> backward is the weight grad only (1x)
    # b: 2*3*4*5 = 120, input requires grad -> 2x
    assert _counted(gm) == [("aten.linear.default", 192, 192, "matmul"),
                            ("aten.linear.default", 120, 240, "matmul")]
    assert gm.meta[FLOP_SUMMARY].fwd == 312 and gm.meta[FLOP_SUMMARY].bwd == 432
    for node in gm.graph.nodes:  # every node is annotated, non-matmul ones with zeros
        assert isinstance(node.meta[FLOPS], FlopMeta)
        if node.meta[FLOPS].kind == "none":
            assert node.meta[FLOPS].fwd == 0 and node.meta[FLOPS].bwd == 0


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, groups=2)

    def forward(self, x):
        return self.c2(self.c1(x)).sum()


def test_conv_counts_and_grouped_weight_grad():
    gm = _annotated(Convs(), ("batch", 3, 8, 8))
    # c1: 2 * N=2 * 8*8 * 3*3 * 4 * 3 = 27648; input needs no grad -> weight grad only.
    # c2: 2 * 2 * 64 * 9 * 4 * (4/2) = 18432; backward = input grad (1x) + weight grad counted
    #     with all 4 input channels as FlopCounterMode does (groups=2 -> 2x).
    assert [(f, b) for _, f, b, _ in _counted(gm)] == [(27648, 27648), (18432, 18432 + 2 * 18432)]
    assert {k for *_, k in _counted(gm)} == {"conv"}


class GQAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(16, 32))
        self.wk = nn.Parameter(torch.randn(16, 16))
        self.wv = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        b, s, _ = x.shape
        q = (x @ self.wq).view(b, s, 4, 8).transpose(1, 2)
        k = (x @ self.wk).view(b, s, 2, 8).transpose(1, 2)
        v = (x @ self.wv).view(b, s, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()


def test_sdpa_with_gqa_and_causal_mask_counted_in_full():
    gm = _annotated(GQAttention(), ("batch", "seq", 16))
    # q proj 2*2*6*16*32 = 12288, k/v proj 2*2*6*16*16 = 6144 (weight grad only);
    # attention 4 * B=2 * Hq=4 * Sq=6 * Sk=6 * D=8 = 9216, backward 2x (q, k, v all need grad).
    assert _counted(gm) == [("aten.matmul.default", 12288, 12288, "matmul"),
                            ("aten.matmul.default", 6144, 6144, "matmul"),
                            ("aten.matmul.default", 6144, 6144, "matmul"),
                            ("aten.scaled_dot_product_attention.default", 9216, 18432, "attention")]


def test_sdpa_symbolic():
    gm = _annotated(GQAttention(), ("batch", "seq", 16), symbolic=("batch", "seq"))
    attn = [(f, b) for t, f, b, _ in _counted(gm) if "attention" in t]
    assert attn == [(4 * 4 * 8 * B * S**2, 2 * 4 * 4 * 8 * B * S**2)]  # 4*Hq*D*B*S^2


class Batched(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 5))
        self.u = nn.Parameter(torch.randn(5, 7))

    def forward(self, x):
        return torch.matmul(torch.bmm(x, self.w), self.u).sum()


def test_bmm_and_broadcast_matmul():
    gm = _annotated(Batched(), (4, 3, 8))
    # bmm 2*4*3*8*5 = 960 (weight grad only); matmul [4,3,5]@[5,7] 2*4*3*5*7 = 840, 2x back.
    assert _counted(gm) == [("aten.bmm.default", 960, 960, "matmul"),
                            ("aten.matmul.default", 840, 1680, "matmul")]


def test_missing_shapes_names_the_node():
    gm = capture_model(TwoLinear(), inputs=(InputSpec(name="x", shape=(3, 8)),), dims={})
    with pytest.raises(AnalysisError, match=r"node '\w+'.*annotate_shapes"):
        annotate_flops(gm)


# --- GPT: the public formula -----------------------------------------------------------------
GPT = dict(layers=2, hidden=64, heads=4, vocab=256, seq=32)
GPT_SPEC = "gpt:" + ",".join(f"{k}={v}" for k, v in GPT.items())


def _gpt_fwd(b, s, h=GPT["hidden"], L=GPT["layers"], V=GPT["vocab"]):
    # 24*b*s*h^2*L*(1 + s/(6h)) + 2*b*s*h*V, written without the division
    return 24 * b * s * h**2 * L + 4 * b * s**2 * h * L + 2 * b * s * h * V


def test_gpt_concrete_and_symbolic_totals():
    spec = build_model(GPT_SPEC, device="meta")
    concrete = annotate_flops(annotate_shapes(capture_spec(spec))).meta[FLOP_SUMMARY]
    b, s = spec.dims["batch"], spec.dims["seq"]
    assert concrete.fwd == _gpt_fwd(b, s) and concrete.bwd == 2 * _gpt_fwd(b, s)
    assert isinstance(concrete.fwd, sympy.Integer)

    symbolic = annotate_flops(annotate_shapes(capture_spec(spec, symbolic=("batch", "seq")))).meta[FLOP_SUMMARY]
    assert sympy.expand(symbolic.fwd - _gpt_fwd(B, S)) == 0
    assert sympy.expand(symbolic.bwd - 2 * _gpt_fwd(B, S)) == 0
    assert symbolic.fwd.subs({B: b, S: s}) == concrete.fwd
    assert symbolic.bwd.subs({B: b, S: s}) == concrete.bwd


def test_gpt3_widths_annotate_exactly():
    """GPT-3 widths (hidden 12288, 96 heads, vocab 50257, seq 2048) at 8 layers, symbolic: the
    totals are the formula. (Speed: bench/analyze_speed.py times all passes on 96 layers.)"""
    big = dict(layers=8, hidden=12288, heads=96, vocab=50257, seq=2048)
    spec = build_model("gpt:" + ",".join(f"{k}={v}" for k, v in big.items()), device="meta")
    gm = annotate_shapes(capture_spec(spec, symbolic=("batch", "seq")))
    annotate_flops(gm)
    fwd = _gpt_fwd(B, S, h=big["hidden"], L=big["layers"], V=big["vocab"])
    assert sympy.expand(gm.meta[FLOP_SUMMARY].fwd - fwd) == 0
    assert sympy.expand(gm.meta[FLOP_SUMMARY].bwd - 2 * fwd) == 0


# --- truth: FlopCounterMode ------------------------------------------------------------------
def _counter(step, *inputs):
    """FlopCounterMode's (forward, backward) FLOPs of ``step(*inputs).backward()``."""
    with FlopCounterMode(display=False) as fwd:
        loss = step(*inputs)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


class Op(nn.Module):
    """One op on a graph input ``x`` and parameters ``p0, p1, ...`` (which need grad)."""

    def __init__(self, fn, *param_shapes):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in param_shapes)

    def forward(self, x):
        return self.fn(x, *self.ps).float().sum()


OPS = {
    "vec@mat": (lambda x, w: x @ w, (8,), [(8, 5)]),
    "mat@vec mv (0)": (lambda x, w: w @ x, (8,), [(5, 8)]),
    "dot (0)": (lambda x, w: x @ w, (8,), [(8,)]),
    "3d@vec folds to mv (0)": (lambda x, w: x @ w, (2, 3, 8), [(8,)]),
    "mat@3d": (lambda x, w: x @ w, (3, 8), [(2, 8, 5)]),
    "broadcast 4d": (lambda x, w: x @ w, (2, 1, 3, 8), [(4, 8, 5)]),
    "linear 1d": (lambda x, w, b: F.linear(x, w, b), (8,), [(5, 8), (5,)]),
    "addmm": (lambda x, w, b: torch.addmm(b, x, w), (3, 8), [(8, 5), (5,)]),
    "baddbmm": (lambda x, w, b: torch.baddbmm(b, x, w), (2, 3, 8), [(2, 8, 5), (3, 5)]),
    "einsum bmm": (lambda x, w: torch.einsum("bij,jk->bik", x, w), (2, 3, 8), [(8, 5)]),
    "einsum heads": (lambda x, w: torch.einsum("bhqd,bhkd->bhqk", x, w), (2, 2, 3, 4), [(2, 2, 5, 4)]),
    "einsum ellipsis": (lambda x, w: torch.einsum("...ij,jk", x, w), (2, 3, 8), [(8, 5)]),
    "einsum rowdot": (lambda x, w: torch.einsum("ij,ij->i", x, w), (3, 8), [(3, 8)]),
    "einsum outer (0)": (lambda x, w: torch.einsum("i,j->ij", x, w), (3,), [(4,)]),
    "einsum 3 operands": (lambda x, w, u: torch.einsum("ij,jk,kl->il", x, w, u), (3, 8), [(8, 5), (5, 2)]),
    "conv1d stride": (lambda x, w: F.conv1d(x, w, stride=2), (2, 4, 9), [(6, 4, 3)]),
    "conv2d unbatched": (lambda x, w: F.conv2d(x, w, padding=1), (4, 5, 5), [(6, 4, 3, 3)]),
    "conv2d groups": (lambda x, w: F.conv2d(x, w, groups=2), (2, 4, 6, 6), [(6, 2, 3, 3)]),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2, groups=2), (2, 4, 5, 5), [(4, 3, 3, 3)]),
    "conv3d": (lambda x, w: F.conv3d(x, w), (1, 2, 4, 4, 4), [(3, 2, 2, 2, 2)]),
    "sdpa q no grad": (lambda x, k, v: F.scaled_dot_product_attention(x, k, v), (2, 2, 5, 4),
                       [(2, 2, 7, 4), (2, 2, 7, 3)]),
    "sdpa gqa mask": (lambda x, k, v, m: F.scaled_dot_product_attention(x * 2.0, k, v, attn_mask=m,
                                                                        enable_gqa=True),
                      (2, 4, 5, 4), [(2, 2, 5, 4), (2, 2, 5, 4), (5, 5)]),
    "sdpa kv no grad": (lambda x, q: F.scaled_dot_product_attention(q, x, x, is_causal=True), (1, 2, 6, 4),
                        [(1, 2, 6, 4)]),
}


@pytest.mark.parametrize("case", list(OPS))
def test_op_matches_flop_counter_on_meta(case):
    fn, x_shape, param_shapes = OPS[case]
    with torch.device("meta"):
        module = Op(fn, *param_shapes)
    gm = capture_model(module, inputs=(InputSpec(name="x", shape=x_shape),), dims={})
    summary = annotate_flops(annotate_shapes(gm)).meta[FLOP_SUMMARY]
    expected = _counter(module, torch.zeros(x_shape, device="meta"))
    assert (summary.fwd, summary.bwd) == expected
    if "(0)" not in case:
        assert expected[0] > 0  # the case exercises a counted op


# Small spec per zoo model; names registered but missing here are skipped, not failed silently.
ZOO_SPECS = {
    "gpt": "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16",
    "moe": "moe:layers=2,hidden=64,heads=4,vocab=128,seq=16,experts=4,top_k=2,expert_hidden=128,shared_experts=1",
    "llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16",
    "bert": "bert:layers=2,hidden=64,heads=4,vocab=128,seq=16",
    "mlp": "mlp:layers=2,hidden=32,in_features=16,out_features=8",
    "resnet": "resnet:blocks=1-1,widths=8-16,image=16,classes=10",
    "hf-gpt2": "hf-gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,seq=16",
    "hf-llama": "hf-llama:num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=4,"
                "num_key_value_heads=2,vocab_size=64,max_position_embeddings=16,seq=16",
    "hf-bert": "hf-bert:num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
               "vocab_size=64,max_position_embeddings=16,seq=16",
}


@pytest.mark.parametrize("name", sorted(known_models()))
def test_zoo_model_matches_flop_counter(name):
    if name not in ZOO_SPECS:
        pytest.skip(f"no small spec for zoo model {name!r} in ZOO_SPECS")
    if name.startswith("hf-"):
        # HF mask code reads tensor values, which meta tensors cannot give: run the tiny model on
        # CPU with the math attention backend, which counts attention as meta does (two bmm).
        spec = build_model(ZOO_SPECS[name])
        inputs = spec.example_inputs()
        with sdpa_kernel(SDPBackend.MATH):
            expected = _counter(lambda *xs: spec.loss(spec.module, *xs), *inputs)
    else:
        spec = build_model(ZOO_SPECS[name], device="meta")
        inputs = [torch.zeros([spec.dims[d] if isinstance(d, str) else d for d in i.shape], dtype=i.dtype,
                              device="meta") for i in spec.inputs]
        expected = _counter(lambda *xs: spec.loss(spec.module, *xs), *inputs)
    summary = annotate_flops(annotate_shapes(capture_spec(spec))).meta[FLOP_SUMMARY]
    assert expected[0] > 0
    assert (summary.fwd, summary.bwd) == expected


# --- checkpointed regions --------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["full", "dag"])
def test_checkpointed_regions_charge_what_their_replay_runs(policy):
    """A checkpointed region's backward is charged the forward its replay runs: the whole region
    under ``full``, only the uncached nodes (``node.meta[REMAT]``) under ``dag``. The re-analysed
    rewritten graph then gives FlopCounterMode's count of a real step, recompute included."""
    import copy

    from passes.analysis.annotate_blocks import annotate_blocks
    from passes.analysis.annotate_flops import checkpoint_submodule, recompute_flops
    from passes.rewrites.apply_checkpoint import apply_checkpoint
    from passes.policies.checkpoint_policy import checkpoint_policy
    from passes.ir.meta import CHECKPOINT_PLAN, DAG_CHECKPOINT_PLAN

    spec = build_model(ZOO_SPECS["resnet"] + ",batch=8")
    gm = annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec))))
    plain = gm.meta[FLOP_SUMMARY]
    full = checkpoint_policy(copy.deepcopy(gm), policy="full").meta[CHECKPOINT_PLAN]
    budget = int(full.saved_bytes_after + 0.5 * (full.saved_bytes_before - full.saved_bytes_after))
    rewritten = apply_checkpoint(checkpoint_policy(copy.deepcopy(gm), policy=policy, budget_bytes=budget))
    plan = rewritten.meta[CHECKPOINT_PLAN]
    summary = annotate_flops(annotate_shapes(rewritten)).meta[FLOP_SUMMARY]
    calls = [n for n in rewritten.graph.nodes if checkpoint_submodule(rewritten, n) is not None]
    region_fwd = sum(int(n.meta[FLOPS].fwd) for n in calls)
    charged = sum(int(recompute_flops(checkpoint_submodule(rewritten, n))) for n in calls)
    assert calls and summary.fwd == plain.fwd
    assert summary.bwd == plain.bwd + plan.recompute_flops == plain.bwd + charged
    if policy == "dag":
        assert rewritten.meta[DAG_CHECKPOINT_PLAN].cached
        assert 0 < charged < region_fwd  # cached nodes are not charged again
    else:
        assert charged == region_fwd
    assert (summary.fwd, summary.bwd) == _counter(rewritten, *spec.example_inputs())
