"""ParallelConfig: the one typed record of a plan's knobs; every rule it checks names the
constraint, the values and the fix; JSON round trip; the Plan holds one."""
from __future__ import annotations

import pytest

from passes.ir.config import CHECKPOINTING, KNOBS, OFFLOAD, SCHEDULES, ParallelConfig, is_mixed
from passes.ir.errors import ConfigError


def test_defaults_are_one_device_and_derived_sizes():
    c = ParallelConfig()
    assert (c.world_size, c.global_batch, c.n_stages, is_mixed(c.dtype)) == (1, 1, 1, False)
    c = ParallelConfig(dp=2, tp=2, pp=2, virtual_pp=2, schedule="interleaved", micro_batch_size=3, num_micro_batches=4,
                       dtype="bf16")
    assert (c.world_size, c.global_batch, c.n_stages, is_mixed(c.dtype)) == (8, 24, 4, True)
    assert set(c.knobs()) == set(KNOBS)


def test_is_mixed_is_the_16bit_dtypes_and_refuses_unknown_ones():
    assert [is_mixed(d) for d in ("fp32", "bf16", "fp16")] == [False, True, True]
    with pytest.raises(ConfigError, match="dtype must be one of fp32, bf16, fp16, got 'fp8'"):
        is_mixed("fp8")


@pytest.mark.parametrize("knobs,needle", [
    (dict(tp=0), "tp must be an integer >= 1, got 0"),
    (dict(dp=True), "dp must be an integer >= 1, got True"),
    (dict(schedule="zigzag"), "schedule must be one of gpipe, 1f1b, interleaved, zb1p, zbv, got 'zigzag'"),
    (dict(checkpointing="sometimes"), "checkpointing must be one of none, selective, full"),
    (dict(zero_stage=4), "zero_stage must be one of 0, 1, 2, 3"),
    (dict(dp=2, pp=2, num_micro_batches=2, schedule="zb1p", zero_stage=3), "zero_stage=3 gathers"),
    (dict(pp=2, num_micro_batches=2, schedule="zbv", virtual_pp=2, checkpointing="dag"), "selective checkpointing, which replays"),
    (dict(virtual_pp=2), "virtual_pp=2 needs schedule='interleaved'"),
    (dict(pp=2, schedule="interleaved", virtual_pp=2, num_micro_batches=3), "divisible by pp (2)"),
    (dict(sequence_parallel=True), "sequence_parallel=true needs tp > 1"),
    (dict(offload="optimizer", zero_stage=1, dp=2), "offload='optimizer' keeps the whole optimizer state on the host"),
    (dict(pp=2, stage_boundaries=(1, 2)), "stage_boundaries has 2 entries for pp*virtual_pp = 2 stages"),
    (dict(pp=3, stage_boundaries=(2, 2)), "strictly increasing"),
    (dict(compile="yes"), "compile must be true or false"),
    (dict(pp=2, num_micro_batches=2, schedule="zb1p", compile=True, checkpointing="full"),
     "compile=true with schedule='zb1p' compiles the segments between a stage's weight-reading ops"),
    (dict(pp=2, num_micro_batches=2, schedule="zbv", virtual_pp=2, compile=True, checkpointing="selective"),
     "compile=true with schedule='zbv'"),
    (dict(offload="activations", compile=True), "compile=true with offload='activations' is not supported yet"),
    (dict(checkpointing="dag", compile=True), "compile=true with checkpointing='dag'"),
    (dict(checkpointing="tensor", compile=True), "compile=true with checkpointing='tensor'"),
    (dict(cp=2, compile=True), "compile=true with cp=2"),
    (dict(dp=2, ep=2, compile=True), "compile=true with ep=2"),
])
def test_each_rule_names_the_constraint_and_the_fix(knobs, needle):
    with pytest.raises(ConfigError, match="invalid parallel config") as err:
        ParallelConfig(**knobs)
    assert needle in str(err.value)


def test_rules_that_need_the_model_or_the_job():
    c = ParallelConfig(dp=2, tp=4, pp=2)
    assert c.problems() == []
    found = c.problems(world_size=8, blocks=1, heads=6)
    assert any("dp*cp*tp*pp = 2*1*4*2 = 16 but the job has 8 devices" in p for p in found)
    assert any("2 stages but the model has 1 blocks" in p for p in found)
    assert any("tp=4 must divide the attention heads (6)" in p for p in found)


def test_round_trip_and_global_batch_constructor():
    c = ParallelConfig.for_global_batch(16, dp=2, pp=2, num_micro_batches=4, stage_boundaries=[3])
    assert c.micro_batch_size == 2 and c.stage_boundaries == (3,)
    assert ParallelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="positive multiple of dp \\* num_micro_batches = 2 \\* 4"):
        ParallelConfig.for_global_batch(12, dp=2, num_micro_batches=4)
    with pytest.raises(ConfigError, match="unknown field"):
        ParallelConfig.from_dict({**c.to_dict(), "tensor_parallel": 2})


def test_the_choices_are_spelled_here():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb1p", "zbv")
    assert CHECKPOINTING == ("none", "selective", "full", "dag", "tensor") and OFFLOAD == ("none", "activations", "optimizer")


def test_compiled_plans_run_with_every_other_knob_the_runtime_compiles():
    """What compile=true takes: the non-split schedules, every ZeRO stage, tp with sp, full and
    selective checkpointing; and it round-trips."""
    for knobs in (dict(dp=2, zero_stage=2), dict(dp=2, zero_stage=3), dict(tp=2, sequence_parallel=True),
                  dict(pp=2, num_micro_batches=2, checkpointing="full"),
                  dict(pp=2, num_micro_batches=2, schedule="interleaved", virtual_pp=2, checkpointing="selective")):
        c = ParallelConfig(compile=True, **knobs)
        assert ParallelConfig.from_dict(c.to_dict()) == c and c.compile
        assert "compile=True" in c.text()
    assert "compile" not in ParallelConfig().text()
