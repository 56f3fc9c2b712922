"""Real kernels of the ``partitioner::*`` ops (their schemas, fake kernels and autograd are in
:mod:`passes.ir.ops` and :mod:`passes.ir.offload_ops`): importing this package registers them.

* :mod:`runtime.kernels.collectives` — the tp collectives and the tp group registry;
* :mod:`runtime.kernels.dropout` — dropout on a tp shard with one device's mask;
* :mod:`runtime.kernels.offload` — host copies of offloaded activations;
* :mod:`runtime.kernels.zero3` — ZeRO-3's parameter gathers, prefetch and gradient reduce-scatters;
* :mod:`runtime.kernels.expert_parallel` — the ep group's token gathers and the data axis' means.
"""
from runtime.kernels import collectives, dropout, offload  # noqa: F401  (registers the kernels)
from runtime.kernels import zero3  # noqa: F401
from runtime.kernels import context_parallel  # noqa: F401  (ring attention and Ulysses kernels)
from runtime.kernels import expert_parallel  # noqa: F401  (expert-parallel dispatch and combine)
