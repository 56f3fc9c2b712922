"""tensor_parallel: recognition (tag) on small hand-built graphs, exactness of the rewritten rank
programs (simulated tp=2 in threads, and once on real gloo in 2 processes), parameter coverage."""
from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import runtime.kernels.collectives as tpc
from runtime.dist.launch import spawn
from partitioner.inputs.models import build_model
from passes.rewrites.apply_tensor_parallel import apply_tensor_parallel
from passes.ir.program import shard_tensor, unshard_tensor
from passes.capture.capture import capture_model, capture_spec, module_path
from passes.ir.meta import SHAPE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN, InputSpec, ParamSharding
from passes.policies.tensor_parallel_patterns import sharded_param_bytes, tag_tensor_parallel
from tests.passes.tp_graphs import run_simulated_step, tagged_tp2

RTOL = 1e-5
EXACT_SPECS = {
    "gpt": "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,dropout=0",
    "llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16",
    "hf-gpt2": "hf-gpt2:n_layer=2,n_embd=64,n_head=4,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0,seq=16",
}


# --- hand-built graphs --------------------------------------------------------------------------
class Attn(nn.Module):
    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Mlp(nn.Module):
    def __init__(self, hidden=16, norm_between=False):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.norm = nn.LayerNorm(4 * hidden) if norm_between else nn.Identity()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.down(self.norm(F.gelu(self.up(x))))


def _capture(module):
    return capture_model(module, inputs=[InputSpec(name="x", shape=("batch", 8, 16))], dims={"batch": 2},
                         loss=lambda m, x: m(x).pow(2).mean(), symbolic=("batch",))


def _roles(gm) -> dict[str, str]:
    """module path -> role of its linear node."""
    return {module_path(n): n.meta[TENSOR_PARALLEL].role for n in gm.graph.nodes
            if n.target in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default)}


def test_mlp_is_column_then_row():
    gm = tag_tensor_parallel(_capture(Mlp()), degree=2)
    assert _roles(gm) == {"up": "column", "down": "row"}
    params = gm.meta[TENSOR_PARALLEL_PLAN].params
    assert params["up.weight"].dim == 0 and params["up.bias"].dim == 0
    assert params["down.weight"].dim == 1 and params["down.bias"].dim is None  # added once after the all-reduce


def test_norm_inside_mlp_keeps_it_replicated_with_reason():
    gm = tag_tensor_parallel(_capture(Mlp(norm_between=True)), degree=2)
    assert set(_roles(gm).values()) == {"replicated"}
    up = next(n for n in gm.graph.nodes if module_path(n) == "up")
    assert "layer_norm" in up.meta[TENSOR_PARALLEL].reason
    assert "layer_norm" in gm.meta[TENSOR_PARALLEL_PLAN].params["up.weight"].reason


def test_fused_qkv_is_sharded_per_section_by_heads():
    gm = tag_tensor_parallel(_capture(Attn(heads=4)), degree=2)
    assert _roles(gm) == {"qkv": "column", "proj": "row"}
    qkv = gm.meta[TENSOR_PARALLEL_PLAN].params["qkv.weight"]
    assert (qkv.dim, qkv.sections) == (0, (16, 16, 16))
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default and len(n.args[1]) == 4]
    assert views and all(n.meta[TENSOR_PARALLEL].shard_dim == 2 for n in views)  # the heads dim


def test_heads_not_divisible_by_tp_stay_replicated():
    gm = tag_tensor_parallel(_capture(Attn(heads=4)), degree=8)
    assert set(_roles(gm).values()) == {"replicated"}
    qkv = next(n for n in gm.graph.nodes if module_path(n) == "qkv" and n.op == "call_function")
    assert "divisible by tp=8" in qkv.meta[TENSOR_PARALLEL].reason


