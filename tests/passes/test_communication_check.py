"""The pre-launch communication check (passes/checks/communication_check.py) on real lowered programs.

Plans of small models pass; copies of their rank programs broken the ways that hang real jobs
(a missing receive, swapped tp collectives, a dp bucket of another size, a dtype mismatch, a
tied-weight sync on one stage only, a rank with one micro-batch less) are caught with the group,
the ranks, the calls and a grid in the message; and the calls the check derives for a rank are
the ones the runtime issues, recorded from a real ``train_step`` on torch's fake process group
(one process plays one rank; the collectives move no data).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from partitioner.compile.build import capture_for_pipeline, lower_plan
from partitioner.inputs.models import build_model
from passes.checks.communication_check import (
    CommunicationMismatchError,
    check_communication,
    check_lowering,
    format_call_grid,
    rank_calls,
)
from passes.ir.config import ParallelConfig
from passes.ir.errors import ConfigError
from passes.ir.grad_buckets import GradSlot, bucket_layout
from passes.ir.ops import op_name
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GPT4 = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GPT_HEADS4 = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=8,dropout=0.0"  # Ulysses: heads % (tp * cp) == 0
LLAMA = "llama:layers=2,hidden=32,heads=2,kv_heads=1,vocab=64,seq=8"
GRID_MARK = "<- first disagreement"


@functools.cache
def _graph(model: str):
    return capture_for_pipeline(build_model(model))


@functools.cache
def _lowering(model: str, global_batch: int = 8, **knobs):
    config = ParallelConfig.for_global_batch(global_batch, **{"schedule": "1f1b", "num_micro_batches": 2, **knobs})
    return lower_plan(_graph(model), config, cluster=local_cluster(config.world_size), check=False)


def _programs(model: str, **knobs):
    lowering = _lowering(model, **knobs)
    return [lowering.rank_program(r) for r in range(lowering.config.world_size)]


def _mismatch(programs) -> str:
    assert not dist.is_initialized()  # nothing runs: the check is pure
    with pytest.raises(CommunicationMismatchError) as info:
        check_communication(programs)
    text = str(info.value)
    assert GRID_MARK in text and "call " in text, text  # the call x rank grid, first disagreement marked
    assert "lowering" in text and "Report it" in text  # what to do
    return text


# --------------------------------------------------------------------------------------------
# Real lowered programs pass

PLANS = {
    "dp2": (GPT, dict(dp=2, tp=1, pp=1)),
    "tp2": (GPT, dict(dp=1, tp=2, pp=1)),
    "pp2-tied": (GPT, dict(dp=1, tp=1, pp=2)),
    "dp2-tp2-pp2-zero1": (GPT, dict(dp=2, tp=2, pp=2, zero_stage=1)),
    "dp2-pp2-zero2": (GPT, dict(dp=2, tp=1, pp=2, zero_stage=2)),
    "tp2-sp-ckpt-pp2": (GPT, dict(dp=1, tp=2, pp=2, sequence_parallel=True, checkpointing="full")),
    "interleaved-pp2-v2-dp2": (GPT4, dict(dp=2, tp=1, pp=2, schedule="interleaved", virtual_pp=2)),
    "llama-tp2-pp2": (LLAMA, dict(dp=1, tp=2, pp=2)),
    "llama-dp2-zero2-offload": (LLAMA, dict(dp=2, tp=1, pp=1, zero_stage=2, offload="activations")),
    # split backward: the tp collectives of the backward run in the I actions, W is local
    "zb1p-tp2-pp2": (GPT, dict(dp=1, tp=2, pp=2, schedule="zb1p")),
    "zbv-tp2-pp2": (GPT4, dict(dp=1, tp=2, pp=2, schedule="zbv", virtual_pp=2)),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_lowered_plans_pass(name):
    model, knobs = PLANS[name]
    lowering = _lowering(model, **knobs)
    c = lowering.config
    summary = check_lowering(lowering)
    assert summary.ranks == c.world_size
    programs = _programs(model, **knobs)
    kinds = {call.label.split()[0] for p in programs for call in rank_calls(p).calls}
    if c.tp > 1:
        assert any(call.group == (0, 1) for call in rank_calls(programs[0]).calls), "tp collectives are checked"
    if c.dp > 1:
        assert "dp" in kinds, "the dp buckets are checked"
    if c.pp > 1:
        assert summary.messages > 0, "the pipeline's sends are checked"
    if model == GPT and c.pp > 1:  # the zoo GPT ties its embedding and LM head (llama does not)
        assert "tied" in kinds, "the tied-weight sync is checked"
    if c.zero_stage:
        ops = {call.op for call in rank_calls(programs[0]).calls if call.label.startswith("dp bucket")}
        assert ops == {"reduce_scatter(sum)", "all_gather"}


def test_launch_path_checks_and_returns_the_rank_program():
    config = ParallelConfig.for_global_batch(8, dp=1, tp=2, pp=2, schedule="1f1b", num_micro_batches=2)
    start = time.perf_counter()
    program = lower_plan(_graph(GPT), config, cluster=local_cluster(4)).rank_program(3)
    print(f"\nlower every program + check, tp2 pp2: {time.perf_counter() - start:.2f} s")
    assert (program.rank, program.stages, program.tp_index) == (3, (1,), 1)
    assert program.comms == _lowering(GPT, dp=1, tp=2, pp=2).rank_program(3).comms


# --------------------------------------------------------------------------------------------
# Broken copies of lowered programs are caught

def test_missing_receive_is_caught():
    programs = _programs(GPT, dp=1, tp=1, pp=2)
    r1 = programs[1]
    drop = next(a for a in r1.actions if a.kind.value == "RECV_F" and a.microbatch == 1)
    programs[1] = dataclasses.replace(r1, actions=tuple(a for a in r1.actions if a is not drop))
    text = _mismatch(programs)
    assert "point-to-point rank 0 -> rank 1" in text
    assert "rank 0 sends [" in text and "0SEND_F1->1" in text and "which never receives it" in text


def _swap_independent(gm, a, b):
    """Move collective ``a`` (before ``b``) to right after ``b``: a valid graph whose two
    collectives run in the other order."""
    order = list(gm.graph.nodes)
    between = order[order.index(a) + 1:order.index(b) + 1]
    assert not any(u in between for u in a.users), "the two collectives must be independent"
    b.append(a)
    gm.graph.lint()
    gm.recompile()


def test_swapped_tp_collectives_on_one_rank_are_caught():
    programs = _programs(GPT, dp=1, tp=2, pp=1, sequence_parallel=True)
    r1 = programs[1]
    gm = copy.deepcopy(r1.modules[0])
    # the token embedding's reduce-scatter and the position embedding's scatter are independent
    rs = next(n for n in gm.graph.nodes if op_name(n.target) == "reduce_scatter_seq")
    sc = next(n for n in gm.graph.nodes if op_name(n.target) == "scatter_to_seq")
    _swap_independent(gm, rs, sc)
    programs[1] = dataclasses.replace(r1, modules={0: gm})
    text = _mismatch(programs)
    assert "tp group (0, 1)" in text and "rank 1 against 0" in text
    # the swapped pair, named by node, in backward order: the all-gathers of their gradients
    assert f"grad of scatter_to_seq %{sc.name}" in text and f"grad of reduce_scatter_seq %{rs.name}" in text


def test_dp_bucket_of_another_size_is_caught():
    programs = _programs(GPT, dp=2, tp=1, pp=1)
    r1 = programs[1]
    gm = copy.deepcopy(r1.modules[0])
    gm.register_parameter("stray_bias", nn.Parameter(torch.zeros(7)))  # one parameter more than its dp peer
    programs[1] = dataclasses.replace(r1, modules={0: gm})
    text = _mismatch(programs)
    assert "dp group (0, 1)" in text and "dp bucket 0" in text
    sizes = [c.numel for p in programs for c in rank_calls(p).calls if c.label == "dp bucket 0"]
    assert sizes[1] - sizes[0] == 7 and f"all_reduce(sum) {sizes[1]} float32" in text


def test_dtype_mismatch_on_a_send_is_caught():
    programs = _programs(GPT, dp=1, tp=1, pp=2)
    r1 = programs[1]
    io1 = r1.io[1]
    k = next(k for k, i in enumerate(io1.inputs) if i.kind == "recv")
    inp = io1.inputs[k]
    bad = dataclasses.replace(inp, meta=dataclasses.replace(inp.meta, dtype=torch.bfloat16))
    io = list(r1.io)
    io[1] = dataclasses.replace(io1, inputs=io1.inputs[:k] + (bad,) + io1.inputs[k + 1:])
    programs[1] = dataclasses.replace(r1, io=tuple(io))
    text = _mismatch(programs)
    assert "point-to-point rank 0 -> rank 1" in text
    assert "rank 1 receives it as" in text and "bfloat16" in text and inp.name in text


def test_dtype_mismatch_on_a_collective_is_caught():
    programs = _programs(GPT, dp=1, tp=1, pp=2)
    r1 = programs[1]
    (name, tied), = r1.tied.items()
    programs[1] = dataclasses.replace(r1, tied={name: dataclasses.replace(tied, dtype=torch.float16)})
    text = _mismatch(programs)
    assert "group (0, 1)" in text and f"tied weight {name}" in text and "float16" in text


def test_tied_weight_sync_on_one_stage_only_is_caught():
    programs = _programs(GPT, dp=1, tp=2, pp=2)
    r3 = programs[3]  # stage 1, tp rank 1: forgets the tied embedding / LM head
    assert r3.tied
    programs[3] = dataclasses.replace(r3, tied={})
    text = _mismatch(programs)
    assert "pipeline group (1, 3)" in text and "rank 3 against 1" in text
    assert "tied weight wte.weight" in text and "rank 3: nothing" in text and "[end]" in text


def test_rank_with_one_micro_batch_less_is_caught():
    programs = _programs(GPT, dp=1, tp=2, pp=2)
    r3 = programs[3]
    last = r3.config.num_micro_batches - 1
    programs[3] = dataclasses.replace(r3, actions=tuple(a for a in r3.actions if a.microbatch != last))
    text = _mismatch(programs)
    assert "tp group (2, 3)" in text and "rank 3 against 2" in text and "[end]" in text
    assert f"1F{last}" in text  # what rank 2 issues where rank 3 has stopped
    assert "point-to-point rank 1 -> rank 3" in text  # and the sends rank 3 never receives


def _per_rank_check(programs):
    """The check from every rank's own calls (what a job's ranks gather), for comparison."""
    from passes.checks.communication_check import check_calls

    return check_calls({p.rank: rank_calls(p) for p in programs}, config=programs[0].config)


def _edited_replica(programs, rank: int):
    """``programs`` with ``rank`` (a data-parallel replica of rank ``rank - 2``) carrying a stray
    parameter and missing its last forward receive: two problems the replicas must not hide."""
    p = programs[rank]
    gm = copy.deepcopy(p.modules[p.stages[0]])
    gm.register_parameter("stray_bias", nn.Parameter(torch.zeros(7)))
    drop = [a for a in p.actions if a.kind.value == "RECV_F"][-1:]
    out = list(programs)
    out[rank] = dataclasses.replace(p, modules={p.stages[0]: gm}, actions=tuple(a for a in p.actions if a not in drop))
    return out


@pytest.mark.parametrize("knobs", [dict(dp=2, tp=2, pp=2, zero_stage=1), dict(dp=2, tp=1, pp=2, zero_stage=3)],
                         ids=["zero1-tp2-pp2", "zero3-pp2"])
def test_the_check_of_shared_programs_finds_what_each_rank_finds(knobs):
    """check_communication works out the calls once per program the data-parallel replicas share
    (their groups by reference): it passes and fails as the check of every rank's own calls does,
    with the same message, when one replica's program is edited."""
    programs = _programs(GPT, **knobs)
    shared, own = check_communication(programs), _per_rank_check(programs)
    assert (shared.ranks, shared.groups, shared.collectives, shared.messages) == \
           (own.ranks, own.groups, own.collectives, own.messages)
    broken = _edited_replica(programs, len(programs) - 1)
    with pytest.raises(CommunicationMismatchError) as fast:
        check_communication(broken)
    with pytest.raises(CommunicationMismatchError) as slow:
        _per_rank_check(broken)
    assert str(fast.value) == str(slow.value)
    assert "point-to-point" in str(fast.value)
    # the stray parameter joins a dp bucket (ZeRO-3 gathers only the sharded ones: no call for it)
    assert ("dp group" in str(fast.value)) == (knobs["zero_stage"] != 3)


