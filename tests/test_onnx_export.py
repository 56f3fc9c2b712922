"""ONNX per pipeline stage: valid under onnx.checker, parameters under their original names,
send/recv as custom-domain nodes, annotations in metadata, and onnxruntime matching torch; per
(stage, tp rank) rank programs with the tp collectives as custom-domain nodes and each rank's
parameter shards; the text/JSON dumps of a stage module whose graph meta holds a plain int; the
dynamo exporter writing the files (our ops through its translation table, the same nodes as the
TorchScript exporter's), and the TorchScript exporter standing in, with a warning, where it fails."""
from __future__ import annotations

import functools

import json
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ir_dumps.json_dump import graph_json
from ir_dumps.onnx_export import DOMAIN, export_rank_programs, export_split, export_stage, stage_example_inputs
from ir_dumps.text import graph_text
from partitioner.inputs.models import build_model
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_spec
from passes.policies.checkpoint_policy import checkpoint_policy
from passes.ir.meta import PIPELINE_STAGE
from passes.policies.pipeline_stages import assign_stages, assign_stages_by_layers, balanced_boundaries
from passes.rewrites.pipeline_split import split_pipeline_stages
from partitioner.compile.build import lower_plan
from passes.ir.config import ParallelConfig
from passes.ir.program import global_rank
from runtime.kernels.collectives import trace_groups
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"


@pytest.fixture(scope="module")
def gpt():
    spec = build_model(GPT)
    gm = checkpoint_policy(annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec)))), policy="full")
    return spec, gm


@pytest.fixture(scope="module")
def two_stages(gpt, tmp_path_factory):
    spec, gm = gpt
    split = split_pipeline_stages(gm, assign_stages_by_layers(gm, balanced_boundaries(2, 2)))
    paths = export_split(split, tmp_path_factory.mktemp("onnx"), dims=spec.dims)
    return split, paths


def _custom(model):
    return [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node if n.domain == DOMAIN]


def test_two_stage_files_are_valid_with_send_and_recv(two_stages):
    split, paths = two_stages
    assert [p.name for p in paths] == ["stage0_tp0.onnx", "stage1_tp0.onnx"]
    first, last = (onnx.load(str(p)) for p in paths)
    for model in (first, last):
        onnx.checker.check_model(model)
        assert DOMAIN in {o.domain for o in model.opset_import}
    boundary = split.io[0].outputs[0].name
    assert split.io[1].inputs[0].name == boundary and split.io[1].inputs[0].source == 0
    assert _custom(first) == [("Send", [boundary], [f"{boundary}.sent"])]
    assert _custom(last) == [("Recv", [], [boundary])]
    # The received tensor is produced by the Recv node, no longer a graph input.
    assert boundary not in {i.name for i in last.graph.input}
    assert [i.name for i in last.graph.input] == ["targets"]
    recv = next(n for n in last.graph.node if n.op_type == "Recv")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in recv.attribute}["src_stage"] == 0


def test_parameter_names_and_annotations(two_stages):
    split, paths = two_stages
    first, last = (onnx.load(str(p)) for p in paths)
    inits = {i.name: i for i in first.graph.initializer}
    assert {"wte.weight", "wpe.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight"} <= set(inits)
    assert "tied copy of wte.weight on stages [0, 1]" in inits["wte.weight"].doc_string
    assert not any(n.startswith("blocks.1.") for n in inits)  # block 1 lives on stage 1
    assert "lm_head.weight" in {i.name for i in last.graph.initializer}
    props = {p.key: p.value for p in last.metadata_props}
    assert props["partitioner.stage"] == "1" and props["partitioner.tp_rank"] == "0"
    assert json.loads(props["partitioner.tied"]) == {"wte.weight": [0, 1]}
    annotations = json.loads(props["partitioner.annotations"])
    # checkpoint_policy(full) marked block 1's nodes for recompute; the annotation travels.
    assert any(a.get("checkpoint", {}).get("recompute") for a in annotations.values())


def _ort(path, names, args):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {n: a.numpy() for n, a in zip(names, args) if n in {i.name for i in sess.get_inputs()}}
    return sess.run(None, feed)


