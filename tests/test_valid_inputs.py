"""Valid inputs in every form the README lists, and bad batches refused at the door.

* ``path/to/file.py:factory`` through ``partitioner plan`` and ``partitioner train`` (CLI
  subprocesses), the factory returning a ModelSpec or a dict of module, inputs, loss_fn, dims;
* ``partitioner.plan`` / ``partitioner.analyze`` of a spec string, a ModelSpec and a model
  object alike (a Hugging Face GPT-2 planned on the ``dgx-h100`` preset);
* the zoo ``mlp`` (no sequence dim) through ``auto_parallelize`` on 2 gloo ranks, with tuple and
  dict batches, matching one-device training step for step;
* a table of bad batches against a captured contract (:func:`runtime.exec.batch_check.check_batch`,
  no processes), and one spawned job where a bad batch fails on every rank with the same
  message before any collective, and the next good step still trains.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import partitioner
from partitioner.errors import ConfigError
from partitioner.inputs.models import as_spec, build_model
from passes.capture.capture import capture_spec
from passes.ir.meta import CAPTURE, DimBound, InputBounds, InputSpec
from passes.ir.plan import Plan
from runtime.exec.batch_check import check_batch
from runtime.dist.launch import spawn
from tests.train_cli import launch_train, outputs_of_success

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
MLP = "mlp:layers=2,hidden=32,in_features=16,out_features=4,loss=ce"
ROOT = Path(__file__).resolve().parents[1]

MODEL_FILE = '''
import torch
import torch.nn.functional as F
from torch import nn

from partitioner.inputs.models import as_spec, build_model
from passes.ir.meta import InputSpec


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def loss(model, idx, targets):
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten(0, 1))


def make_dict():
    """A module + its inputs, the loss and the dims' sizes."""
    inputs = (InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=32),
              InputSpec(name="targets", shape=("batch", "seq"), dtype=torch.long, high=32))
    return {"module": Tiny(), "inputs": inputs, "loss_fn": loss, "dims": {"seq": 8}}


def make_spec():
    return build_model("GPT_SPEC")