def test_missing_program_is_refused():
    programs = _programs(GPT, dp=2, tp=1, pp=1)
    with pytest.raises(ConfigError, match="programs missing for \\[1\\]"):
        check_communication(programs[:1])


def test_grid_marks_the_row():
    grid = format_call_grid({"rank 0": ["a", "b", "c"], "rank 1": ["a", "x"]}, 1)
    lines = grid.splitlines()
    assert lines[0].split("|")[1].strip() == "rank 0"
    assert "[b]" in lines[2] and "[x]" in lines[2] and GRID_MARK in lines[2]
    assert GRID_MARK not in lines[1] and GRID_MARK not in lines[3]


# --------------------------------------------------------------------------------------------
# The check derives what the runtime issues (no drift)

def test_bucket_layout_is_the_runtimes():
    from runtime.optim.grad_sync import BucketedGradSync

    params = [nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              [(300_000, torch.float32), (5, torch.float32), (7, torch.bfloat16), (9, torch.float32), (3, torch.float32)]]
    late = [params[3]]
    for mode, shard in (("all_reduce", False), ("reduce_scatter", True)):
        sync = BucketedGradSync(params, None, 4, late=late, overlap=False, mode=mode, bucket_bytes=40_000)
        specs = bucket_layout([GradSlot(p.numel(), p.dtype, p is params[3]) for p in params], size=4, shard=shard,
                              bucket_bytes=40_000)
        assert [(b.numel, b.late, [id(p) for p in b.params]) for b in sync.buckets] == \
               [(s.numel, s.late, [id(params[i]) for i in s.members]) for s in specs]
        # reversed: the last one alone (the first bucket is small), a dtype change, a float32 one
        # again, the one over the cap alone, then the late one in a bucket of its own
        assert [s.members for s in specs] == [(4,), (2,), (1,), (0,), (3,)]


