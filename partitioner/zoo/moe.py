"""GPT-style decoder whose MLP is a mixture of experts (Mixtral/Qwen3-MoE routing).

Each block: pre-LN causal attention (the GPT zoo model's), then an MoE layer:

* a linear router (no bias) gives ``E`` logits per token; softmax over them (fp32), top-k, and the
  top-k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE with ``norm_topk_prob``);
* ``E`` experts, each a SwiGLU (``down(silu(gate(x)) * up(x))``) or GELU (``proj(gelu(fc(x)))``)
  MLP of hidden ``expert_hidden``; ``shared_experts`` more of the same shape that every token goes
  through with weight 1 (DeepSeek/Qwen2-MoE shared experts);
* the auxiliary load-balancing loss of Switch/Mixtral, ``E * sum_e f_e * P_e`` with ``f_e`` the
  fraction of tokens that chose expert ``e`` among their top-k (so ``sum_e f_e = k``, as in
  transformers' ``load_balancing_loss_func``) and ``P_e`` the mean router probability of ``e``;
  summed over layers and added to the LM loss times ``aux_loss``.

**Capture form (dropless, exact, static shapes).** Every expert runs on every token and the combine
weights are zero for the experts a token did not choose: ``out = sum_e combine[..., e] * expert_e(x)``
with ``combine = zeros.scatter(-1, top_i, top_w)``. This is exactly the top-k mixture (no token is
dropped, nothing depends on data-dependent shapes), so ``torch.export`` captures it with fixed
shapes. Its matmuls cost ``E / k`` times what routing would run; the analysis
(:mod:`passes.analysis.annotate_moe`) recognises the block and ``annotate_flops`` counts each expert
at the tokens it receives under routing, not at every token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.inputs.model_spec import ModelSpec
from partitioner.inputs.spec_keys import COUNT, DROPOUT, Divisible, Key, SpecTable
from partitioner.zoo.gpt import CausalSelfAttention, init_weights
from partitioner.zoo.registry import register
from passes.ir.errors import ModelSpecError
from passes.ir.meta import InputSpec


class Expert(nn.Module):
    """One expert MLP: SwiGLU (gate, up, down) or GELU (fc, proj), no biases."""

    def __init__(self, hidden: int, expert_hidden: int, activation: str):
        super().__init__()
        self.swiglu = activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(hidden, expert_hidden, bias=False)
            self.up = nn.Linear(hidden, expert_hidden, bias=False)
            self.down = nn.Linear(expert_hidden, hidden, bias=False)
        else:
            self.fc = nn.Linear(hidden, expert_hidden, bias=False)
            self.proj = nn.Linear(expert_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Router, top-k, E experts (+ shared experts); returns (output, load-balancing loss)."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_hidden: int, shared_experts: int,
                 activation: str):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, expert_hidden, activation) for _ in range(experts))
        self.shared = nn.ModuleList(Expert(hidden, expert_hidden, activation) for _ in range(shared_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_experts = len(self.experts)
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)  # [b, s, E]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        # the capture form: every expert sees every token; unchosen experts weigh 0 (module docstring)
        combine = torch.zeros_like(probs).scatter(-1, top_i, top_w).to(x.dtype)
        out = None
        for e, expert in enumerate(self.experts):
            term = combine[..., e:e + 1] * expert(x)
            out = term if out is None else out + term
        for expert in self.shared:
            out = out + expert(x)
        # Switch/Mixtral load balancing: E * sum_e f_e P_e (f_e: tokens choosing e / tokens)
        chosen = torch.zeros_like(probs).scatter(-1, top_i, 1.0)
        f = chosen.flatten(0, -2).mean(dim=0)
        p = probs.flatten(0, -2).mean(dim=0)
        return out, n_experts * (f * p).sum()


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, moe: MoE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.moe = moe
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + self.drop(y), aux


class MoEGPT(nn.Module):
    """The GPT zoo model with MoE MLPs; ``forward`` returns (logits, sum of the layers' aux losses)."""

    def __init__(self, *, layers: int, hidden: int, heads: int, vocab: int, seq: int, dropout: float,
                 experts: int, top_k: int, expert_hidden: int, shared_experts: int, aux_loss: float,
                 activation: str):
        super().__init__()
        self.aux_loss_coef = aux_loss
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            MoEBlock(hidden, heads, dropout, MoE(hidden, experts, top_k, expert_hidden, shared_experts, activation))
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        aux = None
        for block in self.blocks:
            x, a = block(x)
            aux = a if aux is None else aux + a
        return self.lm_head(self.ln_f(x)), aux


def moe_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy plus ``aux_loss`` times the summed load-balancing losses."""
    logits, aux = model(idx)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)) + model.aux_loss_coef * aux


MOE_KEYS = SpecTable(
    keys={"layers": COUNT, "hidden": COUNT, "heads": COUNT, "vocab": COUNT, "seq": COUNT, "dropout": DROPOUT,
          "batch": COUNT, "experts": COUNT, "top_k": COUNT, "expert_hidden": COUNT,
          "shared_experts": Key(kind="int", ge=0), "aux_loss": Key(kind="float", ge=0),
          "activation": Key(kind="str", choices=("swiglu", "gelu"))},
    rules=(Divisible("hidden", "heads"),), limits={"seq": "seq"})
"""The keys of the MoE decoder."""


@register("moe", "GPT decoder with mixture-of-experts MLPs: layers, hidden, heads, vocab, seq, experts, top_k, "
                 "expert_hidden, shared_experts, aux_loss (coefficient), activation (swiglu|gelu), dropout, batch",
          keys=MOE_KEYS)
def build_moe(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, seq: int = 16,
              experts: int = 4, top_k: int = 2, expert_hidden: int = 128, shared_experts: int = 0,
              aux_loss: float = 0.01, activation: str = "swiglu", dropout: float = 0.0, batch: int = 2) -> ModelSpec:
    if top_k > experts:
        raise ModelSpecError(f"moe: top_k={top_k} exceeds experts={experts}; a token picks top_k of the experts, "
                             f"so top_k <= experts")
    module = MoEGPT(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, dropout=dropout,
                    experts=experts, top_k=top_k, expert_hidden=expert_hidden, shared_experts=shared_experts,
                    aux_loss=float(aux_loss), activation=activation)
    inputs = (
        InputSpec(name="idx", shape=("batch", "seq"), dtype=torch.long, high=vocab),
        InputSpec(name="targets", shape=("batch", "seq"), dtype=torch.long, high=vocab),
    )
    return ModelSpec(name="moe", module=module, inputs=inputs, loss=moe_loss, dims={"batch": batch, "seq": seq})
