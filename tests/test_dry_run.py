"""The dry run: a 16-rank job's distinct rank programs run here, on fake tensors and a fake group."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from partitioner import Training
from partitioner.api.dry_run import Collective, RankRun, check_sequences, dry_run, representatives
from passes.ir.config import ParallelConfig
from runtime.kernels.collectives import get_group, register_group
from tests.memory_devices import NOTHING_HELD_BACK

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
FIX = "dp=4,tp=2,pp=2"
TRAINING = Training(global_batch=16)


@pytest.fixture(scope="module")
def plan():
    from partitioner.api.planning import plan as make_plan

    return make_plan(MODEL, "dgx-h100", nodes=2, training=TRAINING, fix=FIX)


def test_representatives_stand_for_every_rank():
    config = ParallelConfig.for_global_batch(16, dp=4, tp=2, pp=2)
    reps = representatives(config)
    assert reps == {0: (0, 2, 4, 6), 1: (1, 3, 5, 7), 8: (8, 10, 12, 14), 9: (9, 11, 13, 15)}
    cp = ParallelConfig.for_global_batch(8, dp=2, cp=2, tp=2)
    assert representatives(cp) == {0: (0, 4), 1: (1, 5), 2: (2, 6), 3: (3, 7)}  # cp ranks differ, replicas not


def test_sixteen_ranks_run_and_agree(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan)
    assert report.world_size == 16 and report.ok, report.text()
    assert sorted(m for r in report.ranks for m in r.stands_for) == list(range(16))
    by_rank = {r.rank: r for r in report.ranks}
    assert sorted(by_rank) == [0, 1, 8, 9]
    for a, b in ((0, 1), (8, 9)):  # the tp peers issue the same collectives on their tp group
        calls = [[c.key() for c in by_rank[r].collectives if c.group == (a, b)] for r in (a, b)]
        assert calls[0] == calls[1] and any(k[0] == "reduce_scatter" for k in calls[0])
    for r in report.ranks:  # the data-parallel gradient all-reduce runs over the rank's 4 replicas
        assert any(c.op == "all_reduce" and c.group == r.stands_for for c in r.collectives)
    sends = [c for c in by_rank[0].collectives if c.op == "send"]
    assert sends and sends[0].peer == 8
    assert "rank 9 (pp=1 tp=1 cp=0) for ranks (9, 11, 13, 15): OK" in report.text()


class _SkipFirstAllReduce:
    """A tp group that skips its first all-reduce (a collective missing on one rank)."""

    def __init__(self, inner):
        self.inner, self.skipped = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, t, op):
        if not self.skipped:
            self.skipped = True
            return t.clone()
        return self.inner.all_reduce(t, op)


def _on_tp_rank_1(wrap):
    """An edit of the dry run that plants ``wrap`` around tp rank 1's tp group (a planted bug)."""
    def plant(rank, model):
        if rank == 1:
            register_group(model.tp_group_name, wrap(get_group(model.tp_group_name)))
    return plant


def test_a_collective_missing_on_one_tp_rank_is_named(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0, 1),
                     edit=_on_tp_rank_1(_SkipFirstAllReduce))
    assert all(r.ok for r in report.ranks) and not report.ok
    assert len(report.mismatches) == 1, report.mismatches
    message = report.mismatches[0]
    assert message.startswith("group (0, 1): call ") and "rank 0 all_reduce" in message and "rank 1 " in message


def test_a_rank_that_raises_is_named_and_the_cli_fails(plan, tmp_path, monkeypatch, capsys):
    from partitioner.cli.main import main
    from runtime.exec.parallel_model import ParallelModel

    real = ParallelModel.train_step

    def train_step(self, batch):
        if self.mesh.rank == 9:
            raise RuntimeError("planted failure")
        return real(self, batch)

    monkeypatch.setattr(ParallelModel, "train_step", train_step)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    code = main(["dry-run", "--plan", str(path), "--cluster", "dgx-h100", "--nodes", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "rank 9 (pp=1 tp=1 cp=0) for ranks (9, 11, 13, 15): FAILED: RuntimeError: planted failure" in out
    assert "rank 0 (pp=0 tp=0 cp=0) for ranks (0, 2, 4, 6): OK" in out


def test_a_compiled_plan_is_refused_before_any_planning(plan, monkeypatch):
    """The dry run executes the uncompiled programs: a plan with compile=true (pinned, or given) is
    refused, naming the way out, before the planner runs."""
    import partitioner.api.dry_run as module
    from passes.ir.errors import ConfigError

    monkeypatch.setattr(module, "make_plan", lambda *a, **k: pytest.fail("planned a refused dry run"))
    with pytest.raises(ConfigError, match="compile=true cannot be dry-run yet.*compile=false"):
        dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, fix=FIX + ",compile=true")
    compiled = dataclasses.replace(plan, config=plan.config.replace(compile=True, schedule="1f1b"))
    with pytest.raises(ConfigError, match="compile=true cannot be dry-run yet"):
        dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=compiled)


