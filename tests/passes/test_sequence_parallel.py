"""sequence_parallel: Megatron sequence parallelism on top of the tp rewrite. Exactness of the
rewritten rank programs (simulated tp=2 in threads: gpt with LayerNorm, llama with RMSNorm),
sequence-sharded shapes on fake tensors, the divisibility check, the rank programs of a pipeline
split, and one spawn of 4 gloo ranks training ParallelModel at (dp, tp, pp) = (1, 2, 1), (1, 2, 2)."""
from __future__ import annotations

import pytest
import sympy
import torch
from torch import fx

import runtime.kernels.collectives as tpc
from partitioner.errors import ConfigError
from partitioner.inputs.models import build_model
from passes.analysis.annotate_shapes import annotate_shapes
from passes.rewrites.apply_tensor_parallel import apply_tensor_parallel
from passes.ir.program import unshard_tensor
from passes.capture.capture import capture_spec
from passes.ir.meta import SHAPE, TENSOR_PARALLEL, TENSOR_PARALLEL_PLAN, dim_symbol
from passes.policies.tensor_parallel_patterns import tag_tensor_parallel
from tests.passes.tp_graphs import run_simulated_step, tagged_tp2
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

RTOL = 1e-5
SPECS = {
    "gpt": "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    "llama": "llama:layers=2,hidden=32,heads=2,kv_heads=2,vocab=64,seq=8",
}


@pytest.fixture(scope="module")
def captured():
    return tagged_tp2(SPECS)


def _run_ranks(gm, inputs, prefix):
    names = tpc.simulated_groups(prefix, 2, timeout_s=30)
    ranks = [apply_tensor_parallel(gm, rank=r, group=names[r], sequence_parallel=True) for r in range(2)]
    return ranks, run_simulated_step(ranks, inputs)


@pytest.mark.parametrize("key", list(SPECS))
def test_sp_tp2_simulated_matches_single_device(captured, key):
    gm, inputs = captured[key]
    for p in gm.parameters():
        p.grad = None
    ref_loss = gm(*inputs)
    ref_loss.backward()
    ranks, results = _run_ranks(gm, inputs, f"sp-{key}")
    code = ranks[0].code
    # every tp boundary became a sequence-parallel one: no all-reduce left in forward
    assert "partitioner.reduce_scatter_seq" in code and "partitioner.all_gather_seq" in code
    assert "reduce_from_tp" not in code and "copy_to_tp" not in code
    plan = ranks[0].meta[TENSOR_PARALLEL_PLAN]
    norms = {n for n, p in gm.named_parameters() if "ln" in n or "norm" in n}
    assert plan.sequence_parallel and norms <= set(plan.sequence_parallel_grads)
    for loss in (r[0] for r in results):
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=0)
    worst = 0.0
    for name, ref in dict(gm.named_parameters(remove_duplicate=False)).items():
        if name not in results[0][1]:
            continue  # the tied alias not read by the graph
        grads = [r[1][name] for r in results]
        if name in plan.sequence_parallel_grads:  # partial per sequence chunk: the runtime sums them
            assert not torch.allclose(grads[0], grads[1])
            grads = [sum(grads)] * 2
        full = unshard_tensor(grads, plan.params[name])
        g = ref.grad
        torch.testing.assert_close(full, g, rtol=RTOL, atol=RTOL * g.abs().max().item(), msg=name)
        worst = max(worst, ((full - g).abs().max() / g.abs().max()).item())
    print(f"{key}: loss {ref_loss.item():.6f}, worst grad error {worst:.2e} of each tensor's max")


