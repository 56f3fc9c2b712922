"""Profile replication and the plan search: fixing, determinism, the memory ladder, tp placement."""
import dataclasses
import math

import pytest

from partitioner.compile.analysis import analyze
from partitioner.cost.cluster import Cluster
from partitioner.errors import ConfigError, InfeasiblePlanError
from passes.ir.plan import format_bytes
from partitioner.search.profile import profile_model
from partitioner.search.plan_cost import chunk_sizes
from partitioner.search.search import candidates, min_memory, search
from partitioner.calibration.job_cluster import local_cluster
from tests.memory_devices import NOTHING_HELD_BACK

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=32"


@pytest.fixture(scope="module")
def profile():
    return profile_model(SPEC, dtype="bf16", tensor_remat=True)  # the search offers every checkpointing


def _cluster(memory_bytes: float | None = None, nodes: int = 1, devices: int | None = None) -> Cluster:
    c = Cluster.preset("dgx-a100-80gb", nodes=nodes)
    if devices is not None:
        c = dataclasses.replace(c, devices_per_node=devices)
    if memory_bytes is not None:
        c = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=int(memory_bytes), **NOTHING_HELD_BACK))
    return c


def test_replicated_profile_matches_full_capture_and_analysis(profile):
    direct = profile_model(SPEC, dtype="bf16", sample_layers=None, tensor_remat=True)  # all 4 blocks captured
    assert len(profile.blocks) == len(direct.blocks) == 4
    for key in ("param_count", "param_bytes", "fwd_flops", "bwd_flops", "activation_bytes"):
        assert getattr(profile, key) == getattr(direct, key), key
    # the per-tensor decision is made on the whole captured graph, so the share of it one block
    # takes moves a little with the number of blocks sharing its budget: near, not equal; what its
    # recomputes hold at the fullest moment (working bytes) depends on which of the decisions of
    # equal cost the MILP returns, and may be none
    tensor = ("tensor_activation_bytes", "tensor_recompute_flops", "tensor_recomputed_ops")
    decided = (*tensor, "tensor_working_bytes")
    assert [dataclasses.replace(b, **dict.fromkeys(decided, 0)) for b in profile.blocks] == \
        [dataclasses.replace(b, **dict.fromkeys(decided, 0)) for b in direct.blocks]
    assert all(b.tensor_working_bytes >= 0 for b in [*profile.blocks, *direct.blocks])
    for key in tensor:
        got, want = getattr(profile.blocks[0], key), getattr(direct.blocks[0], key)
        assert 0 < got == pytest.approx(want, rel=0.2), key
    whole = analyze(SPEC, batch=1, seq=32, dtype="bf16")
    assert profile.param_count == whole.param_count
    assert profile.fwd_flops == whole.fwd_flops and profile.bwd_flops == whole.bwd_flops
    assert profile.activation_bytes == whole.activation_bytes
    assert (profile.hidden, profile.heads) == (64, 4)
    assert profile.shared_param_count == 256 * 64  # tied wte / lm_head
    # public GPT formula: 24·s·h²·(1 + s/6h) forward matmul FLOPs per block and sample
    s, h = 32, 64
    assert profile.blocks[0].fwd_flops == 24 * s * h * h * (1 + s / (6 * h))


def test_fix_every_field_reproduces_prediction(profile):
    cluster = _cluster(nodes=2)
    chosen = search(profile, cluster, global_batch=64)
    again = search(profile, cluster, global_batch=64, fix=chosen.knobs())
    assert again.knobs() == chosen.knobs()
    assert again.predicted == chosen.predicted
    assert again.stages == chosen.stages
    assert again.alternatives == ()  # a single candidate


