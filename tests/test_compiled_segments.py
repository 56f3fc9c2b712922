"""The weight-free segments a split-backward schedule compiles (:mod:`runtime.exec.compiled`): which
ops of a zero-bubble stage program go into a segment, and that a segmented program's split
backward (input half, then weight half) gives the gradients of the whole program's backward.
The segments run uncompiled here (the parity of compiled ones is tests/test_compiled_parity.py)."""
from __future__ import annotations

import pytest
import torch

from partitioner.calibration.job_cluster import local_cluster
from partitioner.compile.build import capture_for_pipeline, lower_plan
from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from runtime.exec.compiled import SEGMENT_PREFIX, segmented, weight_free_segments
from runtime.exec.split_backward import backward_input, backward_weight

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"


@pytest.fixture(scope="module")
def programs():
    spec = build_model(SPEC)
    config = ParallelConfig.for_global_batch(4, pp=2, schedule="zb1p", num_micro_batches=2)
    lowering = lower_plan(capture_for_pipeline(spec), config, cluster=local_cluster(2), check=False)
    return spec, [lowering.rank_program(s).modules[s] for s in (0, 1)]


def _is_a_parameter(module, node) -> bool:
    """A ``get_attr`` of a parameter, or an op on parameters alone (a view, an alias)."""
    if node.op == "get_attr":
        return str(node.target) in dict(module.named_parameters())
    return node.op == "call_function" and bool(node.all_input_nodes) and all(
        _is_a_parameter(module, i) for i in node.all_input_nodes)


def _reads_a_parameter(module, node) -> bool:
    return any(_is_a_parameter(module, i) for i in node.all_input_nodes)


def test_segments_hold_the_ops_between_the_weight_reading_ones(programs):
    _, (first, last) = programs
    for module in (first, last):
        runs = weight_free_segments(module)
        inside = {n for run in runs for n in run}
        # no op that reads a parameter (or a view of one), no split point, no size read
        assert not any(_reads_a_parameter(module, n) or _is_a_parameter(module, n) for n in inside)
        assert not any("split_point" in str(n.target) or n.target is torch.ops.aten.sym_size.int for n in inside)
        # every op that reads a parameter is outside, where the split backward finds it
        readers = [n for n in module.graph.nodes if n.op == "call_function" and _reads_a_parameter(module, n)]
        assert readers and not set(readers) & inside
        # each run is consecutive in the program (get_attr nodes aside)
        order = [n for n in module.graph.nodes if n.op != "get_attr"]
        for run in runs:
            at = order.index(run[0])
            assert order[at:at + len(run)] == run
    targets = [{str(n.target) for n in run} for run in weight_free_segments(last)]
    assert any("aten.scaled_dot_product_attention.default" in t for t in targets)
    assert any(t == {"aten.gelu.default"} for t in targets)
    assert any("aten.cross_entropy_loss.default" in t for t in targets)


def test_a_segmented_program_splits_its_backward_into_the_same_gradients(programs):
    spec, (first, last) = programs
    idx, targets = spec.example_inputs({"batch": 2}, seed=3)
    x = first(idx, targets)[0].detach()
    for module, args in ((first, (idx, targets)), (last, (x, targets))):
        seg = segmented(module, compile_segment=lambda gm: gm)
        names = [name for name, _ in seg.named_children() if name.startswith(SEGMENT_PREFIX)]
        assert names == [f"{SEGMENT_PREFIX}{k}" for k in range(len(weight_free_segments(module)))]
        assert list(seg.parameters()) == list(module.parameters())  # the same tensors, not copies

        module.zero_grad(set_to_none=True)
        inputs = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        (out,) = module(*inputs)
        grad = torch.ones_like(out)
        torch.autograd.backward([out], [grad])
        whole = {n: p.grad.clone() for n, p in module.named_parameters()}
        input_grads = [a.grad for a in inputs if a.is_floating_point()]

        module.zero_grad(set_to_none=True)
        inputs = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        (out,) = seg(*inputs)
        pending = backward_input([out], [grad], [a for a in inputs if a.is_floating_point()])
        assert pending.mixing and not pending.outputs  # the split found the weight-reading ops
        assert all(p.grad is None for p in module.parameters())  # the input half leaves the weights alone
        for a, g in zip([a for a in inputs if a.is_floating_point()], input_grads):
            torch.testing.assert_close(a.grad, g, rtol=1e-6, atol=1e-7)
        backward_weight(pending)
        for n, p in module.named_parameters():
            torch.testing.assert_close(p.grad, whole[n], rtol=1e-6, atol=1e-7, msg=n)
