"""Time the planner on GPT-3 175B (192 DGX A100 80GB nodes) and a 1T GPT (384 nodes), and a job's
planning of a captured Hugging Face model (SmolLM-135M's shape, 30 layers) on 4 CPU ranks.

Targets: under 10 s and under 30 s of search (profiling, which captures a 2-block model on the
meta device and replicates it, is timed separately); under 10 s for the captured model's
planning as ``auto_parallelize`` runs it (``profile_graph`` of the whole analysed capture, then
``choose_plan`` with the graph: the search and the exact memory replay of the plan it keeps;
capture and analysis are timed separately). Prints the chosen plans.

Run: python bench/planner_speed.py
"""
import dataclasses
import time

from partitioner.cost.cluster import Cluster
from partitioner.search.profile import profile_model
from partitioner.search.search import candidates, search

CAPTURED = (
    # SmolLM-135M's published shape (random init): what took minutes when the profile priced
    # checkpointing="tensor" with a MILP over the whole graph unasked
    ("SmolLM-135M shape", "hf-llama:num_hidden_layers=30,hidden_size=576,intermediate_size=1536,num_attention_heads=9,"
     "num_key_value_heads=3,vocab_size=49152,max_position_embeddings=2048,tie_word_embeddings=True,seq=256",
     4, 8, 10.0),
    ("GPT-2 small shape", "hf-gpt2:n_layer=12,n_embd=768,n_head=12,vocab_size=50257,n_positions=1024,seq=256",
     4, 8, 10.0),
)
"""(label, spec, CPU ranks, global batch, target seconds of planning) of the captured cases."""

CASES = (
    ("GPT-3 175B", "gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048", 192, 1536, 10.0),
    ("GPT 1T", "gpt:layers=128,hidden=25600,heads=160,vocab=51200,seq=2048", 384, 1536, 30.0),
)


def main() -> None:
    for label, spec, nodes, batch, target in CASES:
        cluster = Cluster.preset("dgx-a100-80gb", nodes=nodes)
        t0 = time.perf_counter()
        profile = profile_model(spec, dtype="bf16")
        t1 = time.perf_counter()
        chosen = search(profile, cluster, global_batch=batch)
        t2 = time.perf_counter()
        n = len(candidates(profile, cluster, batch))
        print(f"{label}: {spec} on dgx-a100-80gb x {nodes} ({cluster.world_size} GPUs), global batch {batch}, bf16")
        print(f"  params {profile.param_count / 1e9:.1f} B; profile {t1 - t0:.2f} s; search {t2 - t1:.2f} s over "
              f"{n} candidates (target < {target:.0f} s: {'ok' if t2 - t1 < target else 'MISSED'})")
        print(f"  chosen: {chosen.summary()}")
        terms = ", ".join(f"{k} {v:.3f}" for k, v in chosen.predicted.terms.items())
        print(f"  terms (s): {terms}")
        for s in chosen.stages[:1] + chosen.stages[-1:]:
            mem = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in s.memory.items())
            print(f"  stage {s.index}: layers {s.layer_names}, {s.time_s * 1e3:.1f} ms/micro-batch, GiB: {mem}")
        for a in chosen.alternatives:
            k = a.knobs
            print(f"  alt: dp={k['dp']} tp={k['tp']} pp={k['pp']} v={k['virtual_pp']} mbs={k['micro_batch_size']} "
                  f"{k['schedule']} zero={k['zero_stage']} sp={k['sequence_parallel']} ckpt={k['checkpointing']} "
                  f"offload={k['offload']}: {a.reason}")
        if label.startswith("GPT-3"):
            # Narayanan et al. 2021 ran 175B on 1536 A100s with tp=8, pp=12, full recompute at about
            # 140 TFLOP/s per GPU counting the recompute forward (4/3 of the model FLOPs).
            pinned = search(profile, cluster, global_batch=batch,
                          fix={"tp": 8, "pp": 12, "micro_batch_size": 1, "checkpointing": "full"})
            print(f"  pinned tp=8 pp=12 full recompute: {pinned.summary()}; with recompute FLOPs "
                  f"{pinned.predicted.tflops_per_device * 4 / 3:.1f} TFLOP/s/device (published: about 140)")


def captured() -> None:
    """Plan each :data:`CAPTURED` model as a job does, on the ``local-cpu`` preset (no calibration)."""
    from partitioner.api.auto import choose_plan
    from partitioner.compile.build import run_analysis_passes, capture_training_step
    from partitioner.inputs.models import build_model
    from partitioner.search.profile import profile_graph

    import torch

    torch.set_num_threads(1)  # as a job's rank plans: torchrun sets OMP_NUM_THREADS=1
    for label, spec_text, ranks, batch, target in CAPTURED:
        cluster = dataclasses.replace(Cluster.preset("local-cpu"), nodes=1, devices_per_node=ranks)
        t0 = time.perf_counter()
        spec = build_model(spec_text)
        graph = run_analysis_passes(capture_training_step(spec, device="cpu"), memory_batch=1)
        t1 = time.perf_counter()
        profile = profile_graph(graph, dtype="fp32", name=spec.name, dag=False)  # as a job profiles
        t2 = time.perf_counter()
        chosen = choose_plan(spec, cluster, world_size=ranks, global_batch=batch, profile=profile, graph=graph)
        t3 = time.perf_counter()
        print(f"{label}: {spec_text} on {ranks} local-cpu ranks, global batch {batch}, fp32")
        print(f"  capture + analysis {t1 - t0:.1f} s; planning {t3 - t1:.2f} s (profile {t2 - t1:.2f} s, search and "
              f"replay {t3 - t2:.2f} s; target < {target:.0f} s: {'ok' if t3 - t1 < target else 'MISSED'})")
        print(f"  chosen: {chosen.summary()}")


if __name__ == "__main__":
    main()
    captured()
