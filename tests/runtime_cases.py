"""Training plans for the multi-rank runtime tests: a typed plan record, the per-rank trainer that
runs many plans inside one spawned job, and the single-process reference they are compared with.
(The hypothesis strategy of plans is in tests/test_runtime_property.py: the spawned ranks import
this module and need no hypothesis.)

A plan is feasible when ``ParallelModel`` accepts it: dp*tp*pp in {1, 2, 4, 8} (the spawned
world has 8 ranks), tp divides the attention heads, pp*virtual_pp <= layers, the interleaved
schedule has virtual_pp=2 with layers % (pp*2) == 0 and num_micro_batches % pp == 0, the global
batch is a multiple of dp*num_micro_batches. (Checkpointing with activation offload is covered
by a fixed case in tests/test_runtime_tp_parity.py.)
"""
from __future__ import annotations

import functools
import time
from collections.abc import Collection
from dataclasses import dataclass

import pytest
import torch
from partitioner.inputs.models import build_model
from passes.ir.graph_transfer import GraphPayload, pack_graph, unpack_graph
from passes.ir.config import ParallelConfig
from passes.ir.schedule.validate import stream_count
from runtime.optim.lr_schedules import warmup_cosine
from tests.one_device import train_one_device
from partitioner.calibration.job_cluster import local_cluster

# Dropout 0 everywhere: parity must be exact, and pipelining or micro-batching change the order
# in which dropout draws its masks.
MODELS = {
    "gpt": "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    "hf-gpt2": ("hf-gpt2:n_layer=4,n_embd=32,n_head=2,vocab_size=64,n_positions=16,resid_pdrop=0.0,"
                "embd_pdrop=0.0,attn_pdrop=0.0,seq=8"),
    # eight layers: ZBV on four pipeline ranks has eight stages
    "gpt8": "gpt:layers=8,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    # six layers: two ranks' four chunks (interleaved, ZBV) cannot all be equally deep
    "gpt6": "gpt:layers=6,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    "gpt2l": "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0",
    # context parallelism: four heads (Ulysses at cp=4), a sequence of 2 * 4 chunks of 2 tokens;
    # llama with grouped-query attention (2 kv heads) and rotary tables
    "gpt-cp": "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16,dropout=0.0",
    "llama-cp": "llama:layers=4,hidden=32,heads=4,kv_heads=2,vocab=64,seq=16",
    # mixture of experts: 4 SwiGLU experts, top-2, a shared expert, the load-balancing loss weighed
    # high enough (0.1) that a wrong token average shows in the losses and the router's gradients
    "moe": ("moe:layers=4,hidden=32,heads=2,vocab=64,seq=8,experts=4,top_k=2,expert_hidden=32,shared_experts=1,"
            "aux_loss=0.1,dropout=0.0"),
    # Hugging Face Mixtral: stacked experts (batched_mm), the load-balancing loss over the
    # routing recomputed from all layers' router logits (output_router_logits)
    "hf-mixtral": ("hf-mixtral:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
                   "vocab_size=64,num_local_experts=4,num_experts_per_tok=2,intermediate_size=48,"
                   "router_aux_loss_coef=0.1,seq=8"),
    # Hugging Face Qwen3-MoE (stacked experts, top-k weights renormalised, the aux loss as
    # Mixtral's) and LFM2-MoE (sigmoid scores chosen with a per-expert bias, weights gathered from
    # the plain scores, no aux loss; a dense short-conv layer first, then conv and attention)
    "hf-qwen3-moe": ("hf-qwen3-moe:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
                     "vocab_size=64,num_experts=4,num_experts_per_tok=2,moe_intermediate_size=48,"
                     "router_aux_loss_coef=0.1,seq=8"),
    "hf-lfm2-moe": ("hf-lfm2-moe:num_hidden_layers=3,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
                    "vocab_size=64,num_experts=4,num_experts_per_tok=2,moe_intermediate_size=48,intermediate_size=64,"
                    "num_dense_layers=1,seq=8"),
}
LAYERS, HEADS, SEQ = 4, 2, 8  # of the first two models above (what the property test draws from)
WORLD, STEPS = 8, 3
# eps=1e-6, not AdamW's 1e-8: the attention key bias has a gradient that is zero in exact arithmetic
# and ~1e-10 of rounding noise in practice, which eps=1e-8 turns into order-dependent updates.
ADAMW = {"lr": 1e-3, "eps": 1e-6}
# Every plan clips the global gradient norm and follows a warm-up + cosine schedule, as a real run
# does. CLIP is far below the models' gradient norms (0.5-3 at these sizes), so every step clips:
# the gradients compared after the step are the clipped ones, and a wrong global norm (a tp
# shard, dp replica, ZeRO chunk or tied copy counted twice or not at all) scales them wrongly.
CLIP = 0.05
SCHEDULE = warmup_cosine(1, STEPS, min_ratio=0.1)  # lr factors 0.5, 1, 0.55 over the 3 steps
TIMEOUT_S = 60.0  # seconds, of every mesh group: a rank that fails turns its peers' waits into errors


