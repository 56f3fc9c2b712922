"""Our runtime vs PyTorch's own distributed training, side by side, on 4 gloo ranks.

Pairs (same zoo GPT, same initial weights, same global batches, same AdamW, same micro-batches):

* ``pp-1f1b`` / ``pp-gpipe``: ``ParallelModel`` with pp=4 and that schedule vs
  ``torch.distributed.pipelining`` (``Schedule1F1B`` / ``ScheduleGPipe`` over a hand-built
  ``PipelineStage`` per rank: the blocks of a copy of the eager model, split at the same layer
  boundaries as ours; the tied embedding / LM head gradient is summed over the two pipeline ends
  as our runtime does; pipelining's default ``scale_grads=True`` makes the gradient the mean over
  micro-batches, which is what our mean loss gives).
* ``pp-zb1p``: ``ParallelModel`` with the zero-bubble ZB-H1 schedule (backward split into input
  and weight halves) vs ``ScheduleInterleavedZeroBubble`` over the same one stage per rank (its
  ZB-H1: the same action lists, tests/test_schedule_vs_torch.py).
* ``dp``: ``ParallelModel`` with dp=4 vs ``DistributedDataParallel`` on the eager model.
* ``tp``: ``ParallelModel`` with tp=4 vs ``parallelize_module`` with
  Colwise/Rowwise plans over a gloo ``DeviceMesh``. The fused QKV projection is column-sharded
  with its rows permuted so that each rank's shard holds its own heads' q, k and v (the usual way
  to shard a fused QKV; still one matmul, like the eager model).

Both sides of a pair step in alternation (ours, torch, ours, ...) so that load from other work on
the machine hits both alike. Each step starts after a barrier and is timed on rank 0; every step
of both sides ends in an all-reduce of the loss, so rank 0's clock covers the whole step. The
table shows median seconds per step and torch/ours (> 1: ours is faster), and the largest
relative difference between the two sides' per-step losses (same weights, same data: it should
be ~1e-6; it grows slowly with steps as summation orders differ).

Run: python bench/runtime_vs_torch.py            (default config, a few minutes on 2 cores)
     python bench/runtime_vs_torch.py --config smoke --steps 1 --warmup 0
"""
from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repo importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner.inputs.models import build_model  # noqa: E402
from partitioner.calibration.job_cluster import local_cluster

WORLD = 4
PAIRS = ("pp-1f1b", "pp-gpipe", "pp-zb1p", "dp", "tp")
# eps=1e-6 as in tests/test_runtime_parity.py: with 1e-8 Adam amplifies rounding noise in the
# (exactly zero) gradient of the attention key bias into order-lr updates of random sign.
ADAMW = {"lr": 1e-3, "eps": 1e-6}
TIMEOUT_S = 300.0  # seconds for collectives: this machine is shared and slow


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark size.

    * ``spec``: a zoo GPT spec (the torch side reaches into its ``blocks``, ``wte``, ...).
    * ``global_batch``: samples per optimizer step (every rank gets the whole batch).
    * ``micro_batches``: pipeline micro-batches per step (dp and tp use 1).
    * ``warmup`` / ``steps``: untimed / timed steps per side.
    * ``tp``: tensor-parallel degree (= world, so every rank takes part).
    """

    spec: str
    global_batch: int
    micro_batches: int
    warmup: int
    steps: int
    tp: int = WORLD


CONFIGS = {
    "default": BenchConfig(spec="gpt:layers=8,hidden=128,heads=4,vocab=512,seq=64,dropout=0.0",
                           global_batch=32, micro_batches=8, warmup=3, steps=10),
    "smoke": BenchConfig(spec="gpt:layers=4,hidden=32,heads=4,vocab=64,seq=8,dropout=0.0",
                         global_batch=8, micro_batches=4, warmup=0, steps=1),
}


@dataclass(frozen=True)
class PairResult:
    """Timings (seconds per step, rank 0, timed steps only) and per-step losses (every step,
    warm-up included) of both sides of one pair; ``skipped`` says why our side did not run (the
    torch side then runs alone, so its numbers and losses are still there)."""

    pair: str
    ours_s: tuple[float, ...] = ()
    torch_s: tuple[float, ...] = ()
    ours_losses: tuple[float, ...] = ()
    torch_losses: tuple[float, ...] = ()
    skipped: str = ""

    @property
    def ours_median_s(self) -> float:
        return statistics.median(self.ours_s)

    @property
    def torch_median_s(self) -> float:
        return statistics.median(self.torch_s)

    @property
    def ratio(self) -> float:
        """torch / ours median step time: > 1 means ours is faster."""
        return self.torch_median_s / self.ours_median_s

    @property
    def max_rel_loss_diff(self) -> float:
        return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.ours_losses, self.torch_losses))


# ------------------------------------------------------------------------------------------------
# Torch side: hand-built pipeline stages and a TP-shardable attention for the zoo GPT.
class GPTStage(nn.Module):
    """Blocks ``first:last`` of a GPT (plus the embeddings on the first stage, the final norm and
    LM head on the last): one ``PipelineStage`` submodule. Holds the given model's modules."""

    def __init__(self, model: nn.Module, first: int, last: int, *, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[first:last])
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # as GPT.forward
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x


