"""Any torch optimizer, with parameter groups, schedules, clipping and non-finite steps.

* The default groups: no weight decay on norms, biases and embeddings, recorded by the lowering
  for every rank (``RankProgram.no_weight_decay``) and equal to the plain module's groups that
  the single-device reference builds.
* SGD with momentum and Adam (L2 weight decay, so the groups matter) under no ZeRO, ZeRO-1 and
  ZeRO-2, with a pipeline and a tied weight, clipped and scheduled: the same losses and weights as
  one device. SGD is not scale invariant, so a wrong gradient scale or clipping factor shows in
  the weights themselves.
* An optimizer that is not elementwise is refused under ZeRO; a NaN gradient stops the run
  naming the step, or is skipped on every rank when asked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from partitioner.inputs.models import build_model
from passes.ir.errors import ConfigError
from passes.ir.optimizers import OPTIMIZERS
from runtime.dist.launch import spawn
from runtime.optim.optimizers import (
    as_factory, check_shardable, init_state, module_param_groups, param_groups, planner_optimizer,
)
from runtime.optim.lr_schedules import warmup_cosine, warmup_cosine_factor
from tests.one_device import train_one_device
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
WORLD, STEPS, GLOBAL_BATCH, CLIP = 4, 3, 8, 0.05
TIMEOUT_S = 60.0


def sgd(groups):
    return torch.optim.SGD(groups, lr=1.0, momentum=0.9, weight_decay=0.01)  # clipped: steps of norm <= 0.05


def adam(groups):
    return torch.optim.Adam(groups, lr=1e-3, eps=1e-6, weight_decay=0.1)


def adafactor(groups):
    return torch.optim.Adafactor(groups, lr=1e-2)


FACTORIES = {"sgd": sgd, "adam": adam, "adafactor": adafactor}
SCHEDULE = warmup_cosine(1, STEPS, min_ratio=0.1)


@dataclass(frozen=True)
class Case:
    optimizer: str
    dp: int
    pp: int
    zero: int
    nonfinite: str | None = None  # "stop" / "skip": a NaN weight before the second step

    @property
    def id(self) -> str:
        return f"{self.optimizer}-dp{self.dp}-pp{self.pp}-zero{self.zero}" + (f"-nan_{self.nonfinite}"
                                                                             if self.nonfinite else "")


PARITY = [Case("sgd", 2, 1, 1), Case("sgd", 2, 1, 2), Case("sgd", 2, 2, 2), Case("sgd", 1, 2, 0),
          Case("adam", 2, 1, 1), Case("adam", 2, 1, 2), Case("adam", 2, 2, 1)]
REFUSED = Case("adafactor", 2, 1, 1)
NONFINITE = [Case("adam", 2, 1, 0, "stop"), Case("adam", 2, 1, 2, "skip")]


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _run_cases(cases, payload):
    """On each rank: every case's results. ``payload``: the model's graph, captured once by the test process."""
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from passes.ir.errors import NonFiniteError
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=200)
    spec, graph = unpacked_graph(GPT, payload)
    batches = _batches(spec)
    meshes = {(c.dp, c.pp): None for c in cases}
    meshes = {k: Mesh(k[0], k[1], timeout_s=TIMEOUT_S) for k in sorted(meshes)}
    out = {}
    for case in cases:
        mesh = meshes[(case.dp, case.pp)]
        torch.distributed.barrier()
        if not mesh.active:
            continue
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=case.dp, pp=case.pp, schedule="1f1b",
                                                 num_micro_batches=2, zero_stage=case.zero)
        try:
            pm = build_parallel_model(graph, config, mesh, optimizer=FACTORIES[case.optimizer], lr_scheduler=SCHEDULE,
                                      clip_grad_norm=CLIP, nonfinite=case.nonfinite or "stop", cluster=local_cluster(mesh.size))
        except ConfigError as exc:
            out[case.id] = {"refused": str(exc)}
            continue
        result = {"losses": [], "norms": [], "steps": []}
        try:
            for k, b in enumerate(batches):
                if case.nonfinite and k == 1:
                    with torch.no_grad():  # every rank: a NaN weight makes a NaN loss and gradients
                        for p in pm.params:
                            if p.dim() == 2:
                                p[0, 0] = float("nan")
                                break
                    result["before_nan_step"] = {n: t.clone() for n, t in pm.full_master_parameters().items()}
                result["losses"].append(pm.train_step(b))
                result["norms"].append(pm.last_grad_norm)
                result["steps"].append(pm.step_count)
                if case.nonfinite and k == 1:
                    result["after_nan_step"] = {n: t.clone() for n, t in pm.full_master_parameters().items()}
                    break
        except NonFiniteError as exc:
            result["stopped"] = str(exc)
        result["params"] = pm.full_parameters() if "stopped" not in result else {}
        result["skipped"] = pm.skipped_steps
        out[case.id] = result
    return out


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    results = spawn(_run_cases, WORLD, PARITY + [REFUSED] + NONFINITE, packed_graph(GPT), timeout_s=400)
    print(f"\nspawn of {WORLD} ranks: {time.perf_counter() - start:.1f} s")
    return results


def _reference(name: str):
    spec = build_model(GPT)
    initial = {n: p.detach().clone() for n, p in spec.module.named_parameters()}
    norms: list[float] = []
    losses, module = train_one_device(spec, _batches(spec), optimizer=FACTORIES[name], lr_scheduler=SCHEDULE,
                                      clip_grad_norm=CLIP, norms=norms)
    return losses, module, norms, initial


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY, ids=lambda c: c.id)
def test_optimizer_trains_like_one_device(distributed, case):
    ref_losses, ref_module, ref_norms, initial = _reference(case.optimizer)
    assert min(ref_norms) > 2 * CLIP  # every step clips
    ranks = [r[case.id] for r in distributed[:case.dp * case.pp]]
    covered = set()
    for i, r in enumerate(ranks):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), f"{case.id} rank {i}"
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), f"{case.id} rank {i}"
        for name, value in r["params"].items():
            expected = ref_module.get_parameter(name).detach()
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case.id} {name}: {m}")
            covered.add(id(ref_module.get_parameter(name)))  # a tied weight under any of its names
    assert covered == {id(p) for p in ref_module.parameters()}
    moved = max((ref_module.get_parameter(n).detach() - p).abs().max().item() for n, p in initial.items())
    assert moved > 1e-3  # the weights trained: parity of untouched weights would prove nothing


@pytest.mark.slow
def test_non_elementwise_optimizer_is_refused_under_zero(distributed):
    for r in distributed[:REFUSED.dp]:
        assert "Adafactor is not one of the elementwise optimizers" in r[REFUSED.id]["refused"]
        assert "zero_stage=0" in r[REFUSED.id]["refused"]


@pytest.mark.slow
def test_nan_gradient_stops_naming_the_step(distributed):
    case = NONFINITE[0]
    for r in distributed[:case.dp]:
        result = r[case.id]
        assert "step 1:" in result["stopped"] and "nan" in result["stopped"]


@pytest.mark.slow
def test_nan_gradient_is_skipped_on_every_rank_when_asked(distributed):
    case = NONFINITE[1]
    for r in distributed[:case.dp]:
        result = r[case.id]
        assert "stopped" not in result and result["skipped"] == 1
        assert result["steps"] == [1, 1]  # the optimizer did not step the second time
        for name, before in result["before_nan_step"].items():
            assert torch.equal(before, result["after_nan_step"][name]), name


def test_default_groups_leave_norms_biases_and_embeddings_without_decay():
    spec = build_model(GPT)
    groups = module_param_groups(spec.module)
    names = {id(p): n for n, p in spec.module.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    decay = {names[id(p)] for p in groups[0]["params"]}
    assert groups[1]["weight_decay"] == 0.0 and [g["name"] for g in groups] == ["decay", "no_decay"]
    assert {"wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "blocks.0.attn.qkv.bias"} <= no_decay
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight"} <= decay
    assert not decay & no_decay and len(decay | no_decay) == len(list(spec.module.parameters()))


def test_lowering_records_the_same_groups_on_every_rank():
    from partitioner.cost.cost_model import cost_hooks
    from passes.ir.config import ParallelConfig
    from passes.lowering.lower import lower

    spec, graph = unpacked_graph(GPT, packed_graph(GPT))
    groups = module_param_groups(spec.module)
    aliases = {}
    for n, p in spec.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(n)
    expected = {a for p in groups[1]["params"] for a in aliases[id(p)]}
    config = ParallelConfig.for_global_batch(4, dp=1, pp=2, num_micro_batches=2)
    lowering = lower(graph, config, cost=cost_hooks(local_cluster(2)))
    for rank in range(2):
        program = lowering.rank_program(rank)
        held = {n for m in program.modules.values() for n, _ in m.named_parameters(remove_duplicate=False)}
        assert program.no_weight_decay & held == expected & held, rank
        assert held - expected, rank  # some weights do decay


def test_warmup_cosine_warms_up_then_decays_to_the_floor():
    f = [warmup_cosine_factor(k, warmup_steps=4, total_steps=12, min_ratio=0.1) for k in range(14)]
    assert f[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f[4] == pytest.approx(1.0) and all(a > b for a, b in zip(f[4:12], f[5:12]))
    assert f[8] == pytest.approx(0.1 + 0.9 * 0.5) and f[12] == f[13] == pytest.approx(0.1)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    sched = warmup_cosine(4, 12, min_ratio=0.1)(opt)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * x for x in f[:6]])
    with pytest.raises(ConfigError, match="warmup_steps"):
        warmup_cosine(10, 5)


def test_optimizer_arguments_are_checked_and_named_for_the_planner():
    assert planner_optimizer(as_factory(None)) == "adamw"
    assert planner_optimizer(as_factory({"lr": 1e-2})) == "adamw"
    assert planner_optimizer(sgd) == "sgd_momentum"
    assert planner_optimizer(lambda g: torch.optim.SGD(g, lr=0.1)) == "sgd"
    # a factory's Adam runs torch's default implementation unless it asks for the fused kernel
    assert planner_optimizer(adam) == "adam_unfused"
    assert planner_optimizer(lambda g: torch.optim.Adam(g, fused=True)) == "adam"
    assert planner_optimizer(lambda g: torch.optim.AdamW(g, lr=1e-3)) == "adamw_unfused"
    assert planner_optimizer(as_factory({"lr": 1e-2, "foreach": False})) == "adamw_unfused"
    for name in OPTIMIZERS:  # a name builds the optimizer the planner costs under that name
        assert planner_optimizer(as_factory(name)) == name
    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'; choose one of sgd, sgd_momentum, adam, adamw, adam_unfused"):
        as_factory("lamb")
    with pytest.raises(ConfigError, match="AdamW does not take"):
        as_factory({"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="factory"):
        as_factory(3)
    with pytest.raises(ConfigError, match="not known"):
        planner_optimizer(adafactor)
    probe = adafactor(param_groups([torch.zeros(2, 2, requires_grad=True)], [False]))
    with pytest.raises(ConfigError, match="Adafactor is not one of the elementwise"):
        check_shardable(probe, 1)


def test_named_adam_optimizers_run_the_fused_kernel_where_the_parameters_allow_it():
    """``adamw``/``adam`` (and None, and a dict that names no implementation) build torch's fused
    kernel on CPU; the ``_unfused`` names and a dict naming ``foreach`` build torch's default; on
    the meta device, which has no fused kernel, every name builds the default. A fused optimizer's
    state made up front (what a checkpoint load reads into) is what its first step makes: ``step``
    an fp32 scalar on the parameter's device."""
    def built(optimizer, device="cpu"):
        groups = param_groups([torch.zeros(3, 2, requires_grad=True, device=device)], [False])
        return as_factory(optimizer)(groups)

    for optimizer in (None, "adamw", "adam", {"lr": 1e-3}):
        assert built(optimizer).defaults["fused"] is True, optimizer
    for optimizer in ("adamw_unfused", "adam_unfused", {"lr": 1e-3, "foreach": False}):
        assert not built(optimizer).defaults["fused"], optimizer
    assert not built("adamw", device="meta").defaults["fused"]

    opt = built("adamw")
    init_state(opt)
    (state,) = opt.state.values()
    assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu" and state["step"].dim() == 0
    stepped = built("adamw")
    (p,) = stepped.param_groups[0]["params"]
    p.grad = torch.ones_like(p)
    stepped.step()
    (first,) = stepped.state.values()
    assert {k: (v.dtype, v.shape) for k, v in first.items()} == {k: (v.dtype, v.shape) for k, v in state.items()}


def test_the_named_adamw_is_fused_on_cuda_tensors_as_the_dry_run_makes_them():
    """The GPU path without a GPU: parameters on ``cuda`` under the fake tensor mode (what the dry
    run executes) get the fused kernel, its ``step`` on the device, and a step runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        p = torch.nn.Parameter(torch.zeros(4, 3, device="cuda"))
        opt = as_factory("adamw")(param_groups([p], [False]))
        assert opt.defaults["fused"] is True
        init_state(opt)
        assert opt.state[p]["step"].device.type == "cuda"
        p.grad = torch.ones_like(p)
        opt.step()
