"""Cost-model primitives against textbook formulas (Narayanan et al. 2021, ZeRO, ring collectives)."""
import dataclasses

import pytest

from partitioner.cost.cluster import Cluster, DeviceEfficiency, Link
from partitioner.cost.cost_model import (
    DEFAULT_EFFICIENCY,
    EfficiencyCurve,
    StepTimeTerms,
    all_gather_time,
    all_reduce_time,
    bubble_fraction,
    compute_time,
    cost_hooks,
    efficiency_curve,
    group_link,
    in_flight_chunks,
    in_flight_microbatches,
    memory_bound_rate,
    memory_bound_time,
    model_state_bytes,
    pipeline_bubble_time,
    pipeline_step_time,
    reduce_scatter_time,
    ring_all_reduce_bytes_per_rank,
    roofline_time,
    send_recv_time,
    strided_ranks,
)
from partitioner.errors import ConfigError

LINK = Link(kind="nvlink", bandwidth_bytes_per_s=100e9, latency_s=2e-6)
DGX = Cluster.preset("dgx-a100-80gb", nodes=2)


# ---- links -----------------------------------------------------------------------------------

def test_tp_group_inside_node_uses_nvlink_and_spanning_group_is_slower():
    inside = group_link(DGX, size=8)
    spanning = group_link(DGX, ranks=[0, 1, 2, 3, 8, 9, 10, 11])  # 4 GPUs on each of 2 nodes
    assert inside == DGX.intra_node and inside.kind == "nvswitch"
    assert spanning.kind == "infiniband"
    # 8 NICs x 25 GB/s shared by the 2 sibling groups of 4 GPUs on each node
    assert spanning.bandwidth_bytes_per_s == pytest.approx(8 * 25e9 * 4 / 8)
    nbytes = 256 * 2**20
    assert all_reduce_time(nbytes, 8, spanning) > 2 * all_reduce_time(nbytes, 8, inside)


def test_group_link_data_parallel_and_whole_cluster():
    dp = group_link(DGX, size=2, stride=8, start=3)  # one GPU per node: its own rail's NIC
    assert dp.bandwidth_bytes_per_s == pytest.approx(25e9)
    everyone = group_link(DGX, size=16)  # the full node's NICs, capped by NVLink
    assert everyone.bandwidth_bytes_per_s == pytest.approx(min(300e9, 200e9))
    assert group_link(DGX, ranks=[5]) == DGX.intra_node
    with pytest.raises(ConfigError, match="rank 16 is outside the cluster's world of 16 ranks"):
        group_link(DGX, size=2, stride=8, start=8)
    with pytest.raises(ConfigError, match="distinct ranks"):
        group_link(DGX, ranks=[1, 1])
    assert strided_ranks(3, 4, 1) == (1, 5, 9)


# ---- collectives -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_collectives(n):
    nbytes = 1e9
    assert ring_all_reduce_bytes_per_rank(nbytes, n) == pytest.approx(2 * (n - 1) / n * nbytes)
    ar = all_reduce_time(nbytes, n, LINK)
    ag = all_gather_time(nbytes, n, LINK)
    assert ar == pytest.approx(2 * (n - 1) / n * nbytes / 100e9 + 2 * (n - 1) * 2e-6)
    assert ag == pytest.approx((n - 1) / n * nbytes / 100e9 + (n - 1) * 2e-6)
    # an all-reduce is a reduce-scatter followed by an all-gather
    assert ar == pytest.approx(reduce_scatter_time(nbytes, n, LINK) + ag)


def test_collectives_edge_cases():
    assert all_reduce_time(1e9, 1, LINK) == 0.0 and all_gather_time(1e9, 1, LINK) == 0.0
    assert send_recv_time(1e6, LINK) == pytest.approx(2e-6 + 1e6 / 100e9)
    # latency dominates small messages, bandwidth large ones
    assert all_reduce_time(8, 8, LINK) == pytest.approx(14 * 2e-6, rel=1e-3)
    with pytest.raises(ConfigError, match="at least 1 rank, got n=0"):
        all_reduce_time(1, 0, LINK)


# ---- compute ---------------------------------------------------------------------------------

