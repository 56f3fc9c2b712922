"""Checkpoints are untrusted input: every failure of a load is a CheckpointError naming the file or
key and the cause, and no part of a checkpoint can run code (a ``.metadata`` pickle that would call
``os.system`` is refused, as is a train-state file that would)."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from partitioner.inputs.models import build_model
from passes.ir.errors import CheckpointError
from runtime.checkpoint.io import (
    checkpoint_keys, load_into_module, load_optimizer_state_into, save_module,
)
from runtime.dist.launch import spawn
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"


class _Evil:
    """Pickles as a call of ``os.system`` (what a hostile checkpoint would hold)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _trained(optimizer: str = "adamw"):
    spec = build_model(GPT)
    opt = (torch.optim.AdamW(spec.module.parameters()) if optimizer == "adamw"
           else torch.optim.SGD(spec.module.parameters(), lr=0.1, momentum=0.9))
    spec.loss(spec.module, *spec.example_inputs({"batch": 2}, seed=0)).backward()
    opt.step()
    return spec, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    spec, opt = _trained("adamw")
    save_module(spec.module, root / "adamw", step=1, optimizer=opt)
    spec, opt = _trained("sgd")
    save_module(spec.module, root / "sgd", step=1, optimizer=opt)
    return root


def _copy(saved, name, tmp_path):
    return shutil.copytree(saved / name, tmp_path / name)


def test_truncated_metadata(saved, tmp_path):
    ckpt = _copy(saved, "adamw", tmp_path)
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated or damaged .*load an older checkpoint"):
        load_into_module(build_model(GPT).module, ckpt)


def test_missing_and_truncated_data_file(saved, tmp_path):
    ckpt = _copy(saved, "adamw", tmp_path)
    (data,) = [p for p in ckpt.iterdir() if p.suffix == ".distcp"]
    payload = data.read_bytes()
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"data file {data.name} is missing .*copy it whole"):
        load_into_module(build_model(GPT).module, ckpt)
    data.write_bytes(payload[: len(payload) - 100])
    with pytest.raises(CheckpointError, match=rf"data file {data.name} is truncated \({len(payload) - 100} bytes"):
        load_into_module(build_model(GPT).module, ckpt)


def test_missing_directory_and_missing_metadata(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_into_module(build_model(GPT).module, tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"no \.metadata file"):
        checkpoint_keys(tmp_path)


def test_another_models_checkpoint(saved):
    other = build_model("gpt:layers=3,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0").module
    with pytest.raises(CheckpointError, match=r"has no blocks\.2\..*another model"):
        load_into_module(other, saved / "adamw")
    wider = build_model("gpt:layers=2,hidden=48,heads=2,vocab=64,seq=8,dropout=0.0").module
    with pytest.raises(CheckpointError, match=r"has shape \(64, 32\) in the checkpoint but \(64, 48\)"):
        load_into_module(wider, saved / "adamw")


def test_another_optimizers_checkpoint(saved):
    spec = build_model(GPT)
    adamw = torch.optim.AdamW(spec.module.parameters())
    with pytest.raises(CheckpointError, match=r"holds \['momentum_buffer'\] per parameter but this optimizer needs "
                                              r"\['exp_avg', 'exp_avg_sq', 'step'\].*another optimizer"):
        load_optimizer_state_into(adamw, spec.module, saved / "sgd")
    load_optimizer_state_into(adamw, spec.module, saved / "adamw")  # its own kind loads


@pytest.mark.parametrize("where", ["whole file", "inside the metadata"])
def test_metadata_that_would_run_code_is_refused(saved, tmp_path, where):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = _copy(saved, "adamw", tmp_path)
    pwned = tmp_path / "pwned"
    if where == "whole file":
        payload = pickle.dumps(_Evil(f"touch {pwned}"))
    else:  # a real checkpoint's metadata with one hostile field
        metadata = FileSystemReader(str(saved / "adamw")).read_metadata()
        metadata.planner_data = _Evil(f"touch {pwned}")
        payload = pickle.dumps(metadata)
    (ckpt / ".metadata").write_bytes(payload)
    for load in (lambda: checkpoint_keys(ckpt), lambda: load_into_module(build_model(GPT).module, ckpt)):
        with pytest.raises(CheckpointError, match=r"\.metadata refers to posix\.system, .*refused"):
            load()
        assert not pwned.exists()
    # The payload is live: torch's own reader (plain pickle) runs it.
    try:
        FileSystemReader(str(ckpt)).read_metadata()
    except Exception:  # noqa: BLE001 - what os.system returned is no metadata
        pass
    assert pwned.exists()


def _train_state_case(root: str, pwned: str):
    """One rank: save a checkpoint directory, then load it after replacing its train state and
    then its .metadata by pickles that would run code."""
    from partitioner import Job, Training
    from partitioner.api.auto import auto_parallelize
    from runtime.checkpoint import directory as cd

    trainer = auto_parallelize(GPT, local_cluster(1), training=Training(global_batch=2), fix="dp=1",
                               job=Job(timeout_s=60))
    spec = build_model(GPT)
    trainer.train_step(spec.example_inputs({"batch": 2}, seed=0))
    path = trainer.save(root)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    saved_path = trainer.save(root)  # the generator as it was just above
    assert saved_path == path
    state = trainer.load(root)
    out = {"step": state.step, "rng_restored": bool(torch.equal(torch.rand(3), expected))}
    shared = path / cd.STATE_DIR / cd.SHARED_FILE
    original = shared.read_bytes()
    torch.save({"step": 1, "extra": _Evil(f"touch {pwned}")}, shared)
    try:
        trainer.load(root)
    except CheckpointError as exc:
        out["train_state"] = str(exc)
    shared.write_bytes(original)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(f"touch {pwned}")))
    try:
        trainer.load(root)
    except CheckpointError as exc:
        out["metadata"] = str(exc)
    out["pwned"] = os.path.exists(pwned)
    return out


def test_train_state_and_metadata_of_a_checkpoint_directory_run_no_code(tmp_path):
    (out,) = spawn(_train_state_case, 1, str(tmp_path / "root"), str(tmp_path / "pwned"), timeout_s=240)
    assert out["step"] == 1 and out["rng_restored"], out
    assert "train_state/shared.pt is truncated, damaged or holds more than tensors" in out.get("train_state", ""), out
    assert "GLOBAL posix.system" in out["train_state"], out
    assert "refers to posix.system" in out.get("metadata", ""), out
    assert not out["pwned"]
