"""``checkpointing="dag"`` on two gloo ranks: the zoo ResNet, the zoo U-Net and Hugging Face BERT
(dropout off) trained with ``ParallelConfig(dp=2, checkpointing="dag")`` through
:func:`partitioner.compile.build.build_parallel_model` give, after three AdamW steps, bit-identical losses
and parameters to the same plan without checkpointing (selective activation checkpointing replays
the uncached ops exactly), and the same as one device. The rank program must really have cached
some op outputs and recomputed others inside its checkpointed regions, or the parity proves nothing.

BatchNorm (ResNet, U-Net) normalizes over each dp rank's own rows (no synchronized statistics), so
the one-device reference computes the loss as the mean of the per-shard losses: the step dp=2 takes.
"""
from __future__ import annotations

import time

import pytest
import torch

from partitioner.inputs.models import build_model
from runtime.dist.launch import spawn
from runtime.optim.optimizers import as_factory
from tests.one_device import train_one_device
from tests.runtime_cases import packed_graph, unpacked_graph
from partitioner.calibration.job_cluster import local_cluster

MODELS = {
    "resnet": "resnet:blocks=1-1,widths=8-16,image=16,classes=10,batch=8",
    "unet": "unet:batch=4",
    "hf-bert": "hf-bert:batch=4,attention_probs_dropout_prob=0.0,hidden_dropout_prob=0.0",
}
DP, STEPS, GLOBAL_BATCH = 2, 3, 4
ADAMW = {"lr": 1e-3, "eps": 1e-6}
POLICIES = ("dag", "none")
TIMEOUT_S = 60.0


def _batches(spec):
    return [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=100 + k) for k in range(STEPS)]


def _remat_counts(program) -> dict[str, int]:
    """Checkpoint calls under the selective policy, and the nodes of their regions that keep their
    op outputs (``cached``) or run again in backward (``recomputed``), over the rank's stages."""
    from passes.analysis.annotate_flops import checkpoint_submodule
    from passes.rewrites.apply_checkpoint import SelectiveRecompute
    from passes.ir.meta import CHECKPOINT_PLAN, REMAT

    counts = {"calls": 0, "cached": 0, "recomputed": 0, "regions": 0}
    for gm in program.modules.values():
        plan = gm.meta.get(CHECKPOINT_PLAN)
        counts["regions"] += sum(r.recompute for r in plan.regions) if plan is not None and plan.policy == "dag" else 0
        for node in gm.graph.nodes:
            sub = checkpoint_submodule(gm, node)
            if sub is None or node.kwargs.get("context_fn") is not SelectiveRecompute.CONTEXTS:
                continue
            counts["calls"] += 1
            for n in sub.graph.nodes:
                meta = n.meta.get(REMAT)
                if meta is not None and n.op == "call_function":
                    counts["cached" if meta.cached else "recomputed"] += 1
    return counts


def _run(payloads):
    """On each rank: per (model, policy) the per-step losses, the trained parameters and the
    rank program's rematerialization counts."""
    from partitioner.compile.build import build_parallel_model
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=300)
    mesh = Mesh(DP, 1, timeout_s=TIMEOUT_S)
    out = {}
    for model, payload in payloads.items():
        spec, graph = unpacked_graph(MODELS[model], payload)
        for policy in POLICIES:
            torch.distributed.barrier()
            config = ParallelConfig.for_global_batch(GLOBAL_BATCH, dp=DP, checkpointing=policy)
            pm = build_parallel_model(graph, config, mesh, optimizer=as_factory(ADAMW), cluster=local_cluster(mesh.size))
            losses = [pm.train_step(b) for b in _batches(spec)]
            out[(model, policy)] = {"losses": losses, "params": pm.full_parameters(),
                                    "remat": _remat_counts(pm.program)}
    return out


@pytest.fixture(scope="module")
def distributed():
    start = time.perf_counter()
    payloads = {m: packed_graph(s) for m, s in MODELS.items()}
    results = spawn(_run, DP, payloads, timeout_s=900)
    print(f"\nspawn of {DP} ranks: {time.perf_counter() - start:.1f} s")
    return results


class _ShardMeanLoss:
    """``spec`` whose loss is the mean of its loss on each dp rank's rows (what dp=2 steps on)."""

    def __init__(self, spec):
        self.module, self._spec = spec.module, spec

    def loss(self, module, *batch):
        shards = zip(*(t.chunk(DP) for t in batch))
        return torch.stack([self._spec.loss(module, *rows) for rows in shards]).mean()


def _one_device(model: str):
    spec = build_model(MODELS[model])
    initial = {n: p.detach().clone() for n, p in spec.module.named_parameters()}
    losses, module = train_one_device(_ShardMeanLoss(spec), _batches(spec), adamw=ADAMW)
    return losses, module, initial


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_dag_plan_caches_and_recomputes(distributed, model):
    for rank, r in enumerate(distributed):
        remat = r[(model, "dag")]["remat"]
        assert remat["calls"] == remat["regions"] > 0, (rank, remat)
        assert remat["cached"] > 0 and remat["recomputed"] > 0, (rank, remat)
        assert r[(model, "none")]["remat"]["calls"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_dag_plan_trains_exactly_like_no_checkpointing(distributed, model):
    for rank, r in enumerate(distributed):
        dag, none = r[(model, "dag")], r[(model, "none")]
        assert dag["losses"] == none["losses"], rank
        assert dag["params"].keys() == none["params"].keys() and dag["params"]
        for name, value in dag["params"].items():
            assert torch.equal(value, none["params"][name]), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_dag_plan_trains_like_one_device(distributed, model):
    assert_trains_like_one_device(model, [r[(model, "dag")] for r in distributed])


def assert_trains_like_one_device(model: str, ranks: list[dict]) -> None:
    """Every rank's losses match one device's (rtol 1e-5), and so does every parameter the ranks
    hold (each rank its stages' ones; together, all of them), after training moved them."""
    ref_losses, ref_module, initial = _one_device(model)
    covered = set()
    for rank, result in enumerate(ranks):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), rank
        for name, value in result["params"].items():
            expected = ref_module.get_parameter(name).detach()
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{model} {name}: {m}")
            covered.add(id(ref_module.get_parameter(name)))
    assert covered == {id(p) for p in ref_module.parameters()}
    moved = max((ref_module.get_parameter(n).detach() - p).abs().max().item() for n, p in initial.items())
    assert moved > 1e-4  # the weights trained