@dataclass(frozen=True, slots=True)
class Plan:
    """One dp x tp x pp training configuration of ``ParallelModel`` on model ``model`` (a MODELS key)."""
    model: str
    dp: int
    tp: int
    pp: int
    schedule: str
    virtual_pp: int
    num_micro_batches: int
    global_batch: int  # samples per optimizer step, split over dp, then into micro-batches
    zero: int  # ZeRO stage 0, 1, 2 or 3
    checkpointing: str
    offload: str
    hsdp: int | None = None  # ZeRO-3's shard group (HSDP), None: all of dp
    reshard: bool = True  # ZeRO-3 frees the gathered parameters after forward (False: keeps them for backward)
    cp: int = 1  # context-parallel degree
    cp_mode: str = "ring"
    sp: bool = False  # sequence parallelism (tp > 1)
    ep: int = 1  # expert-parallel degree (taken from the dp x cp ranks)
    compile: bool = False  # stage programs compiled (torch.compile, inductor)
    stage_boundaries: tuple[int, ...] | None = None  # where each virtual stage starts (None: spread evenly)

    @property
    def size(self) -> int:
        """Ranks the plan uses (the first ``size`` of the world)."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def id(self) -> str:
        return (f"{self.model}-dp{self.dp}-tp{self.tp}-pp{self.pp}-{self.schedule}-v{self.virtual_pp}"
                f"-m{self.num_micro_batches}-b{self.global_batch}" + (f"-zero{self.zero}" if self.zero else "")
                + (f"-ckpt_{self.checkpointing}" if self.checkpointing != "none" else "")
                + (f"-offload_{self.offload}" if self.offload != "none" else "")
                + (f"-hsdp{self.hsdp}" if self.hsdp else "") + ("" if self.reshard else "-keep")
                + (f"-cp{self.cp}_{self.cp_mode}" if self.cp > 1 else "") + ("-sp" if self.sp else "")
                + (f"-ep{self.ep}" if self.ep > 1 else "") + ("-compiled" if self.compile else "")
                + (f"-at{'_'.join(map(str, self.stage_boundaries))}" if self.stage_boundaries else ""))

    def config(self) -> ParallelConfig:
        """The :class:`ParallelConfig` the plan is lowered with."""
        return ParallelConfig.for_global_batch(
            self.global_batch, dp=self.dp, tp=self.tp, pp=self.pp, schedule=self.schedule, virtual_pp=self.virtual_pp,
            num_micro_batches=self.num_micro_batches, zero_stage=self.zero, checkpointing=self.checkpointing,
            offload=self.offload, hsdp_shard=self.hsdp, reshard_after_forward=self.reshard, cp=self.cp,
            cp_mode=self.cp_mode, sequence_parallel=self.sp, ep=self.ep, compile=self.compile,
            stage_boundaries=self.stage_boundaries)


def _mesh_shape(c: ParallelConfig) -> tuple:
    """What tells two meshes apart: (data axis, tp, pp, pipeline streams, HSDP shard, cp, ep)."""
    return (c.dp_cp, c.tp, c.pp, stream_count(c.schedule), c.hsdp_shard or 0, c.cp, c.ep)


def batches(spec, global_batch: int) -> list[tuple[torch.Tensor, ...]]:
    """The ``STEPS`` global batches every plan and the reference train on."""
    return [spec.example_inputs({"batch": global_batch}, seed=100 + k) for k in range(STEPS)]


def reference(model: str, global_batch: int):
    """Single-process AdamW training, clipped and scheduled: (per-step losses, trained module,
    per-step gradient norms before clipping, per-step learning rates)."""
    spec = build_model(MODELS[model])
    norms, lrs = [], []
    losses, module = train_one_device(spec, batches(spec, global_batch), adamw=ADAMW, lr_scheduler=SCHEDULE,
                                      clip_grad_norm=CLIP, norms=norms, lrs=lrs)
    return losses, module, norms, lrs


@functools.cache
def packed_graph(model: str) -> GraphPayload:
    """``capture_for_pipeline`` of model spec ``model``, captured and analysed once in this (the
    test) process and packed (:mod:`passes.ir.graph_transfer`, as a job's rank 0 ships its
    capture): spawned ranks unpack it instead of each exporting the model, the slow part of their
    start-up on a shared machine. Cached for the session: every test file of the same spec shares it."""
    from partitioner.compile.build import capture_for_pipeline
    spec = build_model(model)
    return pack_graph(capture_for_pipeline(spec), spec.module)


def payloads_for(plans: list[Plan]) -> dict[str, GraphPayload]:
    """The :func:`packed_graph` of every model ``plans`` train, by MODELS key (``train_plans``' second argument)."""
    return {k: packed_graph(MODELS[k]) for k in sorted({p.model for p in plans})}


def unpacked_graph(model: str, payload: GraphPayload):
    """On a rank: (the spec of ``model``, the analysed graph of ``payload`` around that spec's own
    module), what ``capture_for_pipeline(build_model(model))`` would give."""
    spec = build_model(model)
    return spec, unpack_graph(payload, spec.module)


def train_plans(plans: list[Plan], payloads: dict[str, GraphPayload] | None = None, *,
                track_memory: Collection[str] = ()) -> dict:
    """On each rank of a spawned world: every plan's per-step losses and this rank's full
    (tp-gathered) parameters and last-step gradients, or the error it raised. The plans whose
    ids are in ``track_memory`` also give what :func:`measure_memory` measures (``"memory"``),
    over the first two of their steps: one build of a plan checks its training and its memory.

    Every rank builds the mesh of every (dp, tp, pp) shape first, in the same order (group creation
    is collective over the world); then each plan runs on the first ``plan.size`` ranks while the
    others wait at the next world barrier. A plan that raises is recorded and the job goes on, so
    one runtime bug does not hide the verdict on the other plans. ``payloads``: the
    :func:`packed_graph` of each model the plans train (by MODELS key); without, each rank captures.
    """
    import runtime.observe.measure as measure
    from partitioner.compile.build import build_parallel_model, capture_for_pipeline
    from runtime.dist.mesh import Mesh, init_distributed

    started, start = time.time(), time.perf_counter()
    init_distributed(timeout_s=600)  # the world group only paces the plans; it may wait long
    rank = torch.distributed.get_rank()
    used = {p.model for p in plans if rank < p.size}  # only what this rank trains
    if payloads is None:
        specs = {k: build_model(MODELS[k]) for k in sorted(used)}
        graphs = {k: capture_for_pipeline(specs[k]) for k in sorted(used)}
    else:
        specs, graphs = {}, {}
        for k in sorted(used):
            specs[k], graphs[k] = unpacked_graph(MODELS[k], payloads[k])
    captured = time.perf_counter()
    configs = {p.id: p.config() for p in plans}
    shapes = {}  # mesh shape -> a config of that shape, in a deterministic order
    for p in plans:
        shapes.setdefault(_mesh_shape(configs[p.id]), configs[p.id])
    meshes = {sh: Mesh.for_config(c, timeout_s=TIMEOUT_S) for sh, c in sorted(shapes.items())}
    meshed = time.perf_counter()
    out = {"setup": {"started": started, "capture_s": captured - start, "meshes_s": meshed - captured}}
    for plan in plans:
        mesh = meshes[_mesh_shape(configs[plan.id])]
        torch.distributed.barrier()
        if not mesh.active:
            continue
        t0 = time.perf_counter()
        graphs_before = _compiled_graphs()
        try:
            pm = build_parallel_model(graphs[plan.model], plan.config(), mesh, optimizer=ADAMW,
                                      lr_scheduler=SCHEDULE, clip_grad_norm=CLIP, cluster=local_cluster(mesh.size))
            losses, norms, lrs = [], [], []
            timer = measure.StepTimer(pm, track_memory=2) if plan.id in track_memory else None
            peak = 0
            for k, b in enumerate(batches(specs[plan.model], plan.global_batch)):
                if timer is None:
                    losses.append(pm.train_step(b))
                else:  # the live bytes of the step, tracked (the first two steps reach the peak)
                    m = timer.measure(k, lambda b=b: pm.train_step(b))
                    losses.append(m.loss)
                    peak = max(peak, m.peak_memory_bytes or 0)
                norms.append(pm.last_grad_norm)
                lrs.append(pm.last_lr)
            out[plan.id] = {"losses": losses, "params": pm.full_parameters(), "grads": pm.full_gradients(),
                            "norms": norms, "lrs": lrs, "seconds": time.perf_counter() - t0,
                            "cp_ops": sorted({c.op for c in pm.program.comms_of("cp")}),
                            "expert_params": list(pm.program.expert_params),
                            "expert_numel": {n: p.numel() for n, p in pm.named_parameters().items()
                                             if n in set(pm.program.expert_params)},
                            "data_ops": sorted({c.op for c in pm.program.comms_of("data")}),
                            "compiled_graphs": _compiled_graphs() - graphs_before}
            if timer is not None:
                out[plan.id]["memory"] = {"peak": peak, **model_state_bytes(pm)}
        except Exception as exc:  # noqa: BLE001 - reported per plan by the test
            import traceback
            out[plan.id] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-12)}",
                            "seconds": time.perf_counter() - t0}
    out["setup"]["plans_s"] = time.perf_counter() - meshed
    return out


