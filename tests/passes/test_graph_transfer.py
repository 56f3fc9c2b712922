"""An analysed graph packed on one process and rebuilt around another copy of the model: the
same code, tensors in the same order (the other copy's own objects), the passes' meta, and the
same lowering and loss; a model that lacks a tensor of the graph is named."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ir_dumps.writer import program_text
from partitioner.compile.build import capture_for_pipeline, rank_program
from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from passes.ir.errors import PassError
from passes.ir.graph_transfer import PASS_KEYS, pack_graph, unpack_graph
from passes.ir.meta import EXPORT_MODULE_STACK, module_path
from partitioner.calibration.job_cluster import local_cluster

MODELS = {
    "gpt": "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    "hf-llama": "hf-llama",
    "resnet": "resnet:blocks=1-1,widths=8-16,image=16,classes=10",  # batch-norm buffers
}


def _round_trip(spec_text: str):
    spec = build_model(spec_text, seed=0)
    graph = capture_for_pipeline(spec)
    other = build_model(spec_text, seed=1)  # another rank's copy: its own tensors
    return spec, graph, other, unpack_graph(pack_graph(graph, spec.module), other.module)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_rebuilt_graph_is_the_analysed_one(name):
    spec, graph, other, rebuilt = _round_trip(MODELS[name])
    assert rebuilt.code == graph.code
    assert [n for n, _ in rebuilt.named_parameters()] == [n for n, _ in graph.named_parameters()]
    assert [n for n, _ in rebuilt.named_buffers()] == [n for n, _ in graph.named_buffers()]
    assert set(rebuilt.state_dict()) == set(graph.state_dict())
    own = dict(other.module.named_parameters()) | dict(other.module.named_buffers())
    for n, t in list(rebuilt.named_parameters()) + list(rebuilt.named_buffers()):
        if n in own:
            assert t is own[n], n  # the rank's own tensor, not a copy of rank 0's
    for a, b in zip(graph.graph.nodes, rebuilt.graph.nodes, strict=True):
        assert (a.op, a.name, a.target) == (b.op, b.name, b.target)
        for key in PASS_KEYS:
            assert a.meta.get(key) == b.meta.get(key), (a.name, key)
        assert module_path(a) == module_path(b)
        assert "val" not in b.meta  # export's fake values stay in the capturing process
    assert {k: graph.meta[k] for k in PASS_KEYS if k in graph.meta} == {k: rebuilt.meta[k] for k in PASS_KEYS
                                                                      if k in rebuilt.meta}
    assert any(EXPORT_MODULE_STACK in n.meta for n in rebuilt.graph.nodes)


def test_the_rebuilt_graph_computes_the_same_loss_and_lowering():
    spec, graph, other, rebuilt = _round_trip(MODELS["gpt"])
    other.module.load_state_dict(spec.module.state_dict())  # what the weight broadcast does
    batch = spec.example_inputs({"batch": 4}, seed=3)
    assert torch.equal(rebuilt(*batch), graph(*batch))
    config = ParallelConfig(dp=1, tp=2, pp=2, micro_batch_size=2, num_micro_batches=2, checkpointing="full",
                            sequence_parallel=True)
    for rank in range(config.world_size):
        mine, theirs = rank_program(graph, config, rank, cluster=local_cluster(config.world_size)), rank_program(rebuilt, config, rank, cluster=local_cluster(config.world_size))
        for s in mine.stages:
            assert program_text(theirs.modules[s], "p") == program_text(mine.modules[s], "p")


def test_a_model_without_a_tensor_of_the_graph_is_named():
    spec = build_model(MODELS["gpt"])
    payload = pack_graph(capture_for_pipeline(spec), spec.module)
    smaller = build_model(MODELS["gpt"])
    del smaller.module.ln_f
    smaller.module.ln_f = nn.Identity()
    with pytest.raises(PassError, match="no parameter 'ln_f.weight'.*same model"):
        unpack_graph(payload, smaller.module)


def test_a_program_with_checkpointed_regions_comes_back_with_them():
    """A lowered stage program's checkpointed regions (graph modules in it) travel as graphs of
    their own; a parameter a region re-lists comes back as the program's one object; a tensor
    packed as a token comes back as what ``resolve`` makes of it."""
    from passes.lowering.lower import lower

    spec = build_model(MODELS["gpt"], seed=0)
    graph = capture_for_pipeline(spec)
    config = ParallelConfig(pp=2, micro_batch_size=2, num_micro_batches=2, checkpointing="full")
    lowering = lower(graph, config, cost=None, programs=[(0, 0)])
    program = lowering.programs[(0, 0)]
    regions = [n for n, m in program.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert regions
    token = "wpe"  # one tensor as a token, the others by name from the whole graph
    wpe = program.get_parameter("wpe.weight")
    made = torch.nn.Parameter(wpe.detach().clone())
    rebuilt = unpack_graph(pack_graph(program, lowering.graph, refs={id(wpe): token}), lowering.graph,
                           resolve={token: made}.__getitem__)
    assert rebuilt.code == program.code
    assert [n for n, _ in rebuilt.named_modules()] == [n for n, _ in program.named_modules()]
    for name in regions:
        mine, theirs = rebuilt.get_submodule(name), program.get_submodule(name)
        assert type(mine).__name__ == type(theirs).__name__ == "CheckpointRegion"
        assert mine.code == theirs.code
    assert ([n for n, _ in rebuilt.named_parameters(remove_duplicate=False)]
            == [n for n, _ in program.named_parameters(remove_duplicate=False)])
    own = {id(t) for t in lowering.graph.parameters()}
    groups: dict[tuple[int, int], list[str]] = {}  # names of one object in both
    for (name, mine), (_, theirs) in zip(rebuilt.named_parameters(remove_duplicate=False),
                                         program.named_parameters(remove_duplicate=False)):
        if theirs is wpe:
            assert mine is made
        elif id(theirs) in own:
            assert mine is theirs, name  # the whole graph's own, by name
        else:  # a tied weight's copy on this stage: by value
            assert mine is not theirs and torch.equal(mine, theirs), name
        groups.setdefault((id(mine), id(theirs)), []).append(name)
    assert len({i for i, _ in groups}) == len({j for _, j in groups}) == len(groups)  # regions share, as there
    assert any(len(names) > 1 for names in groups.values())
    batch = spec.example_inputs({"batch": 2}, seed=3)
    for mine, theirs in zip(rebuilt(*batch), program(*batch), strict=True):
        assert torch.equal(mine, theirs)


def test_symbolic_meta_comes_back_equal_without_being_evaluated_again(monkeypatch):
    # sympy's own unpickling rebuilds each expression through its evaluating constructor: a Max
    # of a memory bound's terms compares every pair again, on every rank that unpacks the graph
    import sympy

    from passes.ir.meta import MEMORY_SUMMARY

    spec = build_model(MODELS["gpt"], seed=0)
    graph = capture_for_pipeline(spec)
    b, s = sympy.symbols("batch seq", positive=True, integer=True)
    bound = sympy.Max(3 * b * s + 7, 2 * b * s ** 2, b * s + sympy.Min(b, 4 * s))
    graph.meta["test_bound"] = bound  # a plain picklable entry travels with the graph's meta
    payload = pack_graph(graph, spec.module)

    def evaluated(*args, **kwargs):
        raise AssertionError("an expression was evaluated again while unpacking")

    monkeypatch.setattr(sympy.Max, "_find_localzeros", classmethod(evaluated))
    monkeypatch.setattr(sympy.Min, "_find_localzeros", classmethod(evaluated))
    rebuilt = unpack_graph(payload, build_model(MODELS["gpt"], seed=1).module)
    assert rebuilt.meta["test_bound"] == bound and rebuilt.meta["test_bound"].func is sympy.Max
    assert rebuilt.meta.get(MEMORY_SUMMARY) == graph.meta.get(MEMORY_SUMMARY)
    monkeypatch.undo()
    assert sympy.simplify(rebuilt.meta["test_bound"] - bound) == 0
