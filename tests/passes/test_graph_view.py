"""graph_view: the DiGraph view of an analysed training graph carries the analyses' bytes and FLOPs,
and its dominator cut points (which checkpoint_policy.cut_points takes from the structural view)
agree with the block boundaries annotate_blocks finds, on chain-like models; on a U-Net the long
skips leave no cut point inside the U; split at them, checkpoint_policy's regions are one per block,
Hugging Face models (mask code on the token ids) included. Also: the U-Net of the zoo captures and
trains on CPU."""
from __future__ import annotations

import networkx as nx
import pytest
import torch

from partitioner.errors import ModelSpecError, PassError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_blocks import annotate_blocks
from passes.analysis.annotate_flops import annotate_flops
from passes.analysis.annotate_memory import annotate_memory
from passes.analysis.annotate_shapes import annotate_shapes
from passes.capture.capture import capture_spec
from passes.policies.checkpoint_policy import cut_points
from passes.analysis.graph_view import forward_cut_points, generations, to_networkx, trunk
from passes.ir.meta import BLOCK, FLOP_SUMMARY, LAYER_CHAIN, MEMORY_SUMMARY

MODELS = {
    "gpt": "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.1",
    "llama": "llama:layers=2,hidden=32,heads=2,kv_heads=1,vocab=64,seq=8",
    "bert": "bert:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.1",
    "resnet": "resnet:blocks=2-2,widths=8-16,image=16",
}
UNET = "unet:depth=2,width=4,image=8"


def _analysed(spec: str):
    gm = capture_spec(build_model(spec, device="meta"))
    return annotate_memory(annotate_flops(annotate_blocks(annotate_shapes(gm))))


@pytest.fixture(scope="module", params=sorted(MODELS))
def chain_model(request):
    gm = _analysed(MODELS[request.param])
    return request.param, gm, to_networkx(gm)


@pytest.fixture(scope="module")
def unet():
    gm = _analysed(UNET)
    return gm, to_networkx(gm)


def _index(gm) -> dict[str, int]:
    return {n.name: n.meta[BLOCK].index for n in gm.graph.nodes}


def _crossing(G: nx.DiGraph, index: dict[str, int], k: int) -> set[str]:
    """Trunk storages made before chain index ``k`` and read at index ``k`` or later."""
    T = trunk(G)
    owner = {s.name: n for n in T for s in G.nodes[n]["owns"]}
    return {s for n in T if index[n] >= k for s in G.nodes[n]["reads"] if s in owner and index[owner[s]] < k}


# ---------------------------------------------------------------------------------------------
# The view carries the analyses' facts.

def test_view_totals_are_the_analyses_totals(chain_model):
    _, gm, G = chain_model
    memory, flops = gm.meta[MEMORY_SUMMARY], gm.meta[FLOP_SUMMARY]
    assert set(G) == {n.name for n in gm.graph.nodes}
    assert set(G.edges) == {(a.name, n.name) for n in gm.graph.nodes for a in n.all_input_nodes}
    # Storages counted once: the kept bytes of all nodes are annotate_memory's activation bytes.
    kept = sum(d["kept_bytes"] for _, d in G.nodes(data=True))
    assert kept == int(memory.activation_bytes)  # a concrete capture: integers
    assert G.graph["fixed_bytes"] == int(memory.input_bytes)
    assert G.graph["fwd_flops"] == int(flops.fwd) and G.graph["bwd_flops"] == int(flops.bwd)
    assert G.graph["fwd_flops"] == sum(d["flops"] for _, d in G.nodes(data=True)) > 0


