"""The in-job microbenchmarks on this process's device, as a GPU job's first run would take them.

    PYTHONPATH=. python scripts/gpu_calibrate.py               # cuda under NCCL (one rank)
    PYTHONPATH=. python scripts/gpu_calibrate.py --device cpu  # the same path on gloo (tests)

Times square matmuls (fp32, bf16) and a device-memory copy on the device, synchronising around
every sample (``partitioner.calibration.measure.device_synchronizer``), fits the efficiency
curve against the datasheet peak of the detected GPU (the measured best on CPU), and times the
collectives over the job's group (one rank here: the calls run, nothing is fitted). Prints one
line per result and the seconds it took; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", default="256,1024,4096", help="square matmul sizes n (comma-separated)")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    import torch
    import torch.distributed as dist

    from partitioner.calibration.measure import (QUICK, fit_efficiency, measure_matmul, measure_memcpy,
                                                 time_collectives)
    from runtime.dist.mesh import init_distributed

    init_distributed(backend="nccl" if args.device == "cuda" else "gloo", timeout_s=60)
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    peaks = None
    if args.device == "cuda":
        from partitioner.calibration.detect import GpuProperties, match_gpu

        props = GpuProperties.from_torch(torch.cuda.current_device())
        peaks = match_gpu(props).peak_flops
        print(f"gpu: {props.summary()}")
    sizes = tuple(int(n) for n in args.sizes.split(","))
    samples = measure_matmul(("fp32", "bf16"), sizes, effort=QUICK, device=device)
    for dtype in ("fp32", "bf16"):
        mine = [(s.flops, s.seconds) for s in samples if s.dtype == dtype]
        fit = fit_efficiency(mine, peaks.for_dtype(dtype) if peaks is not None else None)
        best = max(f / t for f, t in mine)
        print(f"matmul {dtype}: best {best / 1e12:.3g} TFLOP/s; peak {fit.peak_flops_per_s / 1e12:.3g} TFLOP/s, "
              f"peak_efficiency {fit.curve.peak_efficiency:.3g}, half_saturation_s {fit.curve.half_saturation_s:.3g}")
    copy = measure_memcpy(256 * 2**20 if args.device == "cuda" else 8 * 2**20, effort=QUICK, device=device)
    print(f"memcpy: {copy.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s read+write")
    timed = time_collectives((4096, 2**20), 3, device=device)
    print("collectives on " + f"{dist.get_world_size()} rank(s): "
          + ", ".join(f"{op} {t[-1][1] * 1e6:.0f} us" for op, t in timed.items() if t))
    if args.device == "cuda":  # what the planner holds back (partitioner.cost.device_memory), measured
        from partitioner.cost.device_memory import GPU_COMMUNICATOR_BYTES, GPU_RESERVED_BYTES

        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = total - free - torch.cuda.memory_reserved()
        print(f"device memory outside the allocator after matmuls and collectives on {dist.get_world_size()} "
              f"rank(s) (one rank: NCCL connects no peer, so this is the process's own): "
              f"{outside / 2**20:.0f} MiB (the planner holds back {GPU_RESERVED_BYTES / 2**20:.0f} MiB for the "
              f"process and {GPU_COMMUNICATOR_BYTES / 2**20:.0f} MiB per communicator)")
    print(f"gpu_calibrate: done in {time.perf_counter() - start:.1f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