def test_gqa_with_fewer_kv_heads_than_tp_keeps_attention_replicated():
    gm = tag_tensor_parallel(capture_spec(build_model(EXACT_SPECS["llama"], device="meta")), degree=4)
    roles = _roles(gm)
    assert {roles[f"blocks.0.attn.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")} == {"replicated"}
    assert roles["blocks.0.mlp.gate_proj"] == roles["blocks.0.mlp.up_proj"] == "column"
    assert roles["blocks.0.mlp.down_proj"] == "row"
    k = next(n for n in gm.graph.nodes if module_path(n) == "blocks.0.attn.k_proj")
    assert "divisible by tp=4" in k.meta[TENSOR_PARALLEL].reason


def test_shard_and_unshard_per_section_round_trip():
    t = torch.arange(24.0).reshape(12, 2)
    s = ParamSharding(dim=0, sections=(4, 4, 4))
    shards = [shard_tensor(t, s, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]  # first half of each of q, k, v
    assert torch.equal(unshard_tensor(shards, s), t)


# --- exactness ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def captured():
    return tagged_tp2(EXACT_SPECS)


def _reference(gm, inputs):
    for p in gm.parameters():
        p.grad = None
    loss = gm(*inputs)
    loss.backward()
    params = dict(gm.named_parameters(remove_duplicate=False))
    grads = {n.target: params[n.target].grad.clone() for n in gm.graph.nodes
             if n.op == "get_attr" and n.target in params}
    return loss.detach(), grads


def _check(gm, ref_loss, ref_grads, losses, rank_grads):
    plan = gm.meta[TENSOR_PARALLEL_PLAN]
    for loss in losses:
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    worst = 0.0
    for name, g in ref_grads.items():
        full = unshard_tensor([rg[name] for rg in rank_grads], plan.params[name])
        # Scale by the tensor's largest gradient: an all-reduce reorders sums, so entries near 0
        # differ by rounding relative to the tensor, not to themselves.
        torch.testing.assert_close(full, g, rtol=RTOL, atol=RTOL * g.abs().max().item(), msg=name)
        worst = max(worst, ((full - g).abs().max() / g.abs().max()).item())
    return worst


@pytest.mark.parametrize("key", list(EXACT_SPECS))
def test_tp2_simulated_matches_single_device(captured, key):
    gm, inputs = captured[key]
    ref_loss, ref_grads = _reference(gm, inputs)
    names = tpc.simulated_groups(f"test-{key}", 2, timeout_s=30)
    ranks = [apply_tensor_parallel(gm, rank=r, group=names[r]) for r in range(2)]
    code = ranks[0].code
    assert "partitioner.copy_to_tp" in code and "partitioner.reduce_from_tp" in code
    assert "partitioner.vocab_parallel_cross_entropy" in code

    results = run_simulated_step(ranks, inputs)
    worst = _check(gm, ref_loss, ref_grads, [r[0] for r in results], [r[1] for r in results])
    print(f"{key}: loss {ref_loss.item():.6f}, worst grad error {worst:.2e} of each tensor's max")
    # Sharded parameters are real halves, named as the originals.
    plan = gm.meta[TENSOR_PARALLEL_PLAN]
    full = dict(gm.named_parameters(remove_duplicate=False))
    for name, p in ranks[1].named_parameters(remove_duplicate=False):
        expect = shard_tensor(full[name], plan.params[name], 1, 2)
        assert torch.equal(p.detach(), expect)
        if plan.params[name].dim is not None:
            assert p.numel() * 2 == full[name].numel()


def test_rank_program_shapes_are_local(captured):
    """The rank program runs on fake tensors too (custom ops have fake kernels) with halved heads."""
    from passes.analysis.annotate_shapes import annotate_shapes

    gm, _ = captured["llama"]
    rank = annotate_shapes(apply_tensor_parallel(gm, rank=0, group="unused"))
    sdpa = [n for n in rank.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa and all(int(n.meta[SHAPE].tensor.shape[1]) == 2 for n in sdpa)  # 4 heads / tp 2


def _gloo_worker(cases: bytes):
    """On each rank of a 2-rank job: every case's loss and gradients from this rank's program."""
    import torch.distributed as dist

    import runtime.kernels.collectives as collectives  # registers the kernels before the program is loaded
    import runtime.kernels  # noqa: F401
    from runtime.dist.mesh import init_distributed

    init_distributed(timeout_s=60)
    rank = dist.get_rank()
    collectives.register_group("tp", collectives.DistGroup())
    out = []
    for programs, inputs, seed in pickle.loads(cases):
        gm = pickle.loads(programs[rank])
        torch.manual_seed(seed)  # every tp rank draws from the same stream, as one device would
        loss = gm(*torch.load(io.BytesIO(inputs)))
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in gm.named_parameters(remove_duplicate=False)}))
    return out


