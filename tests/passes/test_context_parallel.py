"""context_parallel: the rewrite of attention, positions and the loss for ring attention and Ulysses.

IR checks (node counts of the cp ops, grouped-query K/V read before their repeat, shapes on fake
tensors, the plan and capture meta), the layout helpers, the errors, and exactness of the
rewritten zoo gpt / llama and of a model with a position buffer, run on simulated cp ranks
(threads) against the uncut graph on one device."""
from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import runtime.kernels  # noqa: F401  (the real kernels of the cp ops)
import runtime.kernels.collectives as tpc
from partitioner.inputs.models import build_model
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_model, capture_spec
from passes.rewrites.context_parallel import apply_context_parallel, context_parallel_problems
from passes.policies.tensor_parallel_patterns import sharded_param_bytes, tag_tensor_parallel
from passes.ir.meta import CONTEXT_PARALLEL
from passes.ir.cp_ops import (
    load_balanced_chunks, rank_order_index, true_positions, shard_sequence, true_order_index, unshard_sequence,
)
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import CAPTURE, SHAPE, TENSOR_PARALLEL, InputSpec, dim_symbol

aten = torch.ops.aten
cp = torch.ops.partitioner
SPECS = {
    "gpt": "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,dropout=0.0",
    "llama": "llama:layers=2,hidden=32,heads=4,kv_heads=2,vocab=64,seq=16",
}


@pytest.fixture(scope="module")
def captured():
    out = {}
    for key, spec_str in SPECS.items():
        torch.manual_seed(0)
        spec = build_model(spec_str, device="cpu")
        out[key] = (capture_spec(spec, symbolic=("batch", "seq")), spec.example_inputs(seed=1))
    return out


def _count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


