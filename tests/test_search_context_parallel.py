"""The planner and context parallelism (cp): which models and knobs it offers cp for, what cp costs
(memory divided along the sequence, exchanges on the cp group's link, gradients and ZeRO over
dp x cp), and that the search takes cp where nothing fits without it or where it is faster."""
import dataclasses

import pytest

from partitioner.cli.main import main
from partitioner.cost.cluster import Cluster
from partitioner.cost.cost_model import all_reduce_time, ring_exposed_time, send_recv_time
from partitioner.errors import ConfigError, InfeasiblePlanError
from partitioner.inputs.knobs import parse_fix
from partitioner.search.plan_cost import RING_WORKING_BLOCKS
from partitioner.search.profile import AttentionProfile, profile_model
from partitioner.search.search import candidates, min_memory, search
from tests.memory_devices import NOTHING_HELD_BACK

# Six heads: tensor parallelism stops at tp=2 on an 8-GPU node (tp divides the heads and the node)
# and Ulysses at cp=2; ring attention cuts the sequence over all 8 GPUs. Grouped-query attention
# (2 kv heads) and a long sequence for the model's size.
SPEC = "llama:layers=4,hidden=768,heads=6,kv_heads=2,vocab=2048,seq=16384"
S, H, KVH, D, L = 16384, 6, 2, 128, 4
ALL = dict(tp=1, pp=1, virtual_pp=1, schedule="1f1b", zero_stage=0, hsdp_shard=None, reshard_after_forward=True,
           sequence_parallel=False, checkpointing="none", offload="none", cp_mode="ring")


@pytest.fixture(scope="module")
def profile():
    return profile_model(SPEC, dtype="bf16")


def _node(memory_bytes: float | None = None, nodes: int = 1, devices: int | None = None, **links) -> Cluster:
    c = Cluster.preset("dgx-h100", nodes=nodes)
    if devices is not None:
        c = dataclasses.replace(c, devices_per_node=devices)
    if memory_bytes is not None:
        c = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=int(memory_bytes), **NOTHING_HELD_BACK))
    for name, changes in links.items():
        c = dataclasses.replace(c, **{name: dataclasses.replace(getattr(c, name), **changes)})
    return c


def _pinned(profile, cluster, global_batch, **knobs):
    """The plan of one config, every knob pinned, on ``cluster`` with room for anything."""
    roomy = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=1 << 50))
    return search(profile, roomy, global_batch=global_batch, fix={**ALL, **knobs})


def test_the_profile_says_what_the_cp_rewrite_can_cut(profile):
    assert profile.attention == AttentionProfile(sites=1, heads=H, kv_heads=KVH, head_dim=D, causal=True)
    assert profile.context_parallel
    gpt = profile_model("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64", dtype="bf16")
    assert gpt.context_parallel and gpt.attention.kv_heads == 4  # no grouped-query attention
    bert = profile_model("bert:layers=2,hidden=64,heads=4,vocab=256,seq=64", dtype="bf16")
    assert not bert.context_parallel and "dropout" in bert.attention.cp_refusal
    assert profile_model("mlp", dtype="bf16").attention is None


def test_the_search_takes_cp_where_nothing_fits_without_it(profile):
    cluster = _node()
    without, who = min_memory(profile, cluster, global_batch=8, fix={"cp": 1})
    least, cp_plan = min_memory(profile, cluster, global_batch=8)
    assert who.cp == 1 and cp_plan.cp > 1
    assert least < 0.9 * without  # cutting the sequence 8 ways beats tp=2 and the pipeline
    tight = _node((least + without) / 2)
    chosen = search(profile, tight, global_batch=8)
    assert chosen.config.cp > 1 and chosen.config.tp == 1
    assert chosen.predicted.peak_memory_bytes <= tight.device.memory_bytes
    with pytest.raises(InfeasiblePlanError, match="no plan fits") as info:
        search(profile, tight, global_batch=8, fix={"cp": 1})
    assert info.value.min_bytes == without


def test_the_search_takes_cp_where_it_is_faster(profile):
    # a global batch of 2 on 8 GPUs: dp stops at 2; the rest is tensor, pipeline or context parallel
    chosen = search(profile, _node(), global_batch=2)
    assert chosen.config.cp > 1 and chosen.config.dp * chosen.config.cp * chosen.config.pp == 8
    no_cp = search(profile, _node(), global_batch=2, fix={"cp": 1})
    assert no_cp.config.cp == 1
    assert no_cp.predicted.step_time_s > chosen.predicted.step_time_s
    assert chosen.predicted.terms["cp_comm"] > 0 and no_cp.predicted.terms["cp_comm"] == 0


