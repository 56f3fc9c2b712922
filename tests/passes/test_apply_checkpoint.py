"""apply_checkpoint on the zoo GPT (dropout 0.1, real CPU fp32): exact losses and gradients,
saved activations measured against the plan, and the rewritten graph's text."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import fx

from partitioner.errors import PassError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_shapes import annotate_shapes
from passes.rewrites.apply_checkpoint import apply_checkpoint
from passes.capture.capture import capture_spec
from passes.policies.checkpoint_policy import checkpoint_policy
from passes.ir.meta import CHECKPOINT, CHECKPOINT_PLAN

L = 3
SPEC = f"gpt:layers={L},hidden=64,heads=4,vocab=128,seq=16,dropout=0.1"


@pytest.fixture(scope="module")
def gpt() -> fx.GraphModule:
    torch.manual_seed(0)
    gm = capture_spec(build_model(SPEC, device="cpu"))
    return annotate_flops(annotate_blocks(annotate_shapes(gm)))


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, 16), generator=gen), torch.randint(0, 128, (2, 16), generator=gen)


def _step(gm: fx.GraphModule):
    """One forward+backward: (loss, {param name: grad}, bytes of storages saved for backward)."""
    for p in gm.parameters():
        p.grad = None
    params = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    saved: dict[int, int] = {}
    keep = []  # hold saved tensors so no storage address is reused during the forward

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()  # dedupe by storage
        return t

    torch.manual_seed(1234)  # same dropout masks in both runs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gm(*_inputs())
    keep.clear()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    return loss.detach(), grads, sum(saved.values())


def _budget_for_two_blocks(gm: fx.GraphModule) -> int:
    full = checkpoint_policy(copy.deepcopy(gm), policy="full").meta[CHECKPOINT_PLAN]
    return int(full.saved_bytes_before - 2 * full.regions[0].bytes_saved)


@pytest.mark.parametrize("policy", ["full", "selective", "solver"])
def test_exact_and_smaller(gpt, policy):
    gm = copy.deepcopy(gpt)
    loss0, grads0, saved0 = _step(gm)
    budget = _budget_for_two_blocks(gpt) if policy == "solver" else None
    apply_checkpoint(checkpoint_policy(gm, policy=policy, budget_bytes=budget))
    loss1, grads1, saved1 = _step(gm)

    # (a) bit-identical: checkpoint replays dropout's RNG state in the recompute
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0), \
        [n for n in grads0 if not torch.equal(grads0[n], grads1[n])]
    # (b) saved activations shrink, as predicted
    plan = gm.meta[CHECKPOINT_PLAN]
    before, after = int(plan.saved_bytes_before), int(plan.saved_bytes_after)
    err_before, err_after = abs(saved0 - before) / saved0, abs(saved1 - after) / saved1
    print(f"{policy}: measured {saved0} -> {saved1} bytes, predicted {before} -> {after} "
          f"(error {err_before:.2%} / {err_after:.2%}), recompute {plan.recompute_flops} FLOPs")
    assert saved1 < saved0
    assert err_before < 0.05 and err_after < 0.05


def test_rewritten_graph_text(gpt):
    gm = apply_checkpoint(checkpoint_policy(copy.deepcopy(gpt), policy="full"))
    names = [f"checkpoint_blocks_{i}" for i in range(L)]
    assert [n for n, _ in gm.named_children() if n.startswith("checkpoint_")] == names
    assert [r.submodule for r in gm.meta[CHECKPOINT_PLAN].regions] == names
    code = gm.code
    calls = re.findall(r"(\w+) = torch\.utils\.checkpoint\.checkpoint\((\w+), (\w+), use_reentrant = False\)", code)
    # each block reads the previous block's checkpoint output; the first reads the embedding dropout
    assert calls == [("checkpoint", "checkpoint_blocks_0", "dropout"),
                     ("checkpoint_1", "checkpoint_blocks_1", "checkpoint"),
                     ("checkpoint_2", "checkpoint_blocks_2", "checkpoint_1")]
    assert "layer_norm_6 = torch.ops.aten.layer_norm.default(checkpoint_2" in code  # ln_f
    assert "blocks" not in code.replace("checkpoint_blocks", "")  # no block parameter left in the parent
    assert "scaled_dot_product_attention" not in code
    for i, name in enumerate(names):
        sub = getattr(gm, name)
        sub_code = sub.code
        assert re.search(r"def forward\(self, \w+\):", sub_code)  # one input
        assert sub_code.count("aten.scaled_dot_product_attention") == 1
        assert sub_code.count("aten.layer_norm") == 2 and sub_code.count("aten.linear") == 4
        assert sub_code.count("aten.dropout") == 2
        # the submodule reads the model's own Parameter objects
        assert getattr(sub.blocks, str(i)).attn.qkv.weight is getattr(gm.blocks, str(i)).attn.qkv.weight
    call_nodes = [n for n in gm.graph.nodes if n.target is torch.utils.checkpoint.checkpoint]
    assert [n.meta[CHECKPOINT].region for n in call_nodes] == list(range(L))
    assert len(list(gm.parameters())) == len(list(gpt.parameters()))  # each parameter once
    gm.graph.lint()


def test_needs_a_plan(gpt):
    with pytest.raises(PassError, match="run checkpoint_policy first"):
        apply_checkpoint(copy.deepcopy(gpt))