def test_dag_checkpointing_is_costed_between_none_and_full(profile):
    """The profile carries the dag policy's decision on the captured blocks (a share of the saved
    bytes kept, some matmul FLOPs recomputed), and the search prices it: with every other knob
    pinned, dag's peak lies between full checkpointing's and none's, and so does its recompute."""
    block = profile.blocks[0]
    assert block.activation_bytes > block.dag_activation_bytes > 0
    assert 0 < block.dag_recompute_flops < block.fwd_flops and 0 < block.dag_checkpointed <= 1
    base = {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b", "zero_stage": 0, "micro_batch_size": 2, "offload": "none",
            "sequence_parallel": False}
    by_policy = {ckpt: search(profile, _cluster(), global_batch=64, fix={**base, "checkpointing": ckpt}).predicted
                 for ckpt in ("none", "dag", "full")}
    peak = {k: v.peak_memory_bytes for k, v in by_policy.items()}
    recompute = {k: v.terms["recompute"] for k, v in by_policy.items()}
    assert peak["full"] < peak["dag"] < peak["none"], peak
    assert recompute["none"] == 0 < recompute["dag"] < recompute["full"], recompute


def test_a_model_dag_cannot_be_priced_on_is_not_offered_and_pinning_dag_says_why(monkeypatch):
    """Where the dag policy fails on the profiled graph, the profile records what it said, the
    search does not offer dag, and a pinned dag is refused with that reason."""
    from partitioner.search import profile as profiling
    from passes.ir.errors import PassError

    def fails(gm, *args, **kwargs):
        raise PassError("an op the policy cannot price")

    monkeypatch.setattr(profiling, "checkpoint_policy", fails)
    refused = profile_model("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8")
    assert refused.blocks[0].dag_activation_bytes is None
    assert "an op the policy cannot price" in refused.blocks[0].dag_refusal
    assert all(c.checkpointing != "dag" for c in candidates(refused, _cluster(), global_batch=8))
    with pytest.raises(ConfigError, match="cannot be priced on this model: the dag checkpoint policy failed .*an op "
                                          "the policy cannot price.*pin none, selective or full"):
        search(refused, _cluster(), global_batch=8, fix={"checkpointing": "dag"})


def test_fix_pins_knobs(profile):
    fix = {"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_pp": 2, "checkpointing": "full",
           "zero_stage": 1, "micro_batch_size": 1}
    p = search(profile, _cluster(nodes=2), global_batch=64, fix=fix)
    assert {k: getattr(p, k) for k in fix} == fix
    assert p.predicted.terms["recompute"] > 0
    with pytest.raises(ConfigError, match="unknown knob"):
        search(profile, _cluster(), global_batch=64, fix={"tensor_parallel": 2})


def test_compile_is_off_unless_pinned_and_pinned_leaves_out_what_it_does_not_run_with(profile):
    cluster = _cluster(nodes=2)
    assert not search(profile, cluster, global_batch=64).compile
    pinned = search(profile, cluster, global_batch=64, fix={"compile": True, "pp": 2})
    assert pinned.compile and pinned.offload == "none"
    assert pinned.alternatives and all(a.knobs["compile"] for a in pinned.alternatives)
    # a split backward compiles the segments between the weight-reading ops: no checkpointed region there
    for knobs in [pinned.knobs(), *(a.knobs for a in pinned.alternatives)]:
        assert knobs["offload"] == "none"
        assert knobs["schedule"] not in ("zb1p", "zbv") or knobs["checkpointing"] == "none", knobs
    zb = search(profile, cluster, global_batch=64, fix={"compile": True, "pp": 2, "schedule": "zb1p"})
    assert zb.compile and zb.schedule == "zb1p" and zb.checkpointing == "none"
    with pytest.raises(ConfigError, match="compile=true with schedule='zb1p'"):
        search(profile, cluster, global_batch=64, fix={"compile": True, "pp": 2, "schedule": "zb1p",
                                                       "checkpointing": "full"})


def test_search_is_deterministic(profile):
    a = search(profile, _cluster(nodes=2), global_batch=64)
    b = search(profile, _cluster(nodes=2), global_batch=64)
    assert a == b and a.to_json() == b.to_json()
    # alternatives are real losers: slower, or over the memory limit
    for alt in a.alternatives:
        assert alt.step_time_s >= a.predicted.step_time_s or alt.reason.startswith("needs")


