"""What is dumped is what runs: for seven plans on 4 gloo ranks, ``auto_parallelize(job=Job(dump_dir=D))``
dumps every rank program (rank 0 lowers them all, pass by pass), while every rank runs its own;
the text of the program each rank executes equals ``D/stage<s>_tp<r>/program.txt`` byte for byte.
And a job captures its model once: each ``auto_parallelize`` call captures on rank 0 only, and
every other rank rebuilds rank 0's analysed graph."""
from __future__ import annotations

import time

import pytest

from partitioner.inputs.models import build_model
from runtime.dist.launch import spawn

MODEL = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
WORLD, GLOBAL_BATCH = 4, 8
COMMON = "schedule=1f1b,num_micro_batches=2,zero_stage=0"
PLANS = {
    "tp": f"dp=2,tp=2,pp=1,sequence_parallel=false,checkpointing=none,offload=none,{COMMON}",
    "pp": f"dp=2,tp=1,pp=2,checkpointing=none,offload=none,{COMMON}",
    "dp": f"dp=4,tp=1,pp=1,checkpointing=none,offload=none,{COMMON}",
    "sequence-parallel": f"dp=2,tp=2,pp=1,sequence_parallel=true,checkpointing=none,offload=none,{COMMON}",
    "full-checkpointing": f"dp=2,tp=1,pp=2,checkpointing=full,offload=none,{COMMON}",
    "activation-offload": f"dp=2,tp=1,pp=2,checkpointing=none,offload=activations,{COMMON}",
    "all": f"dp=1,tp=2,pp=2,sequence_parallel=true,checkpointing=full,offload=activations,{COMMON}",
    "context-parallel": f"dp=2,tp=1,pp=1,cp=2,cp_mode=ring,checkpointing=none,offload=none,{COMMON}",
    "context-parallel-pipeline": f"dp=1,tp=1,pp=2,cp=2,cp_mode=ulysses,checkpointing=full,offload=none,{COMMON}",
}


def _rank(root: str):
    from ir_dumps.writer import program_text
    from partitioner import Job, Training, auto_parallelize
    from passes.capture.capture import capture_count

    spec = build_model(MODEL)
    batch = spec.example_inputs({"batch": GLOBAL_BATCH}, seed=7)
    out = {}
    for name, fix in PLANS.items():
        before = capture_count()
        start = time.perf_counter()
        trainer = auto_parallelize(MODEL, training=Training(global_batch=GLOBAL_BATCH), fix=fix,
                                   job=Job(dump_dir=f"{root}/{name}", timeout_s=60, track_memory=False))
        built = time.perf_counter() - start
        captures = capture_count() - before
        pm = trainer.model
        loss = trainer.train_step(batch)  # the modules below are the ones that just trained
        texts = {f"stage{s}_tp{pm.program.tp_index}": program_text(st.module, f"stage{s}_tp{pm.program.tp_index}")
                 for s, st in pm.stages.items()}
        out[name] = {"captures": captures, "texts": texts, "loss": loss, "config": trainer.plan.config.text(),
                     "build_s": built}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    start = time.perf_counter()
    results = spawn(_rank, WORLD, str(root), timeout_s=600)
    print(f"\n{len(PLANS)} plans on {WORLD} ranks: {time.perf_counter() - start:.1f} s")
    return root, results


@pytest.mark.parametrize("name", list(PLANS))
def test_each_rank_executes_the_dumped_program(runs, name):
    root, results = runs
    seen = set()
    for rank, r in enumerate(results):
        for scope, text in r[name]["texts"].items():
            dumped = (root / name / scope / "program.txt").read_text(encoding="utf-8")
            assert text == dumped, f"rank {rank} runs a {scope} that differs from the dump"
            seen.add(scope)
    # every program of the tree is run by some rank
    assert seen == {p.name for p in (root / name).iterdir() if p.is_dir() and p.name.startswith("stage")}
    loss = results[0][name]["loss"]
    assert loss == loss and all(r[name]["loss"] == loss for r in results)
    print(f"{name}: {results[0][name]['config']}, build {max(r[name]['build_s'] for r in results):.1f} s")


def test_the_knobs_asked_for_are_the_ones_lowered(runs):
    _, results = runs
    config = results[0]["all"]["config"]
    assert "tp=2" in config and "pp=2" in config and "sequence_parallel=True" in config
    assert "checkpointing=full" in config and "offload=activations" in config


def test_context_parallel_plans_dump_and_run_their_cp_attention(runs):
    root, results = runs
    for name, op in (("context-parallel", "ring_attention"), ("context-parallel-pipeline", "seq_to_heads")):
        assert "cp=2" in results[0][name]["config"]
        texts = "".join(t for r in results for t in r[name]["texts"].values())
        # the attention op (a checkpointed block's nodes are listed by name in its region) and the loss's
        assert op in texts and "partitioner.reduce_from_cp" in texts, name
        dumped = "".join(p.read_text(encoding="utf-8") for p in (root / name).glob("stage*/program.txt"))
        assert op in dumped, name


def test_auto_parallelize_captures_once_per_job(runs):
    _, results = runs
    for name in PLANS:
        assert [r[name]["captures"] for r in results] == [1] + [0] * (WORLD - 1), name