def test_compute_efficiency_rises_with_size():
    dev = DGX.device
    curve = EfficiencyCurve(peak_efficiency=0.8, half_saturation_s=1e-5)
    f_half = 312e12 * 1e-5
    assert curve.efficiency(f_half, 312e12) == pytest.approx(0.4)
    effs = [curve.efficiency(f, 312e12) for f in (1e8, 1e10, 1e12, 1e14)]
    assert effs == sorted(effs) and effs[-1] == pytest.approx(0.8, rel=1e-3)
    assert compute_time(1e15, dev, "bf16", curve) == pytest.approx(1e15 / (0.8 * 312e12), rel=1e-3)
    assert compute_time(1e12, dev, "fp32") > compute_time(1e12, dev, "bf16")
    assert compute_time(0, dev) == 0.0
    with pytest.raises(ConfigError, match=r"peak_efficiency must be in \(0, 1\]"):
        EfficiencyCurve(peak_efficiency=1.5)


def test_a_kernel_is_priced_with_the_devices_measured_curve_and_with_the_default_without_one():
    cpu = Cluster.preset("local-cpu")  # 50 GFLOP/s fp32, no measured curve: the default (0.75, 5 us)
    measured = EfficiencyCurve(peak_efficiency=0.99, half_saturation_s=1.2e-6)
    calibrated = dataclasses.replace(cpu.device, efficiency=DeviceEfficiency(fp32=measured))
    f, peak = 2 * 64**3, 50e9  # a 64x64 matmul: about 10 us at the peak
    assert efficiency_curve(cpu.device, "fp32") is DEFAULT_EFFICIENCY
    assert compute_time(f, cpu.device, "fp32") == pytest.approx((f + peak * 5e-6) / (peak * 0.75))
    assert efficiency_curve(calibrated, "fp32") == efficiency_curve(calibrated, "tf32") == measured
    assert compute_time(f, calibrated, "fp32") == pytest.approx((f + peak * 1.2e-6) / (peak * 0.99))
    assert compute_time(f, calibrated, "torch.float32") == compute_time(f, calibrated, "fp32")
    # a dtype the calibration did not measure keeps the default; an explicit curve wins
    assert efficiency_curve(calibrated, "bf16") is DEFAULT_EFFICIENCY
    assert compute_time(f, calibrated, "bf16") == compute_time(f, cpu.device, "bf16")
    assert compute_time(f, calibrated, "fp32", DEFAULT_EFFICIENCY) == compute_time(f, cpu.device, "fp32")
    # the roofline and the lowering's cost hooks read the same curve
    assert roofline_time(f, 0.0, calibrated, "fp32") == compute_time(f, calibrated, "fp32")
    hooks = cost_hooks(dataclasses.replace(cpu, device=calibrated))
    assert hooks.compute_seconds(f, "fp32") == compute_time(f, calibrated, "fp32")


def test_memory_bound_and_roofline():
    dev = DGX.device
    assert memory_bound_time(2039e9, dev) == pytest.approx(1.0)
    assert memory_bound_time(1e9, 1e9) == 1.0
    # an elementwise op: few FLOPs, many bytes -> memory bound
    assert roofline_time(1e6, 1e9, dev) == memory_bound_time(1e9, dev)
    assert roofline_time(1e14, 1e6, dev) == compute_time(1e14, dev)
    # a calibrated rate for the memory-bound nodes; a matmul's operands still stream at the memory's
    slow = dataclasses.replace(dev, memory_bound_bytes_per_s=dev.memory_bandwidth_bytes_per_s / 4)
    assert memory_bound_rate(dev) == dev.memory_bandwidth_bytes_per_s and memory_bound_rate(slow) == 2039e9 / 4
    assert memory_bound_time(2039e9, slow) == pytest.approx(4.0)
    assert roofline_time(1e6, 1e9, slow) == roofline_time(1e6, 1e9, dev) == memory_bound_time(1e9, 2039e9)


# ---- pipeline --------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32), (1, 3)])
def test_bubble_fraction_textbook(p, m):
    for schedule in ("gpipe", "1f1b"):
        assert bubble_fraction(schedule, p, m) == pytest.approx((p - 1) / (m + p - 1))
    step = pipeline_step_time(1.0, 2.0, p, m, "1f1b")
    assert pipeline_bubble_time(1.0, 2.0, p, m, "1f1b") / step == pytest.approx(bubble_fraction("1f1b", p, m))
    # bubble over ideal time is (p-1)/m (Narayanan et al.)
    assert pipeline_bubble_time(1.0, 2.0, p, m, "gpipe") / (m * 3.0) == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_bubble_by_v(v):
    p, m = 4, 8
    plain = pipeline_bubble_time(1.0, 2.0, p, m, "1f1b")
    assert pipeline_bubble_time(1.0, 2.0, p, m, "interleaved", v) == pytest.approx(plain / v)
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))
    assert bubble_fraction("interleaved", p, m, v) < bubble_fraction("1f1b", p, m)
    assert bubble_fraction("interleaved", p, m, 1) == bubble_fraction("1f1b", p, m)