'''.replace("GPT_SPEC", GPT)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user_model") / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "partitioner", *args], capture_output=True, text=True, check=False,
                          timeout=timeout, env=env, cwd=ROOT)


# ---------------------------------------------------------------------------------------------
# file.py:factory through the CLI

def test_plan_cli_takes_a_file_factory(model_file):
    spec = f"{model_file}:make_dict"
    out = _cli("plan", "--model", spec, "--cluster", "dgx-h100", "--global-batch", "8", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    chosen = Plan.from_json(out.stdout)
    assert chosen.model == spec and chosen.world_size == 8
    assert len(chosen.stages) == chosen.pp


def test_plan_cli_refuses_a_missing_factory_cleanly(model_file):
    out = _cli("plan", "--model", f"{model_file}:nope", "--cluster", "dgx-h100", "--global-batch", "8")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "has no function 'nope'" in out.stderr + out.stdout


def test_train_cli_takes_a_file_factory(model_file):
    results = launch_train(2, ["--model", f"{model_file}:make_spec", "--global-batch", "4", "--steps", "2",
                               "--timeout", "60"])
    outs = outputs_of_success(results)
    assert "step   2/2" in outs[0]
    assert "plan: " in outs[0]


# ---------------------------------------------------------------------------------------------
# partitioner.plan / analyze of any model form

def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    inputs = (InputSpec(name="input_ids", shape=("batch", "seq"), dtype=torch.long, high=128),
              InputSpec(name="labels", shape=("batch", "seq"), dtype=torch.long, high=128))

    def loss(module, input_ids, labels):
        return module(input_ids=input_ids, labels=labels, use_cache=False).loss

    return model, inputs, loss


def test_plan_of_a_hugging_face_model_object_on_a_preset():
    model, inputs, loss = _hf_gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    chosen = partitioner.plan(partitioner.ModelSpec(module=model, inputs=inputs, loss=loss, dims={"seq": 32}),
                              "dgx-h100", training=partitioner.Training(global_batch=8))
    assert chosen.world_size == 8 and chosen.global_batch == 8
    assert chosen.model == "GPT2LMHeadModel"
    assert chosen.predicted.step_time_s > 0
    # planned from a meta copy: the caller's weights are untouched, still real, still fp32
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32 and torch.equal(p, before[n]), n


def test_plan_takes_a_spec_string_and_a_model_spec_alike():
    fp32 = partitioner.Training(global_batch=8, dtype="fp32")
    by_string = partitioner.plan(GPT, "dgx-h100", training=fp32)
    by_spec = partitioner.plan(build_model(GPT), "dgx-h100", training=fp32)
    assert by_spec.knobs() == by_string.knobs()
    assert by_spec.predicted.peak_memory_bytes == pytest.approx(by_string.predicted.peak_memory_bytes, rel=0.05)


def test_plan_of_a_model_without_a_sequence_dim():
    for model in (MLP, build_model(MLP)):
        chosen = partitioner.plan(model, "dgx-h100", training=partitioner.Training(global_batch=8))
        assert chosen.world_size == 8


def test_analyze_takes_a_module_with_inputs():
    spec = build_model(GPT)
    by_module = partitioner.analyze(partitioner.ModelSpec(module=spec.module, inputs=spec.inputs, loss=spec.loss,
                                                          dims={"seq": 8}), batch=2)
    by_string = partitioner.analyze(GPT, batch=2)
    assert by_module.param_count == by_string.param_count
    assert by_module.fwd_flops == by_string.fwd_flops
    with pytest.raises(ConfigError, match=r"bare nn\.Module \(GPT\) does not say its inputs or its loss; wrap it in "
                                          r"a ModelSpec"):
        partitioner.analyze(spec.module)


# ---------------------------------------------------------------------------------------------
# What capture records of the batches a graph takes

@pytest.fixture(scope="module")
def gpt_contract():
    spec = build_model(GPT)
    info = capture_spec(spec, dims={"batch": 2}, symbolic=("batch", "seq")).meta[CAPTURE]
    return info.inputs, info.bounds


def test_capture_records_position_and_token_bounds(gpt_contract):
    _, bounds = gpt_contract
    assert bounds.dim("seq").high == 8 and "wpe.weight" in bounds.dim("seq").reason
    assert bounds.value("idx").high == 64 and bounds.value("idx").allowed == ()
    assert bounds.value("targets").high == 64 and bounds.value("targets").allowed == (-100,)  # cross_entropy's


def test_capture_records_the_export_guard_of_hugging_face_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=128, max_position_embeddings=16)
    inputs = (InputSpec(name="input_ids", shape=("batch", "seq"), dtype=torch.long),
              InputSpec(name="labels", shape=("batch", "seq"), dtype=torch.long))
    spec = as_spec(
        transformers.BertForMaskedLM(config), inputs=inputs, dims={"seq": 8},
        loss_fn=lambda m, ids, labels: m(input_ids=ids, labels=labels).loss)
    bounds = capture_spec(spec, dims={"batch": 2}, symbolic=("batch", "seq")).meta[CAPTURE].bounds
    assert bounds.dim("seq").high == 16
    assert bounds.value("input_ids").high == 128  # no InputSpec.high given: read from the embedding
    with pytest.raises(ConfigError, match=r"input 'input_ids' has seq=17 outside the model's seq <= 16"):
        check_batch(inputs, (torch.zeros(2, 17, dtype=torch.long),) * 2, batch_size=2, bounds=bounds)


# ---------------------------------------------------------------------------------------------
# Bad batches: one ConfigError naming the input, the expected shape, what it got and the fix

def _ids(*shape, value=1, dtype=torch.long):
    return torch.full(shape, value, dtype=dtype)


def _good():
    return _ids(4, 8), _ids(4, 8)


BAD_BATCHES = [
    ("one tensor", lambda: (_ids(4, 8),), r"the batch has 1 tensor\(s\); expected 2: idx \(batch, seq\) int64"),
    ("three tensors", lambda: _good() + (_ids(4, 8),), r"the batch has 3 tensor\(s\); expected 2"),
    ("a bare tensor", lambda: _ids(4, 8), r"the batch is a Tensor; expected a tuple or a dict"),
    ("dict without targets", lambda: {"idx": _ids(4, 8)}, r"the batch has no input\(s\) \['targets'\]"),
    ("dict with an unknown key", lambda: {"idx": _ids(4, 8), "targets": _ids(4, 8), "attention_mask": _ids(4, 8)},
     r"input\(s\) \['attention_mask'\] the model does not take"),
    ("a list instead of a tensor", lambda: ([[1] * 8] * 4, _ids(4, 8)), r"input 'idx' is a list, not a tensor"),
    ("ids of rank 1", lambda: (_ids(32), _ids(4, 8)),
     r"input 'idx' has 1 dims, the model takes 2; expected shape \(batch=4, seq<=8\) int64, got \(32,\) int64"),
    ("ids of rank 3", lambda: (_ids(4, 8, 1), _ids(4, 8)), r"input 'idx' has 3 dims, the model takes 2"),
    ("seq disagrees between inputs", lambda: (_ids(4, 8), _ids(4, 6)),
     r"input 'targets' has seq=6 but seq=8 in input 'idx'; expected shape \(batch=4, seq=8\)"),
    ("batch is not the global batch", lambda: (_ids(3, 8), _ids(3, 8)),
     r"input 'idx' has batch=3 samples but the global batch is 4.*Fix: pass 4 samples"),
    ("sequence longer than the positions", lambda: (_ids(4, 16), _ids(4, 16)),
     (r"input 'idx' has seq=16 outside the model's seq <= 8 \(positions index the embedding wpe.weight of 8 "
      r"rows\).*got \(4, 16\) int64. Fix: cut seq to at most 8")),
    ("float token ids", lambda: (_ids(4, 8, dtype=torch.float32), _ids(4, 8)),
     r"input 'idx' is float32, but it is token ids / labels the model takes as int64.*Fix: cast it"),
    ("int32 token ids", lambda: (_ids(4, 8, dtype=torch.int32), _ids(4, 8)), r"input 'idx' is int32"),
    ("token id = vocab", lambda: (_ids(4, 8, value=64), _ids(4, 8)),
     r"input 'idx' holds values in \[64, 64\] outside \[0, 64\).*Fix: keep idx in \[0, 64\)"),
    ("negative token id", lambda: (_ids(4, 8, value=-1), _ids(4, 8)), r"input 'idx' holds values in \[-1, -1\]"),
    ("label = vocab", lambda: (_ids(4, 8), _ids(4, 8, value=64)),
     r"input 'targets' holds values in \[64, 64\] outside \[0, 64\) or -100, because they are class labels"),
    ("negative label other than ignore_index", lambda: (_ids(4, 8), _ids(4, 8, value=-5)),
     r"input 'targets' holds values in \[-5, -5\]"),
]


@pytest.mark.parametrize("batch, pattern", [(b, p) for _, b, p in BAD_BATCHES], ids=[n for n, _, _ in BAD_BATCHES])
def test_bad_batch_is_refused_with_the_expected_shape_and_a_fix(gpt_contract, batch, pattern):
    inputs, bounds = gpt_contract
    with pytest.raises(ConfigError, match=pattern) as info:
        check_batch(inputs, batch(), batch_size=4, bounds=bounds)
    text = str(info.value)
    if "input '" in text.split(";")[0]:  # about one input: its expected shape, what came, the fix
        assert "expected shape (" in text and ", got " in text
    assert "Fix: " in text


def test_good_batches_pass_as_tuple_or_dict(gpt_contract):
    inputs, bounds = gpt_contract
    idx, targets = _ids(4, 5, value=63), _ids(4, 5, value=-100)  # a shorter seq, ignore_index labels
    by_tuple = check_batch(inputs, (idx, targets), batch_size=4, bounds=bounds)
    by_dict = check_batch(inputs, {"targets": targets, "idx": idx}, batch_size=4, bounds=bounds)
    assert list(by_tuple) == list(by_dict) == ["idx", "targets"]
    assert by_dict["idx"] is idx and by_dict["targets"] is targets


def test_rows_of_one_rank_and_fixed_sizes():
    # train_local's rows: the inputs one stage reads, a dp rank's share of the batch
    x = InputSpec(name="x", shape=("batch", 16))
    y = InputSpec(name="y", shape=("batch",), dtype=torch.long, high=4)
    check_batch((x, y), {"y": torch.zeros(2, dtype=torch.long)}, batch_size=2, names=("y",))
    with pytest.raises(ConfigError, match=r"has batch=3 samples but global_batch // dp is 2"):
        check_batch((x, y), {"y": torch.zeros(3, dtype=torch.long)}, batch_size=2, names=("y",),
                    batch_rule="global_batch // dp")
    with pytest.raises(ConfigError, match=r"input 'x' has size 15 along dim 1, the model takes 16; "
                                          r"expected shape \(batch=2, 16\) float32"):
        check_batch((x, y), (torch.zeros(2, 15), torch.zeros(2, dtype=torch.long)), batch_size=2)
    with pytest.raises(ConfigError, match=r"input 'x' is int64, but it is a floating input"):
        check_batch((x, y), (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, dtype=torch.long)), batch_size=2)
    with pytest.raises(ConfigError, match=r"input 'y' holds values in \[4, 4\] outside \[0, 4\), because its "
                                          r"InputSpec declares values below 4"):
        check_batch((x, y), (torch.zeros(2, 16), torch.full((2,), 4)), batch_size=2)
    bounds = InputBounds(dims=(DimBound(name="seq", low=4, high=4, reason="captured with seq=4 fixed"),))
    z = InputSpec(name="z", shape=("batch", "seq"))
    with pytest.raises(ConfigError, match=r"has seq=5 outside the model's seq = 4"):
        check_batch((z,), (torch.zeros(2, 5),), batch_size=2, bounds=bounds)


# ---------------------------------------------------------------------------------------------
# mlp through auto_parallelize on 2 gloo ranks; dict batches; a bad batch on every rank

STEPS, GLOBAL_BATCH = 4, 8


def _mlp_batches():
    spec = build_model(MLP)
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=50 + k) for k in range(STEPS + 1)]


def _mlp_rank():
    from partitioner.api.auto import auto_parallelize

    trainer = auto_parallelize(MLP, training=partitioner.Training(global_batch=GLOBAL_BATCH), fix="pp=2",
                               job=partitioner.Job(timeout_s=60))
    batches = _mlp_batches()
    names = [i.name for i in trainer.model.inputs]
    losses = [trainer.train_step(b) for b in batches[:2]]  # tuples
    errors = []
    for bad in ((batches[2][0], torch.full_like(batches[2][1], 4)),  # a label = out_features
                {"x": batches[2][0]}):  # a dict without the labels
        try:
            trainer.train_step(bad)
        except ConfigError as exc:
            errors.append(str(exc))
    losses += [trainer.train_step(dict(zip(names, b))) for b in batches[2:STEPS]]  # dicts
    evaluated = trainer.eval_step(dict(zip(names, batches[STEPS])))
    return {"losses": losses, "eval": evaluated, "errors": errors, "plan": trainer.plan.summary()}


@pytest.fixture(scope="module")
def mlp_run():
    return spawn(_mlp_rank, 2, timeout_s=300)


def _mlp_reference():
    from tests.one_device import train_one_device

    spec = build_model(MLP, seed=0)
    batches = _mlp_batches()
    losses, module = train_one_device(spec, batches[:STEPS])
    with torch.no_grad():
        return losses, spec.loss(module, *batches[STEPS]).item()


def test_mlp_trains_through_auto_parallelize_with_tuple_and_dict_batches(mlp_run):
    ref_losses, ref_eval = _mlp_reference()
    assert "pp=2" in mlp_run[0]["plan"]
    for rank in mlp_run:
        # steps 0-1 took tuples, 2-3 dicts (and eval a dict): the one-device losses throughout
        assert rank["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
        assert rank["eval"] == pytest.approx(ref_eval, rel=1e-4, abs=1e-6)
    assert ref_losses[-1] < ref_losses[0]


def test_a_bad_batch_fails_on_every_rank_with_one_message(mlp_run):
    first = mlp_run[0]["errors"]
    assert len(first) == 2
    assert re.search(r"input 'y' holds values in \[4, 4\] outside \[0, 4\)", first[0])
    assert re.search(r"the batch has no input\(s\) \['y'\]", first[1])
    for rank in mlp_run[1:]:  # rank 1 (the last stage) reads only y, rank 0 only x: the same refusal
        assert rank["errors"] == first
