"""Checkpoints move between plans: saved under one (dp, pp, tp) (plain AdamW, ZeRO-1 or -2), loaded
under another, training continues exactly as an uninterrupted single-device run; the same
checkpoint loads into the plain module and its torch.optim.AdamW.

One spawn of 4 gloo ranks runs every save and load case (each on its own mesh, built up front
by every rank); the single-process checks (tp shard layouts, the plain module) need no spawn.
"""
from __future__ import annotations

import time

import pytest
import torch

from runtime.optim.optimizers import module_param_groups

from partitioner.errors import CheckpointError, ConfigError
from partitioner.inputs.models import build_model
from runtime.checkpoint.io import (
    OPTIM_PREFIX, TRAIN_STEP_KEY, Entry, ParamLayout, checkpoint_keys, flat_range_boxes, load_entries,
    load_into_module, load_optimizer_state_into, pieces_of, save_entries,
)
from runtime.dist.launch import spawn
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
GLOBAL_BATCH, SAVE_AT, STEPS, WORLD = 16, 3, 5, 4
ADAMW = {"lr": 1e-3, "eps": 1e-6}  # eps: see tests/test_runtime_parity.py
TIMEOUT_S = 30.0

# (name, dp, pp, tp, zero, micro-batches): saves train SAVE_AT steps from the initial weights.
SAVES = [("pp2", 1, 2, 1, False, 2), ("dp2pp2-zero1", 2, 2, 1, True, 2), ("tp2pp2", 1, 2, 2, False, 2),
         ("dp2pp2-zero2", 2, 2, 1, 2, 2)]