def test_memory_ladder(profile):
    batch = 64
    roomy = search(profile, _cluster(), global_batch=batch)
    assert (roomy.checkpointing, roomy.offload) == ("none", "none")
    times = [roomy.predicted.step_time_s]

    # 1. just below what any plan without checkpointing or offload needs: checkpointing turns on
    need, _ = min_memory(profile, _cluster(), global_batch=batch, fix={"checkpointing": "none", "offload": "none"})
    p1 = search(profile, _cluster(need * 0.999), global_batch=batch)
    assert p1.checkpointing != "none" or p1.offload != "none"
    assert p1.predicted.peak_memory_bytes <= need * 0.999
    times.append(p1.predicted.step_time_s)

    # 2. below what plain data parallelism needs even with checkpointing: ZeRO / pipeline / tp / offload
    base = {"zero_stage": 0, "pp": 1, "tp": 1, "offload": "none"}
    need2, _ = min_memory(profile, _cluster(), global_batch=batch, fix=base)
    p2 = search(profile, _cluster(need2 * 0.999), global_batch=batch)
    assert p2.zero_stage > 0 or p2.pp > 1 or p2.tp > 1 or p2.offload != "none"
    assert p2.predicted.peak_memory_bytes <= need2 * 0.999
    # less memory never makes the chosen plan faster
    by_cap = sorted([(float("inf"), times[0]), (need * 0.999, times[1]), (need2 * 0.999, p2.predicted.step_time_s)],
                    reverse=True)
    assert [t for _, t in by_cap] == sorted(t for _, t in by_cap)

    # 3. below the smallest need of every candidate: an error that names that need
    least, _ = min_memory(profile, _cluster(), global_batch=batch)
    with pytest.raises(InfeasiblePlanError) as info:
        search(profile, _cluster(least * 0.99), global_batch=batch)
    message = str(info.value)
    assert f"smallest need is {format_bytes(least)} per device" in message
    assert "checkpointing in {dag, full, none, tensor}" in message and "zero_stage in {0, 1, 2, 3}" in message
    assert info.value.min_bytes == least
    # ... and that need is enough
    fits = search(profile, _cluster(math.ceil(least) + 1), global_batch=batch)
    assert fits.predicted.peak_memory_bytes <= least + 1


def test_tp_stays_in_a_node_unless_fixed(profile):
    cluster = _cluster(nodes=4, devices=2)
    assert {c.tp for c in candidates(profile, cluster, 64)} == {1, 2}
    for memory in (None, 2e6):
        assert search(profile, _cluster(memory, nodes=4, devices=2), global_batch=64).tp <= 2
    forced = search(profile, cluster, global_batch=64, fix={"tp": 4, "pp": 1, "micro_batch_size": 1})
    inside = search(profile, _cluster(nodes=1, devices=8), global_batch=64,
                  fix={"tp": 4, "pp": 1, "dp": 2, "micro_batch_size": 1, "checkpointing": "none", "zero_stage": 0,
                       "offload": "none", "sequence_parallel": False})
    assert forced.tp == 4
    # a TP group across nodes pays the inter-node link
    assert forced.predicted.terms["tp_comm"] > inside.predicted.terms["tp_comm"]


def test_interleaved_chunks_may_differ_in_depth_but_each_needs_a_block(profile):
    with pytest.raises(ConfigError, match="12 stages but the model has 4 blocks"):
        search(profile, _cluster(nodes=2), global_batch=64,
             fix={"pp": 4, "schedule": "interleaved", "virtual_pp": 3})
    # six blocks over 2 ranks x 2 chunks: the two extra blocks go to the middle chunks, one per rank
    assert chunk_sizes(6, [0, 1, 0, 1], 2) == [1, 2, 2, 1]
    assert chunk_sizes(8, [0, 1, 0, 1], 2, embedding=5.0, head=5.0) == [2, 2, 2, 2]  # equal when they divide
    # more extra blocks than middle chunks: the last one goes to an end chunk, never a third to a middle one
    assert chunk_sizes(7, [0, 1, 0, 1], 2) == [2, 2, 2, 1]
    for blocks in range(4, 40):
        sizes = chunk_sizes(blocks, [0, 1, 2, 3, 3, 2, 1, 0], 4, embedding=0.3, head=0.6)
        assert sum(sizes) == blocks and max(sizes) - min(sizes) <= 1, (blocks, sizes)
    # a V: chunks 0 and 3 on rank 0, which also holds the embedding and the head
    assert chunk_sizes(6, [0, 1, 1, 0], 2, embedding=0.5, head=0.5) == [1, 2, 2, 1]
    # Llama 3 405B's 126 blocks over 16 ranks x 6 chunks: every rank within one block of the others,
    # the first and last chunk (embedding, head) among the shallowest
    ranks = [j % 16 for j in range(96)]
    sizes = chunk_sizes(126, ranks, 16, embedding=0.2, head=0.3)
    per_rank = [sum(n for n, r in zip(sizes, ranks) if r == k) for k in range(16)]
    assert sum(sizes) == 126 and min(sizes) >= 1 and max(per_rank) - min(per_rank) <= 1
    assert sizes[0] == sizes[-1] == min(sizes)


