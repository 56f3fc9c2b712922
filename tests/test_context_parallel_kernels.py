"""Context-parallel kernels on gloo (spawned processes, cp=2 and cp=4): ring attention and Ulysses
forward and backward against full ``F.scaled_dot_product_attention`` on one process (fp32), causal
and not, grouped-query attention; and the rewritten zoo gpt and llama (GQA) graphs, whose loss on
every rank and parameter gradients averaged over the cp ranks equal the uncut graph's.

One spawn per cp degree runs every case (spawning costs seconds); the tests read its results. The
zoo graphs are captured and rewritten here, once, and each rank gets its program pickled (a rank
program is a plain GraphModule)."""
from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
import torch.nn.functional as F

from passes.ir.cp_ops import shard_sequence, unshard_sequence

RTOL, ATOL = 1e-5, 1e-6
B, S, D = 2, 16, 8
# (mode, causal, query heads, kv heads)
KERNEL_CASES = [(mode, causal, h, hkv) for mode in ("ring", "ulysses") for causal in (True, False)
                for h, hkv in ((4, 4), (8, 4))] + [("ring", True, 8, 2), ("ring", False, 8, 2)]
ZOO = {
    "gpt": "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,dropout=0.0",
    "llama": "llama:layers=2,hidden=32,heads=8,kv_heads=4,vocab=64,seq=16",
}


def _tensors(h: int, hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (h, hkv, hkv))
    return q, k, v, torch.randn(B, h, S, D, generator=g)


@functools.cache
def _zoo(key: str):
    from partitioner.inputs.models import build_model
    from passes.capture.capture import capture_spec

    torch.manual_seed(0)
    spec = build_model(ZOO[key], device="cpu")
    return capture_spec(spec, symbolic=("batch", "seq")), spec.example_inputs(seed=1)


def _programs(degree: int) -> dict:
    """(model, mode) -> per rank (pickled rank program, its sharded inputs), and the inputs."""
    from passes.rewrites.context_parallel import apply_context_parallel
    from passes.ir.meta import CONTEXT_PARALLEL

    out = {}
    for key in ZOO:
        gm, inputs = _zoo(key)
        for mode in ("ring", "ulysses"):
            progs = [apply_context_parallel(gm, degree=degree, group="cp", mode=mode)] * degree
            out[(key, mode)] = ([(pickle.dumps(p), p.meta[CONTEXT_PARALLEL].sharded_inputs) for p in progs], inputs)
    return out


def _rank_job(degree: int, programs: dict) -> dict:
    """Every case on this rank of a gloo job of ``degree`` processes (the cp group is the world)."""
    import torch.distributed as dist

    import runtime.kernels  # noqa: F401  (before unpickling programs that call the cp ops)
    from passes.ir.errors import ConfigError
    from runtime.dist import comm
    from runtime.kernels.collectives import DistGroup, register_group
    from runtime.dist.mesh import init_distributed

    init_distributed(backend="gloo", timeout_s=120)
    rank = dist.get_rank()
    register_group("cp", DistGroup(comm.new_group(range(degree), timeout_s=60)))
    ops = torch.ops.partitioner
    out: dict = {"kernels": {}, "zoo": {}}
    for i, (mode, causal, h, hkv) in enumerate(KERNEL_CASES):
        q, k, v, do = (shard_sequence(t, 2, rank, degree) for t in _tensors(h, hkv, seed=i))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        if mode == "ring":
            o, _ = ops.ring_attention(q, k, v, causal, None, degree, "cp")
        else:
            if hkv % degree:
                continue
            qh, kh, vh = (ops.seq_to_heads(t, degree, "cp") for t in (q, k, v))
            o = ops.heads_to_seq(F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=h != hkv),
                                 degree, "cp")
        o.backward(do)
        out["kernels"][i] = (o.detach(), q.grad, k.grad, v.grad)
    try:
        ops.seq_to_heads(torch.ones(1, degree // 2, 2, 2), degree, "cp")
    except ConfigError as exc:
        out["gqa_error"] = str(exc)
    for case, (per_rank, inputs) in programs.items():
        blob, sharded = per_rank[rank]
        prog = pickle.loads(blob)
        dims = dict(sharded)
        names = [n.target for n in prog.graph.nodes if n.op == "placeholder"]
        loss = prog(*[shard_sequence(x, dims[n], rank, degree) for x, n in zip(inputs, names)])
        loss.backward()
        out["zoo"][case] = (loss.detach(), {n: p.grad for n, p in prog.named_parameters(remove_duplicate=False)})
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda d: f"cp{d}")
def gloo(request):
    from runtime.dist.launch import spawn

    degree = request.param
    return degree, spawn(_rank_job, degree, degree, _programs(degree), timeout_s=400)


def test_kernels_match_full_attention(gloo):
    degree, results = gloo
    checked = 0
    for i, (mode, causal, h, hkv) in enumerate(KERNEL_CASES):
        if i not in results[0]["kernels"]:
            assert mode == "ulysses" and hkv % degree
            continue
        q, k, v, do = (t.clone() for t in _tensors(h, hkv, seed=i))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != hkv)
        ref.backward(do)
        for j, (name, want) in enumerate((("out", ref), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))):
            got = unshard_sequence([r["kernels"][i][j] for r in results], 2)
            torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL,
                                       msg=f"cp={degree} {mode} causal={causal} H={h} H_kv={hkv} {name}")
        checked += 1
    assert checked >= len(KERNEL_CASES) - 2
    assert "is not divisible by cp" in results[0]["gqa_error"]


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("key", list(ZOO))
def test_rewritten_zoo_graph_matches_one_process(gloo, key, mode):
    degree, results = gloo
    gm, inputs = _zoo(key)
    gm = copy.deepcopy(gm)
    loss = gm(*inputs)
    loss.backward()
    ref = dict(gm.named_parameters(remove_duplicate=False))
    per_rank = [r["zoo"][(key, mode)] for r in results]
    for rank, (got, _) in enumerate(per_rank):
        torch.testing.assert_close(got, loss.detach(), rtol=RTOL, atol=ATOL, msg=f"rank {rank} loss")
    names = per_rank[0][1].keys()
    assert names and names <= ref.keys()
    for name in names:
        mean = sum(grads[name] for _, grads in per_rank) / degree  # cp ranks average, as dp replicas
        torch.testing.assert_close(mean, ref[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=f"cp={degree} {mode} grad of {name}")
