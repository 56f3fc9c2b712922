"""IR dumps on a tiny hand-annotated graph: text lines, JSON schema and read-back, DOT, and the CLI."""
import json

import pytest
import sympy
import torch
from torch import fx, nn

from ir_dumps.cli import main
from ir_dumps.dot import graph_dot
from ir_dumps.json_dump import FORMAT, graph_json
from ir_dumps.reader import DumpError, load_dump_dir, load_json_dump, sympy_value
from ir_dumps.text import graph_text, node_line
from ir_dumps.writer import DumpWriter
from passes.lowering.manager import Pass, PassManager
from passes.ir.meta import (FLOP_SUMMARY, FLOPS, MEMORY, SHAPE, FlopMeta, FlopSummary, MemoryMeta, SavedTensor,
                            ShapeMeta, TensorMeta, dim_symbol)

B, S = dim_symbol("batch"), dim_symbol("seq")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum()


def shapes(gm, ctx=None):
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta[SHAPE] = ShapeMeta(tensors=(TensorMeta(shape=(B, S, 4), dtype=torch.float32),))
    return gm


def flops(gm, ctx=None):
    for node in gm.graph.nodes:
        if node.op == "call_module":
            node.meta[FLOPS] = FlopMeta(fwd=24 * B * S, bwd=48 * B * S, kind="matmul")
    gm.meta[FLOP_SUMMARY] = FlopSummary(fwd=24 * B * S, bwd=48 * B * S)
    return gm


def memory(gm, ctx=None):
    for node in gm.graph.nodes:
        if node.name == "relu":
            node.meta[MEMORY] = MemoryMeta(output_bytes=12 * B * S, kept_bytes=12 * B * S,
                                           saved=(SavedTensor(owner="relu", nbytes=12 * B * S),))
    return gm


PIPELINE = [Pass(name="shapes", fn=shapes, provides=(SHAPE,)), Pass(name="flops", fn=flops, provides=(FLOP_SUMMARY,)),
            Pass(name="memory", fn=memory)]


def annotated() -> fx.GraphModule:
    gm = fx.symbolic_trace(Tiny())
    for p in PIPELINE:
        p.fn(gm)
    return gm


@pytest.fixture()
def dump_dir(tmp_path):
    PassManager(PIPELINE, instrument=DumpWriter(tmp_path / "d")).run(fx.symbolic_trace(Tiny()))
    return tmp_path / "d"


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


# ----------------------------------------------------------------------------------------- text
def test_text_line_has_code_shape_and_annotations():
    gm = annotated()
    assert node_line(_node(gm, "lin")) == (
        "%lin = call_module[lin](%x) :: float32[batch, seq, 4]  | flops fwd=24*batch*seq bwd=48*batch*seq kind=matmul  | module=lin")
    assert node_line(_node(gm, "relu")) == (
        "%relu = torch.relu(%lin) :: float32[batch, seq, 4]  | mem output=12*batch*seq saved=[relu:12*batch*seq] "
        "kept=12*batch*seq")
    text = graph_text(gm, title="pass 03 memory")
    assert text.startswith("# pass 03 memory\n# flop_summary: fwd=24*batch*seq bwd=48*batch*seq\n# nodes: 5\n")
    assert text.rstrip().endswith("return %sum_1")
    assert "0x" not in text


def test_text_shows_sizes_and_several_outputs():
    gm = annotated()
    x = _node(gm, "x")
    x.meta[SHAPE] = ShapeMeta(value=B * S)
    assert node_line(x) == "%x = placeholder[x] :: = batch*seq"
    x.meta[SHAPE] = ShapeMeta(tensors=(TensorMeta(shape=(B,), dtype=torch.int64),
                                       TensorMeta(shape=(), dtype=torch.bfloat16)))
    assert node_line(x) == "%x = placeholder[x] :: (int64[batch], bfloat16[])"


# ----------------------------------------------------------------------------------------- json
def test_json_schema_and_values():
    data = graph_json(annotated(), pass_name="memory", index=3)
    assert data["format"] == FORMAT and data["pass"] == "memory" and data["index"] == 3
    assert data["graph"] == {"flop_summary": {"fwd": "24*batch*seq", "bwd": "48*batch*seq"}}
    lin = next(n for n in data["nodes"] if n["name"] == "lin")
    assert lin == {
        "name": "lin", "op": "call_module", "target": "lin", "args": ["%x"], "kwargs": {}, "users": ["relu"],
        "module": "lin",
        "meta": {"shape": {"tensors": [{"shape": ["batch", "seq", 4], "dtype": "float32", "requires_grad": False}],
                           "value": None},
                 "flops": {"fwd": "24*batch*seq", "bwd": "48*batch*seq", "kind": "matmul"}},
    }
    summed = next(n for n in data["nodes"] if n["name"] == "sum_1")
    assert summed["target"] == "sum" and summed["args"] == ["%relu"] and summed["op"] == "call_method"


def test_json_dump_reads_back(dump_dir):
    raw = json.loads((dump_dir / "03_memory.json").read_text())
    assert list(raw) == ["format", "pass", "index", "graph", "nodes"]
    graph = load_json_dump(dump_dir / "03_memory.json")
    assert graph.pass_name == "memory" and graph.index == 3
    assert [n.name for n in graph.nodes] == ["x", "lin", "relu", "sum_1", "output"]
    relu = graph.node("relu")
    assert relu.meta[MEMORY]["saved"] == [{"owner": "relu", "nbytes": "12*batch*seq"}]
    assert sympy.simplify(sympy_value(relu.meta[MEMORY]["kept_bytes"]) - 12 * B * S) == 0
    assert sympy_value(relu.meta[MEMORY]["param_bytes"]) == 0
    assert graph.graph[FLOP_SUMMARY]["bwd"] == "48*batch*seq"

    d = load_dump_dir(dump_dir)
    assert [e.name for e in d.entries] == ["input", "shapes", "flops", "memory"]
    assert d.entry("2").name == "flops" and d.entry("03_memory").name == "memory"


