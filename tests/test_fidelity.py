"""Per-rank predictions (partitioner.search.replay) and the cost-model refit (partitioner.calibration.refit),
single process only: rank programs are built for one rank at a time, nothing is spawned."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import sympy

from partitioner.cost.cluster import Cluster
from partitioner.search.replay import predict_rank, predict_step_time
from partitioner.inputs.models import build_model
from partitioner.search.profile import profile_model
from partitioner.calibration.refit import load_run, refit, refit_from_runs
from passes.analysis.annotate_memory import annotate_memory
from passes.ir.meta import CAPTURE, MEMORY_SUMMARY, dim_symbol
from partitioner.compile.build import capture_for_pipeline, lower_plan, rank_program
from passes.ir.config import ParallelConfig
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
DIMS = {"batch": 4, "seq": 8}
BASE = dict(dp=1, tp=1, pp=1, virtual_pp=1, micro_batch_size=4, num_micro_batches=1, schedule="1f1b",
            zero_stage=0, sequence_parallel=False, checkpointing="none", offload="none")


@pytest.fixture(scope="module")
def graph():
    return capture_for_pipeline(build_model(GPT))


def test_pipeline_ranks_hold_every_parameter_once_plus_tied_copies(graph):
    knobs = {**BASE, "pp": 2, "num_micro_batches": 2}
    preds = [predict_rank(graph, knobs, r, DIMS, cluster=local_cluster(2)) for r in range(2)]
    split = lower_plan(graph, ParallelConfig(pp=2, num_micro_batches=2, micro_batch_size=4),
                      cluster=local_cluster(2), check=False).split
    model = sum(t.numel() * t.element_size() for t in graph.parameters())  # tied weights once
    # a weight tied across stages (embedding / LM head) has a copy on each stage holding it
    tied_extra = sum((len(stages) - 1) * _param_bytes(graph, split.aliases[name][0])
                     for name, stages in split.tied.items())
    assert sum(p.param_bytes for p in preds) == model + tied_extra
    assert all(p.peak_bytes > 3 * p.param_bytes for p in preds)  # params + AdamW state + activations


def test_one_stage_one_micro_batch_equals_whole_graph_analysis(graph):
    # With one stage and one micro-batch the replay is the whole step's liveness (plus the batch).
    # the whole graph's analysis counts its inputs (token ids, targets): the batch the rank slices
    batch_bytes = sum(t.untyped_storage().nbytes() for t in build_model(GPT).example_inputs(DIMS))
    pred = predict_rank(graph, BASE, 0, DIMS, global_batch_bytes=batch_bytes, cluster=local_cluster(1))
    gm = copy.deepcopy(graph)
    info = gm.meta[CAPTURE]
    gm.meta[CAPTURE] = dataclasses.replace(info, dims=tuple((n, DIMS.get(n, v)) for n, v in info.dims))
    annotate_memory(gm)
    whole = int(sympy.sympify(gm.meta[MEMORY_SUMMARY].peak_bytes).xreplace(
        {dim_symbol(k): v for k, v in DIMS.items()}))
    assert pred.peak_bytes == whole


def test_gpipe_keeps_more_micro_batches_in_flight_than_1f1b(graph):
    knobs = {**BASE, "pp": 2, "num_micro_batches": 4, "micro_batch_size": 1}
    dims = {"batch": 1, "seq": 8}
    gpipe = predict_rank(graph, {**knobs, "schedule": "gpipe"}, 0, dims, cluster=local_cluster(2))
    one_f = predict_rank(graph, knobs, 0, dims, cluster=local_cluster(2))
    assert gpipe.peak_bytes > one_f.peak_bytes
    assert gpipe.parts["activations"] > one_f.parts["activations"]


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_shards_optimizer_state(graph, zero):
    full = predict_rank(graph, {**BASE, "dp": 2}, 0, DIMS, cluster=local_cluster(2))
    sharded = predict_rank(graph, {**BASE, "dp": 2, "zero_stage": zero}, 0, DIMS, cluster=local_cluster(2))
    # params + AdamW state (2 x params + steps) vs params + 3 fp32 chunks (master, exp_avg,
    # exp_avg_sq) of 1/dp of every gradient bucket (padded to a multiple of dp)
    chunk = 4 * (-(-full.param_bytes // 4 // 2))
    assert full.state_bytes - full.param_bytes > 2 * full.param_bytes
    assert 0 <= (sharded.state_bytes - sharded.param_bytes) - (3 * chunk + 4) <= 3 * 4 * 2 * 4  # < dp elements a bucket


def test_zero2_replay_holds_one_round_of_gradients_whatever_the_micro_batches(graph):
    """ZeRO-2 frees each micro-batch's gradients once reduced: the replayed gradient bytes at the
    peak are the same for 2 and 8 micro-batches, at most one round being made, one bucket in
    flight (fp32 flat copy) and the summed chunk."""
    dims = {"batch": 1, "seq": 8}
    held = []
    for m in (2, 8):
        r = predict_rank(graph, {**BASE, "dp": 2, "num_micro_batches": m, "micro_batch_size": 1,
                                 "zero_stage": 2}, 0, dims, cluster=local_cluster(2))
        chunk = 4 * (-(-r.param_bytes // 4 // 2))
        assert r.parts["grads"] <= 2 * r.param_bytes + chunk
        held.append(r.parts["grads"])
    assert held[0] == held[1]


def _cluster() -> Cluster:
    return dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=1)


def _write_run(tmp_path, plan, compute_factor: float, optimizer_factor: float, steps: int = 3):
    m = plan.num_micro_batches
    stage_t = plan.stages[0].time_s
    opt_t = plan.predicted.terms["optimizer"]
    rank_steps = [{"step": k, "rank": 0, "loss": 1.0, "wall_s": 1.0, "compute_s": compute_factor * stage_t * m,
                   "compute_by_stage_s": {"0": compute_factor * stage_t * m}, "recv_wait_s": 0.0,
                   "send_wait_s": 0.0, "p2p_post_s": 0.0, "collective_s": 0.0,
                   "optimizer_s": optimizer_factor * opt_t, "other_s": 0.0, "peak_memory_bytes": 1}
                  for k in range(steps)]
    rank_steps[0] = {**rank_steps[0], "compute_s": 100.0}  # the warm-up step is left out
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "measurements.json").write_text(json.dumps({"steps": [rank_steps]}))
    return tmp_path


def test_refit_moves_efficiency_towards_measurements(tmp_path):
    cluster = _cluster()
    profile = profile_model(GPT, dtype="fp32")
    plan = predict_step_time(profile, cluster, {**BASE, "micro_batch_size": 4, "num_micro_batches": 2},
                             global_batch=8)
    run = _write_run(tmp_path, plan, compute_factor=3.0, optimizer_factor=0.5)
    result = refit([load_run(run)], cluster)
    assert result.compute_ratio_before == pytest.approx(3.0, rel=1e-6)
    assert result.compute_ratio_after == pytest.approx(1.0, abs=0.02)
    # slower than predicted, in one run: a slower peak and a per-op overhead explain it
    # equally well, so the rates keep their measured values (refit.MIN_RATE_GAIN) and the
    # per-op overhead carries it all
    assert result.flops_scale == 1.0 and result.kernel_overhead_s > 0
    assert result.memory_bound_scale == pytest.approx(1.0)
    assert result.bandwidth_scale == pytest.approx(2.0, rel=0.01)  # faster optimizer: a faster stream
    dev = result.cluster.device  # ... for the optimizer alone: memory-bound nodes keep the measured bandwidth
    assert dev.memory_bandwidth_bytes_per_s == cluster.device.memory_bandwidth_bytes_per_s
    assert dev.optimizer_bytes_per_s == pytest.approx(2.0 * cluster.device.memory_bandwidth_bytes_per_s, rel=0.01)
    assert result.cluster.device.peak_flops.fp32 == pytest.approx(cluster.device.peak_flops.fp32 * result.flops_scale)
    out = tmp_path / "refit.yaml"
    again = refit_from_runs([tmp_path], cluster, out)
    assert Cluster.from_file(out).device.peak_flops.fp32 == pytest.approx(again.cluster.device.peak_flops.fp32)


def test_refit_names_missing_files(tmp_path):
    from partitioner.errors import ConfigError

    with pytest.raises(ConfigError, match="plan.json"):
        load_run(tmp_path)


# ---------------------------------------------------------------------------------------------
def _attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _param_bytes(gm, name) -> int:
    t = _attr(gm, name)
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Activation offload on CPU: the host copy and the reloaded copy are in the measured memory


def test_offload_events_add_a_host_copy_and_a_reload_per_offloaded_storage(graph):
    from partitioner.search.replay import stage_events

    plain = rank_program(graph, ParallelConfig(micro_batch_size=4), 0, cluster=local_cluster(1))
    offl = rank_program(graph, ParallelConfig(micro_batch_size=4, offload="activations"), 0, cluster=local_cluster(1))
    ev = stage_events(offl.modules[0], DIMS)
    base = stage_events(plain.modules[0], DIMS)
    host = {e.key: e.bytes for e in ev.forward if e.op == "+" and _copy(e.key) == "offload_host"}
    reload = {e.key: e.bytes for e in ev.backward if e.op == "+" and _copy(e.key) == "offload_reload"}
    assert host and len(host) == len(reload)  # CPU: one host copy and one reload per storage
    assert sorted(host.values()) == sorted(reload.values())
    freed = [e.key for e in ev.backward if e.op == "-" and _copy(e.key)]
    assert sorted(freed) == sorted([*host, *reload])  # every copy is released by its last backward
    # the copies hold what the un-offloaded graph keeps for backward (bytes saved at least once)
    assert sum(host.values()) <= base.activation_bytes + sum(reload.values())
    pred_off = predict_rank(graph, {**BASE, "offload": "activations"}, 0, DIMS, cluster=local_cluster(1))
    pred = predict_rank(graph, BASE, 0, DIMS, cluster=local_cluster(1))
    assert pred_off.peak_bytes > pred.peak_bytes  # on CPU offload costs memory: copies in the same RAM


def _copy(key) -> str | None:
    return key[0] if isinstance(key, tuple) and key and key[0] in ("offload_host", "offload_reload") else None


# ---------------------------------------------------------------------------------------------
# Refit of the per-kernel and per-message overheads


def _synthetic_run(path, plan, truth_plan, p2p_s=None, grad_norm_s=0.0):
    """A run directory whose measurements are exactly ``truth_plan``'s predictions (``grad_norm_s``:
    the gradient norm's all-reduce, which the runtime times as a collective, not in ``other_s``)."""
    path.mkdir(parents=True, exist_ok=True)
    m = plan.num_micro_batches
    ranks = []
    for rank in range(plan.world_size):
        stage = truth_plan.stages[rank // (plan.dp * plan.tp)]
        wait = truth_plan.predicted.terms.get("pp_comm", 0.0) + truth_plan.predicted.terms.get("bubble", 0.0)
        ranks.append([{"step": k, "rank": rank, "loss": 1.0, "wall_s": truth_plan.predicted.step_time_s,
                       "compute_s": stage.time_s * m, "compute_by_stage_s": {}, "recv_wait_s": wait,
                       "send_wait_s": 0.0, "p2p_post_s": 0.0, "collective_s": grad_norm_s,
                       "optimizer_s": truth_plan.predicted.terms["optimizer"],
                       "other_s": truth_plan.predicted.terms.get("framework", 0.0) - grad_norm_s,
                       "peak_memory_bytes": 1} for k in range(3)])
    (path / "plan.json").write_text(plan.to_json())
    (path / "measurements.json").write_text(json.dumps({"steps": ranks}))
    return path


def _synthetic_runs(tmp_path, profile, cluster, truth, knob_list):
    """One run directory per knobs of ``knob_list``: what ``cluster`` plans, measured as ``truth`` predicts."""
    from partitioner.search.plan_cost import scalar_all_reduce_time

    runs = []
    for k, knobs in enumerate(knob_list):
        gb = knobs["dp"] * knobs["micro_batch_size"] * knobs["num_micro_batches"]
        plan = predict_step_time(profile, cluster, knobs, global_batch=gb)
        true = predict_step_time(profile, truth, knobs, global_batch=gb)
        runs.append(load_run(_synthetic_run(tmp_path / str(k), plan, true,
                                            grad_norm_s=scalar_all_reduce_time(truth) + truth.step_end_wait_s)))
    return runs


def test_refit_recovers_kernel_overhead_and_pipeline_message_seconds(tmp_path):
    from partitioner.calibration.refit import _scaled

    cluster = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=2)
    truth = _scaled(cluster, 0.5, 1.0)
    truth = dataclasses.replace(truth, p2p_latency_s=2e-3,
                                device=dataclasses.replace(truth.device, kernel_overhead_s=4e-5))
    profile = profile_model(GPT, dtype="fp32")
    # micro-batch sizes 1 and 4 and two stage depths: kernels and FLOPs scale differently
    runs = _synthetic_runs(tmp_path, profile, cluster, truth, [
        {**BASE, "pp": 2, "micro_batch_size": 1, "num_micro_batches": 4},
        {**BASE, "pp": 2, "micro_batch_size": 4, "num_micro_batches": 2},
        {**BASE, "dp": 2, "micro_batch_size": 4, "num_micro_batches": 1}])
    result = refit(runs, cluster)
    assert result.kernel_overhead_s == pytest.approx(4e-5, rel=0.05)
    assert result.flops_scale == pytest.approx(0.5, rel=0.05)
    assert result.p2p_latency_s == pytest.approx(2e-3, rel=0.05)
    assert result.sync_latency_scale is None  # no tensor-parallel run: one latency for every collective
    assert result.compute_ratio_after == pytest.approx(1.0, abs=0.02)
    # the fitted fields survive the cluster file
    out = tmp_path / "refit.yaml"
    result.cluster.to_file(out)
    back = Cluster.from_file(out)
    assert back.device.kernel_overhead_s == pytest.approx(result.kernel_overhead_s)
    assert back.p2p_latency_s == pytest.approx(result.p2p_latency_s)


