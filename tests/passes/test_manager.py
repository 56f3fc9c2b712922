"""PassManager on tiny hand-built graphs: requires/provides checks, lint, error wrapping, dumps."""
import json

import pytest
import sympy
import torch
from torch import fx, nn

from partitioner.errors import PassError
from ir_dumps.writer import DumpWriter
from passes.lowering.manager import Pass, PassContext, PassManager, _adapt
from passes.lowering.pipelines import analysis_passes
from passes.ir.meta import CAPTURE, FLOP_SUMMARY, FLOPS, SHAPE, FlopMeta, FlopSummary, ShapeMeta, TensorMeta, dim_symbol

B = dim_symbol("batch")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum()


def tiny_gm() -> fx.GraphModule:
    return fx.symbolic_trace(Tiny())


def fake_shapes(gm, ctx):
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta[SHAPE] = ShapeMeta(tensors=(TensorMeta(shape=(B, 4), dtype=torch.float32),))
    return gm


def fake_flops(gm, ctx):
    total = sympy.Integer(0)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            node.meta[FLOPS] = FlopMeta(fwd=24 * B, bwd=48 * B, kind="matmul")
            total += 24 * B
        elif node.op in ("call_function", "call_method"):
            node.meta[FLOPS] = FlopMeta(fwd=sympy.Integer(0), bwd=sympy.Integer(0))
    gm.meta[FLOP_SUMMARY] = FlopSummary(fwd=total, bwd=2 * total)
    return gm


SHAPES = Pass(name="fake_shapes", fn=fake_shapes, provides=(SHAPE,))
FLOP = Pass(name="fake_flops", fn=fake_flops, requires=(SHAPE,), provides=(FLOPS, FLOP_SUMMARY))


def test_runs_passes_in_order_and_records_time():
    seen = []

    def record(name):
        def fn(gm, ctx):
            seen.append((name, ctx.optimizer))
            return gm
        return fn

    pm = PassManager([Pass(name="a", fn=record("a")), Pass(name="b", fn=record("b"))])
    gm = tiny_gm()
    assert pm.run(gm, PassContext(optimizer="sgd")) is gm
    assert seen == [("a", "sgd"), ("b", "sgd")]
    assert [r.name for r in pm.records] == ["a", "b"]
    assert all(r.seconds >= 0 and r.nodes == len(gm.graph.nodes) for r in pm.records)


def test_pass_that_forgets_provided_meta_is_named():
    def lazy(gm, ctx):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                node.meta[SHAPE] = ShapeMeta()
        return gm

    pm = PassManager([Pass(name="lazy_shapes", fn=lazy, provides=(SHAPE,))])
    with pytest.raises(PassError, match=r"pass 'lazy_shapes' declares it provides meta 'shape', but node 'lin'"):
        pm.run(tiny_gm())


def test_graph_key_must_land_in_gm_meta():
    def no_summary(gm, ctx):
        return gm

    pm = PassManager([Pass(name="summarize", fn=no_summary, provides=(FLOP_SUMMARY,))])
    with pytest.raises(PassError, match=r"'summarize'.*gm.meta has no 'flop_summary'"):
        pm.run(tiny_gm())


def test_unchecked_manager_skips_provides():
    pm = PassManager([Pass(name="summarize", fn=lambda gm, ctx: gm, provides=(FLOP_SUMMARY,))], check=False)
    pm.run(tiny_gm())


def test_missing_requirement_names_the_provider():
    pm = PassManager([FLOP, SHAPES])
    with pytest.raises(PassError) as info:
        pm.run(tiny_gm())
    msg = str(info.value)
    assert "pass 'fake_flops' requires meta 'shape'" in msg
    assert "Pass 'fake_shapes' provides it but runs later" in msg

    with pytest.raises(PassError, match=r"Run passes.capture.capture.capture_model before 'needs_capture'"):
        PassManager([Pass(name="needs_capture", fn=lambda gm, ctx: gm, requires=(CAPTURE,))]).run(tiny_gm())


def test_exception_in_pass_names_pass_node_and_previous_passes():
    def explode(gm, ctx):
        for node in gm.graph.nodes:
            if node.name == "relu":
                raise ValueError("unsupported op")
        return gm

    pm = PassManager([SHAPES, FLOP, Pass(name="explode", fn=explode)])
    with pytest.raises(PassError) as info:
        pm.run(tiny_gm())
    err = info.value
    msg = str(err)
    assert "pass 'explode' failed at node 'relu'" in msg
    assert "ValueError: unsupported op" in msg
    assert "Passes already run: fake_shapes, fake_flops." in msg
    assert isinstance(err.__cause__, ValueError)
    assert (err.pass_name, err.node, err.previous) == ("explode", "relu", ("fake_shapes", "fake_flops"))


