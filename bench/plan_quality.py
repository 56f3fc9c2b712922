"""Does the planner pick the fastest plan that really runs? Predicted against measured step time
over many plans of one model on 4 local gloo ranks.

    python bench/plan_quality.py [--models gpt,llama,hf-gpt2] [--plans 24] [--warmup 3] [--steps 15]
                                 [--final 40] [--clusters calibrated,local-cpu] [--quick]

Per model:

* the candidates: every plan the search considers that fits in memory
  (:func:`partitioner.search.search.feasible_plans`, the search's own enumeration and cost model, fastest
  predicted first) on each cluster of ``--clusters``; the first cluster is the primary one. Plans
  that run alike (the same knobs and the same pipeline action lists: GPipe and 1F1B with one
  micro-batch) are measured once, as the pick when it is one of them. The
  planner's pick is :func:`partitioner.search.search.search` with the exact memory replay
  (:func:`partitioner.search.memory_check.replay_check`), as ``auto_parallelize`` calls it;
* the plans run: all of them when there are at most ``--plans`` + 6, else a sample
  (:func:`sample_plans`): the pick of every cluster, the ``TOP`` predicted fastest, for every knob
  and every value it takes among the candidates (every axis size, schedule, virtual stages,
  micro-batch size, ZeRO stage, sequence parallelism, checkpointing, offload) and every
  ``dp x tp x pp`` shape the fastest predicted plan with it, then plans spread evenly over the
  predicted order until there are ``--plans``;
* the measurement: ONE spawn of 4 gloo ranks builds every plan of every model (the plan's own
  stage split, from the same captured graph and so the same initial weights) and trains them on the
  same batches. Steps go round-robin over the plans, each step after a barrier, the order rotated
  every round, so load on the shared machine hits every plan alike. ``--warmup`` rounds are left
  out; a plan's step time is the slowest rank's wall time (:class:`runtime.observe.measure.StepTimer`),
  and its measured s/step the median over the ``--steps`` timed rounds;
* head to head: then the pick and the ``CONTENDERS`` plans measured fastest so far run
  ``--final`` more rounds by themselves (same barriers and rotation). The gap the goal is judged
  on is the median over these rounds of the pick's time over a contender's, against the contender
  it trails most: the fastest of 24 noisy medians is biased fast (the least of many), and the
  ratio within a round cancels the load that round had.

Printed: a table of the plans (short form, predicted s/step and rank among all candidates per
cluster, measured s/step, measured rank), where the pick lands (measured rank, gap to the measured
fastest in %, and in how many rounds it was slower than that plan; the head-to-head gap), the Spearman rank correlation
of predicted against measured over the plans run (``scipy.stats.spearmanr``), the cost-model terms
of the pick and the measured fastest next to the measured time split, the first-step loss of every
plan against single-process eager training, and the total wall time.

Clusters: ``calibrated`` (the primary one by default) is ``local_cluster(4)`` without
``$PARTITIONER_CLUSTER_FILE``: this machine's cached calibration (``$PARTITIONER_CACHE_DIR``, else
``~/.cache/partitioner``; measured once on a miss), which is what ``auto_parallelize`` plans
against on a local gloo job; ``local-cpu`` is the preset ``partitioner/cost/presets/local-cpu.yaml`` as
``local_cluster(4)`` reads it through ``$PARTITIONER_CLUSTER_FILE`` (a rough description without
overheads or shared cores, which the tests use); any other value is a cluster file path. Every
plan is lowered against the primary cluster.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner.cost.cluster import CLUSTER_FILE_ENV, PRESET_DIR, Cluster  # noqa: E402
from passes.ir.config import KNOBS, ParallelConfig  # noqa: E402
from passes.ir.plan import Plan  # noqa: E402
from partitioner.calibration.job_cluster import local_cluster

MODELS = {  # as bench/fidelity.py: a step on 4 gloo ranks takes 0.03-0.5 s here
    "gpt": "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16,dropout=0.0",
    "llama": "llama:layers=4,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16",
    "hf-gpt2": ("hf-gpt2:n_layer=4,n_embd=64,n_head=4,vocab_size=128,n_positions=32,resid_pdrop=0.0,"
                "embd_pdrop=0.0,attn_pdrop=0.0,seq=16"),
}
WORLD, GLOBAL_BATCH = 4, 16
ADAMW = {"lr": 1e-3, "eps": 1e-6}
TOP = 4
"""Predicted-fastest plans always run: the pick's closest competitors."""
CONTENDERS = 3
"""Measured-fastest plans of the first rounds that meet the pick head to head."""
GOAL_GAP = 0.05
"""The pick should be the measured fastest or at most this much slower (fraction)."""
GOAL_RHO = 0.8
"""The Spearman correlation of predicted and measured step time should be at least this."""
_COVERED = tuple(k for k in KNOBS if k != "num_micro_batches")  # follows from dp and micro_batch_size


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one run of the bench does."""

    models: tuple[str, ...]
    clusters: tuple[str, ...]
    plans: int
    """Plans per model to run at least (all of them when there are few)."""
    warmup: int
    """Untimed rounds per plan."""
    steps: int
    """Timed rounds per plan."""
    top: int = TOP
    cover: tuple[str, ...] = _COVERED
    """Knobs each of whose values some plan run has."""
    final: int = 0
    """Head-to-head rounds of the pick against the ``contenders`` measured fastest (0: none)."""
    contenders: int = CONTENDERS
    timeout_s: float = 3000.0


FULL = Settings(models=tuple(MODELS), clusters=("calibrated", "local-cpu"), plans=24, warmup=3, steps=15, final=40)
QUICK = Settings(models=("gpt",), clusters=("local-cpu",), plans=4, warmup=0, steps=1, top=0,
                 cover=("schedule", "pp"), final=2, contenders=1, timeout_s=300.0)


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """One plan run: its predictions (per cluster) and what it measured (seconds)."""

    label: str
    config: ParallelConfig
    predicted_s: Mapping[str, float]
    """Per cluster name: predicted seconds per step."""
    predicted_rank: Mapping[str, int]
    """Per cluster name: 1-based rank of the prediction among all feasible candidates."""
    terms: Mapping[str, Mapping[str, float]]
    """Per cluster name: the prediction's step-time terms (seconds)."""
    picked_by: tuple[str, ...]
    """Clusters whose planner pick this is."""
    step_s: tuple[float, ...] = ()
    """Per timed round: the slowest rank's wall seconds."""
    final_s: tuple[float, ...] = ()
    """Per head-to-head round (when this plan is the pick or a contender): the slowest rank's wall seconds."""
    parts_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Measured split of a step (median over rounds of the mean over ranks, seconds)."""
    first_loss: float = float("nan")
    """Rank 0's loss of the plan's first step (before any update)."""
    error: str | None = None

    @property
    def measured_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def spread(self) -> float:
        """Interquartile range of the timed rounds over their median (0.1 = 10%)."""
        if len(self.step_s) < 4:
            return float("nan")
        q = statistics.quantiles(self.step_s, n=4)
        return (q[2] - q[0]) / self.measured_s


@dataclass(frozen=True, kw_only=True)
class ModelReport:
    """Every plan run of one model, with what the table prints."""

    model: str
    spec: str
    candidates: Mapping[str, int]
    """Per cluster: feasible candidates the search considers."""
    plans: tuple[PlanResult, ...]
    eager_loss: float
    """Single-process eager training's first-step loss on the same batch."""

    @property
    def ok(self) -> tuple[PlanResult, ...]:
        return tuple(p for p in self.plans if p.error is None and p.step_s)

    def measured_rank(self, p: PlanResult) -> int:
        return 1 + sorted(q.measured_s for q in self.ok).index(p.measured_s)

    def fastest(self) -> PlanResult:
        return min(self.ok, key=lambda p: p.measured_s)

    def pick(self, cluster: str) -> PlanResult | None:
        """The planner's pick on ``cluster``; None when it did not fit the primary cluster."""
        return next((p for p in self.plans if cluster in p.picked_by), None)

    def gap(self, cluster: str) -> float:
        """The pick's measured step time over the measured fastest's, minus 1."""
        return self.pick(cluster).measured_s / self.fastest().measured_s - 1

    def head_to_head(self, cluster: str) -> tuple[PlanResult, float, int] | None:
        """The pick against the contender it trails most in the head-to-head rounds: that plan,
        the median over rounds of the pick's time over its (minus 1: the gap), and the rounds the
        pick was slower; None without head-to-head rounds or when the pick met no contender."""
        pick = self.pick(cluster)
        if pick is None or not pick.final_s:
            return None
        rows = [(statistics.median(a / b for a, b in zip(pick.final_s, q.final_s)) - 1,
                 sum(a > b for a, b in zip(pick.final_s, q.final_s)), q)
                for q in self.ok if q is not pick and len(q.final_s) == len(pick.final_s)]
        if not rows:
            return None
        gap, slower, q = max(rows, key=lambda r: r[0])
        return q, gap, slower

    def spearman(self, cluster: str) -> float:
        from scipy.stats import spearmanr

        ok = self.ok
        if len(ok) < 3:
            return float("nan")
        return float(spearmanr([p.predicted_s[cluster] for p in ok], [p.measured_s for p in ok]).statistic)


