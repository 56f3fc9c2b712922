"""The same bad models meet the same refusal at every front door: ``analyze``, ``plan`` and
``auto_parallelize`` from Python, and ``partitioner analyze``, ``plan`` and ``train`` on the
command line (one ``error:`` line naming the cause, never a traceback).

The models are a user's own file of factories (``bad_models.py:factory``), the form every door
takes: a forward with Python side effects (a warning: the captured graph never runs them), a model
without trainable parameters, a loss that is not a scalar, a factory that raises, and a factory
whose ``module`` is not a module. ``auto_parallelize`` and ``train`` run in a process of their own
(a rank of a one-rank job), as a user runs them.
"""
from __future__ import annotations

import re
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import partitioner
from partitioner.cli.main import main
from passes.capture.training_step_checks import SideEffectWarning
from passes.ir.errors import CaptureError, ConfigError, ModelSpecError
from runtime.dist.launch import spawn
from tests.train_cli import launch_train

MODELS = textwrap.dedent('''\
    import torch
    from torch import nn
    from partitioner import InputSpec


    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.calls = 0

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return x


    class Counting(Blocks):
        def forward(self, x):
            self.calls += 1  # a Python side effect: runs while capturing, never in training
            return super().forward(x)


    class NoParams(nn.Module):
        def forward(self, x):
            return x * 2


    INPUTS = (InputSpec(name="x", shape=("batch", 8)),)


    def side_effects():
        return {"module": Counting(), "inputs": INPUTS, "loss_fn": lambda m, x: m(x).pow(2).mean()}


    def no_params():
        return {"module": NoParams(), "inputs": INPUTS, "loss_fn": lambda m, x: m(x).pow(2).mean()}


    def nonscalar():
        return {"module": Blocks(), "inputs": INPUTS, "loss_fn": lambda m, x: m(x).pow(2)}


    def raises():
        raise RuntimeError("my factory broke")


    def not_module():
        return {"module": "Blocks()", "inputs": INPUTS, "loss_fn": lambda m, x: m(x).sum()}
''')
RAISE_LINE = MODELS.splitlines().index('    raise RuntimeError("my factory broke")') + 1

# (factory, what every door raises (None: it goes on), the message's regex)
CASES = [
    ("side_effects", None, r"forward has Python side effects .* module attribute\(s\) changed: calls"),
    ("no_params", ConfigError, r"the model has no trainable parameters"),
    # (batch at its example size where the door captures it concretely, as analyze does by default)
    ("nonscalar", CaptureError, r"the loss has shape \((batch|\d+), 8\), not a scalar; reduce it in loss_fn"),
    ("raises", ModelSpecError, rf"bad_models\.py:{RAISE_LINE}: .*raises\(\) raised RuntimeError: my factory broke"),
    ("not_module", ModelSpecError, r"not_module\(\) returned a dict whose 'module' is str, not a torch\.nn\.Module"),
]
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "bad_models.py"
    path.write_text(MODELS)
    return path


def _outcome(call) -> tuple[str, str, list[str]]:
    """(the error's type name or "ok", its message, the side-effect warnings) of ``call()``."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            call()
            kind, message = "ok", ""
        except partitioner.PartitionerError as exc:
            kind, message = type(exc).__name__, str(exc)
    return kind, message, [str(w.message) for w in seen if issubclass(w.category, SideEffectWarning)]


def _auto_parallelize(spec: str):
    """In a rank of a one-rank job: what ``auto_parallelize`` says of ``spec``."""
    return _outcome(lambda: partitioner.auto_parallelize(spec, training=partitioner.Training(global_batch=2)))


@pytest.fixture(scope="module")
def api(models) -> dict[tuple[str, str], tuple[str, str, list[str]]]:
    out = {}
    for factory, _, _ in CASES:
        spec = f"{models}:{factory}"
        out["analyze", factory] = _outcome(lambda: partitioner.analyze(spec))
        out["plan", factory] = _outcome(lambda: partitioner.plan(spec, "dgx-a100-80gb", training=partitioner.Training(global_batch=8)))
    for (factory, _, _), got in zip(CASES, spawn(_run_all_auto, 1, [f"{models}:{c[0]}" for c in CASES],
                                                  timeout_s=300)[0]):
        out["auto_parallelize", factory] = got
    return out


def _run_all_auto(specs: list[str]):
    return [_auto_parallelize(s) for s in specs]


@pytest.mark.parametrize("door", ["analyze", "plan", "auto_parallelize"])
@pytest.mark.parametrize("factory, error, message", CASES, ids=IDS)
def test_every_python_front_door_refuses_alike(api, door, factory, error, message):
    kind, text, side_effects = api[door, factory]
    if error is None:
        assert kind == "ok", text
        assert any(re.search(message, w) for w in side_effects), side_effects
    else:
        assert kind == error.__name__, (kind, text)
        assert re.search(message, text), text


CLI = {
    "analyze": ["analyze"],
    "plan": ["plan", "--cluster", "dgx-a100-80gb", "--global-batch", "8"],
    "train": ["--global-batch", "2", "--steps", "1", "--timeout", "60"],
}


def _cli_in_process(argv: list[str], capsys) -> tuple[int, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # as outside pytest: a warning is printed on stderr
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def _cli_process(argv: list[str]) -> tuple[int, str]:
    """``partitioner train`` as the one rank of a launched job (the environment torchrun gives it)."""
    (code, _, err), = launch_train(1, argv, timeout_s=300)
    return code, err


@pytest.fixture(scope="module")
def trained(models) -> dict[str, tuple[int, str]]:
    """``partitioner train`` of every case, as the processes a user starts (a few at a time)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = pool.map(lambda c: _cli_process([*CLI["train"], "--model", f"{models}:{c[0]}"]), CASES)
        return dict(zip(IDS, runs))


@pytest.mark.parametrize("command", ["analyze", "plan", "train"])
@pytest.mark.parametrize("factory, error, message", CASES, ids=IDS)
def test_every_command_refuses_alike_in_one_line(models, trained, capsys, command, factory, error, message):
    if command == "train":
        code, err = trained[factory]
    else:  # the command's own code, in this process: no interpreter start per row
        code, err = _cli_in_process([*CLI[command], "--model", f"{models}:{factory}"], capsys)
    assert "Traceback" not in err, err
    if error is None:
        assert code == 0, err
        assert re.search(message, err), err  # the warning reaches the user
    else:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1, err
        assert re.search(message, errors[0]), errors[0]
