"""Stage programs lowered in one process and taken in another (passes.lowering.shared_programs): the
taker's programs are those it would have lowered itself (code, digest, tensor names, values and
sharing, ZeRO-3's full tensors, the rank programs assembled from them), its tensors its own; a
tensor no recipe makes travels by value when small and makes the programs unshareable when large."""
from __future__ import annotations

import pickle

import pytest
import torch

from partitioner.compile.build import capture_for_pipeline
from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from passes.ir.errors import PassError
from passes.ir.graph_transfer import pack_graph, unpack_graph
from passes.lowering.lower import lower, programs_of
from passes.lowering.shared_programs import BY_VALUE_BYTES, Derived, pack_programs, take_programs

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
MOE = ("moe:layers=4,hidden=32,heads=2,vocab=64,seq=8,experts=4,top_k=2,expert_hidden=32,shared_experts=1,"
       "aux_loss=0.1,dropout=0.0")
CASES = {
    "tp-sp-zero3-full": (GPT, ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=2, zero_stage=3,
                                             checkpointing="full", sequence_parallel=True)),
    "ep-full": (MOE, ParallelConfig(dp=2, pp=2, ep=2, micro_batch_size=2, num_micro_batches=2, checkpointing="full")),
    "tensor-remat": (GPT, ParallelConfig(dp=2, pp=2, micro_batch_size=2, num_micro_batches=2, checkpointing="tensor")),
}


def _graphs(spec_text: str, n: int):
    """``n`` ranks' analysed graphs: one capture, rebuilt around each rank's own copy of the model."""
    spec = build_model(spec_text, seed=0)
    payload = pack_graph(capture_for_pipeline(spec), spec.module)
    out = []
    for _ in range(n):
        other = build_model(spec_text, seed=1)
        other.module.load_state_dict(spec.module.state_dict())
        out.append(unpack_graph(payload, other.module))
    return out


def _tensors(module) -> dict:
    return {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("case", list(CASES))
def test_taken_programs_are_those_the_rank_would_lower(case):
    spec_text, config = CASES[case]
    first, taker, alone_graph = _graphs(spec_text, 3)
    rank = config.dp_cp * config.tp * (config.pp - 1) + config.tp - 1  # the last pipeline rank, last tp rank
    programs = programs_of(config, rank)
    made = lower(first, config, cost=None, programs=programs)
    shared = pickle.loads(pickle.dumps(pack_programs(made, programs)))
    taken = take_programs(taker, config, shared, cost=None)
    alone = lower(alone_graph, config, cost=None, programs=programs)
    assert taken.digest() == alone.digest() == made.digest()
    sent = {id(t) for p in made.programs.values() for t in _tensors(p).values()}
    whole = {id(t) for t in _tensors(taken.graph).values()}
    whole_alone = {id(t) for t in _tensors(alone.graph).values()}
    for key in programs:
        mine, theirs = taken.programs[key], alone.programs[key]
        assert [n for n, _ in mine.named_modules()] == [n for n, _ in theirs.named_modules()]
        for (_, a), (_, b) in zip(mine.named_modules(), theirs.named_modules()):
            if isinstance(a, torch.fx.GraphModule):
                assert a.code == b.code and type(a).__name__ == type(b).__name__
        ta, tb = _tensors(mine), _tensors(theirs)
        assert list(ta) == list(tb)
        groups_a, groups_b = {}, {}
        for name in ta:
            a, b = ta[name], tb[name]
            assert type(a) is type(b) and a.dtype == b.dtype and a.requires_grad == b.requires_grad, name
            assert a.shape == b.shape and torch.equal(a, b), name
            assert id(a) not in sent, name  # its own tensor, never the sender's
            assert (id(a) in whole) == (id(b) in whole_alone), name  # its whole graph's where alone's is
            groups_a.setdefault(id(a), []).append(name)
            groups_b.setdefault(id(b), []).append(name)
        assert sorted(groups_a.values()) == sorted(groups_b.values())  # held under the same names
        if hasattr(theirs, "zero3_sources"):
            assert list(mine.zero3_sources) == list(theirs.zero3_sources)
            for name, t in theirs.zero3_sources.items():
                assert torch.equal(mine.zero3_sources[name], t)
        assert sorted(mine.meta) == sorted(theirs.meta)
    for r in range(config.world_size):  # every data-axis rank's program (its ep experts) from the taken ones
        if programs_of(config, r) == programs:
            a, b = taken.rank_program(r), alone.rank_program(r)
            assert a.comms == b.comms and a.tied == b.tied and a.expert_params == b.expert_params
            for s in a.modules:
                for (name, x), (_, y) in zip(_tensors(a.modules[s]).items(), _tensors(b.modules[s]).items(),
                                             strict=True):
                    assert torch.equal(x, y), name


def test_a_tensor_no_recipe_makes_travels_by_value_when_small_and_stops_the_sharing_when_large():
    config = ParallelConfig(dp=2, pp=2, micro_batch_size=2, num_micro_batches=2, zero_stage=3)
    first, taker = _graphs(GPT, 2)
    made = lower(first, config, cost=None, programs=[(0, 0)])
    program = made.programs[(0, 0)]
    small = next(n for n, p in program.named_parameters() if p.numel() * p.element_size() <= BY_VALUE_BYTES)
    odd = torch.nn.Parameter(torch.randn_like(program.get_parameter(small)))
    owner, _, leaf = small.rpartition(".")
    program.get_submodule(owner).register_parameter(leaf, odd)
    made.programs[(0, 0)].zero3_sources.pop(small)  # nor is it ZeRO-3's: by value
    shared = pack_programs(made, [(0, 0)])
    taken = take_programs(taker, config, shared, cost=None)
    assert torch.equal(taken.programs[(0, 0)].get_parameter(small), odd)

    large = next(n for n, _ in program.named_parameters() if n != small)
    big = torch.nn.Parameter(torch.randn(BY_VALUE_BYTES // 4 + 1))
    owner, _, leaf = large.rpartition(".")
    program.get_submodule(owner).register_parameter(leaf, big)
    with pytest.raises(PassError, match=f"{large}.*too large"):
        pack_programs(made, [(0, 0)])


def test_a_recipe_refuses_a_whole_graph_that_does_not_fit():
    first, = _graphs(GPT, 1)
    recipe = Derived(name="wte.weight", kind="parameter", tp=None, rows=None, zero3=None, shape=(3, 3),
                     dtype=torch.float32)
    with pytest.raises(PassError, match="came out as"):
        recipe.make(first)
    with pytest.raises(PassError, match="no parameter 'nope'"):
        Derived(name="nope", kind="parameter", tp=None, rows=None, zero3=None, shape=(1,),
                dtype=torch.float32).make(first)
