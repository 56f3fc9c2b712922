"""pipeline_split: stage programs chained on one process reproduce the loss and the gradients
bit for bit, with every boundary tensor, size and tied weight recorded in the split."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

from partitioner.errors import PassError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_model, capture_spec, module_path
from passes.ir.meta import PIPELINE_STAGE, InputSpec, StageInput, StageIO, StageOutput, TensorMeta, dim_symbol
from passes.policies.pipeline_stages import (
    assign_stages, assign_stages_by_chain, assign_stages_by_layers, balanced_boundaries, find_layers, stage_rank_chunk,
)
from passes.rewrites.pipeline_split import split_pipeline_stages

B, S = dim_symbol("batch"), dim_symbol("seq")
GPT = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16,dropout=0.0"


# --------------------------------------------------------------------------------------------
# A single-process pipeline runtime: forward stage by stage, then backward stage by stage.
# --------------------------------------------------------------------------------------------
def run_pipeline(split, inputs: dict[str, torch.Tensor], dims: dict[str, int]):
    """Loss and per-stage parameter grads, passing tensors as send/recv would (detached)."""
    sent: dict[tuple[int, str], torch.Tensor] = {}  # (producer stage, name) -> tensor
    recvd: list[dict[str, torch.Tensor]] = []
    outs: list[tuple[torch.Tensor, ...]] = []
    loss = None
    for module, io in zip(split.modules, split.io):
        args, leaves = [], {}
        for inp in io.inputs:
            if inp.kind == "graph_input":
                args.append(inputs[inp.name])
            elif inp.kind == "size":
                args.append(int(inp.value.subs({dim_symbol(k): v for k, v in dims.items()})))
            else:
                t = sent[(inp.source, inp.name)].detach().requires_grad_(inp.meta.requires_grad)
                leaves[inp.name] = t
                args.append(t)
        result = module(*args)
        assert isinstance(result, tuple) and len(result) == len(io.outputs)
        for out, value in zip(io.outputs, result):
            assert tuple(value.shape) == tuple(int(d.subs({dim_symbol(k): v for k, v in dims.items()}))
                                               for d in out.meta.shape), out.name
            assert value.dtype == out.meta.dtype
            if out.dests:
                sent[(io.stage, out.name)] = value
            if out.graph_output == 0:
                loss = value
        recvd.append(leaves)
        outs.append(result)
    for module, io in reversed(list(zip(split.modules, split.io))):
        tensors, grads = [], []
        for out, value in zip(io.outputs, outs[io.stage]):
            if out.graph_output == 0:
                tensors.append(value)
                grads.append(None)
            elif value.requires_grad:
                # The gradient of a sent tensor is the sum of what its receivers computed.
                gs = [recvd[d][out.name].grad for d in out.dests if recvd[d][out.name].grad is not None]
                if gs:
                    tensors.append(value)
                    grads.append(sum(gs[1:], gs[0]))
        if tensors:
            torch.autograd.backward(tensors, grads)
    return loss


def _gpt(symbolic=()):
    spec = build_model(GPT)
    gm = annotate_blocks(annotate_shapes(capture_spec(spec, symbolic=symbolic)))
    return spec, gm


@pytest.fixture(scope="module")
def gpt():
    return _gpt()


def _reference(gm, inputs):
    params = dict(gm.named_parameters())  # tied weights appear once, under their first name
    loss = gm(*inputs)
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads))


def _stage_grads(split):
    """Gradient of each original parameter: the sum over the stages holding a copy."""
    total: dict[str, torch.Tensor] = {}
    canonical = {alias: name for name, names in split.aliases.items() for alias in names}
    seen: set[tuple[int, int]] = set()
    for s, module in enumerate(split.modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            if (s, id(p)) in seen:
                continue
            seen.add((s, id(p)))
            key = canonical.get(name, name)
            total[key] = p.grad if key not in total else total[key] + p.grad
    return total


@pytest.mark.parametrize("n_stages", [2, 4])
def test_gpt_stages_reproduce_loss_and_grads(gpt, n_stages):
    spec, gm = gpt
    inputs = spec.example_inputs()
    ref_loss, ref_grads = _reference(gm, inputs)

    layers = find_layers(gm)
    assert layers == [f"blocks.{i}" for i in range(4)]
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, balanced_boundaries(len(layers), n_stages)))
    for module in split.modules:
        module.zero_grad(set_to_none=True)
    loss = run_pipeline(split, dict(zip(("idx", "targets"), inputs)), spec.dims)

    assert torch.equal(loss, ref_loss)
    grads = _stage_grads(split)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=0, msg=name)  # readable diff first
    # Bitwise, even the tied weight (a sum of two addends is the same in either order).
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())

    # Tied embedding / LM head: a copy on the first and on the last stage, original names kept.
    assert split.tied == {"wte.weight": (0, n_stages - 1)}
    assert split.aliases == {"wte.weight": ("wte.weight", "lm_head.weight")}
    first, last = dict(split.modules[0].named_parameters()), dict(split.modules[-1].named_parameters())
    assert "wte.weight" in first and "lm_head.weight" in last and "wte.weight" not in last
    assert first["wte.weight"] is not last["lm_head.weight"]
    # Each block's parameters live on exactly the stage of its layer.
    per_stage = len(layers) // n_stages
    for s, module in enumerate(split.modules):
        blocks = {n.split(".")[1] for n, _ in module.named_parameters() if n.startswith("blocks.")}
        assert blocks == {str(i) for i in range(s * per_stage, (s + 1) * per_stage)}
    # The original graph is tagged.
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["idx"].meta[PIPELINE_STAGE] == 0
    assert nodes["targets"].meta[PIPELINE_STAGE] == n_stages - 1
    assert nodes["cross_entropy_loss"].meta[PIPELINE_STAGE] == n_stages - 1
    # export keeps one get_attr for the tied weight; it is tagged with its first user (wte).
    assert [n.name for n in gm.graph.nodes if n.op == "get_attr" and "lm_head" in n.name] == ["lm_head_weight"]
    assert nodes["lm_head_weight"].meta[PIPELINE_STAGE] == 0


def test_gpt_two_stage_io(gpt):
    _, gm = gpt
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, ["blocks.2"]))
    hidden = TensorMeta(shape=(2, 16, 64), dtype=torch.float32, requires_grad=True)
    tokens = TensorMeta(shape=(2, 16), dtype=torch.int64)
    (boundary,) = split.io[0].outputs
    assert split.io[0] == StageIO(stage=0, inputs=(StageInput(name="idx", source=None, meta=tokens),),
                                  outputs=(StageOutput(name=boundary.name, meta=hidden, dests=(1,)),))
    assert split.io[1] == StageIO(
        stage=1,
        inputs=(StageInput(name=boundary.name, source=0, meta=hidden),
                StageInput(name="targets", source=None, meta=tokens)),
        outputs=(StageOutput(name="cross_entropy_loss", meta=TensorMeta(shape=(), dtype=torch.float32,
                                                                         requires_grad=True),
                             dests=(), graph_output=0),))
    # The boundary is the residual stream leaving block 1 (its last add).
    producer = next(n for n in gm.graph.nodes if n.name == boundary.name)
    assert producer.target is torch.ops.aten.add.Tensor and module_path(producer) == "blocks.1"
    assert all(module_path(u).startswith("blocks.2") for u in producer.users)


def test_symbolic_boundaries_and_sizes_rebuilt_locally():
    spec, gm = _gpt(symbolic=("batch", "seq"))
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, [1, 2, 3]))
    for io in split.io[1:]:
        recv = [i for i in io.inputs if i.kind == "recv"]
        assert [i.meta.shape for i in recv] == [(B, S, 64)]
        assert not [i for i in io.inputs if i.kind == "size"]  # batch and seq come from the hidden state
    # Every later stage rebuilds the sizes its views need from its received tensor.
    for module in split.modules[1:]:
        sizes = [n for n in module.graph.nodes if n.target is torch.ops.aten.sym_size.int]
        assert sizes and all(n.args[0].op == "placeholder" for n in sizes)
    # Stage programs run at other dims than the capture's example (batch 3, seq 8).
    dims = {"batch": 3, "seq": 8}
    inputs = spec.example_inputs(dims)
    loss = run_pipeline(split, dict(zip(("idx", "targets"), inputs)), dims)
    assert torch.equal(loss, gm(*inputs))


def test_rotary_tables_are_made_on_the_stage_that_reads_them():
    # Each Llama block makes its RoPE tables from the sequence length alone; export checks each
    # table's metadata with a node nothing reads, which must not pull the table to stage 0 (every
    # later stage would receive its blocks' tables with each micro-batch)
    spec = build_model("llama:layers=4,hidden=32,heads=4,kv_heads=2,vocab=64,seq=8")
    gm = annotate_blocks(annotate_shapes(capture_spec(spec, symbolic=("batch", "seq"))))
    checks = [n for n in gm.graph.nodes if "assert_tensor_metadata" in str(n.target) and not n.users]
    assert checks  # the case this guards
    assignment = assign_stages_by_chain(gm, [2, 3, 4])
    split = split_pipeline_stages(gm, assignment)
    for io in split.io[1:]:
        assert [i.meta.shape for i in io.inputs if i.kind == "recv"] == [(B, S, 32)], io.inputs
    tables = [n for n in gm.graph.nodes if n.name.startswith(("cos", "sin"))]
    assert len({assignment.stage_of[n.name] for n in tables}) == 4
    for n in tables:
        assert {assignment.stage_of[u.name] for u in n.users} == {assignment.stage_of[n.name]}
    dims = {"batch": 2, "seq": 8}
    inputs = spec.example_inputs(dims)
    assert torch.equal(run_pipeline(split, dict(zip(("idx", "targets"), inputs)), dims), gm(*inputs))


class Skip(nn.Module):
    """x -> a -> b -> c -> d, with ``a`` also read by ``d`` three stages later."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        a = self.layers[0](x)
        h = torch.tanh(self.layers[1](a))
        h = torch.tanh(self.layers[2](h))
        return (self.layers[3](h) * a).sum()


