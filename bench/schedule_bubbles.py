"""Measured pipeline bubble of every schedule against its theory, on balanced stages.

One spawn of ``--pp`` gloo ranks (one thread each) trains the same GPT under every schedule
(gpipe, 1f1b, interleaved, zb1p, zbv) for a few steps, the schedules taking turns step by step so
machine load hits them alike. For each schedule the last rounds' per-action timelines
(:class:`runtime.observe.measure.StepTimer`) give:

* measured bubble: over the span from the first compute action of any rank to the last one, the
  share of rank-time not spent in forward / backward / weight-gradient actions (averaged over
  ranks; the gradient sync and the optimizer step come after the span);
* theory: the schedule's own action lists simulated (:func:`passes.ir.schedule.simulate`) with
  each stage's measured mean seconds of F, B (or I and W) on this run and the measured time of one
  boundary message: from when both ends are ready (the later of the sending action's end and the
  start of the receiver's wait) to the end of that wait, median over the waits that really waited
  (a bare ping-pong of the tensor is printed too, for comparison); also without communication,
  with the stages' mean times (perfect balance), and, for GPipe / 1F1B / interleaved, the closed
  form ``(p-1)/v / (m + (p-1)/v)``.

Run: ``python bench/schedule_bubbles.py [--pp 2] [--m 8] [--steps 4] [--model SPEC]``. Prints a
table; asserts nothing. The stages are balanced by construction: 8 equal blocks, a small
vocabulary so that the embedding and the head add little to the first and last stage.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.dist.launch import spawn
from partitioner.calibration.job_cluster import local_cluster

MODEL = "gpt:layers=8,hidden=384,heads=4,vocab=128,seq=128,dropout=0.0"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 2))
COMPUTE = ("F", "B", "I", "W")


def _kind(label: str) -> str | None:
    for k in COMPUTE:
        head, sep, tail = label.partition(k)
        if sep and head.isdigit() and tail.isdigit():
            return k
    return None


def _rank(pp: int, m: int, steps: int, warmup: int, model: str = MODEL) -> dict:
    from partitioner.compile.build import build_parallel_model, capture_for_pipeline
    from partitioner.inputs.models import build_model
    from passes.ir.config import ParallelConfig
    from passes.ir.schedule.validate import stream_count
    from runtime.observe.measure import StepTimer
    from runtime.dist.mesh import Mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_s=600)
    spec = build_model(model)
    graph = capture_for_pipeline(spec)
    meshes = {n: Mesh(1, pp, 1, timeout_s=300, pp_streams=n) for n in sorted({stream_count(s) for s, _ in SCHEDULES})}
    models, timers = {}, {}
    for name, v in SCHEDULES:
        config = ParallelConfig.for_global_batch(2 * m, pp=pp, schedule=name, virtual_pp=v, num_micro_batches=m)
        models[name] = build_parallel_model(graph, config, meshes[stream_count(name)], optimizer={"lr": 1e-4}, cluster=local_cluster(meshes[stream_count(name)].size))
        timers[name] = StepTimer(models[name], track_memory=False)
    batch = spec.example_inputs({"batch": 2 * m}, seed=1)
    out: dict = {name: [] for name, _ in SCHEDULES}
    out["message_s"] = _one_way_message_s(spec)
    for k in range(warmup + steps):
        for name, _ in SCHEDULES:
            torch.distributed.barrier()
            meas = timers[name].measure(k, lambda: models[name].train_step(batch))
            if k >= warmup:
                out[name].append((meas.started_at, meas.timeline))
    return out


def _one_way_message_s(spec, trips: int = 50) -> float:
    """Median one-way seconds of a boundary tensor (one micro-batch of 2 samples' hidden states)
    between ranks 0 and 1, by ping-pong over isend/irecv as the executor posts them."""
    import torch.distributed as dist

    rank = dist.get_rank()
    hidden = next(p for p in spec.module.parameters() if p.dim() == 2).shape[1]  # the embedding's width
    x = torch.zeros(2, spec.dims["seq"], hidden)
    times = []
    for _ in range(trips):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.isend(x, 1).wait()
            dist.irecv(x, 1).wait()
        elif rank == 1:
            dist.irecv(x, 0).wait()
            dist.isend(x, 0).wait()
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _hops(rows: list[tuple[float, tuple]]) -> list[float]:
    """Seconds from the later of a sending action's end and the start of the receiver's wait to
    the end of that wait, for every receive that waited (rows: per rank (wall start, timeline)
    of one step)."""
    first = min(start for start, _ in rows)
    ends, waits = {}, []
    for start, timeline in rows:
        shift = start - first
        inner = [(a + shift, b + shift) for label, a, b in timeline if label == "wait"]
        for label, a, b in timeline:
            kind = _kind(label)
            if kind is None:
                continue
            stage, mb = (int(x) for x in label.split(kind))
            ends[(stage, kind, mb)] = b + shift
            if kind in ("F", "B", "I"):
                got = [(wa, wb) for wa, wb in inner if a + shift <= wa and wb <= b + shift and wb - wa > 5e-5]
                if got:
                    src = (stage - 1, ("F",), mb) if kind == "F" else (stage + 1, ("B", "I"), mb)
                    waits.append((src, got[0]))
    out = []
    for (stage, kinds, mb), (began, arrived) in waits:
        sent = [ends[(stage, k, mb)] for k in kinds if (stage, k, mb) in ends]
        # from when both sides were ready: a receiver that starts waiting after the send ended
        # waited only for the message itself (the receive is posted right before its wait, and
        # gloo moves the data once both ends are posted)
        if sent and arrived > max(sent[0], began):
            out.append(arrived - max(sent[0], began))
    return out


def _bubble(rows: list[tuple[float, tuple]]) -> tuple[float, dict[tuple[str, int], list[float]]]:
    """Measured bubble of one step (rows: per rank (wall start, timeline)) and the seconds of each
    compute action by (kind, stage)."""
    first = min(start for start, _ in rows)
    spans, busy, seconds = [], [], {}
    for start, timeline in rows:
        shift = start - first
        acts = [(label, a + shift, b + shift) for label, a, b in timeline if _kind(label)]
        # a receive waited inside an action is idle, not compute
        waits = [(a + shift, b + shift) for label, a, b in timeline if label == "wait"]
        work = 0.0
        for label, a, b in acts:
            inner = sum(max(0.0, min(b, wb) - max(a, wa)) for wa, wb in waits)
            work += b - a - inner
            kind = _kind(label)
            seconds.setdefault((kind, int(label.split(kind)[0])), []).append(b - a - inner)
        busy.append(work)
        spans.append((min(a for _, a, _ in acts), max(b for _, _, b in acts)))
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    return 1.0 - sum(busy) / (len(rows) * (hi - lo)), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=4, help="timed rounds (after 2 warm-up rounds)")
    ap.add_argument("--model", default=MODEL, help="model spec (keep the blocks equal: balanced stages)")
    args = ap.parse_args()
    from passes.ir.schedule import build, simulate

    t0 = time.perf_counter()
    results = spawn(_rank, args.pp, args.pp, args.m, args.steps, 2, args.model, timeout_s=1800)
    p, m = args.pp, args.m
    print(f"{args.model}, pp={p}, m={m}, {args.steps} timed rounds ({time.perf_counter() - t0:.0f} s)\n")
    ping = results[0]["message_s"]
    hops = [h for name, _ in SCHEDULES for k in range(args.steps) for h in _hops([results[r][name][k] for r in range(p)])]
    message_s = statistics.median(hops) if hops else ping
    print(f"one boundary message: {message_s * 1e3:.2f} ms from the sender's action end to the receiver's wait end "
          f"(median of {len(hops)}); a bare ping-pong of the tensor: {ping * 1e3:.2f} ms one way\n")
    print("| schedule | measured bubble | theory: simulated, each stage's measured F/B/I/W and messages | "
          "measured - theory (points) | simulated without messages | same, stages' mean times | closed form | "
          "F ms (stages) | B ms | I ms | W ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in SCHEDULES:
        per_step = [_bubble([results[r][name][k] for r in range(p)]) for k in range(args.steps)]
        measured = statistics.median(b for b, _ in per_step)
        # mean seconds of each action kind per stage over the timed steps: the stages' own times,
        # so a stage slower than its neighbours (the head and loss on the last) is in the theory
        pooled: dict[tuple[str, int], list[float]] = {}
        for _, secs_of in per_step:
            for key, values in secs_of.items():
                pooled.setdefault(key, []).extend(values)
        stage = {key: statistics.mean(values) for key, values in pooled.items()}
        kinds = sorted({k for k, _ in stage}, key=COMPUTE.index)
        f = {st: t for (k, st), t in stage.items() if k == "F"}
        w = {st: t for (k, st), t in stage.items() if k == "W"} or None
        b = {st: t for (k, st), t in stage.items() if k == "B"} or {st: stage[("I", st)] + w[st] for st in f}
        schedule = build(name, p, m, v)
        theory = simulate(schedule, f, b, message_s, weight_time=w).bubble_fraction()
        bare = simulate(schedule, f, b, weight_time=w).bubble_fraction()
        uniform = simulate(schedule, statistics.mean(f.values()), statistics.mean(b.values()),
                           weight_time=statistics.mean(w.values()) if w else None).bubble_fraction()
        closed = "" if name.startswith("zb") else f"{((p - 1) / v) / (m + (p - 1) / v):.3f}"
        per_kind = {k: [t for (kk, _), t in stage.items() if kk == k] for k in kinds}
        cells = [f"{1e3 * min(per_kind[k]):.1f}-{1e3 * max(per_kind[k]):.1f}" if k in per_kind else "" for k in COMPUTE]
        print(f"| {name} | {measured:.3f} | {theory:.3f} | {100 * (measured - theory):+.1f} | {bare:.3f} | "
              f"{uniform:.3f} | {closed} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
