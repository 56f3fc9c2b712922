"""The ``partitioner`` command line (also ``python -m partitioner``)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

from passes.ir.errors import ConfigError, PartitionerError
from passes.ir.heap import collect_young_less_often, importing
from passes.ir.launcher_env import under_launcher


def _human(expr, unit: str) -> str:
    """A size for people: 1.23 GiB / 4.56 TFLOP for numbers, the expression when symbolic."""
    import sympy  # here: `partitioner --help` loads neither sympy nor torch

    expr = sympy.sympify(expr)
    if not expr.is_number:
        return str(expr)
    value = float(expr)
    if unit == "B":
        steps, names = 1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    else:
        steps, names = 1000.0, [unit, "K" + unit, "M" + unit, "G" + unit, "T" + unit, "P" + unit, "E" + unit]
    i = 0
    while abs(value) >= steps and i < len(names) - 1:
        value /= steps
        i += 1
    return f"{value:.4g} {names[i]}"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cmd_analyze(args: argparse.Namespace) -> int:
    from partitioner.compile.analysis import analyze

    start = time.perf_counter()
    result = analyze(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, optimizer=args.optimizer,
                     dump_dir=args.dump_dir)
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(f"model {result.model}  dims {result.dims}  dtype {result.dtype}  optimizer {result.optimizer}  "
          f"({elapsed:.1f} s)")
    rows = [("quantity", "value"),
            ("parameters", _human(result.param_count, "")),
            ("parameter memory", _human(result.param_bytes, "B")),
            ("gradient memory", _human(result.grad_bytes, "B")),
            ("optimizer state", _human(result.optimizer_bytes, "B")),
            ("forward FLOPs", _human(result.fwd_flops, "FLOP")),
            ("backward FLOPs", _human(result.bwd_flops, "FLOP")),
            ("saved activations", _human(result.activation_bytes, "B")),
            (f"peak of one step ({result.peak_phase})", _human(result.peak_bytes, "B"))]
    print(_table(rows))
    if args.per_layer:
        print()
        rows = [("layer", "params", "fwd FLOPs", "activations")]
        rows += [(layer.name, _human(layer.param_bytes, "B"), _human(layer.fwd_flops, "FLOP"),
                  _human(layer.activation_bytes, "B")) for layer in result.layers]
        print(_table(rows))
    if args.dump_dir:
        print(f"\nIR dumps in {args.dump_dir}  (python -m ir_dumps show {args.dump_dir})")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from partitioner.api.planning import plan
    from partitioner.inputs.training import Training

    start = time.perf_counter()
    training = Training(global_batch=args.global_batch, optimizer=args.optimizer, dtype=args.dtype)
    chosen = plan(args.model, args.cluster, training=training, nodes=args.nodes, seq=args.seq, fix=args.fix,
                  dump_dir=args.dump_dir)
    elapsed = time.perf_counter() - start
    if args.json:
        print(chosen.to_json())
        return 0
    pred = chosen.predicted
    print(f"plan for {args.model} on {args.cluster} ({chosen.world_size} devices), global batch "
          f"{args.global_batch}, {chosen.config.dtype}  (planned in {elapsed:.1f} s)")
    rows = [("knob", "value")] + [(k, str(v)) for k, v in chosen.knobs().items()]
    print(_table(rows))
    print()
    rows = [("prediction", "value"),
            ("step time", f"{pred.step_time_s:.4g} s"),
            ("TFLOP/s per device", f"{pred.tflops_per_device:.1f}"),
            ("MFU", f"{pred.mfu * 100:.1f}%"),
            ("peak memory per device", _human(pred.peak_memory_bytes, "B"))]
    budget = pred.memory_budget
    if budget:
        rows += [("  usable of the device", f"{_human(budget['usable_bytes'], 'B')} of {_human(budget['device_bytes'], 'B')}")]
        if budget["reserved_bytes"] or budget["communicator_bytes"] or budget["slack"]:
            rows += [("  held back", f"{_human(budget['reserved_bytes'], 'B')} CUDA context and workspaces, "
                                     f"{_human(budget['communicator_bytes'], 'B')} for {int(budget['communicators'])} "
                                     f"NCCL communicator(s), {budget['slack']:.0%} allocator slack")]
        rows += [("  headroom", _human(pred.headroom_bytes, "B"))]
    rows += [("bubble", f"{pred.bubble_fraction * 100:.1f}%")]
    rows += [(f"  {name}", f"{value:.4g} s") for name, value in pred.terms.items()]
    print(_table(rows))
    print()
    rows = [("stage", "layers", "time/micro-batch", "peak memory")]
    rows += [(str(s.index), f"{s.layer_names[0]} .. {s.layer_names[-1]}" if len(s.layer_names) > 1 else
              s.layer_names[0], f"{s.time_s * 1e3:.2f} ms", _human(sum(s.memory.values()), "B"))
             for s in chosen.stages]
    print(_table(rows))
    if chosen.alternatives:
        print("\nalternatives:")
        for alt in chosen.alternatives:
            knobs = " ".join(f"{k}={v}" for k, v in alt.knobs.items())
            print(f"  {knobs}: {alt.reason}")
    if args.dump_dir:
        print(f"\ndumps in {args.dump_dir}: every pass of the lowering, stage<s>_tp<r>/program.txt (+ .onnx) per "
              f"rank program, stages.dot, plan.json, report.html  (python -m ir_dumps show {args.dump_dir})")
    return 0


def _cmd_lower(args: argparse.Namespace) -> int:
    from partitioner.cli.demo import read_plan
    from partitioner.cost.cluster import Cluster
    from partitioner.api.planning import write_model_plan_dumps

    plan = read_plan(args.plan)
    if args.cluster == "local":
        from partitioner.calibration.job_cluster import local_cluster

        cluster = local_cluster(args.world_size or plan.world_size)
    else:
        cluster = Cluster.load(args.cluster, nodes=args.nodes)
    dumps = write_model_plan_dumps(args.dump_dir, model=plan.model, plan=plan, cluster=cluster,
                                   param_bytes=None if args.onnx else float("inf"), seq=args.seq)
    print(f"lowered {plan.model} under {plan.config.text()}: {len(dumps.programs)} rank programs in {args.dump_dir}")
    for note in dumps.notes:
        print(f"  {note}")
    return 0


def _cmd_dry_run(args: argparse.Namespace) -> int:
    from partitioner.api.dry_run import dry_run
    from partitioner.cli.demo import read_plan
    from partitioner.inputs.training import Training

    plan = read_plan(args.plan) if args.plan else None
    if plan is None and (args.model is None or args.global_batch is None):
        raise ConfigError("dry-run: give --model and --global-batch (to plan), or --plan plan.json")
    if plan is not None and args.fix is not None:
        raise ConfigError("dry-run: --fix and --plan both given; a plan fixes every knob already: drop --fix")
    model = args.model or plan.model
    training = Training(global_batch=args.global_batch or plan.global_batch, optimizer=args.optimizer,
                        dtype=args.dtype or (plan.config.dtype if plan is not None else None))
    report = dry_run(model, args.cluster, training=training, fix=args.fix, plan=plan, nodes=args.nodes,
                     steps=args.steps, job_device=args.job_device)
    print(report.text())
    if args.debug:
        for r in report.failed():
            print(f"rank {r.rank}: {r.traceback}", file=sys.stderr)
    return 0 if report.ok else 1


def _cmd_refit(args: argparse.Namespace) -> int:
    from partitioner.calibration.cache import local_cache_file
    from partitioner.calibration.job_cluster import local_cluster
    from partitioner.calibration.refit import measured_matmul_flops, refit_from_runs

    out = args.out or local_cache_file(args.world_size)
    # the cached cluster's peak may itself be a refit: anchor to the microbenchmark beside it
    result = refit_from_runs(args.from_run, local_cluster(args.world_size), out,
                             matmul_flops_per_s=measured_matmul_flops(local_cache_file(args.world_size)) or None)
    print(f"refit from {result.runs} run(s): peak FLOP/s x{result.flops_scale:.3g}, optimizer stream "
          f"x{result.bandwidth_scale:.3g}, link latency x{result.latency_scale:.3g}; median measured/predicted "
          f"compute {result.compute_ratio_before:.3g} -> {result.compute_ratio_after:.3g}")
    print(f"  {result.overheads_text()}")
    print(f"cluster file written to {out}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from partitioner.inputs.models import key_rules, known_models

    rows = [("name", "keys")] + [(name, help) for name, help in known_models().items()]
    print(_table(rows))
    print("\nwhat each key takes (checked before the model is built):")
    for name in known_models():
        rules = key_rules(name)
        if rules is not None:
            print(f"  {name}: {rules}")
    print("\nor path/to/file.py:factory (a function returning partitioner.inputs.model_spec.ModelSpec)")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from partitioner.calibration.calibrate import run_calibration

    if args.show:
        return _show_calibrations()
    if args.from_run:
        args.world_size = args.world_size or 4
        return _cmd_refit(args)
    if under_launcher():
        cal = _calibrate_job(args)
        if cal is None:  # ranks other than 0 print nothing
            return 0
    else:
        cal = run_calibration(args.world_size or 4, args.out, args.quick,
                              reference_runs=False if args.no_reference_runs else None)
    print(f"calibrated {cal.world_size} gloo ranks, {cal.threads_per_rank} thread(s) each "
          f"({cal.elapsed_s:.1f} s{', quick' if args.quick else ''})")
    if cal.refit is not None:
        r = cal.refit
        print(f"refit to {r.runs} reference training runs ({cal.reference_dirs[0].parent}): "
              f"{r.overheads_text()}, peak FLOP/s x{r.flops_scale:.3g}, link latency x{r.latency_scale:.3g}")
    rows = [("matmul", "n", "time", "FLOP/s", "fitted efficiency")]
    for s in cal.matmul:
        fit = cal.efficiency[s.dtype]
        rows.append((s.dtype, str(s.n), f"{s.seconds * 1e6:.1f} us", _human(s.flops_per_s, "FLOP/s"),
                     f"{fit.curve.efficiency(s.flops, fit.peak_flops_per_s):.2f}"))
    print(_table(rows))
    print()
    rows = [("dtype", "peak", "peak_efficiency", "half_saturation")]
    rows += [(d, _human(f.peak_flops_per_s, "FLOP/s"), f"{f.curve.peak_efficiency:.3g}",
              f"{f.curve.half_saturation_s * 1e6:.3g} us") for d, f in cal.efficiency.items()]
    print(_table(rows))
    print()
    rows = [("communication", "ranks", "bytes", "time", "bytes/time", "alpha-beta model")]
    for where, g in (("", cal.gloo), ("across nodes: ", cal.inter_node)):
        if g is None:
            continue
        fits = [(g.all_reduce, g.all_reduce_fit), (g.send_recv, g.send_recv_fit)]
        fits += [(tuple(s for s in g.collectives if s.op == f.op), f) for f in g.collective_fits]
        for samples, fit in fits:
            rows += [(where + s.op, str(s.world_size), _human(s.nbytes, "B"), f"{s.seconds * 1e6:.1f} us",
                      f"{_human(s.algorithm_bytes_per_s, 'B')}/s", f"{fit.predict_seconds(s.nbytes) * 1e6:.1f} us")
                     for s in samples]
            rows.append((f"{where}{fit.op} fit", str(fit.world_size), "", f"alpha {fit.latency_s * 1e6:.3g} us",
                         f"beta {_human(fit.bandwidth_bytes_per_s, 'B')}/s", ""))
    print(_table(rows))
    print()
    m = cal.memcpy
    rows = [("memory", "value"),
            (f"copy of {_human(m.nbytes, 'B')}", f"{m.seconds * 1e3:.2f} ms"),
            ("copy rate (host_to_device)", f"{_human(m.copy_bytes_per_s, 'B')}/s"),
            ("read+write bandwidth (device)", f"{_human(m.memory_bandwidth_bytes_per_s, 'B')}/s"),
            ("4 KiB copy (host_to_device latency)", f"{m.small_copy_s * 1e6:.2f} us"),
            ("host memory", _human(cal.cluster.host_memory_bytes, "B")),
            ("device memory (host / ranks)", _human(cal.cluster.device.memory_bytes, "B"))]
    print(_table(rows))
    print(f"\ncluster file written to {cal.path} (samples in {cal.path.name}.calibration.json); "
          + ("local_cluster reads it (the cache of this machine)" if args.out is None
             else "local_cluster reads it with PARTITIONER_CLUSTER_FILE set to it"))
    return 0


def _calibrate_job(args: argparse.Namespace):
    """``partitioner calibrate`` under torchrun: the job's own ranks measure (every rank runs
    this); rank 0 writes the cache for the job's world size. Returns the calibration on rank 0,
    None on the others."""
    import torch.distributed as dist

    from dataclasses import replace
    from pathlib import Path

    from partitioner.calibration.calibrate import FULL_RECIPE, QUICK_RECIPE, calibrate_in_job
    from partitioner.calibration.cache import local_cache_file
    from partitioner.calibration.detect import job_shape
    from runtime.dist.mesh import START_TIMEOUT_S, init_distributed

    world = int(os.environ["WORLD_SIZE"])
    if args.world_size is not None and args.world_size != world:
        raise ConfigError(f"calibrate: --world-size {args.world_size} under a launcher of {world} rank(s); the "
                          f"job calibrates its own ranks: leave --world-size out, or launch {args.world_size}")
    init_distributed(timeout_s=START_TIMEOUT_S)
    recipe = QUICK_RECIPE if args.quick else FULL_RECIPE
    if args.no_reference_runs:
        recipe = replace(recipe, reference_steps=0)
    nodes = job_shape(world_size=world).nodes  # several: the link between them is measured too
    path = Path(args.out).expanduser() if args.out else local_cache_file(world, nodes)
    cal = calibrate_in_job(path, recipe)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return cal if rank == 0 else None


def _show_calibrations() -> int:
    """``partitioner calibrate --show``: every cached calibration of this machine, with the
    summary its file's header holds."""
    from partitioner.cost.cluster import Cluster
    from partitioner.calibration.cache import cache_dir

    root = cache_dir()
    files = sorted(root.glob("local-*.yaml")) if root.is_dir() else []
    if not files:
        print(f"no calibration cached in {root}; the first job (or `partitioner calibrate`) measures this machine")
        return 0
    print(f"calibrations cached in {root}:")
    for path in files:
        try:
            cluster = Cluster.from_file(path)
        except PartitionerError as exc:
            print(f"\n{path.name}: unreadable ({exc}); delete it or run `partitioner calibrate`")
            continue
        d = cluster.device
        print(f"\n{path.name}: {cluster.devices_per_node} rank(s) of {d.name}, fp32 "
              f"{_human(d.peak_flops.fp32, 'FLOP/s')}, {_human(d.memory_bytes, 'B')} each, link alpha "
              f"{cluster.intra_node.latency_s * 1e6:.3g} us beta {_human(cluster.intra_node.bandwidth_bytes_per_s, 'B')}/s")
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            print("  " + line[1:].strip())
    return 0