def _skip_graph():
    torch.manual_seed(0)
    gm = capture_model(Skip(), inputs=(InputSpec(name="x", shape=("batch", 8)),), dims={"batch": 4})
    return annotate_blocks(annotate_shapes(gm))


@pytest.mark.parametrize("skip", ["relay", "direct"])
def test_skip_connection_over_three_stages(skip):
    gm = _skip_graph()
    assignment = assign_stages_by_layers(gm, [1, 2, 3])
    split = split_pipeline_stages(gm, assignment, skip=skip)
    a = next(n.name for n in gm.graph.nodes if n.meta.get(PIPELINE_STAGE) == 0 and n.op == "call_function")
    a_meta = TensorMeta(shape=(4, 8), dtype=torch.float32, requires_grad=True)
    sends = {s: {o.name: o.dests for o in io.outputs} for s, io in enumerate(split.io)}
    recvs = {s: {i.name: i.source for i in io.inputs if i.kind == "recv"} for s, io in enumerate(split.io)}
    if skip == "relay":  # hops 0 -> 1 -> 2 -> 3
        assert all(sends[s][a] == (s + 1,) for s in range(3))
        assert all(recvs[s][a] == s - 1 for s in (1, 2, 3))
    else:  # one send, straight to stage 3
        assert sends[0][a] == (1, 3) and a not in sends[1] and a not in sends[2]
        assert recvs[3][a] == 0 and a not in recvs[2]
    assert all(i.meta == a_meta for io in split.io for i in io.inputs if i.name == a)
    assert split.skip == skip

    x = torch.randn(4, 8)
    ref_loss, ref_grads = _reference(gm, (x,))
    loss = run_pipeline(split, {"x": x}, {"batch": 4})
    assert torch.equal(loss, ref_loss)
    grads = _stage_grads(split)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_non_monotone_assignment_names_the_node():
    gm = _skip_graph()
    ok = assign_stages_by_layers(gm, [2])
    bad = dict(ok.stage_of)
    victim = next(n for n in gm.graph.nodes if n.op == "call_function" and bad[n.name] == 1
                  and any(bad.get(a.name) == 1 and a.op == "call_function" for a in n.all_input_nodes))
    bad[victim.name] = 0
    with pytest.raises(PassError, match=f"node {victim.name!r}.*stage 0.*later stage 1"):
        split_pipeline_stages(gm, bad)
    with pytest.raises(PassError, match="strictly increasing"):
        assign_stages_by_layers(gm, [2, 2])


