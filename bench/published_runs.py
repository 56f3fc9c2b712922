"""The planner's step time against published large training runs.

Each run is evaluated as published: the knobs the source gives are pinned with ``fix=``; the ones
it does not give (the pipeline schedule and its chunks, the micro-batch size where it is not
given, and for the newer runs the ZeRO stage, checkpointing and sequence parallelism) are left to
the planner, which picks its fastest plan that fits, as the authors tuned theirs. Megatron-LM of
the Narayanan and Korthikanti runs had no ZeRO and no offload: ``zero_stage=0``,
``offload="none"``. Those runs and MT-NLG are GPT-style, sequence 2048, vocabulary 51200, on
Selene-like DGX A100 80GB nodes (8 GPUs on NVSwitch, 8 HDR InfiniBand NICs): the
``dgx-a100-80gb`` preset. torchtitan's FSDP2 runs are Llama 2/3 on 64 A100 80GB; Llama 3 405B
ran on H100s (the ``dgx-h100`` preset). All 16-bit mixed precision with Adam.

Sources (numbers copied from the papers; see bench/README.md):

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC'21, arXiv:2104.04473), Table 1 (weak scaling, 1.7B to 1T): per model the
  hidden size, heads, layers, tp, pp, GPUs, global batch and the achieved teraFLOP/s per GPU.
  Activation recomputation is on for every run and the FLOPs count it (their eq. 3):
  ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``, so the published step time is
  ``F / (GPUs · achieved FLOP/s)``.
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (MLSys'23, arXiv:2205.05198): the configuration table (22B, 175B, 530B, 1T: tp 8, pp 1/8/35/64,
  8/64/280/512 GPUs, global batch = GPUs, micro-batch 4/1/1/1, data parallel 1) and the end-to-end
  iteration-time table: full recompute 1.42 / 18.13 / 49.05 / 94.42 s, selective recompute with
  sequence parallelism ("present work") 1.10 / 13.75 / 37.83 / 71.49 s (MFU 41.5 / 51.4 / 56.0 /
  56.3%, also listed in the Megatron-LM README).

The model is profiled as these runs ran it: Megatron-LM's attention of 2021-22 materialises the
[b, heads, s, s] scores (QKᵀ, causal mask, softmax, dropout, then ·V), which the roofline charges
by their bytes; the zoo GPT's fused ``scaled_dot_product_attention`` (flash attention, which
these runs predate) would keep none of that traffic. The block is the zoo GPT's block with its
attention core unfused (:class:`UnfusedAttention`); profiled with 2 blocks and replicated, as
``profile_model`` does.

One device-efficiency assumption, not fitted to these runs: the cost model's default
``EfficiencyCurve`` (large matmuls reach 75% of the datasheet's 312 TFLOP/s; a kernel of
``312e12 · 5 µs`` FLOPs reaches half of that), and the datasheet's 2.039 TB/s for memory-bound
kernels.

Smith et al. 2022 (MT-NLG), torchtitan's docs/performance.md and Llama 3 2024 (Table 4): see the
tables below and bench/README.md for what each gives and what is pinned.

Run: python bench/published_runs.py [--source NAME ...]
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from partitioner.cost.cluster import Cluster
from partitioner.inputs.models import build_model
from partitioner.search.plan_cost import Evaluated, PlanContext, evaluate
from partitioner.search.profile import ModelProfile, profile_model, profile_spec
from partitioner.search.search import candidates

SEQ = 2048
VOCAB = 51200
PRESET = "dgx-a100-80gb"
PEAK = 312e12
"""A100 dense bf16/fp16 FLOP/s (the preset's)."""
H100_PEAK = 989e12
"""H100 SXM dense bf16 FLOP/s (the ``dgx-h100`` preset's)."""
MEGATRON = {"zero_stage": 0, "offload": "none"}
"""Knobs of the Megatron-LM these runs used: no ZeRO, no offload."""


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published training configuration and its measured step time."""

    source: str
    """Paper and table."""
    label: str
    spec: str
    """The model as a zoo spec string."""
    gpus: int
    global_batch: int
    """Sequences per step."""
    fix: dict = field(hash=False)
    """Knobs the source publishes, pinned."""
    step_s: float
    """Published seconds per step (derived from the published FLOP/s or tokens/s where that is
    what it gives)."""
    published: str
    """What the source prints, as printed."""
    model_flops: float
    """Model FLOPs of one step (no recompute), for the MFU columns."""
    preset: str = PRESET
    peak: float = PEAK
    """The preset GPU's dense 16-bit FLOP/s."""
    unfused_attention: bool = True
    """Profiled with :class:`UnfusedAttention` (Megatron-LM before flash attention); else with
    the zoo model's fused ``scaled_dot_product_attention``."""

    @property
    def layers(self) -> int:
        return int(_spec_value(self.spec, "layers"))


def _spec_value(spec: str, key: str) -> str:
    return next(kv.split("=")[1] for kv in spec.split(":", 1)[1].split(",") if kv.startswith(key + "="))


def gpt_spec(layers: int, hidden: int, heads: int) -> str:
    return f"gpt:layers={layers},hidden={hidden},heads={heads},vocab={VOCAB},seq={SEQ}"


class UnfusedAttention(nn.Module):
    """Causal self-attention with the [b, heads, s, s] scores materialised, as Megatron-LM ran it
    before flash attention: QKᵀ (scale folded into q), causal mask, softmax, dropout, ·V."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = (t.view(b, s, self.heads, d).transpose(1, 2) for t in self.qkv(x).split(h, dim=2))
        scores = (q * (1.0 / math.sqrt(d))) @ k.transpose(-2, -1)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.attn_drop(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.proj(y))


def megatron_profile(run: "PublishedRun", sample_layers: int = 2) -> ModelProfile:
    """Profile of ``run``'s GPT with :class:`UnfusedAttention`: ``sample_layers`` blocks captured
    on the meta device, the last one replicated to ``run.layers`` (every block costs the same)."""
    small = run.spec.replace(f"layers={run.layers}", f"layers={sample_layers}")
    spec = build_model(small, device="meta", dtype=torch.bfloat16)
    hidden, heads = int(_spec_value(run.spec, "hidden")), int(_spec_value(run.spec, "heads"))
    for block in spec.module.blocks:
        block.attn = UnfusedAttention(hidden, heads).to(device="meta", dtype=torch.bfloat16)
    p = profile_spec(spec, dtype="bf16")
    ref = p.blocks[-1]
    blocks = tuple(dataclasses.replace(ref, name=f"blocks.{i}") for i in range(run.layers))
    # the heads come from a fused attention node, which this model has none of
    return dataclasses.replace(p, model=run.spec, blocks=blocks, heads=heads)


def run_profile(run: "PublishedRun") -> ModelProfile:
    """The profile ``run`` is planned with: unfused attention for the Megatron-era runs, else the
    zoo model as it is (two blocks captured on the meta device and replicated)."""
    return megatron_profile(run) if run.unfused_attention else profile_model(run.spec, dtype="bf16")


@functools.lru_cache(maxsize=None)
def parameter_count(spec: str) -> int:
    """Parameters of ``spec``'s model, built on the meta device."""
    return sum(p.numel() for p in build_model(spec, device="meta", dtype=torch.bfloat16).module.parameters())


def llama_model_flops(spec: str, sequences: int) -> float:
    """Model FLOPs of one step of a Llama: ``(6·N + 12·l·h·s)`` per token (N all parameters; the
    attention scores counted whole, not causally halved), the count torchtitan's MFU uses (and
    PaLM's appendix B)."""
    layers, hidden, seq = (int(_spec_value(spec, k)) for k in ("layers", "hidden", "seq"))
    return (6 * parameter_count(spec) + 12 * layers * hidden * seq) * sequences * seq


def narayanan_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one step with full recompute, Narayanan et al. 2021 eq. 3:
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``."""
    s, h, v = SEQ, hidden, VOCAB
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def model_flops(batch: int, layers: int, hidden: int) -> float:
    """Model FLOPs of one step (no recompute), Korthikanti et al. 2022:
    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``."""
    s, h, v = SEQ, hidden, VOCAB
    return 72 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


# Narayanan et al. 2021, Table 1: (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU)
NARAYANAN_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

# Korthikanti et al. 2022: (label, heads, hidden, layers, tp, pp, GPUs, batch, micro-batch,
# full-recompute s, selective + sequence parallel s)
KORTHIKANTI = (
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49),
)


# Smith et al. 2022 (MT-NLG 530B, DeepSpeed + Megatron-LM, arXiv:2201.11990): 105 layers, hidden
# 20480, 128 heads, sequence 2048, global batch 1920, micro-batch 1, tp 8 x pp 35 per replica;
# (DGX A100 nodes, iteration s, TFLOP/s per GPU) at 280, 350 and 420 nodes.
MT_NLG = ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113))

# torchtitan's docs/performance.md (FSDP2, i.e. ZeRO-3, on 64 A100 80GB, bf16): (label, spec,
# local batch, activation checkpointing, tokens/s per GPU). Llama 3: sequence 8192, vocabulary
# 128256; Llama 2: sequence 4096, vocabulary 32000. The rows with torchtitan's "selective op" or
# "selective layer" checkpointing are left out: neither is the selective recompute planned here.
TORCHTITAN = (
    ("Llama 3 70B", "llama:layers=80,hidden=8192,heads=64,kv_heads=8,intermediate=28672,vocab=128256,seq=8192,"
                    "theta=500000", 1, "full", 331),
    ("Llama 2 13B", "llama:layers=40,hidden=5120,heads=40,kv_heads=40,intermediate=13824,vocab=32000,seq=4096",
     2, "none", 2162),
    ("Llama 2 70B", "llama:layers=80,hidden=8192,heads=64,kv_heads=8,intermediate=28672,vocab=32000,seq=4096",
     2, "full", 353),
)

# Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4), H100
# 80GB: (GPUs, tp, pp, dp, TFLOP/s per GPU) at sequence 8192 and 16M tokens per step (2048
# sequences). The 131072-token row with cp=16 is left out: at that length the attention FLOPs
# are a third of the step, and whether its count is causally halved changes the step by a quarter.
LLAMA3_405B_SPEC = ("llama:layers=126,hidden=16384,heads=128,kv_heads=8,intermediate=53248,vocab=128256,seq=8192,"
                    "theta=500000")
LLAMA3_405B = ((8192, 8, 16, 64, 430), (16384, 8, 16, 128, 400))


def published_runs() -> tuple[PublishedRun, ...]:
    """Every run of every source, in the order of their tables."""
    runs = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in NARAYANAN_TABLE_1:
        runs.append(PublishedRun(
            source="Narayanan 2021 T1", label=f"GPT {params:g}B", spec=gpt_spec(layers, hidden, heads),
            gpus=gpus, global_batch=batch, step_s=narayanan_flops(batch, layers, hidden) / (gpus * tflops * 1e12),
            published=f"{tflops} TFLOP/s/GPU", model_flops=model_flops(batch, layers, hidden),
            fix={"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "checkpointing": "full",
                 "sequence_parallel": False, **MEGATRON}))
    for label, heads, hidden, layers, tp, pp, gpus, batch, mbs, full_s, selective_s in KORTHIKANTI:
        common = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "micro_batch_size": mbs, **MEGATRON}
        for ckpt, sp, step in (("full", False, full_s), ("selective", True, selective_s)):
            runs.append(PublishedRun(
                source="Korthikanti 2022", label=f"GPT {label} {ckpt}{' +SP' if sp else ''}",
                spec=gpt_spec(layers, hidden, heads), gpus=gpus, global_batch=batch, step_s=step,
                published=f"{step} s", model_flops=model_flops(batch, layers, hidden),
                fix={**common, "checkpointing": ckpt, "sequence_parallel": sp}))
    for nodes, step, tflops in MT_NLG:
        gpus = 8 * nodes
        runs.append(PublishedRun(
            source="Smith 2022 MT-NLG", label=f"GPT 530B dp{gpus // 280}", spec=gpt_spec(105, 20480, 128),
            gpus=gpus, global_batch=1920, step_s=step, published=f"{step} s", model_flops=model_flops(1920, 105, 20480),
            # DeepSpeed's pipeline engine with ZeRO-1, full recompute as Megatron-LM then ran it
            fix={"tp": 8, "pp": 35, "dp": gpus // 280, "micro_batch_size": 1, "zero_stage": 1, "offload": "none",
                 "checkpointing": "full", "sequence_parallel": False}))
    for label, spec, local, ckpt, wps in TORCHTITAN:
        seq = int(_spec_value(spec, "seq"))
        runs.append(PublishedRun(
            source="torchtitan FSDP2", label=f"{label} ckpt={ckpt}", spec=spec, gpus=64, global_batch=64 * local,
            step_s=local * seq / wps, published=f"{wps} tok/s/GPU", model_flops=llama_model_flops(spec, 64 * local),
            unfused_attention=False,
            fix={"dp": 64, "tp": 1, "pp": 1, "micro_batch_size": local, "zero_stage": 3, "offload": "none",
                 "checkpointing": ckpt}))
    for gpus, tp, pp, dp, tflops in LLAMA3_405B:
        flops = llama_model_flops(LLAMA3_405B_SPEC, 2048)
        runs.append(PublishedRun(
            source="Llama 3 2024 T4", label=f"Llama 3 405B dp{dp}", spec=LLAMA3_405B_SPEC, gpus=gpus,
            global_batch=2048, step_s=flops / (gpus * tflops * 1e12), published=f"{tflops} TFLOP/s/GPU",
            model_flops=flops, preset="dgx-h100", peak=H100_PEAK, unfused_attention=False,
            fix={"tp": tp, "pp": pp, "dp": dp, "cp": 1, "offload": "none"}))
    return tuple(runs)


def evaluate_run(run: PublishedRun, profile: ModelProfile) -> tuple[Evaluated, bool]:
    """The fastest candidate with the run's pins that fits (``True``), else the fastest of them
    with its memory ignored (``False``: the planner's memory model says it does not fit)."""
    cluster = Cluster.preset(run.preset, nodes=run.gpus // 8)
    ctx = PlanContext(profile, cluster, run.global_batch, "adamw")
    cands = candidates(profile, cluster, run.global_batch, run.fix)
    if not cands:
        raise SystemExit(f"{run.label}: no candidate for fix={run.fix}")
    evaluated = [evaluate(ctx, c) for c in cands]
    fits = [e for e in evaluated if e.feasible]
    if fits:
        return min(fits, key=lambda e: e.step_time), True
    return min((evaluate(ctx, c, limit=None) for c in cands), key=lambda e: e.step_time), False


def main(argv: list[str] | None = None) -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", help="only the runs of this source (repeatable)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    profiles: dict[tuple[str, bool], ModelProfile] = {}
    rows = []
    for run in published_runs():
        if args.source and run.source not in args.source:
            continue
        key = (run.spec, run.unfused_attention)
        if key not in profiles:
            profiles[key] = run_profile(run)
        e, fits = evaluate_run(run, profiles[key])
        rows.append((run, e, fits))
        print(f"  evaluated {run.source}: {run.label} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{'source':<18} {'run':<26} {'GPUs':>5} {'published':>18} {'pub s':>7} {'pred s':>7} {'err':>7}"
          f" {'pub MFU':>7} {'pred MFU':>8}  planner's choice of the unpinned knobs")
    errors: dict[str, list[float]] = {}
    for run, e, fits in rows:
        err = e.step_time / run.step_s - 1
        errors.setdefault(run.source, []).append(abs(err))
        mfu_pub = run.model_flops / (run.gpus * run.peak * run.step_s)
        mfu_pred = run.model_flops / (run.gpus * run.peak * e.step_time)
        c = e.config
        chosen = (f"mbs={c.micro_batch_size} m={c.num_micro_batches} {c.schedule} v={c.virtual_pp} "
                  f"zero={c.zero_stage} ckpt={c.checkpointing}{' sp' if c.sequence_parallel else ''}")
        print(f"{run.source:<18} {run.label:<26} {run.gpus:>5} {run.published:>18} {run.step_s:>7.2f} "
              f"{e.step_time:>7.2f} {err * 100:>+6.1f}% {mfu_pub * 100:>6.1f}% {mfu_pred * 100:>7.1f}%  "
              f"{chosen}{'' if fits else '  (does not fit in the memory model)'}")
    every = [x for errs in errors.values() for x in errs]
    per_source = ", ".join(f"{src} {statistics.median(errs) * 100:.1f}%" for src, errs in errors.items())
    print(f"median |error| {statistics.median(every) * 100:.1f}% over {len(every)} runs ({per_source}); "
          f"max |error| {max(every) * 100:.1f}%; {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