RUNTIME_CASES = [  # (model, knobs, ranks to play)
    (GPT, dict(dp=1, tp=2, pp=2, sequence_parallel=True, checkpointing="full"), (1, 2)),
    (GPT, dict(dp=2, tp=1, pp=2, zero_stage=2), (0, 3)),
    (GPT, dict(dp=2, tp=2, pp=1, zero_stage=1), (3,)),
    (LLAMA, dict(dp=2, tp=1, pp=2), (2,)),
    (GPT, dict(dp=1, tp=2, pp=2, schedule="zb1p"), (0, 3)),  # I and W actions
    (GPT, dict(dp=2, tp=1, pp=2, schedule="zb1p", zero_stage=2), (1,)),
    (GPT, dict(dp=2, tp=1, pp=2, zero_stage=3), (0, 3)),  # gathers, prefetch, re-gathers, reduce-scatters
    (GPT, dict(dp=2, tp=1, pp=2, zero_stage=3, reshard_after_forward=False, checkpointing="full"), (0, 3)),
]


def _record_runtime_calls(program, spec, global_batch: int):
    """The (group, op, numel, dtype) of every call ``ParallelModel.train_step`` makes through
    runtime.dist.comm as rank ``program.rank``, on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.dist import comm
    from runtime.dist.mesh import Mesh
    from runtime.exec.parallel_model import ParallelModel

    c = program.config
    calls = []
    real = {n: getattr(comm, n) for n in ("all_reduce", "all_gather", "reduce_scatter", "post_p2p")}

    def ranks(group):
        return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(c.world_size))

    def all_reduce(t, group=None, *, op="sum", async_op=False):
        calls.append((ranks(group), f"all_reduce({op})", t.numel(), t.dtype))
        return real["all_reduce"](t, group, op=op, async_op=async_op)

    def all_gather(parts, t, group=None, *, async_op=False):
        calls.append((ranks(group), "all_gather", sum(p.numel() for p in parts), t.dtype))
        return real["all_gather"](parts, t, group, async_op=async_op)

    def reduce_scatter(out, parts, group=None, *, async_op=False):
        calls.append((ranks(group), "reduce_scatter(sum)", sum(p.numel() for p in parts), out.dtype))
        return real["reduce_scatter"](out, parts, group, async_op=async_op)

    def post_p2p(messages):
        me = dist.get_rank()
        for m in messages:
            calls.append(((me, m.peer) if m.op == "send" else (m.peer, me), m.op, m.tensor.numel(), m.tensor.dtype))
            if m.op == "recv":
                m.tensor.zero_()  # the fake group leaves receive buffers as allocated: keep the step finite
        return real["post_p2p"](messages)

    dist.init_process_group("fake", store=FakeStore(), rank=program.rank, world_size=c.world_size)
    try:
        mesh = Mesh(c.dp, c.pp, c.tp)
        model = ParallelModel(program, mesh, nonfinite="skip")  # the fake group moves no data
        for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
                         ("post_p2p", post_p2p)):
            setattr(comm, name, fn)
        model.train_step(spec.example_inputs({"batch": global_batch}, seed=3))
    finally:
        for name, fn in real.items():
            setattr(comm, name, fn)
        dist.destroy_process_group()
    return calls


@pytest.mark.parametrize("model,knobs,ranks", RUNTIME_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_derived_calls_are_what_the_runtime_issues(model, knobs, ranks):
    lowering = _lowering(model, **knobs)
    for r in ranks:
        program = lowering.rank_program(r)
        # its own copy of the modules (training moves their weights and hooks their parameters)
        program = dataclasses.replace(program, modules=copy.deepcopy(dict(program.modules)))
        ran = _record_runtime_calls(program, build_model(model), 8)
        derived = [(c.group, c.op, c.numel, c.dtype) for c in rank_calls(program).calls]
        assert len(ran) > 5
        assert ran == derived, f"rank {r}: first difference at call " \
                               f"{next(k for k, (a, b) in enumerate(zip(ran + [None], derived + [None])) if a != b)}"


def _lowered_ranks(model: str, config: ParallelConfig, *, plan: str = "plan"):
    """What each process of a job tells the others: it lowers only its own rank's programs."""
    from passes.checks.communication_check import LoweredRank
    from passes.lowering.lower import lower, programs_of
    from partitioner.cost.cost_model import cost_hooks

    out = []
    for r in range(config.world_size):
        lowering = lower(_graph(model), config, cost=cost_hooks(local_cluster(config.world_size)),
                         programs=programs_of(config, r))
        out.append(LoweredRank(rank=r, plan=plan, programs=tuple(sorted(lowering.programs)), digest=lowering.digest(),
                               calls=rank_calls(lowering.rank_program(r))))
    return out


