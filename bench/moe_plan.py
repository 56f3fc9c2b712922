"""Plan a Mixtral-8x7B or DeepSeek-V3-like shape with expert parallelism on DGX-H100 nodes, bf16:
the search's choice, the published layout pinned, and the best plan with ep pinned to 1, against
the published throughput.

**Mixtral 8x7B** (``--model mixtral``, 8 nodes): Megatron-Core's published layout tp=1, pp=4,
ep=8 on 64 GPUs and 468 TFLOP/s per H100 for Mixtral 8x7B bf16 (the Megatron Core MoE guide,
MCore v0.9: docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html).

**DeepSeek-V3-like** (``--model deepseek-v3``, 256 nodes): the DeepSeek-V3 technical report
(arXiv:2412.19437, sections 3.1-3.3 and 4.2) trains on 2048 H800s with pp=16, ep=64 (across 8
nodes) and ZeRO-1 data parallelism, sequences of 4096 tokens, and states 180K H800 GPU hours
per trillion tokens: 1.0e12 / (180e3 * 3600) = 1543 tokens/s per GPU, in FP8 (an H800 has an
H100's compute; its NVLink is 400 GB/s, not 900). The zoo ``moe`` at its sizes: 61 layers,
hidden 7168, 128 heads, 256 routed experts of hidden 2048 with top-8 and one shared expert,
vocabulary 129280. Unlike DeepSeek-V3 it has plain multi-head attention (no latent compression),
every layer MoE (DeepSeek-V3's first three are dense) and softmax top-k routing without groups.

The model is the zoo ``moe`` decoder at Mixtral's published sizes (32 layers, hidden 4096, 32
heads, 8 SwiGLU experts of hidden 14336, top-2, vocabulary 32000, sequence 4096); unlike Mixtral
its attention has 32 key/value heads, not 8 (the zoo decoder has no grouped-query attention:
0.4 B more attention parameters of 46.7 B). Profiled on the meta device from two captured
blocks. Its experts are captured in the dense form (each expert on every token, the unchosen
weighted 0), which is what the runtime runs today: the step time is priced at those FLOPs (4x
the routed experts' at top-2 of 8), while TFLOP/s and MFU count the model's routed FLOPs, as
published figures do. The gap to the published figure is therefore mostly the dense form's.

Run: python bench/moe_plan.py [--model mixtral|deepseek-v3] [--global-batch N] [--nodes N]
"""
import argparse
import time

from partitioner.cost.cluster import Cluster
from partitioner.errors import InfeasiblePlanError
from partitioner.search.profile import profile_model
from partitioner.search.search import candidates, search
from plan_lines import show  # bench/ is the script's directory

MODELS = {
    "mixtral": dict(
        spec=("moe:layers=32,hidden=4096,heads=32,vocab=32000,seq=4096,experts=8,top_k=2,expert_hidden=14336,"
              "shared_experts=0,aux_loss=0.02,dropout=0.0"),
        nodes=8, global_batch=256, published={"tp": 1, "pp": 4, "ep": 8},
        figure="tflops", value=468.0),  # TFLOP/s per H100, Mixtral 8x7B bf16, Megatron-Core v0.9
    "deepseek-v3": dict(
        spec=("moe:layers=61,hidden=7168,heads=128,vocab=129280,seq=4096,experts=256,top_k=8,expert_hidden=2048,"
              "shared_experts=1,aux_loss=0.0001,dropout=0.0"),
        nodes=256, global_batch=15360, published={"tp": 1, "pp": 16, "ep": 64, "zero_stage": 1},
        figure="tokens", value=1.0e12 / (180e3 * 3600)),  # tokens/s per H800, DeepSeek-V3 report
}


def against_published(p, model: dict, global_batch: int, seq: int, world: int) -> str:
    if model["figure"] == "tflops":
        got = p.predicted.tflops_per_device
        return f"  {got:.0f} TFLOP/s per GPU: {got / model['value'] - 1:+.0%} against the published {model['value']:.0f}"
    got = global_batch * seq / p.predicted.step_time_s / world
    return f"  {got:.0f} tokens/s per GPU: {got / model['value'] - 1:+.0%} against the published {model['value']:.0f}"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--model", choices=sorted(MODELS), default="mixtral")
    args.add_argument("--global-batch", type=int, default=None,
                      help="sequences per step (default: mixtral 256, 1M tokens; deepseek-v3 15360, 63M tokens, the report's batch after its ramp)")
    args.add_argument("--nodes", type=int, default=None, help="DGX-H100 nodes (default: mixtral 8, deepseek-v3 256)")
    a = args.parse_args()
    model = MODELS[a.model]
    spec, nodes = model["spec"], a.nodes or model["nodes"]
    global_batch = a.global_batch or model["global_batch"]
    cluster = Cluster.preset("dgx-h100", nodes=nodes)
    t0 = time.perf_counter()
    profile = profile_model(spec, dtype="bf16")
    experts = sum(b.expert_param_count for b in profile.blocks)
    print(f"{spec}\non dgx-h100 x {nodes} ({cluster.world_size} GPUs, {cluster.device.memory_bytes / 2**30:.0f} GiB "
          f"each), global batch {global_batch} sequences, bf16")
    print(f"params {profile.param_count / 1e9:.2f} B, of which routed experts {experts / 1e9:.2f} B; "
          f"profiled in {time.perf_counter() - t0:.1f} s")
    layout = " ".join(f"{k}={v}" for k, v in model["published"].items())
    plans = [("chosen", {}), (f"published layout {layout}", model["published"]), ("best with ep=1", {"ep": 1})]
    for label, fix in plans:
        t = time.perf_counter()
        try:
            p = search(profile, cluster, global_batch=global_batch, fix=fix or None)
        except InfeasiblePlanError as e:
            print(f"\n{label}: nothing fits ({str(e).splitlines()[0][:200]})")
            continue
        n = len(candidates(profile, cluster, global_batch, fix=fix or None))
        print(f"\n({n} candidates searched in {time.perf_counter() - t:.1f} s)")
        show(label, p)
        print(against_published(p, model, global_batch, profile.seq, cluster.world_size))


if __name__ == "__main__":
    main()