def test_reader_errors_are_friendly(tmp_path, dump_dir):
    with pytest.raises(DumpError, match="does not exist"):
        load_dump_dir(tmp_path / "missing")
    with pytest.raises(DumpError, match="has no manifest.json"):
        load_dump_dir(tmp_path)
    with pytest.raises(DumpError, match="is it a graph dump"):
        load_json_dump(dump_dir / "manifest.json")


# ----------------------------------------------------------------------------------------- dot
def test_dot_has_nodes_edges_and_module_clusters():
    text = graph_dot(annotated(), title='pass "1"')
    assert text.startswith('digraph G {\n  label="pass \\"1\\"";')
    assert '"x" -> "lin";' in text and '"relu" -> "sum_1";' in text
    assert '"lin" [label="lin\\ncall_module[lin]' not in text  # call_module shows its target, not op[..]
    assert 'label="lin\\nlin\\nfloat32[batch, seq, 4]"' in text
    assert text.count("subgraph cluster_") == 1  # only %lin ran inside a submodule
    assert 'subgraph cluster_0 {\n    label="lin";\n    "lin" [' in text
    assert text.endswith("}\n")


# ----------------------------------------------------------------------------------------- cli
def test_cli_show_table(dump_dir, capsys):
    assert main(["show", str(dump_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split() == ["#", "pass", "nodes", "time", "(ms)", "dump"]
    assert [line.split()[1] for line in lines[2:6]] == ["input", "shapes", "flops", "memory"]
    assert all(line.split()[2] == "5" for line in lines[2:6])


def test_cli_show_pass_prints_text_dump(dump_dir, capsys):
    assert main(["show", str(dump_dir), "--pass", "flops"]) == 0
    assert capsys.readouterr().out == (dump_dir / "02_flops.txt").read_text()


def test_cli_show_node_across_passes(dump_dir, capsys):
    assert main(["show", str(dump_dir), "--node", "%relu"]) == 0
    out = capsys.readouterr().out
    assert "== 00 input\n   %relu = torch.relu(%lin)\n" in out
    assert "== 02 flops\n   %relu = torch.relu(%lin) :: float32[batch, seq, 4]\n   meta unchanged\n" in out
    assert "     kept_bytes = 12*batch*seq" in out


def test_cli_friendly_errors(dump_dir, tmp_path, capsys):
    assert main(["show", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["show", str(dump_dir), "--pass", "fusion"]) == 2
    assert "no pass 'fusion'" in capsys.readouterr().err
    assert main(["show", str(dump_dir), "--node", "rel"]) == 2
    assert "did you mean relu" in capsys.readouterr().err
    assert main(["diff", str(dump_dir), str(dump_dir / "01_shapes.json")]) == 2
    assert "cannot compare directory" in capsys.readouterr().err


def test_cli_diff_two_json_dumps(dump_dir, capsys):
    assert main(["diff", str(dump_dir / "01_shapes.json"), str(dump_dir / "03_memory.json")]) == 0
    out = capsys.readouterr().out
    assert "nodes: 5 -> 5 (0 added, 0 removed, 2 changed)" in out
    assert "  + flop_summary: fwd=24*batch*seq bwd=48*batch*seq" in out
    assert "  %lin:\n    + flops: fwd=24*batch*seq bwd=48*batch*seq kind=matmul" in out
    assert "  %relu:\n    + memory:" in out


def test_cli_diff_directories_reports_added_removed_and_changed(dump_dir, tmp_path, capsys):
    def rewrite(gm, ctx=None):
        relu = _node(gm, "relu")
        with gm.graph.inserting_after(relu):
            neg = gm.graph.call_function(torch.neg, (relu,))
        relu.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
        neg.meta[SHAPE] = ShapeMeta(tensors=(TensorMeta(shape=(B, 4), dtype=torch.float32),))
        _node(gm, "lin").meta[FLOPS] = FlopMeta(fwd=sympy.Integer(7), bwd=sympy.Integer(14), kind="matmul")
        gm.recompile()
        return gm

    other = tmp_path / "other"
    PassManager([*PIPELINE, Pass(name="rewrite", fn=rewrite)], instrument=DumpWriter(other)).run(fx.symbolic_trace(Tiny()))
    assert main(["diff", str(dump_dir), str(other)]) == 0
    out = capsys.readouterr().out
    assert out.count("no differences") == 4  # input, shapes, flops, memory are the same
    assert f"pass 'rewrite' only in {other}" in out

    assert main(["diff", str(dump_dir / "03_memory.json"), str(other / "04_rewrite.json")]) == 0
    out = capsys.readouterr().out
    assert "nodes: 5 -> 6 (1 added, 0 removed" in out
    assert "added nodes:\n  + %neg = call_function torch.neg(%relu)" in out
    assert "    ~ flops.fwd: 24*batch*seq -> 7" in out
    assert "    ~ users: [\"sum_1\"] -> [\"neg\"]" in out

    assert main(["diff", str(other / "04_rewrite.json"), str(dump_dir / "03_memory.json")]) == 0
    assert "removed nodes:\n  - %neg = call_function torch.neg(%relu)" in capsys.readouterr().out
