"""Parity on the local device (CUDA under NCCL on a GPU; gloo on CPU otherwise): one rank's
ParallelModel, plain and with checkpointing, activation offload (pinned host memory and a side
stream on CUDA) and both, trains like plain AdamW on the same device, loss for loss.

    python scripts/device_parity.py [--steps 3]

Prints one line per configuration and exits non-zero on a mismatch. Part of
``scripts/device_check.sh``; also runs on CPU, which is how it is tested without a GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from partitioner.calibration.job_cluster import local_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPEC = "gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=128,dropout=0.0"
GLOBAL_BATCH = 8
ADAMW = {"lr": 1e-3, "eps": 1e-6}
CONFIGS = (("none", "none"), ("full", "none"), ("none", "activations"), ("full", "activations"))


def _rank(steps: int) -> list[tuple[str, list[float], list[float], int | None]]:
    import torch

    from partitioner.inputs.models import build_model
    from runtime.observe.measure import StepTimer
    from partitioner.compile.build import build_parallel_model, capture_for_pipeline
    from passes.ir.config import ParallelConfig
    from runtime.dist.mesh import Mesh, init_distributed

    init_distributed(timeout_s=300)
    mesh = Mesh(1, 1, 1, timeout_s=120)
    device = mesh.device
    spec = build_model(SPEC)
    batches = [spec.example_inputs({"batch": GLOBAL_BATCH}, seed=10 + k) for k in range(steps)]
    reference = build_model(SPEC)  # same seed: same initial weights
    module = reference.module.to(device)
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    ref = []
    for b in batches:
        opt.zero_grad()
        loss = reference.loss(module, *[t.to(device) for t in b])
        loss.backward()
        opt.step()
        ref.append(loss.item())
    graph = capture_for_pipeline(spec, device=device.type)
    out = []
    for ckpt, offload in CONFIGS:
        config = ParallelConfig.for_global_batch(GLOBAL_BATCH, num_micro_batches=2, checkpointing=ckpt, offload=offload)
        pm = build_parallel_model(graph, config, mesh, optimizer=ADAMW, cluster=local_cluster(mesh.size))
        timer = StepTimer(pm)
        losses = [timer.measure(k + 1, lambda b=b: pm.train_step(b)).loss for k, b in enumerate(batches)]
        kernel = "fused" if pm.torch_optimizer.defaults.get("fused") else "unfused"
        out.append((f"checkpointing={ckpt} offload={offload} on {device}, {kernel} AdamW", losses, ref,
                    max((s.peak_memory_bytes or 0) for s in timer.steps)))
    return out


def main(argv=None) -> int:
    from runtime.dist.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    (results,) = spawn(_rank, 1, args.steps, timeout_s=900)
    bad = 0
    for name, losses, ref, peak in results:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        ok = diff < 1e-4  # two micro-batches vs one batch: summation order only
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: losses {[round(x, 5) for x in losses]}, max rel diff {diff:.2e}, "
              f"peak {peak / 2**20:.1f} MiB")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
