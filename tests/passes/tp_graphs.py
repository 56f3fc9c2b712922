"""Tiny models captured with symbolic dims and tagged for tp=2, shared by the tp and sp tests."""
import torch

from partitioner.inputs.models import build_model
from passes.capture.capture import capture_spec
from passes.policies.tensor_parallel_patterns import tag_tensor_parallel


def tagged_tp2(specs: dict[str, str]) -> dict[str, tuple]:
    """spec key -> (tagged tp=2 graph on cpu with real weights, example inputs)."""
    out = {}
    for key, spec_str in specs.items():
        torch.manual_seed(0)
        spec = build_model(spec_str, device="cpu")
        gm = capture_spec(spec, symbolic=("batch", "seq"))
        out[key] = (tag_tensor_parallel(gm, degree=2), spec.example_inputs(seed=1))
    return out


def run_simulated_step(ranks, inputs, timeout_s: float = 60.0) -> list[tuple]:
    """One forward + backward of every tp rank program in lockstep threads (simulated groups):
    per rank (loss, {parameter name: gradient})."""
    import runtime.kernels.collectives as tpc

    def step(m):
        def run():
            loss = m(*inputs)
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in m.named_parameters(remove_duplicate=False)}
        return run

    return tpc.run_simulated([step(m) for m in ranks], timeout_s=timeout_s)
