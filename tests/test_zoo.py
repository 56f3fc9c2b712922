"""The model zoo and spec strings: every builder builds on ``meta`` quickly with the expected
parameter count, specs round-trip, bad specs fail with messages that say what to write."""

import pytest
import torch

from partitioner.errors import ModelSpecError
from partitioner.inputs.model_spec import ModelSpec
from partitioner.inputs.models import build_model, format_spec, known_models, model_keys, parse_spec

ZOO = ("gpt", "llama", "bert", "mlp", "resnet")
HF = ("hf-gpt2", "hf-llama", "hf-bert")


def _params(spec: ModelSpec) -> int:
    return sum(p.numel() for p in spec.module.parameters())


def test_known_models_lists_every_builder_with_help():
    models = known_models()
    assert set(ZOO + HF) <= models.keys()
    assert all(text.strip() for text in models.values())


@pytest.mark.parametrize("name", ZOO + HF)
def test_default_spec_builds_on_meta_with_inputs_and_dims(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    spec = build_model(name, device="meta")
    assert spec.name == name
    assert all(p.device.type == "meta" for p in spec.module.parameters())
    assert _params(spec) > 0
    assert "batch" in spec.dims and all(s.shape[0] == "batch" for s in spec.inputs)
    # Every named dim has a default, so example inputs need no arguments.
    assert len(spec.example_inputs()) == len(spec.inputs)


def test_gpt3_175b_builds_on_meta_without_weights():
    # Build time (well under a second) is printed by bench/analyze_speed.py, not asserted here.
    h, layers, vocab, seq = 12288, 96, 51200, 2048
    spec = build_model(f"gpt:layers={layers},hidden={h},heads=96,vocab={vocab},seq={seq}", device="meta")
    assert all(p.device.type == "meta" for p in spec.module.parameters())
    # Public formula (tied head): 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h)).
    expected = 12 * layers * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))
    assert _params(spec) == pytest.approx(174.6e9, rel=1e-3)
    assert _params(spec) == pytest.approx(expected, rel=1e-6)


def test_llama_70b_builds_on_meta_with_gqa_parameter_count():
    L, h, heads, kv, V, ffn = 80, 8192, 64, 8, 128256, 28672
    spec = build_model(f"llama:layers={L},hidden={h},heads={heads},kv_heads={kv},vocab={V},seq=4096,"
                       f"intermediate={ffn}", device="meta")
    kv_dim = h // heads * kv
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * ffn + 2 * h  # q,o + k,v + SwiGLU + 2 RMSNorms
    assert _params(spec) == L * per_layer + 2 * V * h + h  # untied embed + head, final norm
    assert _params(spec) == pytest.approx(70.55e9, rel=1e-3)  # Llama 3 70B


def test_llama_default_intermediate_is_swiglu_width():
    spec = build_model("llama:hidden=96,heads=4,kv_heads=4", device="meta")
    up = spec.module.blocks[0].mlp.up_proj.weight
    assert up.shape == (256, 96)  # 8/3 * 96 = 256, a multiple of 32


def test_bert_large_parameter_count():
    L, h, V, s = 24, 1024, 30522, 512
    spec = build_model(f"bert:layers={L},hidden={h},heads=16,vocab={V},seq={s}", device="meta")
    emb = (V + s + 2) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * (4 * h * h) + 4 * h + h + 4 * h  # attn, MLP weights+biases, 2 LNs
    head = h * h + h + 2 * h + V  # dense, LN, decoder bias (weight tied)
    assert _params(spec) == emb + L * layer + head


def test_resnet_stages_and_widths():
    spec = build_model("resnet:blocks=2-2-2,widths=16,image=32,classes=7", device="meta")
    assert [len(stage) for stage in spec.module.stages] == [2, 2, 2]
    assert spec.module.fc.weight.shape == (7, 64)  # widths double per stage: 16, 32, 64
    assert spec.inputs[0].shape == ("batch", 3, 32, 32)


def test_hf_keys_go_to_the_config():
    pytest.importorskip("transformers")
    spec = build_model("hf-gpt2:n_layer=3,n_embd=32,n_head=4,vocab_size=50,n_positions=16,seq=8,batch=5",
                       device="meta")
    assert len(spec.module.transformer.h) == 3
    assert spec.module.config.n_embd == 32 and spec.module.config.use_cache is False
    assert spec.dims == {"batch": 5, "seq": 8}
    with pytest.raises(ModelSpecError, match=r"unknown key 'n_layers'.*did you mean n_layer"):
        build_model("hf-gpt2:n_layers=2", device="meta")
    with pytest.raises(ModelSpecError, match=r"seq=100 exceeds n_positions=64"):
        build_model("hf-gpt2:seq=100", device="meta")


