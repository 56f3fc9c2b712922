"""Honest predictions: predicted vs measured per-rank peak memory and step time, many plans.

    python bench/fidelity.py [--steps 10] [--out bench_out/fidelity] [--models gpt,llama,hf-gpt2]

ONE spawn of 4 gloo ranks runs every (model, plan) case for ``--steps`` steps; step 1 is warm-up
and left out of the times (its peak is lower: no gradients or optimizer state exist before it).

* memory, the planner's returned per-rank peak (``plan.predicted.rank_peak_memory_bytes``: the
  search checks its plan with the exact replay of every rank program it lowers,
  :mod:`partitioner.search.memory_check`; each rank also replays the program it runs, a cross-check);
  measured by :class:`runtime.observe.measure.StepTimer` (live tensor
  storage bytes on CPU), max over the steps;
* time, predicted by the planner (:func:`partitioner.search.replay.predict_step_time`) on
  ``local_cluster(4)`` (a quick calibration is made first when this machine has no calibration
  file), measured as the median wall seconds of a step after the warm-up, per rank;
* refit: every case writes ``<out>/<model>/<plan>/{plan.json,measurements.json}``; per model,
  :func:`partitioner.calibration.refit.refit` (FLOP/s, per-op overhead, bandwidth, offload calls, pipeline message
  seconds, link latency) is fitted on every case but the HELD-OUT plan, and the held-out plan's
  step time is predicted with the cluster before and after the refit.

ZeRO-1/2: :class:`runtime.observe.measure.StepTimer` counts :class:`runtime.optim.grad_sync.ShardedOptimizer`'s
fp32 master chunk, its gradient and its AdamW state in the persistent baseline.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from partitioner.calibration.job_cluster import local_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "gpt": "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16,dropout=0.0",
    "llama": "llama:layers=4,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16",
    "hf-gpt2": ("hf-gpt2:n_layer=4,n_embd=64,n_head=4,vocab_size=128,n_positions=32,resid_pdrop=0.0,"
                "embd_pdrop=0.0,attn_pdrop=0.0,seq=16"),
    # one GPU (--world 1 --cluster dgx-h200): large enough that kernels, not Python, dominate
    "gpt-gpu": "gpt:layers=8,hidden=1024,heads=16,vocab=32768,seq=512,dropout=0.0",
}
WORLD, GLOBAL_BATCH = 4, 16
ADAMW = {"lr": 1e-3, "eps": 1e-6}
HELD_OUT = "pp4-1f1b"
HELD_OUT_BY_WORLD = {4: "pp4-1f1b", 1: "1dev"}


@dataclass(frozen=True)
class Case:
    """One plan on WORLD ranks (dp * tp * pp = WORLD)."""

    name: str
    dp: int
    tp: int
    pp: int
    schedule: str
    virtual_pp: int
    num_micro_batches: int
    zero: int = 0
    checkpointing: str = "none"
    offload: str = "none"
    dtype: str = "fp32"  # bf16: the model captured in bf16, fp32 master weights (runtime.optim.mixed_precision)

    def knobs(self) -> dict:
        return dict(dp=self.dp, tp=self.tp, pp=self.pp, virtual_pp=self.virtual_pp,
                    micro_batch_size=GLOBAL_BATCH // (self.dp * self.num_micro_batches),
                    num_micro_batches=self.num_micro_batches, schedule=self.schedule, zero_stage=self.zero,
                    sequence_parallel=False, checkpointing=self.checkpointing, offload=self.offload)


CASES = (
    Case("pp4-1f1b", 1, 1, 4, "1f1b", 1, 4),
    Case("dp2-pp2-interleaved", 2, 1, 2, "interleaved", 2, 2),
    Case("tp2-pp2-1f1b", 1, 2, 2, "1f1b", 1, 2),
    Case("dp2-tp2", 2, 2, 1, "1f1b", 1, 2),
    Case("dp4-zero1", 4, 1, 1, "1f1b", 1, 2, zero=1),
    Case("dp4-zero2", 4, 1, 1, "1f1b", 1, 2, zero=2),
    Case("dp2-pp2-zero2", 2, 1, 2, "1f1b", 1, 2, zero=2),
    Case("dp2-pp2-ckpt-full", 2, 1, 2, "1f1b", 1, 2, checkpointing="full"),
    Case("dp2-pp2-offload", 2, 1, 2, "1f1b", 1, 2, offload="activations"),
    Case("dp2-pp2-ckpt-offload", 2, 1, 2, "1f1b", 1, 2, checkpointing="full", offload="activations"),
    Case("dp2-pp2-bf16", 2, 1, 2, "1f1b", 1, 2, dtype="bf16"),
    Case("tp2-pp2-bf16", 1, 2, 2, "1f1b", 1, 2, dtype="bf16"),
    Case("dp4-zero2-bf16", 4, 1, 1, "1f1b", 1, 2, zero=2, dtype="bf16"),
    Case("dp2-pp2-zero1-ckpt-bf16", 2, 1, 2, "1f1b", 1, 2, zero=1, checkpointing="full", dtype="bf16"),
)
ONE_DEVICE_CASES = (  # --world 1: the one-GPU table, with and without checkpointing/offload
    Case("1dev", 1, 1, 1, "1f1b", 1, 2),
    Case("1dev-ckpt-full", 1, 1, 1, "1f1b", 1, 2, checkpointing="full"),
    Case("1dev-offload", 1, 1, 1, "1f1b", 1, 2, offload="activations"),
    Case("1dev-ckpt-offload", 1, 1, 1, "1f1b", 1, 2, checkpointing="full", offload="activations"),
)
CASES_BY_WORLD = {4: CASES, 1: ONE_DEVICE_CASES}
DTYPE_OF_CASE = {c.name: c.dtype for c in (*CASES, *ONE_DEVICE_CASES)}


def _rank_main(models: dict, cases: tuple, steps: int, boundaries: dict) -> list[dict]:
    """On every rank: each case's prediction (before training) and its measured steps; stages are
    cut where the plan cuts them (``boundaries[(model, case)]``)."""
    import torch

    from partitioner.search.replay import predict_memory
    from partitioner.inputs.models import build_model
    from runtime.observe.measure import StepTimer
    from partitioner.compile.build import build_parallel_model, capture_for_pipeline
    from passes.ir.config import TORCH_DTYPES, ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=600)
    meshes = {}
    for c in cases:  # every rank creates every group, in the same order
        key = (c.dp, c.pp, c.tp)
        if key not in meshes:
            meshes[key] = Mesh(c.dp, c.pp, c.tp, timeout_s=180)
    out = []
    device = next(iter(meshes.values())).device.type
    for model, spec_str in models.items():
        graphs = {}  # one capture per dtype (a bf16 plan runs the model captured in bf16)
        for dtype in sorted({c.dtype for c in cases}):
            graphs[dtype] = capture_for_pipeline(build_model(spec_str).cast(TORCH_DTYPES[dtype]), device=device)
        spec = build_model(spec_str)
        batches = [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=10 + k) for k in range(steps)]
        for c in cases:
            graph = graphs[c.dtype]
            batch_bytes = sum(t.to(TORCH_DTYPES[c.dtype]).untyped_storage().nbytes() if t.is_floating_point()
                              else t.untyped_storage().nbytes() for t in batches[0])
            torch.distributed.barrier()
            row = {"model": model, "case": c.name, "rank": torch.distributed.get_rank()}
            try:
                start = time.perf_counter()
                config = ParallelConfig.for_global_batch(
                    GLOBAL_BATCH, dp=c.dp, pp=c.pp, tp=c.tp, schedule=c.schedule, num_micro_batches=c.num_micro_batches,
                    virtual_pp=c.virtual_pp, zero_stage=c.zero, checkpointing=c.checkpointing, offload=c.offload,
                    dtype=c.dtype, stage_boundaries=boundaries.get((model, c.name)))
                pm = build_parallel_model(graph, config, meshes[(c.dp, c.pp, c.tp)], optimizer=ADAMW, cluster=local_cluster(meshes[c.dp, c.pp, c.tp].size))
                dims = {**dict(pm.micro_batches(batches[0])[1])}
                t0 = time.perf_counter()
                try:  # a failed prediction must not skip training: the other ranks would wait
                    mem = predict_memory(
                        pm.program, schedule=c.schedule, num_micro_batches=c.num_micro_batches, dims=dims,
                        global_batch_bytes=batch_bytes, zero=c.zero)
                    row.update(pred_peak=mem.peak_bytes, pred_where=mem.where, pred_parts=dict(mem.parts),
                               param_bytes=mem.param_bytes)
                except Exception as e:  # noqa: BLE001
                    row["predict_error"] = f"{type(e).__name__}: {e}"[:300]
                row.update(predict_s=time.perf_counter() - t0, build_s=t0 - start)
                timer = StepTimer(pm)
                for k, b in enumerate(batches):
                    timer.measure(k + 1, lambda b=b: pm.train_step(b))
                row["steps"] = [dataclasses.asdict(s) for s in timer.steps]
            except Exception as e:  # noqa: BLE001 - reported in the table; the other cases go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            out.append(row)
            if row["rank"] == 0:
                print(f"  {model} {c.name}: {'FAILED ' + row['error'] if 'error' in row else 'done'}", flush=True)
    torch.distributed.barrier()
    return out


def _pct(pred: float, meas: float) -> float:
    return (pred / meas - 1) * 100 if meas else float("nan")


def _median(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _cluster(out: Path, preset: str | None = None):
    import dataclasses

    from partitioner.calibration.cache import local_cache_file
    from partitioner.cost.cluster import CLUSTER_FILE_ENV, Cluster

    if preset is not None:  # e.g. dgx-h200 for --world 1 on a GPU: one node of WORLD devices
        return dataclasses.replace(Cluster.preset(preset), nodes=1, devices_per_node=WORLD)

    if not os.environ.get(CLUSTER_FILE_ENV) and not local_cache_file(WORLD).is_file():
        from partitioner.calibration.calibrate import run_calibration

        path = out / "local-cluster.yaml"
        if not path.is_file():
            print(f"no calibration file: quick calibration into {path}", flush=True)
            run_calibration(WORLD, path, True)
        os.environ[CLUSTER_FILE_ENV] = str(path)
    return local_cluster(WORLD)


def _cross_validate(models: dict, run_dirs: dict, plans: dict, cluster) -> None:
    """Leave-one-plan-out: per model and plan, refit on the model's OTHER plans and predict this
    one; every error is out of sample."""
    from partitioner.search.replay import predict_step_time
    from partitioner.search.profile import profile_model
    from partitioner.calibration.refit import load_run, refit

    print("\nleave-one-plan-out (refit on the model's other plans): step time |err| median over ranks")
    errs = []
    for model in models:
        cases = [c for (m, c) in run_dirs if m == model]
        runs = {c: load_run(run_dirs[(model, c)]) for c in cases}
        line = []
        for case in cases:
            result = refit([runs[c] for c in cases if c != case], cluster)
            profile = profile_model(models[model], dtype=DTYPE_OF_CASE[case])
            pred = predict_step_time(profile, result.cluster, dict(plans[(model, case)].knobs()),
                                     global_batch=GLOBAL_BATCH).predicted.step_time_s
            per_rank = [abs(_pct(pred, w)) for w in runs[case].step_s]
            errs += per_rank
            line.append(f"{case} {_median(per_rank):.1f}%")
        print(f"  {model}: " + ", ".join(line))
    print(f"  all: median {_median(errs):.1f}% over {len(errs)} rank-plans, "
          f"{sum(e <= 20 for e in errs)} within 20%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "fidelity_runs"))
    ap.add_argument("--models", default="gpt,llama,hf-gpt2", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: every case of the world)")
    ap.add_argument("--world", type=int, default=4, choices=sorted(CASES_BY_WORLD),
                    help="ranks: 4 (the CPU table) or 1 (one device: with and without checkpointing/offload)")
    ap.add_argument("--cluster", default=None,
                    help="a preset to predict on (e.g. dgx-h200 with --world 1 on a GPU); default the local calibration")
    ap.add_argument("--reuse", action="store_true", help="re-tabulate <out>/results.json instead of running")
    ap.add_argument("--cross-validate", action="store_true",
                    help="also leave each plan out in turn: refit on the others, predict it")
    args = ap.parse_args(argv)
    global WORLD, HELD_OUT
    WORLD, HELD_OUT = args.world, HELD_OUT_BY_WORLD[args.world]
    models = {m: MODELS[m] for m in args.models.split(",")}
    every = CASES_BY_WORLD[args.world]
    cases = every if args.cases is None else tuple(c for c in every if c.name in args.cases.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from partitioner.compile.build import capture_for_pipeline
    from partitioner.search.replay import predict_step_time
    from partitioner.search.memory_check import replay_check
    from passes.ir.config import TORCH_DTYPES
    from partitioner.inputs.models import build_model
    from partitioner.search.profile import profile_model
    from partitioner.calibration.refit import load_run, refit
    from runtime.dist.launch import spawn
    from runtime.observe.measure import RunMeasurements, StepMeasurement

    cluster = _cluster(out, args.cluster)
    t0 = time.time()
    plans = {}
    for model, spec in models.items():
        for dtype in sorted({c.dtype for c in cases}):
            profile = profile_model(spec, dtype=dtype)
            graph = capture_for_pipeline(build_model(spec).cast(TORCH_DTYPES[dtype]))
            check = replay_check(graph, cluster)  # the planner's own memory numbers
            for c in (c for c in cases if c.dtype == dtype):
                plans[(model, c.name)] = predict_step_time(profile, cluster, c.knobs(), global_batch=GLOBAL_BATCH,
                                                           check=check)
    print(f"planned {len(plans)} cases in {time.time() - t0:.1f} s; spawning {WORLD} ranks", flush=True)
    raw = out / "results.json"
    if args.reuse and raw.is_file():  # re-tabulate (and refit) a previous spawn's results
        results = json.loads(raw.read_text())
    else:
        t0 = time.time()

        boundaries = {key: p.config.stage_boundaries for key, p in plans.items()}
        results = spawn(_rank_main, WORLD, models, cases, args.steps, boundaries, timeout_s=3000)
        print(f"spawn done in {time.time() - t0:.1f} s", flush=True)
        raw.write_text(json.dumps(results, default=str))

    rows = {}
    for per_rank in results:
        for row in per_rank:
            rows.setdefault((row["model"], row["case"]), {})[row["rank"]] = row
    failed, run_dirs = {}, {}
    for (model, case), ranks in rows.items():
        plan = plans[(model, case)]
        errors = [r.get("error") or r["predict_error"] for r in ranks.values() if "error" in r or "predict_error" in r]
        if errors:
            failed[(model, case)] = errors[0]
            continue
        steps = [[StepMeasurement(**{**s, "compute_by_stage_s": {int(k): v for k, v in s["compute_by_stage_s"].items()}})
                  for s in ranks[r]["steps"]] for r in sorted(ranks)]
        run = RunMeasurements(plan_summary=plan.summary(), predicted_step_time_s=plan.predicted.step_time_s,
                              predicted_peak_memory_bytes=plan.predicted.peak_memory_bytes,
                              predicted_terms=plan.predicted.terms, world_size=WORLD, steps=steps,
                              notes=[f"bench/fidelity.py {model} {case}"])
        d = out / model / case
        run.write(d / "measurements.json")
        (d / "plan.json").write_text(plan.to_json() + "\n")
        run_dirs[(model, case)] = d

    # Refit per model (calibrate --from-run on that model's runs) on every plan but the held-out
    # one; every plan's step time is then predicted again with the refitted cluster.
    refitted, fits = {}, {}
    for model in models:
        fit = [d for (m, c), d in run_dirs.items() if m == model and c != HELD_OUT]
        if not fit:
            continue
        result = fits[model] = refit([load_run(d) for d in fit], cluster)
        result.cluster.to_file(out / model / "refit-cluster.yaml")
        for (m, case) in run_dirs:
            if m == model:
                profile = profile_model(models[model], dtype=DTYPE_OF_CASE[case])
                refitted[(m, case)] = predict_step_time(profile, result.cluster, dict(plans[(m, case)].knobs()),
                                                        global_batch=GLOBAL_BATCH).predicted.step_time_s

    print("\nmemory: the planner's returned peak of each rank (plan.predicted.rank_peak_memory_bytes, the exact "
          "replay of the rank program it lowers) against the rank's measured peak")
    print("\n| model | plan | rank | planner peak B | measured peak B | err % | measured step s "
          "| predicted (calibration) | err % | predicted (refit) | err % | peak at |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    mem_err, time_err, after_all, held_before, held_after = [], [], [], [], []
    for (model, case), ranks in rows.items():
        if (model, case) in failed:
            print(f"| {model} | {case} | - | FAILED: {failed[(model, case)]} |")
            continue
        plan, steps = plans[(model, case)], load_run(run_dirs[(model, case)])
        name = f"{case} (held out)" if case == HELD_OUT else case
        for r in sorted(ranks):
            row = ranks[r]
            peaks = [s["peak_memory_bytes"] for s in row["steps"][1:] if s["peak_memory_bytes"] is not None]
            if not peaks:
                print(f"| {model} | {name} | {r} | no memory measured ({len(row['steps'])} steps) |")
                continue
            peak, wall = max(peaks), steps.step_s[r]
            planned = plan.predicted.rank_peak_memory_bytes[r]
            me, te = _pct(planned, peak), _pct(plan.predicted.step_time_s, wall)
            after = refitted.get((model, case), float("nan"))
            ae = _pct(after, wall)
            mem_err.append(abs(me))
            time_err.append(abs(te))
            after_all.append(abs(ae))
            if case == HELD_OUT:
                held_before.append(abs(te))
                held_after.append(abs(ae))
            print(f"| {model} | {name} | {r} | {planned:.0f} | {peak} | {me:+.2f} | {wall:.4f} "
                  f"| {plan.predicted.step_time_s:.4f} | {te:+.1f} | {after:.4f} | {ae:+.1f} | {row['pred_where']} |")
    print(f"\nmemory |err|: median {_median(mem_err):.2f}%, max {max(mem_err, default=float('nan')):.2f}%, "
          f"{sum(e <= 5 for e in mem_err)}/{len(mem_err)} rank-plans within 5%, {sum(e <= 3 for e in mem_err)} within 3%")
    print(f"step time |err| with the calibration only: median {_median(time_err):.1f}%")
    for model, result in fits.items():
        print(f"\n{model}: refit on the plans but {HELD_OUT}: peak FLOP/s x{result.flops_scale:.3g}, "
              f"optimizer stream x{result.bandwidth_scale:.3g}, link latency x{result.latency_scale:.3g}, "
              f"per-op overhead {result.kernel_overhead_s * 1e6:.0f} us, pipeline message "
              f"{(result.p2p_latency_s or 0) * 1e3:.2f} ms, step overhead {result.step_overhead_s * 1e3:.2f} ms, "
              f"offload call {result.offload_call_s * 1e6:.0f} us; median measured/predicted compute "
              f"{result.compute_ratio_before:.2f} -> {result.compute_ratio_after:.2f}")
        for (m, case), d in run_dirs.items():
            if m != model:
                continue
            walls = load_run(d).step_s
            before = _median([abs(_pct(plans[(m, case)].predicted.step_time_s, w)) for w in walls])
            after = _median([abs(_pct(refitted[(m, case)], w)) for w in walls])
            tag = "HELD-OUT" if case == HELD_OUT else "fit set "
            print(f"  {tag} {case}: step time |err| median over ranks {before:.1f}% -> {after:.1f}%")
    if after_all:
        print(f"\nstep time |err| after the per-model refit: median {_median(after_all):.1f}% over all rank-plans "
              f"(fit sets included); held-out plans: median {_median(held_before):.1f}% before, "
              f"{_median(held_after):.1f}% after")
    if args.cross_validate:
        _cross_validate(models, run_dirs, plans, cluster)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
