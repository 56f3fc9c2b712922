"""How much of each model's parameters Megatron-style tensor parallelism shards.

Prints, per model, the share of parameter bytes ``tag_tensor_parallel`` shards for a tp degree
and the largest parameters it leaves replicated, with the reason.

Run from the repository root: python scripts/tp_coverage.py [--tp 2] [MODEL_SPEC ...]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from partitioner.inputs.models import build_model
from passes.capture.capture import capture_spec
from passes.ir.meta import TENSOR_PARALLEL_PLAN
from passes.policies.tensor_parallel_patterns import sharded_param_bytes, tag_tensor_parallel

DEFAULT_MODELS = ("gpt", "llama", "bert", "hf-gpt2", "hf-llama", "hf-bert")


@dataclass(frozen=True)
class Coverage:
    """Parameter bytes of one model, sharded and in all, and the replicated ones with reasons."""

    model: str
    sharded_bytes: int
    total_bytes: int
    replicated: tuple[tuple[str, int, str], ...]  # (name, bytes, reason), largest first

    @property
    def share(self) -> float:
        return self.sharded_bytes / self.total_bytes if self.total_bytes else 0.0


def coverage(spec: str, degree: int = 2) -> Coverage:
    """Tag ``spec`` (a model spec string) for tp ``degree`` and measure its sharded bytes."""
    # On cpu: small default models, and HF Llama's rotary buffer does not run on fake meta tensors.
    gm = capture_spec(build_model(spec, device="cpu"), symbolic=("batch", "seq"))
    tag_tensor_parallel(gm, degree=degree)
    plan = gm.meta[TENSOR_PARALLEL_PLAN]
    sharded, total = sharded_param_bytes(gm)
    repl = sorted(((n, p.numel() * p.element_size(), plan.params[n].reason)
                   for n, p in gm.named_parameters() if plan.params[n].dim is None), key=lambda r: -r[1])
    return Coverage(spec, sharded, total, tuple(repl))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    ap.add_argument("--top", type=int, default=3, help="largest replicated parameters shown per model")
    ap.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    args = ap.parse_args(argv)
    print(f"{'model':<12} {'param bytes':>12} {'sharded':>12} {'share':>7}   largest replicated (reason)")
    for spec in args.models:
        c = coverage(spec, args.tp)
        print(f"{c.model:<12} {c.total_bytes:>12,} {c.sharded_bytes:>12,} {c.share:>7.1%}")
        for name, nbytes, reason in c.replicated[:args.top]:
            print(f"{'':<12} {'':>12} {nbytes:>12,} {'':>7}   {name} ({reason})")


if __name__ == "__main__":
    main()