def test_in_flight_microbatches():
    p, m = 4, 8
    assert [in_flight_microbatches("gpipe", s, p, m) for s in range(p)] == [8, 8, 8, 8]
    assert [in_flight_microbatches("1f1b", s, p, m) for s in range(p)] == [4, 3, 2, 1]
    assert in_flight_microbatches("1f1b", 0, p, 2) == 2  # fewer micro-batches than stages
    # Megatron interleaved: stage 0 warms up 2(p-1) + (v-1)p chunks, holds p + (p-1)/v stages' worth
    v = 2
    assert in_flight_chunks("interleaved", 0, p, m, v) == 2 * (p - 1) + (v - 1) * p + 1
    assert in_flight_microbatches("interleaved", 0, p, m, v) == pytest.approx(p + (p - 1) / v)
    assert in_flight_chunks("interleaved", p - 1, p, m, v) == (v - 1) * p + 1
    assert in_flight_chunks("interleaved", 2, p, p, v) == p * v  # m == p: all warm-up


def test_pipeline_validation():
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb'"):
        bubble_fraction("zb", 4, 8)
    with pytest.raises(ConfigError, match="use schedule='interleaved' for v > 1"):
        bubble_fraction("1f1b", 4, 8, v=2)
    with pytest.raises(ConfigError, match=r"stage must be in \[0, 4\), got 4"):
        in_flight_microbatches("1f1b", 4, 4, 8)


# ---- ZeRO ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 8, 64])
def test_zero_bf16_adam(n):
    psi = 7.5e9
    assert model_state_bytes(psi, n, 0).total == pytest.approx(16 * psi)
    assert model_state_bytes(psi, n, 1).total == pytest.approx(4 * psi + 12 * psi / n)
    assert model_state_bytes(psi, n, 2).total == pytest.approx(2 * psi + 14 * psi / n)
    assert model_state_bytes(psi, n, 3).total == pytest.approx(16 * psi / n)


def test_zero_other_optimizers():
    psi, n = 1e9, 4
    fp32 = model_state_bytes(psi, n, 0, "fp32", "adamw")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    assert model_state_bytes(psi, n, 1, "fp32", "adam").total == pytest.approx(8 * psi + 8 * psi / n)
    assert model_state_bytes(psi, n, 0, "fp32", "sgd").total == pytest.approx(8 * psi)
    assert model_state_bytes(psi, n, 0, "bf16", "sgd").total == pytest.approx(8 * psi)  # + fp32 master
    assert model_state_bytes(psi, n, 3, "fp32", "sgd_momentum").total == pytest.approx(12 * psi / n)
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        model_state_bytes(psi, n, 0, optimizer="lion")
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1, 2 or 3, got 4"):
        model_state_bytes(psi, n, 4)


# ---- step time -------------------------------------------------------------------------------

def test_step_time_terms():
    terms = StepTimeTerms(compute=1.0, tp_comm=0.25, dp_comm=0.5, bubble=0.125)
    assert terms.total == 1.875
    assert terms.to_dict()["total"] == 1.875 and terms.to_dict()["offload"] == 0.0
    with pytest.raises(ConfigError, match="StepTimeTerms.bubble must be >= 0 seconds"):
        StepTimeTerms(bubble=-1.0)


@pytest.mark.parametrize("schedule,v", [("zb1p", 1), ("zbv", 2)])
@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("share", [0.2, None, 0.9])
def test_zero_bubble_costs_past_2p_micro_batches_equal_the_full_simulation(schedule, v, p, share):
    """The search simulates ZB-V at most at 2p micro-batches and ZB-H1 on two stages: beyond that
    their idle time per micro-batch and their in-flight peaks do not change (ZB-H1's grows as
    p - 1), which the full action lists show, at any share of the backward in its weight half."""
    from passes.ir.schedule import build, peak_in_flight, simulate
    from partitioner.cost import cost_model

    share = round(cost_model.WEIGHT_GRAD_SHARE if share is None else share, 3)
    f, b = 1.0 / v, cost_model.FWD_BWD_RATIO / v
    for m in (p, 2 * p + 1, 3 * p, 5 * p + 2):
        actions = build(schedule, p, m, v, check=False)
        work = m * v * (f + b)
        direct = (simulate(actions, f, b, weight_time=b * share).makespan - work) / (work / m)
        assert cost_model._simulated_bubble_slots(schedule, p, m, v, share) == pytest.approx(direct, rel=1e-12)
        assert cost_model._zero_bubble_peaks(schedule, p, m, v) == tuple(peak_in_flight(actions, s) for s in range(p))