def test_whole_graph_pp1_matches_torch(gpt, tmp_path):
    spec, gm = gpt
    split = split_pipeline_stages(gm, assign_stages(gm, {}, n_stages=1))
    path = export_stage(split, 0, tmp_path / "stage0_tp0.onnx", dims=spec.dims)
    model = onnx.load(str(path))
    assert _custom(model) == []  # nothing to send or receive
    inputs = spec.example_inputs()
    (loss,) = split.modules[0](*inputs)
    (got,) = _ort(path, ("idx", "targets"), inputs)
    np.testing.assert_allclose(got, loss.detach().numpy(), atol=1e-5, rtol=0)


def test_first_stage_without_comm_runs_in_onnxruntime(two_stages, gpt, tmp_path):
    spec, _ = gpt
    split, _ = two_stages
    path = export_stage(split, 0, tmp_path / "s0.onnx", dims=spec.dims, with_comm=False)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    (hidden,) = split.modules[0](idx)
    (got,) = _ort(path, ("idx",), (idx,))
    assert got.shape == tuple(hidden.shape)
    np.testing.assert_allclose(got, hidden.detach().numpy(), atol=1e-5, rtol=0)
    # With the communication nodes the same stage is not runnable: the custom domain has no kernel.
    with_comm = onnx.load(str(export_stage(split, 0, tmp_path / "s0c.onnx", dims=spec.dims)))
    assert [op for op, _, _ in _custom(with_comm)] == ["Send"]


def test_example_inputs_follow_stage_io(two_stages, gpt):
    spec, _ = gpt
    split, _ = two_stages
    args = stage_example_inputs(split, 1, spec.dims)
    assert [tuple(a.shape) for a in args] == [(2, 8, 32), (2, 8)]
    assert [a.dtype for a in args] == [torch.float32, torch.int64]


# ---------------------------------------------------------------------------------- rank programs
TP, PP = 2, 2
TP_OPS = {"CopyToTP", "ReduceFromTP", "AllReduce", "VocabParallelCrossEntropy"}


def _programs(gm, **knobs):
    """The rank programs of dp 0 for every (pipeline index, tp rank), in that order."""
    config = ParallelConfig(**knobs)
    lowering = lower_plan(gm, config, cluster=local_cluster(config.world_size), check=False)
    return [lowering.rank_program(global_rank(p, 0, t, dp=1, tp=config.tp))
            for p in range(config.pp) for t in range(config.tp)]


def _export(programs, out_dir):
    return export_rank_programs(programs, out_dir, tracing=lambda p: trace_groups(p.tp_group, p.tp_index, p.tp))


@pytest.fixture(scope="module")
def rank_export(gpt, tmp_path_factory):
    """(paths, {(stage, tp rank): loaded model}) of export_rank_programs at tp=2, pp=2."""
    _, gm = gpt
    programs = _programs(gm, tp=TP, pp=PP)
    paths = _export(programs, tmp_path_factory.mktemp("ranks"))
    keys = [(s, r) for s in range(PP) for r in range(TP)]
    return paths, {k: onnx.load(str(p)) for k, p in zip(keys, paths)}, programs


@pytest.fixture(scope="module")
def rank_files(rank_export):
    return rank_export[1]


def _props(model):
    return {p.key: p.value for p in model.metadata_props}


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_rank_program_files_are_valid_with_tp_collectives(gpt, rank_export):
    paths, rank_files, programs = rank_export
    assert [p.name for p in paths] == ["stage0_tp0.onnx", "stage0_tp1.onnx",
                                                     "stage1_tp0.onnx", "stage1_tp1.onnx"]
    for (stage, tp_rank), model in rank_files.items():
        onnx.checker.check_model(model)
        rank = global_rank(stage, 0, tp_rank, dp=1, tp=TP)
        props = _props(model)
        assert (props["partitioner.stage"], props["partitioner.tp_rank"]) == (str(stage), str(tp_rank))
        assert (props["partitioner.tp_degree"], props["partitioner.rank"]) == (str(TP), str(rank))
        # Every tp collective of the rank program's fx graph is a partitioner-domain node, in order,
        # under the fx node's name, with the global ranks of its tp group.
        (program,) = [p for p in programs if p.rank == rank]
        comms = program.comms_of("tp")
        nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type in TP_OPS]
        assert comms and [n.name for n in nodes] == [c.node for c in comms]
        assert all(_attrs(n)["ranks"] == list(c.ranks) and _attrs(n)["tp_rank"] == tp_rank
                   for n, c in zip(nodes, comms))
        op_types = {n.op_type for n in nodes}
        assert {"CopyToTP", "ReduceFromTP"} <= op_types
        assert ("VocabParallelCrossEntropy" in op_types) == (stage == PP - 1)  # the loss is on the last stage


