"""Runtime parity with tensor parallelism, activation checkpointing and offload: dp x tp x pp
training on gloo (8 CPU processes) gives the per-step losses and final parameters of
single-process training of the same model; plus single-process checks of the rank programs
(``build_rank_program``): stages, shard shapes and communication lists, without any process group.

One spawn of 8 ranks runs every plan case (each case builds its own mesh on the first
dp*tp*pp ranks), because starting gloo processes is the slow part.
"""
from __future__ import annotations

import time

import pytest
import torch

from partitioner.inputs.models import build_model
from passes.ir.config import ParallelConfig
from runtime.dist.launch import spawn
from tests.one_device import train_one_device
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

MODELS = {
    "gpt": "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    "hf-gpt2": ("hf-gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,resid_pdrop=0.0,"
                "embd_pdrop=0.0,attn_pdrop=0.0,seq=8"),
}
GLOBAL_BATCH, STEPS, WORLD = 8, 3, 8
# eps=1e-6 as in test_runtime_parity.py: the attention key bias has a zero gradient in exact
# arithmetic and rounding noise in practice, which AdamW with eps=1e-8 would amplify.
ADAMW = {"lr": 1e-3, "eps": 1e-6}
TIMEOUT_S = 60.0
# A sharded matmul sums in another order than the full one (the order depends on the CPU's
# kernels: AVX-512 and AVX2 machines differ), so gradients agree to rounding, checked below
# relative to their largest element. AdamW then moves an element by up to lr per step whatever
# its gradient's size, so where that gradient is itself rounding noise the element's path is
# too: allow a thousandth of the steps' largest move (a 4-layer GPT's mlp.fc element was off by
# 1.4e-6 on an AVX2 machine, with every gradient within tolerance).
PARAM_ATOL = 1e-3 * ADAMW["lr"] * STEPS

# (model, dp, tp, pp, micro-batches, zero, checkpointing, offload); schedule 1F1B throughout
CASES = [
    ("gpt", 1, 2, 1, 1, False, "none", "none"),
    ("gpt", 2, 2, 1, 2, False, "none", "none"),
    ("gpt", 1, 2, 2, 2, False, "none", "none"),
    ("gpt", 2, 2, 2, 2, False, "none", "none"),
    ("gpt", 2, 2, 1, 1, True, "none", "none"),
    ("gpt", 1, 1, 2, 2, False, "full", "none"),
    ("gpt", 2, 1, 2, 2, False, "full", "none"),
    ("gpt", 1, 2, 2, 2, False, "full", "none"),
    ("gpt", 1, 1, 2, 2, False, "none", "activations"),
    ("gpt", 1, 2, 2, 2, False, "full", "activations"),  # recompute, and the regions' inputs on host
    ("hf-gpt2", 1, 2, 1, 1, False, "none", "none"),
    ("hf-gpt2", 2, 2, 1, 2, False, "none", "none"),
    ("hf-gpt2", 1, 2, 2, 2, False, "none", "none"),
]
# hf-gpt2 at (2, 2, 2) is left out: gpt covers (2, 2, 2) here, and tests/test_runtime_property.py
# trains hf-gpt2 at dp2 tp2 pp2 (its HF_PIPELINE plans).