def test_view_node_kinds_and_storages(chain_model):
    _, gm, G = chain_model
    for node in gm.graph.nodes:
        d = G.nodes[node.name]
        assert d["is_input"] == (node.op == "placeholder")
        assert d["is_output"] == (node.op == "output")
        assert d["is_param"] == (node.op == "get_attr")
        if node.op != "call_function":
            assert not d["activation"] and not d["recomputable"] and not d["owns"]
        # What a node owns is what it allocates; a storage it reads is owned by an earlier node.
        assert d["out_bytes"] + d["internal_bytes"] == sum(s.nbytes for s in d["owns"])
        for s in d["reads"]:
            assert nx.has_path(G, s.split(":")[0], node.name)
    assert G.nodes[G.graph["loss"]]["op"] == "aten.cross_entropy_loss.default"
    # In-place updates (BatchNorm's num_batches_tracked) are never recomputed.
    for n, d in G.nodes(data=True):
        if d["op"].endswith("_.Tensor"):
            assert not d["recomputable"]


def test_bare_graph_is_read_through_its_module(chain_model):
    _, gm, G = chain_model
    H = to_networkx(gm.graph)
    assert dict(H.nodes(data="kept_bytes")) == dict(G.nodes(data="kept_bytes"))


def test_view_needs_flops():
    gm = annotate_shapes(capture_spec(build_model(MODELS["gpt"], device="meta")))
    with pytest.raises(PassError, match="annotate_flops"):
        to_networkx(gm)


def test_generations_order_the_data_flow(chain_model):
    _, _, G = chain_model
    level = {n: i for i, gen in enumerate(generations(G)) for n in gen}
    A = G.subgraph(level)
    assert level and all(level[u] < level[v] for u, v in A.edges)


# ---------------------------------------------------------------------------------------------
# Cut points: dominators versus the liveness walk and the block chain.

def test_cut_points_are_dominators_of_the_loss(chain_model):
    _, _, G = chain_model
    cuts = forward_cut_points(G)
    T = trunk(G)
    loss = G.graph["loss"]
    assert cuts
    for c in cuts:  # removing a cut point disconnects the trunk's roots from the loss
        H = T.subgraph(set(T) - {c})
        roots = [n for n in T if T.in_degree(n) == 0 and n != c]
        assert not any(nx.has_path(H, r, loss) for r in roots), c


def test_the_checkpoint_policys_cut_points_are_the_dominators(chain_model):
    """checkpoint_policy.cut_points (on the structural view, no fake run) are the dominators of
    the analysed view, in graph order, from the first block to the loss."""
    name, gm, G = chain_model
    index = _index(gm)
    policy = [n.name for n in cut_points(gm)]
    assert set(policy) == set(forward_cut_points(G)) - {G.graph["loss"]}, name
    assert policy == sorted(policy, key=[n.name for n in gm.graph.nodes].index)
    assert [n for n in policy if index[n] >= 1]


def test_every_block_boundary_is_crossed_by_one_cut_point(chain_model):
    """annotate_blocks's chain (module paths) and the dominators (data flow) agree: one trunk
    storage crosses each boundary between chain indexes, and its owner is a cut point."""
    name, gm, G = chain_model
    index = _index(gm)
    cuts = set(forward_cut_points(G))
    n_blocks = gm.meta[LAYER_CHAIN].n_blocks
    assert n_blocks >= 2
    for k in range(1, n_blocks + 2):
        crossing = _crossing(G, index, k)
        assert len(crossing) == 1, (name, k, crossing)
        assert crossing.pop().split(":")[0] in cuts, (name, k)


def test_unet_long_skips_leave_no_cut_point_inside_the_u(unet):
    gm, G = unet
    index = _index(gm)
    depth = gm.meta[LAYER_CHAIN].n_blocks // 2
    doms = forward_cut_points(G)
    # Between the stem's output and the last up block's input every boundary carries the skips.
    inside = range(1, 2 * depth + 1)
    for k in range(2, 2 * depth + 1):
        assert len(_crossing(G, index, k)) >= 2, k
    assert not [c for c in doms if index[c] in inside and c not in _last_block_nodes(gm, index, 2 * depth)]
    # only stem, the last up block (after it reads its skip) and the head are cut
    assert {n.name for n in cut_points(gm)} == set(doms) - {G.graph["loss"]}
    assert [c for c in doms if index[c] == 0]  # the stem is a chain