def test_rank_program_send_recv_name_peer_ranks(rank_files):
    for tp_rank in range(TP):
        send = next(n for n in rank_files[(0, tp_rank)].graph.node if n.op_type == "Send")
        recv = next(n for n in rank_files[(1, tp_rank)].graph.node if n.op_type == "Recv")
        assert _attrs(send)["peer_ranks"] == [global_rank(1, 0, tp_rank, dp=1, tp=TP)]
        assert _attrs(recv)["peer_rank"] == global_rank(0, 0, tp_rank, dp=1, tp=TP)


def test_tp_rank1_initializers_are_shards_of_the_full_ones(rank_files, two_stages):
    _, full_paths = two_stages  # the unsharded split of the same model, exported by export_split
    for stage in range(PP):
        full = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(full_paths[stage])).graph.initializer}
        model = rank_files[(stage, 1)]
        local = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        params = json.loads(_props(model)["partitioner.tp_params"])
        sharded_dims, compared = set(), 0
        for name, array in local.items():
            if name not in full or name not in params:
                continue  # an exporter-deduplicated copy
            dim = params[name]["dim"]
            assert list(full[name].shape) == params[name]["full_shape"]
            if dim is None:
                assert array.shape == full[name].shape
                continue
            sharded_dims.add(dim)
            expected = list(full[name].shape)
            expected[dim] //= TP
            assert list(array.shape) == expected, name
            if not params[name]["sections"] or len(params[name]["sections"]) == 1:
                # one section: tp rank 1 holds the second half of the full tensor
                np.testing.assert_array_equal(array, np.split(full[name], TP, axis=dim)[1])
                compared += 1
            assert "tp sharded along dim" in next(i for i in model.graph.initializer if i.name == name).doc_string
        assert sharded_dims == {0, 1}  # column-parallel rows and row-parallel columns
        assert compared >= 2  # values checked for at least the MLP's fc and proj weights
    fc = onnx.numpy_helper.to_array(next(i for i in rank_files[(0, 1)].graph.initializer
                                         if i.name == "blocks.0.mlp.fc.weight"))
    assert fc.shape == (64, 32)  # 4*hidden = 128 rows, half of them on each tp rank


def test_vocab_parallel_loss_knows_its_vocab_slice(rank_files):
    for tp_rank in range(TP):
        node = next(n for n in rank_files[(1, tp_rank)].graph.node if n.op_type == "VocabParallelCrossEntropy")
        assert _attrs(node)["vocab_start"] == tp_rank * 64 // TP
        assert len(node.input) == 2 and len(node.output) == 2


def test_text_and_json_dumps_of_a_stage_module_with_int_graph_meta(gpt):
    _, gm = gpt
    (program,) = [p for p in _programs(gm, tp=TP, pp=PP) if p.rank == global_rank(1, 0, 1, dp=1, tp=TP)]
    module = program.modules[1]
    assert module.meta[PIPELINE_STAGE] == 1  # a plain int, not a dataclass
    text = graph_text(module, title="stage1_tp1")
    assert "# pipeline_stage=1\n" in text
    assert "partitioner.vocab_parallel_cross_entropy" in text
    assert graph_json(module, pass_name="stage1_tp1", index=0)["graph"]["pipeline_stage"] == 1


def test_checkpointed_rank_program_names_collectives_inside_regions(gpt, tmp_path):
    _, gm = gpt
    programs = _programs(gm, tp=TP, checkpointing="full")
    paths = _export(programs, tmp_path)
    assert [p.name for p in paths] == ["stage0_tp0.onnx", "stage0_tp1.onnx"]
    model = onnx.load(str(paths[1]))
    onnx.checker.check_model(model)
    program = programs[1]
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type in TP_OPS]
    # the checkpoint is inlined by the trace; its region's collectives keep their fx names
    assert sorted(n.name.rsplit("/", 1)[-1] for n in nodes) == sorted(c.node for c in program.comms_of("tp"))
    assert any(n.name.startswith("checkpoint_") and "/" in n.name for n in nodes)


