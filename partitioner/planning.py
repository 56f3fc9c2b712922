"""``partitioner.plan``: profile a model (meta device, repeated layers exploited) and search plans."""
from __future__ import annotations

from pathlib import Path

from partitioner.cluster import Cluster
from partitioner.errors import ConfigError
from partitioner.plan_types import KNOBS, Plan

_KNOB_TYPES = {"schedule": str, "checkpointing": str, "offload": str, "sequence_parallel": bool}


def plan(model: str, cluster: Cluster | str, *, global_batch: int, nodes: int | None = None,
         seq: int | None = None, dtype: str = "bf16", fix: dict | str | None = None,
         optimizer: str = "adamw", dump_dir: str | Path | None = None) -> Plan:
    """The fastest plan for ``model`` (a spec string) on ``cluster`` (a Cluster, preset or file).

    ``fix`` pins knobs (dict, or ``"tp=8,pp=4"``); ``dump_dir`` receives ``plan.json`` and ``report.html``.
    """
    from partitioner.profile import profile_model
    from partitioner.search import plan as search

    if isinstance(cluster, str):
        cluster = Cluster.load(cluster, nodes=nodes)
    elif nodes is not None:
        cluster = cluster.with_nodes(nodes)
    pinned = parse_fix(fix) if isinstance(fix, str) else (fix or {})
    profile = profile_model(model, seq=seq, dtype=dtype, optimizer=optimizer)
    chosen = search(profile, cluster, global_batch=global_batch, fix=pinned, optimizer=optimizer)
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        (Path(dump_dir) / "plan.json").write_text(chosen.to_json() + "\n")
        from ir_dumps.report import write_report

        write_report(Path(dump_dir) / "report.html", plan=chosen, cluster=cluster)
    return chosen


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