def test_first_pass_failure_says_none_ran():
    def fail(gm, ctx):
        raise RuntimeError("nope")

    with pytest.raises(PassError, match=r"pass 'fail' failed: RuntimeError: nope\. Passes already run: \(none\)"):
        PassManager([Pass(name="fail", fn=fail)]).run(tiny_gm())


def test_lint_failure_is_caught():
    def break_graph(gm, ctx):
        nodes = {n.name: n for n in gm.graph.nodes}
        # Make the first node read one defined after it: a use before definition.
        nodes["x"].append(nodes["relu"])
        return gm

    with pytest.raises(PassError, match=r"pass 'break_graph' left an invalid graph"):
        PassManager([Pass(name="break_graph", fn=break_graph)]).run(tiny_gm())


def test_pass_returning_none_is_reported():
    with pytest.raises(PassError, match=r"pass 'forgetful' returned NoneType, not a GraphModule"):
        PassManager([Pass(name="forgetful", fn=lambda gm, ctx: None)]).run(tiny_gm())


def test_manager_rejects_plain_functions():
    with pytest.raises(TypeError, match="Pass objects"):
        PassManager([fake_shapes])


def test_dumps_written_with_expected_names(tmp_path):
    pm = PassManager([SHAPES, FLOP], instrument=DumpWriter(tmp_path / "dumps"))
    pm.run(tiny_gm())
    names = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    stems = ["00_input", "01_fake_shapes", "02_fake_flops"]
    assert names == sorted([f"{s}.{k}" for s in stems for k in ("txt", "json", "dot")] + ["manifest.json"])
    manifest = json.loads((tmp_path / "dumps" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["input", "fake_shapes", "fake_flops"]
    assert manifest["passes"][2]["files"]["json"] == "02_fake_flops.json"
    assert all(p["nodes"] == 5 for p in manifest["passes"])
    # Timings live only in the manifest.
    assert "seconds" not in (tmp_path / "dumps" / "02_fake_flops.json").read_text()


def test_dump_dir_from_context_and_stale_files_removed(tmp_path):
    (tmp_path / "05_old_pass.txt").write_text("stale")
    (tmp_path / "notes.txt").write_text("mine")
    PassManager([SHAPES], instrument=DumpWriter(tmp_path)).run(tiny_gm())
    assert (tmp_path / "01_fake_shapes.txt").is_file()
    assert not (tmp_path / "05_old_pass.txt").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_failed_run_keeps_dumps_of_earlier_passes(tmp_path):
    def fail(gm, ctx):
        raise RuntimeError("nope")

    with pytest.raises(PassError, match=str(tmp_path)):
        PassManager([SHAPES, Pass(name="fail", fn=fail)], instrument=DumpWriter(tmp_path)).run(tiny_gm())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["input", "fake_shapes"]


def test_dumps_are_deterministic(tmp_path):
    for run in ("a", "b"):
        PassManager([SHAPES, FLOP], instrument=DumpWriter(tmp_path / run)).run(tiny_gm())
    files = sorted(p.name for p in (tmp_path / "a").iterdir() if p.name != "manifest.json")
    assert len(files) == 9
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_adapt_passes_context_options_as_keywords():
    got = {}

    def memory_like(gm, ctx, *, optimizer="adamw", dtype="fp32"):
        got.update(optimizer=optimizer, dtype=dtype)
        return gm

    _adapt(memory_like)(tiny_gm(), PassContext(optimizer="sgd", dtype="bf16"))
    assert got == {"optimizer": "sgd", "dtype": "bf16"}


def test_default_pipeline_is_ordered_and_self_consistent():
    pm = analysis_passes()
    names = [p.name for p in pm]
    assert names[0] == "annotate_shapes"
    order = ["annotate_shapes", "annotate_blocks", "annotate_moe", "annotate_flops", "annotate_memory"]
    assert names == [n for n in order if n in names]
    provided = {CAPTURE}  # written by capture, before any pass
    for p in pm:
        assert set(p.requires) <= provided, (p.name, p.requires, provided)
        provided |= set(p.provides)


def test_every_key_a_registered_pass_reads_or_writes_is_in_the_one_table():
    from passes.ir.meta import KEYS
    from passes.lowering.manager import GRAPH_KEYS, KNOWN_PROVIDERS, NODE_KEY_COVERAGE
    from passes.lowering.pipelines import REGISTRY

    used = {k for d in REGISTRY.values() for k in (*d.requires, *d.provides)}
    assert used <= set(KEYS), sorted(used - set(KEYS))
    # the manager's tables are read off it, not written again
    assert GRAPH_KEYS == {k for k, s in KEYS.items() if s.scope == "graph"}
    assert all(KNOWN_PROVIDERS[k] == s.owner for k, s in KEYS.items())
    assert set(NODE_KEY_COVERAGE) == {k for k, s in KEYS.items() if s.covers is not None}
    # a pass that first writes a key is its owner
    for d in REGISTRY.values():
        for k in d.provides:
            if k not in d.requires:
                assert KEYS[k].owner == d.name, (d.name, k, KEYS[k].owner)