def test_a_rank_whose_peak_exceeds_the_device_is_out_of_memory(plan):
    """The dry run says where the job would run out of memory: a rank whose peak is above what
    the device leaves the plan (its memory less the CUDA context, NCCL's buffers and the
    allocator's slack) fails the report, naming the rank, its peak and that budget."""
    from partitioner.cost.cluster import Cluster
    from partitioner.cost.device_memory import memory_budget

    big = Cluster.preset("dgx-h100", nodes=2)
    report = dry_run(MODEL, big, training=TRAINING, plan=plan, ranks=(0,))
    assert report.ok and "OUT OF MEMORY" not in report.text()
    peak = report.ranks[0].peak_bytes
    # the peak fits the device's memory, but not beside what a GPU process holds besides its tensors
    held = dataclasses.replace(big, device=dataclasses.replace(big.device, memory_bytes=peak + 2**20))
    assert report.ranks[0].peak_bytes < held.device.memory_bytes
    report = dry_run(MODEL, held, training=TRAINING, plan=plan, ranks=(0,))
    assert not report.ok and not report.ranks[0].fits and report.ranks[0].ok
    assert report.ranks[0].device_bytes == memory_budget(held, plan.config.communicators).usable_bytes
    assert f"OUT OF MEMORY: rank 0 (for ranks (0, 2, 4, 6)) peaks at {peak / 2**30:.2f} GiB" in report.text()
    # with nothing held back, the device's memory itself is the limit: one byte short of the peak
    bare = dataclasses.replace(big, device=dataclasses.replace(big.device, memory_bytes=peak - 1, **NOTHING_HELD_BACK))
    report = dry_run(MODEL, bare, training=TRAINING, plan=plan, ranks=(0,))
    assert not report.ok and report.ranks[0].device_bytes == peak - 1


def test_messages_are_matched_by_shape():
    send = Collective("send", (0, 2), (4, 8), "torch.float32", peer=2, group_id="5")
    recv = Collective("recv", (0, 2), (4, 16), "torch.float32", peer=0, group_id="5")
    runs = [RankRun(0, (0,), 0, 0, 0, ok=True, collectives=[send]),
            RankRun(2, (2,), 1, 0, 0, ok=True, collectives=[recv])]
    (problem,) = check_sequences(runs)
    assert problem == ("messages rank 0 -> rank 2 on (0, 2): message 0 is [4, 8] float32 as sent and "
                       "[4, 16] float32 as received (1 sent, 1 received)")


def test_messages_match_in_order_within_each_communicator():
    """Two groups over the same ranks are two communicators (the zero-bubble V schedule sends its
    forward and backward messages on two): each keeps its own order, as on NCCL."""
    act_f = Collective("send", (0, 2), (1, 4, 8), "torch.bfloat16", peer=2, group_id="5")
    rope_f = Collective("send", (0, 2), (4, 2), "torch.float32", peer=2, group_id="5")
    grad_b = Collective("send", (0, 2), (1, 4, 8), "torch.bfloat16", peer=2, group_id="6")

    def recv(c):
        return dataclasses.replace(c, op="recv", peer=0)

    runs = [RankRun(0, (0,), 0, 0, 0, ok=True, collectives=[grad_b, act_f, rope_f]),
            RankRun(2, (2,), 1, 0, 0, ok=True, collectives=[recv(act_f), recv(rope_f), recv(grad_b)])]
    assert check_sequences(runs) == []
    runs[1].collectives = [recv(rope_f), recv(act_f), recv(grad_b)]  # out of order within group "5"
    (problem,) = check_sequences(runs)
    assert problem.startswith("messages rank 0 -> rank 2 on (0, 2): message 0 is [1, 4, 8] bfloat16 as sent and "
                              "[4, 2] float32 as received")