# ---------------------------------------------------------------------------------------------
# Which plans run


def label(c: ParallelConfig) -> str:
    """Short form of a plan's knobs, e.g. ``dp2.tp1.pp2 interleaved/v2 mbs4 z1 ckpt=full``."""
    parts = [f"dp{c.dp}.tp{c.tp}.pp{c.pp}" + (f".cp{c.cp}-{c.cp_mode}" if c.cp > 1 else ""),
             c.schedule + (f"/v{c.virtual_pp}" if c.virtual_pp > 1 else ""), f"mbs{c.micro_batch_size}"]
    parts += [f"z{c.zero_stage}"] if c.zero_stage else []
    parts += [f"hsdp{c.hsdp_shard}"] if c.hsdp_shard is not None else []
    parts += ["keep-gathered"] if c.zero_stage == 3 and not c.reshard_after_forward else []
    parts += ["sp"] if c.sequence_parallel else []
    parts += [f"ckpt={c.checkpointing}"] if c.checkpointing != "none" else []
    parts += [f"off={c.offload}"] if c.offload != "none" else []
    return " ".join(parts)


def _knobs(c: ParallelConfig) -> tuple:
    return tuple(c.knobs().values())


def _runs_as(c: ParallelConfig) -> tuple:
    """What ``c`` runs: its knobs with the schedule's name replaced by its action lists. Two
    plans alike in this (GPipe and 1F1B with one micro-batch per pipeline) are one plan to
    measure: timing both would only compare two samples of the same run."""
    from passes.ir.schedule.build import build

    knobs = dict(c.knobs())
    if c.pp > 1:
        actions = build(c.schedule, c.pp, c.num_micro_batches, c.virtual_pp, check=False)
        knobs["schedule"] = tuple((rank, tuple(map(str, acts))) for rank, acts in sorted(actions.items()))
    return tuple(knobs.items())


