"""split_backward (the pass) and runtime.exec.split_backward (I then W on the autograd graph).

The pass marks where parameters first meet the data and gives each shared parameter use its own
alias; the runtime's two halves together must give exactly the gradients of one full backward,
with the parameters untouched by I and the input gradients complete after it.
"""
from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

from passes.ir.errors import PartitionerError
from passes.ir.meta import SHAPE, ShapeMeta, TensorMeta
from passes.rewrites.split_backward import copied_weight_gradients, split_backward, weight_half_nodes
from runtime.exec.split_backward import WeightOrder, backward_input, backward_weight


class Shared(nn.Module):
    """An embedding, then one linear applied twice (its weight read by two ops): ALBERT-style."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        h = self.emb(ids)
        h = torch.tanh(self.lin(h))
        return self.norm(self.lin(h)).square().mean()


class Blocks(nn.Module):
    """A middle stage: received activations through attention/MLP blocks, optionally checkpointed."""

    def __init__(self, ckpt: bool):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                    for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint.checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


def _exported(module, *args) -> torch.fx.GraphModule:
    return torch.export.export(module, args).module()


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_marks_the_data_entry_and_aliases_shared_uses():
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 5))
    gm = split_backward(_exported(Shared(), ids))
    targets = _targets(gm)
    assert targets.count("partitioner.split_point.default") == 1
    entry = next(n for n in gm.graph.nodes if "split_point" in str(n.target))
    assert "embedding" in str(entry.args[0].target)  # right after the lookup
    # lin.weight and lin.bias are read by two linears each: every read has its own alias
    assert targets.count("aten.alias.default") == 4


def _as_stage_program(gm):
    """``gm`` as a lowered stage program carries it: the analysis' shapes, no export values."""
    for node in gm.graph.nodes:
        val = node.meta.pop("val", None)
        if isinstance(val, torch.Tensor):
            node.meta[SHAPE] = ShapeMeta(tensors=(TensorMeta(shape=tuple(sympy.Integer(d) for d in val.shape),
                                                             dtype=val.dtype),))
    return gm


def test_a_stage_program_is_marked_from_the_analysis_shapes():
    """A lowered stage program carries the analysis' shapes, not export's values: the entry is
    found from them (without a marker, a first stage's I does nothing and W the whole backward)."""
    gm = split_backward(_as_stage_program(_exported(Shared(), torch.randint(0, 16, (2, 5)))))
    entry = next(n for n in gm.graph.nodes if "split_point" in str(n.target))
    assert "embedding" in str(entry.args[0].target)
    assert entry.meta[SHAPE] == entry.args[0].meta[SHAPE]


def test_what_the_weight_half_keeps_and_which_gradients_it_copies():
    torch.manual_seed(0)
    gm = split_backward(_as_stage_program(_exported(Shared(), torch.randint(0, 16, (2, 5)))))
    kept = weight_half_nodes(gm)
    norm = next(n for n in gm.graph.nodes if "layer_norm" in str(n.target))
    square = next(n for n in gm.graph.nodes if "square" in str(n.target) or "pow" in str(n.target))
    assert norm.name in kept and "split_point_default" in kept  # W walks down from them
    assert square.name not in kept  # only the loss side reads it: I releases what it saved
    # the norm reads its parameters directly (W's gradients are handed over, then copied); the
    # linears read theirs through aliases and the embedding sits below the split point
    assert copied_weight_gradients(gm) == {"norm.weight", "norm.bias"}


def test_split_halves_give_the_full_backward_exactly_on_a_first_stage():
    torch.manual_seed(0)
    model = Shared()
    ids = torch.randint(0, 16, (2, 5))
    ref = copy.deepcopy(model)
    ref(ids).backward()
    gm = split_backward(_exported(model, ids))
    loss = gm(ids)
    pending = backward_input([loss], [None], [])
    assert pending.mixing and pending.entries  # I ran down to the embedding's output
    assert all(p.grad is None for p in gm.parameters())  # I leaves the weights to W
    backward_weight(pending)
    for name, p in ref.named_parameters():
        assert torch.equal(gm.get_parameter(name).grad, p.grad), name


