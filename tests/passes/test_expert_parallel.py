"""apply_expert_parallel and average_aux_loss on the zoo ``moe`` model: what each ep rank's program
holds and runs (its experts only, under the model's names; the dispatch, column pick and combine per
block), the load-balancing averages over the data axis, one process simulating the ranks against one
device's loss, and the refusals (no MoE, ep not dividing the experts, knobs ep does not run with
yet); on Hugging Face Mixtral (stacked experts) each ep rank's rows of the stacked weights and the
rows, ids and weights gathered for them."""
from __future__ import annotations

import pytest
import torch

import partitioner
from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from passes.ir.errors import ConfigError
from passes.ir.meta import EXPERT_PARALLEL
from passes.ir.ops import op_name
from passes.lowering.lower import lower

E, L = 4, 2
ZOO = (f"moe:layers={L},hidden=16,heads=2,vocab=32,seq=8,experts={E},top_k=2,expert_hidden=16,shared_experts=1,"
       f"aux_loss=0.1")


@pytest.fixture(scope="module")
def graph():
    return partitioner.analyze(ZOO).graph


def _ops(gm) -> list[str]:
    return [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target)]


def _experts(gm) -> set[str]:
    return {n for n, _ in gm.named_parameters() if ".experts." in n}


@pytest.mark.parametrize("ep", [2, 4])
def test_each_ep_rank_holds_its_experts_and_gathers_the_tokens_for_them(graph, ep):
    low = lower(graph, ParallelConfig(dp=4, ep=ep, micro_batch_size=2), cost=None)
    held = []
    for rank in range(4):
        program = low.rank_program(rank)
        module = program.modules[0]
        mine = _experts(module)
        r = rank % ep
        assert mine == {f"blocks.{b}.moe.experts.{e}.{w}.weight" for b in range(L)
                        for e in range(r * E // ep, (r + 1) * E // ep) for w in ("gate", "up", "down")}
        assert set(program.expert_params) == mine
        held.append(mine)
        # per block: tokens and combine weights gathered, this rank's columns picked, the sum scattered back
        ops = _ops(module)
        assert ops.count("ep_dispatch") == 2 * L and ops.count("ep_local") == L and ops.count("ep_combine") == L
        assert ops.count("data_mean") == 2 * L  # f_e and P_e of each block's aux loss
        assert {c.kind for c in program.comms} >= {"ep", "data"}
        assert {c.ranks for c in program.comms_of("ep")} == {tuple(range(rank - r, rank - r + ep))}
        assert module.meta[EXPERT_PARALLEL].degree == ep
    assert set().union(*held[:ep]) == {f"blocks.{b}.moe.experts.{e}.{w}.weight" for b in range(L) for e in range(E)
                                       for w in ("gate", "up", "down")}


def test_simulated_ep_ranks_compute_one_devices_loss_and_router_gradient():
    """Two ep ranks in threads of one process (simulated groups): their mean loss is the one-device
    loss of the whole batch, and the router gradients averaged over them are one device's."""
    from partitioner.compile.build import capture_for_pipeline
    from runtime.kernels.collectives import _Comm, SimulatedGroup, register_group, run_simulated
    spec = build_model(ZOO)
    graph = capture_for_pipeline(spec)  # real weights (analyze builds the model on meta)
    config = ParallelConfig(dp=2, ep=2, micro_batch_size=2)
    for kind in ("ep", "data"):
        comm = _Comm(2, 30)
        for r in range(2):
            register_group(f"sim{r}.{kind}", SimulatedGroup(comm, r, 2))
    programs = [lower(graph, config, cost=None, tp_group=f"sim{r}").rank_program(r).modules[0] for r in range(2)]
    batch = spec.example_inputs({"batch": 4}, seed=3)
    reference = spec.loss(spec.module, *batch)
    reference.backward()

    def step(r):
        loss = programs[r](*[t[2 * r:2 * r + 2] for t in batch])
        loss = loss[0] if isinstance(loss, (tuple, list)) else loss
        loss.backward()
        return loss.detach()

    losses = run_simulated([lambda r=r: step(r) for r in range(2)])
    assert float(sum(losses) / 2) == pytest.approx(reference.item(), rel=1e-6)
    for b in range(L):
        name = f"blocks.{b}.moe.router.weight"
        mean = (programs[0].get_parameter(name).grad + programs[1].get_parameter(name).grad) / 2
        torch.testing.assert_close(mean, spec.module.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    # an expert's gradient: its rank's sum over the group's tokens, which the sync divides by dp * cp
    expert = "blocks.0.moe.experts.3.down.weight"
    torch.testing.assert_close(programs[1].get_parameter(expert).grad / 2, spec.module.get_parameter(expert).grad,
                               rtol=1e-5, atol=1e-7)


def test_without_ep_only_the_aux_averages_change(graph):
    low = lower(graph, ParallelConfig(dp=2, micro_batch_size=2), cost=None)
    module = low.rank_program(0).modules[0]
    assert _ops(module).count("data_mean") == 2 * L and "ep_dispatch" not in _ops(module)
    assert len(_experts(module)) == L * E * 3
    single = lower(graph, ParallelConfig(micro_batch_size=2), cost=None).rank_program(0).modules[0]
    assert "data_mean" not in _ops(single)


def test_refusals(graph):
    with pytest.raises(ConfigError, match="ep=3 does not divide the 4 experts"):
        lower(graph, ParallelConfig(dp=3, ep=3, micro_batch_size=1), cost=None)
    dense = partitioner.analyze("gpt:layers=2,hidden=16,heads=2,vocab=32,seq=8").graph
    with pytest.raises(ConfigError, match="model has none"):
        lower(dense, ParallelConfig(dp=2, ep=2, micro_batch_size=1), cost=None)
    for knobs, rule in [({"dp": 2, "ep": 4}, "dividing 2"), ({"dp": 2, "ep": 2, "tp": 2}, "tp=2 is not supported"),
                        ({"dp": 2, "ep": 2, "zero_stage": 3}, "zero_stage=3 is not supported"),
                        ({"dp": 2, "ep": 0}, "ep must be an integer >= 1")]:
        with pytest.raises(ConfigError, match=rule):
            ParallelConfig(**knobs)


MIXTRAL = ("hf-mixtral:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
           "vocab_size=64,num_local_experts=4,num_experts_per_tok=2,intermediate_size=48,seq=8")


@pytest.fixture(scope="module")
def mixtral():
    pytest.importorskip("transformers")
    return partitioner.analyze(build_model(MIXTRAL)).graph


def test_the_gathered_form_keeps_each_ep_ranks_rows_of_the_stacked_experts(mixtral):
    """Hugging Face Mixtral at ep=2: each rank holds rows 2r, 2r+1 of every stacked expert weight
    under the model's name, and per block gathers the rows, their ids and their combine weights,
    routes the ids to its rows and scatters the weighted rows back."""
    full = {n: p for n, p in mixtral.named_parameters() if ".experts." in n}
    low = lower(mixtral, ParallelConfig(dp=2, ep=2, micro_batch_size=1), cost=None)
    for rank in range(2):
        program = low.rank_program(rank)
        module = program.modules[0]
        mine = {n: p for n, p in module.named_parameters() if ".experts." in n}
        assert set(mine) == set(full) == set(program.expert_params) == set(program.stacked_experts)
        for name, p in mine.items():
            torch.testing.assert_close(p, full[name][2 * rank:2 * rank + 2], rtol=0, atol=0)
        ops = _ops(module)
        assert ops.count("ep_dispatch") == 3 * 2 and ops.count("ep_route") == 2 and ops.count("ep_combine") == 2
        assert "ep_local" not in ops


def test_the_gathered_forms_aux_loss_averages_over_the_data_axis(mixtral):
    """Hugging Face Mixtral's load-balancing loss (recomputed from every layer's router logits,
    counts and probabilities summed over the layers, then divided by the tokens) has one f * P
    product, whose two factors average over dp."""
    module = lower(mixtral, ParallelConfig(dp=2, micro_batch_size=1), cost=None).rank_program(0).modules[0]
    means = [n for n in module.graph.nodes if n.op == "call_function" and op_name(n.target) == "data_mean"]
    assert len(means) == 2 and len({u for m in means for u in m.users}) == 1  # both factors of one product