def test_every_operator_belongs_to_one_layer_and_llama_blocks_dispatch_more(profile):
    import operator

    whole = analyze(SPEC, batch=1, seq=32, dtype="bf16")
    ops = [n for n in whole.graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert sum(layer.ops for layer in profile.layers) == len(ops)
    blk = profile.blocks[0]
    assert blk.ops > blk.matmuls and 0 < blk.saved_tensors < blk.ops
    # RMSNorm, RoPE and SwiGLU are many small operators: the per-op overhead must see them
    llama = profile_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq=32", dtype="bf16")
    assert llama.blocks[0].ops > 2 * blk.ops


def _knobs(**kw):
    return {**dict(dp=1, tp=1, pp=1, virtual_pp=1, micro_batch_size=2, num_micro_batches=2, schedule="1f1b",
                   zero_stage=0, sequence_parallel=False, checkpointing="none", offload="none"), **kw}


def test_tied_weights_are_synced_between_first_and_last_stage_only(profile):
    from partitioner.cost.cost_model import all_reduce_time
    from partitioner.search.replay import predict_step_time

    c = _cluster(devices=2)
    two = predict_step_time(profile, c, _knobs(pp=2), global_batch=4).predicted.terms
    assert two["tied_comm"] == pytest.approx(all_reduce_time(256 * 64 * 2, 2, c.intra_node))  # bf16 grads
    one = predict_step_time(profile, c, _knobs(dp=2), global_batch=8).predicted.terms
    assert one["tied_comm"] == 0.0
    untied = profile_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq=32", dtype="bf16")
    assert untied.shared_param_count == 0
    assert predict_step_time(untied, c, _knobs(pp=2), global_batch=4).predicted.terms["tied_comm"] == 0.0


def test_framework_term_is_step_overhead_plus_grad_norm_and_loss_all_reduces(profile):
    """Every step ends with two scalar all-reduces over the mesh (the runtime's global gradient
    norm, then the loss): each 2·⌈log2 n⌉ latencies on the step-end link, for every plan."""
    from partitioner.search.replay import predict_step_time

    c = _cluster(devices=8)
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, step_overhead_s=1e-3))
    for knobs, gb in ((_knobs(dp=8), 32), (_knobs(dp=4, pp=2), 16)):
        pred = predict_step_time(profile, c, knobs, global_batch=gb).predicted
        assert pred.terms["framework"] == pytest.approx(1e-3 + 2 * (2 * 3 * c.intra_node.latency_s))  # log2(8) = 3
    slow = dataclasses.replace(c, sync_latency_scale=3.0)
    pred = predict_step_time(profile, slow, _knobs(dp=8), global_batch=32).predicted
    assert pred.terms["framework"] == pytest.approx(1e-3 + 2 * (2 * 3 * 3.0 * c.intra_node.latency_s))
    assert pred.step_time_s == pytest.approx(sum(v for k, v in pred.terms.items() if k != "total"))


