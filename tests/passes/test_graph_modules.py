"""passes.ir.graph_modules: lazy code generation, and copies that share immutable metadata."""
import copy
from dataclasses import dataclass

import sympy
import torch
from torch import fx, nn

from passes.ir.graph_modules import compiled, copy_graph_module, graph_module


@dataclass(frozen=True)
class _Summary:
    bytes: sympy.Expr
    per_node: dict


def _module() -> fx.GraphModule:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    b = sympy.Symbol("batch", positive=True, integer=True)
    gm.meta["summary"] = _Summary(bytes=16 * b + 64, per_node={"relu": [4 * b]})
    gm.meta["plain"] = {"counts": [1, 2]}
    return gm


def test_a_copy_shares_expressions_and_nothing_else():
    gm = _module()
    twin = copy_graph_module(gm)
    assert twin.meta["summary"] == gm.meta["summary"]
    assert twin.meta["summary"] is not gm.meta["summary"]  # the dataclass, its dict and list are copies
    assert twin.meta["summary"].per_node["relu"] is not gm.meta["summary"].per_node["relu"]
    assert twin.meta["summary"].bytes is gm.meta["summary"].bytes  # the expression is shared
    assert twin.meta["summary"].per_node["relu"][0] is gm.meta["summary"].per_node["relu"][0]
    assert twin.meta["plain"] == gm.meta["plain"] and twin.meta["plain"]["counts"] is not gm.meta["plain"]["counts"]
    assert twin.graph is not gm.graph and [n.name for n in twin.graph.nodes] == [n.name for n in gm.graph.nodes]
    p, q = dict(gm.named_parameters()), dict(twin.named_parameters())
    assert all(q[k] is not p[k] and torch.equal(q[k], p[k]) for k in p)
    x = torch.randn(2, 4)
    assert torch.equal(twin(x), gm(x))


def test_a_copy_shares_what_it_is_told_to():
    gm = _module()
    twin = copy_graph_module(gm, share=tuple(gm.parameters()))
    assert [id(p) for p in twin.parameters()] == [id(p) for p in gm.parameters()]
    assert twin.graph is not gm.graph and twin.meta["plain"] is not gm.meta["plain"]


def test_a_copy_is_what_deepcopy_makes():
    gm = _module()
    a, b = copy_graph_module(gm), copy.deepcopy(gm)
    assert a.code == b.code and a.meta["summary"] == b.meta["summary"]


def test_lazy_modules_make_their_code_when_asked():
    gm = fx.symbolic_trace(nn.Linear(3, 3))
    lazy = graph_module(gm, gm.graph)
    assert "linear" in compiled(lazy).code
    assert torch.equal(lazy(torch.ones(1, 3)), gm(torch.ones(1, 3)))


def test_a_weightless_copy_has_meta_tensors_of_the_same_shapes_and_ties():
    """What the memory replay lowers: the graph and its metadata as they are, every parameter and
    buffer a meta tensor (no storage), a tied weight still one parameter; the original untouched."""
    from partitioner.compile.build import capture_for_pipeline
    from partitioner.inputs.models import build_model
    from passes.ir.graph_modules import weightless_copy

    gm = capture_for_pipeline(build_model("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"))
    light = weightless_copy(gm)
    assert [str(n.target) for n in light.graph.nodes] == [str(n.target) for n in gm.graph.nodes]
    named = dict(gm.named_parameters(remove_duplicate=False))
    for name, p in light.named_parameters(remove_duplicate=False):
        assert p.device.type == "meta" and p.shape == named[name].shape and p.dtype == named[name].dtype
        assert p.requires_grad == named[name].requires_grad
    ties = lambda m: sorted(len(ns) for ns in _names_by_id(m).values())  # noqa: E731
    assert ties(light) == ties(gm) and max(ties(gm)) == 2  # the embedding and the LM head
    assert all(b.device.type == "meta" for b in light.buffers())
    assert all(p.device.type == "cpu" for p in gm.parameters())


def _names_by_id(module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out
