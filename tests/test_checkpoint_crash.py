"""Checkpoints survive a crash: a save killed midway leaves the previous checkpoint the latest
complete one, loadable exactly; the train state (RNG per rank, lr scheduler, extra) round-trips.

Two spawns of 2 gloo ranks (pp=2, so each rank writes its own part): the first trains and saves
steps 1..3 (keep=2), then one rank is SIGKILLed inside the save of step 4 (after its DCP write,
before the barrier: ``runtime.checkpoint.directory.FAULT_ENV``); the second resumes from the root and
trains on. The directory rules (marker, rotation, leftovers) are also checked without a spawn.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from partitioner.inputs.models import build_model
from passes.ir.errors import CheckpointError
from runtime.checkpoint import directory as cd
from runtime.checkpoint.io import load_into_module
from runtime.dist.launch import LaunchError, spawn
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
FIX = ("dp=1,pp=2,tp=1,zero_stage=0,schedule=1f1b,num_micro_batches=2,checkpointing=none,offload=none,"
       "sequence_parallel=false")
WORLD, GLOBAL_BATCH, SAVED, KEEP = 2, 4, 3, 2
STALE_TMP, MARKERLESS = ".tmp-step_00000099-stale", "step_00000100"


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=200 + k) for k in range(SAVED + 1)]


def _trainer():
    from partitioner import Job, Training
    from partitioner.api.auto import auto_parallelize

    trainer = auto_parallelize(GPT, local_cluster(WORLD), training=Training(global_batch=GLOBAL_BATCH,
                                                                            optimizer={"lr": 1e-2}),
                               fix=FIX, job=Job(timeout_s=30))
    pm = trainer.model
    if getattr(pm, "lr_scheduler", None) is None:  # a schedule whose lr changes every step
        pm.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, lambda s: 1.0 / (1 + s))
    return trainer


def _step(trainer, batch) -> float:
    scheduler = trainer.model.lr_scheduler
    before = scheduler.last_epoch
    loss = trainer.train_step(batch)
    if scheduler.last_epoch == before:  # the model does not step the scheduler itself
        scheduler.step()
    return loss


def _draws() -> dict:
    """One draw from every generator the train state covers."""
    return {"torch": torch.rand(4), "python": random.random(), "numpy": float(np.random.rand())}


def _counters(pm) -> dict:
    return {k: getattr(pm, k) for k in cd.COUNTERS if hasattr(pm, k)}


def _params(pm) -> dict:
    return {n: t.detach().clone() for n, t in pm.full_master_parameters().items()}


def _train_save_then_crash(root: str, out: str):
    import torch.distributed as dist

    trainer = _trainer()
    pm, rank = trainer.model, dist.get_rank()
    batches = _batches(build_model(GPT))  # build_model seeds torch: before the per-rank seeds
    torch.manual_seed(1000 + rank)  # per-rank streams: a resume must give each rank its own back
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    paths = []
    for k in range(SAVED):
        _step(trainer, batches[k])
        paths.append(str(trainer.save(root, keep=KEEP, extra={"sampler": {"position": k + 1}})))
    record = {"draws": _draws(), "paths": paths, "params": _params(pm), "counters": _counters(pm),
              "scheduler": pm.lr_scheduler.state_dict()}
    record["loss_next"] = _step(trainer, batches[SAVED])
    record["params_next"] = _params(pm)
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    os.environ[cd.FAULT_ENV] = "rank=1,point=written"
    trainer.save(root, keep=KEEP)  # rank 1 is killed in here; rank 0 then fails at the barrier
    return "saved"


def _resume(root: str):
    trainer = _trainer()
    pm = trainer.model
    refused = None
    try:
        trainer.load(os.path.join(root, MARKERLESS))
    except CheckpointError as exc:
        refused = str(exc)
    state = trainer.load(root)
    out = {"refused": refused, "state": state, "draws": _draws(), "params": _params(pm), "counters": _counters(pm),
           "scheduler": pm.lr_scheduler.state_dict(), "lr": pm.optimizer.param_groups[0]["lr"]}
    out["loss_next"] = _step(trainer, _batches(build_model(GPT))[SAVED])
    out["params_next"] = _params(pm)
    out["saved"] = trainer.save(root, keep=KEEP, extra={"sampler": {"position": SAVED + 1}})
    return out


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("ckpt-root"), tmp_path_factory.mktemp("ckpt-out")
    (root / STALE_TMP).mkdir()
    (root / STALE_TMP / "__0_0.distcp").write_bytes(b"partial")
    (root / MARKERLESS).mkdir()  # e.g. copied by hand, or a save of another tool: never loaded
    (root / MARKERLESS / ".metadata").write_bytes(b"not a checkpoint")
    start = time.perf_counter()
    with pytest.raises(LaunchError) as failure:
        spawn(_train_save_then_crash, WORLD, str(root), str(out), timeout_s=240)
    print(f"\nspawn of {WORLD} ranks, {SAVED} saves and a killed one: {time.perf_counter() - start:.1f} s")
    saved = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    after_crash = {"latest": cd.latest_checkpoint(root), "complete": cd.complete_checkpoints(root),
                   "entries": sorted(p.name for p in root.iterdir())}
    return root, str(failure.value), saved, after_crash


@pytest.fixture(scope="module")
def resumed(crash):
    root = crash[0]
    start = time.perf_counter()
    results = spawn(_resume, WORLD, str(root), timeout_s=240)
    print(f"\nspawn of {WORLD} ranks, resume: {time.perf_counter() - start:.1f} s")
    return results


def test_killed_save_leaves_previous_checkpoint_latest(crash):
    root, failure, saved, after = crash
    assert "rank 1" in failure or "rank(s) [1]" in failure or "exit code -9" in failure, failure
    a = root / cd.step_dir_name(SAVED)
    assert after["latest"] == a
    assert saved[0]["paths"][-1] == str(a)
    assert cd.read_info(a).step == SAVED and cd.read_info(a).world_size == WORLD
    # The killed save got as far as the DCP write (its .metadata exists) but has no marker.
    killed = [root / n for n in after["entries"] if n.startswith(f".tmp-{cd.step_dir_name(SAVED + 1)}-")]
    assert len(killed) == 1 and (killed[0] / ".metadata").exists() and not cd.is_complete(killed[0])
    with pytest.raises(CheckpointError, match="incomplete"):
        cd.resolve(killed[0])


def test_rotation_keeps_last_k_and_first_save_cleans_leftovers(crash):
    root, _, _, after = crash
    assert after["complete"] == [root / cd.step_dir_name(s) for s in range(SAVED - KEEP + 1, SAVED + 1)]
    assert STALE_TMP not in after["entries"]
    assert MARKERLESS in after["entries"]  # not ours to delete, and never the latest
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        cd.resolve(root / MARKERLESS)


def test_checkpoint_after_crash_loads_into_plain_module(crash):
    _, _, saved, after = crash
    spec = build_model(GPT)
    assert load_into_module(spec.module, after["latest"]) == SAVED
    plain = dict(spec.module.named_parameters())
    held = {n: t for rank in saved for n, t in rank["params"].items()}
    common = set(plain) & set(held)
    assert common, f"no parameter names in common: {sorted(plain)[:3]} vs {sorted(held)[:3]}"
    for name in common:
        assert torch.equal(plain[name].detach(), held[name]), name


def test_resumed_job_continues_exactly(crash, resumed):
    root, _, saved, _ = crash
    for rank, (got, want) in enumerate(zip(resumed, saved)):
        assert got["state"].step == SAVED and got["state"].path == root / cd.step_dir_name(SAVED)
        assert got["state"].extra == {"sampler": {"position": SAVED}}
        assert got["params"].keys() == want["params"].keys()
        for name, t in want["params"].items():
            assert torch.equal(got["params"][name], t), f"rank {rank}: {name}"
        # the next step: same loss, same weights (lr from the restored schedule, AdamW state)
        assert got["loss_next"] == want["loss_next"]
        for name, t in want["params_next"].items():
            assert torch.equal(got["params_next"][name], t), f"rank {rank}: {name} after the next step"


def test_train_state_round_trips_per_rank(crash, resumed):
    _, _, saved, _ = crash
    for rank, (got, want) in enumerate(zip(resumed, saved)):
        assert torch.equal(got["draws"]["torch"], want["draws"]["torch"]), f"rank {rank}"
        assert got["draws"]["python"] == want["draws"]["python"]
        assert got["draws"]["numpy"] == want["draws"]["numpy"]
        assert got["scheduler"] == want["scheduler"] and got["scheduler"]["last_epoch"] == SAVED
        assert got["lr"] == want["scheduler"]["_last_lr"][0]
        assert got["counters"] == want["counters"]
    assert not torch.equal(saved[0]["draws"]["torch"], saved[1]["draws"]["torch"])  # ranks differ


def test_resumed_save_cleans_killed_save_and_rotates(crash, resumed):
    root = crash[0]
    assert all(r["refused"] is not None and "no COMPLETE marker" in r["refused"] for r in resumed)
    assert resumed[0]["saved"] == root / cd.step_dir_name(SAVED + 1)
    assert cd.complete_checkpoints(root) == [root / cd.step_dir_name(s) for s in (SAVED, SAVED + 1)]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


# ----------------------------------------------------------------------------------------------
# The directory rules without a job
# ----------------------------------------------------------------------------------------------
def _fake_tmp(root, step: int):
    tmp = root / f".tmp-{cd.step_dir_name(step)}-x{step}"
    tmp.mkdir(parents=True)
    (tmp / "payload").write_text(str(step))
    return tmp


def _commit(root, step: int, keep):
    info = cd.CheckpointInfo(step=step, world_size=1, dp=1, pp=1, tp=1)
    return cd._commit(_fake_tmp(root, step), root / cd.step_dir_name(step), info, keep)


def test_commit_keeps_last_k_and_resave_replaces(tmp_path):
    for step in range(1, 5):
        assert _commit(tmp_path, step, keep=2) == tmp_path / cd.step_dir_name(step)
    assert cd.complete_checkpoints(tmp_path) == [tmp_path / cd.step_dir_name(s) for s in (3, 4)]
    (tmp_path / cd.step_dir_name(4) / "payload").write_text("old")
    _commit(tmp_path, 4, keep=None)  # a re-save of the newest step
    assert (tmp_path / cd.step_dir_name(4) / "payload").read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == [cd.step_dir_name(3), cd.step_dir_name(4)]
    _commit(tmp_path, 2, keep=1)  # an older step than the newest: the new one is never removed
    assert cd.latest_checkpoint(tmp_path) == tmp_path / cd.step_dir_name(4)
    assert (tmp_path / cd.step_dir_name(2)).exists()


def test_marker_decides_and_leftovers_are_cleaned(tmp_path):
    assert cd.latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        cd.resolve(tmp_path)
    _commit(tmp_path, 1, keep=None)
    killed_before_rename = _fake_tmp(tmp_path, 3)  # marker written, not yet renamed
    (killed_before_rename / cd.MARKER).write_text(cd.CheckpointInfo(step=3, world_size=1, dp=1, pp=1, tp=1).to_json())
    unmarked = tmp_path / cd.step_dir_name(2)
    unmarked.mkdir()
    assert cd.latest_checkpoint(tmp_path) == cd.resolve(tmp_path) == tmp_path / cd.step_dir_name(1)
    with pytest.raises(CheckpointError, match="incomplete"):
        cd.resolve(unmarked)
    with pytest.raises(CheckpointError, match="no directory"):
        cd.resolve(tmp_path / "nowhere")
    # A re-save killed between its two renames: the old checkpoint is put back.
    os.replace(tmp_path / cd.step_dir_name(1), tmp_path / f"{cd.REPLACED_PREFIX}{cd.step_dir_name(1)}-abc")
    cd.clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [cd.step_dir_name(1), cd.step_dir_name(2)]
    assert cd.latest_checkpoint(tmp_path) == tmp_path / cd.step_dir_name(1)


def test_plain_dcp_directory_is_refused_with_a_hint(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="runtime.checkpoint.io.load_checkpoint"):
        cd.resolve(tmp_path)