def test_activations_divide_by_cp_and_model_state_does_not(profile):
    cluster = _node()
    mem = {(cp, mode): _pinned(profile, cluster, 8, dp=8 // cp, cp=cp, cp_mode=mode, micro_batch_size=1,
                               num_micro_batches=cp).stages[0].memory
           for cp, mode in ((1, "ring"), (2, "ring"), (4, "ring"), (2, "ulysses"))}
    act = {k: m["activations"] for k, m in mem.items()}
    # ring attention saves what SDPA saved: every saved tensor holds S/cp tokens
    assert act[(2, "ring")] == pytest.approx(act[(1, "ring")] / 2, rel=1e-12)
    assert act[(4, "ring")] == pytest.approx(act[(1, "ring")] / 4, rel=1e-12)
    # Ulysses also saves the head-sharded q, k (kv heads), v of each block: S/cp tokens each
    extra = L * (S // 2) * (H + 2 * KVH) * D * 2
    assert act[(2, "ulysses")] == pytest.approx(act[(1, "ring")] / 2 + extra, rel=1e-12)
    for key in ("parameters", "gradients", "optimizer"):  # replicated over the cp ranks
        assert len({m[key] for m in mem.values()}) == 1, key
    # the ring's fp32 [b, H, c, c] score blocks (c = S / 2cp) are its working set, beside the buffers
    c4 = S // 8
    assert mem[(4, "ring")]["buffers"] - mem[(1, "ring")]["buffers"] >= RING_WORKING_BLOCKS * H * c4 * c4 * 4


def test_per_rank_tokens_are_micro_batch_times_seq_over_cp(profile):
    cluster = _node()
    # 2 samples cut 2 ways is one sample's tokens per rank: the same compute and pipeline messages
    one = _pinned(profile, cluster, 8, dp=4, pp=2, micro_batch_size=1, num_micro_batches=2).predicted.terms
    cut = _pinned(profile, cluster, 8, dp=2, pp=2, cp=2, cp_mode="ulysses", micro_batch_size=2,
                  num_micro_batches=2).predicted.terms
    assert cut["pp_comm"] == pytest.approx(one["pp_comm"], rel=1e-12)
    # attention FLOPs / cp like every other kernel; Ulysses adds only its layout copies
    assert cut["compute"] == pytest.approx(one["compute"], rel=0.02) and cut["compute"] >= one["compute"]


def test_ulysses_moves_its_tensors_over_the_cp_group(profile):
    cluster = _node()
    p = _pinned(profile, cluster, 8, dp=4, cp=2, cp_mode="ulysses", micro_batch_size=1, num_micro_batches=2)
    alpha, beta, cp, m = cluster.intra_node.latency_s, cluster.intra_node.bandwidth_bytes_per_s, 2, 2
    q = S // cp * H * D * 2  # bf16 [1, H, S/cp, D] on a rank; K and V with their 2 kv heads
    kv = S // cp * KVH * D * 2

    def a2a(n):  # each all-to-all moves (cp-1)/cp of its tensor
        return (cp - 1) / cp * n / beta + (cp - 1) * alpha

    per_block = 2 * (a2a(q) + 2 * a2a(kv) + a2a(q))  # q, k, v, out forward; their gradients backward
    loss = 2 * (2 * (cp - 1) / cp * 4 / beta + 2 * (cp - 1) * alpha)  # the loss's two scalar all-reduces
    assert p.predicted.terms["cp_comm"] == pytest.approx(m * (L * per_block + loss), rel=1e-9)


def test_ring_steps_hide_behind_the_blocks_compute_unless_the_link_is_slow(profile):
    knobs = dict(dp=1, cp=8, cp_mode="ring", micro_batch_size=1, num_micro_batches=8)
    cp, m = 8, 8
    kv = 2 * S // cp * KVH * D * 2  # K and V stacked, bf16
    dkv = 2 * kv  # their gradients travel in fp32

    def expected(cluster, link):
        loss = 2 * all_reduce_time(4.0, cp, link)
        return m * (L * cp * send_recv_time(dkv, link) + loss)  # K/V steps hidden, dK/dV steps waited

    fast = _node()
    terms = _pinned(profile, fast, 8, **knobs).predicted.terms
    assert terms["cp_comm"] == pytest.approx(expected(fast, fast.intra_node), rel=1e-9)
    slow = _node(intra_node={"bandwidth_bytes_per_s": 1e8})
    slow_terms = _pinned(profile, slow, 8, **knobs).predicted.terms
    assert slow_terms["cp_comm"] > expected(slow, slow.intra_node) * 1.2  # the K/V steps now show
    # a cp group over two nodes of 4: each ring step as slow as its hop between the nodes
    two = _node(nodes=2, devices=4)
    across = _pinned(profile, two, 8, **knobs).predicted.terms["cp_comm"]
    assert across > terms["cp_comm"]
    pair = dataclasses.replace(two.inter_node, bandwidth_bytes_per_s=two.inter_node.aggregate_bytes_per_s / 4)
    assert ring_exposed_time(dkv, cp, pair) < across
    # the primitive: exposed max(0, comm - compute) per step
    assert ring_exposed_time(kv, 7, fast.intra_node, 1.0) == 0.0
    assert ring_exposed_time(kv, 7, fast.intra_node) == pytest.approx(7 * (fast.intra_node.latency_s + kv / 450e9))


def test_gradients_and_zero_go_over_dp_times_cp(profile):
    cluster = _node()
    base = dict(micro_batch_size=1, num_micro_batches=8)
    cp_only = _pinned(profile, cluster, 8, dp=1, cp=8, zero_stage=1, **base)
    dp_only = _pinned(profile, cluster, 8, dp=8, cp=1, zero_stage=1, micro_batch_size=1, num_micro_batches=1)
    zero0 = _pinned(profile, cluster, 8, dp=1, cp=8, zero_stage=0, **base)
    # one replica (dp=1) of 8 cp ranks still averages its gradients over the 8
    assert cp_only.predicted.terms["dp_comm"] > 0
    mem = cp_only.stages[0].memory
    assert mem["optimizer"] == pytest.approx(dp_only.stages[0].memory["optimizer"], rel=1e-12)
    assert mem["optimizer"] == pytest.approx(zero0.stages[0].memory["optimizer"] / 8, rel=1e-12)
    assert mem["parameters"] == zero0.stages[0].memory["parameters"]  # not sharded by cp itself


def test_pinned_cp_is_checked_and_refused_with_a_reason(profile):
    cluster = _node()
    assert parse_fix("cp=2,cp_mode=ulysses") == {"cp": 2, "cp_mode": "ulysses"}
    p = search(profile, cluster, global_batch=8, fix="cp=2,cp_mode=ulysses")
    assert (p.config.cp, p.config.cp_mode) == (2, "ulysses")
    p = search(profile, cluster, global_batch=8, fix={"cp": 2, "tp": 2})
    assert (p.config.cp, p.config.tp) == (2, 2)
    with pytest.raises(ConfigError, match=r"cp_mode=ulysses gives each of tp\*cp = 1\*4 ranks its share of the 6 "):
        search(profile, cluster, global_batch=8, fix={"cp": 4, "cp_mode": "ulysses"})
    with pytest.raises(ConfigError, match=r"cp_mode=ulysses gives each of tp\*cp = 2\*2 ranks its share of the 6 "):
        search(profile, cluster, global_batch=8, fix={"cp": 2, "tp": 2, "cp_mode": "ulysses"})
    with pytest.raises(ConfigError, match="cp=2 with hsdp_shard=2"):
        search(profile, cluster, global_batch=8, fix={"cp": 2, "hsdp_shard": 2})
    with pytest.raises(ConfigError, match="cp_mode 'sideways' is not one of ring, ulysses"):
        parse_fix("cp_mode=sideways")
    odd = profile_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq=20", dtype="bf16")
    with pytest.raises(ConfigError, match=r"into 2\*cp = 8 chunks"):
        search(odd, cluster, global_batch=8, fix={"cp": 4})
    bert = profile_model("bert:layers=2,hidden=64,heads=4,vocab=256,seq=64", dtype="bf16")
    with pytest.raises(ConfigError, match="this model does not allow: attention .* has dropout_p="):
        search(bert, cluster, global_batch=8, fix={"cp": 2})
    # a cp group larger than a node is tried only when pinned
    assert max(c.cp for c in candidates(profile, _node(nodes=2, devices=4), 8)) == 4
    assert search(profile, _node(nodes=2, devices=4), global_batch=8, fix={"cp": 8}).config.cp == 8


def test_cp_grows_the_search_little_and_only_where_it_applies():
    gpt = profile_model("gpt:layers=8,hidden=1024,heads=16,vocab=32000,seq=1024", dtype="bf16")
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    every, no_cp = candidates(gpt, cluster, 64), candidates(gpt, cluster, 64, fix={"cp": 1})
    assert len(no_cp) < len(every) <= 2 * len(no_cp)
    cut = [c for c in every if c.cp > 1]
    assert cut and all(c.micro_batch_size % c.cp for c in cut)  # dp's twins left out
    # cp with tp: the tp*cp ranks of a cp group stay in the node; sequence parallelism when tp*cp cuts the sequence
    assert {(c.tp, c.cp) for c in cut} == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    assert any(c.sequence_parallel for c in cut if c.tp > 1)
    assert {c.cp_mode for c in cut} == {"ring", "ulysses"}
    bert = profile_model("bert:layers=2,hidden=64,heads=4,vocab=256,seq=64", dtype="bf16")
    assert {c.cp for c in candidates(bert, cluster, 64)} == {1}


def test_the_cli_plans_with_a_pinned_cp(capsys):
    assert main(["plan", "--model", "llama:layers=2,hidden=256,heads=4,kv_heads=2,vocab=512,seq=4096",
                 "--cluster", "dgx-h100", "--global-batch", "2", "--fix", "cp=2,cp_mode=ulysses"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["cp"] == ["2"] and rows["cp_mode"] == ["ulysses"]
    assert rows["cp_comm"][1] == "s" and float(rows["cp_comm"][0]) > 0  # the step-time term, seconds
