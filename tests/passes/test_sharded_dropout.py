"""sharded_dropout: the op draws one device's mask for its shard; the rewrite replaces dropout (and
SDPA with dropout) on tp shards only. Multi-process exactness is in test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import runtime.kernels  # noqa: F401
from passes.rewrites.apply_tensor_parallel import apply_tensor_parallel
from tests.passes.tp_graphs import tagged_tp2

drop = torch.ops.partitioner.sharded_dropout


@pytest.mark.parametrize("dim,sections", [(1, []), (0, []), (1, [4, 8])])
def test_shards_together_are_one_devices_dropout(dim, sections):
    full = torch.randn(6, 12, 5)
    torch.manual_seed(3)
    expect = torch.ops.aten.dropout(full, 0.25, True)
    after = torch.rand(())  # the stream goes on as after one device's dropout
    pieces = []
    for rank in range(2):
        shard = _slice(full, dim, rank, sections)
        torch.manual_seed(3)
        out, mask = drop(shard, 0.25, dim, rank, 2, sections)
        assert mask.dtype == torch.bool and torch.equal(out, shard * mask.float().div(0.75))
        assert torch.equal(torch.rand(()), after)
        pieces.append(out)
    torch.testing.assert_close(_unslice(pieces, dim, sections), expect, rtol=0, atol=0)


def _slice(t, dim, rank, sections):
    parts, offset = [], 0
    for size in sections or [t.shape[dim]]:
        parts.append(t.narrow(dim, offset + rank * (size // 2), size // 2))
        offset += size
    return torch.cat(parts, dim)


def _unslice(pieces, dim, sections):
    out, offset = [], 0
    for size in sections or [pieces[0].shape[dim] * 2]:
        out += [p.narrow(dim, offset // 2, size // 2) for p in pieces]
        offset += size
    return torch.cat(out, dim)


def test_backward_scales_the_kept_gradient_and_checkpoint_recompute_redraws_the_mask():
    x = torch.randn(4, 8, requires_grad=True)

    def f(t):
        return (drop(t * 2, 0.5, 1, 1, 2, [])[0] ** 2).sum()

    torch.manual_seed(7)
    f(x).backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(7)
    checkpoint(f, x, use_reentrant=False).backward()  # recompute restores the generator first
    assert torch.equal(x.grad, plain)
    torch.manual_seed(7)
    _, mask = drop(x.detach() * 2, 0.5, 1, 1, 2, [])
    noise = mask.float().div(0.5)  # d/dx of (2x·noise)² = 2·(2x·noise)·noise·2
    torch.testing.assert_close(plain, 2 * (x.detach() * 2 * noise) * noise * 2)


def test_rewrite_touches_shards_only():
    specs = {"hf": "hf-gpt2:n_layer=1,n_embd=64,n_head=4,resid_pdrop=0.1,embd_pdrop=0.1,attn_pdrop=0.1,seq=16"}
    gm, _ = tagged_tp2(specs)["hf"]
    program = apply_tensor_parallel(gm, rank=1, group="unused")
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    # the attention (heads sharded) is spelled out around the sharded dropout; the residual and
    # embedding dropouts run on replicated tensors and stay ordinary dropouts
    assert targets.count(drop.default) == 1
    assert aten.scaled_dot_product_attention.default not in targets
    assert targets.count(aten.dropout.default) == 3
    call = next(n for n in program.graph.nodes if n.target is drop.default)
    assert call.args[1:] == (0.1, 1, 1, 2, [4])  # p, heads dim, rank, degree, one section of 4 heads
    sp = apply_tensor_parallel(tagged_tp2({"gpt": "gpt:layers=1,hidden=64,heads=4,vocab=128,seq=16,dropout=0.1"})
                               ["gpt"][0], rank=0, group="unused", sequence_parallel=True)
    seq_drops = [n for n in sp.graph.nodes if n.target is drop.default]
    assert seq_drops and all(n.args[2] == 1 for n in seq_drops)  # [b, s, h]: the sequence dim