def test_a_parameter_read_twice_without_aliases_is_refused():
    """Both linears add the same bias directly: without the pass's aliases, W's walk from the
    second one would reach it through the first one as well (counted twice)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    out = lin(torch.tanh(lin(x))).sum()
    with pytest.raises(PartitionerError, match="both read"):
        backward_input([out], [None], [x])


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_split_halves_give_the_full_backward_exactly_on_a_middle_stage(ckpt):
    torch.manual_seed(0)
    model = Blocks(ckpt)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 6, 16)
    g = torch.randn(2, 6, 16)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(g)
    x_run = x.clone().requires_grad_()
    pending = backward_input([model(x_run)], [g], [x_run])
    assert torch.equal(x_run.grad, x_ref.grad)  # what the previous stage waits for, after I alone
    assert all(p.grad is None for p in model.parameters())
    backward_weight(pending)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(q.grad, p.grad), name


def test_weight_half_fires_the_post_accumulate_hooks_of_every_parameter():
    """Data-parallel buckets launch from these hooks: W must fire each exactly once."""
    torch.manual_seed(0)
    model = Blocks(False)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    x = torch.randn(2, 6, 16, requires_grad=True)
    pending = backward_input([model(x)], [torch.ones(2, 6, 16)], [x])
    assert not fired
    backward_weight(pending)
    assert sorted(fired) == sorted(id(p) for p in model.parameters())


@pytest.mark.parametrize("ckpt", [False, True])
def test_weight_half_accumulates_in_the_order_it_is_given_each_parameter_once(ckpt):
    """Without an order the engine runs the parameters a node reads directly (norm weights,
    biases) first, in its heap's order; buckets launch from the hooks, and the communication
    check predicts reverse parameter order. The gradients are those of one full backward."""
    torch.manual_seed(0)
    model = Blocks(ckpt)
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    x, g = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(g)
    x_run = x.clone().requires_grad_()
    pending = backward_input([model(x_run)], [g], [x_run])
    _weights_in_reverse_order(pending, params, fired, ref)


def test_a_parameter_reached_from_two_edges_accumulates_once_in_order():
    """The shared linear of an ALBERT-style first stage: its two uses are two views (the
    lowering's aliases), one parameter: it accumulates once, with both gradients."""
    torch.manual_seed(0)
    gm = split_backward(_exported(Shared(), torch.randint(0, 16, (2, 5))))
    ref = copy.deepcopy(gm)
    ids = torch.randint(0, 16, (2, 5))
    ref(ids).backward()
    params = list(gm.parameters())
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    pending = backward_input([gm(ids)], [None], [])
    _weights_in_reverse_order(pending, params, fired, ref)


def _weights_in_reverse_order(pending, params, fired, ref) -> None:
    """W with one bucket per parameter (the order is exact; within a bucket it is the engine's):
    the hooks fire in reverse parameter order, the gradients are ``ref``'s."""
    order = WeightOrder(position={id(p): -k for k, p in enumerate(params)}, buckets={id(p): k for k, p in enumerate(params)})
    backward_weight(pending, order)
    assert fired == [id(p) for p in reversed(params)]
    for (name, p), q in zip(ref.named_parameters(), params):
        assert torch.equal(q.grad, p.grad), name


def test_a_bucket_launches_after_its_last_member_in_bucket_order():
    """Members of one bucket go in one call (fewer engine calls); buckets complete in order."""
    torch.manual_seed(0)
    model = Blocks(False)
    params = list(model.parameters())
    bucket = {id(p): k // 3 for k, p in enumerate(params)}
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(bucket[id(p)]))
    x = torch.randn(2, 6, 16, requires_grad=True)
    pending = backward_input([model(x)], [torch.ones(2, 6, 16)], [x])
    backward_weight(pending, WeightOrder(position={id(p): -k for k, p in enumerate(params)}, buckets=bucket))
    assert fired == sorted(fired, reverse=True) and len(fired) == len(params)