# (saved checkpoint, dp, pp, tp, zero, micro-batches): loads continue to step STEPS.
LOADS = [("pp2", 2, 2, 1, False, 2), ("tp2pp2", 1, 4, 1, False, 4), ("dp2pp2-zero1", 1, 2, 2, False, 2),
         ("pp2", 2, 1, 2, True, 2),
         ("tp2pp2", 2, 2, 1, False, 2),  # tp traded for dp: (dp,tp,pp) (1,2,2) -> (2,1,2)
         ("dp2pp2-zero2", 1, 2, 2, False, 2), ("tp2pp2", 2, 2, 1, 2, 2)]  # out of and into ZeRO-2


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _run_cases(root: str, payload):
    """On each rank: the losses of every save case (steps 1..SAVE_AT) and load case (the rest).
    ``payload``: the model's graph, captured once by the test process (``packed_graph``)."""
    from runtime.checkpoint.io import load_checkpoint, save_checkpoint
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=200)  # the world group only paces the cases
    spec, graph = unpacked_graph(GPT, payload)
    batches = _batches(spec)
    cases = [("save", *c) for c in SAVES] + [("load", *c) for c in LOADS]
    meshes = [Mesh(c[2], c[3], c[4], timeout_s=TIMEOUT_S) for c in cases]
    out = {}
    for (kind, name, dp, pp, tp, zero, m), mesh in zip(cases, meshes):
        torch.distributed.barrier()  # a load starts after every save has finished
        if not mesh.active:
            continue
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=dp, pp=pp, tp=tp, num_micro_batches=m,
                                                 zero_stage=int(zero))
        model = build_parallel_model(graph, config, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
        if kind == "save":
            losses = [model.train_step(b) for b in batches[:SAVE_AT]]
            save_checkpoint(model, f"{root}/{name}", step=SAVE_AT)
            out[(kind, name)] = {"losses": losses}
        else:
            step = load_checkpoint(model, f"{root}/{name}")
            losses = [model.train_step(b) for b in batches[step:]]
            out[(kind, name, dp, pp, tp, zero)] = {"losses": losses, "step": step}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    start = time.perf_counter()
    results = spawn(_run_cases, WORLD, str(root), packed_graph(GPT), timeout_s=300)
    print(f"\nspawn of {WORLD} ranks, {len(SAVES)} saves + {len(LOADS)} loads: {time.perf_counter() - start:.1f} s")
    return str(root), results


@pytest.fixture(scope="module")
def reference():
    """Uninterrupted single-device AdamW: losses of all STEPS, and the module + optimizer state
    after SAVE_AT steps."""
    spec = build_model(GPT)
    model = spec.module
    optimizer = torch.optim.AdamW(module_param_groups(model), **ADAMW)
    losses, at_save = [], None
    for k, batch in enumerate(_batches(spec)):
        optimizer.zero_grad()
        loss = spec.loss(model, *batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if k + 1 == SAVE_AT:
            at_save = ({n: p.detach().clone() for n, p in model.named_parameters()},
                       {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()})
    return losses, at_save


@pytest.mark.parametrize("save", SAVES, ids=lambda c: c[0])
def test_saving_run_matches_one_device(checkpoints, reference, save):
    _, results = checkpoints
    dp, pp, tp = save[1], save[2], save[3]
    for rank in range(dp * pp * tp):
        assert results[rank][("save", save[0])]["losses"] == pytest.approx(reference[0][:SAVE_AT], rel=1e-5)


@pytest.mark.parametrize("load", LOADS, ids=lambda c: f"{c[0]}-to-dp{c[1]}pp{c[2]}tp{c[3]}" + (f"-zero{int(c[4])}" if c[4] else ""))
def test_resumed_under_another_plan_matches_uninterrupted_run(checkpoints, reference, load):
    _, results = checkpoints
    name, dp, pp, tp, zero, _ = load
    for rank in range(dp * pp * tp):
        got = results[rank][("load", name, dp, pp, tp, zero)]
        assert got["step"] == SAVE_AT
        assert got["losses"] == pytest.approx(reference[0][SAVE_AT:], rel=1e-5), f"rank {rank}"


def test_checkpoint_is_keyed_by_original_names(checkpoints):
    root, _ = checkpoints
    module = build_model(GPT).module
    names = {n: tuple(p.shape) for n, p in module.named_parameters()}  # the tied weight once: wte.weight
    for name in [s[0] for s in SAVES]:
        keys = checkpoint_keys(f"{root}/{name}")
        assert {k: v for k, v in keys.items() if not k.startswith((OPTIM_PREFIX, "train."))} == names
        assert "lm_head.weight" not in keys
        for n, shape in names.items():
            assert keys[f"{OPTIM_PREFIX}{n}.exp_avg"] == shape and keys[f"{OPTIM_PREFIX}{n}.step"] == ()
        assert keys[TRAIN_STEP_KEY] == ()


@pytest.mark.parametrize("name", [s[0] for s in SAVES])
def test_plain_module_loads_and_continues(checkpoints, reference, name):
    root, _ = checkpoints
    ref_losses, (ref_params, ref_state) = reference
    spec = build_model(GPT)
    module = spec.module
    assert load_into_module(module, f"{root}/{name}") == SAVE_AT
    # the tied LM head follows (it is the same Parameter as wte.weight)
    assert module.lm_head.weight is module.wte.weight
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    optimizer = torch.optim.AdamW(module_param_groups(module), **ADAMW)
    load_optimizer_state_into(optimizer, module, f"{root}/{name}")
    for n, p in module.named_parameters():
        for key, value in ref_state[n].items():
            # Moments of near-zero gradients differ by summation-order noise (the tied weight's
            # gradient is summed across stages): tolerance relative to the tensor's scale.
            torch.testing.assert_close(optimizer.state[p][key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item(),
                                       msg=lambda m: f"{n} {key}: {m}")
    losses = []
    for batch in _batches(spec)[SAVE_AT:]:
        optimizer.zero_grad()
        loss = spec.loss(module, *batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)


def test_wrong_model_is_refused(checkpoints):
    root, _ = checkpoints
    other = build_model("gpt:layers=4,hidden=16,heads=2,vocab=64,seq=8,dropout=0.0").module
    with pytest.raises(CheckpointError, match=r"wte.weight has shape \(64, 32\) in the checkpoint but \(64, 16\)"):
        load_into_module(other, f"{root}/pp2")


# ---------------------------------------------------------------------------------------------
# Layouts without a process group
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4)])
def test_flat_ranges_become_contiguous_boxes(shape):
    n = int(torch.tensor(shape).prod())
    t = torch.arange(n).reshape(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            covered = []
            boxes = flat_range_boxes(shape, a, b)
            assert len(boxes) <= 2 * len(shape) - 1
            for offsets, sizes, flat in boxes:
                view = t
                for d, (o, s) in enumerate(zip(offsets, sizes)):
                    view = view.narrow(d, o, s)
                assert view.reshape(-1).tolist() == list(range(flat, flat + view.numel()))
                covered += view.reshape(-1).tolist()
            assert sorted(covered) == list(range(a, b))


def _tp_plans(*degrees):
    from passes.ir.meta import TENSOR_PARALLEL_PLAN
    from passes.policies.tensor_parallel_patterns import tag_tensor_parallel
    gm = unpacked_graph(GPT, packed_graph(GPT))[1]  # captured once per session: capture is the slow part
    return [tag_tensor_parallel(gm, degree=d).meta[TENSOR_PARALLEL_PLAN] for d in degrees]


def test_tp_shards_reshard_through_a_checkpoint(tmp_path):
    """tp=2 shards (fused q/k/v: three sections), written in ZeRO-style flat slices of each
    shard, load into the full module and into tp=4 shards equal to shard_tensor's."""
    from passes.ir.program import shard_tensor

    module = build_model(GPT).module
    full = dict(module.named_parameters())
    plan2, plan4 = _tp_plans(2, 4)
    assert plan2.params["blocks.0.attn.qkv.weight"].sections == (32, 32, 32)
    entries: dict[str, Entry] = {}
    for name, p in full.items():
        entries[name] = Entry(tuple(p.shape))
        for rank in range(2):
            local = shard_tensor(p, plan2.params[name], rank, 2)
            layout = ParamLayout.from_sharding(p.shape, plan2.params[name], rank, 2)
            if layout.dim is not None or rank == 0:  # replicated: tp rank 0 writes
                # as ZeRO would: the local shard's flat elements cut at an odd point
                cut = local.numel() // 3 + 1
                for lo, hi in ((0, cut), (cut, local.numel())):
                    for offs, sizes, _ in flat_range_boxes(local.shape, lo, hi):
                        entries[name].pieces += pieces_of(local, layout, offs, sizes)
    save_entries(entries, tmp_path, no_dist=True)

    fresh = build_model(GPT).module
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_into_module(fresh, tmp_path)
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p, full[name], rtol=0, atol=0)

    for rank in range(4):
        want, loaded = {}, {}
        for name, p in full.items():
            want[name] = shard_tensor(p, plan4.params[name], rank, 4)
            loaded[name] = torch.zeros_like(want[name])
        layouts = {n: ParamLayout.from_sharding(p.shape, plan4.params[n], rank, 4) for n, p in full.items()}
        load_entries({n: Entry(tuple(full[n].shape), pieces_of(loaded[n], layouts[n])) for n in full}, tmp_path,
                     no_dist=True)
        for name in full:
            torch.testing.assert_close(loaded[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_overlapping_writes_are_refused(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    layout = ParamLayout(shape=(2, 3))
    twice = Entry((2, 3), pieces_of(t, layout) + pieces_of(t, layout, (0, 0), (1, 3)))
    with pytest.raises(ConfigError, match="overlapping chunks"):
        save_entries({"w": twice}, tmp_path, no_dist=True)
