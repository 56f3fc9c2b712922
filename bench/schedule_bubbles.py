"""Measured pipeline bubble of every schedule against its theory, on balanced stages.

One spawn of ``--pp`` gloo ranks (one thread each) trains the same GPT under every schedule
(gpipe, 1f1b, interleaved, zb1p, zbv) for a few steps, the schedules taking turns step by step so
machine load hits them alike. For each schedule the last rounds' per-action timelines
(:class:`runtime.measure.StepTimer`) give:

* measured bubble: over the span from the first compute action of any rank to the last one, the
  share of rank-time not spent in forward / backward / weight-gradient actions (averaged over
  ranks; the gradient sync and the optimizer step come after the span);
* theory: the schedule's own action lists simulated (:func:`passes.ir.schedule.simulate`) with
  the measured mean seconds of one chunk's F, B (or I and W) on this run and the measured hop
  time of one boundary message: from the end of the sending action to the end of the receiver's
  wait for it, median over the waits that really waited (posting, the transfer and the host work
  around it; a bare ping-pong of the tensor is printed too, for comparison); also without
  communication, and, for GPipe / 1F1B / interleaved, the closed form ``(p-1)/v / (m + (p-1)/v)``.

Run: ``python bench/schedule_bubbles.py [--pp 2] [--m 8] [--steps 4]``. Prints a table; asserts
nothing. The stages are balanced by construction: 8 equal blocks, a small vocabulary so that the
embedding and the head add little to the first and last stage.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.launch import spawn

MODEL = "gpt:layers=8,hidden=128,heads=4,vocab=128,seq=64,dropout=0.0"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 2))
COMPUTE = ("F", "B", "I", "W")


def _kind(label: str) -> str | None:
    for k in COMPUTE:
        head, sep, tail = label.partition(k)
        if sep and head.isdigit() and tail.isdigit():
            return k
    return None


def _rank(pp: int, m: int, steps: int, warmup: int) -> dict:
    from partitioner.build import build_parallel_model, capture_for_pipeline
    from partitioner.model_spec import build_model
    from passes.ir.config import ParallelConfig
    from passes.ir.schedule.validate import stream_count
    from runtime.measure import StepTimer
    from runtime.mesh import Mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_s=600)
    spec = build_model(MODEL)
    graph = capture_for_pipeline(spec)
    meshes = {n: Mesh(1, pp, 1, timeout_s=300, pp_streams=n) for n in sorted({stream_count(s) for s, _ in SCHEDULES})}
    models, timers = {}, {}
    for name, v in SCHEDULES:
        config = ParallelConfig.for_global_batch(2 * m, pp=pp, schedule=name, virtual_pp=v, num_micro_batches=m)
        models[name] = build_parallel_model(graph, config, meshes[stream_count(name)], optimizer={"lr": 1e-4})
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
    x = torch.zeros(2, spec.dims["seq"], 128)
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
    """Seconds from a sending action's end to the end of the receiver's wait, for every receive
    that waited (rows: per rank (wall start, timeline) of one step)."""
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
                    waits.append((src, got[0][1]))
    out = []
    for (stage, kinds, mb), arrived in waits:
        sent = [ends[(stage, k, mb)] for k in kinds if (stage, k, mb) in ends]
        if sent and arrived > sent[0]:
            out.append(arrived - sent[0])
    return out


def _bubble(rows: list[tuple[float, tuple]]) -> tuple[float, dict[str, float]]:
    """Measured bubble of one step (rows: per rank (wall start, timeline)) and the mean seconds per
    compute action kind."""
    first = min(start for start, _ in rows)
    spans, busy, seconds = [], [], {k: [] for k in COMPUTE}
    for start, timeline in rows:
        shift = start - first
        acts = [(_kind(label), a + shift, b + shift) for label, a, b in timeline if _kind(label)]
        # a receive waited inside an action is idle, not compute
        waits = [(a + shift, b + shift) for label, a, b in timeline if label == "wait"]
        work = 0.0
        for kind, a, b in acts:
            inner = sum(max(0.0, min(b, wb) - max(a, wa)) for wa, wb in waits)
            work += b - a - inner
            seconds[kind].append(b - a - inner)
        busy.append(work)
        spans.append((min(a for _, a, _ in acts), max(b for _, _, b in acts)))
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    return 1.0 - sum(busy) / (len(rows) * (hi - lo)), {k: statistics.mean(v) for k, v in seconds.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=4, help="timed rounds (after 2 warm-up rounds)")
    args = ap.parse_args()
    from passes.ir.schedule import build, simulate

    t0 = time.perf_counter()
    results = spawn(_rank, args.pp, args.pp, args.m, args.steps, 2, timeout_s=1800)
    p, m = args.pp, args.m
    print(f"{MODEL}, pp={p}, m={m}, {args.steps} timed rounds ({time.perf_counter() - t0:.0f} s)\n")
    ping = results[0]["message_s"]
    hops = [h for name, _ in SCHEDULES for k in range(args.steps) for h in _hops([results[r][name][k] for r in range(p)])]
    message_s = statistics.median(hops) if hops else ping
    print(f"one boundary message: {message_s * 1e3:.2f} ms from the sender's action end to the receiver's wait end "
          f"(median of {len(hops)}); a bare ping-pong of the tensor: {ping * 1e3:.2f} ms one way\n")
    print("| schedule | measured bubble | theory: simulated, measured F/B/I/W and messages | measured - theory "
          "(points) | simulated without messages | closed form | F ms | B ms | I ms | W ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in SCHEDULES:
        per_step = [_bubble([results[r][name][k] for r in range(p)]) for k in range(args.steps)]
        measured = statistics.median(b for b, _ in per_step)
        secs = {k: statistics.mean(s[k] for _, s in per_step if k in s) for k in COMPUTE if k in per_step[0][1]}
        f = secs["F"]
        b = secs.get("B", secs.get("I", 0.0) + secs.get("W", 0.0))
        schedule = build(name, p, m, v)
        theory = simulate(schedule, f, b, message_s, weight_time=secs.get("W")).bubble_fraction()
        bare = simulate(schedule, f, b, weight_time=secs.get("W")).bubble_fraction()
        closed = "" if name.startswith("zb") else f"{((p - 1) / v) / (m + (p - 1) / v):.3f}"
        cells = [f"{secs[k] * 1e3:.1f}" if k in secs else "" for k in COMPUTE]
        print(f"| {name} | {measured:.3f} | {theory:.3f} | {100 * (measured - theory):+.1f} | {bare:.3f} | {closed} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
