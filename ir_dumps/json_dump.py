"""JSON dump of a graph after one pass, format ``partitioner-ir/1``.

Schema (keys always present, in this order; fact fields in dataclass order). The file holds one
top-level key per line and one node per line (``grep '"name": "linear_3"'`` finds a node); shown
here spread out::

    {
      "format": "partitioner-ir/1",
      "pass":   "annotate_shapes",        # pass that produced this graph ("input" for the captured graph)
      "index":  1,                        # position in the pipeline (0 = input graph)
      "graph": {                          # project facts of gm.meta, by key (see passes/ir/meta.py)
        "capture": {"model": "gpt:...", "dims": [["batch", 2], ["seq", 16]], ...},
        "flop_summary": {"fwd": "<sympy expr>", "bwd": "<sympy expr>"},
        ...
      },
      "nodes": [                          # in graph order
        {
          "name":   "linear",
          "op":     "call_function",      # placeholder | get_attr | call_function | call_module | call_method | output
          "target": "aten.linear.default",
          "args":   ["%layer_norm", "%blocks_0_attn_qkv_weight", "%blocks_0_attn_qkv_bias"],
          "kwargs": {},
          "users":  ["split"],            # names of nodes reading this one, in graph order
          "module": "blocks.0.attn.qkv",  # user module path ("" for top level)
          "meta":   {                     # project facts of node.meta, by key
            "shape": {"tensors": [{"shape": ["batch", "seq", 192], "dtype": "float32",
                                   "requires_grad": true}], "value": null},
            "flops": {"fwd": "24576*batch*seq", "bwd": "49152*batch*seq", "kind": "matmul"}
          }
        }
      ]
    }

Value encoding: an input node is ``"%name"``; any other argument is its Python literal as a
string (``"2"``, ``"None"``, ``"torch.float32"``), lists stay lists. In ``meta`` and ``graph``,
integers (sympy or not) are JSON numbers, other sympy expressions strings in ``str()`` form
(parse back with ``sympy.sympify``), dtypes ``"float32"``, nested dataclasses objects, tuples lists.
"""
from __future__ import annotations

import json
from typing import Any

from torch import fx

from ir_dumps.encode import arg_json, facts, node_module, target_text, to_json

FORMAT = "partitioner-ir/1"


def graph_json(gm: fx.GraphModule, *, pass_name: str, index: int) -> dict[str, Any]:
    """The dump of ``gm`` as a JSON-ready dict (see the module docstring for the schema)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return {
        "format": FORMAT,
        "pass": pass_name,
        "index": index,
        "graph": {key: to_json(fact) for key, fact in facts(gm.meta)},
        "nodes": [node_json(n, order) for n in gm.graph.nodes],
    }


def node_json(node: fx.Node, order: dict[fx.Node, int]) -> dict[str, Any]:
    """One node's entry; ``order`` gives graph positions so ``users`` come in graph order."""
    return {
        "name": node.name,
        "op": node.op,
        "target": target_text(node),
        "args": [arg_json(a) for a in node.args],
        "kwargs": {k: arg_json(v) for k, v in node.kwargs.items()},
        "users": [u.name for u in sorted(node.users, key=order.__getitem__)],
        "module": node_module(node),
        "meta": {key: to_json(fact) for key, fact in facts(node.meta)},
    }


def dumps(data: dict[str, Any]) -> str:
    """Deterministic JSON text (keys in the order built, newline at the end): one line per
    top-level key and per entry of ``nodes``. Each line is encoded without indentation, which
    keeps to json's C encoder (an indented dump takes its pure-Python one, several times slower)."""
    lines = []
    for key, value in data.items():
        if key == "nodes" and isinstance(value, list):
            body = ",\n  ".join(json.dumps(n) for n in value)
            lines.append(f'"nodes": [\n  {body}\n ]' if value else '"nodes": []')
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"