def test_explicit_mapping_fills_in_the_rest():
    gm = _skip_graph()
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assignment = assign_stages(gm, {linears[2]: 1})
    assert assignment.n_stages == 2
    # Nodes before the mapped one stay on stage 0 (max of their inputs), later ones follow it.
    assert [assignment.stage_of[n.name] for n in linears] == [0, 0, 1, 1]
    x = torch.randn(4, 8)
    assert torch.equal(run_pipeline(split_pipeline_stages(gm, assignment), {"x": x}, {"batch": 4}), gm(x))


class _Flatten(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h, rows):
        return self.linear(h.reshape(rows, 8))


class FlattensLate(nn.Module):
    """Stage 1 flattens the boundary (batch, seq, 8) into ``batch * seq`` rows, a size made on stage 0."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), _Flatten()])

    def forward(self, x):
        b, s, _ = x.shape
        return self.layers[1](self.layers[0](x), b * s).cumsum(0).sum()


def test_a_product_of_sizes_is_rebuilt_from_the_received_tensor():
    torch.manual_seed(0)
    gm = annotate_blocks(annotate_shapes(capture_model(FlattensLate(), inputs=(InputSpec(name="x", shape=("batch", "seq", 8)),),
                                       dims={"batch": 2, "seq": 3}, symbolic=("batch", "seq"))))
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, [1]))
    assert [(i.kind, i.meta.shape if i.meta else i.value) for i in split.io[1].inputs] == [("recv", (B, S, 8))]
    products = [n for n in split.modules[1].graph.nodes if n.target is operator.mul]
    assert len(products) == 1 and all(a.target is torch.ops.aten.sym_size.int and a.args[0].op == "placeholder"
                                      for a in products[0].args)
    dims = {"batch": 4, "seq": 5}
    x = torch.randn(4, 5, 8)
    assert torch.allclose(run_pipeline(split, {"x": x}, dims), gm(x))


class Flattened(nn.Module):
    """The boundary tensor is (batch*seq, 8): stage 1 cannot read batch and seq from it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        b, s, h = x.shape
        y = self.layers[0](x).flatten(0, 1)
        return self.layers[1](y).view(b, s, h).cumsum(1).sum()


def test_size_without_a_carrier_becomes_a_size_input():
    torch.manual_seed(0)
    gm = annotate_blocks(annotate_shapes(capture_model(Flattened(), inputs=(InputSpec(name="x", shape=("batch", "seq", 8)),),
                                       dims={"batch": 2, "seq": 3}, symbolic=("batch", "seq"))))
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, [1]))
    inputs = split.io[1].inputs
    assert [(i.kind, i.meta.shape if i.meta else i.value) for i in inputs] == [
        ("recv", (B * S, 8)), ("size", B), ("size", S)]
    assert not any(i.name == "x" for i in inputs)  # the stage does not read x for its sizes
    dims = {"batch": 4, "seq": 5}
    x = torch.randn(4, 5, 8)
    assert torch.equal(run_pipeline(split, {"x": x}, dims), gm(x))


def test_virtual_stage_placement():
    assert [stage_rank_chunk(s, 2, 4) for s in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    with pytest.raises(PassError, match="multiple of pp"):
        stage_rank_chunk(0, 3, 4)