def test_pipeline_states_of_one_f_one_b_read_off_by_hand():
    """Rank 1 of 1F1B on two stages, 3 micro-batches: F0 B0 F1 B1 F2 B2. Each forward holds its
    graph and its received input; each backward sends the input gradient, held to the step's end,
    and frees the graph; the gradients exist from B0 on; the step's end holds them alone."""
    from partitioner.cost.cost_model import pipeline_states

    # (graphs, held, weight, grads made, messages): F0 (one graph, its input received); during
    # B0..B2 (a graph, gradients made, 1-3 input gradients sent) the most is B2's; the end
    assert pipeline_states("1f1b", 1, 2, 3, 1) == (((0,), (0,), -1, (1,), 3), ((1,), (0,), -1, (0,), 1),
                                                   ((1,), (0,), -1, (1,), 3))
    # rank 0 (F0 F1 B0 F2 B1 B2): two graphs at once, no message (stage 0 receives none)
    assert max(pipeline_states("1f1b", 0, 2, 3, 1)) == ((2,), (0,), -1, (1,), 0)


@pytest.mark.parametrize("m", [1, 2, 7])
@pytest.mark.parametrize("stage", [0, 2])
def test_gpipe_states_cover_every_state_of_its_walk(m, stage):
    """GPipe's states are written down, not walked: each state of the walk holds no more of
    anything than one of them."""
    from partitioner.cost import cost_model

    states = cost_model.pipeline_states("gpipe", stage, 3, m, 1)
    for graphs, held, weight, grads, n in ((*k, n) for k, n in cost_model._walk("gpipe", stage, 3, m, 1).items()):
        assert any(s[0][0] >= graphs[0] and s[3][0] >= grads[0] and s[4] >= n for s in states), (graphs, grads, n)
    assert len(states) == 3


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb1p", 1), ("zbv", 2)])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_pipeline_states_past_3p_micro_batches_equal_the_full_walk(schedule, v, p):
    """Past 3p micro-batches the search walks a schedule at 3p and 4p and takes each state's
    messages linearly to m: the same states as walking every micro-batch."""
    from partitioner.cost import cost_model

    def walked(stage: int, m: int) -> tuple:
        return tuple(sorted((*key, n) for key, n in cost_model._walk(schedule, stage, p, m, v).items()))

    for m in (3 * p + (p if schedule == "interleaved" else 1), 5 * p, 6 * p + (0 if schedule == "interleaved" else 1),
              11 * p):
        for stage in range(p):
            assert cost_model.pipeline_states(schedule, stage, p, m, v) == walked(stage, m), (m, stage)


@pytest.mark.parametrize("m", [1, 4])
def test_unequal_pipeline_stages_pay_the_fill_and_drain_of_each_stage_once(m):
    """A 4-stage pipeline of hf-gpt2 (embedding + block, block, block, block + head: the end
    stages are slower): GPipe's step is the sum of the stages plus (m − 1) times the slowest, as
    the schedule's own action lists simulate it; (p − 1) times the slowest stage over-charged the
    one-micro-batch pipeline here by about half. 1F1B's is at most that."""
    import dataclasses

    from partitioner.search.replay import predict_step_time
    from partitioner.search.profile import profile_model
    from passes.ir.schedule import build, simulate

    profile = profile_model("hf-gpt2:n_layer=4,n_embd=64,n_head=4,vocab_size=128,n_positions=32,"
                            "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0,seq=16", dtype="fp32")
    cpu = Cluster.preset("local-cpu")  # with a CPU's per-op overhead, as calibrated here (the ends have more ops)
    cluster = dataclasses.replace(cpu, devices_per_node=4,
                                  device=dataclasses.replace(cpu.device, kernel_overhead_s=25e-6))
    knobs = dict(dp=1, tp=1, pp=4, virtual_pp=1, zero_stage=0, sequence_parallel=False, checkpointing="none",
                 offload="none", micro_batch_size=16 // m, num_micro_batches=m)
    for schedule in ("gpipe", "1f1b"):
        plan = predict_step_time(profile, cluster, {**knobs, "schedule": schedule}, global_batch=16)
        t = [s.time_s for s in plan.stages]
        assert max(t) > 1.2 * min(t)  # unequal, else this proves nothing
        half = {i: x / 2 for i, x in enumerate(t)}
        simulated = simulate(build(schedule, 4, m), half, half).makespan
        charged = plan.predicted.terms["compute"] + plan.predicted.terms["bubble"]
        if schedule == "gpipe":
            assert charged == pytest.approx(simulated, rel=1e-9)
        else:
            assert simulated <= charged * (1 + 1e-9)
        assert charged < (m + 3) * max(t)