ONNX_HELP = ("also write program.onnx beside each rank program's program.txt at build (each program is "
             "traced again by the ONNX exporter: seconds per program before the first step)")


def _cmd_demo(args: argparse.Namespace) -> int:
    from partitioner.cli.demo import run_demo

    run_demo(model=args.model, steps=args.steps, fix=args.fix, dump_dir=args.dump_dir, global_batch=args.global_batch,
             dtype=args.dtype, onnx=args.onnx)
    return 0


def _check_run_options(args: argparse.Namespace) -> None:
    """Refuse out-of-range options (``--timeout 0``, ``--steps 0``, ...) before any work, and for
    train a --global-batch that the pinned knobs cannot split (:mod:`partitioner.inputs.run_options`)."""
    from partitioner.inputs.knobs import check_fix
    from partitioner.inputs.models import check_dim
    from partitioner.inputs.run_options import OPTIONS, check_option

    for name in OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, str):  # analyze's --batch/--seq: a number, or a name kept symbolic
            if not value.lstrip("+-").isdigit():
                continue
            value = int(value)
        if value is not None:
            check_option(name, value, spelled="--" + name.replace("_", "-"))
            if name == "seq" and isinstance(getattr(args, "model", None), str):
                check_dim(args.model, "seq", value, spelled="--seq")
    if getattr(args, "optimizer", None) is not None:
        from passes.ir.optimizers import OPTIMIZERS

        if args.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer: unknown optimizer {args.optimizer!r}; "
                              f"choose one of {', '.join(OPTIMIZERS)}")
    if getattr(args, "fix", None) is not None and args.command in ("train", "demo"):
        pinned = check_fix(args.fix, where="--fix")
        split = {k: pinned[k] for k in ("dp", "num_micro_batches", "micro_batch_size") if k in pinned}
        parts = 1
        for v in split.values():
            parts *= v
        if split and args.global_batch % parts:
            raise ConfigError(f"--global-batch {args.global_batch} is not divisible by "
                              f"{'*'.join(f'{k}={v}' for k, v in split.items())} = {parts} (pinned by --fix); "
                              f"use a multiple of {parts}")