def test_ranks_sharing_compute_slots_pay_for_computing_together(profile):
    """4 CPU ranks on 2 cores: data parallelism, all 4 computing at once, runs its compute and
    optimizer step at half speed; a 4-stage pipeline of 2 micro-batches keeps about 2 of its
    4 ranks busy at once and pays almost nothing; 1F1B over 8 micro-batches keeps all 4 busy in its
    steady phase and pays for it; without slots nothing changes."""
    from partitioner.search.replay import predict_step_time

    alone = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=4)
    shared = dataclasses.replace(alone, compute_slots_per_node=2)
    dp = {n: predict_step_time(profile, c, _knobs(dp=4, num_micro_batches=1), global_batch=8).predicted.terms
          for n, c in (("alone", alone), ("shared", shared))}
    assert dp["alone"]["contention"] == 0.0
    t = dp["shared"]
    assert t["contention"] == pytest.approx(t["compute"] + t["optimizer"])  # everything twice as long
    assert t["total"] == pytest.approx(dp["alone"]["total"] + t["contention"])
    pp = predict_step_time(profile, shared, _knobs(pp=4, micro_batch_size=4, num_micro_batches=2),
                           global_batch=8).predicted.terms
    assert pp["contention"] < 0.05 * pp["compute"] and pp["bubble"] > 0  # uneven stages overlap a little
    steady = predict_step_time(profile, shared, _knobs(pp=4, micro_batch_size=1, num_micro_batches=8),
                               global_batch=8).predicted.terms
    # the steady phase (4 ranks at half speed) lasts longer than the rest of the pipeline gives back
    assert steady["contention"] > 0.25 * steady["compute"]
    # a slot per rank: nothing shared
    roomy = dataclasses.replace(alone, compute_slots_per_node=4)
    assert predict_step_time(profile, roomy, _knobs(dp=4, num_micro_batches=1),
                             global_batch=8).predicted.terms["contention"] == 0.0


def test_a_zero_bubble_schedule_fills_its_bubble_with_the_weight_gradients_the_stage_has(profile):
    """ZB-H1 hides the bubble behind W, the weight-gradient half of the backward. Where the
    backward is mostly per-op dispatch (CPU ranks: 50 us an operator), W is a small share of it,
    and ZB-H1 saves less of 1F1B's bubble than where it is matmuls."""
    from partitioner.cost.cost_model import _bubble_slots
    from partitioner.search.replay import predict_step_time

    plain = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=4)
    dispatch = dataclasses.replace(plain, device=dataclasses.replace(plain.device, kernel_overhead_s=50e-6))

    def bubble_ratio(cluster) -> float:
        terms = {s: predict_step_time(profile, cluster, _knobs(pp=4, micro_batch_size=1, num_micro_batches=4, schedule=s),
                                      global_batch=4).predicted.terms for s in ("zb1p", "1f1b")}
        return terms["zb1p"]["bubble"] / terms["1f1b"]["bubble"]

    # 1F1B's bubble is 3 slots; ZB-H1's at W = half the backward is 3 x 2/3 of them in a
    # 1:2 forward:backward simulation: the matmul-bound ratio is near that, the dispatch-bound one above
    half = _bubble_slots("zb1p", 4, 4, 1, 0.5) / 3
    assert bubble_ratio(plain) < bubble_ratio(dispatch)
    assert bubble_ratio(dispatch) > 1.2 * half


def test_zero3_pays_a_collective_per_layer_and_pass(profile):
    """ZeRO-3 gathers each layer's parameters in its own collective (a gather site), before the
    forward and again before the backward, and reduce-scatters each layer's gradients: on CPU
    ranks (nothing hidden) 3 collectives per layer and micro-batch, each paying the link's latency."""
    from partitioner.search.replay import predict_step_time

    cluster = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=2)
    alpha = 1e-3
    cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node, latency_s=alpha))
    layers = len(profile.blocks) + 2  # the embedding and the head are sites too
    for m in (1, 2):
        terms = predict_step_time(profile, cluster, _knobs(dp=2, zero_stage=3, micro_batch_size=2, num_micro_batches=m),
                                  global_batch=4 * m).predicted.terms
        assert terms["dp_comm"] >= m * 3 * layers * alpha  # each of 2 ranks: (n - 1) = 1 latency a collective
        assert terms["dp_comm"] < m * 3 * layers * alpha * 1.5