def test_a_zero_bubble_v_plan_of_a_rope_model_runs_and_agrees():
    """Llama's rotary tables cross every stage boundary beside the activations, on the forward
    stream, while the gradients come back on the backward one. The first pipeline rank holds the
    first and the last stage: the LM head's gradient bucket (one bucket of its own, as the
    embedding's) launches first, where backward makes its gradient, not in parameter order."""
    report = dry_run("llama:layers=4,hidden=1024,heads=8,kv_heads=4,intermediate=2816,vocab=32000,seq=64",
                     "dgx-h100", nodes=1, training=Training(global_batch=8),
                     fix="tp=2,pp=2,dp=2,schedule=zbv,virtual_pp=2,num_micro_batches=4")
    assert report.ok, report.text()
    assert len(report.ranks) == 4 and all(r.static_calls > 0 for r in report.ranks)


def test_zero_bubble_buckets_launch_in_the_order_the_check_predicts():
    """A split backward's weight half (W) under ZeRO-1, with a bucket per layer norm (ZeRO cuts
    its chunks where weight decay changes) between the matmuls' buckets: W accumulates in reverse
    parameter order, bucket by bucket, as the check predicts (one backward from every weight
    edge would accumulate the norms first, in the autograd engine's heap order)."""
    report = dry_run("gpt:layers=4,hidden=4096,heads=8,vocab=1024,seq=16", "dgx-h100", nodes=1,
                     training=Training(global_batch=8), ranks=(0,),
                     fix="tp=2,pp=2,dp=2,schedule=zbv,virtual_pp=2,num_micro_batches=4,zero_stage=1")
    assert report.ok and not report.ranks[0].static, report.text()
    sizes = {c.numel for c in report.ranks[0].collectives if c.op.startswith("reduce_scatter")}
    assert len(sizes) > 2  # norms' and matmuls' buckets apart: an order to get right


def test_a_zero_bubble_zero1_plans_peak_is_the_dry_runs():
    """The replay of a split backward as the runtime runs it: W holds the micro-batch's graph and
    every weight gradient it makes until it returns, and under ZeRO-1 the buckets its hooks launch
    hold their flat fp32 copies beside the chunks until the ALL_REDUCE (the replay counted one
    gradient and one bucket at a time: 27.7% under the dry run here)."""
    report = dry_run("gpt:layers=4,hidden=2048,heads=16,vocab=1024,seq=512", "dgx-h100", nodes=1,
                     training=Training(global_batch=8), ranks=(0,),
                     fix="pp=2,dp=2,schedule=zb1p,num_micro_batches=4,zero_stage=1")
    assert report.ok, report.text()
    assert abs(report.ranks[0].memory_difference) <= 0.05, report.text()


# --- the recorded calls against the communication check's prediction ----------------------------

def test_every_rank_issues_the_calls_the_communication_check_predicts(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0, 8))
    assert report.ok, report.text()
    for r in report.ranks:
        assert r.static == [] and r.static_calls == len([c for c in r.collectives[r.step_starts[0]:]])
    assert "(19 calls as the communication check predicts)" in report.text()


def test_a_rank_that_differs_from_the_prediction_is_named_with_both_sides(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(1,),
                     edit=_on_tp_rank_1(_SkipFirstAllReduce))
    (message,) = report.static_mismatches
    assert message == ("rank 1 step 0: collective 13 (call 15 of its log) runs all_reduce(sum) of 1216 bfloat16 on "
                       "(1, 3, 5, 7); the communication check predicts all_reduce(sum) of 192 bfloat16 on (0, 1) "
                       "(sequence-parallel grads (6 params)) (16 run, 17 predicted)")
    assert "STATIC MISMATCH: rank 1 step 0: collective 13" in report.text() and not report.ok


def test_a_call_the_check_does_not_model_is_noted_not_a_mismatch(plan):
    import torch.distributed as dist

    def plant(rank, model):
        real = model.train_step

        def train_step(batch):
            dist.barrier()  # a synchronisation point the runtime may add: the check has no barriers
            return real(batch)
        model.train_step = train_step

    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0,), edit=plant)
    assert report.ok, report.text()
    (note,) = report.ranks[0].static_notes
    assert note.startswith("step 0 call 0: barrier [] object on 0..15: a barrier") and "does not model it" in note
    assert "not compared: barrier [] object on 0..15: a barrier" in report.text()


# --- the strict fake group: what NCCL refuses --------------------------------------------------