def _cmd_train(args: argparse.Namespace) -> int:
    from partitioner.cli.demo import run_train

    if args.save_every is not None and args.save_dir is None:
        raise ConfigError("train: --save-every needs --save-dir DIR (where the checkpoints go)")
    if args.nodes is not None and args.cluster is None:
        raise ConfigError("train: --nodes needs --cluster PRESET (the node type the job runs on)")
    if args.plan is not None and args.fix is not None:
        raise ConfigError("train: --fix and --plan both given; a plan fixes every knob already: give --plan alone, "
                          "or --fix alone to search the rest")
    return run_train(model=args.model, global_batch=args.global_batch, steps=args.steps, fix=args.fix,
                     dump_dir=args.dump_dir, cluster=args.cluster, timeout_s=args.timeout, lr=args.lr, dtype=args.dtype,
                     optimizer=args.optimizer, plan=args.plan,
                     data=args.data, tokenizer=args.tokenizer, seed=args.seed, metrics=args.metrics,
                     save_dir=args.save_dir, save_every=args.save_every, keep=args.keep, resume=args.resume,
                     onnx=args.onnx,
                     clip_grad_norm=args.clip_grad_norm, warmup=args.warmup, nodes=args.nodes, debug=args.debug)


OPTIMIZER_HELP = ("adamw, adam, adamw_unfused, adam_unfused, sgd or sgd_momentum (the optimizer table, "
                  "passes.ir.optimizers; default adamw: AdamW on torch's fused kernel, no weight decay on norms, "
                  "biases and embeddings; the _unfused names run torch's default implementation)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partitioner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("analyze", help="shapes, FLOPs and memory of one training step")
    p.add_argument("--model", required=True, help="NAME:key=value,... (see `partitioner models`)")
    p.add_argument("--batch", help="batch size, or a name (e.g. B) to keep it symbolic")
    p.add_argument("--seq", help="sequence length, or a name (e.g. S) to keep it symbolic")
    p.add_argument("--dtype", default="fp32", help="fp32, or bf16/fp16 (mixed precision, fp32 master weights)")
    p.add_argument("--optimizer", default="adamw", help=OPTIMIZER_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--per-layer", action="store_true", help="also print a per-layer breakdown")
    p.add_argument("--dump-dir", help="write the IR after every pass here")
    p.set_defaults(fn=_cmd_analyze)

    p = sub.add_parser("plan", help="choose dp x tp x pp, micro-batching, schedule, ZeRO, checkpointing")
    p.add_argument("--model", required=True, help="NAME:key=value,... (a repeated-block model)")
    p.add_argument("--cluster", required=True, help="preset (dgx-a100-80gb, dgx-h100, ...) or a YAML/JSON file")
    p.add_argument("--nodes", type=int, help="number of nodes (default: the preset's)")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--seq", type=int, help="sequence length (default: the spec's)")
    p.add_argument("--dtype", help="fp32, or bf16/fp16 (mixed precision) (default: bf16 on a GPU cluster, fp32 on "
                                   "CPU ranks, as everywhere)")
    p.add_argument("--optimizer", default="adamw", help=OPTIMIZER_HELP)
    p.add_argument("--fix", help="pin knobs: tp=8,pp=4,schedule=interleaved,virtual_pp=2,...")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--dump-dir", help="write the plan's dump tree here (every pass, rank programs, ONNX, plan.json)")
    p.set_defaults(fn=_cmd_plan)

    p = sub.add_parser("lower", help="lower a plan.json again into a dump tree (what --dump-dir writes)")
    p.add_argument("--plan", required=True, help="a plan.json (from plan/demo/train --dump-dir)")
    p.add_argument("--cluster", required=True, help="preset, cluster file, or 'local' (this machine)")
    p.add_argument("--nodes", type=int, help="number of nodes of a preset (default: the preset's)")
    p.add_argument("--world-size", type=int, help="ranks of the 'local' cluster (default: the plan's)")
    p.add_argument("--seq", type=int, help="sequence length the model was planned at (default: the spec's)")
    p.add_argument("--no-onnx", dest="onnx", action="store_false", help="capture on the meta device, no ONNX")
    p.add_argument("--dump-dir", required=True, help="where to write the tree")
    p.set_defaults(fn=_cmd_lower)

    p = sub.add_parser("dry-run", help="run every distinct rank program of the job for a step, here, on fake "
                                       "tensors and a fake process group of the job's world size")
    p.add_argument("--model", help="NAME:key=value,... (default: the --plan's model)")
    p.add_argument("--cluster", required=True, help="preset (dgx-a100-80gb, dgx-h100, ...) or a YAML/JSON file")
    p.add_argument("--nodes", type=int, help="number of nodes (default: the preset's)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step (default: the --plan's)")
    p.add_argument("--dtype", help="fp32, or bf16/fp16 (default: the plan's, else the cluster's)")
    p.add_argument("--optimizer", default="adamw", help=OPTIMIZER_HELP)
    p.add_argument("--fix", help="pin knobs: tp=8,pp=4,... (the search chooses the rest)")
    p.add_argument("--plan", metavar="PLAN.json", help="dry-run this plan instead of searching one")
    p.add_argument("--steps", type=int, default=1, help="training steps per rank (default 1)")
    p.add_argument("--job-device", choices=("cpu", "cuda", "meta"),
                   help="the device every collective's tensors must be on (default: the fake tensors', cpu)")
    p.add_argument("--debug", action="store_true", help="print each failed rank's traceback")
    p.set_defaults(fn=_cmd_dry_run)

    p = sub.add_parser("models", help="list the model zoo")
    p.set_defaults(fn=_cmd_models)

    p = sub.add_parser("calibrate", help="measure this machine; write the cluster file local_cluster reads")
    p.add_argument("--world-size", type=int, help="local gloo ranks to calibrate for (default 4; under torchrun "
                                                  "the job's own ranks)")
    p.add_argument("--out", help="cluster file to write (default: this machine's cache file, which local_cluster "
                                 "reads; a calibration refreshes it)")
    p.add_argument("--show", action="store_true", help="print the calibrations cached for this machine and exit")
    p.add_argument("--quick", action="store_true",
                   help="fewer, smaller measurements and no reference runs (seconds; pessimistic)")
    p.add_argument("--no-reference-runs", action="store_true",
                   help="skip training the reference GPT under a few plans (about a minute) to fit the framework "
                        "overheads; the microbenchmarks alone predict small steps far too short")
    p.add_argument("--from-run", nargs="+", metavar="DIR",
                   help="refit the efficiency terms of the current local cluster file from run directories "
                        "(plan.json + measurements.json) instead of measuring; writes --out")
    p.set_defaults(fn=_cmd_calibrate)

    from partitioner.cli.demo import DEMO_FIX, DEMO_GLOBAL_BATCH, DEMO_MODEL

    p = sub.add_parser("demo", help="plan and train a GPT on 4 local gloo ranks, checked against one process")
    p.add_argument("--model", default=DEMO_MODEL, help=f"model spec (default {DEMO_MODEL})")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--fix", default=DEMO_FIX, help="pin knobs, e.g. dp=2,pp=2 (default: none, the search chooses)")
    p.add_argument("--global-batch", type=int, default=DEMO_GLOBAL_BATCH, help="samples per step")
    p.add_argument("--dump-dir", default="demo_out", help="the dump tree, plan.json, report.html, measurements.json")
    p.add_argument("--onnx", action="store_true", help=ONNX_HELP)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="training precision (16-bit: fp32 master weights; checked against one process in that dtype)")
    p.add_argument("--debug", action="store_true", help="on a failure, print the full traceback of each failed rank")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("train", help="train a model spec on every rank of a torchrun (env://) job")
    p.add_argument("--model", required=True, help="NAME:key=value,... (see `partitioner models`)")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--fix", help="pin knobs: dp=2,pp=2,... (the search chooses the rest)")
    p.add_argument("--plan", metavar="PLAN.json", help="run this plan (from plan/demo/train --dump-dir) instead of "
                                                      "searching; not with --fix")
    p.add_argument("--cluster", help="preset or cluster file (default: this machine, one device per rank)")
    p.add_argument("--dump-dir", help="write the dump tree, plan.json, report.html, measurements.json here (rank 0)")
    p.add_argument("--onnx", action="store_true", help=ONNX_HELP)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective/receive may wait (default 60)")
    p.add_argument("--optimizer", default="adamw", help=OPTIMIZER_HELP)
    p.add_argument("--lr", type=float, help="learning rate of --optimizer (default torch's)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="training precision: fp32, or bf16/fp16 weights, gradients and activations with fp32 "
                        "master weights (fp16 with dynamic loss scaling); default: bf16 on GPUs, fp32 on CPU ranks")
    p.add_argument("--data", metavar="FILE", help="train on this text file, each rank reading only its share "
                                                  "(windows of the model's seq + 1 tokens; default: the stdlib corpus)")
    p.add_argument("--tokenizer", metavar="NAME", help="Hugging Face tokenizer for --data (a local directory or a "
                                                       "cached hub name; default: byte-level, vocab 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --data sample order (default 0)")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line of metrics per step (rank 0)")
    p.add_argument("--save-dir", metavar="DIR", help="checkpoint root: a checkpoint after the last step, and every "
                                                     "--save-every steps")
    p.add_argument("--save-every", type=int, metavar="N", help="checkpoint every N steps (needs --save-dir)")
    p.add_argument("--keep", type=int, metavar="K", help="keep only the last K checkpoints (default: all)")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint root (its latest) or directory; "
                                                   "--steps counts from the start of the run")
    p.add_argument("--clip-grad-norm", type=float, metavar="X", help="clip the global gradient norm to X")
    p.add_argument("--warmup", type=int, metavar="N", help="learning rate: linear warm-up over N steps, then cosine "
                                                           "decay to 0.1x at --steps (default: constant)")
    p.add_argument("--nodes", type=int, metavar="N", help="the job spans N nodes of --cluster (torchrun --nnodes)")
    p.add_argument("--debug", action="store_true", help="on a failure, print the full traceback (default: one line)")
    p.set_defaults(fn=_cmd_train)
    for p in sub.choices.values():  # every command fails in one line, with the whole traceback on request
        if not any("--debug" in a.option_strings for a in p._actions):
            p.add_argument("--debug", action="store_true", help="on a failure, print the full traceback "
                                                                "(default: one error line)")
    return parser


def _failure_lines(exc: Exception) -> list[str]:
    """One line per failed rank of a spawned job (``runtime.dist.launch.LaunchError.failures``): its
    error and the frame it came from."""
    by_text: dict[str, list[int]] = {}
    lines = []
    for f in getattr(exc, "failures", ()):
        message = f.line.split(": ", 1)[-1]
        if message.startswith(f"rank {f.rank}: "):  # a RankFailure's message names its rank already
            lines.append(message)
        else:  # the same refusal on several ranks: one line naming them all
            by_text.setdefault(f.line, []).append(f.rank)
    for text, ranks in by_text.items():
        lines.append(f"rank {ranks[0]}: {text}" if len(ranks) == 1
                     else f"ranks {', '.join(map(str, sorted(ranks)))}: {text}")
    return lines


# What the work of every command but ``models`` imports (capturing a model loads torch's compiler
# stack and, at its first shape guard, the modules passes.capture.preload names): imported first,
# with the collector off, and frozen (passes.ir.heap).
_STACK = ("torch", "torch._dynamo", "passes.capture.preload")


def _import_stack() -> None:
    if all(m in sys.modules for m in _STACK):  # called in a process that has it (a test's): freeze nothing
        return
    with importing():
        for module in _STACK:
            importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    collect_young_less_often()  # the command's own process: it captures, plans and lowers
    args = build_parser().parse_args(argv)
    debug = args.debug
    try:
        if args.fn is not _cmd_models:
            _import_stack()
        _check_run_options(args)
        code = args.fn(args)
        sys.stdout.flush()  # here, where a reader that went away is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # whoever read our output stopped reading (`partitioner plan ... | head`): stop quietly,
        # as a Unix filter does, with stdout pointed at nothing so its flush at exit cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except PartitionerError as exc:
        lines = _failure_lines(exc)
        if debug:
            if lines:
                for f in exc.failures:
                    print(f"rank {f.rank}: {f.traceback}", file=sys.stderr)
            else:
                traceback.print_exc()
        for line in lines or [str(exc)]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line naming where it failed, not a traceback, unless --debug
        if debug:
            raise
        from runtime.dist.faults import error_line

        rank = f"rank {os.environ.get('RANK', '?')}: " if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""
        print(f"error: {rank}{error_line(exc)}; run with --debug for the full traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