def distinct_plans(ranked: Sequence[Plan]) -> list[Plan]:
    """``ranked`` without the plans that run as an earlier one does (:func:`_runs_as`)."""
    seen, out = set(), []
    for p in ranked:
        key = _runs_as(p.config)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def sample_plans(ranked: Sequence[Plan], picks: Sequence[Plan], n: int, *, top: int = TOP,
                 cover: Sequence[str] = _COVERED) -> list[Plan]:
    """The plans of ``ranked`` (fastest predicted first) to run: ``picks``, the ``top`` first,
    for every knob of ``cover`` and every value it takes in ``ranked`` the first plan with it
    (with every knob covered, every ``dp x tp x pp`` shape too), then plans spread evenly over
    ``ranked`` (each the farthest in rank from those chosen) until there are ``n``. All of
    ``ranked`` when it has at most ``n`` + 6 plans. In ``ranked`` order."""
    if len(ranked) <= n + 6:
        return list(ranked)
    index = {_knobs(p.config): i for i, p in enumerate(ranked)}
    chosen: set[int] = {index[_knobs(p.config)] for p in picks} | set(range(min(top, len(ranked))))

    def first_with(pred) -> None:
        i = next((i for i, p in enumerate(ranked) if pred(p.config)), None)
        if i is not None and not any(pred(ranked[j].config) for j in chosen):
            chosen.add(i)

    for knob in cover:
        for value in sorted({getattr(p.config, knob) for p in ranked}, key=str):
            first_with(lambda c, knob=knob, value=value: getattr(c, knob) == value)
    if set(cover) >= set(_COVERED):
        for shape in sorted({(p.config.dp, p.config.tp, p.config.pp) for p in ranked}):
            first_with(lambda c, shape=shape: (c.dp, c.tp, c.pp) == shape)
    while len(chosen) < n:
        chosen.add(max((i for i in range(len(ranked)) if i not in chosen),
                       key=lambda i: (min(abs(i - j) for j in chosen), -i)))
    return [ranked[i] for i in sorted(chosen)]


