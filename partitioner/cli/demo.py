"""``partitioner demo`` and ``partitioner train``: plan and train a model on real text.

``partitioner demo`` (no arguments needed) plans the zoo GPT for 4 local gloo ranks on the
cluster its ranks detect (``detect_cluster``: this machine, calibrated inside the job the first
time; ``$PARTITIONER_CLUSTER_FILE`` overrides it), letting the search choose every
knob (``--fix`` pins some), prints the chosen plan and the runner-up with how much it lost, spawns the 4 ranks
(:func:`runtime.dist.launch.spawn`), trains on the byte-level stdlib corpus (:mod:`partitioner.cli.corpus`),
prints the loss per step (and a tqdm bar when stderr is a terminal), checks the first steps
against single-process training of the same model, and leaves in ``--dump-dir`` the plan's dump tree
(:mod:`partitioner.api.dumps`: every pass of the lowering, each rank program as text, and as ONNX
with ``--onnx``),
``plan.json``, ``report.html`` and ``measurements.json``.

``partitioner train`` is the same loop for any model spec, run by every rank of a job that
torchrun (or any env:// launcher) started. A rank that fails (an exception, or a peer that
died: gloo raises on the survivors, every group has a timeout) prints
``rank R: peer rank K failed during <action>; exiting`` (a peer that stopped answering: ``rank R:
peer rank K stopped answering: no heartbeat for T s (host, pid P); ...``, :mod:`runtime.dist.heartbeat`)
and the frame it came from, and exits with :data:`EXIT_PEER_FAILED`; ``--debug`` prints the
traceback first.
``train --data FILE`` trains on a text file instead (:func:`token_dataset`), each rank reading only
the fields of its own dp shard that its stages consume (``AutoParallel.fit``, :mod:`runtime.exec.data`);
``--metrics`` writes per-step JSON lines, ``--save-dir``/``--resume`` checkpoint and continue
(weights, optimizer, and the data order's position).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from passes.ir.errors import PartitionerError

if TYPE_CHECKING:  # torch is imported where used: `partitioner --help` stays fast
    import torch

    from partitioner.inputs.job import Job
    from partitioner.inputs.training import Training

    from passes.ir.plan import Plan

DEMO_MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=64,dropout=0.0"
DEMO_FIX = None
"""Nothing pinned: the search chooses dp, tp, pp, micro-batching, schedule, ZeRO, checkpointing
and offload (the dtype is the user's)."""
DEMO_WORLD = 4
DEMO_GLOBAL_BATCH = 8
CHECK_STEPS = 3
CHECK_RTOL = 1e-4
CHECK_RTOL_16BIT = 2e-2
"""bf16/fp16 losses are 16-bit numbers summed in a plan's own order: about one unit in the last
place of bf16 (2**-8 relative) apart from one process's; two of them stay under this bound."""
EXIT_PEER_FAILED = 3
"""Exit status of ``partitioner train`` on a rank that stops because a peer failed."""
EXIT_RANK_FAILED = 1
"""Exit status of the rank whose own step raised."""


class RankFailure(PartitionerError, RuntimeError):
    """This rank's training stopped because it (``own``) or a peer failed; the message names who
    and where."""

    def __init__(self, message: str, *, own: bool):
        super().__init__(message)
        self.own = own


class ParityError(PartitionerError, RuntimeError):
    """Distributed training did not match single-process training of the same model."""


def batch_for(spec, step: int, global_batch: int) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step``: corpus bytes for language models with (idx, targets) inputs
    and a vocabulary of at least 256, seeded random inputs (``spec.example_inputs``) otherwise."""
    from partitioner.cli import corpus

    names = tuple(i.name for i in spec.inputs)
    if names == ("idx", "targets") and all((i.high or 0) >= corpus.VOCAB for i in spec.inputs):
        return corpus.batch(step, global_batch, int(spec.dims["seq"]))
    return spec.example_inputs({"batch": global_batch}, seed=1000 + step)


def progress(step: int, steps: int, loss: float, seconds: float) -> str:
    """``step   3/30  loss 5.5412  0.31 s/step``: the log line of a step."""
    return f"step {step:>3}/{steps}  loss {loss:.4f}  {seconds:.2f} s/step"


def step_bar(steps: int, *, start: int = 0, echo: bool = True):
    """A bar over ``steps`` steps (``start`` done), drawn only on the echoing rank
    (:func:`runtime.observe.progress.terminal_bar`): captured output gets the per-step lines alone."""
    from runtime.observe.progress import terminal_bar  # the runtime imports torch: `--help` stays fast

    return terminal_bar(steps, unit="step", initial=start, show=echo)


def echo_step(bar, step: int, steps: int, loss: float, seconds: float) -> None:
    """Print the step's :func:`progress` line on stdout (above the bar, which it redraws) and
    advance the bar."""
    bar.write(progress(step, steps, loss, seconds), file=sys.stdout)
    sys.stdout.flush()
    bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
    bar.update(1)


def train_loop(trainer, steps: int, batch: Callable[[int], Sequence[torch.Tensor]], *,
               echo: bool, start: int = 0, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train steps ``start .. steps-1`` (``batch(k)``: the global batch of step ``k``); on rank 0
    (``echo``) prints a progress line per step (and a :func:`step_bar` on a terminal);
    ``on_step(steps_done, loss)`` after each. Any failure is re-raised as :class:`RankFailure`
    naming the failed peer and this rank's last action."""
    losses = []
    try:
        with step_bar(steps, start=start, echo=echo) as bar:
            for step in range(start, steps):
                begin = time.perf_counter()
                losses.append(trainer.train_step(batch(step)))
                if echo:
                    echo_step(bar, step + 1, steps, losses[-1], time.perf_counter() - begin)
                if on_step is not None:
                    on_step(step + 1, losses[-1])
    except Exception as exc:  # noqa: BLE001 - a peer's death shows up as any of gloo's errors
        raise _rank_failure(trainer, exc) from exc
    return losses


def fit_loop(trainer, dataset, steps: int, *, echo: bool, start: int = 0, seed: int = 0,
             sampler_state: dict | None = None, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """As :func:`train_loop`, each rank loading its own share of ``dataset`` (``AutoParallel.fit``,
    :mod:`runtime.exec.data`); the progress line's seconds include loading the step's data."""
    last = [time.perf_counter()]

    try:
        with step_bar(steps, start=start, echo=echo) as bar:
            def done(step: int, loss: float) -> None:
                if echo:
                    echo_step(bar, step, steps, loss, time.perf_counter() - last[0])
                if on_step is not None:
                    on_step(step, loss)
                last[0] = time.perf_counter()

            return trainer.fit(dataset, steps=max(0, steps - start), seed=seed, sampler_state=sampler_state,
                               on_step=done)
    except Exception as exc:  # noqa: BLE001 - as train_loop
        raise _rank_failure(trainer, exc) from exc


def _rank_failure(trainer, exc: Exception) -> RankFailure:
    from runtime.dist.heartbeat import STALE_AFTER_S

    mesh = trainer.model.mesh
    # A stopped peer's heartbeat is about one timeout old when a wait on it gives up: a short
    # timeout needs a shorter staleness bound (never below three beats).
    stale_s = min(STALE_AFTER_S, max(3.0, mesh.timeout.total_seconds() / 2))
    from runtime.dist.faults import describe_failure, is_communication_error

    return RankFailure(describe_failure(exc, rank=trainer.rank, last_action=trainer.last_action,
                                        identities=trainer.identities, pp_ranks=mesh.pp_ranks,
                                        group_ranks=range(mesh.first, mesh.first + mesh.size),
                                        stale_after_s=stale_s),
                       own=not is_communication_error(exc))


def token_dataset(spec, path: str, tokenizer: str | None = None):
    """``path`` as a :class:`runtime.exec.data.TokenFileDataset` for a language model ``spec`` (two
    integer inputs over ``("batch", "seq")``: token ids and next-token targets), windows of the
    model's ``seq``. Raises :class:`ConfigError` for other models."""
    from passes.ir.errors import ConfigError
    from runtime.exec.data import TokenFileDataset

    ins = spec.inputs
    if len(ins) != 2 or any(i.dtype.is_floating_point or tuple(i.shape) != ("batch", "seq") for i in ins):
        raise ConfigError(f"train --data: a text file trains a language model taking (token ids, targets) of dims "
                          f"(batch, seq), e.g. gpt or llama; {spec.name} takes "
                          f"{[(i.name, i.shape) for i in ins]}: train it without --data")
    return TokenFileDataset(path, int(spec.dims["seq"]), tokenizer=tokenizer, names=(ins[0].name, ins[1].name))


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """What one demo rank returns to the launcher."""

    losses: list[float]
    plan_json: str
    build_s: float
    train_s: float
    measured: dict[int, dict[str, float]]
    breakdown: dict[int, dict[str, float]]
    """Per rank: median seconds per step of each measured term (:func:`breakdown`)."""
    eval_loss: float
    """Loss of the next, unseen corpus batch after training (``eval_step``)."""
    build_phases: dict[str, float]
    """Seconds of each phase of ``auto_parallelize`` on this rank."""


def _demo_rank(model: str, steps: int, fix: str | None, training: Training, job: Job, cluster=None) -> RankResult:
    import torch.distributed as dist

    from partitioner.api.auto import auto_parallelize

    start = time.perf_counter()
    global_batch = training.global_batch
    trainer = auto_parallelize(model, cluster, training=training, fix=fix, job=job)
    built = time.perf_counter()
    rank0 = dist.get_rank() == 0
    if rank0:
        print("\n".join(plan_lines(trainer.plan, fix)), flush=True)
    losses = train_loop(trainer, steps, lambda k: batch_for(trainer.spec, k, global_batch), echo=rank0)
    trained = time.perf_counter()
    eval_loss = trainer.eval_step(batch_for(trainer.spec, steps, global_batch))
    run = trainer.finish()
    return RankResult(losses=losses, plan_json=trainer.plan.to_json(), build_s=built - start,
                      train_s=trained - built, measured=run.summary_by_rank(), breakdown=breakdown(run.steps),
                      eval_loss=eval_loss, build_phases=trainer.build_seconds)


def plan_lines(plan: Plan, fix: str | None) -> list[str]:
    """What the search decided: the chosen plan (and what was pinned), then the runner-up and
    how much slower it was predicted, in seconds and percent."""
    from partitioner.search.search import runner_up

    pinned = f"pinned {fix}" if fix else "nothing pinned"
    lines = [f"plan ({pinned}; the search chose the rest): {plan.summary()}"]
    second = runner_up(plan)
    if second is None:
        lines.append("runner-up: none (no other candidate fits)")
    else:
        # a tie goes to the simpler plan (search._key): say so rather than leave "lost by 0 s" unexplained
        tie = "; a tie, the simpler plan is chosen" if second.loss_s == 0 else ""
        lines.append(f"runner-up: {_knobs_text(second.knobs)}: {second.step_time_s:.4f} s predicted, lost by "
                     f"{second.loss_s:.3g} s ({second.loss_fraction:.2%}){tie}")
    return lines


def _knobs_text(knobs: dict) -> str:
    short = {"micro_batch_size": "mbs", "num_micro_batches": "m", "zero_stage": "zero",
             "sequence_parallel": "sp", "checkpointing": "ckpt", "virtual_pp": "v"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in knobs.items() if not (k == "virtual_pp" and v == 1))


TERMS = ("wall_s", "compute_s", "recv_wait_s", "send_wait_s", "p2p_post_s", "collective_s", "optimizer_s", "other_s")


def breakdown(steps, skip_first: int = 2) -> dict[int, dict[str, float]]:
    """Per rank, the median over steps (after ``skip_first`` warm-up, memory-tracked steps) of each term of
    :class:`runtime.observe.measure.StepMeasurement`, in seconds."""
    out = {}
    for rank, per_rank in enumerate(steps):
        kept = per_rank[skip_first:] or per_rank
        out[rank] = {t: sorted(getattr(m, t) for m in kept)[len(kept) // 2] for t in TERMS}
    return out


def reference_losses(model: str, steps: int, global_batch: int, dtype: str = "fp32") -> list[float]:
    """Single-process AdamW training of ``model`` (same seed, same batches): per-step losses. A
    16-bit ``dtype``: the model cast to it, AdamW on fp32 master weights; fp16 with the runtime's
    dynamic loss scaling policy (:class:`runtime.optim.mixed_precision.DynamicLossScaler`)."""
    import torch

    from partitioner.inputs.models import build_model
    from passes.ir.config import TORCH_DTYPES
    from runtime.optim.mixed_precision import DynamicLossScaler, MasterWeightOptimizer
    from runtime.optim.optimizers import module_param_groups

    spec = build_model(model, device="cpu", seed=0)  # auto_parallelize builds with seed 0 too
    if dtype == "fp32":
        opt = torch.optim.AdamW(module_param_groups(spec.module))
    else:
        spec = spec.cast(TORCH_DTYPES[dtype])
        groups = module_param_groups(spec.module)
        no_decay = {id(p) for p in groups[1]["params"]}
        params = groups[0]["params"] + groups[1]["params"]
        opt = MasterWeightOptimizer(params, no_decay=[id(p) in no_decay for p in params])
    scaler = DynamicLossScaler() if dtype == "fp16" else None
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss = spec.loss(spec.module, *batch_for(spec, step, global_batch))
        out.append(loss.item())
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        (loss.float() * scaler.scale).backward()
        overflow = bool(scaler.unscale_local(opt.prepare_grads(), torch.device("cpu")))
        scaler.update(overflow)
        if not overflow:
            opt.apply()
    return out


def _off(predicted: float, measured: float) -> str:
    """``"-12.3% off"``: the prediction's error relative to the measurement."""
    return f"{(predicted / measured - 1) * 100:+.1f}% off" if measured > 0 else "nothing measured"


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


ONNX_NOTE = {True: " (+ .onnx)", False: " (ONNX: --onnx, or the manifest's partitioner lower command)"}
"""What the closing line says of ``program.onnx``, with and without ``--onnx``."""


def run_demo(*, model: str = DEMO_MODEL, steps: int = 30, fix: str | None = DEMO_FIX, dump_dir: str = "demo_out",
             global_batch: int = DEMO_GLOBAL_BATCH, timeout_s: float = 60.0, track_memory: bool | int = 2,
             dtype: str = "fp32", onnx: bool = False, out=None) -> dict:
    """The whole demo; returns a summary dict. Raises :class:`ParityError` when the first
    :data:`CHECK_STEPS` losses differ from single-process training by more than :data:`CHECK_RTOL`."""
    from partitioner.inputs.job import Job
    from partitioner.inputs.training import Training
    from runtime.dist.launch import preload, spawn

    training = Training(global_batch=global_batch, dtype=dtype)  # refused here, before any rank starts
    preload("partitioner.cli.demo", "partitioner.api.auto", "passes.capture.preload")  # imported once, by the server the ranks fork from

    def say(text: str) -> None:
        print(text, file=out or sys.stdout, flush=True)

    start = time.perf_counter()
    dump = str(Path(dump_dir).resolve())
    # the cluster is the ranks' to find, as in any job (auto_parallelize's detect_cluster): on a
    # first run they calibrate this machine together, inside the job, instead of this process
    # starting a calibration job of its own first; rank 0 prints what it found
    say(f"demo: {model} on {DEMO_WORLD} local gloo ranks, {f'fix {fix}' if fix else 'nothing pinned'}, "
        f"global batch {global_batch}, {steps} steps; the ranks detect the cluster")
    job = Job(dump_dir=dump, timeout_s=timeout_s, track_memory=track_memory, onnx=onnx)
    results = spawn(_demo_rank, DEMO_WORLD, model, steps, fix, training, job, None,
                    timeout_s=max(600.0, 20.0 * steps))
    distributed_s = time.perf_counter() - start
    losses = results[0].losses
    for rank, r in enumerate(results):
        if r.losses != losses:
            raise ParityError(f"rank {rank} returned losses {r.losses[:3]}..., rank 0 {losses[:3]}...; every rank "
                              f"must return the same loss")
    n = min(CHECK_STEPS, steps)
    ref = reference_losses(model, n, global_batch, dtype)
    diff = max_rel_diff(losses[:n], ref) if n else 0.0
    rtol = CHECK_RTOL if dtype == "fp32" else CHECK_RTOL_16BIT
    if diff > rtol:
        raise ParityError(f"first {n} losses {losses[:n]} differ from single-process {dtype} training {ref} by max "
                          f"rel diff {diff:.2e} > {rtol:g}")
    say(f"matches single-process training: max rel diff {diff:.2e} over the first {n} steps")
    measured = results[0].measured
    med = sorted(v["step_time_s"] for v in measured.values())
    peaks = [v["peak_memory_bytes"] for v in measured.values()]
    from passes.ir.plan import Plan

    plan = Plan.from_json(results[0].plan_json)
    step_s, peak = med[len(med) // 2], max(peaks)
    memory = (f"peak memory {peak / 2**20:.2f} MiB measured, {plan.predicted.peak_memory_bytes / 2**20:.2f} MiB "
              f"predicted ({_off(plan.predicted.peak_memory_bytes, peak)})") if not plan.config.compile else \
        "peak memory not measured (compiled programs on CPU ranks run outside the memory tracker)"
    say(f"step time (median over ranks): {step_s:.3f} s measured, {plan.predicted.step_time_s:.3f} s "
        f"predicted ({_off(plan.predicted.step_time_s, step_s)}); {memory}")
    if "+refit" not in plan.cluster:
        say(f"  (predicted on cluster '{plan.cluster}'; to predict this machine, fit it to this run: "
            f"partitioner calibrate --from-run {dump})")
    say(f"eval loss on the next unseen batch: {results[0].eval_loss:.4f}")
    say("per rank, median ms per step:  " + "  ".join(t[:-2] for t in TERMS))
    for rank, terms in results[0].breakdown.items():
        say(f"  rank {rank}:  " + "  ".join(f"{terms[t] * 1e3:{len(t) - 2}.1f}" for t in TERMS))
    phases = results[0].build_phases
    say("build on rank 0: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    total = time.perf_counter() - start
    say(f"wrote {dump}/: every pass, stage<s>_tp<r>/program.txt{ONNX_NOTE[onnx]}, plan.json, report.html, "
        f"measurements.json  (total {total:.1f} s: build "
        f"{max(r.build_s for r in results):.1f} s, train {max(r.train_s for r in results):.1f} s)")
    return {"losses": losses, "reference": ref, "max_rel_diff": diff, "seconds": total,
            "distributed_seconds": distributed_s, "plan": plan, "dump_dir": dump}


def run_train(*, model: str, global_batch: int, steps: int, fix: str | None, dump_dir: str | None,
              cluster: str | None, timeout_s: float, lr: float | None, dtype: str | None = None,
              optimizer: str = "adamw", plan: str | None = None, data: str | None = None,
              tokenizer: str | None = None, seed: int = 0, metrics: str | None = None, save_dir: str | None = None,
              save_every: int | None = None, keep: int | None = None, resume: str | None = None,
              clip_grad_norm: float | None = None, warmup: int | None = None, nodes: int | None = None,
              debug: bool = False, onnx: bool = False) -> int:
    """``partitioner train`` on this rank (env:// rendezvous); returns the exit code.

    ``data``: a text file (:func:`token_dataset`; ``tokenizer``: a Hugging Face tokenizer name,
    default byte-level) that every rank reads its own share of, in an order fixed by ``seed``
    (:mod:`runtime.exec.data`); without it, the corpus batches of :func:`batch_for`. ``metrics``: a
    JSONL file of per-step metrics (rank 0). ``save_dir``: checkpoint every ``save_every``
    steps (and after the last), keeping the last ``keep``; ``resume``: a checkpoint root or
    directory to continue from. ``steps`` counts from the start of the run, so a resumed run
    trains the steps after the checkpoint's up to ``steps``. ``clip_grad_norm``: the global
    norm's clip; ``warmup``: warm-up steps of a warm-up + cosine schedule over ``steps``;
    ``nodes``: the job spans that many nodes of ``cluster``. A failed step prints one line
    (:class:`RankFailure` and the frame it came from; ``debug``: the whole traceback first)."""
    import torch.distributed as dist

    from partitioner.api.auto import auto_parallelize
    from runtime.exec.data import probe_dataset

    from partitioner.cost.cluster import Cluster
    from partitioner.inputs.job import Job
    from partitioner.inputs.training import Training
    from runtime.optim.lr_schedules import warmup_cosine

    training = Training(global_batch=global_batch, optimizer=with_lr(optimizer, lr), dtype=dtype,
                        clip_grad_norm=clip_grad_norm,
                        lr_scheduler=warmup_cosine(warmup, steps) if warmup is not None else None)
    job = Job(timeout_s=timeout_s, dump_dir=dump_dir, onnx=onnx)
    chosen = read_plan(plan) if plan is not None else None
    _report_before_sigterm(timeout_s + 5.0)
    job_cluster = Cluster.load(cluster, nodes=nodes) if nodes is not None else cluster
    trainer = auto_parallelize(model, job_cluster, training=training, fix=fix, plan=chosen, job=job)
    rank0 = dist.get_rank() == 0
    dataset = token_dataset(trainer.spec, data, tokenizer) if data is not None else None
    if dataset is not None:  # refused here on every rank alike, before any step
        probe_dataset(dataset, trainer.model.inputs)
    start, sampler_state = 0, None
    if resume is not None:
        state = trainer.load(resume)
        start, sampler_state = state.step, (state.extra or {}).get("sampler")
        if dataset is not None and sampler_state is None:  # saved by a run without --data: data from its step
            sampler_state = {"seed": seed, "step": start, "global_batch": global_batch, "num_samples": len(dataset)}
    if rank0:
        print(f"plan: {trainer.plan.summary()}", flush=True)
        if dataset is not None:
            print(f"data: {data}, {len(dataset)} windows of {dataset.seq + 1} tokens "
                  f"({tokenizer or 'byte-level'}, vocab {dataset.vocab_size})", flush=True)
        if resume is not None:
            print(f"resumed from {state.path} at step {start}", flush=True)
    logger = None
    if metrics is not None:
        from runtime.observe.metrics import MetricsLogger

        logger = MetricsLogger(jsonl=metrics, echo=False, total_steps=steps) if rank0 else None
        trainer.attach_metrics(logger)

    def save(step: int) -> None:
        sampler = getattr(trainer, "sampler", None)
        extra = {"sampler": sampler.state_dict()} if sampler is not None else {}
        path = trainer.save(save_dir, keep=keep, extra=extra)
        if rank0:
            print(f"saved {path}", flush=True)

    def on_step(step: int, loss: float) -> None:
        if save_dir is not None and (step == steps or (save_every and step % save_every == 0)):
            save(step)

    try:
        if dataset is not None:
            fit_loop(trainer, dataset, steps, echo=rank0, start=start, seed=seed, sampler_state=sampler_state,
                     on_step=on_step)
        else:
            train_loop(trainer, steps, lambda k: batch_for(trainer.spec, k, global_batch), echo=rank0, start=start,
                       on_step=on_step)
    except RankFailure as exc:
        from runtime.dist.faults import frame_text

        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        where = frame_text(exc)
        print(f"{exc} ({where})" if where else str(exc), file=sys.stderr, flush=True)
        # Skip the process-group teardown: it may wait on the dead peer.
        sys.stdout.flush()
        os._exit(EXIT_RANK_FAILED if exc.own else EXIT_PEER_FAILED)
    if logger is not None:
        logger.close()
    trainer.finish()
    if rank0 and dump_dir:
        print(f"wrote {dump_dir}/: every pass, stage<s>_tp<r>/program.txt{ONNX_NOTE[onnx]}, plan.json, report.html, "
              f"measurements.json", flush=True)
    from runtime.dist import heartbeat

    heartbeat.stop()
    dist.destroy_process_group()
    return 0


def with_lr(optimizer: str, lr: float | None):
    """``--optimizer NAME --lr X``: the named optimizer (:data:`passes.ir.optimizers.OPTIMIZERS`)
    at learning rate ``lr`` in both parameter groups; the name alone when ``lr`` is None."""
    if lr is None:
        return optimizer
    from runtime.optim.optimizers import as_factory

    named = as_factory(optimizer)
    return lambda groups: named([{**g, "lr": lr} for g in groups])


def read_plan(path: str):
    """``--plan FILE``: the :class:`Plan` a plan.json holds (``plan``/``demo``/``train --dump-dir``)."""
    from passes.ir.errors import ConfigError
    from passes.ir.plan import Plan

    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise ConfigError(f"cannot read plan {path}: {exc.strerror}; give the plan.json a plan wrote") from None
    return Plan.from_json(text)


def _report_before_sigterm(grace_s: float) -> None:
    """Under a torchrun agent, keep running for up to ``grace_s`` seconds after a SIGTERM.

    The agent answers the first rank that exits by sending SIGTERM to all the others at once,
    so the ranks still waiting on a stopped or dead peer would die without saying which one it
    was. With this, their waits time out (within the timeout), they print the failure and exit
    as usual; one that is still running after ``grace_s`` exits then (a second SIGTERM: at once).
    """
    import signal
    import threading

    if "TORCHELASTIC_RUN_ID" not in os.environ or threading.current_thread() is not threading.main_thread():
        return

    def leave() -> None:
        print(f"rank {os.environ.get('RANK', '?')}: terminated by the launcher (SIGTERM); exiting", file=sys.stderr,
              flush=True)
        os._exit(128 + signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        timer = threading.Timer(grace_s, leave)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)
