"""Plan a Llama-3-8B shape at a 131072-token sequence on 4 DGX-H100 nodes (32 GPUs), bf16: the
search's choice, which cuts the sequence over cp ranks, against the best plan with cp pinned to 1.

The model is profiled on the meta device from two captured blocks (no weights allocated), so this
runs on a CPU in seconds. Prints each plan's knobs, predicted step time, peak memory per device
(by stage memory term) and step-time terms; the chosen plan must have cp > 1 and fit the device,
and the cp=1 plan must not fit or be slower (a line says whether both held). Also prints the best
ring-attention plans at the chosen cp, a node's and all GPUs' cp: the ring kernel computes in
fp32 (``partitioner.search.plan_cost.RING_COMPUTE_DTYPE``) and holds fp32 score blocks of S/(2cp)
queries by S/(2cp) keys, so it loses to Ulysses wherever the heads let Ulysses run.

Run: python bench/long_context_plan.py [--global-batch 8] [--nodes 4]
"""
import argparse
import time

from partitioner.cost.cluster import Cluster
from partitioner.errors import InfeasiblePlanError
from partitioner.search.profile import profile_model
from partitioner.search.search import candidates, search
from plan_lines import show  # bench/ is the script's directory

SPEC = ("llama:layers=32,hidden=4096,heads=32,kv_heads=8,vocab=128256,seq=131072,intermediate=14336,"
        "theta=500000")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8: 1M tokens)")
    args.add_argument("--nodes", type=int, default=4)
    a = args.parse_args()
    cluster = Cluster.preset("dgx-h100", nodes=a.nodes)
    t0 = time.perf_counter()
    profile = profile_model(SPEC, dtype="bf16")
    t1 = time.perf_counter()
    print(f"{SPEC}\non dgx-h100 x {a.nodes} ({cluster.world_size} GPUs, "
          f"{cluster.device.memory_bytes / 2**30:.0f} GiB each), global batch {a.global_batch} sequences, bf16")
    print(f"params {profile.param_count / 1e9:.2f} B; attention {profile.attention}; profiled in {t1 - t0:.1f} s")

    t = time.perf_counter()
    chosen = search(profile, cluster, global_batch=a.global_batch)
    n = len(candidates(profile, cluster, a.global_batch))
    print(f"\nsearch over {n} candidates in {time.perf_counter() - t:.1f} s")
    show("chosen", chosen)

    t = time.perf_counter()
    try:
        no_cp = search(profile, cluster, global_batch=a.global_batch, fix={"cp": 1})
        print(f"\n(cp=1 searched in {time.perf_counter() - t:.1f} s)")
        show("best with cp=1", no_cp)
        slower = no_cp.predicted.step_time_s / chosen.predicted.step_time_s - 1
        print(f"  cp=1 is {slower:+.1%} against the chosen plan")
        beaten = slower > 0
    except InfeasiblePlanError as exc:
        print(f"\nbest with cp=1: none fits: {exc}")
        beaten = True

    for cp in sorted({chosen.config.cp, cluster.devices_per_node, cluster.world_size}):
        if cp == 1 or profile.seq % (2 * cp):
            continue
        try:
            ring = search(profile, cluster, global_batch=a.global_batch, fix={"cp": cp, "cp_mode": "ring"})
            print()
            show(f"best with cp={cp} cp_mode=ring", ring)
        except InfeasiblePlanError as exc:
            print(f"\nbest with cp={cp} cp_mode=ring: none fits: {exc}")

    ok = chosen.config.cp > 1 and chosen.predicted.peak_memory_bytes <= cluster.device.memory_bytes and beaten
    print(f"\nchosen cp > 1, fits, and cp=1 does not fit or is slower: {'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
