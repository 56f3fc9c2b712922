"""Plan a Mixtral-8x7B shape with expert parallelism on DGX-H100 nodes, bf16: the search's choice,
the published Megatron-Core layout (tp=1, pp=4, ep=8 on 64 GPUs) pinned, and the best plan with
ep pinned to 1, against Megatron-Core's published 468 TFLOP/s per H100 for Mixtral 8x7B bf16
(the Megatron Core MoE guide, MCore v0.9: docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html).

The model is the zoo ``moe`` decoder at Mixtral's published sizes (32 layers, hidden 4096, 32
heads, 8 SwiGLU experts of hidden 14336, top-2, vocabulary 32000, sequence 4096); unlike Mixtral
its attention has 32 key/value heads, not 8 (the zoo decoder has no grouped-query attention:
0.4 B more attention parameters of 46.7 B). Profiled on the meta device from two captured
blocks. Its experts are captured in the dense form (each expert on every token, the unchosen
weighted 0), which is what the runtime runs today: the step time is priced at those FLOPs (4x
the routed experts' at top-2 of 8), while TFLOP/s and MFU count the model's routed FLOPs, as
published figures do. The gap to the published figure is therefore mostly the dense form's.

Run: python bench/moe_plan.py [--global-batch 256] [--nodes 8]
"""
import argparse
import time

from partitioner.cost.cluster import Cluster
from partitioner.errors import InfeasiblePlanError
from partitioner.search.profile import profile_model
from partitioner.search.search import candidates, search
from plan_lines import show  # bench/ is the script's directory

SPEC = ("moe:layers=32,hidden=4096,heads=32,vocab=32000,seq=4096,experts=8,top_k=2,expert_hidden=14336,"
        "shared_experts=0,aux_loss=0.02,dropout=0.0")
PUBLISHED_TFLOPS = 468.0  # per H100, Mixtral 8x7B bf16, Megatron-Core v0.9


def against_published(p) -> str:
    return (f"  {p.predicted.tflops_per_device:.0f} TFLOP/s per GPU: "
            f"{p.predicted.tflops_per_device / PUBLISHED_TFLOPS - 1:+.0%} against the published {PUBLISHED_TFLOPS:.0f}")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--global-batch", type=int, default=256, help="sequences per step (default 256: 1M tokens)")
    args.add_argument("--nodes", type=int, default=8)
    a = args.parse_args()
    cluster = Cluster.preset("dgx-h100", nodes=a.nodes)
    t0 = time.perf_counter()
    profile = profile_model(SPEC, dtype="bf16")
    experts = sum(b.expert_param_count for b in profile.blocks)
    print(f"{SPEC}\non dgx-h100 x {a.nodes} ({cluster.world_size} GPUs, {cluster.device.memory_bytes / 2**30:.0f} GiB "
          f"each), global batch {a.global_batch} sequences, bf16")
    print(f"params {profile.param_count / 1e9:.2f} B, of which routed experts {experts / 1e9:.2f} B; "
          f"profiled in {time.perf_counter() - t0:.1f} s")
    plans = [("chosen", {}), ("published layout tp=1 pp=4 ep=8", {"tp": 1, "pp": 4, "ep": 8}), ("best with ep=1", {"ep": 1})]
    for label, fix in plans:
        t = time.perf_counter()
        try:
            p = search(profile, cluster, global_batch=a.global_batch, fix=fix or None)
        except InfeasiblePlanError as e:
            print(f"\n{label}: nothing fits ({str(e).splitlines()[0][:200]})")
            continue
        n = len(candidates(profile, cluster, a.global_batch, fix=fix or None))
        print(f"\n({n} candidates searched in {time.perf_counter() - t:.1f} s)")
        show(label, p)
        print(against_published(p))


if __name__ == "__main__":
    main()
