"""The lowering on a small GPT: pipelines built from the registry and their text form, the
ordering rules, stage boundaries on the layer chain, the programs it makes and the rank program
it assembles, the re-analysis at the micro-batch."""
from __future__ import annotations

import pytest
import torch

from partitioner.compile.build import capture_for_pipeline
from partitioner.cost.cluster import Cluster
from partitioner.cost.cost_model import cost_hooks
from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from passes.ir.errors import ConfigError, PassError
from passes.ir.meta import CAPTURE, MEMORY_SUMMARY, SHAPE
from passes.lowering.lower import lower
from passes.lowering.manager import Pass, PassManager, pipeline_text
from passes.lowering.pipelines import ORDER, make_pass, manager, parse_pipeline, stage_passes, whole_graph_passes

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
COST = cost_hooks(Cluster.preset("local-cpu"))


@pytest.fixture(scope="module")
def graph():
    return capture_for_pipeline(build_model(GPT))


def test_pipeline_text_builds_the_same_pipeline():
    config = ParallelConfig(tp=2, pp=2, checkpointing="full", offload="activations", micro_batch_size=2)
    for passes in (whole_graph_passes(config, cost=COST, starts=(3,)),
                   stage_passes(config, stage=1, tp_rank=1, tp_group="tp", cost=COST)):
        text = pipeline_text(passes)
        again = parse_pipeline(text, cost=COST)
        assert [p.spec() for p in again] == [p.spec() for p in passes]
    assert "offload_policy{selection=all,optimizer_on_host=false}" in text  # cost has no text form
    with pytest.raises(PassError, match="unknown pass 'tag_everything'"):
        parse_pipeline("annotate_shapes,tag_everything")
    with pytest.raises(PassError, match="takes no option"):
        make_pass("annotate_shapes", degree=2)


def test_pipeline_text_written_before_the_dtype_option_still_reads():
    for old, dtype in (("false", "fp32"), ("true", "bf16")):
        (p,) = parse_pipeline(f"annotate_memory{{optimizer=adamw,mixed_precision={old}}}")
        assert p.spec() == f"annotate_memory{{optimizer=adamw,dtype={dtype}}}"


def test_ordering_rules_refuse_a_pipeline_in_the_wrong_order():
    wrong = [make_pass("offload_policy", selection="all", cost=COST), make_pass("checkpoint_policy", policy="full")]
    with pytest.raises(PassError, match="'offload_policy' .* runs before 'checkpoint_policy'.*offload is decided after"):
        manager(wrong)
    names = {r.first for r in ORDER} | {r.then for r in ORDER}
    assert {"checkpoint_policy", "offload_policy", "apply_tensor_parallel", "apply_offload"} <= names
    # re-running an analysis after a rewrite is fine: a rule orders first occurrences
    PassManager([Pass(name="annotate_shapes", fn=lambda g, c: g), Pass(name="annotate_flops", fn=lambda g, c: g),
                 Pass(name="annotate_shapes", fn=lambda g, c: g)], order=ORDER)


def test_programs_of_a_tp_pp_plan_and_its_rank_programs(graph):
    config = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=2)
    low = lower(graph, config, cost=COST)
    assert sorted(low.programs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.name for r in low.pipelines] == ["whole_graph", "stage0_tp0", "stage0_tp1", "stage1_tp0", "stage1_tp1"]
    program = low.rank_program(6)  # pp 1, dp 1, tp 0
    assert (program.pp_index, program.dp_index, program.tp_index, program.stages) == (1, 1, 0, (1,))
    assert program.config is config and program.modules[1] is low.programs[(1, 0)]
    assert [a for a in program.actions if a.kind.value == "F"]  # its schedule
    assert set(program.tied) == {"wte.weight"} and program.tied["wte.weight"].local_shape == (32, 32)
    assert program.canonical_names["lm_head.weight"] == "wte.weight"
    # re-analysed at the micro-batch: concrete numbers, 2 samples of 8 tokens
    module = low.programs[(1, 0)]
    assert module.meta[CAPTURE].symbolic == () and dict(module.meta[CAPTURE].dims)["batch"] == 2
    shapes = [n.meta[SHAPE].tensors[0].shape for n in module.graph.nodes if n.op == "placeholder"]
    assert shapes[0][:2] == (2, 8)
    assert int(module.meta[MEMORY_SUMMARY].peak_bytes) > 0
    # the caller's graph is not changed
    assert not any("tensor_parallel" in n.meta for n in graph.graph.nodes)


def test_a_rank_lowers_only_its_own_programs(graph):
    config = ParallelConfig(tp=2, pp=2)
    low = lower(graph, config, cost=COST, programs=[(1, 1)])
    assert list(low.programs) == [(1, 1)]
    assert low.rank_program(3).stages == (1,)
    with pytest.raises(ConfigError, match="made no program of stage"):
        low.rank_program(0)


def test_stage_boundaries_follow_the_chain(graph):
    low = lower(graph, ParallelConfig(pp=2, stage_boundaries=(2,)), cost=COST)  # embedding + block 0 | rest
    first = {n for n, _ in low.programs[(0, 0)].named_parameters()}
    assert "blocks.0.ln_1.weight" in first and "blocks.1.ln_1.weight" not in first
    with pytest.raises(ConfigError, match="stage_boundaries .* go past the head"):
        lower(graph, ParallelConfig(pp=2, stage_boundaries=(7,)), cost=COST)
    with pytest.raises(ConfigError, match="at most 4 stages"):
        lower(graph, ParallelConfig(pp=8), cost=COST)


def test_offload_needs_the_cost_of_a_cluster(graph):
    with pytest.raises(PassError, match="offload_policy needs the cost hooks"):
        lower(graph, ParallelConfig(offload="activations"), cost=None)


def test_lowered_program_trains_like_the_graph(graph):
    # one stage, one rank: the program computes the captured step's loss
    spec = build_model(GPT)
    low = lower(graph, ParallelConfig(micro_batch_size=2), cost=COST)
    module = low.programs[(0, 0)]
    idx, targets = spec.example_inputs({"batch": 2}, seed=3)
    (loss,) = module(idx, targets)
    torch.testing.assert_close(loss, spec.loss(spec.module, idx, targets))