class ShardableAttention(nn.Module):
    """The zoo's causal self-attention with its fused QKV rows permuted to
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``_r``: the heads of tp rank r), so that a plain
    ``ColwiseParallel`` shard of ``qkv`` holds whole heads; ``proj`` is then row-sharded.
    Same math as the original (its forward splits the local output in three, heads inferred)."""

    def __init__(self, attn: nn.Module, tp: int):
        super().__init__()
        self.head_dim = attn.qkv.out_features // 3 // attn.heads
        h = attn.qkv.out_features // 3
        per = h // tp
        order = torch.cat([torch.arange(part * h + r * per, part * h + (r + 1) * per)
                           for r in range(tp) for part in range(3)])
        self.qkv = copy.deepcopy(attn.qkv)
        with torch.no_grad():
            self.qkv.weight.copy_(attn.qkv.weight[order])
            self.qkv.bias.copy_(attn.qkv.bias[order])
        self.proj, self.resid_drop = attn.proj, attn.resid_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, s, -1)))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def _world_mean_loss(loss: torch.Tensor | None, contributors: int) -> float:
    """Sum over the world of ``loss / contributors`` (ranks without a loss add 0)."""
    total = torch.zeros((), dtype=torch.float64)
    if loss is not None:
        total += loss.detach().double() / contributors
    torch.distributed.all_reduce(total)
    return float(total)


# ------------------------------------------------------------------------------------------------
# Step functions: each returns ``step(batch) -> float`` (the global batch's mean loss, every rank).
def _ours(spec, graph, mesh, config: BenchConfig, *, dp=1, pp=1, tp=1, schedule="1f1b", m=1):
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig

    parallel = ParallelConfig.for_global_batch(config.global_batch, dp=dp, pp=pp, tp=tp, schedule=schedule,
                                               num_micro_batches=m)
    return build_parallel_model(graph, parallel, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size)).train_step


def _torch_pipeline(spec, config: BenchConfig, schedule: str, ends_group):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleavedZeroBubble)
    from passes.policies.pipeline_stages import balanced_boundaries

    rank, pp = torch.distributed.get_rank(), WORLD
    model = copy.deepcopy(spec.module)
    cuts = (0, *balanced_boundaries(len(model.blocks), pp), len(model.blocks))  # as ParallelModel
    stage_module = GPTStage(model, cuts[rank], cuts[rank + 1], is_first=rank == 0, is_last=rank == pp - 1)
    stage = PipelineStage(stage_module, rank, pp, torch.device("cpu"))
    if schedule == "zb1p":  # torch's zero-bubble schedule with one stage per rank is ZB-H1
        sched = ScheduleInterleavedZeroBubble([stage], config.micro_batches, loss_fn=_lm_loss)
    else:
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        sched = cls(stage, config.micro_batches, loss_fn=_lm_loss)  # scale_grads=True: mean over micro-batches
    optimizer = torch.optim.AdamW(stage_module.parameters(), **ADAMW)
    tied = (stage_module.wte.weight if rank == 0 else stage_module.lm_head.weight if rank == pp - 1 else None)

    def step(batch) -> float:
        idx, targets = batch
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(idx)
        elif rank == pp - 1:
            sched.step(target=targets, losses=losses, return_outputs=False)
        else:
            sched.step()
        if tied is not None:  # the embedding and LM head are one weight: sum its two gradients
            torch.distributed.all_reduce(tied.grad, group=ends_group)
        optimizer.step()
        return _world_mean_loss(torch.stack(losses).mean() if losses else None, 1)

    return step


def _torch_ddp(spec, config: BenchConfig):
    from torch.nn.parallel import DistributedDataParallel

    rank = torch.distributed.get_rank()
    model = DistributedDataParallel(copy.deepcopy(spec.module))
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    per = config.global_batch // WORLD

    def step(batch) -> float:
        idx, targets = (t[rank * per:(rank + 1) * per] for t in batch)  # as ParallelModel's dp slice
        optimizer.zero_grad()
        loss = _lm_loss(model(idx), targets)
        loss.backward()
        optimizer.step()
        return _world_mean_loss(loss, WORLD)

    return step


