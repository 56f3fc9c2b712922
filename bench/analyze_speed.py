"""Time `partitioner analyze` on the GPT-3 175B shape (target: under 20 s here), per phase.

Run: python bench/analyze_speed.py
"""
import time

from partitioner.inputs.models import build_model
from passes.capture.capture import capture_spec
from passes.lowering.manager import PassContext
from passes.lowering.pipelines import analysis_passes, manager as pass_manager

SPEC = "gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"


def main() -> None:
    t0 = time.perf_counter()
    spec = build_model(SPEC, device="meta")
    t1 = time.perf_counter()
    gm = capture_spec(spec, dims={"batch": 1})
    t2 = time.perf_counter()
    manager = pass_manager(analysis_passes())
    manager.run(gm, PassContext())
    t3 = time.perf_counter()
    print(f"{SPEC}  batch=1  nodes={len(gm.graph.nodes)}")
    print(f"build {t1 - t0:6.2f} s   capture {t2 - t1:6.2f} s   passes {t3 - t2:6.2f} s   total {t3 - t0:6.2f} s"
          f"   (target < 20 s)")
    for record in getattr(manager, "records", []):
        print(f"  {record}")


if __name__ == "__main__":
    main()