def _compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def measure_memory(plans: list[Plan], payloads: dict[str, GraphPayload], models: dict[str, str] | None = None,
                   steps: int = 2) -> dict:
    """On each rank of a spawned world: per plan, the peak live bytes of ``steps`` AdamW steps
    (:class:`runtime.observe.measure.LiveBytes`, as every measured step takes it) and the model
    state held after them (bytes of parameters, gradients, optimizer state). ``models``: the spec of each model key the plans use, when not all in :data:`MODELS`.
    Two steps: the first makes the optimizer state, the second is what every later step holds
    (measured over three on every plan of the suite: the third's peak was the second's, but for
    an expert-parallel plan whose routing moved 2 KiB more, 0.2%)."""
    import runtime.observe.measure as measure
    from partitioner.compile.build import build_parallel_model
    from runtime.dist.mesh import Mesh, init_distributed

    models = {**MODELS, **(models or {})}
    init_distributed(timeout_s=600)
    rank = torch.distributed.get_rank()
    graphs = {k: unpacked_graph(models[k], payloads[k]) for k in sorted({p.model for p in plans if rank < p.size})}
    shapes = sorted({_mesh_shape(p.config()) for p in plans})
    meshes = {sh: Mesh(sh[0], sh[2], sh[1], timeout_s=TIMEOUT_S, pp_streams=sh[3], dp_shard=sh[4] or None, cp=sh[5],
                       ep=sh[6]) for sh in shapes}
    out = {}
    for plan in plans:
        mesh = meshes[_mesh_shape(plan.config())]
        torch.distributed.barrier()
        if not mesh.active:
            continue
        start = time.perf_counter()
        spec, graph = graphs[plan.model]
        pm = build_parallel_model(graph, plan.config(), mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
        timer = measure.StepTimer(pm, track_memory=True)
        peak = 0
        for k in range(steps):
            batch = spec.example_inputs({"batch": plan.global_batch}, seed=300 + k)
            m = timer.measure(k, lambda: pm.train_step(batch))
            peak = max(peak, m.peak_memory_bytes or 0)
        out[plan.id] = {"peak": peak, **model_state_bytes(pm), "seconds": time.perf_counter() - start}
    return out


def model_state_bytes(pm) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state ``pm`` (a ParallelModel) holds."""
    from runtime.observe.measure import tensor_bytes
    params = list(pm.params)
    state = [t for s in pm.torch_optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"params": tensor_bytes(params), "grads": tensor_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": tensor_bytes(state)}


@functools.cache
def _reference(model: str, global_batch: int):
    return reference(model, global_batch)


@functools.cache
def _initial(model: str) -> torch.nn.Module:
    return build_model(MODELS[model]).module


def check_plan(plan: Plan, results: list[dict]) -> None:
    """Assert that ``plan``'s run (``train_plans``' results of every rank) trained like one device:
    losses, gradient norms, learning rates, final parameters and last gradients."""
    ranks = [r[plan.id] for r in results[:plan.size]]
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
    assert not errors, f"{plan} raised:\n" + "\n".join(errors)
    ref_losses, ref_model, ref_norms, ref_lrs = _reference(plan.model, plan.global_batch)
    assert min(ref_norms) > 2 * CLIP, ref_norms  # every step clips
    assert len(set(ref_lrs)) == len(ref_lrs), ref_lrs  # the schedule moves the learning rate
    for i, r in enumerate(ranks):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), f"{plan.id} rank {i}"
        assert r["losses"] == ranks[0]["losses"], f"{plan.id}: every rank must return the same loss"
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), f"{plan.id} rank {i}: global gradient norm"
        assert r["lrs"] == pytest.approx(ref_lrs, rel=1e-12), f"{plan.id} rank {i}: learning rate"
    initial = _initial(plan.model)
    moved = max((p - initial.get_parameter(n)).abs().max().item() for n, p in ref_model.named_parameters())
    assert moved > 1e-3  # training moved the weights: parity of untouched weights proves nothing

    covered = set()
    for i, r in enumerate(ranks):
        for name, value in r["params"].items():
            expected = ref_model.get_parameter(name)  # a tied weight under any of its names
            # atol 2e-5 = 2% of one AdamW step (lr 1e-3): an element whose gradient is ~eps has its
            # update ~ lr * g / (|g| + eps) swing with rounding (seen: 4.8e-6 on one element of a
            # tp=2 row-parallel weight at global batch 1); a wrong gradient moves most elements ~lr.
            torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=2e-5,
                                       msg=lambda m: f"{plan.id} rank {i} {name}: {m}")
            covered.add(id(expected))
            g = expected.grad
            # AdamW is scale invariant: the gradients check loss scaling and the dp / tied sums. A
            # wrong scale is off by >= 1/dp*m; reordered float32 sums (tp partial sums, recompute)
            # are ~1e-5 of the largest entry (seen: 1.5e-5 on hf-gpt2 dp2 tp2 pp2 zero1 ckpt).
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-5, atol=1e-4 * g.abs().max().item() + 1e-8,
                                       msg=lambda m: f"{plan.id} rank {i} grad of {name}: {m}")
    missing = [n for n, p in ref_model.named_parameters() if id(p) not in covered]
    assert not missing, f"{plan.id}: no rank holds {missing}"
    print(f"{plan.id}: {max(r['seconds'] for r in ranks):.2f} s")