@pytest.mark.parametrize("symbolic", [("batch", "seq"), ("batch",)])
def test_norm_regions_have_half_the_sequence(captured, symbolic):
    spec = build_model(SPECS["gpt"], device="meta")
    gm = tag_tensor_parallel(capture_spec(spec, symbolic=symbolic), degree=2)
    rank = annotate_shapes(apply_tensor_parallel(gm, rank=1, group="unused", sequence_parallel=True))
    norms = [n for n in rank.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    assert len(norms) == 5  # 2 per block and the final one
    seq = dim_symbol("seq")
    for n in norms:
        assert n.meta[TENSOR_PARALLEL].role == "sequence" and n.meta[TENSOR_PARALLEL].shard_dim == 1
        b, s, h = n.meta[SHAPE].tensor.shape
        s = sympy.sympify(s)
        assert h == 32 and s.subs(seq, 8) == 4  # seq//2 when symbolic, 4 when captured at seq=8
        if "seq" in symbolic:
            assert s.free_symbols == {seq} and s.subs(seq, 12) == 6
        else:
            assert s == 4
    # outside the regions: whole sequence (attention's heads halved by tp instead)
    sdpa = next(n for n in rank.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert sympy.sympify(sdpa.meta[SHAPE].tensor.shape[2]).subs(seq, 8) == 8


def test_sequence_not_divisible_by_tp_is_a_config_error():
    spec = build_model(SPECS["gpt"], device="meta")
    gm = tag_tensor_parallel(capture_spec(spec, dims={"seq": 6}, symbolic=("batch", "seq")), degree=4)
    with pytest.raises(ConfigError, match=r"seq=6 is not divisible by tp=4"):
        apply_tensor_parallel(gm, rank=0, group="unused", sequence_parallel=True)
    # at run time (a symbolic graph fed another length): the op names the numbers
    names = tpc.simulated_groups("sp-odd", 2, timeout_s=10)
    with pytest.raises(ConfigError, match=r"sequence length 7 .* not divisible by tp=2"):
        tpc.run_simulated([lambda r=r: torch.ops.partitioner.scatter_to_seq(torch.ones(1, 7, 4), 1, 2, names[r])
                           for r in range(2)], timeout_s=20)


def test_rank_programs_of_a_pipeline_split():
    from partitioner.compile.build import capture_for_pipeline, lower_plan
    from passes.ir.config import ParallelConfig

    graph = capture_for_pipeline(build_model(SPECS["gpt"], device="meta"))
    lowering = lower_plan(graph, ParallelConfig(tp=2, pp=2, sequence_parallel=True), cluster=local_cluster(4), check=False)
    progs = [lowering.rank_program(r) for r in range(4)]
    ops = {r: sorted({c.op for c in p.comms_of("tp")}) for r, p in enumerate(progs)}
    # the residual stream crosses the stage boundary as each tp rank's sequence chunk: stage 0
    # sends its chunk without gathering it, stage 1 runs on it without cutting it
    assert "gather_from_seq" not in ops[0] and "scatter_to_seq" not in ops[2]
    assert "reduce_scatter_seq" in ops[0] and "all_gather_seq" in ops[2]
    (out,) = [o for o in progs[0].io[0].outputs if o.dests]
    (recv,) = [i for i in progs[2].io[1].inputs if i.kind == "recv"]
    whole = [o for o in lowering.split.io[0].outputs if o.dests][0]
    assert out.meta.shape[1] == recv.meta.shape[1] == whole.meta.shape[1] / 2  # [batch, seq/2, hidden]
    stage0 = lowering.programs[(0, 0)]
    position = [o.name for o in progs[0].io[0].outputs].index(out.name)
    sent = stage0.graph.output_node().args[0][position]
    assert sent.target is torch.ops.aten.add.Tensor  # the residual add, on this rank's chunk
    from passes.checks.communication_check import check_lowering
    summary = check_lowering(lowering)  # the sends and receives agree on the chunk's size
    assert summary
    assert progs[0].sp_grad_params == progs[1].sp_grad_params
    assert "blocks.0.ln_1.weight" in progs[0].sp_grad_params and "ln_f.weight" in progs[2].sp_grad_params


# --- end to end on gloo ---------------------------------------------------------------------
GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, STEPS = 4, 3
ADAMW = {"lr": 1e-3, "eps": 1e-6}  # eps as in tests/test_runtime_parity.py
# (dp, tp, pp, micro-batches, schedule, checkpointing); with pp=2 the boundary travels as chunks,
# recomputed inside checkpointed regions and through the split backward of the zero-bubble schedule
CASES = [(1, 2, 1, 1, "1f1b", "none"), (1, 2, 2, 2, "1f1b", "none"), (1, 2, 2, 2, "1f1b", "full"),
         (1, 2, 2, 4, "zb1p", "none")]


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _train(cases, payload):
    """On each rank: every case's results. ``payload``: the model's graph, captured once by the test process."""
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=200)
    spec, graph = unpacked_graph(GPT, payload)
    meshes = [Mesh(dp, pp, tp, timeout_s=60) for dp, tp, pp, *_ in cases]
    out = {}
    for (dp, tp, pp, m, schedule, ckpt), mesh in zip(cases, meshes):
        torch.distributed.barrier()
        if not mesh.active:
            continue
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=dp, tp=tp, pp=pp, schedule=schedule,
                                                 num_micro_batches=m, sequence_parallel=True, checkpointing=ckpt)
        pm = build_parallel_model(graph, config, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
        losses = [pm.train_step(b) for b in _batches(spec)]
        # the stage graphs and their checkpointed regions' graphs
        code = "".join(m.code for st in pm.stages.values() for m in st.module.modules() if isinstance(m, fx.GraphModule))
        out[(dp, tp, pp, m, schedule, ckpt)] = {"losses": losses, "params": pm.full_parameters(), "grads": pm.full_gradients(),
                                "sp_grads": pm.program.sp_grad_params, "reduce_scatter": "reduce_scatter_seq" in code}
    return out


def test_parallel_model_with_sequence_parallel_matches_one_device():
    from runtime.dist.launch import spawn
    from tests.one_device import train_one_device

    results = spawn(_train, 4, CASES, packed_graph(GPT), timeout_s=300)
    spec = build_model(GPT)
    ref_losses, model = train_one_device(spec, _batches(spec), adamw=ADAMW)
    for case in CASES:
        dp, tp, pp, *_ = case
        ranks = [r[case] for r in results[:dp * tp * pp]]
        covered = set()
        for rank, res in enumerate(ranks):
            assert res["reduce_scatter"] and res["sp_grads"], f"{case} rank {rank}: no sequence parallelism"
            assert res["losses"] == pytest.approx(ref_losses, rel=1e-5), f"{case} rank {rank}"
            for name, value in res["params"].items():
                expected = model.get_parameter(name)
                covered.add(id(expected))
                torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda msg: f"{case} rank {rank} {name}: {msg}")
                g = expected.grad
                torch.testing.assert_close(res["grads"][name], g, rtol=1e-5,
                                           atol=1e-5 * g.abs().max().item() + 1e-8,
                                           msg=lambda msg: f"{case} rank {rank} grad of {name}: {msg}")
        assert not [n for n, p in model.named_parameters() if id(p) not in covered], case
        print(f"{case}: losses {ranks[0]['losses']}")