def test_each_rank_lowering_only_its_own_programs_gets_the_calls_of_the_whole_lowering():
    """A process lowers only its rank's programs (partitioner.compile.build.build_parallel_model); its
    calls are those of the same rank in a lowering of every program, and the ranks' gathered
    summaries pass the check, where one rank's calls from another plan do not."""
    from passes.checks.communication_check import check_lowered_ranks

    config = ParallelConfig.for_global_batch(8, dp=1, tp=2, pp=2, schedule="1f1b", num_micro_batches=2)
    ranks = _lowered_ranks(GPT, config)
    whole = lower_plan(_graph(GPT), config, cluster=local_cluster(4), check=False)
    assert [r.calls for r in ranks] == [rank_calls(whole.rank_program(r)) for r in range(4)]
    assert [r.programs for r in ranks] == [((0, 0),), ((0, 1),), ((1, 0),), ((1, 1),)]
    assert check_lowered_ranks(ranks, config=config).ranks == 4

    other = ParallelConfig.for_global_batch(8, dp=1, tp=2, pp=2, schedule="gpipe", num_micro_batches=4)
    swapped = ranks[:3] + [_lowered_ranks(GPT, other)[3]]
    with pytest.raises(CommunicationMismatchError, match="do not match"):
        check_lowered_ranks(swapped, config=config)
    with pytest.raises(CommunicationMismatchError, match=r"different plans \(ranks \[0, 1, 2\] lowered a; ranks \[3\] "
                                                         r"lowered b\)"):
        check_lowered_ranks([dataclasses.replace(r, plan="b" if r.rank == 3 else "a") for r in ranks], config=config)