def test_refit_tells_step_end_collectives_from_tensor_parallel_ones(tmp_path):
    """Runs made by a cluster whose links' α is 2x the one refitted and whose step-end
    collectives (gradient reduction, tied sync, loss all-reduce) pay 4x that again: the refit
    finds both, the first from the tp run, the second from the runs without tp."""
    cluster = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=2)
    alpha = cluster.intra_node.latency_s * 64  # large enough for the collectives to matter
    cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node, latency_s=alpha),
                                  inter_node=dataclasses.replace(cluster.inter_node, latency_s=alpha))
    truth = dataclasses.replace(cluster, sync_latency_scale=4.0,
                                intra_node=dataclasses.replace(cluster.intra_node, latency_s=2 * alpha),
                                inter_node=dataclasses.replace(cluster.inter_node, latency_s=2 * alpha))
    profile = profile_model(GPT, dtype="fp32")
    runs = _synthetic_runs(tmp_path, profile, cluster, truth, [
        {**BASE, "pp": 2, "micro_batch_size": 1, "num_micro_batches": 4},
        {**BASE, "dp": 2, "micro_batch_size": 4, "num_micro_batches": 1, "zero_stage": 1},
        {**BASE, "tp": 2, "micro_batch_size": 4, "num_micro_batches": 1}])
    result = refit(runs, cluster)
    assert result.sync_latency_scale == pytest.approx(4.0)
    assert result.latency_scale == pytest.approx(2.0)
    assert result.step_log_error == pytest.approx(0.0, abs=0.01)
    assert Cluster.from_dict(result.cluster.to_dict()).sync_latency_scale == pytest.approx(4.0)
    # without it (the link's α for every collective) the runs without tp are predicted too fast
    one = dataclasses.replace(result.cluster, sync_latency_scale=None)
    errors = [abs(predict_step_time(profile, one, dict(r.plan.knobs()), global_batch=r.plan.global_batch)
                  .predicted.step_time_s / r.step_s[0] - 1) for r in runs]
    assert max(errors) > 0.05