def _torch_tp(spec, config: BenchConfig, device_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(spec.module)
    plan = {}
    for i, block in enumerate(model.blocks):
        block.attn = ShardableAttention(block.attn, config.tp)
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    parallelize_module(model, device_mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(batch) -> float:
        idx, targets = batch
        optimizer.zero_grad()
        loss = _lm_loss(model(idx), targets)
        loss.backward()
        optimizer.step()
        return _world_mean_loss(loss, WORLD)  # every rank has the same loss: the mean is it

    return step


# ------------------------------------------------------------------------------------------------
def run_rank(config: BenchConfig, pairs: tuple[str, ...]) -> list[PairResult]:
    """On each of the ``WORLD`` ranks: build both sides of every pair, step them in alternation,
    and return rank 0's timings and the losses."""
    from torch.distributed.device_mesh import DeviceMesh

    from partitioner.compile.build import capture_for_pipeline
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=TIMEOUT_S)
    rank = torch.distributed.get_rank()
    spec = build_model(config.spec)
    graph = capture_for_pipeline(spec)  # ours deep-copies it per pair
    batches = [spec.example_inputs({"batch": config.global_batch}, seed=100 + k)
               for k in range(config.warmup + config.steps)]
    # Every group, on every rank, in the same order (a torch.distributed rule), before any pair runs.
    pp_mesh = Mesh(1, WORLD, timeout_s=TIMEOUT_S) if any(p.startswith("pp") for p in pairs) else None
    dp_mesh = Mesh(WORLD, 1, timeout_s=TIMEOUT_S) if "dp" in pairs else None
    ends_group = torch.distributed.new_group([0, WORLD - 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
    tp_mesh = Mesh(1, 1, config.tp, timeout_s=TIMEOUT_S) if "tp" in pairs else None
    device_mesh = DeviceMesh("cpu", list(range(config.tp))) if "tp" in pairs else None

    results = []
    for pair in pairs:
        torch.distributed.barrier()
        m = config.micro_batches
        if pair.startswith("pp"):
            schedule = pair.split("-")[1]
            ours = _ours(spec, graph, pp_mesh, config, pp=WORLD, schedule=schedule, m=m)
            theirs = _torch_pipeline(spec, config, schedule, ends_group)
        elif pair == "dp":
            ours = _ours(spec, graph, dp_mesh, config, dp=WORLD)
            theirs = _torch_ddp(spec, config)
        else:
            ours = _ours(spec, graph, tp_mesh, config, tp=config.tp)
            theirs = _torch_tp(spec, config, device_mesh)
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        losses: dict[str, list[float]] = {"ours": [], "torch": []}
        for k, batch in enumerate(batches):
            for side, fn in (("ours", ours), ("torch", theirs)):
                if fn is None:
                    continue
                torch.distributed.barrier()
                start = time.perf_counter()
                loss = fn(batch)
                elapsed = time.perf_counter() - start
                losses[side].append(loss)
                if k >= config.warmup:
                    times[side].append(elapsed)
        results.append(PairResult(pair, tuple(times["ours"]), tuple(times["torch"]), tuple(losses["ours"]),
                                  tuple(losses["torch"]), skipped="" if ours else "not available yet"))
        if rank == 0:
            print(f"[bench] {format_row(results[-1])}", flush=True)
    return results


def run(config: BenchConfig, pairs: tuple[str, ...] = PAIRS, *, timeout_s: float = 1800.0) -> list[PairResult]:
    """Every pair, in one spawn of ``WORLD`` gloo ranks; rank 0's results."""
    from runtime.dist.launch import spawn

    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        raise ValueError(f"runtime_vs_torch: unknown pair(s) {unknown}; use some of {PAIRS}")
    return spawn(run_rank, WORLD, config, tuple(pairs), timeout_s=timeout_s)[0]


def format_table(results: list[PairResult]) -> str:
    """A Markdown table: pair, ours and torch median s/step, torch/ours, max relative loss diff."""
    lines = ["| pair | ours s/step | torch s/step | torch/ours | max rel loss diff |",
             "|---|---:|---:|---:|---:|"]
    return "\n".join(lines + [format_row(r) for r in results])


def format_row(r: PairResult) -> str:
    """One table row; a side that did not run shows its reason."""
    if r.skipped:
        torch_s = f"{r.torch_median_s:.4f}" if r.torch_s else "-"
        return f"| {r.pair} | {r.skipped} | {torch_s} | - | - |"
    return (f"| {r.pair} | {r.ours_median_s:.4f} | {r.torch_median_s:.4f} | {r.ratio:.2f} | "
            f"{r.max_rel_loss_diff:.1e} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default")
    parser.add_argument("--steps", type=int, help="timed steps per side (default: the config's)")
    parser.add_argument("--warmup", type=int, help="untimed steps per side (default: the config's)")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {PAIRS}")
    args = parser.parse_args(argv)
    base = CONFIGS[args.config]
    config = BenchConfig(spec=base.spec, global_batch=base.global_batch, micro_batches=base.micro_batches,
                         warmup=base.warmup if args.warmup is None else args.warmup,
                         steps=base.steps if args.steps is None else args.steps, tp=base.tp)
    pairs = tuple(p.strip() for p in args.pairs.split(",") if p.strip())
    print(f"{config.spec}, global batch {config.global_batch}, {config.micro_batches} micro-batches (pp), "
          f"{WORLD} gloo ranks, {config.warmup} warm-up + {config.steps} timed steps per side, "
          f"torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    results = run(config, pairs)
    print(format_table(results))
    for r in results:
        if r.skipped and r.pair == "tp":
            print("tp: not available yet")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