def _last_block_nodes(gm, index, k):
    """Nodes of chain index ``k`` after the last skip is read (the concat of the top-level skip)."""
    names = [n.name for n in gm.graph.nodes if index[n.name] == k]
    cat = max(i for i, n in enumerate(names) if n.startswith("cat"))
    return set(names[cat:])


# ---------------------------------------------------------------------------------------------
# The U-Net of the zoo.

def test_unet_captures_and_trains_on_cpu():
    spec = build_model("unet:depth=2,width=4,image=16,classes=3,batch=2")
    gm = capture_spec(spec, symbolic=("batch",))
    inputs = spec.example_inputs({"batch": 3}, seed=1)
    torch.manual_seed(0)
    loss = gm(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in gm.named_parameters()}
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if n.startswith("blocks.0."))  # through the skips
    eager = spec.loss(spec.module, *inputs)
    assert torch.allclose(eager, loss.detach(), rtol=1e-5), (eager.item(), loss.item())
    chain = annotate_blocks(annotate_shapes(gm)).meta[LAYER_CHAIN]
    assert chain.blocks == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")


def test_unet_spec_rejects_an_image_the_down_blocks_cannot_halve():
    with pytest.raises(ModelSpecError, match="divisible by 2\\*\\*depth"):
        build_model("unet:depth=3,image=12")


# ---------------------------------------------------------------------------------------------
# The checkpoint policy's block regions from either cut-point definition.

REGION_MODELS = {
    **MODELS, "unet": UNET,
    "hf-gpt2": "hf-gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,seq=16",
    "hf-bert": "hf-bert:num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
               "vocab_size=64,max_position_embeddings=16,seq=16",
}
# The checkpoint regions the cut points give: one per block, but for the U-Net's long skips.
REGIONS = {
    "bert": ["blocks.0", "blocks.1"], "gpt": ["blocks.0", "blocks.1"], "llama": ["blocks.0", "blocks.1"],
    "resnet": ["stages.0", "stages.1"],
    # HF code makes the attention mask and positions from input_ids (side activations: inputs
    # only), and BERT's first layer makes the mask the second reads: neither joins the trunk
    "hf-gpt2": ["transformer.h.0", "transformer.h.1"],
    "hf-bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "unet": ["blocks.0+blocks.1+blocks.2+blocks.3", "blocks.3"],
}


@pytest.mark.parametrize("name", sorted(REGION_MODELS))
def test_checkpoint_regions_are_one_per_block_between_the_dominators(name):
    from passes.policies.checkpoint_policy import block_regions

    spec = build_model(REGION_MODELS[name], device="cpu" if name.startswith("hf-") else "meta")
    gm = annotate_flops(annotate_blocks(annotate_shapes(capture_spec(spec))))
    regions = block_regions(gm)
    assert [r.name for r in regions] == REGIONS[name]
    for r in regions:  # single entry: one trunk activation in (masks, positions and parameters aside)
        inputs, _ = r.io()
        T = trunk(to_networkx(gm, storages=False))
        assert len([n for n in inputs if n.name in T]) == 1, (r.name, inputs)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_what_draws_random_numbers(dropout_p):
    """The one rule the checkpoint policy, the view's ``random`` attribute and the per-tensor
    remat executor share (a recompute of such a node needs the RNG state it ran with): dropout,
    and fused attention whatever its dropout_p (torch tags it nondeterministic_seeded); not relu."""
    from torch import fx

    from passes.analysis.graph_view import draws_random

    g = fx.Graph()
    q = g.placeholder("q")
    sdpa = g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, q, q, None, dropout_p))
    drop = g.call_function(torch.ops.aten.native_dropout.default, (q, 0.1, True))
    relu = g.call_function(torch.ops.aten.relu.default, (q,))
    assert draws_random(sdpa) and draws_random(drop) and not draws_random(relu)
