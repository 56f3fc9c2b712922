"""Hugging Face ``transformers`` models built from small configs (no download, random weights):
``hf-gpt2``, ``hf-llama``, ``hf-bert``, and mixture-of-experts families (``hf-qwen3-moe``,
``hf-mixtral``, ``hf-olmoe``, ``hf-lfm2-moe``, ``hf-deepseek-v3``, ``hf-qwen2-moe``). Spec keys go straight to the HF config (its own names,
e.g. ``hf-gpt2:n_layer=2,n_embd=64``), except ``batch`` and ``seq``, which are the default dims.

The loss is the model's own (``labels=``), with ``use_cache=False`` so the step returns no
key/value cache. ``transformers`` is optional (the ``test`` extra) and imported only here.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from passes.ir.errors import ModelSpecError
from partitioner.inputs.model_spec import ModelSpec
from partitioner.zoo.registry import register
from passes.ir.meta import InputSpec
from partitioner.inputs.spec_keys import COUNT, Divisible, SpecTable

_DIM_KEYS = ("batch", "seq")


@dataclass(frozen=True)
class _HFModel:
    """How to build one HF model family: its classes, small defaults and training-step inputs."""

    spec_name: str
    config_class: str
    model_class: str
    defaults: dict[str, Any]
    vocab_key: str
    positions_key: str
    token_types: bool  # BERT takes token_type_ids
    rules: tuple[Divisible, ...] = ()
    """Rules across the config's keys (checked before the config is made, with its names)."""
    experts: str | None = None
    """MoE families: the HF experts implementation captured. ``batched_mm`` gathers each (token,
    choice)'s expert weights and runs one bmm (static shapes, FLOPs at the routed token count); the
    default ``grouped_mm`` captures as an opaque custom op that counts 0 FLOPs."""
    mixed_layers: bool = False
    """Its layers differ (dense ones first, or several kinds): profiled whole, not from a sample."""
    layer_pattern: tuple[str, ...] = ()
    """Hybrid families: ``config.layer_types`` when the spec does not give it, this pattern repeated
    over ``num_hidden_layers`` (the config has no default of its own)."""


_MODELS = {
    "hf-gpt2": _HFModel("hf-gpt2", "GPT2Config", "GPT2LMHeadModel",
                        dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64),
                        vocab_key="vocab_size", positions_key="n_positions", token_types=False,
                        rules=(Divisible("n_embd", "n_head"),)),
    "hf-llama": _HFModel("hf-llama", "LlamaConfig", "LlamaForCausalLM",
                         dict(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
                         vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                         rules=(Divisible("hidden_size", "num_attention_heads"),
                                Divisible("num_attention_heads", "num_key_value_heads", says="a multiple of"))),
    "hf-bert": _HFModel("hf-bert", "BertConfig", "BertForMaskedLM",
                        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256, num_attention_heads=2,
                             vocab_size=128, max_position_embeddings=64),
                        vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=True,
                        rules=(Divisible("hidden_size", "num_attention_heads"),)),
}

_MOE_RULES = (Divisible("hidden_size", "num_attention_heads"),
              Divisible("num_attention_heads", "num_key_value_heads", says="a multiple of"))
# Mixture-of-experts families: tiny configs, the router's aux loss in the model's loss.
_MODELS.update({
    "hf-qwen3-moe": _HFModel("hf-qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                             dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                              max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True, num_experts=4, moe_intermediate_size=96, intermediate_size=128,
                                  head_dim=16),
                             vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                             rules=_MOE_RULES, experts="batched_mm"),
    "hf-mixtral": _HFModel("hf-mixtral", "MixtralConfig", "MixtralForCausalLM",
                           dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                              max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True, num_local_experts=4, intermediate_size=96),
                           vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                           rules=_MOE_RULES, experts="batched_mm"),
    "hf-olmoe": _HFModel("hf-olmoe", "OlmoeConfig", "OlmoeForCausalLM",
                         dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                              max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True, num_experts=4, intermediate_size=96),
                         vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                         rules=_MOE_RULES, experts="batched_mm"),
    # sigmoid routing chosen by scores plus a per-expert bias, weights gathered from the plain
    # scores, no aux loss (the bias balances); short-conv and attention layers, dense layers first
    "hf-lfm2-moe": _HFModel("hf-lfm2-moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                            dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=128, max_position_embeddings=64, num_experts_per_tok=2, num_experts=4,
                                 moe_intermediate_size=96, intermediate_size=128, num_dense_layers=1),
                            vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                            rules=_MOE_RULES, experts="batched_mm", layer_pattern=("conv", "full_attention", "conv"),
                            mixed_layers=True),
    # DeepSeek-V3: multi-head latent attention, group-limited sigmoid routing with a bias,
    # a shared expert, dense layers first
    "hf-deepseek-v3": _HFModel("hf-deepseek-v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                               dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                    vocab_size=128, max_position_embeddings=64, num_experts_per_tok=2,
                                    n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
                                    first_k_dense_replace=1, moe_intermediate_size=32, intermediate_size=128,
                                    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                    v_head_dim=16),
                               vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                               rules=_MOE_RULES, experts="batched_mm", mixed_layers=True),
    "hf-qwen2-moe": _HFModel("hf-qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                             dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                              max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True, num_experts=4, moe_intermediate_size=96,
                                  shared_expert_intermediate_size=128, intermediate_size=128),
                             vocab_key="vocab_size", positions_key="max_position_embeddings", token_types=False,
                             rules=_MOE_RULES, experts="batched_mm"),
})


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("hf-* models need Hugging Face transformers; install it with "
                             "`pip install 'transformers>=5,<6'` (or `pip install -e '.[test]'`)") from None
    return transformers


