"""The dumps show context parallelism: the rank programs' text holds the cp ops, their capture
the per-rank sequence length, and the ONNX files (both exporters) hold the ring attention and
Ulysses all-to-all nodes in our custom domain."""
from __future__ import annotations

import contextlib
import functools

import onnx
import pytest

from ir_dumps.onnx_export import export_rank_programs
from ir_dumps.writer import program_text
from partitioner.compile.build import capture_for_pipeline
from partitioner.cost.cost_model import cost_hooks
from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from passes.ir.meta import CAPTURE
from passes.lowering.lower import lower
from runtime.kernels.collectives import trace_groups
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,dropout=0.0"


@functools.cache
def _graph():
    return capture_for_pipeline(build_model(GPT))


def _lowering(mode: str):
    config = ParallelConfig.for_global_batch(4, cp=2, cp_mode=mode, pp=2, num_micro_batches=2)
    return lower(_graph(), config, cost=cost_hooks(local_cluster(config.world_size)))


def test_program_text_shows_the_cp_ops_and_local_sequence():
    lowering = _lowering("ring")
    first, last = (program_text(lowering.programs[(s, 0)], f"stage{s}_tp0") for s in (0, 1))
    assert "partitioner.ring_attention" in first and "partitioner.load_balanced_positions" in first
    assert "scaled_dot_product_attention" not in first + last
    assert "partitioner.reduce_from_cp" in last  # the loss's sum and count over the cp group
    assert dict(lowering.programs[(0, 0)].meta[CAPTURE].dims)["seq"] == 8  # each cp rank's half
    assert [c.op for c in lowering.rank_program(0).comms_of("cp")] == ["ring_attention"]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("mode,op_types", [("ring", {"RingAttention", "LoadBalancedPositions"}),
                                           ("ulysses", {"SeqToHeads", "HeadsToSeq", "LoadBalancedPositions"})])
def test_onnx_has_the_cp_nodes(tmp_path, mode, op_types, exporter):
    lowering = _lowering(mode)
    program = lowering.rank_program(0)

    def tracing(p):
        stack = contextlib.ExitStack()
        stack.enter_context(trace_groups(p.cp_plan.group, 0, 2))
        return stack

    (path,) = export_rank_programs([program], tmp_path, tracing=tracing, exporter=exporter)
    model = onnx.load(str(path))
    found = {n.op_type for n in model.graph.node if n.domain == "partitioner"}
    if exporter == "torchscript":  # its trace keeps the positions as a constant (they depend on no input)
        op_types = op_types - {"LoadBalancedPositions"}
    assert op_types <= found, found
    exporter_used = {p.key: p.value for p in model.metadata_props}["partitioner.exporter"]
    assert exporter_used == exporter