def test_refit_recovers_a_fixed_wait_per_step_end_call(tmp_path):
    """Runs whose step end pays a fixed 2 ms per synchronising call (``Cluster.step_end_wait_s``)
    on top of a step overhead: a ZeRO-1 run (its bucket's reduce-scatter and all-gather, the
    gradient norm, the loss) and pipelined ones (the tied sum, the norm, the loss). The refit
    recovers the wait inside its bounds and fits every run; a multiplier of the α alone cannot."""
    from partitioner.calibration.refit import STEP_END_WAIT_BOUNDS, _scaled

    cluster = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=2)
    truth = _scaled(cluster, 0.5, 1.0)
    truth = dataclasses.replace(truth, step_end_wait_s=2e-3, device=dataclasses.replace(
        truth.device, kernel_overhead_s=4e-5, step_overhead_s=1e-3))
    profile = profile_model(GPT, dtype="fp32")
    knob_list = [{**BASE, "dp": 2, "micro_batch_size": 4, "num_micro_batches": 1, "zero_stage": 1},
                 {**BASE, "pp": 2, "micro_batch_size": 1, "num_micro_batches": 4},
                 {**BASE, "pp": 2, "micro_batch_size": 4, "num_micro_batches": 2}]
    runs = _synthetic_runs(tmp_path, profile, cluster, truth, knob_list)
    result = refit(runs, cluster)
    assert STEP_END_WAIT_BOUNDS[0] <= result.step_end_wait_s <= STEP_END_WAIT_BOUNDS[1]
    assert result.step_end_wait_s == pytest.approx(2e-3, rel=0.05)
    assert result.step_overhead_s == pytest.approx(1e-3, rel=0.1)
    for run in runs:  # the ZeRO-1 run and the pipelined ones alike
        predicted = predict_step_time(profile, result.cluster, dict(run.plan.knobs()),
                                      global_batch=run.plan.global_batch).predicted.step_time_s
        assert predicted == pytest.approx(run.step_s[0], rel=0.01)
    assert "2 ms a call" in result.overheads_text()
    assert Cluster.from_dict(result.cluster.to_dict()).step_end_wait_s == pytest.approx(result.step_end_wait_s)
    # the same runs without the wait (its bound 0): the multiplier alone leaves one kind off
    import partitioner.calibration.refit as refit_module

    original = refit_module.STEP_END_WAIT_BOUNDS
    refit_module.STEP_END_WAIT_BOUNDS = (0.0, 0.0)
    try:
        alone = refit(runs, cluster)
    finally:
        refit_module.STEP_END_WAIT_BOUNDS = original
    errors = [abs(predict_step_time(profile, alone.cluster, dict(r.plan.knobs()), global_batch=r.plan.global_batch)
                  .predicted.step_time_s / r.step_s[0] - 1) for r in runs]
    assert max(errors) > 0.02


