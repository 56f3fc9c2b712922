"""The leaf every layer shares: what the compiler, the runtime and the dumps agree on.

* :mod:`passes.ir.meta` — the ``node.meta`` / ``gm.meta`` keys and the dataclasses under them;
* :mod:`passes.ir.config` — :class:`ParallelConfig`, every knob of a plan, and the choices;
* :mod:`passes.ir.plan` — :class:`Plan`, the config with what it should cost;
* :mod:`passes.ir.program` — the rank-program contract (:class:`RankProgram`, comms, shard specs);
* :mod:`passes.ir.ops`, :mod:`passes.ir.offload_ops` — our custom ops: schemas, fake kernels, autograd;
* :mod:`passes.ir.schedule` — pipeline schedules as data (actions, builders, validation);
* :mod:`passes.ir.graph_transfer` — an analysed graph as bytes, rebuilt on another rank;
* :mod:`passes.ir.cost` — the costs a policy pass asks of the cluster;
* :mod:`passes.ir.errors` — the error types;
* :mod:`passes.ir.launcher_env` — the launcher's variables, which no process we start inherits.

It imports nothing else of the project (``lint-imports`` checks it, tests/test_layers.py runs it).
"""

import warnings as _warnings

# torch's own pytree specs warn when they are copied or unpickled (the deprecation is of a
# class torch itself still creates, e.g. inside an exported graph's meta): nothing a user of
# ours can act on, and every copy of a captured graph would print it.
_warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                         category=FutureWarning)
