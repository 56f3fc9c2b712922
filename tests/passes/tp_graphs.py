"""Tiny models captured with symbolic dims and tagged for tp=2, shared by the tp and sp tests."""
import torch

from partitioner.model_spec import build_model
from passes.capture import capture_spec
from passes.tensor_parallel_patterns import tag_tensor_parallel


def tagged_tp2(specs: dict[str, str]) -> dict[str, tuple]:
    """spec key -> (tagged tp=2 graph on cpu with real weights, example inputs)."""
    out = {}
    for key, spec_str in specs.items():
        torch.manual_seed(0)
        spec = build_model(spec_str, device="cpu")
        gm = capture_spec(spec, symbolic=("batch", "seq"))
        out[key] = (tag_tensor_parallel(gm, degree=2), spec.example_inputs(seed=1))
    return out