# --- layout ---------------------------------------------------------------------------------------
def test_load_balanced_layout():
    assert load_balanced_chunks(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_chunks(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert load_balanced_chunks(8, 4, 3).tolist() == [3, 4]
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for degree in (1, 2, 3, 4):
        shards = [shard_sequence(x, 1, r, degree) for r in range(degree)]
        assert all(s.shape == (2, 24 // degree, 3) for s in shards)
        assert torch.equal(unshard_sequence(shards, 1), x)
        ranked = torch.cat(shards, dim=1)
        assert torch.equal(ranked.index_select(1, true_order_index(degree, 24 // (2 * degree))), x)
        assert torch.equal(x.index_select(1, rank_order_index(degree, 24 // (2 * degree))), ranked)
        for r in range(degree):  # the positions op maps a local arange to the shard's true positions
            local = torch.arange(24 // degree, dtype=torch.float32)
            assert true_positions(local, r, degree).tolist() == load_balanced_chunks(24, degree, r).tolist()
    # the op reads its rank from the cp group
    names = tpc.simulated_groups("cp-pos", 2, timeout_s=10)
    got = tpc.run_simulated([lambda r=r: cp.load_balanced_positions(torch.arange(8), 2, names[r]) for r in range(2)],
                            timeout_s=20)
    assert [g.tolist() for g in got] == [load_balanced_chunks(16, 2, r).tolist() for r in range(2)]
    with pytest.raises(ConfigError, match=r"not divisible by 2\*cp=8"):
        load_balanced_chunks(12, 4, 0)


# --- IR -------------------------------------------------------------------------------------------
def test_ring_rewrite_of_gpt(captured):
    gm, _ = captured["gpt"]
    out = apply_context_parallel(gm, degree=2, group="cp", mode="ring")
    assert _count(out, aten.scaled_dot_product_attention.default) == 0
    assert _count(out, cp.ring_attention.default) == 2  # one per layer
    assert _count(out, cp.load_balanced_positions.default) == 1  # the wpe lookup's arange
    assert _count(out, cp.reduce_from_cp.default) == 2  # loss sum and token count
    losses = [n for n in out.graph.nodes if n.target is aten.cross_entropy_loss.default]
    assert len(losses) == 1 and losses[0].args[3] == 2  # reduction=sum
    plan = out.meta[CONTEXT_PARALLEL]
    assert (plan.mode, plan.degree, plan.group, plan.seq_len) == ("ring", 2, "cp", 16)
    assert plan.sharded_inputs == (("idx", 1), ("targets", 1))
    assert (plan.attention, plan.positions, plan.losses) == (2, 1, 1)
    assert dict(out.meta[CAPTURE].dims)["seq"] == 8 and dict(gm.meta[CAPTURE].dims)["seq"] == 16
    assert _count(gm, aten.scaled_dot_product_attention.default) == 2  # the input graph is untouched
    # shapes on fake tensors: the seq symbol is now this rank's length
    annotate_shapes(out)
    seq, batch = dim_symbol("seq"), dim_symbol("batch")
    for n in out.graph.nodes:
        if n.target is cp.ring_attention.default:
            o, lse = n.meta[SHAPE].tensors
            assert tuple(sympy.sympify(s) for s in o.shape) == (batch, 4, seq, 8)
            assert tuple(sympy.sympify(s) for s in lse.shape) == (batch, 4, seq) and lse.dtype == torch.float32


def test_ulysses_rewrite_of_llama_reads_kv_heads(captured):
    gm, _ = captured["llama"]
    assert _count(gm, aten.expand.default) == 4  # repeat_kv of k and v in 2 layers
    out = apply_context_parallel(gm, degree=2, group="cp", mode="ulysses")
    assert _count(out, cp.seq_to_heads.default) == 6 and _count(out, cp.heads_to_seq.default) == 2
    assert _count(out, cp.load_balanced_positions.default) == 2  # the rotary tables of both layers
    sdpa = [n for n in out.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and all(n.kwargs.get("enable_gqa") for n in sdpa)
    assert _count(out, aten.expand.default) == 0  # kv heads travel, not their copies
    annotate_shapes(out)
    seq = dim_symbol("seq")
    for n in sdpa:
        q, k = (a.meta[SHAPE].tensor.shape for a in n.args[:2])
        assert q[1] == 2 and k[1] == 1  # 4 heads / cp, 2 kv heads / cp
        assert sympy.sympify(q[2]) == 2 * seq  # the whole sequence
    # cp=4: 2 kv heads do not divide, so attention reads the repeated heads instead
    out4 = apply_context_parallel(gm, degree=4, group="cp", mode="ulysses")
    assert _count(out4, aten.expand.default) == 4
    ring = apply_context_parallel(gm, degree=4, group="cp", mode="ring")
    assert _count(ring, aten.expand.default) == 0 and _count(ring, cp.ring_attention.default) == 2


def test_errors(captured):
    gm, _ = captured["gpt"]
    with pytest.raises(ConfigError, match=r"seq 16 is not divisible by 2\*cp=32"):
        apply_context_parallel(gm, degree=16, group="cp")
    with pytest.raises(ConfigError, match=r"heads 4 is not divisible by cp=8"):
        apply_context_parallel(gm, degree=8, group="cp", mode="ulysses")
    with pytest.raises(ConfigError, match="degree=0"):
        apply_context_parallel(gm, degree=0, group="cp")
    with pytest.raises(ConfigError, match="mode="):
        apply_context_parallel(gm, degree=2, group="cp", mode="stripes")
    static = capture_spec(build_model(SPECS["gpt"], device="meta"), symbolic=("batch",))
    with pytest.raises(PassError, match=r"specialized to 16 .* symbolic="):
        apply_context_parallel(static, degree=2, group="cp")
    with pytest.raises(PassError, match="already has context-parallel attention"):
        apply_context_parallel(apply_context_parallel(gm, degree=2, group="cp"), degree=2, group="cp")
    # the kernels check what a graph fed other sizes would break
    names = tpc.simulated_groups("cp-err", 2, timeout_s=10)
    with pytest.raises(ConfigError, match=r"heads 1 is not divisible by cp=2"):
        tpc.run_simulated([lambda r=r: cp.seq_to_heads(torch.ones(1, 1, 4, 2), 2, names[r]) for r in range(2)],
                          timeout_s=20)


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, idx):
        x = self.emb(idx)[:, None]
        mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask).sum()


def test_attention_with_a_mask_is_refused():
    gm = capture_model(_Masked(), inputs=(InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=16),),
                       dims={"batch": 2, "seq": 8}, symbolic=("batch", "seq"))
    with pytest.raises(PassError, match="explicit attn_mask"):
        apply_context_parallel(gm, degree=2, group="cp")


# --- exactness on simulated ranks -------------------------------------------------------------------
def _run_cp(gm, inputs, *, degree, mode, prefix):
    """(per-rank loss, per-rank {param: grad}) of the rewritten graph on simulated cp ranks."""
    names = tpc.simulated_groups(prefix, degree, timeout_s=60)
    progs = [copy.deepcopy(apply_context_parallel(gm, degree=degree, group=names[r], mode=mode))
             for r in range(degree)]  # one program; each simulated rank's copy names its own group

    def step(r):
        def run():
            m = progs[r]
            dims = dict(m.meta[CONTEXT_PARALLEL].sharded_inputs)
            local = [shard_sequence(x, dims[n.target], r, degree) if n.target in dims else x
                     for x, n in zip(inputs, [p for p in m.graph.nodes if p.op == "placeholder"])]
            loss = m(*local)
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in m.named_parameters(remove_duplicate=False)}
        return run

    return tpc.run_simulated([step(r) for r in range(degree)], timeout_s=120)


def _check_against_one_device(gm, inputs, results):
    model = copy.deepcopy(gm)
    loss = model(*inputs)
    loss.backward()
    ref = dict(model.named_parameters(remove_duplicate=False))
    for got, _ in results:  # every rank's loss is the global mean
        torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
    names = results[0][1].keys()
    assert names and names <= ref.keys()
    for name in names:
        # each rank holds cp x its tokens' share: the cp ranks average, as dp replicas do
        mean = sum(r[1][name] for r in results) / len(results)
        torch.testing.assert_close(mean, ref[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(results[0][1][n], ref[n].grad) for n in names)  # shares, not copies


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("key", list(SPECS))
def test_rewritten_zoo_graph_matches_one_device(captured, key, mode, degree):
    gm, inputs = captured[key]
    results = _run_cp(gm, inputs, degree=degree, mode=mode, prefix=f"cp-{key}-{mode}-{degree}")
    _check_against_one_device(gm, inputs, results)


class _PositionTable(nn.Module):
    """Token embedding plus rows of a position buffer sliced by the sequence length, causal attention."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.register_buffer("table", torch.randn(64, 16))
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)

    def forward(self, idx):
        b, s = idx.shape
        x = self.emb(idx) + self.table[:s]
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(b, s, 16))


def test_position_buffer_rows_are_the_true_positions():
    from partitioner.zoo.gpt import lm_loss

    torch.manual_seed(0)
    specs = (InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=32),
             InputSpec(name="targets", shape=("batch", "seq"), dtype=torch.long, high=32))
    gm = capture_model(_PositionTable(), inputs=specs, dims={"batch": 2, "seq": 16}, loss=lm_loss,
                       symbolic=("batch", "seq"))
    inputs = (torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16)))
    out = apply_context_parallel(gm, degree=2, group="cp")
    assert out.meta[CONTEXT_PARALLEL].positions == 1 and _count(out, aten.index_select.default) == 1
    _check_against_one_device(gm, inputs, _run_cp(gm, inputs, degree=2, mode="ring", prefix="cp-table"))


def test_problems_name_what_the_rewrite_cannot_cut(captured):
    gm, _ = captured["gpt"]
    assert context_parallel_problems(gm) == []
    static = capture_spec(build_model(SPECS["gpt"], device="meta"), symbolic=("batch",))
    assert context_parallel_problems(static) == ["the 'seq' dim was captured specialized, not symbolic"]
    masked = capture_model(_Masked(), inputs=(InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long,
                                                        high=16),), dims={"batch": 2, "seq": 8},
                           symbolic=("batch", "seq"))
    (problem,) = context_parallel_problems(masked)
    assert "explicit attn_mask" in problem


# --- with tensor parallelism ----------------------------------------------------------------------
@pytest.mark.parametrize("key,mode", [("gpt", "ring"), ("llama", "ring"), ("llama", "ulysses")])
def test_tp_tagging_shards_context_parallel_attention_by_heads(captured, key, mode):
    gm, _ = captured[key]
    out = apply_context_parallel(gm, degree=2, group="cp", mode=mode, tp=2)
    annotate_shapes(out)
    tag_tensor_parallel(out, degree=2)
    cp_nodes = [n for n in out.graph.nodes if getattr(n.target, "namespace", None) == "partitioner"
                and n.target._opname in ("ring_attention", "seq_to_heads", "heads_to_seq")]
    assert cp_nodes
    for n in cp_nodes:  # each tp rank's cp ops run on its heads
        meta = n.meta[TENSOR_PARALLEL]
        assert (meta.role, meta.shard_dim) == ("sharded", 1), (n.name, meta)
    # attention's projections are column/row pairs, the LM head and loss vocab-parallel: nothing
    # the cp ops touch forced a seed replicated
    roles = [n.meta[TENSOR_PARALLEL].role for n in out.graph.nodes]
    layers = 2
    assert roles.count("row") == 2 * layers and roles.count("vocab_loss") == 1
    assert not [n.name for n in out.graph.nodes if n.target is aten.linear.default
                and n.meta[TENSOR_PARALLEL].role == "replicated"]
    sharded, total = sharded_param_bytes(out)
    assert sharded / total > 0.95


def test_ulysses_under_tp_reads_kv_heads_only_when_every_rank_holds_whole_ones(captured):
    gm, _ = captured["llama"]  # 4 heads, 2 kv heads
    # tp=2: one kv head per tp rank, which cp=2 cannot split: the repeated heads travel (exact too)
    out = apply_context_parallel(gm, degree=2, group="cp", mode="ulysses", tp=2)
    assert _count(out, aten.expand.default) == 4
    annotate_shapes(out)
    for n in out.graph.nodes:
        if n.target is aten.scaled_dot_product_attention.default:
            assert [a.meta[SHAPE].tensor.shape[1] for a in n.args[:3]] == [2, 2, 2]  # before the tp rewrite
    # ring attention takes the kv heads whenever tp divides them
    ring = apply_context_parallel(gm, degree=2, group="cp", mode="ring", tp=2)
    assert _count(ring, aten.expand.default) == 0
    with pytest.raises(ConfigError, match=r"heads 4 is not divisible by tp\*cp=8"):
        apply_context_parallel(captured["gpt"][0], degree=4, group="cp", mode="ulysses", tp=2)
