"""annotate_blocks: the layer chain (embedding, repeated blocks, head) and every node's index in it,
the one block recognition that the profile, the checkpoint policy and the pipeline split read."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.inputs.models import build_model
from passes.analysis.annotate_blocks import annotate_blocks, find_blocks, layer_of
from passes.capture.capture import capture_model, capture_spec
from passes.ir.meta import BLOCK, LAYER_CHAIN, InputSpec


def _chain(spec: str):
    gm = annotate_blocks(capture_spec(build_model(spec, device="meta")))
    return gm, gm.meta[LAYER_CHAIN]


def test_layer_of_is_the_first_indexed_component():
    assert layer_of("blocks.3.attn.qkv") == "blocks.3"
    assert layer_of("model.layers.11.mlp") == "model.layers.11"
    assert layer_of("transformer.h.0") == "transformer.h.0"
    assert layer_of("lm_head") is None and layer_of("") is None


@pytest.mark.parametrize("spec,container,n", [
    ("gpt:layers=3,hidden=32,heads=2,vocab=64,seq=8", "blocks", 3),
    ("llama:layers=2,hidden=32,heads=2,vocab=64,seq=8", "blocks", 2),
    ("hf-gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,seq=8", "transformer.h", 2),
    ("resnet", "stages", 2),  # a CNN's stages, not the small Sequential stem before them
])
def test_the_repeated_stack_of_zoo_models(spec, container, n):
    gm, chain = _chain(spec)
    assert chain.containers == (container,) and len(chain.blocks) == n
    assert chain.names == ("embedding", *chain.blocks, "head")
    assert all(BLOCK in node.meta for node in gm.graph.nodes)


def test_indexes_never_decrease_along_data_and_params_sit_in_their_block():
    gm, chain = _chain("gpt:layers=3,hidden=32,heads=2,vocab=64,seq=8")
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            for a in node.all_input_nodes:
                if a.op not in ("get_attr", "placeholder"):
                    assert a.meta[BLOCK].index <= node.meta[BLOCK].index, (a.name, node.name)
        if node.op == "get_attr" and str(node.target).startswith("blocks.1."):
            assert node.meta[BLOCK].name == "blocks.1" and node.meta[BLOCK].index == 2
    by_name = {n.name: n.meta[BLOCK] for n in gm.graph.nodes}
    assert by_name["idx"].index == 0 and by_name["embedding"].name == "embedding"
    loss = next(n for n in gm.graph.nodes if "cross_entropy" in n.name)
    assert by_name[loss.name].name == "head" and by_name[loss.name].index == len(chain.blocks) + 1
    assert [m.in_block for m in (by_name["embedding"], by_name[loss.name])] == [False, False]


def test_a_graph_without_repeated_layers_is_one_piece():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).sum()

    gm = annotate_blocks(capture_model(Flat(), inputs=(InputSpec(name="x", shape=("batch", 4)),), dims={"batch": 2}))
    assert gm.meta[LAYER_CHAIN].blocks == () and find_blocks(gm).n_blocks == 0
    assert {n.meta[BLOCK].name for n in gm.graph.nodes} == {"model"}