def test_refit_recovers_step_overhead_and_offload_call_seconds(tmp_path):
    from partitioner.calibration.refit import _scaled

    cluster = dataclasses.replace(Cluster.preset("local-cpu"), devices_per_node=2)
    truth = _scaled(cluster, 0.5, 1.0)
    truth = dataclasses.replace(truth, device=dataclasses.replace(
        truth.device, kernel_overhead_s=4e-5, step_overhead_s=3e-3, offload_call_s=2e-4))
    profile = profile_model(GPT, dtype="fp32")
    runs = _synthetic_runs(tmp_path, profile, cluster, truth, [
        {**BASE, "pp": 2, "micro_batch_size": 1, "num_micro_batches": 4},
        {**BASE, "dp": 2, "micro_batch_size": 4, "num_micro_batches": 1},
        {**BASE, "pp": 2, "micro_batch_size": 2, "num_micro_batches": 2, "offload": "activations"},
        {**BASE, "pp": 2, "micro_batch_size": 2, "num_micro_batches": 2, "checkpointing": "full"}])
    result = refit(runs, cluster)
    assert result.step_overhead_s == pytest.approx(3e-3, rel=0.05)
    assert result.offload_call_s == pytest.approx(2e-4, rel=0.05)
    assert result.cluster.device.step_overhead_s == result.step_overhead_s
    for run in runs:  # with every term recovered the step times are the truth's
        again = predict_step_time(profile, result.cluster, dict(run.plan.knobs()), global_batch=run.plan.global_batch)
        assert again.predicted.step_time_s == pytest.approx(run.step_s[0], rel=0.03)
    back = Cluster.from_dict(result.cluster.to_dict())
    assert back.device.offload_call_s == pytest.approx(2e-4, rel=0.05)