class _OnMeta(_SkipFirstAllReduce):
    """A tp group whose first all-reduce carries a tensor on another device (the meta device here;
    a CPU tensor in a CUDA job)."""

    def all_reduce(self, t, op):
        if not self.skipped:
            self.skipped = True
            return self.inner.all_reduce(t.to("meta"), op).to(t.device)
        return self.inner.all_reduce(t, op)


class _InFloat32(_SkipFirstAllReduce):
    """A tp group whose first all-reduce runs in float32 (its peer's in bfloat16)."""

    def all_reduce(self, t, op):
        if not self.skipped:
            self.skipped = True
            return self.inner.all_reduce(t.float(), op).to(t.dtype)
        return self.inner.all_reduce(t, op)


def test_a_tensor_off_the_jobs_device_is_refused_naming_rank_and_call(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(1,),
                     edit=_on_tp_rank_1(_OnMeta))
    (run,) = report.ranks
    assert not run.ok and not report.ok
    assert run.error.startswith("StrictGroupError: rank 1 call 15 (all_reduce [192] bfloat16 on (0, 1)): "), run.error
    assert "a meta tensor of shape [192]" in run.error and "of a cpu job; NCCL refuses it" in run.error


def test_a_cuda_job_refuses_the_cpu_tensors(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0,), job_device="cuda")
    (run,) = report.ranks
    assert not run.ok and run.error.startswith("StrictGroupError: rank 0 call 0 (")
    assert "a cpu tensor of shape" in run.error and "of a cuda job; NCCL refuses it" in run.error


def test_a_collective_of_another_dtype_on_one_rank_is_refused(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0, 1),
                     edit=_on_tp_rank_1(_InFloat32))
    assert all(r.ok for r in report.ranks) and not report.ok
    (message,) = report.mismatches
    assert message == ("group (0, 1): call 11 (all_reduce) differs in size or dtype, which NCCL refuses: rank 0 "
                       "all_reduce [192] bfloat16 on (0, 1) (call 15 of its log), rank 1 all_reduce [192] float32 on "
                       "(0, 1) (call 15 of its log)")


def test_a_send_without_its_receive_is_refused():
    send = Collective("send", (0, 2), (4, 8), "torch.float32", peer=2, group_id="5")
    other = Collective("all_reduce", (0, 1), (4,), "torch.float32", group_id="3")
    runs = [RankRun(0, (0,), 0, 0, 0, ok=True, collectives=[other, send, send]),
            RankRun(2, (2,), 1, 0, 0, ok=True, collectives=[Collective("recv", (0, 2), (4, 8), "torch.float32",
                                                                          peer=0, group_id="5")])]
    (problem,) = check_sequences(runs)
    assert problem == ("rank 0 call 2: send [4, 8] float32 to rank 2 on (0, 2) has no matching receive on rank 2 by "
                       "the end of the step (message 1; 2 sent, 1 received)")
    runs[0].collectives = [other]
    (problem,) = check_sequences(runs)
    assert problem.startswith("rank 2 call 0: receive [4, 8] float32 from rank 0 on (0, 2) has no matching send")


# --- memory ------------------------------------------------------------------------------------

def test_allocator_rounding():
    from partitioner.api.dry_run import allocator_bytes

    assert [allocator_bytes(n) for n in (0, 1, 512, 513, 2**20)] == [0, 512, 512, 1024, 2**20]
    assert allocator_bytes(2**20 + 1) == 2 * 2**20 and allocator_bytes(5 * 2**20) == 6 * 2**20


def test_live_bytes_counts_storages_alive_once_and_keeps_the_peak():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partitioner.api.dry_run import LiveBytes

    memory = LiveBytes()
    with FakeTensorMode(), memory:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes -> 4096
        view = a[:10]  # its storage: counted once
        b = a * 2
        del b  # freed: the peak stays, what is alive goes down
        c = torch.empty(100)  # 400 -> 512
        del view
    assert memory.peak == 4096 + 4096
    memory._sweep()
    assert memory.total == 4096 + 512
    assert sorted(memory.largest(2)) == ["0.00 MiB: empty.memory_format -> [1000] float32",
                                         "0.00 MiB: mul.Tensor -> [1000] float32"]
    del a, c


