"""IR dumps: what the graph looks like after every pass, in forms people and tools can read.

* :mod:`ir_dumps.text` — one line of code per node with its annotations (``NN_<pass>.txt``);
* :mod:`ir_dumps.json_dump` — the ``partitioner-ir/1`` JSON schema (``NN_<pass>.json``);
* :mod:`ir_dumps.dot` — Graphviz text clustered by top-level module (``NN_<pass>.dot``);
* :mod:`ir_dumps.writer` — writes the three per pass plus ``manifest.json`` (used by
  :class:`passes.lowering.manager.PassManager` when given a dump directory);
* :mod:`ir_dumps.reader` / :mod:`ir_dumps.diff` / :mod:`ir_dumps.cli` — read dumps back, compare
  them, and the ``ir-dumps`` command (``python -m ir_dumps show|diff``);
* :mod:`ir_dumps.golden` — the golden dumps checked by ``tests/test_golden_dumps.py``.
"""