def test_overheads_default_to_zero_and_leave_presets_unchanged():
    c = Cluster.preset("local-cpu")
    assert c.device.kernel_overhead_s == 0.0 and c.p2p_latency_s is None
    assert c.device.step_overhead_s == 0.0 and c.device.offload_call_s == 0.0
    assert not {"kernel_overhead_s", "step_overhead_s", "offload_call_s"} & set(c.to_dict()["device"])
    assert "p2p_latency_s" not in c.to_dict()
    with pytest.raises(Exception, match="step_overhead_s must be >= 0"):
        dataclasses.replace(c.device, step_overhead_s=-1.0)


def test_offload_of_checkpointed_regions_costs_memory_on_cpu(graph):
    # On CPU the "host" copy of a region's input lives in the same memory, and backward reloads
    # it for the recompute: the replay must not see a saving (it did, when the offload hooks hid
    # the recompute's saves from the memory pass).
    ckpt = predict_rank(graph, {**BASE, "checkpointing": "full"}, 0, DIMS, cluster=local_cluster(1))
    both = predict_rank(graph, {**BASE, "checkpointing": "full", "offload": "activations"}, 0, DIMS, cluster=local_cluster(1))
    assert both.peak_bytes >= ckpt.peak_bytes


def test_fake_runs_leave_no_offload_state_behind(graph):
    # the replay runs the offload hooks on fake tensors: nothing of it may stay in the registry
    # the real hooks share host copies through (it made every later real offload 2-3x slower)
    import runtime.kernels.offload as oo

    oo.reset_offload_counters()
    alive = sum(v() is not None for v in oo._LIVE.values())
    predict_rank(graph, {**BASE, "offload": "activations"}, 0, DIMS, cluster=local_cluster(1))
    assert sum(v() is not None for v in oo._LIVE.values()) == alive
    assert oo.offload_counters().offloaded_storages == 0
