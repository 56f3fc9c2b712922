"""A user's first run: their launcher, an empty calibration cache, no cluster given.

The job calibrates this machine with its own ranks (no process of ours is started from inside a
rank), caches it, and trains; the second run reads the cache. A process the project starts from
inside a torchrun rank inherits none of torchrun's rendezvous variables.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from partitioner.calibration.cache import CACHE_DIR_ENV

from partitioner.cost.cluster import CLUSTER_FILE_ENV
from passes.ir.launcher_env import is_launcher_var, scrubbed_env
from runtime.dist.launch import spawn
from partitioner.calibration.job_cluster import local_cluster

ROOT = Path(__file__).resolve().parents[1]
CALIBRATING = "calibrating inside the job"


def _readme_torchrun() -> list[str]:
    """The README's first torchrun command, as a user copies it (``torchrun`` is the launcher
    of this Python: ``python -m torch.distributed.run``)."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("torchrun --nproc-per-node 2 -m partitioner train"):
            words = shlex.split(line.split("#")[0])
            return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    raise AssertionError("README.md has no 'torchrun --nproc-per-node 2 -m partitioner train' line")


def _fresh_env(cache: Path) -> dict[str, str]:
    """The environment of a user who never calibrated: no cluster file, an empty cache."""
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_FILE_ENV and not is_launcher_var(k)}
    env[CACHE_DIR_ENV] = str(cache)
    env["PYTHONPATH"] = str(ROOT)
    return env


def _corpus(path: Path) -> Path:
    """A user's text file: the stdlib text the demo trains on (``partitioner.cli.corpus``)."""
    from partitioner.cli.corpus import corpus_bytes

    path.write_bytes(corpus_bytes()[:200_000])
    return path


@pytest.mark.slow
def test_readme_torchrun_on_an_empty_cache_calibrates_inside_the_job_then_reuses_it(tmp_path):
    cmd = _readme_torchrun()
    _corpus(tmp_path / "corpus.txt")
    env = _fresh_env(tmp_path / "cache")
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert first.returncode == 0, f"{first.stdout[-3000:]}\n{first.stderr[-5000:]}"
    assert first.stderr.count(CALIBRATING) == 1, first.stderr[-3000:]  # one line, from rank 0
    assert re.search(r"calibrated this machine inside the job in \d+ s; cached in ", first.stderr)
    cached = sorted((tmp_path / "cache").glob("local-w2-*.yaml"))
    assert len(cached) == 1, sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert "loss" in first.stdout and "plan: dp=2" in first.stdout
    assert "Warning" not in first.stderr, first.stderr[-3000:]

    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert second.returncode == 0, second.stderr[-5000:]
    assert CALIBRATING not in second.stderr and "calibrated this machine" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.count("partitioner: detected cluster: 1 node(s) x 2 ") == 1, second.stderr[-3000:]
    assert sorted((tmp_path / "cache").glob("local-w2-*.yaml")) == cached


def _spawned_user_script(cache: str) -> tuple[str, float, list[str]]:
    """A user's own rank function: ``auto_parallelize`` with ``local_cluster(2)`` on a fresh cache."""
    import torch

    from partitioner import Training
    from partitioner.api.auto import auto_parallelize

    os.environ.pop(CLUSTER_FILE_ENV, None)
    os.environ[CACHE_DIR_ENV] = cache
    trainer = auto_parallelize("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16,dropout=0.0", local_cluster(2),
                               training=Training(global_batch=4), fix="dp=2")
    batch = trainer.spec.example_inputs({"batch": 4}, seed=0)
    loss = trainer.train_step(batch)
    assert torch.isfinite(torch.tensor(loss))
    # plan.json carries the cluster the job found (the plan round-trips through its JSON)
    from passes.ir.plan import Plan

    assert Plan.from_json(trainer.plan.to_json()).cluster_spec == trainer.cluster.to_dict()
    return trainer.cluster.name, loss, sorted(os.listdir(cache))