def test_offload_of_checkpointed_blocks_moves_one_tensor_per_block():
    from partitioner.search.replay import predict_step_time

    prof = profile_model("gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0", dtype="fp32")
    c = local_cluster(2)
    knobs = _knobs(pp=2, num_micro_batches=2, micro_batch_size=2, offload="activations")

    def per_call_seconds(ckpt: str) -> float:  # d(offload term) / d(offload_call_s)
        terms = [predict_step_time(prof, dataclasses.replace(c, device=dataclasses.replace(c.device, offload_call_s=x)),
                                   {**knobs, "checkpointing": ckpt}, global_batch=4).predicted.terms["offload"]
                 for x in (0.0, 1e-3)]
        return (terms[1] - terms[0]) / 1e-3

    # the slower stage's copies, 2 per tensor per micro-batch: its layers' saved tensors, or one
    # per block under full checkpointing (the region's input)
    full, none = per_call_seconds("full"), per_call_seconds("none")
    assert full < none
    stage_tensors = {round(x / (2 * 2)) for x in (full,)}
    assert stage_tensors <= {2 + prof.embedding.saved_tensors, 2 + prof.head.saved_tensors}


def _shrunk(preset: str, nodes: int, memory_gib: float | None) -> Cluster:
    c = Cluster.preset(preset, nodes=nodes)
    if memory_gib is not None:
        c = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=int(memory_gib * 2**30), **NOTHING_HELD_BACK))
    return c


EXHAUSTIVE_MODELS = ("gpt:layers=8,hidden=1024,heads=16,vocab=32000,seq=1024",
                     "llama:layers=8,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=1024",
                     "bert:layers=8,hidden=768,heads=12,vocab=30000,seq=512")
# One node with room, two nodes, and a node so small that memory decides (checkpointing, ZeRO, offload).
EXHAUSTIVE_CLUSTERS = (("dgx-a100-80gb", 1, None), ("dgx-h100", 2, None), ("dgx-a100-40gb", 1, 1.5))


@pytest.mark.parametrize("spec", EXHAUSTIVE_MODELS, ids=lambda s: s.split(":")[0])
@pytest.mark.parametrize("cluster_args", EXHAUSTIVE_CLUSTERS, ids=lambda a: f"{a[0]}x{a[1]}-{a[2] or 'full'}")
def test_search_returns_the_exhaustive_optimum(spec, cluster_args):
    """Branch and bound must return what evaluating EVERY candidate returns: the fastest feasible
    plan, ties to the simpler one."""
    from partitioner.search.plan_cost import PlanContext, evaluate
    from partitioner.search.search import _key

    profile = profile_model(spec, dtype="bf16")
    cluster = _shrunk(*cluster_args)
    ctx = PlanContext(profile, cluster, 64, "adamw")
    every = [evaluate(ctx, c) for c in candidates(profile, cluster, 64)]
    feasible = [e for e in every if e.feasible]
    assert feasible
    if cluster_args[2] is not None:  # the shrunk node: memory rules candidates out
        assert len(feasible) < len(every)
    best = min(feasible, key=lambda e: (e.step_time, _key(e.config)))
    chosen = search(profile, cluster, global_batch=64)
    assert chosen.config.knobs() == best.config.knobs()
    assert chosen.predicted.step_time_s == best.step_time


def test_a_candidate_the_memory_check_drops_is_not_returned(profile):
    """The search returns the fastest candidate whose checked peak fits; a faster one the check
    shows does not fit becomes an alternative with the checked peak as its reason."""
    cluster = _cluster()
    fastest = search(profile, cluster, global_batch=16)

    def check(p):
        peak = 2 * cluster.device.memory_bytes if p.config.knobs() == fastest.config.knobs() else 1.0
        return dataclasses.replace(p, predicted=dataclasses.replace(p.predicted, peak_memory_bytes=peak))

    chosen = search(profile, cluster, global_batch=16, check=check)
    assert chosen.config.knobs() != fastest.config.knobs() and chosen.predicted.peak_memory_bytes == 1.0
    assert chosen.predicted.step_time_s >= fastest.predicted.step_time_s
    dropped = [a for a in chosen.alternatives if a.knobs == fastest.config.knobs()]
    assert len(dropped) == 1 and dropped[0].reason.startswith("needs ")
    with pytest.raises(InfeasiblePlanError, match="exact memory replay of the 3 fastest plans"):
        search(profile, cluster, global_batch=16, check=lambda p: check(dataclasses.replace(p, config=fastest.config)))