def import_model_classes() -> None:
    """Import every family's config and model classes (``transformers`` loads each model's
    module on first use, seconds per family): what a fork server preloads so that its ranks do
    not each import them (:func:`runtime.dist.launch.preload`)."""
    transformers = _import_transformers()
    for kind in _MODELS.values():
        getattr(transformers, kind.config_class), getattr(transformers, kind.model_class)


def _config_errors() -> tuple[type[Exception], ...]:
    """What a config raises for a bad field: ValueError/TypeError, or huggingface_hub's strict
    dataclass validation (transformers 5 configs), which derives from neither."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (TypeError, ValueError)
    return (TypeError, ValueError, StrictDataclassError)


def _config_keys(config_cls: type) -> set[str]:
    """Every key the config accepts: its constructor's named arguments and their aliases."""
    params = inspect.signature(config_cls.__init__).parameters
    keys = {n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return keys | set(getattr(config_cls, "attribute_map", {}))


def _build(kind: _HFModel, kwargs: dict[str, Any]) -> ModelSpec:
    transformers = _import_transformers()
    config_cls = getattr(transformers, kind.config_class)
    model_cls = getattr(transformers, kind.model_class)
    dims = {k: kwargs.pop(k) for k in _DIM_KEYS if k in kwargs}
    known = _config_keys(config_cls)
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ModelSpecError(f"{kind.spec_name}: unknown key {key!r} (not a {kind.config_class} field "
                                 f"nor batch/seq){hint}")
    values = {**kind.defaults, **kwargs}
    if kind.layer_pattern and "layer_types" not in values:
        values["layer_types"] = [kind.layer_pattern[i % len(kind.layer_pattern)]
                                 for i in range(values["num_hidden_layers"])]
    # GPT-2's default special token ids (50256) lie outside a small vocab; keep them in range.
    params = inspect.signature(config_cls.__init__).parameters
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        default = params[tok].default if tok in params else None
        if tok not in values and isinstance(default, int) and default >= values[kind.vocab_key]:
            values[tok] = values[kind.vocab_key] - 1
    try:
        config = config_cls(**values)
    except _config_errors() as exc:  # the config's own field checks (types, ranges)
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ModelSpecError(f"{kind.spec_name}: {kind.config_class} refuses {given or 'its defaults'}: "
                             f"{str(exc).strip().splitlines()[-1].strip()}; fix that key") from None
    vocab = getattr(config, kind.vocab_key)
    config.use_cache = False
    # SDPA exports with torch.export and keeps seq symbolic; eager would too, but is slower.
    config._attn_implementation = "sdpa"
    if kind.experts is not None:
        config._experts_implementation = kind.experts
    module = model_cls(config)
    seq = dims.get("seq", min(32, getattr(config, kind.positions_key)))
    if seq > getattr(config, kind.positions_key):
        raise ModelSpecError(f"{kind.spec_name}: seq={seq} exceeds {kind.positions_key}="
                             f"{getattr(config, kind.positions_key)}; raise {kind.positions_key}")
    inputs = [InputSpec(name="input_ids", shape=("batch", "seq"), dtype=torch.long, high=vocab)]
    if kind.token_types:
        inputs.append(InputSpec(name="token_type_ids", shape=("batch", "seq"), dtype=torch.long,
                                high=config.type_vocab_size))
    inputs.append(InputSpec(name="labels", shape=("batch", "seq"), dtype=torch.long, high=vocab))
    loss = _bert_loss if kind.token_types else _causal_lm_loss
    return ModelSpec(name=kind.spec_name, module=module, inputs=tuple(inputs), loss=loss,
                     dims={"batch": dims.get("batch", 2), "seq": seq})


def _causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own next-token loss (it shifts ``labels`` itself)."""
    return model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _bert_loss(model: nn.Module, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    """The model's own masked-LM loss over every position."""
    return model(input_ids=input_ids, token_type_ids=token_type_ids, labels=labels).loss


def _builder(kind: _HFModel) -> Callable[..., ModelSpec]:
    def build(**kwargs: Any) -> ModelSpec:
        return _build(kind, dict(kwargs))

    build.__name__ = f"build_{kind.spec_name.replace('-', '_')}"
    build.__doc__ = f"{kind.model_class} from a {kind.config_class} made of the spec's keys."
    return build


for _kind in _MODELS.values():
    _defaults = ",".join(f"{k}={v}" for k, v in _kind.defaults.items())
    # The small defaults' keys are counts; any other config field goes to the config, which checks it.
    _table = SpecTable(keys={**{k: COUNT for k in _kind.defaults}, "batch": COUNT, "seq": COUNT},
                       rules=_kind.rules, open=True, limits={"seq": _kind.positions_key})
    register(_kind.spec_name, f"Hugging Face {_kind.model_class} (keys: {_kind.config_class} fields, batch, "
                              f"seq; default {_defaults})", keys=_table,
             defaults={**_kind.defaults, "batch": 2}, mixed_layers=_kind.mixed_layers)(_builder(_kind))