@pytest.mark.slow
def test_auto_parallelize_in_spawned_ranks_calibrates_with_them_then_reuses_it(tmp_path, capfd):
    cache = tmp_path / "cache"
    results = spawn(_spawned_user_script, 2, str(cache), timeout_s=400)
    (name0, loss0, files0), (name1, loss1, _) = results
    assert name0 == name1 == "local-calibrated+refit"  # measured, refitted to the reference runs, on every rank
    assert loss0 == loss1
    assert any(f.startswith("local-w2-") and f.endswith(".yaml") for f in files0)
    assert capfd.readouterr().err.count(CALIBRATING) == 1

    again = spawn(_spawned_user_script, 2, str(cache), timeout_s=400)
    assert [r[1] for r in again] == [loss0, loss0]
    assert CALIBRATING not in capfd.readouterr().err


def _child_env() -> dict[str, str]:
    return dict(os.environ)


def _rank_starts_a_job(out: str) -> None:
    """Inside a torchrun rank: start a job of our own, record what its rank saw."""
    import json

    parent = {k: v for k, v in os.environ.items() if is_launcher_var(k)}
    (child,) = spawn(_child_env, 1, timeout_s=120)
    dot = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                         env=scrubbed_env(), capture_output=True, text=True, check=True).stdout
    Path(out).write_text(json.dumps({"parent": parent, "child": child, "subprocess": json.loads(dot)}))


@pytest.mark.slow
def test_a_process_started_inside_a_torchrun_rank_sees_none_of_its_rendezvous(tmp_path):
    import json

    out = tmp_path / "env.json"
    script = tmp_path / "rank.py"
    # the repository root only: with tests/ first on the path, tests/passes would shadow passes
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                      f"from tests.test_first_run import _rank_starts_a_job\n"
                      f"if __name__ == '__main__':\n    _rank_starts_a_job({str(out)!r})\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(script)],
                          env=_fresh_env(tmp_path / "cache"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert seen["parent"].get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # it was a torchrun rank
    leaked = {k for k in seen["child"] if k.startswith("TORCHELASTIC_")}
    assert not leaked, leaked
    assert seen["child"]["MASTER_PORT"] != seen["parent"]["MASTER_PORT"]  # a job of its own
    assert not {k for k in seen["subprocess"] if is_launcher_var(k)}


def test_scrubbed_env_drops_exactly_the_launcher_variables():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "PATH": "/bin", "OMP_NUM_THREADS": "1", "PARTITIONER_CACHE_DIR": "/c"}
    assert scrubbed_env(env) == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PARTITIONER_CACHE_DIR": "/c"}


def test_the_help_of_the_command_line_loads_neither_torch_nor_sympy():
    code = ("import sys; from partitioner.cli.main import build_parser; build_parser().format_help(); "
            "heavy = sorted(m for m in ('torch', 'sympy') if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_script_without_a_main_guard_is_told_so_instead_of_hanging(tmp_path):
    """``local_cluster(3)`` at a script's top level, on an empty cache: each calibration rank
    re-imports the script and would wait for ever on the lock its parent holds; instead it fails
    at once, naming the fix."""
    script = tmp_path / "train.py"
    script.write_text("from partitioner import local_cluster\nlocal_cluster(3)\n")
    run = subprocess.run([sys.executable, str(script)], env=_fresh_env(tmp_path / "cache"), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0
    assert "LaunchError: local_cluster(3) was called while this process was being started as a rank" in run.stderr
    assert 'if __name__ == "__main__":' in run.stderr


def test_a_calibration_lock_held_elsewhere_is_waited_for_a_bounded_time(tmp_path):
    from filelock import FileLock

    from partitioner.calibration.cache import exclusive_lock
    from passes.ir.errors import ClusterSpecError

    path = tmp_path / "local.yaml"
    with FileLock(str(path) + ".lock"):
        with pytest.raises(ClusterSpecError, match=r"waited 0 s for another process's calibration .*local.yaml.lock"):
            with exclusive_lock(path, timeout_s=0.2):
                pass
    with exclusive_lock(path, timeout_s=0.2):  # free again
        pass