def _case_id(case) -> str:
    model, dp, tp, pp, m, zero, ckpt, offload = case
    return (f"{model}-dp{dp}-tp{tp}-pp{pp}-m{m}" + ("-zero1" if zero else "")
            + (f"-ckpt_{ckpt}" if ckpt != "none" else "") + (f"-offload_{offload}" if offload != "none" else ""))


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _train_cases(cases, payloads):
    """On each rank: every case's per-step losses and the full (tp-gathered) parameters/grads.
    ``payloads``: each model's graph, captured once by the test process (``packed_graph``)."""
    from partitioner.compile.build import build_parallel_model
    from runtime.dist.mesh import Mesh, init_distributed

    start = time.perf_counter()
    init_distributed(timeout_s=300)  # the world group only paces the cases
    rank = torch.distributed.get_rank()
    # Unpack only the models this rank trains.
    used = sorted({c[0] for c in cases if rank < c[1] * c[2] * c[3]})
    specs, graphs = {}, {}
    for k in used:
        specs[k], graphs[k] = unpacked_graph(MODELS[k], payloads[k])
    captured = time.perf_counter()
    # One mesh per (dp, tp, pp) shape, shared by the cases of that shape (creating gloo groups
    # on 8 processes is slow); every rank creates them all, in the same order.
    shapes = sorted({(c[1], c[2], c[3]) for c in cases})
    meshes = {sh: Mesh(sh[0], sh[2], sh[1], timeout_s=TIMEOUT_S) for sh in shapes}
    out = {"setup": {"capture_s": captured - start, "meshes_s": time.perf_counter() - captured}}
    for case in cases:
        model, dp, tp, pp, m, zero, ckpt, offload = case
        mesh = meshes[(dp, tp, pp)]
        torch.distributed.barrier()
        if not mesh.active:
            continue
        start = time.perf_counter()
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=dp, tp=tp, pp=pp, schedule="1f1b",
                                                 num_micro_batches=m, zero_stage=int(zero), checkpointing=ckpt,
                                                 offload=offload)
        pm = build_parallel_model(graphs[model], config, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
        built = time.perf_counter()
        losses = [pm.train_step(b) for b in _batches(specs[model])]
        trained = time.perf_counter()
        local = {n: tuple(p.shape) for n, p in pm.named_parameters().items()}
        out[_case_id(case)] = {"losses": losses, "params": pm.full_parameters(), "grads": pm.full_gradients(),
                               "local_shapes": local, "build_s": built - start, "train_s": trained - start,
                               "seed": torch.initial_seed(),
                               "submodules": sorted(n for st in pm.stages.values()
                                                    for n, _ in st.module.named_children())}
    return out


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    payloads = {k: packed_graph(MODELS[k]) for k in sorted({c[0] for c in CASES})}
    results = spawn(_train_cases, WORLD, CASES, payloads, timeout_s=600)
    setup = results[0]["setup"]
    print(f"\nspawn of {WORLD} ranks, {len(CASES)} cases: {time.perf_counter() - start:.1f} s (rank 0: capture "
          f"{setup['capture_s']:.1f} s, meshes {setup['meshes_s']:.1f} s)")
    return results


@pytest.fixture(scope="module")
def reference():
    """Single-process AdamW training per model: per-step losses and the final module."""
    out = {}
    for key in {c[0] for c in CASES}:
        spec = build_model(MODELS[key])
        out[key] = train_one_device(spec, _batches(spec), adamw=ADAMW)
    return out


def test_pipeline_stages_draw_different_random_streams_and_tp_peers_the_same(distributed):
    # dropout: tp peers hold one replicated tensor (same masks), stages hold different layers
    key = _case_id(("gpt", 1, 2, 2, 2, False, "none", "none"))
    seeds = [distributed[r][key]["seed"] for r in range(4)]  # rank = stage * tp + tp_rank
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_same_losses_and_parameters_as_one_device(distributed, reference, case):
    model, dp, tp, pp = case[:4]
    ref_losses, ref_model = reference[model]
    key = _case_id(case)
    ranks = [r[key] for r in distributed[:dp * tp * pp]]
    for rank, result in enumerate(ranks):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert result["losses"] == ranks[0]["losses"], "every rank must return the same loss"
    initial = build_model(MODELS[model]).module
    moved = max((p - initial.get_parameter(n)).abs().max().item() for n, p in ref_model.named_parameters())
    assert moved > 1e-3  # training moved the weights: parity of untouched weights proves nothing

    covered = set()
    for rank, result in enumerate(ranks):
        for name, value in result["params"].items():
            expected = ref_model.get_parameter(name)
            torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=PARAM_ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
            covered.add(id(expected))
            g = expected.grad
            # AdamW is scale invariant: the gradients check loss scaling and the dp/tied sums.
            torch.testing.assert_close(result["grads"][name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item() + 1e-8,
                                       msg=lambda m: f"rank {rank} grad of {name}: {m}")
    missing = [n for n, p in ref_model.named_parameters() if id(p) not in covered]
    assert not missing, f"no rank holds {missing}"
    if tp > 1:  # the ranks really hold shards: some parameter is 1/tp of its full size locally
        full = dict(ref_model.named_parameters(remove_duplicate=False))
        halves = [n for n, s in ranks[0]["local_shapes"].items() if torch.Size(s).numel() * tp == full[n].numel()]
        assert len(halves) >= len(ranks[0]["local_shapes"]) // 3, halves
    print(f"{key}: build {max(r['build_s'] for r in ranks):.2f} s, 3 steps {max(r['train_s'] for r in ranks):.2f} s")


def test_checkpointed_stages_call_recompute_regions(distributed):
    subs = distributed[0]["gpt-dp1-tp1-pp2-m2-ckpt_full"]["submodules"]
    assert [s for s in subs if s.startswith("checkpoint_")] == ["checkpoint_blocks_0", "checkpoint_blocks_1"]
    plain = distributed[0]["gpt-dp1-tp2-pp2-m2"]["submodules"]
    assert not [s for s in plain if s.startswith("checkpoint_")]


# --- rank programs, single process ------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_graph():
    # the graph the ranks train, rebuilt around a fresh module (the lowering copies what it changes)
    return unpacked_graph(MODELS["gpt"], packed_graph(MODELS["gpt"]))[1]


@pytest.fixture(scope="module")
def programs_222(gpt_graph):
    from partitioner.compile.build import lower_plan
    lowering = lower_plan(gpt_graph, ParallelConfig(dp=2, tp=2, pp=2), cluster=local_cluster(8), check=False)
    return [lowering.rank_program(r) for r in range(8)]


def test_rank_coordinates_and_stages_follow_the_mesh_layout(programs_222):
    # rank = pp*(dp*tp) + dp*tp + tp, tp fastest
    coords = [(p.pp_index, p.dp_index, p.tp_index, p.stages) for p in programs_222]
    assert coords == [(0, 0, 0, (0,)), (0, 0, 1, (0,)), (0, 1, 0, (0,)), (0, 1, 1, (0,)),
                      (1, 0, 0, (1,)), (1, 0, 1, (1,)), (1, 1, 0, (1,)), (1, 1, 1, (1,))]


def test_sharded_parameters_are_one_tp_th_of_the_originals(gpt_graph, programs_222):
    full = dict(gpt_graph.named_parameters(remove_duplicate=False))
    for prog in programs_222:
        (stage,) = prog.modules.values()
        sharded = 0
        for name, p in stage.named_parameters(remove_duplicate=False):
            sharding = prog.tp_plan.params[name]
            if sharding.dim is None:
                assert p.shape == full[name].shape, name
            else:
                expect = list(full[name].shape)
                expect[sharding.dim] //= 2
                assert list(p.shape) == expect, name
                sharded += 1
        assert sharded >= 10, prog.rank  # qkv, proj, fc, proj (+ biases) of 2 blocks, wte / lm_head
    # tp peers hold different halves of the same weight
    a = programs_222[0].modules[0].get_parameter("blocks.0.mlp.fc.weight")
    b = programs_222[1].modules[0].get_parameter("blocks.0.mlp.fc.weight")
    assert torch.equal(torch.cat([a, b]), full["blocks.0.mlp.fc.weight"])


def test_communication_lists(programs_222):
    r0, r5 = programs_222[0], programs_222[5]  # (pp 0, dp 0, tp 0) and (pp 1, dp 0, tp 1)
    (send,) = r0.comms_of("send")
    assert (send.stage, send.peer_stage, send.ranks) == (0, 1, (4,))
    assert not r0.comms_of("recv")
    (recv,) = r5.comms_of("recv")
    assert (recv.stage, recv.peer_stage, recv.ranks) == (1, 0, (1,)) and recv.tensors == send.tensors
    assert not r5.comms_of("send")
    # tp collectives of the graph, on the tp group (same pp and dp index)
    ops0 = [c.op for c in r0.comms_of("tp")]
    ops5 = [c.op for c in r5.comms_of("tp")]
    assert ops0.count("reduce_from_tp") == 1 + 2 * 2  # vocab-parallel embedding + attn/mlp of 2 blocks
    assert ops0.count("copy_to_tp") == 2 * 2 and "vocab_parallel_cross_entropy" not in ops0
    assert ops5.count("vocab_parallel_cross_entropy") == 1 and ops5.count("copy_to_tp") == 2 * 2 + 1
    assert {c.ranks for c in r0.comms_of("tp")} == {(0, 1)} and {c.ranks for c in r5.comms_of("tp")} == {(4, 5)}
    assert {c.group for c in r0.comms_of("tp")} == {"tp"}
    # dp gradient average over the same (pp, tp) index; tied wte/lm_head over the pipeline's ends
    assert [c.ranks for c in r0.comms_of("dp_all_reduce")] == [(0, 2)]
    assert [c.ranks for c in r5.comms_of("dp_all_reduce")] == [(5, 7)]
    assert [(c.ranks, set(c.tensors)) for c in r5.comms_of("tied_all_reduce")] == [((1, 5), {"lm_head.weight",
                                                                                                "wte.weight"})]


def test_checkpointing_wraps_tp_collectives_into_the_regions(gpt_graph):
    from partitioner.compile.build import rank_program
    prog = rank_program(gpt_graph, ParallelConfig(tp=2, pp=2, checkpointing="full"), 0, cluster=local_cluster(4))
    stage = prog.modules[0]
    regions = {n: m for n, m in stage.named_children() if n.startswith("checkpoint_")}
    assert sorted(regions) == ["checkpoint_blocks_0", "checkpoint_blocks_1"]
    for region in regions.values():
        code = region.code
        assert code.count("partitioner.copy_to_tp") == 2 and code.count("partitioner.reduce_from_tp") == 2
    # the comm list still names them (recomputed in backward on every tp rank alike)
    assert len(prog.comms_of("tp")) == 1 + 4 * 2


def test_bad_arguments_name_the_fix(gpt_graph):
    from partitioner.compile.build import rank_program
    from partitioner.errors import ConfigError
    with pytest.raises(ConfigError, match="outside the mesh"):
        rank_program(gpt_graph, ParallelConfig(tp=2), 2, cluster=local_cluster(2))
    with pytest.raises(ConfigError, match="checkpointing"):
        rank_program(gpt_graph, ParallelConfig(checkpointing="some"), 0, cluster=local_cluster(1))
    with pytest.raises(ConfigError, match="at most 4 stages"):
        rank_program(gpt_graph, ParallelConfig(pp=8), 0, cluster=local_cluster(8))
