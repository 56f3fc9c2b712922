"""Plans with ``compile=true`` train like one device: each rank runs its stage programs compiled
with inductor (:mod:`runtime.exec.compiled`) under data parallelism, ZeRO-2 and ZeRO-3, tensor
parallelism with sequence parallelism, 1F1B and interleaved pipelines with full and selective
checkpointing, and the zero-bubble ZB-H1 schedule (its weight-free segments compiled), compared with single-process AdamW training, clipped and scheduled, at rtol 1e-5
(tests/runtime_cases.py's check).

The ranks compile into an empty inductor cache (the first compile a user's job makes), one they
share as the ranks of a node share theirs (``/tmp/torchinductor_<user>`` by default: a kernel two
ranks need is compiled once), one compile thread each and scalar C++ kernels (the suite's two
cores are shared, and a vectorised kernel takes gcc a third longer; which instructions inductor's
kernels use is its own concern, what runs them and in which order is ours).
"""
from __future__ import annotations

import os
import time

import pytest

from runtime.dist.launch import spawn
from tests.runtime_cases import MODELS, Plan, check_plan, payloads_for, train_plans

pytestmark = pytest.mark.slow


def _plan(dp=1, tp=1, pp=1, schedule="1f1b", m=1, *, v=1, zero=0, ckpt="none", sp=False, batch=None) -> Plan:
    return Plan(model="gpt2l", dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_pp=v, num_micro_batches=m,
                global_batch=batch or dp * m, zero=zero, checkpointing=ckpt, offload="none", sp=sp, compile=True)


PLANS = [
    _plan(dp=2, m=2),
    _plan(dp=2, m=2, zero=2),  # the same programs as dp=2: compiled once
    _plan(tp=2, sp=True, batch=2, ckpt="selective"),
    _plan(pp=2, m=2, ckpt="full"),
    # a split backward: the segments between the weight-reading ops compiled, those ops eager
    _plan(pp=2, m=2, schedule="zb1p"),
]


def _compiled_plans(plans, payloads, cache_dir: str) -> dict:
    """On each rank: :func:`train_plans` with inductor caching into ``cache_dir`` and compiling on
    this rank's thread."""
    import torch._inductor.config as inductor

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    inductor.compile_threads = 1
    inductor.cpp.vec_isa_ok = False
    out = train_plans(plans, payloads)
    out["timed"] = _timed_and_under_a_mode(plans[0], payloads)
    return out


def _timed_and_under_a_mode(plan, payloads) -> dict:
    """A compiled model's first step under the step timer that tracks memory on CPU (a dispatch
    mode, under which torch.compile would run the programs eagerly): graphs it compiled and the
    memory it reports; then a step under a dispatch mode of the caller's: the error."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from partitioner.calibration.job_cluster import local_cluster
    from partitioner.compile.build import build_parallel_model
    from runtime.dist.mesh import Mesh
    from runtime.observe.measure import StepTimer
    from tests.runtime_cases import ADAMW, _compiled_graphs, batches, unpacked_graph

    spec, graph = unpacked_graph(MODELS[plan.model], payloads[plan.model])
    mesh = Mesh.for_config(plan.config(), timeout_s=60)
    pm = build_parallel_model(graph, plan.config(), mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
    batch = batches(spec, plan.global_batch)[0]
    before = _compiled_graphs()
    measured = StepTimer(pm, track_memory=True).measure(0, lambda: pm.train_step(batch))

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    try:
        with Counting():
            pm.train_step(batch)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test reads it
        error = f"{type(exc).__name__}: {exc}"
    return {"compiled_graphs": _compiled_graphs() - before, "peak": measured.peak_memory_bytes, "error": error}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    start = time.perf_counter()
    results = spawn(_compiled_plans, 2, PLANS, payloads_for(PLANS), str(tmp_path_factory.mktemp("inductor")),
                    timeout_s=600)
    print(f"\nspawn of 2 ranks, {len(PLANS)} compiled plans: {time.perf_counter() - start:.1f} s")
    return results


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_compiled_plan_trains_like_one_device(distributed, plan):
    check_plan(plan, distributed)


def test_each_rank_ran_compiled_programs(distributed):
    """The losses above came from compiled programs: every rank compiled at least one graph per plan."""
    for rank, result in enumerate(distributed):
        for plan in PLANS:
            if rank < plan.size:
                assert result[plan.id].get("compiled_graphs", 0) >= 1, (rank, plan.id, result[plan.id])


def test_the_step_timer_leaves_compiled_programs_compiled_and_a_callers_dispatch_mode_is_refused(distributed):
    """On CPU the step timer counts live bytes under a dispatch mode; under a compiled plan it does
    not (the programs compiled, no memory reported), and a step a caller runs under a dispatch
    mode of its own is refused instead of running the programs uncompiled."""
    for result in distributed[:PLANS[0].size]:
        timed = result["timed"]
        assert timed["compiled_graphs"] >= 1 and timed["peak"] is None, timed
        assert timed["error"] and "under a torch dispatch mode" in timed["error"] and "compile=false" in timed["error"]
