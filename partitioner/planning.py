"""``partitioner.plan``: profile a model (meta device, repeated layers exploited) and search plans."""
from __future__ import annotations

from pathlib import Path

from partitioner.cluster import Cluster
from passes.ir.config import TORCH_DTYPES
from passes.ir.errors import ConfigError
from passes.ir.plan import KNOBS, Plan
from partitioner.profile import profile_model
from partitioner.search import plan as search
from ir_dumps.writer import DumpWriter
from partitioner.build import analyse, capture_training_step
from partitioner.dumps import write_plan_dumps
from partitioner.model_spec import build_model

_KNOB_TYPES = {"schedule": str, "checkpointing": str, "offload": str, "sequence_parallel": bool}


def plan(model: str, cluster: Cluster | str, *, global_batch: int, nodes: int | None = None,
         seq: int | None = None, dtype: str = "bf16", fix: dict | str | None = None,
         optimizer: str = "adamw", dump_dir: str | Path | None = None) -> Plan:
    """The fastest plan for ``model`` (a spec string) on ``cluster`` (a Cluster, preset or file).

    ``fix`` pins knobs (dict, or ``"tp=8,pp=4"``); ``dump_dir`` receives the plan's dump tree
    (:mod:`partitioner.dumps`: every pass of the lowering, each rank program with its ONNX,
    the stage picture, ``plan.json`` and ``report.html``).
    """

    if isinstance(cluster, str):
        cluster = Cluster.load(cluster, nodes=nodes)
    elif nodes is not None:
        cluster = cluster.with_nodes(nodes)
    pinned = parse_fix(fix) if isinstance(fix, str) else (fix or {})
    profile = profile_model(model, seq=seq, dtype=dtype, optimizer=optimizer)
    chosen = search(profile, cluster, global_batch=global_batch, fix=pinned, optimizer=optimizer)
    if dump_dir is not None:
        write_model_plan_dumps(dump_dir, model=model, plan=chosen, cluster=cluster, param_bytes=4 * profile.param_count,
                               seq=seq, optimizer=optimizer)
    return chosen


MATERIALISE_LIMIT_BYTES = 2**31
"""A model planned without weights gets real (seeded random) ones for its dumps up to this many
fp32 parameter bytes, so its ONNX files hold a runnable program; larger ones are captured on the
meta device and their dumps have no ONNX."""


def write_model_plan_dumps(dump_dir: str | Path, *, model: str, plan: Plan, cluster: Cluster,
                           param_bytes: float | None = None, seq: int | None = None, optimizer: str = "adamw"):
    """Capture ``model`` as a job would (weights in the plan's dtype, symbolic dims), analyse it
    and write the dump tree of ``plan`` (:func:`partitioner.dumps.write_plan_dumps`)."""

    if param_bytes is None:
        param_bytes = 4 * sum(p.numel() for p in build_model(model, device="meta").module.parameters())
    device = "cpu" if param_bytes <= MATERIALISE_LIMIT_BYTES else "meta"
    spec = build_model(model, device=device, seed=0).cast(TORCH_DTYPES[plan.config.dtype])
    if seq is not None:
        spec.dims["seq"] = seq
    writer = DumpWriter(dump_dir, model=plan.model)
    graph = analyse(capture_training_step(spec, device="cpu"), optimizer=optimizer,
                    mixed_precision=plan.config.mixed_precision, writer=writer)
    return write_plan_dumps(dump_dir, graph=graph, plan=plan, cluster=cluster, writer=writer,
                            reproduce_args=("--seq", str(seq)) if seq is not None else ())


def parse_fix(text: str) -> dict[str, object]:
    """``"tp=8,pp=4,schedule=interleaved"`` -> typed dict; unknown knobs are an error."""
    out: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not raw.strip():
            raise ConfigError(f"malformed --fix item {item!r}; write knob=value, e.g. tp=8,pp=4")
        if key not in KNOBS:
            raise ConfigError(f"unknown knob {key!r} in --fix; knobs: {', '.join(KNOBS)}")
        kind = _KNOB_TYPES.get(key, int)
        raw = raw.strip()
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"--fix {key}={raw}: use true or false")
            out[key] = raw.lower() in ("true", "1")
        elif kind is int:
            try:
                out[key] = int(raw)
            except ValueError:
                raise ConfigError(f"--fix {key}={raw}: {key} takes an integer") from None
        else:
            out[key] = raw
    return out
