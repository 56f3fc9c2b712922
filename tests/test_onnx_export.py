"""ONNX per pipeline stage: valid under onnx.checker, parameters under their original names,
send/recv as custom-domain nodes, annotations in metadata, and onnxruntime matching torch."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ir_dumps.onnx_export import DOMAIN, export_split, export_stage, stage_example_inputs
from partitioner.model_spec import build_model
from passes.annotate_flops import annotate_flops
from passes.annotate_shapes import annotate_shapes
from passes.capture import capture_spec
from passes.checkpoint_policy import checkpoint_policy
from passes.pipeline_split import assign_stages, assign_stages_by_layers, balanced_boundaries, split_pipeline_stages

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"


@pytest.fixture(scope="module")
def gpt():
    spec = build_model(GPT)
    gm = checkpoint_policy(annotate_flops(annotate_shapes(capture_spec(spec))), policy="full")
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