def test_host_storages_and_what_is_made_of_them_alone_are_not_device_memory():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partitioner.api.dry_run import LiveBytes

    memory = LiveBytes()
    with FakeTensorMode(), memory:
        master = torch.empty(1000)  # 4096: counted as it is made, then named host memory
        param = torch.empty(1000)  # 4096
        memory.on_host([master])
        assert memory.total == memory.peak == 4096
        step = master * 0.9 + 1.0  # a host optimizer's temporaries: host alone in, host out
        param.copy_(step)  # in place on the device parameter: nothing new
        grad = param * 2  # device in, device out: 4096
        master.copy_(grad)  # the host buffer stays host
    assert memory.peak == 8192
    del master, param, step, grad


def test_a_host_copy_told_right_after_it_is_made_undoes_the_peak_it_made():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partitioner.api.dry_run import LiveBytes

    memory = LiveBytes()
    with FakeTensorMode(), memory:
        saved = torch.empty(1000)  # 4096 on the device
        copy = saved.clone()  # 8192: a peak, until it is told to be a host copy
        memory.host_copy(copy)
        assert (memory.total, memory.peak) == (4096, 4096)
        other = torch.empty(2000)  # 8192 + 4096: a peak of device memory alone
    assert memory.peak == 12288 and len(memory.largest(3)) == 2  # the host copy is not listed
    del saved, copy, other


@pytest.mark.parametrize("offload", ["optimizer", "activations"])
def test_what_offload_moves_to_the_host_is_not_in_the_device_peak(offload):
    """At a shape whose tensors are not mostly a few hundred bytes: the dry run rounds every
    storage as the caching allocator does (512 bytes at least), the plan does not, which at
    :data:`MODEL` alone is over 5%."""
    from partitioner.api.dry_run import MEMORY_TOLERANCE

    report = dry_run("gpt:layers=2,hidden=128,heads=4,vocab=256,seq=32", "dgx-h100", nodes=1, training=TRAINING,
                     fix=f"dp=2,tp=2,pp=2,offload={offload},checkpointing=none", ranks=(0,))
    assert report.ok and not report.static_mismatches, report.text()
    (r,) = report.ranks
    assert abs(r.memory_difference) <= MEMORY_TOLERANCE, report.text()


def test_each_rank_has_its_peak_against_the_plans(plan, monkeypatch):
    from partitioner.api import dry_run as module

    monkeypatch.setattr(module, "MEMORY_TOLERANCE", 0.0)  # list the tensors at every rank's peak
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0, 9))
    assert report.ok, report.text()
    for r in report.ranks:
        assert r.peak_bytes > 0 and r.predicted_bytes > 0 and r.memory_difference is not None
        assert len(r.peak_tensors) == 8 and " MiB: " in r.peak_tensors[0]
    text = report.text()
    assert "memory: peak bytes of each rank" in text
    assert f"{100 * report.ranks[1].memory_difference:+.1f}%" in text
    assert "rank 9's peak differs from the plan's by more than 0%; its largest tensors alive then" in text


# --- plans whose prediction the dry run corrected ------------------------------------------------

@pytest.mark.parametrize("fix,nodes,ranks", [
    # a checkpointed region's recompute re-runs the ring shifts in backward: on the cp group
    ("dp=2,tp=2,pp=1,cp=2,cp_mode=ring,checkpointing=full", 1, (0, 3)),
    # dp bucket 0 completes inside the last backward, before all_gather_seq's reduce-scatter
    ("dp=2,tp=2,pp=2,cp=4,cp_mode=ring,schedule=1f1b", 4, (0, 16)),
], ids=["cp2-ckpt-full", "tp2-pp2-cp4-ring"])
def test_cp_plans_run_the_calls_the_communication_check_predicts(fix, nodes, ranks):
    report = dry_run("gpt:layers=4,hidden=32,heads=4,vocab=64,seq=32", "dgx-h100", nodes=nodes,
                     training=Training(global_batch=8), fix=fix, ranks=ranks)
    assert report.ok and not report.static_mismatches, report.text()
    assert sorted(r.rank for r in report.ranks) == list(ranks)
    for r in report.ranks:
        assert r.static == [] and r.static_calls > 0