@contextlib.contextmanager
def _cluster_file(value: str | None) -> Iterator[None]:
    """``$PARTITIONER_CLUSTER_FILE`` set to ``value`` (unset for None) while inside."""
    old = os.environ.get(CLUSTER_FILE_ENV)
    if value is None:
        os.environ.pop(CLUSTER_FILE_ENV, None)
    else:
        os.environ[CLUSTER_FILE_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CLUSTER_FILE_ENV, None)
        else:
            os.environ[CLUSTER_FILE_ENV] = old


def load_cluster(name: str) -> Cluster:
    """``local-cpu`` (the preset), ``calibrated`` (this machine's cached calibration) or a
    cluster file, as ``local_cluster(WORLD)`` reads it."""
    path = {"local-cpu": str(PRESET_DIR / "local-cpu.yaml"), "calibrated": None}.get(name, name)
    with _cluster_file(path):
        return local_cluster(WORLD)


# ---------------------------------------------------------------------------------------------
# The ranks


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _agree(ok: bool) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _contenders(rows: list[dict], timers: list, warmup: int, pick: int, n: int) -> list[int]:
    """On every rank alike: the pick and the ``n`` plans fastest over the timed rounds so far
    (each round's slowest rank), in plan order."""
    import torch
    import torch.distributed as dist

    steps = max(len(r.get("steps", ())) for r in rows)
    wall = torch.full((len(rows), steps), float("inf"), dtype=torch.float64)
    for i, r in enumerate(rows):
        if timers[i] is not None and len(r.get("steps", ())) == steps:
            wall[i] = torch.tensor([s["wall_s"] for s in r["steps"]], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    median = wall[:, warmup:].median(dim=1).values if steps > warmup else wall.median(dim=1).values
    order = [i for i in median.argsort().tolist() if median[i].isfinite()]
    return sorted({pick, *[i for i in order if i != pick][:n]})


def _rank_main(work: tuple, warmup: int, steps: int, cluster: Cluster, final: int = 0,
               contenders: int = CONTENDERS) -> list[list[dict]]:
    """On every rank: per model of ``work`` ((name, spec, packed graph, configs, index of the
    primary pick or None)), every config built and stepped round-robin, then ``final``
    head-to-head rounds of the pick and the ``contenders`` measured fastest; per model, per
    config, a dict of ``error``, ``steps`` and ``final``."""
    import torch.distributed as dist

    from partitioner.compile.build import build_parallel_model
    from partitioner.inputs.models import build_model
    from passes.ir.graph_transfer import unpack_graph
    from passes.ir.schedule.validate import stream_count
    from runtime.observe.measure import StepTimer
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=300)
    meshes = {}

    def mesh_key(c: ParallelConfig) -> tuple:  # what Mesh.for_config builds its groups from
        return c.dp, c.cp, c.pp, c.tp, stream_count(c.schedule), c.hsdp_shard

    for _, _, _, configs, _ in work:  # every rank creates every group, in the same order
        for c in configs:
            if mesh_key(c) not in meshes:
                meshes[mesh_key(c)] = Mesh.for_config(c, timeout_s=120)
    rank0 = dist.get_rank() == 0
    out = []
    for name, spec_str, payload, configs, pick_i in work:
        spec = build_model(spec_str)  # seeded: the same initial weights on every rank
        graph = unpack_graph(payload, spec.module)  # captured once, by the planning process
        batches = [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=10 + k) for k in range(warmup + steps)]
        timers, rows = [], [{"steps": []} for _ in configs]
        for i, c in enumerate(configs):
            timer = None
            try:  # each plan its own tp group name: plans with different tp groups live side by side
                pm = build_parallel_model(graph, c, meshes[mesh_key(c)], cluster=cluster, optimizer=ADAMW,
                                          tp_group=f"tp-{name}-{i}")
                timer = StepTimer(pm, track_memory=False)
            except Exception as e:  # noqa: BLE001 - reported in the table; the other plans go on
                rows[i]["error"] = f"build: {_first_line(e)}"
            if not _agree(timer is not None):
                rows[i].setdefault("error", "build failed on another rank")
                timer = None
            timers.append(timer)
        if rank0:
            print(f"  {name}: built {sum(t is not None for t in timers)}/{len(configs)} plans", flush=True)
        t0 = time.perf_counter()

        def play(k: int, batch, plans: Sequence[int], key: str) -> None:
            """One round: each plan of ``plans`` one step after a barrier, the order rotated by ``k``."""
            for j in range(len(plans)):
                i = plans[(k + j) % len(plans)]
                timer = timers[i]
                if timer is None:
                    continue
                dist.barrier()
                ok = True
                try:
                    m = timer.measure(k + 1, lambda b=batch, pm=timer.model: pm.train_step(b))
                    rows[i].setdefault(key, []).append(dict(
                        wall_s=m.wall_s, loss=m.loss, compute_s=m.compute_s, p2p_wait_s=m.recv_wait_s + m.send_wait_s,
                        p2p_post_s=m.p2p_post_s, collective_s=m.collective_s, optimizer_s=m.optimizer_s,
                        other_s=m.other_s))
                except Exception as e:  # noqa: BLE001
                    ok = False
                    rows[i]["error"] = f"{key} step {k + 1}: {_first_line(e)}"
                if not _agree(ok):
                    rows[i].setdefault("error", f"{key} step {k + 1} failed on another rank")
                    timers[i] = None

        everyone = range(len(configs))
        for k, batch in enumerate(batches):
            play(k, batch, everyone, "steps")
            if rank0:
                print(f"  {name}: round {k + 1}/{len(batches)}{' (warm-up)' if k < warmup else ''} done, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
        if final and pick_i is not None and timers[pick_i] is not None:
            plans = _contenders(rows, timers, warmup, pick_i, contenders)
            for k in range(final):
                play(k, batches[k % len(batches)], plans, "final")
            if rank0:
                print(f"  {name}: {final} head-to-head rounds of plans {plans} done, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
        out.append(rows)
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# The run


def _eager_loss(spec_str: str) -> float:
    from partitioner.inputs.models import build_model

    spec = build_model(spec_str)
    batch = spec.example_inputs({"batch": GLOBAL_BATCH}, seed=10)
    return float(spec.loss(spec.module, *batch).item())


def run(settings: Settings) -> list[ModelReport]:
    """Plan, sample, measure; one :class:`ModelReport` per model of ``settings``."""
    from partitioner.compile.build import capture_for_pipeline
    from partitioner.search.memory_check import replay_check
    from partitioner.inputs.models import build_model
    from partitioner.search.profile import profile_model
    from partitioner.search.search import feasible_plans, search
    from passes.ir.graph_transfer import pack_graph
    from runtime.dist.launch import spawn

    clusters = {name: load_cluster(name) for name in settings.clusters}
    primary = settings.clusters[0]
    work, meta = [], []
    for model in settings.models:
        t0 = time.perf_counter()
        spec = MODELS[model]
        profile = profile_model(spec, dtype="fp32")
        module = build_model(spec)
        graph = capture_for_pipeline(module)
        ranked = {n: feasible_plans(profile, c, global_batch=GLOBAL_BATCH) for n, c in clusters.items()}
        picks = {n: search(profile, c, global_batch=GLOBAL_BATCH, check=replay_check(graph, c))
                 for n, c in clusters.items()}
        rank_of = {n: {_knobs(p.config): i for i, p in enumerate(r)} for n, r in ranked.items()}
        pick_plans = [ranked[primary][rank_of[primary][_knobs(p.config)]] for p in picks.values()
                      if _knobs(p.config) in rank_of[primary]]  # another cluster's pick may not fit the primary
        # one of each set of plans that run alike: the pick's own, else the predicted fastest
        picked = {_knobs(p.config) for p in pick_plans}
        distinct = distinct_plans(sorted(ranked[primary], key=lambda p: _knobs(p.config) not in picked))
        distinct.sort(key=lambda p: rank_of[primary][_knobs(p.config)])
        standing_for = {_runs_as(p.config): p for p in distinct}
        run_plans = sample_plans(distinct, [standing_for[_runs_as(p.config)] for p in pick_plans], settings.plans,
                                 top=settings.top, cover=settings.cover)
        # the primary pick runs as the planner returned it (its own stage split)
        pick_knobs = _knobs(picks[primary].config)
        configs = tuple(picks[primary].config if _knobs(p.config) == pick_knobs else p.config for p in run_plans)
        results = []
        for c in configs:
            key = _knobs(c)
            per = {n: ranked[n][rank_of[n][key]] for n in clusters if key in rank_of[n]}
            results.append(PlanResult(
                label=label(c), config=c,
                predicted_s={n: per[n].predicted.step_time_s if n in per else float("nan") for n in clusters},
                predicted_rank={n: rank_of[n][key] + 1 if n in per else 0 for n in clusters},
                terms={n: dict(per[n].predicted.terms) if n in per else {} for n in clusters},
                picked_by=tuple(n for n, p in picks.items() if _runs_as(p.config) == _runs_as(c))))
        pick_i = next((i for i, c in enumerate(configs) if _knobs(c) == pick_knobs), None)
        work.append((model, spec, pack_graph(graph, module.module), configs, pick_i))
        meta.append((model, spec, {n: len(r) for n, r in ranked.items()}, results))
        print(f"{model}: {len(ranked[primary])} feasible candidates on {primary} ({len(distinct)} that run "
              f"differently), running {len(configs)} "
              f"(planned in {time.perf_counter() - t0:.1f} s)", flush=True)
    t0 = time.perf_counter()
    per_rank = spawn(_rank_main, WORLD, tuple(work), settings.warmup, settings.steps, clusters[primary],
                     settings.final, settings.contenders,
                     timeout_s=settings.timeout_s)
    print(f"spawn of {WORLD} ranks done in {time.perf_counter() - t0:.1f} s", flush=True)
    reports = []
    for m, (model, spec, n_cands, results) in enumerate(meta):
        done = []
        for i, r in enumerate(results):
            rows = [per_rank[rank][m][i] for rank in range(WORLD)]
            error = next((row["error"] for row in rows if "error" in row), None)
            steps = [row["steps"] for row in rows]
            if error is not None or not steps[0]:
                done.append(dataclasses.replace(r, error=error or "no steps"))
                continue
            timed = [[s[k] for s in steps] for k in range(settings.warmup, len(steps[0]))]
            parts = {key: statistics.median(statistics.fmean(s[key] for s in rnd) for rnd in timed)
                     for key in timed[0][0] if key.endswith("_s") and key != "wall_s"} if timed else {}
            finals = [row.get("final", []) for row in rows]
            done.append(dataclasses.replace(r, step_s=tuple(max(s["wall_s"] for s in rnd) for rnd in timed),
                                            final_s=tuple(max(f[k]["wall_s"] for f in finals)
                                                          for k in range(min(map(len, finals)))),
                                            parts_s=parts, first_loss=steps[0][0]["loss"]))
        reports.append(ModelReport(model=model, spec=spec, candidates=n_cands, plans=tuple(done),
                                   eager_loss=_eager_loss(spec)))
    return reports


# ---------------------------------------------------------------------------------------------
# The tables


def format_report(r: ModelReport, clusters: Sequence[str]) -> str:
    """The markdown table of one model and the lines on its pick, correlation and losses."""
    lines = [f"### {r.model}: `{r.spec}`", "",
             f"feasible candidates: {', '.join(f'{n} {k}' for n, k in r.candidates.items())}; plans run: "
             f"{len(r.plans)}, measured: {len(r.ok)}", ""]
    head = ["plan"] + [f"pred s ({n})" for n in clusters] + [f"pred rank ({n})" for n in clusters]
    head += ["measured s", "IQR %", "measured rank", "pick of"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 2) + "---|"]
    for p in sorted(r.plans, key=lambda p: (p.error is not None, p.measured_s if p.error is None else 0)):
        cells = [f"`{p.label}`"] + [f"{p.predicted_s[n]:.4f}" for n in clusters]
        cells += [str(p.predicted_rank[n]) for n in clusters]
        if p.error is not None:
            cells += [f"FAILED: {p.error}", "", "", ", ".join(p.picked_by)]
        else:
            cells += [f"{p.measured_s:.4f}", f"{100 * p.spread:.0f}", str(r.measured_rank(p)), ", ".join(p.picked_by)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if not r.ok:
        return "\n".join(lines + ["no plan measured"])
    best = r.fastest()
    for n in clusters:
        pick = r.pick(n)
        if pick is None:
            lines.append(f"* {n}: the pick does not fit the primary cluster {clusters[0]}: not run")
            continue
        if pick.error is not None:
            lines.append(f"* {n}: the pick `{pick.label}` FAILED ({pick.error})")
            continue
        slower = sum(a > b for a, b in zip(pick.step_s, best.step_s))
        gap, rho = r.gap(n), r.spearman(n)
        h2h = r.head_to_head(n)
        # the head-to-head gap when there is one: the first rounds' fastest of many plans is
        # biased fast (the least of many noisy medians); paired rounds of a few plans are not
        judged = h2h[1] if h2h is not None else gap
        verdict = "ok" if judged <= GOAL_GAP and rho >= GOAL_RHO else "MISSED"
        lines.append(f"* {n}: pick `{pick.label}` measured rank {r.measured_rank(pick)}/{len(r.ok)}, "
                     f"{100 * gap:+.1f}% vs the measured fastest `{best.label}` (slower in {slower}/{len(pick.step_s)} "
                     f"rounds); Spearman rho {rho:.2f} over {len(r.ok)} plans")
        if h2h is not None:
            q, g, k = h2h
            met = ", ".join(f"`{c.label}`" for c in r.ok if c is not pick and len(c.final_s) == len(pick.final_s))
            lines.append(f"  - head to head ({len(pick.final_s)} rounds against {met}): the pick trails "
                         f"`{q.label}` most, median per-round ratio {100 * g:+.1f}% (slower in {k}/{len(pick.final_s)})")
        lines.append(f"  - goal ({'head-to-head ' if h2h is not None else ''}gap <= {100 * GOAL_GAP:.0f}%, "
                     f"rho >= {GOAL_RHO}): {verdict}")
        if pick is not best:
            terms = [k for k in pick.terms[n] if pick.terms[n][k] or best.terms[n][k]]
            lines.append("  - predicted terms ms, pick / fastest: " + ", ".join(
                f"{k} {1e3 * pick.terms[n][k]:.2f}/{1e3 * best.terms[n][k]:.2f}" for k in terms))
    pick0 = r.pick(clusters[0])
    for p in (pick0, best) if pick0 is not best else (best,):
        if p is not None and p.error is None:
            lines.append(f"* measured split of `{p.label}` (ms, mean over ranks): " + ", ".join(
                f"{k.removesuffix('_s')} {1e3 * v:.1f}" for k, v in p.parts_s.items()))
    losses = [p.first_loss for p in r.ok]
    dev = max(abs(x / r.eager_loss - 1) for x in losses)
    lines.append(f"* first-step loss of every plan vs eager training ({r.eager_loss:.5f}): max rel diff {dev:.1e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="one model, 4 plans, 1 step: a smoke run (first steps, no warm-up: its times mean nothing)")
    ap.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--clusters", help="comma-separated: local-cpu, calibrated or cluster files; the first is "
                                       "primary (default: calibrated,local-cpu; --quick: local-cpu)")
    ap.add_argument("--plans", type=int, help="plans per model to run at least (default 24)")
    ap.add_argument("--warmup", type=int, help="untimed rounds (default 3)")
    ap.add_argument("--steps", type=int, help="timed rounds (default 15: at 5 the medians of plans that run alike differed by up to 13% here)")
    ap.add_argument("--final", type=int, help="head-to-head rounds of the pick against the measured fastest "
                                              f"{CONTENDERS} (default 40; 0: none)")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = dataclasses.replace(
        base, **{k: v for k, v in dict(
            models=tuple(args.models.split(",")) if args.models else None,
            clusters=tuple(args.clusters.split(",")) if args.clusters else None,
            plans=args.plans, warmup=args.warmup, steps=args.steps, final=args.final).items() if v is not None})
    unknown = [m for m in settings.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    start, load0 = time.perf_counter(), os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load0[0]:.1f}; {settings}", flush=True)
    reports = run(settings)
    for r in reports:
        print("\n" + format_report(r, settings.clusters))
    load1 = os.getloadavg()
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average {load0[0]:.1f} at the start, {load1[0]:.1f} "
          f"at the end (1-minute)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
