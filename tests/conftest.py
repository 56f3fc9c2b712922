"""Session set-up: the suite never calibrates this machine by itself, nor touches the user's cache.

``local_cluster`` calibrates and caches this machine on first use; here every test (and every rank
process it spawns, which inherits the environment) sees the ``local-cpu`` preset through
``$PARTITIONER_CLUSTER_FILE`` (the numbers the tests were written against, the same on every
machine) and a cache directory of its own. Tests of the calibration cache unset the file and point
the cache at their ``tmp_path``. Ranks start from a fork server that has imported what they need.
"""
import gc
import os
import shutil
import tempfile

import torch

try:  # pytest >= 8.4: how many collections its unraisable-exception check runs when a worker ends
    from _pytest.unraisableexception import gc_collect_iterations_key
except ImportError:
    gc_collect_iterations_key = None

from partitioner.calibration.cache import CACHE_DIR_ENV

from partitioner.cost.cluster import CLUSTER_FILE_ENV, PRESET_DIR
from passes.ir.heap import collect_young_less_often
from runtime.dist.launch import preload

# What the suite's ranks import: loaded once by the fork server that starts them, not by each.
preload("partitioner.api.auto", "partitioner.compile.build", "partitioner.calibration.reference_runs", "partitioner.cli.demo",
        "passes.lowering.lower", "passes.capture.preload", "ir_dumps.report", "tests.one_device", "tests.runtime_cases",
        "tests.rank_preload")

_CACHE = tempfile.mkdtemp(prefix="partitioner-test-cache-")


def pytest_configure(config):
    os.environ[CACHE_DIR_ENV] = _CACHE
    # a worker captures and lowers as the command line and the ranks do: collected as they are
    collect_young_less_often()
    # Two workers share the cores: each computes on one thread, as each rank does (torchrun's
    # OMP_NUM_THREADS=1); the processes the tests start inherit it. Two threads per worker made
    # 8% more CPU work for the same tests (OpenMP threads waiting on a core the other holds).
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.environ.setdefault(CLUSTER_FILE_ENV, str(PRESET_DIR / "local-cpu.yaml"))
    # pytest's unraisable-exception check collects garbage 5 times when a worker ends, seconds
    # each over the graphs a worker leaves; one collection still finds what it reports
    if gc_collect_iterations_key is not None:
        config.stash[gc_collect_iterations_key] = 1


def pytest_collection_finish(session):
    # what the tests import stays loaded to the end (torch's compiler stack too, which the first
    # capture would load): out of every collection from here on
    import passes.capture.preload  # noqa: F401

    gc.freeze()


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)


# The longest files first (seconds of their tests on two workers, summed from --durations=0 of a
# whole run): pytest-xdist hands whole files (--dist loadfile) to whichever worker is free, in
# this order (--no-loadscope-reorder in pyproject.toml; xdist would sort them by test count), so
# a long file collected last does not run alone at the end while the other worker idles. Only the
# order changes; every other file keeps its place after these.
LONGEST_FIRST = (
    "test_expert_parallel_parity.py",     # 90 s: one spawn of 8 ranks
    "test_dry_run.py",                    # 81
    "test_first_run.py",                  # 75: torchrun and fresh calibrations
    "test_compiled_parity.py",            # 71: inductor compiles of five plans' programs
    "test_search.py",                     # 61
    "test_context_parallel_parity.py",    # 57: one spawn of 8 ranks
    "test_zero3.py",                      # 47: spawns of 4 and 8 ranks
    "test_train_resume.py",               # 39
    "test_faults.py",                     # 39: 4 train processes, waits of the timeout
    "test_runtime_property.py",           # 32: one spawn of 8 ranks
    "test_dumped_is_what_runs.py",        # 32
    "test_readme.py",                     # 32
    "test_fault_naming.py",               # 28
    "test_search_memory.py",              # 26: per-tensor remat MILPs
    "test_onnx_export.py",                # 22
    "test_valid_inputs.py",               # 19
    "test_data.py",                       # 19: two 2-rank command-line trainings
    "test_mixed_precision.py",            # 19
    "test_checkpoint_dag_memory.py",      # 17
    "test_zero_bubble.py",                # 17
    "test_two_node.py",                   # 17
    "test_runtime_tp_parity.py",          # 16
    "test_plan_dumps.py",                 # 16
    "test_analyze_cli.py",                # 15
    "test_capture.py",                    # 15
    "test_step_collectives.py",           # 14
    "test_zero3_memory.py",               # 13
    "test_context_parallel_memory.py",    # 12
    "test_tensor_remat_runtime.py",       # 12
    "test_bad_models.py",                 # 12
    "test_runtime_dp_features.py",        # 11
    "test_auto_parallelize.py",           # 11
    "test_bad_input.py",                  # 10
    "test_sequence_parallel.py",          # 10
    "test_tensor_remat.py",               # 10
    "test_bench_plan_quality.py",         # 10
    "test_communication_check.py",        # 10
    "test_shared_programs.py",            # 9
    "test_checkpoint_io.py",              # 9
    "test_search_lowers_property.py",     # 8
    "test_annotate_flops.py",             # 8
    "test_graph_transfer.py",             # 8
    "test_runtime_parity.py",             # 8
    "test_tensor_parallel.py",            # 8
    "test_bench_smoke.py",                # 8
    "test_remat_solver.py",               # 8
)


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests stay together