def test_zero3_keeps_the_gathered_parameters_when_they_fit_and_frees_them_when_not():
    # one 8-device node at dp=8: ZeRO-3 pinned, the search chooses reshard_after_forward
    profile = profile_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,vocab=32000,seq=4096", dtype="bf16")
    fix = {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 3, "micro_batch_size": 1, "checkpointing": "full"}
    roomy = search(profile, _cluster(), global_batch=64, fix=fix)
    by_keep = {a.knobs["reshard_after_forward"]: a for a in roomy.alternatives}
    assert roomy.config.reshard_after_forward is False  # one gather per micro-batch instead of two
    freed = by_keep[True]
    assert freed.step_time_s > roomy.predicted.step_time_s
    # keeping costs the whole model's parameters in full (bf16) beside the shards
    assert roomy.predicted.peak_memory_bytes - freed.peak_memory_bytes > 0.9 * 2 * profile.param_count * 31 / 32
    tight = search(profile, _cluster(memory_bytes=(freed.peak_memory_bytes + roomy.predicted.peak_memory_bytes) / 2),
                 global_batch=64, fix=fix)
    assert tight.config.reshard_after_forward is True
    assert tight.predicted.peak_memory_bytes == pytest.approx(freed.peak_memory_bytes)


def test_a_pipeline_message_is_the_whole_boundary_tensor_or_its_sequence_chunk(profile):
    # the runtime sends each tp rank's whole (replicated) boundary tensor to its peer; under
    # sequence parallelism each tp rank's chunk of it: the predicted p2p bytes drop by tp there only
    fix = {"pp": 2, "dp": 1, "schedule": "1f1b", "num_micro_batches": 4, "checkpointing": "none"}
    pp_comm = {}
    for tp, sp in ((1, False), (2, False), (2, True), (4, True)):
        dp = 4 // tp  # the same micro-batch (2 samples) on every plan
        chosen = search(profile, _cluster(devices=8), global_batch=dp * 2 * 4,
                      fix={**fix, "tp": tp, "sequence_parallel": sp, "dp": dp, "micro_batch_size": 2})
        pp_comm[(tp, sp)] = chosen.predicted.terms["pp_comm"]
    assert pp_comm[(1, False)] == pp_comm[(2, False)] > 0, pp_comm
    # 8 messages of a + M/(k b) for a chunk of 1/k: the bandwidth part halves from tp=2 to tp=4
    whole, half, quarter = pp_comm[(1, False)], pp_comm[(2, True)], pp_comm[(4, True)]
    assert whole > half > quarter
    assert whole - half == pytest.approx(2 * (half - quarter), rel=1e-9)


def test_the_alternatives_show_the_fastest_plan_of_every_other_zero_stage():
    """A Llama-7B shape on 2 DGX-H100 nodes, where ZeRO-1, -2 and -3 come within 2% of each
    other: however many variants of the winning stage come close, the fastest plan of every
    other stage is listed with what it loses."""
    profile = profile_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,vocab=32000,seq=4096,intermediate=11008",
                            dtype="bf16")
    chosen = search(profile, Cluster.preset("dgx-h100", nodes=2), global_batch=256, fix={"tp": 1, "pp": 1})
    slower = [a for a in chosen.alternatives if a.step_time_s >= chosen.predicted.step_time_s]
    assert {a.knobs["zero_stage"] for a in slower} >= {0, 1, 2, 3} - {chosen.config.zero_stage}
    assert [a.step_time_s for a in slower] == sorted(a.step_time_s for a in slower)
    for a in slower:
        assert a.reason == f"slower by {(a.step_time_s / chosen.predicted.step_time_s - 1) * 100:.1f}%"


