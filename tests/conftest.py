"""Session set-up: the suite never calibrates this machine by itself, nor touches the user's cache.

``local_cluster`` calibrates and caches this machine on first use; here every test (and every rank
process it spawns, which inherits the environment) sees the ``local-cpu`` preset through
``$PARTITIONER_CLUSTER_FILE`` (the numbers the tests were written against, the same on every
machine) and a cache directory of its own. Tests of the calibration cache unset the file and point
the cache at their ``tmp_path``. Ranks start from a fork server that has imported what they need.
"""
import os
import shutil
import tempfile

try:  # pytest >= 8.4: how many collections its unraisable-exception check runs when a worker ends
    from _pytest.unraisableexception import gc_collect_iterations_key
except ImportError:
    gc_collect_iterations_key = None

from partitioner.calibration.cache import CACHE_DIR_ENV

from partitioner.cost.cluster import CLUSTER_FILE_ENV, PRESET_DIR
from runtime.dist.launch import preload

# What the suite's ranks import: loaded once by the fork server that starts them, not by each.
preload("partitioner.api.auto", "partitioner.compile.build", "partitioner.calibration.reference_runs", "partitioner.cli.demo",
        "passes.lowering.lower", "passes.capture.preload", "ir_dumps.report", "tests.one_device", "tests.runtime_cases",
        "tests.rank_preload")

_CACHE = tempfile.mkdtemp(prefix="partitioner-test-cache-")


def pytest_configure(config):
    os.environ[CACHE_DIR_ENV] = _CACHE
    os.environ.setdefault(CLUSTER_FILE_ENV, str(PRESET_DIR / "local-cpu.yaml"))
    # pytest's unraisable-exception check collects garbage 5 times when a worker ends, seconds
    # each over the graphs a worker leaves; one collection still finds what it reports
    if gc_collect_iterations_key is not None:
        config.stash[gc_collect_iterations_key] = 1


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)


# The longest files first (wall seconds of their tests on two workers of a quiet machine, summed
# from --durations=0): pytest-xdist hands whole files (--dist loadfile) to whichever worker is free,
# so a long file collected last would run alone at the end while the other worker idles. Only the
# order changes; every other file keeps its place after these.
LONGEST_FIRST = (
    "test_zero3.py",                      # 78 s: spawns of 4 and 8 ranks
    "test_context_parallel_parity.py",    # 68: one spawn of 8 ranks
    "test_search_memory.py",              # 61: per-tensor remat MILPs
    "test_first_run.py",                  # 61: torchrun and fresh calibrations
    "test_search.py",                     # 59
    "test_onnx_export.py",                # 54
    "test_faults.py",                     # 49: 4 train processes, waits of the timeout
    "test_runtime_property.py",           # 46: one spawn of 8 ranks
    "test_train_resume.py",               # 40
    "test_dry_run.py",                    # 39
    "test_readme.py",                     # 36
    "test_dumped_is_what_runs.py",        # 35
    "test_data.py",                       # 33
    "test_fault_naming.py",               # 30
    "test_valid_inputs.py",               # 28
)


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests stay together