DROPOUT_SPECS = {  # dropout 0.1 everywhere: on tp shards (attention probabilities) and on sequence chunks
    "hf-gpt2-dropout": "hf-gpt2:n_layer=2,n_embd=64,n_head=4,resid_pdrop=0.1,embd_pdrop=0.1,attn_pdrop=0.1,seq=16",
    "gpt-dropout": "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,dropout=0.1",
}


def test_tp2_on_gloo_matches_single_device_with_and_without_dropout(captured):
    """One spawn of 2 gloo ranks: gpt (dropout 0); hf-gpt2 with dropout 0.1 in the tp regions
    (its attention dropout runs on head shards); gpt with dropout 0.1 under sequence parallelism
    (residual dropouts on sequence chunks). Each equals one device seeded alike."""
    dropout = tagged_tp2(DROPOUT_SPECS)
    cases = [("gpt", captured["gpt"], False), ("hf-gpt2-dropout", dropout["hf-gpt2-dropout"], False),
             ("gpt-dropout-sp", dropout["gpt-dropout"], True)]
    refs, payload, summed = [], [], []
    for k, (name, (gm, inputs), sp) in enumerate(cases):
        torch.manual_seed(100 + k)
        refs.append(_reference(gm, inputs))
        programs = [apply_tensor_parallel(gm, rank=r, group="tp", sequence_parallel=sp) for r in range(2)]
        if name != "gpt":
            assert "partitioner.sharded_dropout" in programs[0].code, name
        # sequence parallelism: gradients of replicated norm weights are partial per rank (the
        # runtime sums them over the tp group)
        summed.append(programs[0].meta[TENSOR_PARALLEL_PLAN].sequence_parallel_grads)
        buf = io.BytesIO()
        torch.save(inputs, buf)
        payload.append(([pickle.dumps(p) for p in programs], buf.getvalue(), 100 + k))
    results = spawn(_gloo_worker, 2, pickle.dumps(payload), timeout_s=120)
    for k, (name, (gm, _), _) in enumerate(cases):
        ref_loss, ref_grads = refs[k]
        grads = [r[k][1] for r in results]
        for n in summed[k]:
            total = sum(g[n] for g in grads)
            for g in grads:
                g[n] = total
        _check(gm, ref_loss, ref_grads, [r[k][0] for r in results], grads)
    gm, inputs = dropout["hf-gpt2-dropout"]
    torch.manual_seed(999)
    with torch.no_grad():
        other = gm(*inputs)
    assert not torch.allclose(other, refs[1][0])  # the masks matter: another seed, another loss


# --- coverage -----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(EXACT_SPECS))
def test_tp_shards_at_least_95_percent_of_parameter_bytes(captured, key):
    gm, _ = captured[key]
    sharded, total = sharded_param_bytes(gm)
    assert sharded / total >= 0.95, (key, sharded, total)
    # What stays replicated is norms, biases of row-parallel linears and position embeddings.
    plan = gm.meta[TENSOR_PARALLEL_PLAN]
    for name, p in gm.named_parameters():
        if plan.params[name].dim is None:
            assert p.dim() == 1 or "wpe" in name, (name, plan.params[name].reason)