def test_dropout_on_tp_shards_exports_as_a_custom_node(tmp_path):
    # GPT-2's attention dropout runs on head shards under tp
    spec = build_model("hf-gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=16,resid_pdrop=0.1,"
                       "embd_pdrop=0.1,attn_pdrop=0.1,seq=8")
    paths = _export(_programs(annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec)))), tp=2), tmp_path)
    for rank, path in enumerate(paths):
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
        nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "ShardedDropout"]
        assert len(nodes) == 1, path
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
        assert (attrs["rank"], attrs["degree"], attrs["dim"]) == (rank, 2, 1)
        assert attrs["ratio"] == pytest.approx(0.1)
        assert _props(model)["partitioner.exporter"] == "dynamo"


# ---------------------------------------------------------------------------------- exporters
def test_every_op_of_ours_has_a_dynamo_translation_or_is_dropped():
    from ir_dumps.onnx_translations import DROPPED_OPS, IDENTITY_OPS, NODE_SPECS
    from passes.ir.cp_ops import SCHEMAS as CP_SCHEMAS
    from passes.ir.moe_ops import SCHEMAS as MOE_SCHEMAS
    from passes.ir.ops import SCHEMAS

    # the context- and expert-parallel ops too, but for the backward ops no forward graph holds
    forward_ops = (set(SCHEMAS) | set(CP_SCHEMAS) | set(MOE_SCHEMAS)) - {"ring_attention_backward", "ep_local_backward"}
    assert set(NODE_SPECS) | set(IDENTITY_OPS) == forward_ops and not set(NODE_SPECS) & set(IDENTITY_OPS)
    assert set(DROPPED_OPS) == {"offload_begin", "offload_end"}
    assert {spec.op_type for spec in NODE_SPECS.values()} >= TP_OPS | {"ShardedDropout"}


def test_demo_model_exports_with_dynamo_and_custom_domain_nodes(tmp_path):
    from partitioner.cli.demo import DEMO_MODEL

    spec = build_model(DEMO_MODEL)
    gm = annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec))))
    programs = _programs(gm, tp=2, sequence_parallel=True, offload="activations")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the TorchScript exporter warns
        paths = _export(programs, tmp_path)
    for path, program in zip(paths, programs):
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
        props = _props(model)
        assert props["partitioner.exporter"] == "dynamo" and "partitioner.exporter_fallback" not in props
        ops = [n.op_type for n in model.graph.node if n.domain == DOMAIN]
        assert {"ReduceScatterSeq", "AllGatherSeq", "VocabParallelCrossEntropy"} <= set(ops)
        assert len(ops) == len(program.comms_of("tp"))  # the offload brackets leave no node
        assert "blocks.3.mlp.fc.weight" in {i.name for i in model.graph.initializer}


def test_rank_files_of_the_small_gpt_come_from_the_dynamo_exporter(rank_files, two_stages):
    _, split_paths = two_stages
    for model in [*rank_files.values(), *(onnx.load(str(p)) for p in split_paths)]:
        assert _props(model)["partitioner.exporter"] == "dynamo"


def _custom_nodes(model):
    return [(n.op_type, _attrs(n)) for n in model.graph.node if n.domain == DOMAIN]


def test_both_exporters_write_the_same_custom_nodes(tmp_path):
    spec = build_model("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.1")
    gm = annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec))))
    programs = _programs(gm, tp=2, sequence_parallel=True)[1:]  # tp rank 1: attributes differ from rank 0's
    files = {}
    for exporter in ("dynamo", "torchscript"):
        (path,) = export_rank_programs(programs, tmp_path / exporter, exporter=exporter,
                                       tracing=lambda p: trace_groups(p.tp_group, p.tp_index, p.tp))
        files[exporter] = onnx.load(str(path))
        assert _props(files[exporter])["partitioner.exporter"] == exporter
    dynamo, torchscript = (_custom_nodes(files[e]) for e in ("dynamo", "torchscript"))
    assert {op for op, _ in dynamo} >= {"ShardedDropout", "ScatterToSeq", "AllGatherSeq", "ReduceScatterSeq"}
    assert dynamo == torchscript
    dropout = next(attrs for op, attrs in dynamo if op == "ShardedDropout")
    assert (dropout["rank"], dropout["degree"]) == (1, 2) and dropout["ratio"] == pytest.approx(0.1)