def test_dp_peers_that_lowered_their_program_differently_are_named():
    from passes.checks.communication_check import check_lowered_ranks

    config = ParallelConfig.for_global_batch(8, dp=2, pp=2, schedule="1f1b", num_micro_batches=2)
    ranks = _lowered_ranks(GPT, config)
    assert ranks[0].programs == ranks[1].programs and ranks[0].digest == ranks[1].digest
    assert ranks[0].digest != ranks[2].digest  # another stage: another program
    check_lowered_ranks(ranks, config=config)
    odd = [dataclasses.replace(r, digest="x") if r.rank == 3 else r for r in ranks]
    with pytest.raises(CommunicationMismatchError, match=r"ranks \[2\] lowered .*; ranks \[3\] lowered x"):
        check_lowered_ranks(odd, config=config)


def test_recomputed_context_parallel_calls_are_on_the_cp_group():
    """cp + full checkpointing: the ring shifts a checkpointed region's recompute re-runs in
    backward are on the cp group, as the forward's are (not the tp group)."""
    for mode in ("ring", "ulysses"):
        program = _lowering(GPT_HEADS4, dp=1, tp=2, pp=1, cp=2, cp_mode=mode, sequence_parallel=True,
                            checkpointing="full").rank_program(0)
        calls = rank_calls(program).calls
        recomputed = [c for c in calls if "recompute" in c.label and c.channel == "cp"]
        assert recomputed, f"{mode}: the recompute re-runs the cp ops"
        cp_ops = {"ring_shift"} if mode == "ring" else {"all_to_all"}
        for c in calls:
            if c.op in cp_ops:
                assert c.group == (0, 2) and c.channel == "cp", f"{mode}: {c}"
        assert all(c.group == (0, 1) for c in calls if c.channel == "tp"), mode
