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

from partitioner.calibration.cache import CACHE_DIR_ENV

from partitioner.cost.cluster import CLUSTER_FILE_ENV, PRESET_DIR
from runtime.dist.launch import preload

# What the suite's ranks import: loaded once by the fork server that starts them, not by each.
preload("partitioner.api.auto", "partitioner.compile.build", "partitioner.calibration.reference_runs", "partitioner.cli.demo", "passes.lowering.lower",
        "ir_dumps.report", "tests.one_device", "tests.runtime_cases")

_CACHE = tempfile.mkdtemp(prefix="partitioner-test-cache-")


def pytest_configure(config):
    os.environ[CACHE_DIR_ENV] = _CACHE
    os.environ.setdefault(CLUSTER_FILE_ENV, str(PRESET_DIR / "local-cpu.yaml"))


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