def test_a_failing_dynamo_export_falls_back_to_torchscript_and_says_why(gpt, tmp_path, monkeypatch):
    import ir_dumps.onnx_translations as translations
    from passes.ir.errors import PassError

    _, gm = gpt
    programs = _programs(gm, tp=TP)[:1]
    import ir_dumps.onnx_export as onnx_export

    monkeypatch.setattr(translations, "custom_translation_table", lambda: {})  # our ops: no ONNX function
    monkeypatch.setattr(onnx_export, "_registry", functools.lru_cache(onnx_export._registry.__wrapped__))  # built anew
    with pytest.warns(RuntimeWarning, match=r"stage 0: the dynamo exporter failed \(.*No ONNX function found for "
                                            r".*partitioner\.(copy_to_tp|reduce_from_tp)"):
        (path,) = _export(programs, tmp_path)
    model = onnx.load(str(path))
    props = _props(model)
    assert props["partitioner.exporter"] == "torchscript"
    assert "DispatchError: No ONNX function found" in props["partitioner.exporter_fallback"]
    assert {"CopyToTP", "ReduceFromTP"} <= {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    with pytest.raises(PassError, match="the dynamo exporter failed"):
        export_rank_programs(programs, tmp_path / "strict", exporter="dynamo",
                             tracing=lambda p: trace_groups(p.tp_group, p.tp_index, p.tp))


def test_export_of_checkpointed_offload_leaves_no_offload_region_open(gpt, tmp_path):
    from passes.ir.offload_ops import open_regions

    _, gm = gpt
    # (the dynamo exporter's trace of this combination stops inside an offload region on torch 2.13)
    programs = _programs(gm, tp=TP, sequence_parallel=True, checkpointing="full", offload="activations")[:1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (path,) = _export(programs, tmp_path)
    # a trace that stops between an offload_begin and its offload_end must not leave its
    # saved-tensor hooks on this thread (training in this process would go through them)
    assert open_regions() == []
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    props = _props(model)
    fell_back = [w for w in caught if "the dynamo exporter failed" in str(w.message)]
    assert (props["partitioner.exporter"] == "torchscript") == bool(fell_back)
    assert ("partitioner.exporter_fallback" in props) == bool(fell_back)


def test_a_zero3_program_exports_its_gathers_over_the_shards(gpt, tmp_path):
    """ZeRO-3: the initializers are the flat dp shards under the parameters' names, and each
    block's ``zero3_gather`` is a ``Zero3Gather`` node of our domain over its shards, with the dp
    degree, stage and site; the full parameters come out of it as a sequence."""
    from passes.ir.meta import ZERO3_PLAN

    _, gm = gpt
    config = ParallelConfig.for_global_batch(8, dp=2, zero_stage=3)
    lowering = lower_plan(gm, config, cluster=local_cluster(2), check=False)
    program = lowering.rank_program(0)
    (path,) = _export([program], tmp_path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    zero3 = program.modules[0].meta[ZERO3_PLAN]
    sizes = {i.name: list(i.dims) for i in model.graph.initializer}
    assert all(sizes[r.name] == [r.shard_numel] for r in zero3.params)
    gathers = [n for n in model.graph.node if n.op_type == "Zero3Gather"]
    assert [n.domain for n in gathers] == [DOMAIN] * len(zero3.sites)
    assert [list(n.input) for n in gathers] == [list(s.params) for s in zero3.sites]
    assert [(_attrs(n)["degree"], _attrs(n)["stage"], _attrs(n)["site"]) for n in gathers] == \
           [(2, 0, s.site) for s in zero3.sites]
    takes = [n for n in model.graph.node if n.op_type == "SequenceAt" and n.input[0] in {g.output[0] for g in gathers}]
    assert len(takes) == sum(len(s.params) for s in zero3.sites)  # each gathered parameter taken out once
