"""The planner's step time against published large training runs on DGX A100 80GB clusters.

Each run is evaluated as published: the knobs the source gives (dp, tp, pp, micro-batch size,
recompute, sequence parallelism) are pinned with ``fix=``; the ones it does not give (the pipeline
schedule and its chunks, and the micro-batch size where it is not given) are left to the planner,
which picks its fastest plan that fits, as the authors tuned theirs. Megatron-LM of that time had
no ZeRO and no offload: ``zero_stage=0``, ``offload="none"``. Every run is GPT-style, sequence
2048, vocabulary 51200, 16-bit mixed precision, Adam, on Selene (DGX A100 80GB nodes: 8 GPUs on
NVSwitch, 8 HDR InfiniBand NICs per node): the ``dgx-a100-80gb`` preset.

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

Run: python bench/published_runs.py
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from partitioner.cost.cluster import Cluster
from partitioner.inputs.models import build_model
from partitioner.search.plan_cost import Evaluated, PlanContext, evaluate
from partitioner.search.profile import ModelProfile, profile_spec
from partitioner.search.search import candidates

SEQ = 2048
VOCAB = 51200
PRESET = "dgx-a100-80gb"
PEAK = 312e12
"""A100 dense bf16/fp16 FLOP/s (the preset's)."""
MEGATRON = {"zero_stage": 0, "offload": "none"}
"""Knobs of the Megatron-LM these runs used: no ZeRO, no offload."""


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published training configuration and its measured step time."""

    source: str
    """Paper and table."""
    label: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    global_batch: int
    fix: dict = field(hash=False)
    """Knobs the source publishes (plus :data:`MEGATRON`), pinned."""
    step_s: float
    """Published seconds per step (derived from the published FLOP/s where that is what it gives)."""
    published: str
    """What the source prints, as printed."""

    @property
    def spec(self) -> str:
        return f"gpt:layers={self.layers},hidden={self.hidden},heads={self.heads},vocab={VOCAB},seq={SEQ}"


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
    for block in spec.module.blocks:
        block.attn = UnfusedAttention(run.hidden, run.heads).to(device="meta", dtype=torch.bfloat16)
    p = profile_spec(spec, dtype="bf16")
    ref = p.blocks[-1]
    blocks = tuple(dataclasses.replace(ref, name=f"blocks.{i}") for i in range(run.layers))
    # the heads come from a fused attention node, which this model has none of
    return dataclasses.replace(p, model=run.spec, blocks=blocks, heads=run.heads)


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


def published_runs() -> tuple[PublishedRun, ...]:
    """Every run of both sources, in the order of their tables."""
    runs = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in NARAYANAN_TABLE_1:
        runs.append(PublishedRun(
            source="Narayanan 2021 T1", label=f"GPT {params:g}B", layers=layers, hidden=hidden, heads=heads,
            gpus=gpus, global_batch=batch, step_s=narayanan_flops(batch, layers, hidden) / (gpus * tflops * 1e12),
            published=f"{tflops} TFLOP/s/GPU",
            fix={"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "checkpointing": "full",
                 "sequence_parallel": False, **MEGATRON}))
    for label, heads, hidden, layers, tp, pp, gpus, batch, mbs, full_s, selective_s in KORTHIKANTI:
        common = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "micro_batch_size": mbs, **MEGATRON}
        for ckpt, sp, step in (("full", False, full_s), ("selective", True, selective_s)):
            runs.append(PublishedRun(
                source="Korthikanti 2022", label=f"GPT {label} {ckpt}{' +SP' if sp else ''}", layers=layers,
                hidden=hidden, heads=heads, gpus=gpus, global_batch=batch, step_s=step, published=f"{step} s",
                fix={**common, "checkpointing": ckpt, "sequence_parallel": sp}))
    return tuple(runs)


def evaluate_run(run: PublishedRun, profile: ModelProfile) -> tuple[Evaluated, bool]:
    """The fastest candidate with the run's pins that fits (``True``), else the fastest of them
    with its memory ignored (``False``: the planner's memory model says it does not fit)."""
    cluster = Cluster.preset(PRESET, nodes=run.gpus // 8)
    ctx = PlanContext(profile, cluster, run.global_batch, "adamw")
    cands = candidates(profile, cluster, run.global_batch, run.fix)
    if not cands:
        raise SystemExit(f"{run.label}: no candidate for fix={run.fix}")
    evaluated = [evaluate(ctx, c) for c in cands]
    fits = [e for e in evaluated if e.feasible]
    if fits:
        return min(fits, key=lambda e: e.step_time), True
    return min((evaluate(ctx, c, limit=None) for c in cands), key=lambda e: e.step_time), False


def main() -> None:
    t0 = time.perf_counter()
    profiles: dict[str, ModelProfile] = {}
    rows = []
    for run in published_runs():
        if run.spec not in profiles:
            profiles[run.spec] = megatron_profile(run)
        e, fits = evaluate_run(run, profiles[run.spec])
        rows.append((run, e, fits))
    print(f"{'source':<18} {'run':<26} {'GPUs':>5} {'published':>17} {'pub s':>7} {'pred s':>7} {'err':>7}"
          f" {'pub MFU':>7} {'pred MFU':>8}  planner's choice of the unpinned knobs")
    errors = []
    for run, e, fits in rows:
        err = e.step_time / run.step_s - 1
        errors.append(abs(err))
        flops = model_flops(run.global_batch, run.layers, run.hidden)
        mfu_pub, mfu_pred = flops / (run.gpus * PEAK * run.step_s), flops / (run.gpus * PEAK * e.step_time)
        c = e.config
        chosen = f"mbs={c.micro_batch_size} m={c.num_micro_batches} {c.schedule} v={c.virtual_pp}"
        print(f"{run.source:<18} {run.label:<26} {run.gpus:>5} {run.published:>17} {run.step_s:>7.2f} "
              f"{e.step_time:>7.2f} {err * 100:>+6.1f}% {mfu_pub * 100:>6.1f}% {mfu_pred * 100:>7.1f}%  "
              f"{chosen}{'' if fits else '  (does not fit in the memory model)'}")
    print(f"median |error| {statistics.median(errors) * 100:.1f}% over {len(errors)} runs "
          f"(Narayanan {statistics.median(errors[:10]) * 100:.1f}%, Korthikanti "
          f"{statistics.median(errors[10:]) * 100:.1f}%); max |error| {max(errors) * 100:.1f}%; "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