@pytest.mark.parametrize("text", [
    "gpt",
    "gpt:layers=2,hidden=128",
    "gpt:dropout=0.25,vocab=50257",
    "resnet:blocks=2-2-2,widths=16-32-64",
    "hf-gpt2:n_layer=2,scale_attn_weights=false,layer_norm_epsilon=1e-05",
])
def test_spec_round_trips(text):
    name, kwargs = parse_spec(text)
    assert format_spec(name, kwargs) == text
    assert parse_spec(format_spec(name, kwargs)) == (name, kwargs)


def test_spec_values_are_typed():
    assert parse_spec("x:a=2,b=0.5,c=true,d=gelu,e=1e-5") == (
        "x", {"a": 2, "b": 0.5, "c": True, "d": "gelu", "e": 1e-5})


@pytest.mark.parametrize("text, message", [
    ("gpt:layers", r"malformed item 'layers' .*key=value"),
    ("gpt:layers=2,,=3", r"malformed item '=3' .*key=value"),
    ("gptx", r"unknown model 'gptx'.*did you mean 'gpt'\?.*known models: .*llama.*path/to/file.py:factory"),
    ("gpt:foo=1", r"unknown key 'foo' for model 'gpt'; its keys are: layers, hidden, heads"),
    ("gpt:hiden=64", r"unknown key 'hiden' for model 'gpt'; did you mean 'hidden'\?"),
    ("gpt:layers=2,layers=3", r"key 'layers' is given twice"),
    (":layers=2", r"no model name"),
    ("", r"empty model spec"),
    ("gpt:hidden=100,heads=3", r"hidden=100 must be divisible by heads=3"),
    ("llama:heads=4,kv_heads=3", r"heads=4 must be a multiple of kv_heads=3"),
    ("mlp:loss=l1", r"loss='l1' is not supported; use loss=mse or loss=ce"),
    ("resnet:blocks=2-2,widths=8-16-32", r"same number of stages"),
])
def test_malformed_specs_say_what_to_write(text, message):
    with pytest.raises(ModelSpecError, match=message):
        build_model(text, device="meta")


def test_model_keys():
    assert model_keys("gpt") == ("layers", "hidden", "heads", "vocab", "seq", "dropout", "batch")
    assert model_keys("hf-gpt2") is None  # checked against the HF config instead


MODEL_FILE = '''
import torch
from torch import nn
from partitioner.inputs.model_spec import ModelSpec
from passes.ir.meta import InputSpec

def make_model():
    return ModelSpec(name="mine", module=nn.Linear(6, 3), dims={"batch": 4},
                     inputs=(InputSpec(name="x", shape=("batch", 6)),),
                     loss=lambda m, x: m(x).square().mean())

def not_a_spec():
    return 42
'''


def test_model_from_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    spec = build_model(f"{path}:make_model")
    assert spec.name == f"{path}:make_model"
    x, = spec.example_inputs()
    assert x.shape == (4, 6)
    assert spec.loss(spec.module, x).shape == ()
    with pytest.raises(ModelSpecError, match="no function 'missing'"):
        build_model(f"{path}:missing")
    with pytest.raises(ModelSpecError, match="returned int; it must return a partitioner.inputs.model_spec.ModelSpec"):
        build_model(f"{path}:not_a_spec")
    with pytest.raises(ModelSpecError, match="names a file but no factory"):
        build_model(f"{path}:")
    with pytest.raises(ModelSpecError, match="does not exist"):
        build_model(f"{tmp_path / 'nope.py'}:make_model")


def test_cpu_build_is_seeded():
    a = build_model("mlp:layers=1,hidden=8,in_features=4,out_features=2", seed=3)
    b = build_model("mlp:layers=1,hidden=8,in_features=4,out_features=2", seed=3)
    c = build_model("mlp:layers=1,hidden=8,in_features=4,out_features=2", seed=4)
    assert torch.equal(a.module.out.weight, b.module.out.weight)
    assert not torch.equal(a.module.out.weight, c.module.out.weight)