@pytest.mark.parametrize("spec, devices", [
    (SPEC, 8),
    ("moe:layers=4,hidden=64,heads=4,vocab=128,seq=32,experts=4,top_k=2,expert_hidden=256,dropout=0.0", 4),
])
def test_the_bounds_never_exceed_a_candidates_numbers(spec, devices):
    """The search skips a candidate whose model state alone (spread evenly over its stages)
    exceeds the device without evaluating it: that bound is below every candidate's evaluated
    peak (ZeRO, ep and its ZeRO-sharded experts, pp, tp among them), and the plan found with the
    skip is the one evaluating everything finds. Its time bound is below every step time."""
    from partitioner.search import search as search_module
    from partitioner.search.plan_cost import PlanContext, evaluate, lower_bound, state_lower_bound
    prof = profile_model(spec, dtype="fp32")
    cluster = _cluster(devices=devices)
    ctx = PlanContext(prof, cluster, 8, "adamw")
    cands = candidates(prof, cluster, 8)
    assert len({(c.zero_stage, c.pp, c.ep) for c in cands}) > 6
    evaluated = [evaluate(ctx, c, limit=None) for c in cands]
    peaks = [(state_lower_bound(ctx, c), e.peak) for c, e in zip(cands, evaluated)]
    assert all(0 < bound <= peak * (1 + 1e-12) for bound, peak in peaks)
    # and the time bound the search orders candidates by is below each one's step time
    assert all(lower_bound(ctx, c) <= e.step_time * (1 + 1e-12) for c, e in zip(cands, evaluated))
    # a device that holds some candidates' state but not others': the skip changes nothing
    bounds = sorted(b for b, _ in peaks)
    small = _cluster(memory_bytes=bounds[len(bounds) // 2], devices=devices)
    chosen = search(prof, small, global_batch=8)
    original = search_module.state_lower_bound
    try:
        search_module.state_lower_bound = lambda ctx, c: 0.0  # evaluate every candidate
        everything = search(prof, small, global_batch=8)
    finally:
        search_module.state_lower_bound = original
    assert chosen == everything


@pytest.mark.parametrize("preset, nodes, batch", [("dgx-h100", 16, 256), ("local-cpu", 4, 16)])
def test_the_time_bound_holds_where_optimizer_zero_and_offload_terms_dominate(preset, nodes, batch):
    """At 128 GPUs (data parallelism wide enough that ZeRO-1/2's per-bucket latency, ZeRO-3's
    gathers, the optimizer step and activation offload copies are seconds) and on CPU ranks
    (nothing hides a collective), the search's time bound is below every candidate's step time:
    the average stage's optimizer step, ZeRO collectives and offload copies it adds are ones the
    slowest stage pays."""
    from partitioner.search.plan_cost import PlanContext, evaluate, lower_bound
    prof = profile_model("gpt:layers=8,hidden=512,heads=8,vocab=4096,seq=256", dtype="bf16")
    cluster = Cluster.preset(preset, nodes=nodes)
    ctx = PlanContext(prof, cluster, batch, "adamw")
    cands = candidates(prof, cluster, batch)
    cands = cands[::max(1, len(cands) // 600)]
    assert {c.zero_stage for c in cands} == {0, 1, 2, 3}
    assert cluster.host_to_device.kind == "loopback" or {c.offload for c in cands} >= {"none", "activations"}
    gaps = [(lower_bound(ctx, c), evaluate(ctx, c, limit=None).step_time) for c in cands]
    assert all(bound <= step * (1 + 1e-12) for bound, step in gaps)
    # and it is not vacuous: within 10% of the step time for some candidates of every ZeRO stage
    close = {c.zero_stage for c, (bound, step) in zip(cands, gaps) if bound > 0.9 * step}
    assert close == {0, 1, 2, 3}


def test_each_other_zero_stage_is_shown_at_its_fastest(profile):
    """The alternatives explain the choice of ZeRO stage with the fastest plan of each other stage
    that fits, found past where the search stopped when its bound leaves it in the running."""
    from partitioner.search.plan_cost import PlanContext, evaluate
    cluster = _cluster(nodes=2)
    chosen = search(profile, cluster, global_batch=16)
    ctx = PlanContext(profile, cluster, 16, "adamw")
    fastest: dict[int, float] = {}
    for c in candidates(profile, cluster, 16):
        e = evaluate(ctx, c)
        if e.feasible:
            fastest[c.zero_stage] = min(fastest.get(c.zero_stage, math.inf), e.step_time)
    shown = {}
    for a in chosen.alternatives:
        if a.reason.startswith("slower"):
            z = a.knobs["zero_stage"]
            shown[z] = min(shown.get(z, math.inf), a.step_time_s)
    others = set(fastest) - {chosen.config.zero_stage}
    assert others and set(shown) >= others
    for z in others:
        assert shown[z] == pytest.approx(fastest[z], rel=1e-12), z