@pytest.mark.parametrize("fix", [
    "dp=8,tp=1,pp=1,zero_stage=3",
    "dp=4,tp=2,pp=1,zero_stage=3",
    "dp=2,tp=2,pp=2,offload=activations,checkpointing=none",
    # the offloaded saves of a checkpointed region's nodes set where its recompute stops
    "dp=2,tp=2,pp=2,offload=activations,checkpointing=full,sequence_parallel=true",
    # a split backward's weight half recomputes each checkpointed region again, tp collectives included
    "dp=2,tp=2,pp=2,checkpointing=full,schedule=zb1p,sequence_parallel=false",
    "dp=2,tp=2,pp=2,checkpointing=full,schedule=zb1p,sequence_parallel=true,zero_stage=1",
], ids=["zero3-dp8", "zero3-tp2", "offload-activations", "offload-activations-ckpt-full-sp", "zb1p-ckpt-full", "zb1p-ckpt-full-sp-zero1"])
def test_zero3_offload_and_checkpointed_zero_bubble_plans_of_eight_ranks_run_as_predicted(fix):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = dry_run(MODEL, "dgx-h100", nodes=1, training=TRAINING, fix=fix, ranks=(0,))
    assert not [w for w in caught if "data pointer" in str(w.message)]  # no runtime code reads a fake address
    assert report.world_size == 8 and report.ok and not report.static_mismatches, report.text()
    (r,) = report.ranks
    assert r.static == [] and r.static_calls > 0


@pytest.mark.parametrize("zero", [0, 2])
def test_ep_plans_run_the_calls_the_communication_check_predicts(zero):
    """Expert parallelism (ep=2 of dp=4, so each expert on two ranks whose gradient buckets launch
    from backward hooks) with a pipeline and two micro-batches: the ep dispatch and combine, the
    load-balancing loss's averages over the data axis (the count of chosen experts carries no
    gradient: no backward call) and the expert buckets run as the communication check predicts;
    under ZeRO-2 those buckets reduce-scatter after each backward over the two ranks holding the
    same experts, and the updated chunks are gathered over them."""
    report = dry_run("moe:layers=2,hidden=32,heads=4,vocab=64,seq=16,experts=4,top_k=2,expert_hidden=32,dropout=0.0",
                     "dgx-h100", nodes=1, training=Training(global_batch=8),
                     fix=f"dp=4,ep=2,tp=1,pp=2,num_micro_batches=2,zero_stage={zero}", ranks=(0, 4))
    assert report.ok and not report.static_mismatches, report.text()
    for r in report.ranks:
        assert r.static == [] and r.static_calls > 0
        groups = {c.group for c in r.collectives}
        assert (r.rank, r.rank + 1) in groups  # the ep group: two consecutive ranks of the data axis
        replicas = (r.rank, r.rank + 2)  # the ranks holding the same experts
        ops = {c.op.split("(")[0] for c in r.collectives if c.group == replicas}
        assert ops == ({"reduce_scatter", "all_gather"} if zero else {"all_reduce"}), ops


def test_stacked_expert_plans_run_the_calls_the_communication_check_predicts():
    """Hugging Face Qwen3-MoE (stacked experts) at ep=4 of dp=8: the rows, ids and combine weights
    gathered, the weighted rows scattered back, each rank holding its rows of the experts."""
    pytest.importorskip("transformers")
    report = dry_run("hf-qwen3-moe:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
                     "vocab_size=64,num_experts=4,num_experts_per_tok=2,moe_intermediate_size=48,seq=16",
                     "dgx-h100", nodes=1, training=Training(global_batch=8), fix="dp=8,ep=4,tp=1,pp=1", ranks=(0, 5))
    assert report.ok and not report.static_mismatches, report.text()
    for r in report.ranks:
        assert r.static == [] and r.static_calls > 0
        first = r.rank - r.rank % 4  # the ep group: four consecutive ranks of the data axis
        assert tuple(range(first, first + 4)) in {c.group for c in r.collectives}


def test_a_ranks_run_leaves_nothing_behind(plan, monkeypatch):
    """Each representative's fake model is freed after its step and torch's dispatch cache does
    not grow with the process group's calls: a 96-rank dry run would otherwise hold every rank's
    model (about 50 MB each for GPT-3 175B) to its end."""
    import gc
    import warnings

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from partitioner.api import dry_run as module

    programs = {}
    real = module.run_rank

    def keep(program, spec, **kw):
        programs[program.rank] = (program, spec, kw)
        return real(program, spec, **kw)

    monkeypatch.setattr(module, "run_rank", keep)
    dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0,))
    program, spec, kw = programs[0]

    def alive() -> tuple[int, int]:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch.distributed.reduce_op warns of its deprecation
            warnings.simplefilter("ignore", FutureWarning)
            return sum(isinstance(o, FakeTensor) for o in gc.get_objects()), len(FakeTensorMode.cache)

    before = alive()
    for _ in range(2):
        assert real(program, spec, **kw).ok
    assert alive() == before
