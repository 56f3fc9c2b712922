"""How the planning benches print a plan: its knobs, predicted step, throughput, MFU and peak,
the step-time terms, and the memory terms of its fullest stage."""


def show(label: str, p) -> None:
    """Print plan ``p`` (a :class:`passes.ir.plan.Plan`) under ``label``."""
    pred = p.predicted
    print(f"{label}: {p.config.text()}")
    print(f"  step {pred.step_time_s:.2f} s, {pred.tflops_per_device:.0f} TFLOP/s/device, MFU {pred.mfu:.1%}, "
          f"peak {pred.peak_memory_bytes / 2**30:.1f} GiB per device, bubble {pred.bubble_fraction:.1%}")
    print("  terms (s): " + ", ".join(f"{k} {v:.3f}" for k, v in pred.terms.items() if v))
    worst = max(p.stages, key=lambda s: s.peak_memory_bytes)
    print(f"  stage {worst.index} memory (GiB): "
          + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in worst.memory.items()))
