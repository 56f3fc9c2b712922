"""``partitioner.plan``: profile a model (meta device, repeated layers exploited) and search plans."""
from __future__ import annotations

import copy
from pathlib import Path
from partitioner.cost.cluster import Cluster
from passes.ir.config import TORCH_DTYPES
from passes.ir.plan import Plan
from partitioner.inputs.knobs import check_fix, parse_fix  # noqa: F401  (parse_fix: read here by the CLI and users)
from partitioner.search.profile import ModelProfile, profile_model, profile_spec
from partitioner.search.search import search
from ir_dumps.writer import DumpWriter
from partitioner.compile.build import run_analysis_passes, capture_training_step
from partitioner.api.dumps import write_plan_dumps
from partitioner.inputs.model_spec import ModelSpec, meta_copy
from partitioner.inputs.models import as_spec, build_model, check_dim, check_spec
from passes.ir.errors import ConfigError
from partitioner.inputs.run_options import check_option
from partitioner.inputs.training import Training

def plan(model: str | ModelSpec, cluster: Cluster | str, *, training: Training, nodes: int | None = None,
         seq: int | None = None, fix: dict | str | None = None, dump_dir: str | Path | None = None) -> Plan:
    """The fastest plan for ``model`` on ``cluster`` (a Cluster, preset or file).

    ``model``: a spec string (``gpt:layers=4,...``, or ``path/to/file.py:factory``) or a
    :class:`ModelSpec` (a module of your own with its inputs and loss), as
    :func:`partitioner.api.auto.auto_parallelize` takes it. A zoo spec is profiled from two
    captured blocks; any other model is captured whole on the meta device (a copy: the caller's
    module is left as it is).

    ``training``: the :class:`partitioner.inputs.training.Training` a job would train with; the
    plan reads its ``global_batch`` (samples per step), its ``optimizer`` (a name, AdamW's
    keyword arguments or a factory: the planner counts the state of the optimizer it makes) and
    its ``dtype`` (default: :attr:`Cluster.default_dtype`, bf16 on GPUs and fp32 on CPU ranks, as
    ``auto_parallelize`` and the command line take it). ``nodes``: the cluster's number of nodes
    (default: the preset's or file's); ``seq``: the sequence length to plan at (default: the
    model's). ``fix`` pins knobs (dict, or ``"tp=8,pp=4"``); ``dump_dir`` receives the plan's dump
    tree (:mod:`partitioner.api.dumps`: every pass of the lowering, each rank program with its
    ONNX, the stage picture, ``plan.json`` and ``report.html``).
    """

    if not isinstance(training, Training):
        raise ConfigError(f"plan: training is {type(training).__name__}, not a Training; pass "
                          f"training=Training(global_batch=8, ...) (from partitioner import Training)")
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster, nodes=nodes)
    elif nodes is not None:
        cluster = cluster.with_nodes(nodes)
    dtype = training.dtype or cluster.default_dtype
    optimizer = training.optimizer_name()
    check_spec(model)
    pinned = check_fix(fix)
    if seq is not None:
        check_option("seq", seq, spelled="seq")
        check_dim(model, "seq", seq, spelled="seq")
    profile, model = _profile_any(model, seq=seq, dtype=dtype, optimizer=optimizer,
                                  tensor_remat=pinned.get("checkpointing") == "tensor")
    chosen = search(profile, cluster, global_batch=training.global_batch, fix=pinned, optimizer=optimizer)
    if dump_dir is not None:
        write_model_plan_dumps(dump_dir, model=model, plan=chosen, cluster=cluster, param_bytes=4 * profile.param_count,
                               seq=seq, optimizer=optimizer)
    return chosen


def _profile_any(model, *, seq: int | None, dtype: str, optimizer: str, tensor_remat: bool = False) -> tuple[ModelProfile, str | ModelSpec]:
    """The profile of ``model`` in any form :func:`plan` takes, and the model as the dumps
    rebuild it (a spec string, or a ModelSpec); ``tensor_remat``: price ``checkpointing='tensor'``
    (a whole-graph MILP: only when pinned)."""
    if isinstance(model, str) and not model.partition(":")[0].strip().endswith(".py"):
        return profile_model(model, seq=seq, dtype=dtype, optimizer=optimizer, tensor_remat=tensor_remat), model
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(TORCH_DTYPES)}")
    spec = as_spec(model, device="meta")
    meta = meta_copy(spec).cast(TORCH_DTYPES[dtype])
    if seq is not None:
        if "seq" not in {d for i in meta.inputs for d in i.dim_names()}:
            raise ConfigError(f"model {meta.name!r} has no 'seq' dim (its inputs: "
                              f"{[(i.name, i.shape) for i in meta.inputs]}); drop seq / --seq")
        meta.dims["seq"] = seq
    return (profile_spec(meta, dtype=dtype, optimizer=optimizer, tensor_remat=tensor_remat),
            model if isinstance(model, str) else spec)


MATERIALISE_LIMIT_BYTES = 2**31
"""A model planned without weights gets real (seeded random) ones for its dumps up to this many
fp32 parameter bytes, so its ONNX files hold a runnable program; larger ones are captured on the
meta device and their dumps have no ONNX."""


def write_model_plan_dumps(dump_dir: str | Path, *, model: str | ModelSpec, plan: Plan, cluster: Cluster,
                           param_bytes: float | None = None, seq: int | None = None, optimizer: str = "adamw"):
    """Capture ``model`` as a job would (weights in the plan's dtype, symbolic dims), analyse it
    and write the dump tree of ``plan`` (:func:`partitioner.api.dumps.write_plan_dumps`). A
    ModelSpec ``model`` is captured from a copy, in the weights it has."""

    if isinstance(model, ModelSpec):
        spec = ModelSpec(name=model.name, module=copy.deepcopy(model.module), inputs=model.inputs, loss=model.loss,
                         dims=dict(model.dims)).cast(TORCH_DTYPES[plan.config.dtype])
    else:
        if param_bytes is None:
            param_bytes = 4 * sum(p.numel() for p in build_model(model, device="meta").module.parameters())
        device = "cpu" if param_bytes <= MATERIALISE_LIMIT_BYTES else "meta"
        spec = build_model(model, device=device, seed=0).cast(TORCH_DTYPES[plan.config.dtype])
    if seq is not None:
        spec.dims["seq"] = seq
    writer = DumpWriter(dump_dir, model=plan.model)
    graph = run_analysis_passes(capture_training_step(spec, device="cpu"), optimizer=optimizer,
                    dtype=plan.config.dtype, writer=writer)
    return write_plan_dumps(dump_dir, graph=graph, plan=plan, cluster=cluster, writer=writer,
                            reproduce_args=("--seq", str(seq)) if seq is not None else ())
